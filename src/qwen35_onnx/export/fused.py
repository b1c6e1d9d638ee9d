"""ONNX Runtime fused operators for ``--ops ort`` (``com.microsoft`` contrib domain).

Two torch custom ops stand for ONNX Runtime's fused kernels while tracing, and
``TRANSLATIONS`` (the ``custom_translation_table`` of ``torch.onnx.export``) turns each into
one contrib node:

- ``qwen35::linear_attention`` -> ``LinearAttention`` (``update_rule="gated_delta"``): the
  Gated DeltaNet recurrence ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)``,
  ``o_t = scale q_t^T S_t`` (Yang et al., "Gated Delta Networks", ICLR 2025), for prefill
  (T > 1) and decode (T = 1).
- ``qwen35::causal_conv`` -> ``CausalConvWithState`` (depthwise causal conv1d with carried
  state and fused SiLU).

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

MS_DOMAIN = "com.microsoft"


def _register_schemas() -> None:
    """Make the contrib ops known to onnx/onnxscript (ONNX Runtime has its own copies)."""
    P, A, T = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    optional = OpSchema.FormalParameterOption.Optional
    schemas = [
        OpSchema(
            "LinearAttention", MS_DOMAIN, 1,
            doc="ONNX Runtime contrib LinearAttention",
            inputs=[P("query", "T"), P("key", "T"), P("value", "T"), P("past_state", "S", param_option=optional),
                    P("decay", "T", param_option=optional), P("beta", "T", param_option=optional)],
            outputs=[P("output", "T"), P("present_state", "S")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("S", ["tensor(float)", "tensor(float16)"], "")],
            attributes=[A("q_num_heads", T.INT, ""), A("kv_num_heads", T.INT, ""), A("update_rule", T.STRING, ""),
                        A("scale", T.FLOAT, ""), A("chunk_size", T.INT, "")],
        ),
        OpSchema(
            "CausalConvWithState", MS_DOMAIN, 1,
            doc="ONNX Runtime contrib CausalConvWithState",
            inputs=[P("input", "T"), P("weight", "T"), P("bias", "T", param_option=optional),
                    P("past_state", "T", param_option=optional)],
            outputs=[P("output", "T"), P("present_state", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
            attributes=[A("ndim", T.INT, ""), A("activation", T.STRING, "")],
        ),
    ]
    for schema in schemas:
        try:
            onnx.defs.get_schema(schema.name, schema.since_version, schema.domain)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(schema)


_register_schemas()
_ms = onnxscript.values.Opset(MS_DOMAIN, 1)


# ---- linear attention ------------------------------------------------------------------
@torch.library.custom_op("qwen35::linear_attention", mutates_args=())
def linear_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_state: torch.Tensor,
    decay: torch.Tensor, beta: torch.Tensor, num_heads: int, scale: float,
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
        query, key, value, past_state, decay, beta,
        q_num_heads=num_heads, kv_num_heads=num_heads, update_rule="gated_delta", scale=scale, _outputs=2,
    )


# ---- causal conv with state ------------------------------------------------------------
@torch.library.custom_op("qwen35::causal_conv", mutates_args=())
def causal_conv(x: torch.Tensor, weight: torch.Tensor, past_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU continuing from ``past_state`` (reference).

    Args:
        x: ``[B, D, T]``; weight: ``[D, 1, K]``; past_state: ``[B, D, K-1]``.

    Returns:
        ``(output [B, D, T], present_state [B, D, K-1])`` (the last K-1 inputs).
    """
    window = torch.cat([past_state, x], dim=-1)
    y = F.conv1d(window, weight, groups=x.shape[1])
    return F.silu(y), window[..., window.shape[-1] - past_state.shape[-1]:].clone()


@causal_conv.register_fake
def _(x, weight, past_state):
    return torch.empty_like(x), torch.empty_like(past_state)


def _causal_conv_onnx(x, weight, past_state):
    return _ms.CausalConvWithState(x, weight, None, past_state, ndim=1, activation="silu", _outputs=2)


TRANSLATIONS = {
    torch.ops.qwen35.linear_attention.default: _linear_attention_onnx,
    torch.ops.qwen35.causal_conv.default: _causal_conv_onnx,
}
"""``custom_translation_table`` for ``torch.onnx.export``."""
