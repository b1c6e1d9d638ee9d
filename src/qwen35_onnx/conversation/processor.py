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
import os
import threading
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..image_grids import Grid, choose_grid, fit_budget, grid_tokens, processor_grid
from .detokenizer import TextStreamer
from .messages import DETAILS
from .reasoning import THINK_END, THINK_START

__all__ = ["ImageSizing", "Preprocessor", "TemplateKwargsError"]


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


class TemplateKwargsError(ValueError):
    """``chat_template_kwargs`` tries to set a parameter of ``apply_chat_template`` itself."""


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
        self, tokenizer, image_processor: Qwen2VLImageProcessorPil, sizing: ImageSizing, image_token_id: int
    ) -> None:
        """Wire the parts together; prefer :meth:`from_pretrained`.

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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, sizing: ImageSizing, image_token_id: int) -> Preprocessor:
        """Load tokenizer, chat template and image processor from a Hugging Face folder.

        Args:
            path: folder with ``tokenizer.json`` / ``tokenizer_config.json`` (+ chat
                template) and ``preprocessor_config.json``.
            sizing: how the export sizes images (:meth:`ImageSizing.of` its contract).
            image_token_id: ``config.image_token_id`` of the checkpoint (from the
                shape contract), e.g. 248056 for Qwen3.5.

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
        return cls(tokenizer, image_processor, sizing, image_token_id)

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
        image_tokens: list[int],
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[np.ndarray, str]:
        """Render a conversation with the checkpoint's chat template and tokenize it.

        ``messages`` are chat-template messages (:func:`.messages.normalize_messages`): each
        ``{"type": "image"}`` part becomes one image placeholder, which is replaced by that image's
        number of image tokens (as ``Qwen3VLProcessor`` does, in prompt order); the text is rendered with
        ``add_generation_prompt=True`` plus ``chat_template_kwargs`` (e.g. Qwen3.5's
        ``enable_thinking``) and tokenized without adding special tokens again.

        Args:
            messages: ``[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"}]}]``.
            image_tokens: the image tokens of each image (>= 1 each), one per image part, in order.
            chat_template_kwargs: extra template variables.
            tools: OpenAI-form tool definitions the template lists (``tools`` of
                ``apply_chat_template``), None for none.

        Returns:
            ``(input_ids, prompt_text)``: int64 ``[1, S]`` and the rendered prompt (before the
            placeholder expansion).

        Raises:
            ValueError: the rendered template holds other than one image placeholder per image
                part (e.g. a message text contains the placeholder itself), the template
                fails to render, or tokenization did not yield the expected image tokens.
        """
        image_tokens = [int(n) for n in image_tokens]
        if any(n < 1 for n in image_tokens):
            raise ValueError(f"every image needs at least one image token, got {image_tokens}")
        n_images = sum(
            1
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if part.get("type") == "image"
        )
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & self.reserved_template_kwargs())
        if reserved:
            raise TemplateKwargsError(
                f"chat_template_kwargs may not set {reserved} (parameters of apply_chat_template, "
                "not template variables)"
            )
        text = self._render(messages, tools, True, kwargs)
        if n_images != len(image_tokens):
            raise ValueError(
                f"the messages hold {n_images} images but {len(image_tokens)} image-token counts were given"
            )
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != n_images:
            raise ValueError(
                f"the chat-templated prompt holds {len(pieces) - 1} image placeholders {self.image_token!r}; "
                f"expected {n_images} (does the text contain {self.image_token!r}?)"
            )
        ids = self._tokenize_expanded(pieces, image_tokens)
        got, expected = int((ids == self.image_token_id).sum()), sum(image_tokens)
        if got != expected:
            raise ValueError(f"tokenized prompt holds {got} image tokens, expected {expected}")
        return ids[None, :], text

    def _render(self, messages: list[dict], tools, generation_prompt: bool, kwargs: dict) -> str:
        try:
            with self.lock:
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
                )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def _tokenize_expanded(self, pieces: list[str], image_tokens: list[int]) -> np.ndarray:
        """Token ids of ``pieces`` joined by each image's run of image tokens."""
        text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(image_tokens, pieces[1:]))
        with self.lock:
            return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def history_boundaries(
        self,
        messages: list[dict],
        image_tokens: list[int],
        input_ids: np.ndarray,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[int, ...]:
        """Where in ``input_ids`` ``[1, S]`` (:meth:`encode_chat` of the same arguments) a later
        prompt is likely to repeat this one, in tokens: after the leading system messages (shared by
        every conversation with the same system prompt) and after the whole conversation, before the
        generation prompt. Each is the messages rendered without ``add_generation_prompt``, tokenized
        and compared id by id with ``input_ids`` (the length they agree on; none where the template
        renders them otherwise or refuses them alone). A later turn's rendering of this turn's reply
        may differ (Qwen3.5's template drops earlier replies' reasoning): these points come before it.
        """
        n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        points = set()
        for count in {n_system, len(messages)} - {0}:
            head = messages[:count]
            n_images = sum(
                1
                for m in head
                if isinstance(m.get("content"), list)
                for part in m["content"]
                if part.get("type") == "image"
            )
            try:
                text = self._render(head, tools, False, dict(chat_template_kwargs or {}))
            except ValueError:
                continue
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != n_images:
                continue
            history = self._tokenize_expanded(pieces, [int(n) for n in image_tokens[:n_images]])
            ids = np.asarray(input_ids).reshape(-1)
            n = min(history.shape[0], ids.shape[0])
            differ = np.flatnonzero(history[:n] != ids[:n])
            points.add(int(differ[0]) if differ.size else n)
        return tuple(sorted(p for p in points if 0 < p < np.asarray(input_ids).size))

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
