"""``Pipeline.from_exported(dir)``: the one object users hold (no torch).

chat messages (or image + prompt) -> preprocess -> vision -> prefill -> decode loop -> streamed text.

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
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from .contract import ContractError, ShapeContract, read_manifest
from .runtime.backend import Backend, Decoder, GraphSet, open_backend
from .runtime.masks import CapacityExhausted, advance_mask, prepare_decode_mask
from .runtime.chat import ChatInputError, ImagePolicy, normalize_messages
from .runtime.positions import decode_position_ids, mrope_position_ids
from .runtime.preprocess import Preprocessor, load_image, to_rgb
from .runtime.reasoning import THINK_END, ChatDelta, ReasoningParser, prompt_opens_reasoning
from .runtime.sampling import Sampler, SamplingConfig, StopStrings

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Timings:
    """Wall-clock times in milliseconds (``vision_ms`` is None for a text-only prompt);
    ``decode_steps`` counts decode-graph runs."""

    vision_ms: float | None = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: decode steps per second of decode time."""
        return 1000.0 * self.decode_steps / self.decode_ms if self.decode_ms else 0.0

    def summary(self) -> str:
        vision = "no image" if self.vision_ms is None else f"{self.vision_ms:.1f} ms"
        return (
            f"vision {vision} | prefill {self.prefill_ms:.1f} ms | "
            f"decode {self.decode_ms_per_token:.2f} ms/token over {self.decode_steps} steps | "
            f"{self.tokens_per_s:.1f} tokens/s"
        )


@dataclass
class GenerationResult:
    """Outcome of one generation: ``token_ids`` are the new tokens (an end-of-sequence id
    that stopped generation included), ``text`` their decoded text (special tokens skipped),
    ``finish_reason`` 'stop' or 'length' (None while unfinished), ``prompt_tokens`` the
    prompt length in tokens."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass
class PreparedPrompt:
    """Host-side inputs of one request, checked against the contract: ids ``[1, S]`` int64,
    pixel values ``[n_images * n_patches, patch_dim]`` fp32 (the images' patches one after the
    other; None for a text-only prompt), position ids ``[4, 1, S]`` int64, ``rope_deltas``, the
    prefill ``bucket`` (tokens) it will run in, and whether the rendered prompt ends inside an
    open ``<think>`` block (``opens_reasoning``: the reply starts as reasoning)."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None
    position_ids: np.ndarray
    rope_deltas: int
    bucket: int
    n_images: int = 0
    opens_reasoning: bool = False

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


