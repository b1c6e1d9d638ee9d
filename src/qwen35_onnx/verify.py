"""Parity against the reference implementation (transformers ``Qwen3_5ForConditionalGeneration``).

Needs torch (the ``export`` extra). The same host-side inputs (token ids, pixel values) feed
both sides, so a difference can only come from the graphs or the decode loop.
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


def reference_generate(model, prepared: PreparedPrompt, grid_thw, max_new_tokens: int, eos_token_ids) -> list[int]:
    """Greedy ``model.generate`` on the same ids (and pixels, each of the ``prepared.n_images``
    images with patch grid ``grid_thw``, when the prompt has images); returns the new token ids,
    stopping at any of ``eos_token_ids`` (kept, as ours)."""
    import torch

    ids = torch.from_numpy(prepared.input_ids)
    images = {}
    if prepared.pixel_values is not None:
        images = dict(
            pixel_values=torch.from_numpy(prepared.pixel_values),
            image_grid_thw=torch.tensor([list(grid_thw)] * prepared.n_images, dtype=torch.long),
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


def token_parity(
    pipeline: Pipeline,
    model_id: str | Path,
    image,
    prompt: str,
    max_new_tokens: int,
    result: GenerationResult | None = None,
    model=None,
) -> TokenParity:
    """Generate greedily with ``pipeline`` (unless ``result``, a greedy result, is given) and with
    transformers on the checkpoint ``model_id``, both stopping at ``pipeline.stop_token_ids``;
    compare the token ids."""
    prepared = pipeline.prepare(image, prompt)
    if result is None:
        result = pipeline.generate_prepared(prepared, max_new_tokens=max_new_tokens, sampling=SamplingConfig())
    model = model if model is not None else load_reference(model_id)
    contract = pipeline.contract
    # the export stops when its capacity is full; transformers has no such limit, so it is asked
    # for no more than fit
    fits = pipeline.token_room(prepared)
    reference = reference_generate(
        model, prepared, contract.grid_thw, min(max_new_tokens, fits), pipeline.stop_token_ids
    )
    return TokenParity(result.token_ids, reference)
