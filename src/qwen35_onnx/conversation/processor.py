"""Tokenizer, chat template and image processor of an export (numpy + PIL + transformers, no torch).

Turns a conversation and its images into the host inputs of the vision and prefill graphs:

* :meth:`Preprocessor.pixel_values`: a picture (:mod:`.images`) fitted to the exported grid and
  patchified into ``[n_patches, C*T*P*P]`` float32 patches on the fixed grid
  ``(1, image_size/P, image_size/P)`` the vision graph was exported for;
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

import inspect
import os
import threading
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .detokenizer import TextStreamer
from .images import fit_to_grid

__all__ = ["Preprocessor", "TemplateKwargsError"]


class TemplateKwargsError(ValueError):
    """``chat_template_kwargs`` tries to set a parameter of ``apply_chat_template`` itself."""


TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
"""Files of which a folder needs one for ``AutoTokenizer`` (a fast tokenizer, or a BPE vocabulary)."""
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Files a chat template is read from (besides ``tokenizer_config.json``'s ``chat_template``)."""


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

    def __init__(
        self, tokenizer, image_processor: Qwen2VLImageProcessorPil, image_size: int, image_token_id: int
    ) -> None:
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

    def encode_chat(
        self,
        messages: list[dict],
        n_image_tokens: int,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[np.ndarray, str]:
        """Render a conversation with the checkpoint's chat template and tokenize it.

        ``messages`` are chat-template messages (:func:`.messages.normalize_messages`): each
        ``{"type": "image"}`` part becomes one image placeholder, which is replaced by
        ``n_image_tokens`` copies (as ``Qwen3VLProcessor`` does); the text is rendered with
        ``add_generation_prompt=True`` plus ``chat_template_kwargs`` (e.g. Qwen3.5's
        ``enable_thinking``) and tokenized without adding special tokens again.

        Args:
            messages: ``[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"}]}]``.
            n_image_tokens: image tokens per image (>= 0).
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
        if n_image_tokens < 0:
            raise ValueError(f"n_image_tokens must be >= 0, got {n_image_tokens}")
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
        try:
            with self.lock:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
                )
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
