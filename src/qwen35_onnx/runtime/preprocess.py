"""Prompt and image preprocessing for the runtime (numpy + PIL + transformers, no torch).

Turns ``(image file, prompt)`` into the host inputs of the vision and prefill
graphs, and token ids back into streamed text:

* :func:`load_image` -> :func:`fit_to_grid` -> :meth:`Preprocessor.pixel_values`:
  any image is padded to a centred square and resized to ``image_size x image_size`` RGB, then ``[n_patches, C*T*P*P]``
  float32 patches on the fixed grid ``(1, image_size/P, image_size/P)`` the vision
  graph was exported for;
* :meth:`Preprocessor.encode_chat`: a conversation through the checkpoint's chat template,
  each image placeholder expanded to the number of image tokens, tokenized
  (:meth:`Preprocessor.encode`: one user turn with at most one image);
* :class:`TextStreamer`: incremental detokenization for streaming output.

Sources (transformers 5.24): ``Qwen3VLProcessor.__call__`` /
``replace_image_token`` (models/qwen3_vl/processing_qwen3_vl.py) for the
placeholder expansion, ``Qwen2VLImageProcessorPil`` (models/qwen2_vl/
image_processing_pil_qwen2_vl.py) for the patches, ``transformers.image_utils.
load_image`` for EXIF handling, and text-generation-inference's ``decode_token`` /
transformers' ``TextStreamer`` (generation/streamers.py) for the streamer.

Torch: nothing here imports torch or torchvision. Note that transformers itself
imports torch as a side effect (``image_utils.py``: ``if is_torch_available():
import torch``) whenever torch is *installed*; in a torch-free install the same
code runs without it (see tests/test_preprocess.py).
"""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

__all__ = ["Preprocessor", "TemplateKwargsError", "TextStreamer", "fit_to_grid", "load_image", "to_rgb"]

PAD_COLOUR = (0, 0, 0)  # fit_to_grid square padding: black
WHITE = (255, 255, 255)  # background for transparent pixels in load_image


def load_image(path: str | os.PathLike) -> Image.Image:
    """Read an image file into a fully loaded RGB ``PIL.Image``.

    EXIF orientation is applied (as ``transformers.image_utils.load_image`` does).
    Modes with transparency (RGBA, LA, PA, P with a transparency entry) are
    composited on white; every other mode (L, P, CMYK, I, ...) goes through
    ``Image.convert("RGB")``.

    Args:
        path: image file path.

    Returns:
        ``PIL.Image.Image`` of mode ``"RGB"``, pixels loaded (the file is closed).

    Raises:
        FileNotFoundError: no file at ``path`` (message names the path).
        ValueError: the file exists but is not a readable image (directory,
            unknown format, truncated or corrupt data); the message names the path.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image file not found: {path}")
    if not path.is_file():
        raise ValueError(f"image path is not a file: {path}")
    try:
        with Image.open(path) as image:
            image.load()
            image = ImageOps.exif_transpose(image)
            return to_rgb(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB.

    Transparent pixels (RGBA, LA, PA, P with a transparency entry) are composited on white.
    High-bit-depth modes are scaled to 8 bits rather than clipped: 16-bit integer modes
    (``I;16*``) by 1/257; 32-bit integer ``I`` by its value range (16-bit data stored as
    ``I`` is common); float ``F`` from [0, 1] when its values lie there, else clipped to
    [0, 255]. Other modes go through ``Image.convert("RGB")``.
    """
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float64)
        if image.mode == "F":
            finite = values[np.isfinite(values)]
            top = float(finite.max()) if finite.size else 0.0
            values = values * 255.0 if top <= 1.0 else values
        elif image.mode == "I" and values.size and values.max() > 65535:
            values = values / 2**24
        else:
            values = values / 257.0
        values = np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


MAX_PAD_SIDE = 4096
"""Largest padded square (pixels per side) built at full resolution in :func:`fit_to_grid`."""


