"""``Pipeline.from_exported(dir)``: the one object users hold (no torch).

chat messages (or image + prompt) -> :mod:`~qwen35_onnx.conversation` (template, images) ->
:class:`~qwen35_onnx.runtime.generation.Generation` (vision, prefill, decode steps) -> sampling,
stop criteria and streamed text here.

Example::

    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported("out/")
    stream = pipe.stream("photo.jpg", "Describe this image.", max_new_tokens=64)
    for piece in stream:
        print(piece, end="", flush=True)
    print(stream.result.finish_reason, stream.result.timings.decode_ms_per_token)

    reply = pipe.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "photo.jpg"}},
        {"type": "text", "text": "Describe this image."}]}], max_new_tokens=64)
    print(reply.reasoning_content, reply.content)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    reply = pipe.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
                      tool_choice="required")
    print(reply.finish_reason, reply.tool_calls[0].name, reply.tool_calls[0].arguments)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import numbers
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .contract import ContractError, ShapeContract, read_manifest
from .conversation.grammar import GrammarCompiler, TokenConstraint
from .conversation.images import load_image, to_rgb
from .conversation.messages import ChatInputError, ChatVideo, ImagePolicy, ImageTooLarge, normalize_messages
from .conversation.processor import ImageSizing, Preprocessor
from .conversation.reasoning import THINK_END, ReasoningBudget, ReasoningParser, prompt_opens_reasoning
from .conversation.tool_calls import ToolCallParser
from .conversation.tools import ReplyFormat, parse_reply_format
from .conversation.videos import VideoLimitError, VideoLimits, check_fps, read_video
from .group import GenerationGroup
from .image_grids import grid_tokens
from .runtime.backend import Backend, RuntimeOptions
from .runtime.generation import Generation
from .runtime.masks import CapacityExhausted
from .runtime.prompt import PreparedPrompt, prepare_ids
from .runtime.sampling import Sampler, SamplingConfig, StopStrings, sampling_defaults
from .runtime.select import open_backend
from .runtime.slots import SlotPool
from .runtime.snapshot_disk import DEFAULT_DISK_BYTES, DiskSnapshotCache
from .runtime.snapshots import SnapshotCache, image_digests
from .runtime.speculative import Speculation, check_draft_tokens
from .streams import (
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    ChatResult,
    ChatStream,
    GenerationResult,
    GenerationStream,
    TokenLoop,
)

log = logging.getLogger(__name__)

DEFAULT_STATE_CACHE_BYTES = 1 << 30
"""Default byte limit of a :meth:`Pipeline.state_cache` (1 GiB: at 0.8B about 23 snapshots of a
1,000-token conversation, 19 MB of conv and recurrent state plus 24.6 KB a token; a chat turn keeps
two or three)."""


def _at_once(streaming, name: str, doc: str, returns: str):
    """A method that runs the streaming method ``streaming`` to its end and returns the stream's
    ``result`` (of type ``returns``); it takes ``streaming``'s arguments (``inspect.signature``
    shows them)."""

    @functools.wraps(streaming)
    def at_once(self, *args, **kwargs):
        stream = getattr(self, streaming.__name__)(*args, **kwargs)
        for _ in stream:
            pass
        return stream.result

    at_once.__name__, at_once.__qualname__, at_once.__doc__ = name, f"Pipeline.{name}", doc
    at_once.__signature__ = inspect.signature(streaming).replace(return_annotation=returns)
    return at_once


class Pipeline:
    """An export ready to answer: its backend, its preprocessor, and the user API (prepare, stream,
    generate, chat); stage-level work goes through :meth:`generation`.

    Args:
        root: the export folder (``manifest.json``, ``vision/``, ``text/`` and
            the tokenizer/processor files).
        contract: the manifest's contract.
        backend: the runtime that loaded the graphs (ONNX Runtime or OpenVINO, see
            :mod:`qwen35_onnx.runtime.select`); everything else is shared.
        preprocessor: tokenizer, chat template and image processor.

    Attributes:
        sampling_defaults: the checkpoint's own sampling, from the export's
            ``generation_config.json`` (greedy when it has none or ``do_sample`` is false): what
            ``sampling=None`` means in every generation method, as in transformers' ``generate``.
        stop_token_ids: token ids that end a generation: the export's end-of-sequence ids, plus the
            tokenizer's ``eos_token`` (Qwen3.5: ``<|im_end|>``, the end of a turn) when the export
            has no ``generation_config.json`` to list them (as vLLM adds it).

    Threads: one generation at a time (the graphs' sessions and state buffers are shared);
    ``prepare``/``prepare_chat``/``prepare_ids`` run no graph and may be called from another
    thread while a generation streams (the tokenizer is used under ``preprocessor.lock``).
    """

    def __init__(
        self, root: Path, contract: ShapeContract, backend: Backend, preprocessor: Preprocessor, draft_tokens: int = 0
    ):
        """``draft_tokens``: speculative decoding's drafts a round for every generation (0: off; see
        :attr:`draft_tokens`).

        Raises:
            ValueError: the export's ``generation_config.json`` is not JSON or holds sampling values out of range
                (see :func:`~qwen35_onnx.runtime.sampling.sampling_defaults`); bad ``draft_tokens``.
            ContractError: ``draft_tokens`` above what the export verifies, or on an export without MTP graphs,
                with several decode slots, or on a device where speculative decoding does not run.
        """
        self.draft_tokens = self._check_drafts(contract, draft_tokens)
        if self.draft_tokens:
            backend.check_speculation()
        self.root = Path(root)
        self.contract = contract
        self.backend = backend
        self.preprocessor = preprocessor
        self.sampling_defaults = sampling_defaults(self.root)
        stops = tuple(contract.eos_token_ids)
        end_of_turn = preprocessor.tokenizer.eos_token_id
        if not (self.root / "generation_config.json").is_file() and end_of_turn is not None:
            stops += () if end_of_turn in stops else (int(end_of_turn),)
        self.stop_token_ids = stops
        self.grammars = GrammarCompiler(preprocessor.tokenizer, stops, preprocessor.lock)

    @classmethod
    def from_exported(
        cls, path: str | os.PathLike, options: RuntimeOptions | None = None, **overrides: Any
    ) -> Pipeline:
        """Load an export folder and cross-check manifest, graph metadata and graph shapes.

        Args:
            path: the export folder.
            options: how to run it (runtime, device, precision, threads, host-state roundtrip; see
                :class:`~qwen35_onnx.runtime.backend.RuntimeOptions`; default: ONNX Runtime on the CPU).
            overrides: fields of ``options`` by name, e.g. ``runtime="openvino"``.

        Raises:
            ContractError: incomplete export, graphs that disagree with the manifest or with
                each other (e.g. different capacities), or an export the runtime cannot run.
            ValueError: unknown runtime, device or precision; a ``generation_config.json`` that is
                not JSON or holds sampling values out of range.
            TypeError: ``path`` that is not a path; an override that is not a runtime option.
        """
        if options is not None and not isinstance(options, RuntimeOptions):
            raise TypeError(
                f"options must be a RuntimeOptions or None, got {type(options).__name__} (pass runtime "
                "options by name, e.g. device='cuda')"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be an export folder (str or os.PathLike), got {type(path).__name__}")
        options = dataclasses.replace(options or RuntimeOptions(), **overrides)
        options.validate()  # bad options fail before the export is read
        root = Path(path)
        contract = read_manifest(root)
        cls._check_drafts(contract, options.draft_tokens)  # before any graph loads
        backend = open_backend(root, contract, options)
        preprocessor = Preprocessor.from_pretrained(
            root, ImageSizing.of(contract), contract.image_token_id, contract.capacity
        )
        return cls(root, contract, backend, preprocessor, options.draft_tokens)

    @staticmethod
    def _check_drafts(contract: ShapeContract, draft_tokens) -> int:
        draft_tokens = check_draft_tokens(draft_tokens, contract.draft_tokens)
        if draft_tokens and contract.slots > 1:
            raise ContractError(
                f"draft tokens {draft_tokens}: speculative decoding runs one sequence at a time, and this export "
                f"decodes {contract.slots} slots together; use an export with --slots 1, or --draft-tokens 0"
            )
        return draft_tokens

    # ---- host-side preparation -----------------------------------------------------------
    def prepare(
        self,
        image,
        prompt: str,
        chat_template_kwargs: dict | None = None,
        max_image_tokens: int | None = None,
        video=None,
        fps: float | None = None,
        max_video_tokens: int | None = None,
    ) -> PreparedPrompt:
        """Chat-template and preprocess one user turn: ``image`` (a path, a PIL image, a list of
        them, or None for text only) first, then ``video`` (a path, the file's bytes, a list of them, or None),
        then ``prompt``; the one-turn case of :meth:`prepare_chat` (``chat_template_kwargs``: template variables,
        e.g. ``{"enable_thinking": False}``; ``max_image_tokens``: image-token limit per image, by
        default the export's budget; ``fps`` and ``max_video_tokens``: see :meth:`prepare_chat`).

        Raises:
            FileNotFoundError / ValueError: missing or unreadable image.
            ChatInputError: more images than the export's ``max_images``; an unreadable video.
            ValueError: the prompt does not fit the largest prefill bucket / the capacity.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt is not valid Unicode text: {exc}") from None
        content: list[dict] = []
        for picture in [] if image is None else image if isinstance(image, (list, tuple)) else [image]:
            if isinstance(picture, Image.Image):
                picture = to_rgb(picture)
            elif isinstance(picture, (str, os.PathLike)):
                picture = load_image(picture)
            else:
                raise TypeError(
                    f"image must be a file path, a PIL image, a list of them or None, got {type(picture).__name__}"
                )
            content.append({"type": "image", "image": picture})
        for clip in [] if video is None else video if isinstance(video, (list, tuple)) else [video]:
            if not isinstance(clip, (str, os.PathLike, bytes, bytearray)):
                raise TypeError(f"video must be a file path, bytes, a list of them or None, got {type(clip).__name__}")
            content.append({"type": "video", "video": clip})
        content.append({"type": "text", "text": prompt})
        return self.prepare_chat(
            [{"role": "user", "content": content}],
            chat_template_kwargs,
            max_image_tokens=max_image_tokens,
            fps=fps,
            max_video_tokens=max_video_tokens,
        )

    def reply_format(
        self, tools=None, tool_choice=None, parallel_tool_calls: bool | None = None, response_format=None
    ) -> ReplyFormat:
        """Check OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format``
        (see :mod:`qwen35_onnx.conversation.tools`) and compile the grammar that enforces them.

        Raises:
            ChatInputError: naming the field: a malformed tool, an unknown tool in ``tool_choice``,
                an invalid JSON schema, parameters that are not an object schema, a required or
                named call together with a ``response_format`` schema, or a schema the grammar
                engine cannot enforce.
        """
        reply = parse_reply_format(tools, tool_choice, parallel_tool_calls, response_format)
        self.grammars.check(reply)
        return reply

    def prepare_chat(
        self,
        messages: list[dict],
        chat_template_kwargs: dict | None = None,
        image_policy: ImagePolicy | None = None,
        reply: ReplyFormat | None = None,
        max_image_tokens: int | None = None,
        fps: float | None = None,
        max_video_tokens: int | None = None,
    ) -> PreparedPrompt:
        """Render OpenAI-style chat ``messages`` (roles system / user / assistant; content a string
        or text, image and video parts, see :mod:`qwen35_onnx.conversation.messages`) with the checkpoint's chat
        template, preprocess their images and videos (prompt order) and check the result against the contract.

        A video's frames are sampled at ``fps`` and sized within ``max_video_tokens`` as
        :class:`~qwen35_onnx.conversation.processor.VideoSizing` states; each frame pair then runs through the
        vision graph as an image of that grid (so the graphs see images only: the video pads are given as image
        pads, :meth:`~qwen35_onnx.conversation.processor.Preprocessor.vision_ids`).

        Args:
            messages: the conversation, ending with the turn to answer.
            chat_template_kwargs: template variables, e.g. ``{"enable_thinking": False}``.
            image_policy: where images may come from (default: data URLs and any local file).
            reply: tools to list in the prompt (:meth:`reply_format`; none by default).
            max_image_tokens: image-token limit per image (by default the export's budget, see
                :class:`~qwen35_onnx.conversation.processor.ImageSizing`); an image part's
                ``detail`` 'low' asks for the processor's grid at its ``min_pixels``.
            fps: frames sampled per second of each video (default: the checkpoint's video processor's, 2).
            max_video_tokens: video-token limit per video (default: the processor's own most or half the
                capacity, the smaller).

        Raises:
            ChatInputError: a malformed message, image or video (``param`` names the field), more
                images than the export's ``max_images``, a bad ``max_image_tokens``, ``fps`` or
                ``max_video_tokens``, an image the processor refuses (aspect ratio above 200), a video that
                cannot be read or sized (no video stream, a damaged file, too few frames, more frame pairs than
                the limit has tokens); :class:`~qwen35_onnx.conversation.messages.ImageTooLarge` for a video
                over the ``image_policy``'s duration or frame-size limit.
            ValueError: text that is not valid Unicode, a template that cannot render, or a
                prompt longer than the largest prefill bucket / the capacity.
        """
        template_messages, media = normalize_messages(messages, image_policy)
        c = self.contract
        images = [item for item in media if not isinstance(item, ChatVideo)]
        if len(images) > c.max_images:
            raise ChatInputError(
                f"the messages hold {len(images)} images, more than the {c.max_images} this export takes "
                f"(export with --max-images {len(images)} or more)",
                "messages",
            )
        for m in template_messages:
            texts = [m["content"]] if isinstance(m["content"], str) else [p.get("text", "") for p in m["content"]]
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"message text is not valid Unicode: {exc}") from None
        pieces, grids, tokens = [], [], []
        for name, check, value in (
            ("max_image_tokens", self.preprocessor.sizing.limit, max_image_tokens),
            ("fps", check_fps, fps),
            ("max_video_tokens", lambda v: self.preprocessor.video_sizing.limit(v), max_video_tokens),
        ):
            if value is None and name != "max_image_tokens":
                continue
            try:
                check(value)
            except ValueError as exc:
                raise ChatInputError(str(exc), name) from None
        used = 0  # vision tokens so far: a video is refused before it is decoded where its pairs cannot fit
        for item in media:
            if isinstance(item, ChatVideo):
                room = c.capacity - used
                values, video_grids, count = self._video_inputs(item, image_policy, fps, max_video_tokens, room)
                grids.extend(video_grids)
                used += count.total
            else:
                try:
                    values, grid = self.preprocessor.pixel_values(item.image, max_image_tokens, item.detail)
                except ValueError as exc:
                    raise ChatInputError(f"{item.param}: {exc}", item.param) from None
                grids.append(grid)
                count = grid_tokens(grid[1:], c.spatial_merge_size)
                used += count
            pieces.append(values)
            tokens.append(count)
        tools = [tool.template_form() for tool in reply.offered_tools] if reply is not None else None
        ids, text = self.preprocessor.encode_chat(template_messages, tokens, chat_template_kwargs, tools)
        vision_ids = self.preprocessor.vision_ids(ids)
        prepared = self.prepare_ids(vision_ids, np.concatenate(pieces) if pieces else None, grids)
        prepared.opens_reasoning = prompt_opens_reasoning(text)
        if c.prefill_chunks:  # where the next turn's state may continue from
            prepared.snapshot_points = self.preprocessor.history_boundaries(
                template_messages, tokens, ids, chat_template_kwargs, tools
            )
        return prepared

    def _video_inputs(self, video: ChatVideo, policy: ImagePolicy | None, fps, max_video_tokens, room: int):
        """A video part's patches ``[t*h*w, patch_dim]``, its ``t`` frame-pair grids ``(1, h, w)`` and its
        :class:`~qwen35_onnx.conversation.processor.VideoTokens` (:meth:`prepare_chat`). The grid is chosen from the
        stream's header before any frame is decoded, the video refused there when its frame pairs' tokens alone
        (pads and vision markers) exceed ``room``, and each frame is resized as it is decoded.

        Raises:
            ChatInputError / ImageTooLarge: naming the part (see :meth:`prepare_chat`).
        """
        policy = policy or ImagePolicy.trusted()
        limits = VideoLimits(policy.max_video_seconds, policy.max_video_frame_pixels, policy.max_video_frames)

        def size(num_frames: int, height: int, width: int) -> tuple[int, int]:
            grid = sizing.grid(num_frames, height, width, max_video_tokens)[0]
            pairs = -(-num_frames // sizing.settings.temporal_patch_size)
            tokens = pairs * (grid_tokens(grid, sizing.settings.merge_size) + 2)
            if tokens > room:
                raise ValueError(
                    f"the video's {pairs} frame pairs take at least {tokens} tokens (their pads and vision markers), "
                    f"more than the {room} the capacity leaves it ({self.contract.capacity}, --max-seq-len); sample "
                    "fewer frames per second (fps), allow fewer video tokens (max_video_tokens), or send a shorter clip"
                )
            return grid[0] * sizing.settings.patch_size, grid[1] * sizing.settings.patch_size

        try:
            sizing = self.preprocessor.video_sizing
            clip = read_video(video.source, sizing.settings, fps, limits, size)
            values, (t, h, w), count = self.preprocessor.video_pixel_values(clip, max_video_tokens)
        except VideoLimitError as exc:
            raise ImageTooLarge(f"{video.param}: {exc}", video.param) from None
        except (FileNotFoundError, ValueError) as exc:
            raise ChatInputError(f"{video.param}: {exc}", video.param) from None
        return values, [(1, h, w)] * t, count

    def prepare_ids(
        self, input_ids: np.ndarray, pixel_values: np.ndarray | None = None, image_grids=()
    ) -> PreparedPrompt:
        """Check already tokenized input (and each image's patch grid ``(h, w)``) against the contract
        and compute its positions (see :func:`~qwen35_onnx.runtime.prompt.prepare_ids`).

        Raises:
            ValueError: bad shape, token ids outside the vocabulary, image tokens that do not
                match the images, more images than ``max_images``, or a prompt longer than the
                largest bucket / capacity.
        """
        return prepare_ids(self.contract, input_ids, pixel_values, image_grids)

    def generation(
        self, prepared: PreparedPrompt, state_cache: SnapshotCache | None = None, pooled: bool = False
    ) -> Generation:
        """A :class:`~qwen35_onnx.runtime.generation.Generation` of ``prepared`` on this pipeline's
        backend, for stage-level use (prefill, then one decode step per token you feed); the
        generation methods below sample and stream on top of it. With ``state_cache`` (an export
        with prefill chunks) it continues from the cache's longest kept prefix of the prompt and
        snapshots the state where a later prompt is likely to repeat this one
        (``prepared.snapshot_points``: after the system prompt and the history; none when it continues
        from an earlier reply's state, since the template then repeats replies and the state after this
        reply serves the next turn). The generation holds a slot of :attr:`slot_pool` (until its
        ``close()``) on an export of several decode slots, or with ``pooled``.

        Raises:
            ValueError / ContractError: see :class:`~qwen35_onnx.runtime.generation.Generation`.
            NoFreeSlot: every decode slot is held (by generations not closed).
        """
        pool = self.slot_pool if pooled or self.contract.slots > 1 else None
        if state_cache is None or not self.contract.prefill_chunks:
            return Generation(self.backend, prepared, pool=pool)
        images = image_digests(prepared.pixel_values, prepared.image_grids)
        start = state_cache.longest_prefix(self.backend.export_id, prepared.input_ids[0], images)
        # Continuing from an earlier reply's state means the template repeats replies as generated: the
        # state after this reply will serve the next turn, so no chunk has to end at the history's end
        # for a snapshot there (each forced end can cost a run).
        points = () if start is not None and start.reply else prepared.snapshot_points
        return Generation(self.backend, prepared, start=start, snapshot_at=points, image_digests=images, pool=pool)

    @functools.cached_property
    def slot_pool(self) -> SlotPool:
        """The decode slots of this pipeline's export (:class:`~qwen35_onnx.runtime.slots.SlotPool`, made on first
        use): every generation of an export with several slots holds one of them, alone or in a :meth:`group`.

        Raises:
            ContractError: a dynamic-KV export, or a device the slots cannot run on (see the backend).
        """
        return SlotPool(self.backend)

    def group(self) -> GenerationGroup:
        """A :class:`~qwen35_onnx.group.GenerationGroup`: generations started with ``group=`` it decode together,
        one row each in the export's decode slots (``--slots``), newcomers joining between two decode steps.

        Raises:
            ContractError: see :attr:`slot_pool`.
        """
        return GenerationGroup(self)

    def state_cache(
        self,
        max_bytes: int = DEFAULT_STATE_CACHE_BYTES,
        directory: str | os.PathLike | None = None,
        max_disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> SnapshotCache:
        """A :class:`~qwen35_onnx.runtime.snapshots.SnapshotCache` of ``max_bytes`` for this export: pass
        it as ``state_cache`` to every turn of a conversation (or every request of a server) and each
        turn prefills only what no kept state holds. With ``directory``, a
        :class:`~qwen35_onnx.runtime.snapshot_disk.DiskSnapshotCache`: the snapshots are kept in that folder too (at
        most ``max_disk_bytes`` of files, least recently used removed first), so that a later process on the same
        folder (a restart, another session with the same system prompt and tools) continues from them; ``close()``
        it at the end (or use it as a context manager) to finish its writes.

        Raises:
            ContractError: the export has no prefill chunks (nothing can continue from a state).
            ValueError: ``max_bytes`` or ``max_disk_bytes`` below one snapshot of this export, naming both; a
                ``directory`` that is a file or cannot be made or written in, naming it.
        """
        if not self.contract.prefill_chunks:
            raise ContractError(
                f"the export at {str(self.root)!r} has no prefill chunks, so no turn can continue from a kept state; "
                "re-export with --prefill-chunks (e.g. 64,512)"
            )
        cache = SnapshotCache(max_bytes)
        cache.check_room(self.contract)
        if directory is None:
            return cache
        return DiskSnapshotCache(max_bytes, directory, self.backend.export_id, self.contract, max_disk_bytes)

    # ---- generation ----------------------------------------------------------------------
    def stream(
        self,
        image,
        prompt: str,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] | list[str] = (),
        chat_template_kwargs: dict | None = None,
        max_image_tokens: int | None = None,
        group: GenerationGroup | None = None,
        draft_tokens: int | None = None,
        video=None,
        fps: float | None = None,
        max_video_tokens: int | None = None,
    ) -> GenerationStream:
        """Start a generation for ``image`` (path, PIL image, a list of them, or None), ``video`` (path, bytes,
        a list of them, or None; ``fps`` and ``max_video_tokens``: see :meth:`prepare_chat`) and
        ``prompt``; iterate the returned stream for text pieces. ``sampling`` None: the
        checkpoint's :attr:`sampling_defaults`; ``SamplingConfig()`` is greedy; ``group``
        (:meth:`group`): decode together with the group's other generations; ``draft_tokens``: speculative
        decoding's drafts a round (None: :attr:`draft_tokens`, 0: off; see :meth:`stream_prepared`). All input
        checks run here, before any graph.

        Raises:
            ValueError / FileNotFoundError: bad ``max_new_tokens``, sampling options or stop
                strings, prompt over the largest bucket or capacity, unreadable image.
        """
        prepared = self.prepare(image, prompt, chat_template_kwargs, max_image_tokens, video, fps, max_video_tokens)
        return self.stream_prepared(prepared, max_new_tokens, sampling, stop, group=group, draft_tokens=draft_tokens)

    def stream_chat(
        self,
        messages: list[dict],
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] | list[str] = (),
        chat_template_kwargs: dict | None = None,
        image_policy: ImagePolicy | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict | None = None,
        max_image_tokens: int | None = None,
        state_cache: SnapshotCache | None = None,
        group: GenerationGroup | None = None,
        draft_tokens: int | None = None,
        fps: float | None = None,
        max_video_tokens: int | None = None,
        reasoning_budget: int | None = None,
    ) -> ChatStream:
        """Start a chat turn: OpenAI-style ``messages`` (see :meth:`prepare_chat`, also for ``fps`` and
        ``max_video_tokens``), answered by
        streaming :class:`ChatDelta` s; ``max_new_tokens`` None: until end of sequence or capacity.
        ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` as in OpenAI's
        API (see :meth:`reply_format`): calls come back parsed (``ChatDelta.tool_calls``,
        ``ChatResult.tool_calls``); a required or named call and a response schema are enforced by
        constrained decoding. ``state_cache`` (:meth:`state_cache`): continue from the longest kept
        state of the prompt's tokens and keep this turn's states there. ``group`` (:meth:`group`):
        decode together with the group's other generations. ``draft_tokens``: see :meth:`stream_prepared`;
        ``reasoning_budget``: see :meth:`stream_chat_prepared`. All input checks run here, before any graph.

        Raises:
            ChatInputError / ValueError: see :meth:`reply_format`, :meth:`prepare_chat` and :meth:`stream`.
        """
        reply = self.reply_format(tools, tool_choice, parallel_tool_calls, response_format)
        prepared = self.prepare_chat(
            messages, chat_template_kwargs, image_policy, reply, max_image_tokens, fps, max_video_tokens
        )
        return self.stream_chat_prepared(
            prepared, max_new_tokens, sampling, stop, reply, state_cache, group, draft_tokens, reasoning_budget
        )

    def stream_chat_prepared(
        self,
        prepared: PreparedPrompt,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        stop=(),
        reply: ReplyFormat | None = None,
        state_cache: SnapshotCache | None = None,
        group: GenerationGroup | None = None,
        draft_tokens: int | None = None,
        reasoning_budget: int | None = None,
    ) -> ChatStream:
        """:meth:`stream_chat` for input from :meth:`prepare_chat` (``reply``: the same
        :meth:`reply_format` the prompt was prepared with).

        With a constrained reply and a prompt that opens a reasoning block, the reasoning may use at
        most half of the new tokens (``</think>`` is forced then), so the answer always has room.
        ``reasoning_budget``: most reasoning tokens of a reply whose prompt opens the reasoning block
        (``</think>`` forced then; :class:`~qwen35_onnx.conversation.reasoning.ReasoningBudget`); None: no limit
        of its own.

        Raises:
            ValueError: a ``reasoning_budget`` that is not an integer >= 1.
        """
        reply = reply or ReplyFormat()
        constraint = None
        reasoning = prepared.opens_reasoning and self.has_think_markers
        if reply.constrained:
            limit = self.token_room(prepared) if max_new_tokens is None else max_new_tokens
            think_end = self.think_end_id if reasoning else None
            budget = max(int(limit) // 2, 1) if isinstance(limit, numbers.Integral) else None
            if reasoning_budget is not None:
                budget = reasoning_budget if budget is None else min(budget, reasoning_budget)
            constraint = self.grammars.constraint(reply, think_end, budget)
        elif reasoning_budget is not None and reasoning:
            constraint = ReasoningBudget(self.think_end_id, reasoning_budget)
        stream = self.stream_prepared(
            prepared, max_new_tokens, sampling, stop, constraint, state_cache, group, draft_tokens
        )
        calls = None
        if reply.parses_calls:
            calls = ToolCallParser(reply.offered_tools, None if reply.parallel_tool_calls else 1)
        return ChatStream(stream, ReasoningParser(prepared.opens_reasoning, enabled=self.has_think_markers), calls)

    def token_room(self, prepared: PreparedPrompt) -> int:
        """Most new tokens the capacity leaves for ``prepared``: ``capacity - prompt_len + 1`` (the
        last token needs no KV slot)."""
        return self.contract.capacity - prepared.prompt_len + 1

    @property
    def think_end_id(self) -> int:
        """Token id of ``</think>`` (see :attr:`has_think_markers`)."""
        with self.preprocessor.lock:
            return int(self.preprocessor.tokenizer.convert_tokens_to_ids(THINK_END))

    @property
    def has_think_markers(self) -> bool:
        """The tokenizer has a ``</think>`` token, so replies are split into reasoning and content."""
        if not hasattr(self, "_has_think_markers"):
            tokenizer = self.preprocessor.tokenizer
            with self.preprocessor.lock:
                self._has_think_markers = THINK_END in tokenizer.get_added_vocab() or THINK_END in tokenizer.get_vocab()
        return self._has_think_markers

    def stream_prepared(
        self,
        prepared: PreparedPrompt,
        max_new_tokens: int | None = 128,
        sampling: SamplingConfig | None = None,
        stop=(),
        constraint: TokenConstraint | None = None,
        state_cache: SnapshotCache | None = None,
        group: GenerationGroup | None = None,
        draft_tokens: int | None = None,
    ) -> GenerationStream:
        """:meth:`stream` for input from :meth:`prepare` or :meth:`prepare_ids`; ``max_new_tokens``
        None: until end of sequence or capacity; ``constraint``: the grammar every token must keep
        to (see :class:`~qwen35_onnx.conversation.grammar.TokenConstraint`; one per generation);
        ``state_cache``: see :meth:`generation` (the state at the history's end and at the end of
        the generation are kept there); ``group``: decode in that :meth:`group` together with its other
        generations (iterating any of its streams runs the group); ``draft_tokens``: speculative decoding's
        drafts a round (None: :attr:`draft_tokens`; 0: off; not with ``group``, whose generations speculate with
        :attr:`draft_tokens` on an export of one decode slot). A constrained reply decodes without speculation (a
        grammar decides one token at a time)."""
        if draft_tokens is not None and group is not None:
            raise ValueError(
                "draft_tokens applies to a generation alone: a group's generations speculate with the pipeline's "
                "draft_tokens (on an export of one decode slot)"
            )
        if draft_tokens is None:
            draft_tokens = self.draft_tokens
        else:
            draft_tokens = self._check_drafts(self.contract, draft_tokens)
            if draft_tokens:
                self.backend.check_speculation()
        if state_cache is not None and not isinstance(state_cache, SnapshotCache):
            raise TypeError(f"state_cache must be a SnapshotCache or None, got {type(state_cache).__name__}")
        if group is not None and (not isinstance(group, GenerationGroup) or group.pipeline is not self):
            raise TypeError("group must be a GenerationGroup of this pipeline (Pipeline.group()) or None")
        room = self.token_room(prepared)
        if max_new_tokens is None:
            max_new_tokens = room
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}")
        sampler = Sampler(sampling or self.sampling_defaults)
        stops = StopStrings((stop,) if isinstance(stop, str) else tuple(stop))
        if max_new_tokens > room:
            log.warning(
                "prompt (%d tokens) + max_new_tokens (%d) exceeds the capacity %d: at most %d new tokens "
                "will be generated (finish reason 'length')",
                prepared.prompt_len,
                max_new_tokens,
                self.contract.capacity,
                room,
            )
        stream = GenerationStream()
        loop = TokenLoop(
            prepared.prompt_len,
            max_new_tokens,
            sampler,
            stops,
            self.stop_token_ids,
            self.preprocessor.text_streamer(),
            stream,
            constraint,
        )
        if group is not None:
            group.add(prepared, loop, state_cache)
        else:
            drafts = 0 if constraint is not None else draft_tokens
            stream._pieces = self._generate(prepared, loop, state_cache, drafts)
        return stream

    def _generate(
        self, prepared: PreparedPrompt, loop: TokenLoop, state_cache: SnapshotCache | None, draft_tokens: int = 0
    ) -> Iterator[str]:
        """One generation alone: prefill, then one decode step per token, :class:`~.streams.TokenLoop` deciding; with
        ``draft_tokens``, speculative rounds (:mod:`~.runtime.speculative`) while one can run, each emitting the
        tokens the loop takes before a decode step would have."""
        stream, generation, rest = loop.stream, None, ""
        try:
            generation = self.generation(prepared, state_cache)
            speculation = Speculation(generation, draft_tokens) if draft_tokens and generation.chunked else None
            piece = loop.accept(generation.prefill())
            stream.result.timings, stream.result.cached_tokens = generation.timings, generation.cached_tokens
            while True:
                if piece:
                    yield piece
                if loop.done or stream.cancelled:
                    break
                if speculation is not None and speculation.measuring:  # a plain step, timed: what rounds must beat
                    piece = loop.accept(speculation.plain_step(loop.token))
                    continue
                if speculation is not None and speculation.drafts_for() and speculation.worth_it():
                    piece = loop.speculate(speculation)
                    continue
                try:
                    logits = generation.step(loop.token)
                except CapacityExhausted:
                    loop.out_of_room()
                    break
                if speculation is not None:
                    speculation.stop()  # the decoder holds the states now
                piece = loop.accept(logits)
            rest = loop.flush()
            self.keep_states(generation, state_cache, speculation)
        finally:
            loop.finalize(generation)
        if rest:  # the held-back tail, yielded once the result is final
            yield rest

    @staticmethod
    def keep_states(
        generation: Generation, state_cache: SnapshotCache | None, speculation: Speculation | None = None
    ) -> None:
        """Put a finished generation's snapshots and its state now into ``state_cache`` (if any), with the MTP
        head's state where its ``speculation`` has it (:meth:`~.runtime.speculative.Speculation.with_head_state`)."""
        if state_cache is not None and generation.chunked:
            for snapshot in [*generation.snapshots, generation.snapshot()]:
                with_head = snapshot if speculation is None else speculation.with_head_state(snapshot)
                if not state_cache.put(with_head) and with_head is not snapshot:
                    state_cache.put(snapshot)  # (the head's state made it too big for the cache: the states alone)

    generate = _at_once(
        stream, "generate", "Run a whole generation (the arguments of :meth:`stream`).", "GenerationResult"
    )
    generate_prepared = _at_once(
        stream_prepared,
        "generate_prepared",
        ":meth:`generate` for input from :meth:`prepare_ids` (the arguments of :meth:`stream_prepared`).",
        "GenerationResult",
    )
    chat = _at_once(
        stream_chat, "chat", "Answer a conversation at once (the arguments of :meth:`stream_chat`).", "ChatResult"
    )


__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_TOOL_CALLS",
    "ChatResult",
    "ChatStream",
    "GenerationGroup",
    "GenerationResult",
    "GenerationStream",
    "Pipeline",
]
