"""Parity against the reference implementation (transformers ``Qwen3_5ForConditionalGeneration``).

Needs torch (the ``export`` extra). The reference gets the raw images through the checkpoint's own
image processor (``Qwen2VLImageProcessorPil`` from the checkpoint folder, its ``min_pixels`` and
its ``max_pixels`` capped at the export's image-token budget, as a user would set
``max_pixels``), the conversation through the checkpoint's chat template, each image placeholder
expanded to the processor's grid (as ``Qwen3VLProcessor`` does); never our pixel values or ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .paths import check_checkpoint_folder
from .pipeline import GenerationResult, Pipeline
from .runtime.prompt import PreparedPrompt
from .runtime.sampling import SamplingConfig


@dataclass
class TokenParity:
    """``identical`` leading tokens out of ``total`` compared (the longer of the two runs)."""

    ours: list[int]
    reference: list[int]

    @property
    def total(self) -> int:
        return max(len(self.ours), len(self.reference))

    @property
    def identical(self) -> int:
        n = 0
        for a, b in zip(self.ours, self.reference):
            if a != b:
                break
            n += 1
        return n

    @property
    def ok(self) -> bool:
        return self.ours == self.reference

    def line(self) -> str:
        return f"parity: {self.identical}/{self.total} tokens identical to transformers"


def load_reference(model_id: str | Path):
    """The transformers model of a checkpoint folder: fp32, eval mode, eager attention.

    Raises:
        ValueError: not a checkpoint folder (see :func:`~qwen35_onnx.paths.check_checkpoint_folder`).

    Eager attention because it is the accurate fp32 reference: on the demo checkpoint its
    last-token logits are within 1.4e-5 of an fp64 run, while the default SDPA kernel on CPU
    is 1.1e-4 away (measured with transformers 5.24, torch 2.13).
    """
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    check_checkpoint_folder(model_id)
    # The reference runs transformers' own PyTorch kernels on purpose: its notices about
    # optional fused-kernel packages and its loading progress bar are noise here.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return Qwen3_5ForConditionalGeneration.from_pretrained(
        Path(model_id), dtype="float32", attn_implementation="eager"
    ).eval()


def reference_prompt(model_id: str | Path, messages: list[dict], max_pixels: int, chat_template_kwargs=None):
    """The reference's own inputs for chat-template ``messages`` whose image parts are ``{"type":
    "image", "image": PIL image}``: ``(input_ids [1, S] int64, pixel_values [P, patch_dim] fp32 or
    None, image_grid_thw [n, 3] int64 or None)``, made by the checkpoint's tokenizer, chat template
    and image processor (``max_pixels``: the processor's ``longest_edge`` capped at this)."""
    import numpy as np
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_id)
    images = [
        p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
    ]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )
    pixel_values = grids = None
    if images:
        size = {
            "shortest_edge": processor.size["shortest_edge"],
            "longest_edge": min(processor.size["longest_edge"], max_pixels),
        }
        out = processor(images=images, size=size, return_tensors="np")
        pixel_values, grids = out["pixel_values"], out["image_grid_thw"]
        pad = "<|image_pad|>"
        pieces = text.split(pad)
        counts = [int(np.prod(g)) // processor.merge_size**2 for g in grids]
        text = pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=np.int64)
    return ids, pixel_values, grids


def check_comparable(prepared: PreparedPrompt, reference_grids, contract) -> None:
    """Both sides run every image at the same grid.

    Raises:
        ValueError: an image the checkpoint's processor sizes to a grid this export cannot run (over
            its budget, which the processor's rounding up of a tiny or very thin image can give, or
            not among its static grids), naming both grids and what export would take it.
    """
    theirs = [] if reference_grids is None else [tuple(int(v) for v in g) for g in reference_grids]
    for i, (ours, grid) in enumerate(zip(prepared.image_grids, theirs)):
        if tuple(ours) != grid:
            tokens = grid[1] * grid[2] // contract.spatial_merge_size**2
            needs = [f"--image-tokens {tokens} or more"] if tokens > contract.image_tokens else []
            if contract.static_vision:
                needs.append(f"the {grid[1]}x{grid[2]} grid among its --vision-grids")
            raise ValueError(
                f"image {i + 1}: the checkpoint's processor gives it a {grid[1]}x{grid[2]} grid ({tokens} image "
                f"tokens) but this export runs it at {ours[1]}x{ours[2]}, so transformers cannot be compared on it; "
                f"an export with {' and '.join(needs)} can"
            )


