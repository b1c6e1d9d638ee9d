"""ONNX Runtime fused operators for ``--ops ort`` (``com.microsoft`` contrib domain).

Two torch custom ops stand for ONNX Runtime's fused kernels while tracing, and
``TRANSLATIONS`` (the ``custom_translation_table`` of ``torch.onnx.export``) turns each into
one contrib node:

- ``qwen35::linear_attention`` -> ``LinearAttention`` (``update_rule="gated_delta"``): the
  Gated DeltaNet recurrence ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)``,
  ``o_t = scale q_t^T S_t`` (Yang et al., "Gated Delta Networks", ICLR 2025), for prefill
  (T > 1) and decode (T = 1).
- ``qwen35::rms_norm`` -> ``SimplifiedLayerNormalization``; ``qwen35::skip_rms_norm`` ->
  ``SkipSimplifiedLayerNormalization`` (residual add + RMSNorm); ``qwen35::linear_attention_gate``
  -> ``LinearAttentionGate`` (the decay and beta of Gated DeltaNet).
- ``qwen35::mrotary_embedding`` -> ``MRotaryEmbedding`` (interleaved mRoPE, partial rotary).
- ``qwen35::group_query_attention`` -> ``GroupQueryAttention`` over the fixed-width KV
  cache: the decode graph's KV write and attention in one node, in place when the runtime
  binds past and present to one buffer; ``qwen35::group_query_attention_int8`` -> the same node over
  an int8 cache with per-channel scales (``k_quant_type`` / ``v_quant_type`` PER_CHANNEL,
  ``kv_cache_bit_width`` 8); ``qwen35::prompt_attention`` -> the same node without a past, for a
  whole right-padded prompt (the prefill graph).

The schemas follow the operator documentation shipped with onnxruntime (>= 1.31,
``onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema()``). The eager
implementations are plain reference loops, used only when a graph module runs in PyTorch.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
import torch.nn.functional as F
from onnx.defs import OpSchema

from . import layers

MS_DOMAIN = "com.microsoft"


#: The contrib operators as ONNX Runtime documents them: name, domain, inputs, outputs, type
#: constraints, attributes. ``name:T`` is a formal parameter of type ``T`` (``?``: optional);
#: ``T=float,float16`` a constraint (tensor element types); ``name:INT`` an attribute.
# fmt: off
SCHEMAS = (
    ("LinearAttention", MS_DOMAIN, "query:T key:T value:T past_state:S? decay:T? beta:T?",
     "output:T present_state:S", "T=float,float16 S=float,float16",
     "q_num_heads:INT kv_num_heads:INT update_rule:STRING scale:FLOAT chunk_size:INT"),
    ("GroupQueryAttention", MS_DOMAIN,
     "query:T key:T? value:T? past_key:C? past_value:C? seqlens_k:M total_sequence_length:M cos_cache:T? "
     "sin_cache:T? position_ids:P? attention_bias:T? head_sink:T? k_scale:S? v_scale:S?",
     "output:T present_key:C present_value:C", "T=float,float16 C=float,float16,int8 M=int32 P=int64 S=float",
     "num_heads:INT kv_num_heads:INT scale:FLOAT k_quant_type:STRING v_quant_type:STRING kv_cache_bit_width:INT"),
    ("SimplifiedLayerNormalization", "", "X:T scale:T", "Y:T", "T=float,float16",
     "axis:INT epsilon:FLOAT stash_type:INT"),
    ("SkipSimplifiedLayerNormalization", MS_DOMAIN, "input:T skip:T gamma:T bias:T?",
     "output:T mean:U? inv_std_var:U? input_skip_bias_sum:T?", "T=float,float16 U=float", "epsilon:FLOAT"),
    ("MRotaryEmbedding", MS_DOMAIN, "input:T position_ids:M cos_cache:T sin_cache:T", "output:T",
     "T=float,float16 M=int64",
     "mrope_section:INTS num_heads:INT rotary_embedding_dim:INT interleaved:INT mrope_layout:INT"),
    ("LinearAttentionGate", MS_DOMAIN, "a:T dt_bias:TF decay_scale:TF b:T?", "decay:T beta:T",
     "T=float,float16 TF=float", ""),
)
# fmt: on


def _schema(name: str, domain: str, inputs: str, outputs: str, types: str, attributes: str) -> OpSchema:
    """The :class:`onnx.defs.OpSchema` of one :data:`SCHEMAS` entry (opset 1)."""

    def formal(spec: str) -> OpSchema.FormalParameter:
        param, kind = spec.rstrip("?").split(":")
        option = (
            OpSchema.FormalParameterOption.Optional if spec.endswith("?") else OpSchema.FormalParameterOption.Single
        )
        return OpSchema.FormalParameter(param, kind, param_option=option)

    constraints = [
        (t, [f"tensor({e})" for e in elems.split(",")], "") for t, elems in (c.split("=") for c in types.split())
    ]
    return OpSchema(
        name,
        domain,
        1,
        doc=f"ONNX Runtime {name}",
        inputs=[formal(p) for p in inputs.split()],
        outputs=[formal(p) for p in outputs.split()],
        type_constraints=constraints,
        attributes=[
            OpSchema.Attribute(a, getattr(OpSchema.AttrType, t), "")
            for a, t in (x.split(":") for x in attributes.split())
        ],
    )


def _register_schemas() -> None:
    """Make the contrib ops known to onnx/onnxscript (ONNX Runtime has its own copies)."""
    for spec in SCHEMAS:
        schema = _schema(*spec)
        try:
            onnx.defs.get_schema(schema.name, schema.since_version, schema.domain)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(schema)


_register_schemas()
_ms = onnxscript.values.Opset(MS_DOMAIN, 1)
_onnx = onnxscript.values.Opset("", 18)


# ---- normalisations -------------------------------------------------------------------
@torch.library.custom_op("qwen35::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis (Zhang and Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * scale``,
    computed in fp32. ``x [..., C]``, ``scale [C]`` -> ``[..., C]``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale.float()).to(x.dtype)


@rms_norm.register_fake
def _(x, scale, eps):
    return torch.empty_like(x)


def _rms_norm_onnx(x, scale, eps: float):
    return _onnx.SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=eps, stash_type=1)


@torch.library.custom_op("qwen35::skip_rms_norm", mutates_args=())
def skip_rms_norm(
    x: torch.Tensor, skip: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``total = x + skip``, returns ``(rms_norm(total) * scale, total)``.
    ``x, skip [..., C]``, ``scale [C]``."""
    total = x + skip
    return rms_norm(total, scale, eps), total


