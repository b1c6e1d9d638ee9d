"""Tokenizer, chat template and image processor of an export (numpy + PIL + transformers, no torch).

Turns a conversation and its images into the host inputs of the vision and prefill graphs:

* :meth:`Preprocessor.pixel_values`: a picture (:mod:`.images`) sized by the checkpoint's own
  resolution rule within the export's image-token budget, on a grid the export serves
  (:mod:`qwen35_onnx.image_grids`), and patchified into ``[h*w, C*T*P*P]`` float32 patches;
* :meth:`Preprocessor.encode_chat`: a conversation through the checkpoint's chat template,
  each image placeholder expanded to the number of image tokens, tokenized
  (:meth:`Preprocessor.encode`: one user turn with at most one image);
* :meth:`Preprocessor.text_streamer`: incremental detokenization (:mod:`.detokenizer`).

Sources (transformers 5.24): ``Qwen3VLProcessor.__call__`` / ``replace_image_token``
(models/qwen3_vl/processing_qwen3_vl.py) for the placeholder expansion,
``Qwen2VLImageProcessorPil`` (models/qwen2_vl/image_processing_pil_qwen2_vl.py) for the patches.

Torch: nothing here imports torch or torchvision. Note that transformers itself
imports torch as a side effect (``image_utils.py``: ``if is_torch_available():
import torch``) whenever torch is *installed*; in a torch-free install the same
code runs without it (see tests/test_preprocess.py).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..image_grids import Grid, choose_grid, fit_budget, grid_tokens, processor_grid
from .detokenizer import TextStreamer
from .messages import DETAILS
from .reasoning import THINK_END, THINK_START
from .videos import VideoClip, VideoSettings, frame_timestamps, video_patches, video_smart_resize

__all__ = ["ImageSizing", "Preprocessor", "TemplateKwargsError", "VideoSizing", "VideoTokens", "media_kinds"]


class ImageSizing:
    """How this export sizes images: the checkpoint processor's pixel range, the export's budget and
    its static grids (none: any grid up to the budget).

    Args:
        patch_size, merge_size: the vision tower's patch side (pixels) and spatial merge.
        min_pixels, max_pixels: the checkpoint image processor's range (pixels).
        image_tokens: the export's budget (tokens per image).
        grids: the export's static grids ``(h, w)``, or empty for any grid.
    """

    def __init__(self, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int, image_tokens: int, grids=()):
        self.patch_size, self.merge_size = patch_size, merge_size
        self.factor = patch_size * merge_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.image_tokens = image_tokens
        self.grids: tuple[Grid, ...] = tuple(tuple(g) for g in grids)

    @classmethod
    def of(cls, contract) -> ImageSizing:
        """The sizing of an export (a :class:`~qwen35_onnx.contract.ShapeContract`)."""
        return cls(
            contract.patch_size,
            contract.spatial_merge_size,
            contract.min_pixels,
            contract.max_pixels,
            contract.image_tokens,
            contract.vision_grids,
        )

    @property
    def min_tokens(self) -> int:
        """The fewest tokens a per-call limit may ask for: the processor's ``min_pixels`` in tokens."""
        return -(-self.min_pixels // self.factor**2)

    def limit(self, max_image_tokens: int | None) -> int:
        """The image-token limit of one call: the export's budget, or ``max_image_tokens`` below it.

        Raises:
            ValueError: ``max_image_tokens`` not an integer, below :attr:`min_tokens` or above the
                budget (naming both).
        """
        if max_image_tokens is None:
            return self.image_tokens
        if isinstance(max_image_tokens, bool) or not isinstance(max_image_tokens, int):
            raise ValueError(f"max_image_tokens must be an integer, got {max_image_tokens!r}")
        if max_image_tokens < self.min_tokens:
            raise ValueError(
                f"max_image_tokens {max_image_tokens} is below the image processor's minimum of {self.min_tokens} "
                f"tokens (min_pixels {self.min_pixels})"
            )
        if max_image_tokens > self.image_tokens:
            raise ValueError(
                f"max_image_tokens {max_image_tokens} is above this export's budget of {self.image_tokens} image "
                "tokens (--image-tokens)"
            )
        return max_image_tokens

    def max_pixels_for(self, max_image_tokens: int | None = None, detail: str = "auto") -> int:
        """The processor's ``max_pixels`` for one image: the checkpoint's, capped at the limit's
        pixels (:meth:`limit`), and at ``min_pixels`` for ``detail`` 'low'.

        Raises:
            ValueError: ``detail`` not one of :data:`DETAILS`, or see :meth:`limit`.
        """
        return self._max_pixels(self.limit(max_image_tokens), detail)

    def _max_pixels(self, tokens: int, detail: str) -> int:
        if detail not in DETAILS:
            raise ValueError(f"image detail {detail!r} must be one of {', '.join(DETAILS)}")
        top = min(self.max_pixels, tokens * self.factor**2)
        return min(top, self.min_pixels) if detail == "low" else top

    def grid(
        self, height: int, width: int, max_image_tokens: int | None = None, detail: str = "auto"
    ) -> tuple[Grid, Grid]:
        """``(grid, processor_grid)`` for a ``width x height`` image: the patch grid it runs at and
        the grid the checkpoint's processor gives it with ``max_pixels`` at the limit (for
        ``detail`` 'low': at ``min_pixels``). They are equal unless the export lacks that grid (or
        it is over the budget, which the processor's rounding up of tiny or very thin images can give).

        Raises:
            ValueError: ``detail`` not one of :data:`DETAILS`; a bad ``max_image_tokens`` (see
                :meth:`limit`); an aspect ratio above 200 (the processor's limit); no static
                grid within ``max_image_tokens``.
        """
        tokens = self.limit(max_image_tokens)
        top = self._max_pixels(tokens, detail)
        exact = processor_grid(height, width, self.patch_size, self.merge_size, self.min_pixels, top)
        if not self.grids:
            return fit_budget(exact, tokens, self.merge_size), exact
        grids = [g for g in self.grids if grid_tokens(g, self.merge_size) <= tokens]
        if not grids:
            smallest = min(grid_tokens(g, self.merge_size) for g in self.grids)
            raise ValueError(
                f"max_image_tokens {tokens} is below this export's smallest vision grid ({smallest} tokens)"
            )
        return choose_grid(height, width, grids, exact), exact


class VideoSizing:
    """How this export sizes videos: the checkpoint's video processor rule (:mod:`.videos`) within a video-token
    limit, each frame pair within the export's image-token budget (the vision graph runs once per pair), on a grid
    the export serves.

    The rule: a video of ``T`` sampled frames makes ``pairs = ceil(T / 2)`` frame pairs; with a limit of ``L``
    video tokens each pair may have ``per_pair = min(L // pairs, image_tokens)`` tokens, and the processor's
    ``max_pixels`` becomes ``min(its own for T frames, T * per_pair * (patch * merge)**2)``: the grid transformers
    gives with ``size.longest_edge`` at that value. Where its rounding still leaves a pair over ``per_pair`` the
    grid is scaled down (aspect kept); on a static-grid export the pair grid is the exported grid closest to it
    (:func:`~qwen35_onnx.image_grids.choose_grid`), among those within ``per_pair``.

    Args:
        settings: the checkpoint's video processor settings.
        images: the export's :class:`ImageSizing` (its budget per frame pair and its static grids).
        capacity: the export's capacity in tokens; the default limit is half of it.
    """

    def __init__(self, settings: VideoSettings, images: ImageSizing, capacity: int):
        self.settings, self.images, self.capacity = settings, images, int(capacity)

    @property
    def default_tokens(self) -> int:
        """The limit of a call that sets none: the processor's own most (``max_pixels`` in tokens) or half the
        capacity, the smaller (room is left for the text and the reply)."""
        s = self.settings
        own = s.max_pixels // (s.factor**2 * s.temporal_patch_size)
        return max(1, min(own, self.capacity // 2))

    def limit(self, max_video_tokens: int | None) -> int:
        """The video-token limit of one video: :attr:`default_tokens`, or ``max_video_tokens``.

        Raises:
            ValueError: ``max_video_tokens`` not an integer, below 1 or above the capacity (naming both).
        """
        if max_video_tokens is None:
            return self.default_tokens
        if isinstance(max_video_tokens, bool) or not isinstance(max_video_tokens, numbers.Integral):
            raise ValueError(f"max_video_tokens must be an integer, got {max_video_tokens!r}")
        max_video_tokens = int(max_video_tokens)
        if not 1 <= max_video_tokens <= self.capacity:
            raise ValueError(
                f"max_video_tokens {max_video_tokens} must lie in [1, {self.capacity}] (the export's capacity, "
                "--max-seq-len)"
            )
        return max_video_tokens

    def grid(
        self, num_frames: int, height: int, width: int, max_video_tokens: int | None = None
    ) -> tuple[Grid, Grid, int]:
        """``(grid, processor_grid, max_pixels)`` for ``num_frames`` sampled frames of ``width x height``: the patch
        grid of every frame pair, the grid the checkpoint's processor gives with ``max_pixels`` (the class
        docstring's rule), and that ``max_pixels``.

        Raises:
            ValueError: a bad limit (:meth:`limit`); fewer than 2 frames; an aspect ratio above 200; a limit that
                leaves a frame pair less than one token; no static grid within it.
        """
        s, images = self.settings, self.images
        tokens = self.limit(max_video_tokens)
        pairs = math.ceil(num_frames / s.temporal_patch_size)
        per_pair = min(tokens // max(pairs, 1), images.image_tokens)
        if per_pair < 1:
            raise ValueError(
                f"the video's {num_frames} sampled frames make {pairs} frame pairs, and max_video_tokens {tokens} "
                f"leaves less than one token for each: too long for this export (capacity {self.capacity} tokens); "
                "sample fewer frames per second (fps) or send a shorter clip"
            )
        top = min(s.frame_budget(num_frames), num_frames * per_pair * s.factor**2)
        h, w = video_smart_resize(num_frames, height, width, s.temporal_patch_size, s.factor, s.min_pixels, top)
        exact = (h // s.patch_size, w // s.patch_size)
        if not images.grids:
            return fit_budget(exact, per_pair, s.merge_size), exact, top
        grids = [g for g in images.grids if grid_tokens(g, s.merge_size) <= per_pair]
        if not grids:
            smallest = min(grid_tokens(g, s.merge_size) for g in images.grids)
            raise ValueError(
                f"the video's {pairs} frame pairs may have {per_pair} tokens each (max_video_tokens {tokens}), fewer "
                f"than this export's smallest vision grid ({smallest} tokens)"
            )
        return choose_grid(height, width, grids, exact), exact, top


@dataclass(frozen=True)
class VideoTokens:
    """A video's place in the prompt: each frame pair's time in seconds and its tokens (the same for every pair)."""

    timestamps: tuple[float, ...]
    tokens_per_pair: int

    @property
    def total(self) -> int:
        """Video tokens of the whole video."""
        return len(self.timestamps) * self.tokens_per_pair


def media_kinds(messages: list[dict]) -> list[str]:
    """``"image"`` / ``"video"`` for each image or video part of template ``messages``, in order."""
    return [
        part["type"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") in ("image", "video")
    ]


def _agreement(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids the 1-D id arrays ``a`` and ``b`` share."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class TemplateKwargsError(ValueError):
    """``chat_template_kwargs`` tries to set a parameter of ``apply_chat_template`` itself."""


VIDEO_TOKEN, VISION_START, VISION_END = "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
"""Qwen3VLProcessor's video pad and vision markers (a tokenizer may name its own ``video_token``)."""
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
"""Files of which a folder needs one for ``AutoTokenizer`` (a fast tokenizer, or a BPE vocabulary)."""
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Files a chat template is read from (besides ``tokenizer_config.json``'s ``chat_template``)."""


class Preprocessor:
    """Tokenizer + chat template + the checkpoint's Qwen2-VL image processor, sizing images as an
    export serves them.

    Attributes:
        tokenizer: the ``transformers`` tokenizer (with its chat template).
        image_processor: ``Qwen2VLImageProcessorPil``.
        sizing: the export's :class:`ImageSizing`.
        image_token_id: id of the image placeholder token (``config.image_token_id``).
        image_token: its string, e.g. ``"<|image_pad|>"``.
    """

    def __init__(
        self,
        tokenizer,
        image_processor: Qwen2VLImageProcessorPil,
        sizing: ImageSizing,
        image_token_id: int,
        videos: VideoSizing | Exception | None = None,
    ) -> None:
        """Wire the parts together; prefer :meth:`from_pretrained`. ``videos``: how videos are sized (None, or the
        error that loading the video processor settings raised: videos are then refused with it).

        Raises:
            ValueError: the processor's patch or merge size differs from ``sizing``'s;
                ``image_token_id`` is not a token of the tokenizer; or the tokenizer has no chat
                template.
        """
        theirs = (image_processor.patch_size, image_processor.merge_size)
        if theirs != (sizing.patch_size, sizing.merge_size):
            raise ValueError(
                f"the image processor's patch_size / merge_size {theirs} differ from the export's "
                f"{(sizing.patch_size, sizing.merge_size)}"
            )
        image_token = tokenizer.convert_ids_to_tokens(int(image_token_id))
        if image_token is None or tokenizer.convert_tokens_to_ids(image_token) != image_token_id:
            raise ValueError(
                f"image_token_id {image_token_id} is not a token of the tokenizer (vocabulary size {len(tokenizer)})"
            )
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        # Hugging Face fast tokenizers raise "Already borrowed" when one thread encodes (which
        # sets truncation/padding) while another decodes: every use here holds this lock, so a
        # request may be prepared on one thread while a generation streams on another
        self.lock = threading.RLock()
        self.image_processor = image_processor
        self.sizing = sizing
        self.image_token_id = int(image_token_id)
        self.image_token = image_token
        self._videos = videos
        # the video pad: the tokenizer's own attribute where it has one, as Qwen3VLProcessor takes it
        self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_TOKEN
        video_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.video_token_id = None if video_id in (None, tokenizer.unk_token_id) else int(video_id)
        self.vision_start, self.vision_end = VISION_START, VISION_END

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, sizing: ImageSizing, image_token_id: int, capacity: int | None = None
    ) -> Preprocessor:
        """Load tokenizer, chat template and image processor from a Hugging Face folder.

        Args:
            path: folder with ``tokenizer.json`` / ``tokenizer_config.json`` (+ chat
                template) and ``preprocessor_config.json``.
            sizing: how the export sizes images (:meth:`ImageSizing.of` its contract).
            image_token_id: ``config.image_token_id`` of the checkpoint (from the
                shape contract), e.g. 248056 for Qwen3.5.
            capacity: the export's capacity in tokens, for the video-token limits (:class:`VideoSizing`); None:
                no videos.

        Raises:
            OSError: the folder lacks the tokenizer or image-processor files, naming them.
            ValueError: no chat template (naming the files it looked for); see :meth:`__init__`.
        """
        folder = Path(path)
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise OSError(f"{str(folder)!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
        if not (folder / "preprocessor_config.json").is_file():
            raise OSError(f"{str(folder)!r} has no image processor (preprocessor_config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not tokenizer.chat_template:
            raise ValueError(
                f"{str(folder)!r} has no chat template ({' or '.join(CHAT_TEMPLATE_FILES)}, or chat_template in "
                "tokenizer_config.json)"
            )
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        videos = None
        if capacity is not None:
            try:
                videos = VideoSizing(VideoSettings.from_pretrained(path), sizing, capacity)
            except (OSError, ValueError) as exc:  # images still work; a video names this
                videos = exc
        return cls(tokenizer, image_processor, sizing, image_token_id, videos)

    @property
    def video_sizing(self) -> VideoSizing:
        """How videos are sized (:class:`VideoSizing`).

        Raises:
            ValueError: the export takes no videos: no video pad token in the tokenizer, or video processor
                settings that could not be loaded (naming why).
        """
        if self.video_token_id is None:
            raise ValueError(f"the tokenizer has no video token {self.video_token!r}, so this export takes no videos")
        if isinstance(self._videos, Exception):
            raise ValueError(f"this export's video processor settings cannot be used: {self._videos}")
        if self._videos is None:
            raise ValueError("this preprocessor was made without a capacity, so it sizes no videos")
        return self._videos

    def video_pixel_values(
        self, clip: VideoClip, max_video_tokens: int | None = None
    ) -> tuple[np.ndarray, tuple[int, int, int], VideoTokens]:
        """Sampled frames -> vision-graph input and the video's place in the prompt, as the checkpoint's video
        processor does it (:class:`VideoSizing` for the grid, :func:`.videos.video_patches` for the pixels).

        Returns:
            ``(pixel_values, grid_thw, tokens)``: float32 ``[t*h*w, C*T*P*P]`` (frame pair ``i``'s patches at rows
            ``i*h*w ...``), ``(t, h, w)`` and the :class:`VideoTokens` (each pair's time and tokens).

        Raises:
            ValueError: see :attr:`video_sizing` and :meth:`VideoSizing.grid`.
        """
        sizing = self.video_sizing
        grid, _, _ = sizing.grid(len(clip.frames), clip.height, clip.width, max_video_tokens)
        values, t = video_patches(clip.frames, grid, sizing.settings)
        times = frame_timestamps(clip.frame_indices, clip.source_fps, sizing.settings.temporal_patch_size)
        tokens = VideoTokens(tuple(times), grid_tokens(grid, sizing.settings.merge_size))
        return values, (t, *grid), tokens

    def vision_ids(self, input_ids: np.ndarray) -> np.ndarray:
        """``input_ids`` with every video pad replaced by the image pad: the graphs place vision embeddings at
        image pads, and a video's frame pairs are images to them (each its own run of pads between vision start
        and end). The pad's own embedding is never used, so the logits are those of the video pads."""
        if self.video_token_id is None:
            return input_ids
        return np.where(input_ids == self.video_token_id, self.image_token_id, input_ids)

    def pixel_values(
        self, image: Image.Image, max_image_tokens: int | None = None, detail: str = "auto"
    ) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Image -> vision-graph input, sized as the checkpoint's processor sizes it.

        The grid is :meth:`ImageSizing.grid`'s. When it is the processor's own grid, the processor
        itself resizes and patchifies the image (``size = {shortest_edge: min_pixels,
        longest_edge: the limit's pixels}``): the same pixel values as transformers. Otherwise (a
        static-grid export without that grid, or a tiny or very thin image rounded up over the budget) the image is
        resized (bicubic, the processor's resampling) to exactly the grid and patchified without
        another resize.

        Args:
            image: RGB ``PIL.Image`` of any size (e.g. from :func:`.images.load_image`).
            max_image_tokens: image-token limit of this image (default: the export's budget).
            detail: 'auto' / 'high' (the limit) or 'low' (the processor's grid at ``min_pixels``).

        Returns:
            ``(pixel_values, grid_thw)``: float32 ``[h*w, C*T*P*P]`` (e.g. ``[936, 1536]`` for a
            26 x 36 grid, patch 16, temporal patch 2, 3 channels; normalised with the processor's
            mean/std) and ``(1, h, w)``.

        Raises:
            ValueError: see :meth:`ImageSizing.grid`; the processor returned another grid.
        """
        sizing = self.sizing
        grid, exact = sizing.grid(image.height, image.width, max_image_tokens, detail)
        if grid == exact:
            top = sizing.max_pixels_for(max_image_tokens, detail)
            kwargs = {"size": {"shortest_edge": sizing.min_pixels, "longest_edge": top}}
        else:
            size = (grid[1] * sizing.patch_size, grid[0] * sizing.patch_size)
            image = image.resize(size, Image.Resampling(int(self.image_processor.resample)))
            kwargs = {"do_resize": False}
        out = self.image_processor(images=[image], return_tensors="np", **kwargs)
        got = tuple(int(v) for v in out["image_grid_thw"][0])
        if got != (1, *grid):
            raise ValueError(f"image processor produced grid {got}, expected {(1, *grid)}")
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), got

    def encode(self, prompt: str, n_image_tokens: int) -> np.ndarray:
        """Chat-template a user turn (one image of ``n_image_tokens`` tokens, or none, then the
        text) and tokenize it.

        ``messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text",
        "text": prompt}]}]`` (no image part when ``n_image_tokens`` is 0), rendered by
        :meth:`encode_chat`.

        Args:
            prompt: the user's text.
            n_image_tokens: image tokens to insert (>= 0; 0 for a text-only prompt).

        Returns:
            int64 ``[1, S]`` input ids.

        Raises:
            ValueError: see :meth:`encode_chat`.
        """
        if n_image_tokens < 0:
            raise ValueError(f"n_image_tokens must be >= 0, got {n_image_tokens}")
        content = [{"type": "text", "text": prompt}]
        if n_image_tokens:
            content.insert(0, {"type": "image"})
        return self.encode_chat([{"role": "user", "content": content}], [n_image_tokens] if n_image_tokens else [])[0]

    def encode_chat(
        self,
        messages: list[dict],
        image_tokens: list,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[np.ndarray, str]:
        """Render a conversation with the checkpoint's chat template and tokenize it.

        ``messages`` are chat-template messages (:func:`.messages.normalize_messages`): each
        ``{"type": "image"}`` part becomes one image placeholder, which is replaced by that image's
        number of image tokens; each ``{"type": "video"}`` part becomes the template's
        ``<|vision_start|><|video_pad|><|vision_end|>``, which is replaced by one ``<{t:.1f} seconds>``,
        ``<|vision_start|>``, the pair's video pads and ``<|vision_end|>`` per frame pair (as ``Qwen3VLProcessor``
        does, in prompt order). The text is rendered with ``add_generation_prompt=True`` plus
        ``chat_template_kwargs`` (e.g. Qwen3.5's ``enable_thinking``) and tokenized without adding special
        tokens again.

        Args:
            messages: ``[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"} |
                {"type": "video"}]}]``.
            image_tokens: one entry per image or video part, in order: an image's tokens (an int >= 1), a video's
                :class:`VideoTokens`.
            chat_template_kwargs: extra template variables.
            tools: OpenAI-form tool definitions the template lists (``tools`` of
                ``apply_chat_template``), None for none.

        Returns:
            ``(input_ids, prompt_text)``: int64 ``[1, S]`` (video pads as the tokenizer's video token; see
            :meth:`vision_ids`) and the rendered prompt (before the placeholder expansion).

        Raises:
            ValueError: the parts and ``image_tokens`` disagree, the rendered template holds other placeholders
                than one per image or video part (e.g. a message text contains the placeholder itself), the
                template fails to render, or tokenization did not yield the expected image and video tokens.
        """
        media = [m if isinstance(m, VideoTokens) else int(m) for m in image_tokens]
        if any(not isinstance(m, VideoTokens) and m < 1 for m in media):
            raise ValueError(f"every image needs at least one image token, got {image_tokens}")
        kinds = media_kinds(messages)
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & self.reserved_template_kwargs())
        if reserved:
            raise TemplateKwargsError(
                f"chat_template_kwargs may not set {reserved} (parameters of apply_chat_template, "
                "not template variables)"
            )
        text = self._render(messages, tools, True, kwargs)
        given = ["video" if isinstance(m, VideoTokens) else "image" for m in media]
        if kinds != given:
            if "video" not in kinds + given:
                raise ValueError(
                    f"the messages hold {len(kinds)} images but {len(given)} image-token counts were given"
                )
            raise ValueError(f"the messages hold the parts {kinds} but token counts for {given} were given")
        ids = self._tokenize_media(text, media)
        for token_id, expected, name in (
            (self.image_token_id, sum(m for m in media if isinstance(m, int)), "image"),
            (self.video_token_id, sum(m.total for m in media if isinstance(m, VideoTokens)), "video"),
        ):
            got = int((ids == token_id).sum()) if token_id is not None else 0
            if got != expected:
                raise ValueError(f"tokenized prompt holds {got} {name} tokens, expected {expected}")
        return ids[None, :], text

    def _render(self, messages: list[dict], tools, generation_prompt: bool, kwargs: dict) -> str:
        try:
            with self.lock:
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
                )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def _tokenize_media(self, text: str, media: list) -> np.ndarray:
        """Token ids of the rendered ``text`` with each placeholder expanded (:meth:`encode_chat`).

        Raises:
            ValueError: the placeholders in ``text`` are not one per entry of ``media``, of its kind, in order.
        """
        wrapper = self.vision_start + self.video_token + self.vision_end
        placeholder = f"({re.escape(self.image_token)}|{re.escape(self.video_token)})"
        pieces = re.split(placeholder, text.replace(wrapper, self.video_token))
        found = pieces[1::2]
        expected = [self.video_token if isinstance(m, VideoTokens) else self.image_token for m in media]
        if found != expected:
            n_images, n_videos = found.count(self.image_token), found.count(self.video_token)
            what = f"{n_images} image placeholders {self.image_token!r}"
            if n_videos or self.video_token in expected:
                what += f" and {n_videos} video placeholders {self.video_token!r}"
            raise ValueError(
                f"the chat-templated prompt holds {what}; expected {expected.count(self.image_token)} and "
                f"{expected.count(self.video_token)} in the order of the parts (does the text contain a placeholder?)"
            )
        out = [pieces[0]]
        for m, piece in zip(media, pieces[2::2]):
            if isinstance(m, VideoTokens):
                pads = self.vision_start + self.video_token * m.tokens_per_pair + self.vision_end
                out.append("".join(f"<{t:.1f} seconds>{pads}" for t in m.timestamps))
            else:
                out.append(self.image_token * m)
            out.append(piece)
        with self.lock:
            return np.asarray(self.tokenizer("".join(out), add_special_tokens=False)["input_ids"], dtype=np.int64)

    def history_boundaries(
        self,
        messages: list[dict],
        image_tokens: list,
        input_ids: np.ndarray,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[int, ...]:
        """Where in ``input_ids`` ``[1, S]`` (:meth:`encode_chat` of the same arguments) a later
        prompt is likely to repeat this one, in tokens: the end of the stable prefix (:meth:`stable_prefix`: the
        leading system messages and the tools, shared by every conversation, every agent session, with the same
        system prompt and tools) and the end of the whole conversation, before the generation prompt (the
        messages rendered without ``add_generation_prompt``, tokenized and compared id by id with ``input_ids``:
        the length they agree on; none where the template renders them otherwise or refuses them alone). A later
        turn's rendering of this turn's reply may differ (Qwen3.5's template drops earlier replies' reasoning):
        these points come before it.
        """
        ids = np.asarray(input_ids).reshape(-1)
        kwargs = dict(chat_template_kwargs or {})
        points = {self.stable_prefix(messages, image_tokens, ids, kwargs, tools)}
        try:
            text = self._render(messages, tools, False, kwargs)
            history = self._tokenize_media(text, list(image_tokens))
            points.add(_agreement(history, ids))
        except ValueError:
            pass
        return tuple(sorted(p for p in points if 0 < p < ids.size))

    def stable_prefix(
        self,
        messages: list[dict],
        image_tokens: list,
        input_ids: np.ndarray,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> int:
        """Tokens of ``input_ids`` ``[S]`` (:meth:`encode_chat`'s of the same arguments) that any conversation with
        the same leading system messages and tools begins with, whatever its first user message: the template
        rendered with those system messages and two different one-letter user messages, and the ids all three
        agree on (so the template's own text before the first turn, e.g. Qwen3.5's tool list in its system turn, is
        in it, and a template that refuses system messages alone, as Qwen3.5's does, still gives the point). 0
        when there are no system messages and no tools, or the template refuses the messages.
        """
        n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        if not n_system and not tools:
            return 0
        head = messages[:n_system]
        media = list(image_tokens[: len(media_kinds(head))])
        ids = np.asarray(input_ids).reshape(-1)
        rendered = []
        for text in ("A", "B"):  # first user messages that differ from their first character on
            try:
                prompt = self._render(
                    [*head, {"role": "user", "content": text}], tools, False, chat_template_kwargs or {}
                )
                rendered.append(self._tokenize_media(prompt, media))
            except ValueError:
                return 0
        return min(_agreement(rendered[0], rendered[1]), _agreement(rendered[0], ids))

    def reserved_template_kwargs(self) -> set[str]:
        """``apply_chat_template``'s own parameters (``chat_template``, ``tools``, ``tokenize``, ...),
        which template variables may not override, plus ``messages``."""
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return named | {"messages", "conversation"}

    def text_streamer(self) -> TextStreamer:
        """A fresh :class:`TextStreamer` over this tokenizer (sharing its lock) that keeps the text of the
        reasoning markers (:attr:`reasoning_marker_ids`) whether or not the tokenizer marks them special."""
        return TextStreamer(self.tokenizer, self.lock, self.reasoning_marker_ids)

    @functools.cached_property
    def reasoning_marker_ids(self) -> tuple[int, ...]:
        """Token ids of ``<think>`` and ``</think>`` where the tokenizer has them as tokens of their own (added
        tokens, special or not); the reply is split into reasoning and content at them."""
        with self.lock:
            vocab = {**self.tokenizer.get_vocab(), **self.tokenizer.get_added_vocab()}
        return tuple(int(vocab[marker]) for marker in (THINK_START, THINK_END) if marker in vocab)