def reference_generate(model, input_ids, pixel_values, image_grid_thw, max_new_tokens: int, eos_token_ids) -> list[int]:
    """Greedy ``model.generate`` on ``input_ids`` ``[1, S]`` (and ``pixel_values`` with each image's
    ``image_grid_thw`` row, when the prompt has images); returns the new token ids, stopping at any
    of ``eos_token_ids`` (kept, as ours)."""
    import torch

    ids = torch.from_numpy(input_ids)
    images = {}
    if pixel_values is not None:
        images = dict(
            pixel_values=torch.from_numpy(pixel_values),
            image_grid_thw=torch.from_numpy(image_grid_thw),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_token_ids) or None,
            pad_token_id=0,
            **images,
        )
    return out[0, ids.shape[1] :].tolist()


def reference_generate_prepared(model, prepared: PreparedPrompt, max_new_tokens: int, eos_token_ids) -> list[int]:
    """:func:`reference_generate` on our own host inputs (``prepared``'s ids, pixel values and
    grids): for checks of the graphs and the decode loop alone, where both sides must see the same
    inputs."""
    import numpy as np

    grids = np.asarray(prepared.image_grids, dtype=np.int64).reshape(-1, 3) if prepared.image_grids else None
    return reference_generate(model, prepared.input_ids, prepared.pixel_values, grids, max_new_tokens, eos_token_ids)


def chat_parity(
    pipeline: Pipeline,
    model_id: str | Path,
    messages: list[dict],
    max_new_tokens: int,
    model=None,
    chat_template_kwargs: dict | None = None,
    result: GenerationResult | None = None,
) -> TokenParity:
    """Greedy tokens of ``pipeline`` on chat ``messages`` (image parts ``{"type": "image", "image":
    path or PIL image}``; ``result``: a greedy result for the same input, made already) against
    transformers on the checkpoint ``model_id`` fed the raw images (:func:`reference_prompt`,
    ``max_pixels`` the export's budget), both stopping at ``pipeline.stop_token_ids``.

    Raises:
        ValueError: see :func:`check_comparable` (before anything runs).
    """
    from .conversation.images import load_image

    def raw(part):
        if part.get("type") != "image" or not isinstance(part.get("image"), (str, Path)):
            return part
        return {**part, "image": load_image(part["image"])}

    messages = [
        {**m, "content": [raw(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m for m in messages
    ]
    prepared = pipeline.prepare_chat(messages, chat_template_kwargs)
    contract = pipeline.contract
    ids, pixel_values, grids = reference_prompt(model_id, messages, contract.image_max_pixels, chat_template_kwargs)
    check_comparable(prepared, grids, contract)
    if result is None:
        result = pipeline.generate_prepared(prepared, max_new_tokens=max_new_tokens, sampling=SamplingConfig())
    model = model if model is not None else load_reference(model_id)
    # the export stops when its capacity is full; transformers has no such limit, so it is asked
    # for no more than fit
    fits = pipeline.token_room(prepared)
    reference = reference_generate(model, ids, pixel_values, grids, min(max_new_tokens, fits), pipeline.stop_token_ids)
    return TokenParity(result.token_ids, reference)


def token_parity(
    pipeline: Pipeline,
    model_id: str | Path,
    image,
    prompt: str,
    max_new_tokens: int,
    result: GenerationResult | None = None,
    model=None,
) -> TokenParity:
    """:func:`chat_parity` of one user turn: the raw ``image`` (a path, a PIL image, a list of them or
    None) first, then ``prompt``."""
    pictures = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    content = [{"type": "image", "image": p} for p in pictures] + [{"type": "text", "text": prompt}]
    return chat_parity(pipeline, model_id, [{"role": "user", "content": content}], max_new_tokens, model, None, result)