class GenerationStream:
    """Iterate to receive text pieces as tokens are produced.

    ``result`` is kept up to date after every token, so nothing is lost: when generation
    ends (end of sequence, stop string, ``max_new_tokens`` or capacity) it holds every token
    with its ``finish_reason``; when the caller stops iterating early it holds the tokens
    produced so far with ``finish_reason`` None (call :meth:`close` to release the states).
    """

    def __init__(self):
        self._pieces: Iterator[str] = iter(())
        self.result: GenerationResult | None = None
        self._cancel = threading.Event()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def cancel(self) -> None:
        """Ask the generation to stop before its next token; safe to call from any thread, also
        while another thread is inside the iteration (a generator cannot be closed from there).
        The iteration then ends (tokens that produced no text yet included), ``result`` keeps
        every token with ``finish_reason`` None, and the states are released."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop the generation (its states are released); ``result`` keeps what was produced."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


@dataclass
class ChatResult:
    """Outcome of one chat turn: the reply split at the ``<think>`` markers into ``content`` and
    ``reasoning_content`` (None when the reply had no reasoning block), and the underlying
    :class:`GenerationResult` (``generation.text`` is the raw reply, markers included)."""

    content: str
    reasoning_content: str | None
    generation: GenerationResult

    @property
    def finish_reason(self) -> str | None:
        return self.generation.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return self.generation.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """New tokens (an end-of-sequence id that stopped generation included)."""
        return len(self.generation.token_ids)


class ChatStream:
    """Iterate to receive :class:`~qwen35_onnx.runtime.reasoning.ChatDelta` s (``content`` and
    ``reasoning_content`` text) as tokens are produced. ``result`` is kept up to date as in
    :class:`GenerationStream`; :meth:`close` stops the generation and releases its states."""

    def __init__(self, stream: GenerationStream, parser: ReasoningParser):
        self.generation_stream = stream
        self._parser = parser
        self._deltas = self._iterate()

    def _iterate(self) -> Iterator[ChatDelta]:
        for piece in self.generation_stream:
            delta = self._parser.feed(piece)
            if delta:
                yield delta
        tail = self._parser.flush()
        if tail:
            yield tail

    def __iter__(self) -> Iterator[ChatDelta]:
        return self._deltas

    @property
    def result(self) -> ChatResult:
        parser = self._parser
        reasoning = parser.reasoning_content if (parser.reasoning_content or parser.entered_reasoning) else None
        return ChatResult(parser.content, reasoning, self.generation_stream.result)

    def close(self) -> None:
        """Stop the generation (its states are released); ``result`` keeps what was produced."""
        self._deltas.close()
        self.generation_stream.close()

    def cancel(self) -> None:
        """Thread-safe request to stop before the next token (see :meth:`GenerationStream.cancel`)."""
        self.generation_stream.cancel()


class Pipeline:
    """Exported graphs + preprocessing + decode loop.

    Args:
        root: the export folder (``manifest.json``, ``vision/``, ``text/`` and
            the tokenizer/processor files).
        contract: the manifest's contract.
        backend: the runtime that loaded the graphs (ONNX Runtime or OpenVINO, see
            :mod:`qwen35_onnx.runtime.backend`); everything else here is shared.
        preprocessor: tokenizer, chat template and image processor.

    Threads: one generation at a time (the graphs' sessions and state buffers are shared);
    ``prepare``/``prepare_chat``/``prepare_ids`` run no graph and may be called from another
    thread while a generation streams (the tokenizer is used under ``preprocessor.lock``).
    """

    def __init__(self, root: Path, contract: ShapeContract, backend: Backend, preprocessor: Preprocessor):
        self.root = root
        self.contract = contract
        self.backend = backend
        self.preprocessor = preprocessor

    @classmethod
    def from_exported(cls, path: str | os.PathLike, device: str = "cpu", host_state_roundtrip: bool = False,
                      threads: int = 0, runtime: str = "onnxruntime", precision: str = "f32") -> "Pipeline":
        """Load an export folder and cross-check manifest, graph metadata and graph shapes.

        Args:
            path: the export folder.
            device: ONNX Runtime 'cpu' or 'cuda'; OpenVINO a device name ('cpu' / 'CPU', 'GPU',
                'NPU', ... as present).
            host_state_roundtrip: copy the states to host between decode steps instead of keeping
                them on the device (slower; for comparison).
            threads: intra-op threads (0: the runtime's default).
            runtime: 'onnxruntime' (default) or 'openvino'.
            precision: 'f32' (default: parity with transformers); with OpenVINO also 'bf16' or
                'f16' (its inference precision hint).

        Raises:
            ContractError: incomplete export, graphs that disagree with the manifest or with
                each other (e.g. different capacities), or an export the runtime cannot run.
            ValueError: unknown runtime, device or precision.
        """
        root = Path(path)
        contract = read_manifest(root)
        backend = open_backend(root, contract, runtime=runtime, device=device, precision=precision,
                               threads=threads, host_state_roundtrip=host_state_roundtrip)
        preprocessor = Preprocessor.from_pretrained(root, contract.image_size, contract.image_token_id)
        return cls(root, contract, backend, preprocessor)

    @property
    def graphs(self) -> GraphSet:
        """The loaded, cross-checked graphs (``.vision``, ``.decode``, ``.prefill(bucket)``)."""
        return self.backend.graphs

    @property
    def runtime(self) -> str:
        return self.backend.runtime

    @property
    def device(self) -> str:
        return self.backend.device

    @property
    def host_state_roundtrip(self) -> bool:
        return self.backend.host_state_roundtrip

    # ---- host-side preparation -----------------------------------------------------------
    def prepare(self, image, prompt: str) -> PreparedPrompt:
        """Chat-template and preprocess one user turn: ``image`` (a path, a PIL image, a list of
        them, or None for text only) first, then ``prompt``; the one-turn case of
        :meth:`prepare_chat`.

        Raises:
            FileNotFoundError / ValueError: missing or unreadable image.
            ChatInputError: more images than the export's ``max_images``.
            ValueError: the prompt does not fit the largest prefill bucket / the capacity.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt is not valid Unicode text: {exc}") from None
        content: list[dict] = []
        for picture in ([] if image is None else image if isinstance(image, (list, tuple)) else [image]):
            if isinstance(picture, Image.Image):
                picture = to_rgb(picture)
            elif isinstance(picture, (str, os.PathLike)):
                picture = load_image(picture)
            else:
                raise TypeError(f"image must be a file path, a PIL image, a list of them or None, got {type(picture).__name__}")
            content.append({"type": "image", "image": picture})
        content.append({"type": "text", "text": prompt})
        return self.prepare_chat([{"role": "user", "content": content}])

    def prepare_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                     image_policy: ImagePolicy | None = None) -> PreparedPrompt:
        """Render OpenAI-style chat ``messages`` (roles system / user / assistant; content a string
        or text and image parts, see :mod:`qwen35_onnx.runtime.chat`) with the checkpoint's chat
        template, preprocess their images (prompt order) and check the result against the contract.

        Args:
            messages: the conversation, ending with the turn to answer.
            chat_template_kwargs: template variables, e.g. ``{"enable_thinking": False}``.
            image_policy: where images may come from (default: data URLs and any local file).

        Raises:
            ChatInputError: a malformed message or image (``param`` names the field), or more
                images than the export's ``max_images``.
            ValueError: text that is not valid Unicode, a template that cannot render, or a
                prompt longer than the largest prefill bucket / the capacity.
        """
        template_messages, images = normalize_messages(messages, image_policy)
        c = self.contract
        if len(images) > c.max_images:
            raise ChatInputError(
                f"the messages hold {len(images)} images, more than the {c.max_images} this export takes "
                f"(export with --max-images {len(images)} or more)", "messages"
            )
        for m in template_messages:
            texts = [m["content"]] if isinstance(m["content"], str) else [p.get("text", "") for p in m["content"]]
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"message text is not valid Unicode: {exc}") from None
        pixel_values = None
        if images:
            pixel_values = np.concatenate([self.preprocessor.pixel_values(picture)[0] for picture in images])
        ids, text = self.preprocessor.encode_chat(template_messages, c.n_image_tokens if images else 0,
                                                  chat_template_kwargs)
        prepared = self.prepare_ids(ids, pixel_values)
        prepared.opens_reasoning = prompt_opens_reasoning(text)
        return prepared

    def prepare_ids(self, input_ids: np.ndarray, pixel_values: np.ndarray | None = None) -> PreparedPrompt:
        """Check already tokenized input against the contract and compute its positions.

        Args:
            input_ids: int ``[1, S]``; holds ``n_image_tokens`` image tokens per image, each
                image's tokens one contiguous run.
            pixel_values: fp32 ``[n_images * n_patches, patch_dim]`` (1 <= n_images <=
                ``max_images``) or None.

        Raises:
            ValueError: bad shape, token ids outside the vocabulary, image tokens that do not
                match the images, more images than ``max_images``, or a prompt longer than the
                largest bucket / capacity.
        """
        c = self.contract
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers of shape [1, S] with S >= 1, got {ids.dtype} {ids.shape}")
        low, high = int(ids.min()), int(ids.max())  # Python ints: no wrap-around for uint64
        if low < 0 or high >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size}), got min {low} max {high}")
        ids = ids.astype(np.int64)
        bucket = c.select_bucket(int(ids.shape[1]))
        n_images = 0
        if pixel_values is not None:
            pixel_values = np.asarray(pixel_values)
            rows = pixel_values.shape[0] if pixel_values.ndim == 2 else 0
            if (pixel_values.ndim != 2 or pixel_values.shape[1] != c.patch_dim or rows == 0 or rows % c.n_patches
                    or pixel_values.dtype.kind not in "fiu"):
                raise ValueError(
                    f"pixel_values must be numbers of shape [n_images * {c.n_patches}, {c.patch_dim}] (the exported "
                    f"grid, images one after the other), got {pixel_values.dtype} {tuple(pixel_values.shape)}"
                )
            n_images = rows // c.n_patches
            if n_images > c.max_images:
                raise ValueError(f"pixel_values hold {n_images} images, more than the export's max_images {c.max_images}")
            if not np.isfinite(pixel_values).all():
                raise ValueError("pixel_values hold NaN or infinite values")
            pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        grids = [c.grid_thw] * n_images
        positions, rope_deltas = mrope_position_ids(ids, c.image_token_id, grids, c.spatial_merge_size)
        return PreparedPrompt(ids, pixel_values, positions, int(rope_deltas), bucket, n_images)

    def padded_prompt(self, prepared: PreparedPrompt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad ids, mask and position ids to the prefill bucket; padded positions are
        masked out exactly inside the graph."""
        pad = prepared.bucket - prepared.prompt_len
        pad_id = self.contract.pad_token_id or 0
        ids = np.pad(prepared.input_ids, ((0, 0), (0, pad)), constant_values=pad_id)
        mask = np.zeros((1, prepared.bucket), dtype=np.int64)
        mask[0, : prepared.prompt_len] = 1
        positions = np.pad(prepared.position_ids, ((0, 0), (0, 0), (0, pad)))
        return ids, mask, positions

    # ---- graph runs ----------------------------------------------------------------------
    def run_vision(self, prepared: PreparedPrompt) -> np.ndarray:
        """Vision graph once per image, the embeddings stacked in prompt order and zero-padded to
        the prefill's ``[n_image_rows, hidden]`` (all zeros for a text-only prompt); checks that
        the number of image embeddings equals the number of image tokens in the prompt."""
        c = self.contract
        n_tokens = int((prepared.input_ids == c.image_token_id).sum())
        rows = np.zeros((c.n_image_rows, c.image_embed_dim), dtype=np.float32)
        if prepared.pixel_values is None:
            if n_tokens:
                raise ValueError(f"the prompt has {n_tokens} image tokens but no image was given")
            return rows
        filled = 0
        for start in range(0, prepared.pixel_values.shape[0], c.n_patches):
            embeds = self.backend.run_vision(prepared.pixel_values[start:start + c.n_patches])
            rows[filled:filled + embeds.shape[0]] = embeds
            filled += embeds.shape[0]
        if filled != n_tokens:
            raise ValueError(f"vision graph returned {filled} image embeddings but the prompt has {n_tokens} image tokens")
        return rows

    def run_prefill(self, prepared: PreparedPrompt, image_embeds: np.ndarray) -> tuple[np.ndarray, dict]:
        """Prefill graph of the prompt's bucket; returns the last real token's logits ``[V]``
        (host) and the three states in the backend's device-resident form (ONNX Runtime
        OrtValues, OpenVINO Tensors; numpy arrays in host-roundtrip mode)."""
        return self._prefill(prepared, self.padded_prompt(prepared), image_embeds)

    def _prefill(self, prepared: PreparedPrompt, padded, image_embeds: np.ndarray) -> tuple[np.ndarray, dict]:
        ids, mask, positions = padded
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "image_embeds": image_embeds}
        logits, states = self.backend.run_prefill(prepared.bucket if self.contract.prefill_buckets else None, feeds)
        row = 0 if logits.shape[1] == 1 else prepared.prompt_len - 1
        return logits[0, row], states

    def decoder(self, states: dict) -> Decoder:
        """The backend's decoder starting from prefill ``states`` (from :meth:`run_prefill`):
        ``decoder.step(input_ids, attention_mask, position_ids) -> logits [1, 1, V]``."""
        return self.backend.decoder(states)

    # ---- generation ----------------------------------------------------------------------
    def stream(self, image, prompt: str, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
               stop: tuple[str, ...] | list[str] = ()) -> GenerationStream:
        """Start a generation for ``image`` (path, PIL image, a list of them, or None) and
        ``prompt``; iterate the returned stream for text pieces. All input checks run here,
        before any graph.

        Raises:
            ValueError / FileNotFoundError: bad ``max_new_tokens``, sampling options or stop
                strings, prompt over the largest bucket or capacity, unreadable image.
        """
        return self.stream_prepared(self.prepare(image, prompt), max_new_tokens, sampling, stop)

    def generate(self, image, prompt: str, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
                 stop: tuple[str, ...] | list[str] = ()) -> GenerationResult:
        """Run a whole generation and return its result (see :meth:`stream`)."""
        return _drain(self.stream(image, prompt, max_new_tokens, sampling, stop))

    def generate_prepared(self, prepared: PreparedPrompt, max_new_tokens: int = 128,
                          sampling: SamplingConfig | None = None, stop=()) -> GenerationResult:
        """:meth:`generate` for input from :meth:`prepare_ids`."""
        return _drain(self.stream_prepared(prepared, max_new_tokens, sampling, stop))

    def stream_chat(self, messages: list[dict], max_new_tokens: int | None = None,
                    sampling: SamplingConfig | None = None, stop: tuple[str, ...] | list[str] = (),
                    chat_template_kwargs: dict | None = None, image_policy: ImagePolicy | None = None) -> ChatStream:
        """Start a chat turn: OpenAI-style ``messages`` (see :meth:`prepare_chat`), answered by
        streaming :class:`ChatDelta` s; ``max_new_tokens`` None: until end of sequence or capacity.
        All input checks run here, before any graph.

        Raises:
            ChatInputError / ValueError: see :meth:`prepare_chat` and :meth:`stream`.
        """
        prepared = self.prepare_chat(messages, chat_template_kwargs, image_policy)
        return self.stream_chat_prepared(prepared, max_new_tokens, sampling, stop)

    def chat(self, messages: list[dict], max_new_tokens: int | None = None, sampling: SamplingConfig | None = None,
             stop: tuple[str, ...] | list[str] = (), chat_template_kwargs: dict | None = None,
             image_policy: ImagePolicy | None = None) -> ChatResult:
        """Answer a conversation at once (see :meth:`stream_chat`)."""
        stream = self.stream_chat(messages, max_new_tokens, sampling, stop, chat_template_kwargs, image_policy)
        for _ in stream:
            pass
        return stream.result

    def stream_chat_prepared(self, prepared: PreparedPrompt, max_new_tokens: int | None = None,
                             sampling: SamplingConfig | None = None, stop=()) -> ChatStream:
        """:meth:`stream_chat` for input from :meth:`prepare_chat`."""
        stream = self.stream_prepared(prepared, max_new_tokens, sampling, stop)
        return ChatStream(stream, ReasoningParser(prepared.opens_reasoning, enabled=self.has_think_markers))

    def token_room(self, prepared: PreparedPrompt) -> int:
        """Most new tokens the capacity leaves for ``prepared``: ``capacity - prompt_len + 1`` (the
        last token needs no KV slot)."""
        return self.contract.capacity - prepared.prompt_len + 1

    @property
    def has_think_markers(self) -> bool:
        """The tokenizer has a ``</think>`` token, so replies are split into reasoning and content."""
        if not hasattr(self, "_has_think_markers"):
            tokenizer = self.preprocessor.tokenizer
            with self.preprocessor.lock:
                self._has_think_markers = THINK_END in tokenizer.get_added_vocab() or THINK_END in tokenizer.get_vocab()
        return self._has_think_markers

    def stream_prepared(self, prepared: PreparedPrompt, max_new_tokens: int | None = 128,
                        sampling: SamplingConfig | None = None, stop=()) -> GenerationStream:
        """:meth:`stream` for input from :meth:`prepare` or :meth:`prepare_ids`; ``max_new_tokens``
        None: until end of sequence or capacity."""
        room = self.token_room(prepared)
        if max_new_tokens is None:
            max_new_tokens = room
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}")
        sampler = Sampler(sampling or SamplingConfig())
        stops = StopStrings((stop,) if isinstance(stop, str) else tuple(stop))
        if max_new_tokens > room:
            log.warning(
                "prompt (%d tokens) + max_new_tokens (%d) exceeds the capacity %d: at most %d new tokens "
                "will be generated (finish reason 'length')",
                prepared.prompt_len, max_new_tokens, self.contract.capacity, room,
            )
        stream = GenerationStream()
        stream.result = GenerationResult("", [], None, prepared.prompt_len)
        stream._pieces = self._generate(prepared, max_new_tokens, sampler, stops, stream)
        return stream

    def _generate(self, prepared: PreparedPrompt, max_new_tokens: int, sampler: Sampler, stops: StopStrings,
                  stream: GenerationStream) -> Iterator[str]:
        contract = self.contract
        timings = Timings()
        tokens: list[int] = []
        emitted: list[str] = []
        finish = None
        streamer = self.preprocessor.text_streamer()
        stream.result = GenerationResult("", tokens, None, prepared.prompt_len, timings)
        rest = ""
        try:
            self.graphs.prefill(prepared.bucket if contract.prefill_buckets else None)  # load + check first
            padded = self.padded_prompt(prepared)
            prompt_mask = padded[1]
            # the mask checks (batch 1, 0/1 values, contiguous prefix) run before any graph reads the
            # mask: static compilers do not bound-check the indices a graph derives from it
            width = contract.capacity if contract.kv_mode == "fixed" else prompt_mask.shape[1]
            decode_mask = prepare_decode_mask(prompt_mask, width, width)
            t0 = time.perf_counter()
            image_embeds = self.run_vision(prepared)
            t1 = time.perf_counter()
            logits, states = self._prefill(prepared, padded, image_embeds)
            t2 = time.perf_counter()
            timings.vision_ms = 1000 * (t1 - t0) if prepared.pixel_values is not None else None
            timings.prefill_ms = 1000 * (t2 - t1)

            if contract.kv_mode == "fixed":  # the KV width the prefill returned must be the capacity
                kv_width = self.backend.state_shape(states["present_kv_cache"])[3]
                decode_mask = prepare_decode_mask(prompt_mask, contract.capacity, kv_width)
            decoder = self.backend.decoder(states)
            token = sampler(_finite(logits, "prefill"))
            while True:
                tokens.append(token)
                piece = stops.feed(streamer.put(token))
                if piece:
                    emitted.append(piece)
                    stream.result.text = "".join(emitted)
                    yield piece
                if stops.stopped or token in contract.eos_token_ids:
                    finish = FINISH_STOP
                    break
                if len(tokens) >= max_new_tokens:
                    finish = FINISH_LENGTH
                    break
                if stream.cancelled:
                    break
                try:
                    decode_mask, next_pos = self._advance(decode_mask)
                except CapacityExhausted:
                    finish = FINISH_LENGTH
                    break
                t3 = time.perf_counter()
                step_logits = decoder.step(
                    np.array([[token]], dtype=np.int64), decode_mask, decode_position_ids(next_pos, prepared.rope_deltas)
                )
                timings.decode_ms += 1000 * (time.perf_counter() - t3)
                timings.decode_steps += 1
                token = sampler(_finite(step_logits[0, -1], f"decode step {timings.decode_steps}"))
            if not stops.stopped:
                rest = stops.feed(streamer.end()) + stops.flush()
                if rest:
                    emitted.append(rest)
        finally:
            stream.result = GenerationResult("".join(emitted), tokens, finish, prepared.prompt_len, timings)
        if rest:  # the held-back tail, yielded once the result is final
            yield rest

    def _advance(self, decode_mask: np.ndarray) -> tuple[np.ndarray, int]:
        """Claim the slot of the token being fed; returns the mask and ``next_pos = sum(mask)``
        before the update, the token's text position. Fixed mode sets the next mask slot;
        dynamic mode appends a column. Both raise CapacityExhausted at capacity."""
        if self.contract.kv_mode == "fixed":
            return decode_mask, advance_mask(decode_mask)
        next_pos = int(decode_mask.sum())
        if next_pos >= self.contract.capacity:
            raise CapacityExhausted(next_pos, self.contract.capacity)
        return np.concatenate([decode_mask, np.ones((1, 1), dtype=np.int64)], axis=1), next_pos


def _drain(stream: GenerationStream) -> GenerationResult:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


def _finite(logits: np.ndarray, where: str) -> np.ndarray:
    """``logits`` unchanged; a ContractError if any is NaN or infinite (corrupt weights)."""
    if not np.isfinite(logits).all():
        raise ContractError(
            f"the {where} logits are not finite (NaN or inf): the export's weights are probably corrupt "
            "(re-export the model); the tokens generated so far are in the result"
        )
    return logits


__all__ = [
    "ChatDelta", "ChatInputError", "ChatResult", "ChatStream", "GenerationResult", "GenerationStream", "ImagePolicy",
    "Pipeline", "PreparedPrompt", "SamplingConfig", "Timings",
]