@skip_rms_norm.register_fake
def _(x, skip, scale, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _skip_rms_norm_onnx(x, skip, scale, eps: float):
    out, _, _, total = _ms.SkipSimplifiedLayerNormalization(x, skip, scale, epsilon=eps, _outputs=4)
    return out, total


@torch.library.custom_op("qwen35::linear_attention_gate", mutates_args=())
def linear_attention_gate(
    a: torch.Tensor, dt_bias: torch.Tensor, decay_scale: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet gates: ``decay = decay_scale * softplus(a + dt_bias)`` (log-space decay,
    ``decay_scale = -exp(A_log)``) and ``beta = sigmoid(b)``. ``a, b [B, T, H]``, ``dt_bias,
    decay_scale [H]`` fp32 -> ``(decay, beta) [B, T, H]``."""
    decay = decay_scale.float() * F.softplus(a.float() + dt_bias.float())
    return decay.to(a.dtype), torch.sigmoid(b.float()).to(b.dtype)


@linear_attention_gate.register_fake
def _(a, dt_bias, decay_scale, b):
    return torch.empty_like(a), torch.empty_like(b)


def _linear_attention_gate_onnx(a, dt_bias, decay_scale, b):
    return _ms.LinearAttentionGate(a, dt_bias, decay_scale, b, _outputs=2)


# ---- linear attention ------------------------------------------------------------------
@torch.library.custom_op("qwen35::linear_attention", mutates_args=())
def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over packed heads (reference loop).

    Args:
        query, key: ``[B, T, H*Dk]`` (key L2-normalised); value: ``[B, T, H*Dv]``;
        past_state: ``[B, H, Dk, Dv]`` fp32; decay (log space), beta: ``[B, T, H]``.

    Returns:
        ``(output [B, T, H*Dv], present_state [B, H, Dk, Dv])``.
    """
    batch, steps, _ = query.shape
    q = query.float().view(batch, steps, num_heads, -1)
    k = key.float().view(batch, steps, num_heads, -1)
    v = value.float().view(batch, steps, num_heads, -1)
    state = past_state.float().clone()
    outs = []
    for t in range(steps):
        state = state * decay[:, t].float().exp()[..., None, None]
        memory = (state * k[:, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, t] - memory) * beta[:, t].float().unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2) * scale)
    return torch.stack(outs, dim=1).reshape(batch, steps, -1).to(value.dtype), state


