"""Per-channel scales of an int8 KV cache (``--kv-dtype int8``), calibrated on the checkpoint itself (torch).

ONNX Runtime's GroupQueryAttention keeps an int8 cache with static scales (``k_quant_type`` / ``v_quant_type``
PER_CHANNEL: one scale per KV head and channel of each layer, its operator documentation), and an int8 cache
in standard operators (``--ops portable``) uses the same codes. The scales are measured once at export: the
shipped calibration text (prose, dialogue, code, JSON and a tool call, several languages;
``assets/calibration.txt``) through the checkpoint's chat template, run through the text model one decoder
layer at a time with each layer's weights read from the checkpoint only while it runs (the export's memory
stays bounded by one layer, as :mod:`.weight_source` bounds the rest of the export), and the largest magnitude
of every channel of the keys (after their RMSNorm and the rotary embedding, as they are cached) and of the
values is recorded. ``scale = max|x| * KV_SCALE_MARGIN / 127``: symmetric int8 codes (Dettmers et al. 2022,
"LLM.int8()": absmax quantization; per-channel key scales as KIVI recommends for keys, Liu et al. 2024,
"KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"); a value past the calibrated range
saturates at +-127.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..host_memory import release_freed_memory
from ..paths import asset_path
from .weight_source import CheckpointWeights, parameter_names

CALIBRATION_TOKENS = 1024
"""Most calibration tokens (the chat-templated text is cut there)."""
KV_SCALE_MARGIN = 1.0
"""Headroom of the scales over the calibrated maximum (1.0: the calibrated maximum maps to code 127)."""
ATTENTION_NAME = "qwen35_kv_calibration"
"""The name the calibration's attention function is registered under in transformers' ``AttentionInterface``."""


def calibration_ids(model_dir: str | Path, max_tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The calibration text as the checkpoint's tokenizer and chat template give it: ``[1, N]`` int64, N at
    most ``max_tokens`` (a system turn, a user turn and an assistant turn; the plain text where the checkpoint
    has no chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = asset_path("calibration.txt").read_text(encoding="utf-8")
    parts = text.split("\n\n")
    third = max(1, len(parts) // 3)
    messages = [
        {"role": "system", "content": "\n\n".join(parts[:third])},
        {"role": "user", "content": "\n\n".join(parts[third : 2 * third])},
        {"role": "assistant", "content": "\n\n".join(parts[2 * third :])},
    ]
    ids = None
    if getattr(tokenizer, "chat_template", None):
        with contextlib.suppress(Exception):  # a template that refuses this conversation: the plain text
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
    if ids is None:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([list(ids)[:max_tokens]], dtype=torch.int64)


@contextlib.contextmanager
def _weights_of(module: nn.Module, model: nn.Module, source: CheckpointWeights | None) -> Iterator[None]:
    """``module``'s parameters hold the checkpoint's values in fp32 while the block runs (read from ``source``;
    nothing is read where ``source`` is None: a model with real weights), and are empty again after it, in their
    own dtype (``torch.empty`` storage: not resident). The calibration computes in fp32 whatever the export's
    dtype (a CPU computes fp32 fastest, and the scales are of the values the graphs compute)."""
    if source is None:
        yield
        return
    names = parameter_names(model)
    params = [(p, p.dtype) for p in module.parameters()]
    try:
        with torch.no_grad():
            for p, _ in params:
                p.data = source.tensor(names[id(p)]).float()
        yield
    finally:
        for p, dtype in params:
            p.data = torch.empty(p.shape, dtype=dtype)


def kv_scales(
    model: nn.Module, source: CheckpointWeights | None, ids: torch.Tensor, margin: float = KV_SCALE_MARGIN
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The int8 scales of each full-attention layer's keys and values, in layer order: ``(k_scale, v_scale)``,
    each ``[num_key_value_heads, head_dim]`` fp32, from the calibration tokens ``ids [1, N]`` run through the
    text model of ``model`` (a ``Qwen3_5ForConditionalGeneration``; with ``source``, an empty model whose
    weights are read from the checkpoint one decoder layer at a time, see the module docstring).

    Raises:
        ValueError: ``ids`` is not ``[1, N]`` with N >= 1, or the model has no full-attention layer.
    """
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"calibration ids must be [1, N] with N >= 1, got shape {list(ids.shape)}")
    text = model.model.language_model
    config = text.config
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    if not full:
        raise ValueError("the model has no full-attention layer: an int8 KV cache has nothing to calibrate")
    peaks: dict[int, list[torch.Tensor]] = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        for index, tensor in enumerate((key, value)):  # [B, Hkv, S, D] as the cache holds them
            peak = tensor.detach().float().abs().amax(dim=(0, 2))
            seen = peaks.setdefault(module.layer_idx, [None, None])
            seen[index] = peak if seen[index] is None else torch.maximum(seen[index], peak)
        return qwen.ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, attention)
    before = config._attn_implementation
    with torch.no_grad():
        with _weights_of(text.embed_tokens, model, source):
            hidden = text.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        rope = text.rotary_emb(hidden, positions)
        config._attn_implementation = "sdpa"
        try:
            masks = {
                "full_attention": qwen.create_causal_mask(
                    config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions[0]
                ),
                "linear_attention": None,
            }
            config._attn_implementation = ATTENTION_NAME
            for i, layer in enumerate(text.layers[: config.num_hidden_layers]):
                with _weights_of(layer, model, source):
                    hidden = layer(hidden, position_embeddings=rope, attention_mask=masks[config.layer_types[i]])
        finally:
            config._attn_implementation = before
    release_freed_memory()  # the layers' weights and activations: not kept resident for the rest of the export
    missing = [i for i in full if i not in peaks]
    if missing:
        raise RuntimeError(f"calibration saw no keys of full-attention layers {missing}")
    return [tuple((peak * margin / 127).clamp_min(1e-8) for peak in peaks[i]) for i in full]