def fit_to_grid(image: Image.Image, image_size: int) -> Image.Image:
    """Bring ``image`` to the exported grid as the reference system does: pad it to a centred
    square (black fill, side ``max(width, height)``), then resize (bicubic) to
    ``image_size x image_size``. Black is the fill because it does not depend on the
    processor's normalisation constants.

    A square wider than :data:`MAX_PAD_SIDE` pixels (a very long, thin image) would cost
    gigabytes, so such images are resized first (the short side keeping at least one pixel)
    and padded after, which differs only by edge rounding.

    Args:
        image: ``PIL.Image`` of any size and mode (converted with :func:`to_rgb`).
        image_size: output side in pixels (> 0).

    Returns:
        RGB ``PIL.Image`` of size ``(image_size, image_size)``; a square input of that
        size comes back as an unchanged copy.

    Raises:
        ValueError: ``image_size`` is not positive.
    """
    if image_size <= 0:
        raise ValueError(f"image_size must be positive, got {image_size}")
    image = to_rgb(image)
    width, height = image.size
    side = max(width, height)
    if side > MAX_PAD_SIDE:
        # resize first (the short side keeps at least one pixel), then pad
        scale = image_size / side
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        resized = image.resize(size, Image.Resampling.BICUBIC)
        canvas = Image.new("RGB", (image_size, image_size), PAD_COLOUR)
        canvas.paste(resized, ((image_size - size[0]) // 2, (image_size - size[1]) // 2))
        return canvas
    if width != height:
        square = Image.new("RGB", (side, side), PAD_COLOUR)
        square.paste(image, ((side - width) // 2, (side - height) // 2))
        image = square
    if side == image_size:
        return image.copy()
    return image.resize((image_size, image_size), Image.Resampling.BICUBIC)


class TemplateKwargsError(ValueError):
    """``chat_template_kwargs`` tries to set a parameter of ``apply_chat_template`` itself."""


class Preprocessor:
    """Tokenizer + chat template + Qwen2-VL image processor for one fixed image size.

    Attributes:
        tokenizer: the ``transformers`` tokenizer (with its chat template).
        image_processor: ``Qwen2VLImageProcessorPil``.
        image_size: image side in pixels the vision graph was exported for.
        image_token_id: id of the image placeholder token (``config.image_token_id``).
        image_token: its string, e.g. ``"<|image_pad|>"``.
        grid_thw: the fixed patch grid ``(1, image_size // P, image_size // P)``.
        n_image_tokens: image tokens per image, ``grid_h * grid_w // merge**2``.
    """

    def __init__(self, tokenizer, image_processor: Qwen2VLImageProcessorPil, image_size: int,
                 image_token_id: int) -> None:
        """Wire the parts together; prefer :meth:`from_pretrained`.

        Raises:
            ValueError: ``image_size`` is not a positive multiple of ``patch_size *
                merge_size``; ``image_token_id`` is not a token of the tokenizer; or
                the tokenizer has no chat template.
        """
        factor = image_processor.patch_size * image_processor.merge_size
        if image_size <= 0 or image_size % factor:
            raise ValueError(
                f"image_size {image_size} must be a positive multiple of patch_size * merge_size = "
                f"{image_processor.patch_size} * {image_processor.merge_size} = {factor}"
            )
        image_token = tokenizer.convert_ids_to_tokens(int(image_token_id))
        if image_token is None or tokenizer.convert_tokens_to_ids(image_token) != image_token_id:
            raise ValueError(
                f"image_token_id {image_token_id} is not a token of the tokenizer "
                f"(vocabulary size {len(tokenizer)})"
            )
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        # Hugging Face fast tokenizers raise "Already borrowed" when one thread encodes (which
        # sets truncation/padding) while another decodes: every use here holds this lock, so a
        # request may be prepared on one thread while a generation streams on another
        self.lock = threading.RLock()
        self.image_processor = image_processor
        self.image_size = image_size
        self.image_token_id = int(image_token_id)
        self.image_token = image_token
        side = image_size // image_processor.patch_size
        self.grid_thw = (1, side, side)
        self.n_image_tokens = side * side // image_processor.merge_size**2

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_size: int, image_token_id: int) -> Preprocessor:
        """Load tokenizer, chat template and image processor from a Hugging Face folder.

        Args:
            path: folder with ``tokenizer.json`` / ``tokenizer_config.json`` (+ chat
                template) and ``preprocessor_config.json``.
            image_size: image side in pixels (multiple of ``patch_size * merge_size``).
            image_token_id: ``config.image_token_id`` of the checkpoint (from the
                shape contract), e.g. 248056 for Qwen3.5.

        Raises:
            OSError: the folder lacks the tokenizer or processor files (from transformers).
            ValueError: see :meth:`__init__`.
        """
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        return cls(tokenizer, image_processor, image_size, image_token_id)

    def pixel_values(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Image -> vision-graph input on the fixed grid.

        The image is first padded to a centred square and resized by :func:`fit_to_grid`, then patchified by the
        image processor with ``size = {shortest_edge: image_size**2, longest_edge:
        image_size**2}``, which pins ``smart_resize`` to ``image_size x image_size``
        whatever min/max pixels the checkpoint's ``preprocessor_config.json`` sets.

        Args:
            image: RGB ``PIL.Image`` of any size (e.g. from :func:`load_image`).

        Returns:
            ``(pixel_values, grid_thw)``: float32 ``[t*h*w, C*T*P*P]`` (e.g. ``[64, 1536]``
            for 128 px, patch 16, temporal patch 2, 3 channels; values normalised with
            the processor's mean/std) and ``(1, image_size/P, image_size/P)``.

        Raises:
            ValueError: the processor returned a grid other than :attr:`grid_thw`.
        """
        pixels = self.image_size * self.image_size
        out = self.image_processor(
            images=[fit_to_grid(image, self.image_size)],
            size={"shortest_edge": pixels, "longest_edge": pixels},
            return_tensors="np",
        )
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        if grid != self.grid_thw:
            raise ValueError(f"image processor produced grid {grid}, expected {self.grid_thw}")
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grid

    def encode(self, prompt: str, n_image_tokens: int) -> np.ndarray:
        """Chat-template a user turn (one image, or none, then the text) and tokenize it.

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
        return self.encode_chat([{"role": "user", "content": content}], n_image_tokens)[0]

    def encode_chat(self, messages: list[dict], n_image_tokens: int,
                    chat_template_kwargs: dict | None = None) -> tuple[np.ndarray, str]:
        """Render a conversation with the checkpoint's chat template and tokenize it.

        ``messages`` are chat-template messages (``runtime.chat.normalize_messages``): each
        ``{"type": "image"}`` part becomes one image placeholder, which is replaced by
        ``n_image_tokens`` copies (as ``Qwen3VLProcessor`` does); the text is rendered with
        ``add_generation_prompt=True`` plus ``chat_template_kwargs`` (e.g. Qwen3.5's
        ``enable_thinking``) and tokenized without adding special tokens again.

        Args:
            messages: ``[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"}]}]``.
            n_image_tokens: image tokens per image (>= 0).
            chat_template_kwargs: extra template variables.

        Returns:
            ``(input_ids, prompt_text)``: int64 ``[1, S]`` and the rendered prompt (before the
            placeholder expansion).

        Raises:
            ValueError: the rendered template holds other than one image placeholder per image
                part (e.g. a message text contains the placeholder itself), the template
                fails to render, or tokenization did not yield the expected image tokens.
        """
        if n_image_tokens < 0:
            raise ValueError(f"n_image_tokens must be >= 0, got {n_image_tokens}")
        n_images = sum(
            1 for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"
        )
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & self.reserved_template_kwargs())
        if reserved:
            raise TemplateKwargsError(f"chat_template_kwargs may not set {reserved} (parameters of apply_chat_template, "
                             "not template variables)")
        try:
            with self.lock:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None
        found = text.count(self.image_token)
        if found != n_images:
            raise ValueError(
                f"the chat-templated prompt holds {found} image placeholders {self.image_token!r}; "
                f"expected {n_images} (does the text contain {self.image_token!r}?)"
            )
        if n_image_tokens and n_images:
            text_expanded = text.replace(self.image_token, self.image_token * n_image_tokens)
        else:
            text_expanded = text
        with self.lock:
            encoded = self.tokenizer(text_expanded, add_special_tokens=False)["input_ids"]
        ids = np.asarray(encoded, dtype=np.int64)
        got, expected = int((ids == self.image_token_id).sum()), n_images * n_image_tokens
        if got != expected:
            raise ValueError(f"tokenized prompt holds {got} image tokens, expected {expected}")
        return ids[None, :], text

    def reserved_template_kwargs(self) -> set[str]:
        """``apply_chat_template``'s own parameters (``chat_template``, ``tools``, ``tokenize``, ...),
        which template variables may not override, plus ``messages``."""
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return named | {"messages", "conversation"}

    def text_streamer(self) -> TextStreamer:
        """A fresh :class:`TextStreamer` over this tokenizer (sharing its lock)."""
        return TextStreamer(self.tokenizer, self.lock)


class TextStreamer:
    """Incremental detokenizer: token ids in, newly printable text out.

    Byte-level BPE splits multi-byte UTF-8 characters across tokens; decoding such a
    prefix ends in U+FFFD. The streamer decodes a short window of recent ids and
    emits only text past what was already emitted, holding back while the decoded
    text ends in U+FFFD. The window (``prefix_offset`` .. end) makes each step O(1)
    instead of re-decoding the whole output (text-generation-inference's
    ``decode_token``). Special tokens are skipped.

    Usage::

        streamer = TextStreamer(tokenizer)
        for token_id in generated:
            print(streamer.put(token_id), end="", flush=True)
        print(streamer.end())
    """

    def __init__(self, tokenizer, lock: threading.RLock | None = None) -> None:
        self.tokenizer = tokenizer
        self._lock = lock or threading.RLock()
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it are emitted (the window's prefix part)

    def _decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def put(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while a character is split)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def end(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD) and reset."""
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        self.ids, self._prefix_offset, self._read_offset = [], 0, 0
        return full[len(prefix):]