@linear_attention.register_fake
def _(query, key, value, past_state, decay, beta, num_heads, scale):
    return torch.empty_like(value), torch.empty_like(past_state)


def _linear_attention_onnx(query, key, value, past_state, decay, beta, num_heads: int, scale: float):
    return _ms.LinearAttention(
        query,
        key,
        value,
        past_state,
        decay,
        beta,
        q_num_heads=num_heads,
        kv_num_heads=num_heads,
        update_rule="gated_delta",
        scale=scale,
        _outputs=2,
    )


# ---- multimodal rotary position embedding ---------------------------------------------
@torch.library.custom_op("qwen35::mrotary_embedding", mutates_args=())
def mrotary_embedding(
    x: torch.Tensor,
    position_ids: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int],
    num_heads: int,
    rotary_dim: int,
) -> torch.Tensor:
    """Interleaved mRoPE (Qwen3-VL / Qwen3.5 layout) on the first ``2 * F`` dims of each head,
    rotate-half convention (transformers' ``apply_rotary_pos_emb``).

    Frequency ``f`` takes its position from row 1 (height) when ``f % 3 == 1`` and
    ``f < 3 * section[1]``, row 2 (width) when ``f % 3 == 2`` and ``f < 3 * section[2]``, row 0
    (temporal) otherwise.

    Args:
        x: ``[B, S, num_heads * D]``; position_ids: ``[3, B, S]`` int64 (t, h, w), each below
        ``P``; cos_cache, sin_cache: ``[P, F]`` (``cos(p * inv_freq_f)``), ``rotary_dim = 2 F``.

    Returns:
        ``[B, S, num_heads * D]``.
    """
    from .layers import mrope_rows

    batch, steps, _ = x.shape
    n_freqs = cos_cache.shape[1]
    rows = torch.tensor(mrope_rows(mrope_section, n_freqs), device=x.device)
    pos = position_ids.index_select(0, rows).permute(1, 2, 0)  # [B, S, F]
    freq = torch.arange(n_freqs, device=x.device)
    cos = cos_cache[pos, freq].repeat(1, 1, 2).unsqueeze(2)  # [B, S, 1, 2F]
    sin = sin_cache[pos, freq].repeat(1, 1, 2).unsqueeze(2)
    heads = x.view(batch, steps, num_heads, -1)
    rot, rest = heads[..., : 2 * n_freqs], heads[..., 2 * n_freqs :]
    half = torch.cat([-rot[..., n_freqs:], rot[..., :n_freqs]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1).reshape(x.shape)


@mrotary_embedding.register_fake
def _(x, position_ids, cos_cache, sin_cache, mrope_section, num_heads, rotary_dim):
    return torch.empty_like(x)


def _mrotary_embedding_onnx(
    x, position_ids, cos_cache, sin_cache, mrope_section: list[int], num_heads: int, rotary_dim: int
):
    return _ms.MRotaryEmbedding(
        x,
        position_ids,
        cos_cache,
        sin_cache,
        mrope_section=list(mrope_section),
        num_heads=num_heads,
        rotary_embedding_dim=rotary_dim,
        interleaved=0,
        mrope_layout=1,
    )


# ---- grouped-query attention over a fixed-width KV cache --------------------------------
@torch.library.custom_op("qwen35::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``T`` new tokens over a KV buffer of fixed width ``L`` (reference).

    The new keys/values go to slots ``seqlens_k - T + 1 .. seqlens_k``; token ``t`` attends to
    slots ``<= seqlens_k - T + 1 + t``. Query head ``h`` uses KV head
    ``h // (num_heads / kv_num_heads)`` (grouped-query attention, Ainslie et al. 2023).
    ONNX Runtime's kernel writes the slots in place when ``present_*`` is bound to the same
    buffer as ``past_*``.

    Args:
        query: ``[B, T, num_heads*D]``; key, value: ``[B, T, kv_num_heads*D]``;
        past_key, past_value: ``[B, kv_num_heads, L, D]``; seqlens_k: ``[B]`` int32, the slot
        of the last new token; total_sequence_length: ``[]`` int32 (<= L).

    Returns:
        ``(output [B, T, num_heads*D], present_key, present_value [B, kv_num_heads, L, D])``.
    """
    batch, steps, _ = query.shape
    width, dim = past_key.shape[2], past_key.shape[3]
    q = query.view(batch, steps, num_heads, dim).transpose(1, 2)
    k = key.view(batch, steps, kv_num_heads, dim).transpose(1, 2)
    v = value.view(batch, steps, kv_num_heads, dim).transpose(1, 2)
    first = seqlens_k.long().view(-1, 1) - steps + 1  # [B, 1]
    pos = first + torch.arange(steps, device=query.device)  # [B, T] slot of each new token
    index = pos.view(batch, 1, steps, 1).expand(batch, kv_num_heads, steps, dim)
    present_key = past_key.scatter(2, index, k)
    present_value = past_value.scatter(2, index, v)
    allowed = torch.arange(width, device=query.device).view(1, 1, 1, -1) <= pos.view(batch, 1, steps, 1)
    out = layers.masked_attention(q, present_key, present_value, allowed, scale).reshape(batch, steps, -1)
    return out, present_key, present_value


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total_sequence_length, num_heads, kv_num_heads, scale):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 codes of ``x`` with ``scale`` (broadcast): ``clamp(round(x / scale), -128, 127)``, as ONNX
    Runtime's GroupQueryAttention writes a quantized cache (its CPU kernel, checked against it in the tests)."""
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8)


@torch.library.custom_op("qwen35::group_query_attention_int8", mutates_args=())
def group_query_attention_int8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`group_query_attention` over an int8 KV cache (reference): the new keys and values are written as
    :func:`quantize_int8` codes of ``k_scale`` / ``v_scale`` (``[1, kv_num_heads, 1, D]`` fp32, one scale per
    head and channel), and attention reads the whole cache dequantized (``codes * scale``).

    Args:
        query: ``[B, T, num_heads*D]`` fp32; key, value: ``[B, T, kv_num_heads*D]`` fp32; past_key, past_value:
            ``[B, kv_num_heads, L, D]`` int8; seqlens_k ``[B]`` int32; total_sequence_length ``[]`` int32.

    Returns:
        ``(output [B, T, num_heads*D] fp32, present_key, present_value [B, kv_num_heads, L, D] int8)``.
    """
    batch, steps, _ = query.shape
    dim = past_key.shape[3]
    k = key.view(batch, steps, kv_num_heads, dim).transpose(1, 2)
    v = value.view(batch, steps, kv_num_heads, dim).transpose(1, 2)
    first = seqlens_k.long().view(-1, 1) - steps + 1
    pos = first + torch.arange(steps, device=query.device)
    index = pos.view(batch, 1, steps, 1).expand(batch, kv_num_heads, steps, dim)
    present_key = past_key.scatter(2, index, quantize_int8(k, k_scale))
    present_value = past_value.scatter(2, index, quantize_int8(v, v_scale))
    q = query.view(batch, steps, num_heads, dim).transpose(1, 2)
    width = past_key.shape[2]
    allowed = torch.arange(width, device=query.device).view(1, 1, 1, -1) <= pos.view(batch, 1, steps, 1)
    keys, values = present_key.float() * k_scale, present_value.float() * v_scale
    out = layers.masked_attention(q, keys, values, allowed, scale).reshape(batch, steps, -1)
    return out, present_key, present_value


@group_query_attention_int8.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total, k_scale, v_scale, num_heads, kv_num_heads, scale):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


@torch.library.custom_op("qwen35::prompt_attention", mutates_args=())
def prompt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention over a right-padded prompt with no past (reference):
    ONNX Runtime's ``GroupQueryAttention`` without ``past_key`` / ``past_value``.

    Token ``t`` attends to tokens ``<= min(t, seqlens_k)``; query head ``h`` uses KV head
    ``h // (num_heads / kv_num_heads)`` (Ainslie et al. 2023). Rows past ``seqlens_k`` (padding)
    are meaningless: finite here, unspecified in ONNX Runtime (the caller masks them).

    Args:
        query: ``[B, T, num_heads*D]``; key, value: ``[B, T, kv_num_heads*D]``; seqlens_k:
            ``[B]`` int32, the index of the last real token; total_sequence_length: ``[]`` int32 (T).

    Returns:
        ``output [B, T, num_heads*D]``.
    """
    batch, steps, _ = query.shape
    dim = key.shape[-1] // kv_num_heads
    q = query.view(batch, steps, num_heads, dim).transpose(1, 2)
    k, v = (t.view(batch, steps, kv_num_heads, dim).transpose(1, 2) for t in (key, value))
    pos = torch.arange(steps, device=query.device)
    last = torch.minimum(pos.view(1, -1), seqlens_k.long().view(-1, 1))  # [B, T]
    allowed = pos.view(1, 1, 1, -1) <= last.view(batch, 1, steps, 1)
    return layers.masked_attention(q, k, v, allowed, scale).reshape(batch, steps, -1)


@prompt_attention.register_fake
def _(query, key, value, seqlens_k, total_sequence_length, num_heads, kv_num_heads, scale):
    return torch.empty_like(query)


# fmt: off
def _prompt_attention_onnx(query, key, value, seqlens_k, total_sequence_length, num_heads: int, kv_num_heads: int,
                           scale: float):
    output, _, _ = _ms.GroupQueryAttention(query, key, value, None, None, seqlens_k, total_sequence_length,
                                           num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, _outputs=3)
    return output


def _group_query_attention_onnx(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                num_heads: int, kv_num_heads: int, scale: float):
    return _ms.GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                   num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, _outputs=3)


def _group_query_attention_int8_onnx(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                     k_scale, v_scale, num_heads: int, kv_num_heads: int, scale: float):
    return _ms.GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                   None, None, None, None, None, k_scale, v_scale,
                                   num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
                                   k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8,
                                   _outputs=3)
# fmt: on


TRANSLATIONS = {
    torch.ops.qwen35.rms_norm.default: _rms_norm_onnx,
    torch.ops.qwen35.skip_rms_norm.default: _skip_rms_norm_onnx,
    torch.ops.qwen35.mrotary_embedding.default: _mrotary_embedding_onnx,
    torch.ops.qwen35.linear_attention_gate.default: _linear_attention_gate_onnx,
    torch.ops.qwen35.group_query_attention.default: _group_query_attention_onnx,
    torch.ops.qwen35.group_query_attention_int8.default: _group_query_attention_int8_onnx,
    torch.ops.qwen35.prompt_attention.default: _prompt_attention_onnx,
    torch.ops.qwen35.linear_attention.default: _linear_attention_onnx,
}
"""``custom_translation_table`` for ``torch.onnx.export``."""
