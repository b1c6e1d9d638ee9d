"""The exported graphs as ``nn.Module`` wrappers around a transformers
``Qwen3_5ForConditionalGeneration``: :class:`VisionGraph`, :class:`PrefillGraph`,
:class:`ChunkGraph` and :class:`DecodeGraph`. They reuse the checkpoint's own submodules (projections, norms, MLPs,
rotary embedding) and replace only the parts whose transformers form is not static-shape:
the cache objects, the gated delta rule, the causal conv and the attention mask.

Graph I/O (names as in the reference system; B = 1, except decode's B = the export's slots; L = capacity; with
several KV tiers L is the symbolic ``kv_width`` of the decode, chunk, verify and MTP graphs, and a prefill bucket's
smallest tier that holds it):

=========  ================================================================================
vision     pixel_values [N, patch_dim], pos_embed_indices [N, 4], pos_embed_weights [N, 4],
           rotary_position_ids [N, 2] -> image_embeds [N / merge**2, hidden] (N: one image's patches)
prefill    input_ids [B,S], attention_mask [B,S], position_ids [4,B,S], image_embeds [N,hidden]
           -> logits [B,1,V] (last real token; [B,S,V] with prefill_logits='all'),
              present_conv_states [n_linear,B,K-1,conv_dim],
           present_recurrent_states [n_linear,B,Hv,Dk,Dv] fp32, present_kv_cache [2*n_full,B,Hkv,L,D]
chunk      input_ids [B,C], chunk_mask [B,C], attention_mask [B,L], position_ids [4,B,C],
           image_embeds [C,hidden] and the past states as decode -> as decode (see ChunkGraph)
verify     input_ids [1,C] (the last sampled token and C-1 drafts), attention_mask [1,L], position_ids [4,1,C] and the
           past states as decode -> logits [1,C,V], hidden_states [1,C,hidden] fp32, present_conv_states.{t}.{n}
           [1,K-1,conv_dim] and present_recurrent_states.{t}.{n} [1,Hv,Dk,Dv] (after position t, linear layer n),
           the KV cache as chunk (see VerifyGraph)
mtp        input_ids [1,C] (the next tokens), hidden_states [1,C,hidden] fp32, chunk_mask [1,C], attention_mask
           [1,L], position_ids [4,1,C], image_embeds [C,hidden], past_mtp_kv_cache [2,1,Hkv,L,D] -> logits
           [1,1,V], mtp_hidden [1,1,hidden] fp32 (the last real position), present_mtp_kv_cache (see MtpGraph)
decode     input_ids [B,1], attention_mask [B,L], position_ids [4,B,1], (B > 1: active_rows [B] bool), past_conv_states,
           past_recurrent_states, past_kv_cache -> logits [B,1,V] and the three present_* states;
           with --ops ort and fixed KV every state goes one entry at a time: past_conv_states.{n},
           past_recurrent_states.{n} (n < n_linear), past_kv_cache.{j} [B,Hkv,L,D] (j < 2*n_full)
           and the matching present_*.{n}; the runtime binds them inside the stacked buffers
           (KV updated in place, conv/recurrent A/B)
=========  ================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..contract import KvDtype, KvMode, Ops, PrefillLogits, Quantization, ShapeContract
from . import fused, layers

VISION_INPUTS = ["pixel_values", "pos_embed_indices", "pos_embed_weights", "rotary_position_ids"]
VISION_OUTPUTS = ["image_embeds"]
PREFILL_INPUTS = ["input_ids", "attention_mask", "position_ids", "image_embeds"]
DECODE_INPUTS = [
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_conv_states",
    "past_recurrent_states",
    "past_kv_cache",
]
CHUNK_INPUTS = [
    "input_ids",
    "chunk_mask",
    "attention_mask",
    "position_ids",
    "image_embeds",
    "past_conv_states",
    "past_recurrent_states",
    "past_kv_cache",
]
STATE_OUTPUTS = ["present_conv_states", "present_recurrent_states", "present_kv_cache"]
TEXT_OUTPUTS = ["logits", *STATE_OUTPUTS]
HIDDEN_OUTPUT = "hidden_states"
"""The chunk and verify graphs' extra output in an export with draft tokens: the target's hidden state at every
position (after the final norm), which the MTP head reads."""
VERIFY_INPUTS = DECODE_INPUTS
MTP_INPUTS = ["input_ids", "hidden_states", "chunk_mask", "attention_mask", "position_ids", "image_embeds"]
MTP_OUTPUTS = ["logits", "mtp_hidden"]
MTP_KV = "mtp_kv_cache"
"""The MTP head's own KV cache: ``past_mtp_kv_cache`` / ``present_mtp_kv_cache`` stacked ``[2, 1, Hkv, L, D]``, or
with ``--ops ort`` per entry ``.0`` (k) and ``.1`` (v), written in place."""


#: Projections that read the same input, merged into one MatMul with ``--ops ort`` (one
#: weight-only-quantized MatMulNBits launch instead of several per layer): group name ->
#: (layer type it exists in, or None for every layer; submodule of the decoder layer; its
#: nn.Linear projections in output order).
MERGED_PROJECTIONS = {
    "gdn_in": ("linear_attention", "linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "attn_in": ("full_attention", "self_attn", ("q_proj", "k_proj", "v_proj")),
    "mlp_in": (None, "mlp", ("gate_proj", "up_proj")),
}


Recipe = Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]
"""How a constant of a graph is computed from the model's parameters: called with ``load``,
which gives a parameter's value (the parameter itself when the model holds real weights, the
checkpoint's tensor when it was built empty, see :mod:`.weight_source`)."""


def register_derived(module: nn.Module, name: str, recipe: Recipe) -> None:
    """Register the buffer ``name`` of ``module`` as ``recipe`` applied to the module's own
    parameters and keep the recipe in ``module.recipes[name]``, so that the export computes
    the value when it writes the weights. With ``empty`` (an export traces a model whose
    parameters hold no values, see :mod:`.weight_source`), the buffer is an uninitialized
    tensor of the recipe's shape and dtype (found on the ``meta`` device: nothing is computed
    or touched)."""
    with torch.no_grad():
        if getattr(module, "empty", False):
            shape = recipe(lambda parameter: torch.empty_like(parameter, device="meta"))
            value = torch.empty(shape.shape, dtype=shape.dtype)
        else:
            value = recipe(lambda parameter: parameter.detach())
    module.register_buffer(name, value, persistent=False)
    module.recipes[name] = recipe


def _rms_scale(norm: nn.Module) -> torch.Tensor:
    """The effective scale of a ``Qwen3_5RMSNorm``: ``1 + weight`` (zero-centred weight), fp32."""
    return norm.weight.float() + 1.0


class VisionGraph(nn.Module):
    """ViT tower for one image of any patch grid (the grid's patch count N is the inputs' first
    axis: static in a static-grid graph, dynamic in the any-grid graph).

    What depends on the grid alone comes in as inputs, computed on the host per grid
    (:mod:`qwen35_onnx.runtime.vision_positions`, a port of transformers'
    ``get_vision_interpolation_indices_and_weights`` / ``get_vision_position_ids``, which
    ``Qwen3_5VisionModel.forward`` also accepts precomputed): the taps and weights that resample the
    learned square position-embedding table to the grid, and the (row, col) ids of the 2-D rotary
    embedding. Mirrors ``Qwen3_5VisionModel.forward`` for a single image (one attention window over
    all patches).

    Inputs ``pixel_values [N, patch_dim]`` fp32, ``pos_embed_indices [N, taps]`` int64,
    ``pos_embed_weights [N, taps]`` fp32, ``rotary_position_ids [N, 2]`` int64; output
    ``image_embeds [N / merge**2, out_hidden]`` fp32.
    """

    def __init__(self, visual: nn.Module, contract: ShapeContract):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values, pos_embed_indices, pos_embed_weights, rotary_position_ids) -> torch.Tensor:
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

        visual = self.visual
        pixel_values = pixel_values.to(visual.patch_embed.proj.weight.dtype)  # fp32 in, the export's dtype inside
        table = visual.pos_embed.weight
        pos_embeds = (F.embedding(pos_embed_indices, table) * pos_embed_weights[:, :, None].to(table.dtype)).sum(1)
        hidden = visual.patch_embed(pixel_values) + pos_embeds.to(pixel_values.dtype)
        cos, sin = visual.rotary_pos_emb(hidden, rotary_position_ids)
        n_tokens = hidden.shape[0]
        for block in visual.blocks:
            attn = block.attn
            normed = block.norm1(hidden)
            q, k, v = attn.qkv(normed).reshape(n_tokens, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
            scores = (q @ k.transpose(-1, -2)) * attn.scaling
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = (probs @ v).transpose(0, 1).reshape(n_tokens, -1)
            hidden = hidden + attn.proj(out)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden).float()


class _TextGraph(nn.Module):
    """Shared pieces of the prefill and decode graphs (per-layer mixers around the
    checkpoint's decoder layers)."""

    HOLDS_KV_PRECISION = False
    """Whether the graph's KV cache is in the contract's :attr:`~qwen35_onnx.contract.ShapeContract.kv_precision`
    (the decode and verify graphs) or in the activations' dtype (the prompt's graphs: prefill buckets, chunks)."""

    def __init__(self, model: nn.Module, contract: ShapeContract):
        super().__init__()
        self.text = model.model.language_model
        self.lm_head = model.lm_head
        self.contract = contract
        self.linear_ids = [i for i, t in enumerate(contract.layer_types) if t == "linear_attention"]
        self.full_ids = [i for i, t in enumerate(contract.layer_types) if t == "full_attention"]
        # decoder layer -> its entry in the stacked conv / recurrent states, or its (k, v) pair in the KV cache
        self.linear_slot = {layer: n for n, layer in enumerate(self.linear_ids)}
        self.full_slot = {layer: n for n, layer in enumerate(self.full_ids)}
        self.empty = getattr(model, "empty_weights", False)
        self.recipes: dict[str, Recipe] = {}
        if contract.quantize != Quantization.NONE:
            # lm_head as MatMul(hidden, W^T) with W^T a constant [hidden, V], so that weight-only
            # quantization finds it (a tied W also feeds the embedding's Gather, so the plain
            # export keeps Transpose(W), one copy of the table, which the quantizer would skip)
            register_derived(self, "lm_head_t", lambda load: load(self.lm_head.weight).t().contiguous())
        self.merged_sizes: dict[tuple[int, str], list[int]] = {}
        if contract.kv_precision == KvDtype.INT8 and self.HOLDS_KV_PRECISION:
            self._register_kv_scales(model)
        if self.fused:
            self._merge_projections()
            # MRotaryEmbedding tables for every position below capacity: [L, F]
            rotary = self.text.rotary_emb
            freqs = torch.arange(contract.capacity, dtype=torch.float32)[:, None] * rotary.inv_freq.float()[None]
            dtype = self.text.embed_tokens.weight.dtype
            self.register_buffer("rope_cos", (freqs.cos() * rotary.attention_scaling).to(dtype), persistent=False)
            self.register_buffer("rope_sin", (freqs.sin() * rotary.attention_scaling).to(dtype), persistent=False)

    # ---- the KV cache's precision (ShapeContract.kv_dtype) ------------------------------------
    def _register_kv_scales(self, model: nn.Module) -> None:
        """The int8 cache's scales as constants: ``kv_scale_k_{n}`` / ``kv_scale_v_{n}`` ``[1, Hkv, 1, D]`` fp32 of
        full-attention layer ``n``, from ``model.kv_scales`` (:func:`.calibration.kv_scales`)."""
        scales = getattr(model, "kv_scales", None)
        if scales is None or len(scales) != len(self.full_ids):
            raise ValueError(
                "an int8 KV cache needs the per-channel scales of every full-attention layer, calibrated on the "
                "checkpoint (export.calibration.kv_scales) and set as model.kv_scales"
            )
        for n, pair in enumerate(scales):
            for which, value in zip("kv", pair):
                scale = value.detach().float().reshape(1, value.shape[0], 1, value.shape[1]).contiguous()
                register_derived(self, f"kv_scale_{which}_{n}", lambda load, scale=scale: scale)

    def kv_dtype(self, n: int | None) -> torch.dtype:
        """The storage dtype of full-attention layer ``n``'s cache (None: the MTP head's own cache): the contract's
        KV precision in the decode and verify graphs, the activations' dtype in the prompt's graphs."""
        if n is None:
            name = self.contract.mtp_kv_dtype
        else:
            name = self.contract.kv_precision if self.HOLDS_KV_PRECISION else self.contract.prompt_kv_dtype
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[name]

    def kv_scale(self, n: int, which: str) -> torch.Tensor:
        """The int8 cache's scale ``[1, Hkv, 1, D]`` fp32 of layer ``n``'s keys (``which='k'``) or values ('v')."""
        return getattr(self, f"kv_scale_{which}_{n}")

    def kv_store(self, t: torch.Tensor, n: int | None, which: str) -> torch.Tensor:
        """Keys or values ``[B, Hkv, S, D]`` as layer ``n``'s cache holds them: cast to its dtype, or int8 codes
        (:func:`.fused.quantize_int8` of its scale)."""
        dtype = self.kv_dtype(n)
        if dtype == torch.int8:
            return fused.quantize_int8(t, self.kv_scale(n, which))
        return t.to(dtype)

    def kv_load(self, t: torch.Tensor, n: int | None, which: str, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``n``'s cache entry ``t`` as ``dtype`` values (int8: codes times the scale)."""
        if t.dtype == torch.int8:
            return (t.float() * self.kv_scale(n, which)).to(dtype)
        return t.to(dtype)

    def decoder_layers(self) -> list[tuple[int, nn.Module, str]]:
        """``(index, decoder layer, layer type)`` of every decoder layer this graph runs (the index names its
        merged constants, see :meth:`projections`)."""
        return [(i, layer, self.contract.layer_types[i]) for i, layer in enumerate(self.text.layers)]

    def layer(self, i: int) -> nn.Module:
        """The decoder layer of index ``i`` (:meth:`decoder_layers`)."""
        return self.text.layers[i]

    def _merge_projections(self) -> None:
        """Register, for every group of :data:`MERGED_PROJECTIONS` in every layer, the
        concatenated ``W^T`` ``[hidden, sum(out)]`` as a constant (groups with a bias stay
        separate)."""
        for i, layer, layer_type in self.decoder_layers():
            for group, (kind, owner, names) in MERGED_PROJECTIONS.items():
                if kind not in (None, layer_type):
                    continue
                linears = [getattr(getattr(layer, owner), name) for name in names]
                if any(linear.bias is not None for linear in linears):
                    continue

                def merged(load, linears=linears):
                    return torch.cat([load(linear.weight) for linear in linears], dim=0).t().contiguous()

                register_derived(self, f"{group}_t_{i}", merged)
                self.merged_sizes[(i, group)] = [linear.out_features for linear in linears]

    def projections(
        self, i: int, group: str, hidden: torch.Tensor, first_parts: Sequence[int] = ()
    ) -> list[torch.Tensor]:
        """The projections of ``group`` (:data:`MERGED_PROJECTIONS`) of layer ``i`` applied to
        ``hidden [B, S, hidden]``, in their listed order: one MatMul with the merged constant
        and a Split when merged, else each nn.Linear. ``first_parts``: sizes (summing to the first
        projection's width) to cut the first output into, in the same Split when merged."""
        if (i, group) in self.merged_sizes:
            sizes = self.merged_sizes[(i, group)]
            if first_parts:
                sizes = [*first_parts, *sizes[1:]]
            return list(torch.split(hidden @ getattr(self, f"{group}_t_{i}"), sizes, dim=-1))
        _, owner, names = MERGED_PROJECTIONS[group]
        module = getattr(self.layer(i), owner)
        outputs = [getattr(module, name)(hidden) for name in names]
        if first_parts:
            outputs[:1] = torch.split(outputs[0], list(first_parts), dim=-1)
        return outputs

    def mlp(self, i: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of layer ``i``: ``down(act(gate(x)) * up(x))``."""
        gate, up = self.projections(i, "mlp_in", hidden)
        return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """What :meth:`attention_qkv` needs for mRoPE from ``position_ids [4, B, S]``: cos/sin
        ``[B, S, rotary_dim]`` (portable), or the three mRoPE rows ``[3, B, S]`` that
        MRotaryEmbedding looks up in its tables (``--ops ort``)."""
        if self.fused:
            return position_ids[1:]
        return layers.mrope_cos_sin(self.text.rotary_emb, hidden, position_ids[1:])

    def gdn_projections(self, i: int, attn: nn.Module, hidden: torch.Tensor, packed: bool = True):
        """in_proj_* of Gated DeltaNet layer ``i``: qkv and z in the export's dtype, g/beta ``[B, S, Hv]``
        fp32 (the gates compute in fp32 whatever the dtype). qkv is one packed ``[B, S, D]`` tensor, or
        with ``packed=False`` the list ``[q, k, v]`` of ``[B, S, key_dim | key_dim | value_dim]`` cut by the
        projections' own Split (for :meth:`conv_prefill`)."""
        parts = () if packed else self.qkv_sizes(attn)
        *qkv, z, b, a = self.projections(i, "gdn_in", hidden, first_parts=parts)
        qkv = qkv[0] if packed else qkv
        decay_scale = -attn.A_log.float().exp()
        if self.fused:
            g, beta = fused.linear_attention_gate(a.float(), attn.dt_bias.float(), decay_scale, b.float())
            return qkv, z, g, beta
        beta = b.float().sigmoid()
        g = decay_scale * F.softplus(a.float() + attn.dt_bias.float())
        return qkv, z, g, beta

    @property
    def fused(self) -> bool:
        """ONNX Runtime fused operators (``--ops ort``) instead of standard ONNX ones."""
        return self.contract.ops == Ops.ORT

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head``: ``[B, S, hidden] -> [B, S, V]`` fp32 (computed in the export's dtype)."""
        if self.contract.quantize != Quantization.NONE:
            return (hidden @ self.lm_head_t).float()
        return self.lm_head(hidden).float()

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A ``Qwen3_5RMSNorm`` (scale ``1 + weight``); one SimplifiedLayerNormalization with ``--ops ort``."""
        if not self.fused:
            return module(x)
        return fused.rms_norm(x, _rms_scale(module).to(x.dtype), module.eps)

    def l2norm(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' ``l2norm`` (``x / sqrt(sum x^2 + 1e-6)``) of the last axis ``D``; with
        ``--ops ort`` the same value as an RMSNorm: scale ``D^-1/2`` and epsilon ``1e-6 / D``."""
        if not self.fused:
            return layers.l2norm(x)
        dim = x.shape[-1]
        return fused.rms_norm(x, torch.full((dim,), dim**-0.5, dtype=x.dtype, device=x.device), 1e-6 / dim)

    @staticmethod
    def conv_prefill(attn: nn.Module, parts: Sequence[torch.Tensor], n_valid: torch.Tensor, past=None):
        """Causal conv + SiLU over the prompt (or a chunk of it after the conv state ``past``
        ``[B, K-1, D]``), part by part: ``parts`` q, k, v ``[B, S, D_j]`` (time-major, summing to D) ->
        (outputs ``[B, S, D_j]`` each, state of the last real tokens ``[B, K-1, D]``). Standard ONNX
        (Transpose, Pad or Concat, a depthwise Conv, Sigmoid * x, GatherElements) with either ``--ops``:
        ONNX Runtime's fused ``CausalConvWithState`` measured 13-15x slower at 512 tokens (0.8B, 18
        layers: 132-152 ms against 10 ms) and no faster at one token. A conv per part spares the Split
        of the packed output, and each of its transposes moves only its part (0.8B, 18 layers at 512
        tokens: 116-119 against 142-151 ms; ``benchmarks/README.md``, issue 19)."""
        sizes = [int(x.shape[-1]) for x in parts]
        weights = torch.split(attn.conv1d.weight, sizes, dim=0)
        pasts = torch.split(past, sizes, dim=-1) if past is not None else [None] * len(parts)
        outputs, states = [], []
        for x, weight, state in zip(parts, weights, pasts):
            mixed, state = layers.causal_conv_prefill(x.transpose(1, 2), weight, n_valid, state)
            outputs.append(mixed.transpose(1, 2))
            states.append(state)
        return outputs, torch.cat(states, dim=-1)

    def conv_step(self, i: int, qkv: torch.Tensor, past: torch.Tensor):
        """One decode step of the causal conv of layer ``i``: ``[B, 1, D]`` and state ``[B, K-1, D]``
        (standard ONNX, see :meth:`conv_prefill`), with the kernel ``[K, D]`` a constant of its own."""
        return layers.causal_conv_step(qkv, past, getattr(self, f"conv_kernel_t_{i}"))

    def recurrence(self, q, k, v, g, beta, state, prompt: bool):
        """Gated delta rule: q, k ``[B, S, Hk, Dk]``, v ``[B, S, Hv, Dv]``, g/beta ``[B, S, Hv]``,
        state ``[B, Hv, Dk, Dv]`` fp32 -> (core ``[B, S, Hv, Dv]``, new state)."""
        if not self.fused:
            if prompt:
                return layers.gated_delta_rule_chunked(q, k, v, g, beta, state, self.contract.chunk_size)
            return layers.gated_delta_rule_step(q, k, v, g, beta, state)
        batch, steps, n_v, d_v = v.shape
        n_k, d_k = k.shape[-2:]
        # the fused op takes L2-normalised keys and packed heads (as many q/k heads as v heads)
        q = layers.repeat_heads(self.l2norm(q.float()), n_v // n_k, dim=2).reshape(batch, steps, -1)
        k = layers.repeat_heads(self.l2norm(k.float()), n_v // n_k, dim=2).reshape(batch, steps, -1)
        out, state = fused.linear_attention(
            q, k, v.float().reshape(batch, steps, -1), state.float(), g.float(), beta.float(), n_v, d_k**-0.5
        )
        return out.reshape(batch, steps, n_v, d_v).to(v.dtype), state

    @staticmethod
    def qkv_sizes(attn: nn.Module) -> list[int]:
        """Widths of q, k, v in a Gated DeltaNet layer's packed qkv: key_dim, key_dim, value_dim."""
        return [attn.key_dim, attn.key_dim, attn.value_dim]

    @staticmethod
    def qkv_heads(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Conv outputs q, k ``[B, S, key_dim]``, v ``[B, S, value_dim]`` -> q, k ``[B, S, Hk, Dk]`` and
        v ``[B, S, Hv, Dv]``."""
        batch, seq_len, _ = q.shape
        return (
            q.reshape(batch, seq_len, -1, attn.head_k_dim),
            k.reshape(batch, seq_len, -1, attn.head_k_dim),
            v.reshape(batch, seq_len, -1, attn.head_v_dim),
        )

    def prompt_linear_attention(self, i: int, layer: nn.Module, h, valid_f, n_valid, past_conv, past_rec):
        """Gated DeltaNet layer ``i`` over prompt tokens ``h [B, S, hidden]`` (right-padded: ``valid_f
        [B, S, 1]`` 1.0 on real tokens, ``n_valid [B]`` of them) after the conv state ``past_conv``
        (None: a prompt's start) and the recurrent state ``past_rec``; padded tokens neither decay
        (g = 0) nor write (beta = 0) and leave the conv state alone. Returns (output, conv state,
        recurrent state)."""
        attn = layer.linear_attn
        h = h * valid_f.to(h.dtype)
        qkv, z, g, beta = self.gdn_projections(i, attn, h, packed=False)
        mixed, conv_state = self.conv_prefill(attn, qkv, n_valid, past_conv)
        q, k, v = self.qkv_heads(attn, *mixed)
        g = g * valid_f
        beta = beta * valid_f.to(beta.dtype)
        core, state = self.recurrence(q, k, v, g, beta, past_rec, prompt=True)
        return self.gdn_output(attn, core, z), conv_state, state

    def gdn_output(self, attn: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm + out_proj: core ``[B, S, Hv, Dv]``, z ``[B, S, Hv*Dv]`` -> ``[B, S, hidden]``."""
        batch, seq_len = core.shape[:2]
        if self.fused:
            # one SimplifiedLayerNormalization over each head, then * SiLU(z) in fp32 (transformers'
            # Qwen3_5RMSNormGated); ONNX Runtime's fused GatedRMSNorm measured 47x slower at 512 tokens
            # (0.8B, 18 layers: 216 ms against 4.6 ms) and 10x at one (0.47 ms against 0.05 ms)
            normed = fused.rms_norm(core, attn.norm.weight.to(core.dtype), attn.norm.variance_epsilon)
            out = normed.reshape(batch, seq_len, -1).float() * F.silu(z.float())
            return attn.out_proj(out.to(core.dtype))
        out = attn.norm(core.reshape(-1, attn.head_v_dim), z.reshape(-1, attn.head_v_dim))
        return attn.out_proj(out.reshape(batch, seq_len, -1))

    def attention_qkv(self, i: int, attn: nn.Module, hidden: torch.Tensor, rope):
        """Gated full attention projections of layer ``i``: q ``[B,Hq,S,D]``, k/v ``[B,Hkv,S,D]``
        (rotated), gate ``[B,S,Hq*D]``; ``rope`` from :meth:`rotary`."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        batch, seq_len = hidden.shape[:2]
        q_gate, k, v = self.projections(i, "attn_in", hidden)
        q, gate = torch.chunk(q_gate.view(batch, seq_len, -1, attn.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(batch, seq_len, -1)
        q = self.norm(attn.q_norm, q)
        k = self.norm(attn.k_norm, k.view(batch, seq_len, -1, attn.head_dim))
        v = v.view(batch, seq_len, -1, attn.head_dim).transpose(1, 2)
        if self.fused:
            rotary = self.text.rotary_emb
            q, k = (
                fused.mrotary_embedding(
                    t.reshape(batch, seq_len, -1),
                    rope,
                    self.rope_cos,
                    self.rope_sin,
                    list(rotary.mrope_section),
                    t.shape[2],
                    2 * self.rope_cos.shape[1],
                )
                .view(batch, seq_len, -1, attn.head_dim)
                .transpose(1, 2)
                for t in (q, k)
            )
            return q, k, v, gate
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rope)
        return q, k, v, gate

    @staticmethod
    def _packed_heads(attn: nn.Module, q, k, v):
        """q ``[B, Hq, T, D]``, k / v ``[B, Hkv, T, D]`` -> GroupQueryAttention's packed
        ``[B, T, H*D]`` q, k, v and its ``(num_heads, kv_num_heads)``."""
        batch, steps = q.shape[0], q.shape[2]
        q, k, v = (t.transpose(1, 2).reshape(batch, steps, -1) for t in (q, k, v))
        return q, k, v, (q.shape[-1] // attn.head_dim, k.shape[-1] // attn.head_dim)

    def attention_in_place(self, attn: nn.Module, q, k, v, past_k, past_v, seqlens_k, total, n: int | None):
        """``--ops ort``: one GroupQueryAttention of q ``[B, Hq, T, D]`` and the new k, v ``[B, Hkv, T,
        D]`` over the capacity-wide entries ``past_k`` / ``past_v`` ``[B, Hkv, L, D]`` of full-attention layer
        ``n`` (None: the MTP head's cache), the new tokens at slots ``seqlens_k - T + 1 .. seqlens_k`` (written in
        place when the runtime binds present to past); returns ``(out [B, T, Hq*D], k_all, v_all)``. The node
        computes in the cache's float type (fp32 for an int8 cache, whose scales it is given), q, k, v cast to it
        and the output cast back."""
        dtype, cache = q.dtype, self.kv_dtype(n)
        q, k, v, heads = self._packed_heads(attn, q, k, v)
        if cache == torch.int8:
            q, k, v = q.float(), k.float(), v.float()
            scales = self.kv_scale(n, "k"), self.kv_scale(n, "v")
            out, k_all, v_all = fused.group_query_attention_int8(
                q, k, v, past_k, past_v, seqlens_k, total, *scales, *heads, attn.scaling
            )
        else:
            q, k, v = q.to(cache), k.to(cache), v.to(cache)
            out, k_all, v_all = fused.group_query_attention(
                q, k, v, past_k, past_v, seqlens_k, total, *heads, attn.scaling
            )
        return out.to(dtype), k_all, v_all

    def prompt_attention(self, attn: nn.Module, q, k, v, valid):
        """``--ops ort``: one GroupQueryAttention (no past) of a whole right-padded prompt: q ``[B, Hq,
        S, D]``, k / v ``[B, Hkv, S, D]`` (zero at padded positions), ``valid [B, S]`` bool (a prefix of
        real tokens) -> ``[B, S, Hq*D]``, zero at padded positions: ONNX Runtime leaves those rows
        unspecified (its documentation; its fp16 kernel reads scratch memory there) and a NaN would
        reach the states through the masks' products. On the 0.8B prefill of 512 tokens it replaced
        the MatMul / Where / Softmax / MatMul chain over the expanded KV heads: 61 against 89 ms for
        the 6 layers (``benchmarks/README.md``)."""
        steps = q.shape[2]
        q, k, v, heads = self._packed_heads(attn, q, k, v)
        seqlens_k = (valid.sum(dim=-1) - 1).to(torch.int32)  # the last real token
        total = torch.full((), steps, dtype=torch.int32, device=q.device)
        out = fused.prompt_attention(q, k, v, seqlens_k, total, *heads, attn.scaling)
        return out.masked_fill(~valid.unsqueeze(-1), 0)

    def chunk_attention(self, attn: nn.Module, q, k, v, past_k, past_v, past_len: torch.Tensor, n: int | None):
        """Attention of ``T`` new tokens (q ``[B, Hq, T, D]``, k / v ``[B, Hkv, T, D]``) written to slots
        ``past_len .. past_len + T - 1`` of the capacity-wide ``past_k`` / ``past_v`` ``[B, Hkv, L, D]`` (the cache
        of full-attention layer ``n``, None: the MTP head's), token ``t`` attending to slots ``<= past_len + t``
        (``past_len [B]`` int64): one GroupQueryAttention with ``--ops ort`` (written in place when the runtime
        binds present to past), else a scatter and a masked attention. Returns ``(out [B, T, Hq*D], k_all,
        v_all)``."""
        steps, width = q.shape[2], past_k.shape[2]
        if self.contract.kv_in_place:
            seqlens_k = (past_len + steps - 1).to(torch.int32)
            total = (past_len + steps).to(torch.int32).reshape(())
            return self.attention_in_place(attn, q, k, v, past_k, past_v, seqlens_k, total, n)
        slots = past_len.view(-1, 1) + torch.arange(steps, device=q.device).view(1, -1)  # [B, T]
        allowed = torch.arange(width, device=q.device).view(1, 1, -1) <= slots.unsqueeze(-1)  # [B, T, L]
        index = slots.view(slots.shape[0], 1, steps, 1).expand(k.shape)
        k_all = past_k.scatter(2, index, self.kv_store(k, n, "k"))
        v_all = past_v.scatter(2, index, self.kv_store(v, n, "v"))
        keys, values = self.kv_load(k_all, n, "k", q.dtype), self.kv_load(v_all, n, "v", q.dtype)
        out = layers.masked_attention(q, keys, values, allowed.unsqueeze(1), attn.scaling)
        return out, k_all, v_all

    def chunk_full_mixer(self, rope, past_kv, past_len: torch.Tensor, kv: list):
        """The full-attention mixer of a graph over new tokens after a past (chunk, verify): layer ``i``'s
        :meth:`chunk_attention` over its entries ``2n``, ``2n + 1`` of ``past_kv``, the new entries appended to
        ``kv``."""

        def full_mixer(i, layer, h):
            attn = layer.self_attn
            n = self.full_slot[i]
            q, k, v, gate = self.attention_qkv(i, attn, h, rope)
            out, k_all, v_all = self.chunk_attention(attn, q, k, v, past_kv[2 * n], past_kv[2 * n + 1], past_len, n)
            kv.extend([k_all, v_all])
            return self.attention_output(attn, out, gate)

        return full_mixer

    @staticmethod
    def attention_output(attn: nn.Module, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        batch, seq_len = out.shape[:2]
        out = out.reshape(batch, seq_len, -1) * torch.sigmoid(gate)
        return attn.o_proj(out)

    def run_layers(self, hidden: torch.Tensor, linear_mixer, full_mixer) -> torch.Tensor:
        """Decoder stack: pre-norm mixer + residual, pre-norm MLP + residual, final norm. With
        ``--ops ort`` every residual add is fused into the norm that follows it."""
        if self.fused:
            return self._run_layers_fused(hidden, linear_mixer, full_mixer)
        for i, layer in enumerate(self.text.layers):
            mixer = linear_mixer if layer.block_type == "linear_attention" else full_mixer
            hidden = hidden + mixer(i, layer, self.norm(layer.input_layernorm, hidden))
            hidden = hidden + self.mlp(i, layer, self.norm(layer.post_attention_layernorm, hidden))
        return self.norm(self.text.norm, hidden)

    def _run_layers_fused(self, hidden: torch.Tensor, linear_mixer, full_mixer) -> torch.Tensor:
        def skip_norm(x, residual, module):
            return fused.skip_rms_norm(x, residual, _rms_scale(module).to(x.dtype), module.eps)

        layers_ = list(self.text.layers)
        residual, h = hidden, self.norm(layers_[0].input_layernorm, hidden)
        for i, layer in enumerate(layers_):
            mixer = linear_mixer if layer.block_type == "linear_attention" else full_mixer
            h, residual = skip_norm(mixer(i, layer, h), residual, layer.post_attention_layernorm)
            after = layers_[i + 1].input_layernorm if i + 1 < len(layers_) else self.text.norm
            h, residual = skip_norm(self.mlp(i, layer, h), residual, after)
        return h


class PrefillGraph(_TextGraph):
    """Prompt -> logits and the three decode states (see module docstring for shapes).

    ``attention_mask`` must be a contiguous prefix of ones; padded positions neither decay
    nor write the recurrent state, leave the conv state alone, stay zero in the KV cache and
    are ignored by attention. In fixed mode the KV output is zero-padded to the smallest KV tier that holds the
    bucket (:meth:`~qwen35_onnx.contract.ShapeContract.prefill_kv_width`: the capacity with one tier).
    """

    def forward(self, input_ids, attention_mask, position_ids, image_embeds):
        contract = self.contract
        valid = attention_mask.bool()
        valid_f = valid.unsqueeze(-1).to(torch.float32)
        n_valid = attention_mask.sum(dim=-1)
        seq_len = input_ids.shape[1]

        hidden = self.text.embed_tokens(input_ids)
        hidden = layers.inject_image_embeds(hidden, input_ids, image_embeds, contract.image_token_id)
        rope = self.rotary(hidden, position_ids)
        causal = None
        if not self.fused:  # (GroupQueryAttention masks by position and seqlens_k itself)
            # Causal mask from the running count of real tokens rather than from arange(S): the
            # latter is constant-folded for small static S only, which would make the node count
            # depend on the bucket. For real queries i and keys j, count_j <= count_i iff j <= i.
            count = attention_mask.cumsum(dim=-1)
            causal = (count.unsqueeze(1) <= count.unsqueeze(2)) & valid.unsqueeze(1)  # [B, S(query), S(key)]
        conv_states, rec_states, kv = [], [], []

        def linear_mixer(i, layer, h):
            state0 = torch.zeros(contract.recurrent_state_shape[1:], dtype=torch.float32, device=h.device)
            out, conv_state, state = self.prompt_linear_attention(i, layer, h, valid_f, n_valid, None, state0)
            conv_states.append(conv_state)
            rec_states.append(state)
            return out

        def full_mixer(i, layer, h):
            attn = layer.self_attn
            q, k, v, gate = self.attention_qkv(i, attn, h, rope)
            keep = valid.view(valid.shape[0], 1, -1, 1).to(k.dtype)
            k, v = k * keep, v * keep
            if self.fused:
                out = self.prompt_attention(attn, q, k, v, valid)
            else:
                out = layers.masked_attention(q, k, v, causal.unsqueeze(1), attn.scaling)
            if contract.kv_mode == KvMode.FIXED:  # zero-padded to the smallest KV tier that holds the bucket
                n = self.full_slot[i]
                k, v = (
                    F.pad(self.kv_store(t, n, w), (0, 0, 0, contract.prefill_kv_width(seq_len) - seq_len))
                    for t, w in ((k, "k"), (v, "v"))
                )
            kv.extend([k, v])
            return self.attention_output(attn, out, gate)

        hidden = self.run_layers(hidden, linear_mixer, full_mixer)
        if contract.prefill_logits == PrefillLogits.LAST:
            # only the last real token's row: [B, 1, hidden] -> logits [B, 1, V]
            last = (n_valid - 1).view(-1, 1, 1).expand(hidden.shape[0], 1, hidden.shape[2])
            hidden = torch.gather(hidden, 1, last)
        logits = self.logits(hidden)
        return logits, torch.stack(conv_states), torch.stack(rec_states), torch.stack(kv)


class DecodeGraph(_TextGraph):
    """One token per row -> logits and updated states; ``B`` is the export's decode slots
    (``--slots``, :attr:`ShapeContract.slots`), each row one slot's sequence with its own mask row,
    positions and states. With more than one slot the input ``active_rows [B]`` (bool) says which rows
    step: an idle row (False) leaves its recurrent state exactly as it was (no decay, no write) and
    passes its conv state through; its k, v go to the KV slot its mask claims, which the runtime makes
    its sequence's next free slot (so it costs attention over its own length, and a free slot's row
    over one position); its logits are not read.

    Fixed mode: ``attention_mask [B, L]`` already holds the new token; the graph derives the
    write slot ``cache_pos = sum(mask) - 1``, writes the new k and v into that slot (one
    ScatterElements per k and per v: ``2 * n_full`` slot writes) and attends to
    ``slot <= cache_pos AND mask``. Capacity is the static width L.
    Dynamic mode: the past KV has ``P`` tokens, the mask ``P + 1``; the present KV grows by one.
    Per entry (``--ops ort`` with fixed KV, :attr:`ShapeContract.kv_in_place`): ``past_conv``,
    ``past_rec`` and ``past_kv`` are tuples of per-layer entries (``past_kv``: ``2 * n_full``
    entries ``[B, Hkv, L, D]``) and the graph returns the present states entry by entry too;
    each full-attention layer is one GroupQueryAttention node (slot write + attention over
    ``slot <= cache_pos``), whose present KV entries the runtime binds to the past buffers.
    """

    HOLDS_KV_PRECISION = True

    def __init__(self, model: nn.Module, contract: ShapeContract):
        super().__init__(model, contract)
        for i in self.linear_ids:
            conv = self.text.layers[i].linear_attn.conv1d
            # the depthwise kernel [D, 1, K] as the time-major step reads it, [K, D]: one constant,
            # not a Squeeze and a Transpose of the weight at every step
            register_derived(
                self, f"conv_kernel_t_{i}", lambda load, conv=conv: load(conv.weight)[:, 0, :].t().contiguous()
            )

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        contract = self.contract
        active = None
        if contract.slots > 1:
            active, *rest = rest  # [B] bool
        past_conv, past_rec, past_kv = rest
        hidden = self.text.embed_tokens(input_ids)
        rope = self.rotary(hidden, position_ids)
        mask = attention_mask.bool()
        if contract.kv_mode == KvMode.FIXED:
            cache_pos = attention_mask.sum(dim=-1) - 1  # [B]
            slots = torch.arange(attention_mask.shape[1], device=input_ids.device).view(1, -1)
            allowed = (slots <= cache_pos.view(-1, 1)) & mask
        else:
            allowed = mask
        allowed = allowed.view(allowed.shape[0], 1, 1, -1)
        if not contract.kv_in_place:
            # Stacked states: one Split per state rather than a Gather per layer (a Gather copies
            # its entry; OpenVINO CPU measured 2.8 ms per KV entry at 0.8B, capacity 1280).
            past_conv, past_rec, past_kv = past_conv.unbind(0), past_rec.unbind(0), past_kv.unbind(0)
        conv_states, rec_states, kv = [], [], []
        if contract.kv_in_place:
            seqlens_k = cache_pos.to(torch.int32)
            total = torch.full((), contract.capacity, dtype=torch.int32, device=input_ids.device)

        def linear_mixer(i, layer, h):
            attn = layer.linear_attn
            n = self.linear_slot[i]
            qkv, z, g, beta = self.gdn_projections(i, attn, h)
            mixed, conv_state = self.conv_step(i, qkv, past_conv[n])
            if active is not None:  # idle rows: no decay (g = 0) and no write (beta = 0), the conv state kept
                keep = active.view(-1, 1, 1)
                g = g * keep.to(g.dtype)
                beta = beta * keep.to(beta.dtype)
                conv_state = torch.where(keep, conv_state, past_conv[n])
            q, k, v = self.qkv_heads(attn, *torch.split(mixed, self.qkv_sizes(attn), dim=-1))
            core, state = self.recurrence(q, k, v, g, beta, past_rec[n], prompt=False)
            conv_states.append(conv_state)
            rec_states.append(state)
            return self.gdn_output(attn, core, z)

        def full_mixer(i, layer, h):
            attn = layer.self_attn
            n = self.full_slot[i]
            q, k, v, gate = self.attention_qkv(i, attn, h, rope)
            past_k, past_v = past_kv[2 * n], past_kv[2 * n + 1]
            if contract.kv_in_place:
                out, k_all, v_all = self.attention_in_place(attn, q, k, v, past_k, past_v, seqlens_k, total, n)
                kv.extend([k_all, v_all])
                return self.attention_output(attn, out, gate)
            if contract.kv_mode == KvMode.FIXED:
                k_all = layers.write_kv_slot(past_k, self.kv_store(k, n, "k"), cache_pos)
                v_all = layers.write_kv_slot(past_v, self.kv_store(v, n, "v"), cache_pos)
            else:
                k_all, v_all = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            kv.extend([k_all, v_all])
            keys, values = self.kv_load(k_all, n, "k", q.dtype), self.kv_load(v_all, n, "v", q.dtype)
            out = layers.masked_attention(q, keys, values, allowed, attn.scaling)
            return self.attention_output(attn, out, gate)

        hidden = self.run_layers(hidden, linear_mixer, full_mixer)
        logits = self.logits(hidden)
        if contract.kv_in_place:
            return logits, *conv_states, *rec_states, *kv
        return logits, torch.stack(conv_states), torch.stack(rec_states), torch.stack(kv)


class ChunkGraph(_TextGraph):
    """Chunked prefill: ``C`` new tokens continuing from the states of the tokens before them ->
    the last real token's logits and the updated states.

    Inputs: ``input_ids [B, C]``; ``chunk_mask [B, C]``, a prefix of ones over the chunk's real
    tokens (the rest is padding); ``attention_mask [B, L]``, as in decode the KV slots in use once
    this chunk's real tokens are written (a prefix of ones); ``position_ids [4, B, C]``;
    ``image_embeds [C, hidden]``, the image embeddings of the chunk's image tokens in order; and
    the past conv / recurrent / KV states as decode takes them (per entry with
    :attr:`ShapeContract.kv_in_place`). The graph derives ``n_new = sum(chunk_mask)`` and
    ``past = sum(attention_mask) - n_new``, writes the chunk's keys and values to slots
    ``past .. past + C - 1`` (padding included: those slots are free, and a real token never
    attends to a later slot) and lets chunk token ``i`` attend to slots ``<= past + i``. The
    runtime keeps ``past + C <= L``. Padded tokens neither decay nor write the recurrent state
    and leave the conv state alone (as in :class:`PrefillGraph`). With ``--ops ort`` each
    full-attention layer is one GroupQueryAttention node over the capacity-wide entry, which the
    runtime binds as both past and present (KV written in place).

    Outputs: ``logits [B, 1, V]`` (the last real token; ``[B, C, V]`` with prefill_logits='all')
    and the present states named as decode's.

    Source: chunked prefill as in vLLM / Sarathi (Agrawal et al. 2023, "SARATHI: Efficient LLM
    Inference by Piggybacking Decodes with Chunked Prefills"); the state carried between chunks is
    transformers' ``Qwen3_5DynamicCache`` (conv and recurrent states, KV).
    """

    def forward(self, input_ids, chunk_mask, attention_mask, position_ids, image_embeds, past_conv, past_rec, past_kv):
        contract = self.contract
        valid = chunk_mask.bool()
        valid_f = valid.unsqueeze(-1).to(torch.float32)
        n_new = chunk_mask.sum(dim=-1)  # [B]
        past_len = attention_mask.sum(dim=-1) - n_new  # [B]
        hidden = self.text.embed_tokens(input_ids)
        hidden = layers.inject_image_embeds(hidden, input_ids, image_embeds, contract.image_token_id)
        rope = self.rotary(hidden, position_ids)
        if not contract.kv_in_place:
            past_conv, past_rec, past_kv = past_conv.unbind(0), past_rec.unbind(0), past_kv.unbind(0)
        conv_states, rec_states, kv = [], [], []

        def linear_mixer(i, layer, h):
            n = self.linear_slot[i]
            past = past_conv[n], past_rec[n]
            out, conv_state, state = self.prompt_linear_attention(i, layer, h, valid_f, n_new, *past)
            conv_states.append(conv_state)
            rec_states.append(state)
            return out

        full_mixer = self.chunk_full_mixer(rope, past_kv, past_len, kv)

        hidden = self.run_layers(hidden, linear_mixer, full_mixer)
        every = hidden
        if contract.prefill_logits == PrefillLogits.LAST:
            last = (n_new - 1).view(-1, 1, 1).expand(hidden.shape[0], 1, hidden.shape[2])
            hidden = torch.gather(hidden, 1, last)
        logits = self.logits(hidden)
        extra = (every.float(),) if contract.draft_tokens else ()  # the MTP head reads every position's
        if contract.kv_in_place:
            return logits, *extra, *conv_states, *rec_states, *kv
        return logits, *extra, torch.stack(conv_states), torch.stack(rec_states), torch.stack(kv)


class VerifyGraph(DecodeGraph):
    """Speculative decoding's check: ``C`` tokens (the last sampled token and ``C - 1`` drafts) continuing from
    the states of the tokens before them, with the logits, the hidden state and the conv and recurrent states
    after EACH position, so that the runtime keeps exactly the accepted prefix.

    Inputs as the chunk graph's without ``chunk_mask`` and ``image_embeds`` (every token is real, none an image
    token): ``input_ids [1, C]``, ``attention_mask [1, L]`` (the slots in use once the C tokens are written),
    ``position_ids [4, 1, C]`` and the past states as decode takes them. Outputs ``logits [1, C, V]`` fp32,
    ``hidden_states [1, C, hidden]`` fp32 (after the final norm), ``present_conv_states.{t}.{n} [1, K-1,
    conv_dim]`` and ``present_recurrent_states.{t}.{n} [1, Hv, Dk, Dv]``, the states after position ``t`` of
    linear layer ``n``, each its own output (the runtime binds them into a position-major buffer, where the
    stacked states after position ``t`` are one contiguous block that the next run reads as its past; one
    stacked output measured 15 of a 36 ms verify run of 2 tokens at 0.8B int4 in copies), and the KV cache as the
    chunk graph writes it (slots ``past .. past + C - 1``, in place with ``--ops ort``; the slots of rejected
    drafts are simply not claimed by the mask and are written over later).

    The linear-attention layers run the decode step's recurrence one position at a time (the conv step and the
    gated delta rule of :class:`DecodeGraph`), so each position's state exists; the projections, MLPs and
    lm_head run all ``C`` positions at once (each weight read once). Source: speculative decoding's verification
    (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"); per-position recurrent
    states for rollback as llama.cpp keeps them for Qwen3.5 MTP (llama.cpp issue 28120).
    """

    def forward(self, input_ids, attention_mask, position_ids, past_conv, past_rec, past_kv):
        contract = self.contract
        steps = input_ids.shape[1]
        past_len = attention_mask.sum(dim=-1) - steps  # [1]
        hidden = self.text.embed_tokens(input_ids)
        rope = self.rotary(hidden, position_ids)
        if not contract.kv_in_place:
            past_conv, past_rec, past_kv = past_conv.unbind(0), past_rec.unbind(0), past_kv.unbind(0)
        conv_at = [[] for _ in range(steps)]  # [position][linear layer]
        rec_at = [[] for _ in range(steps)]
        kv = []

        def linear_mixer(i, layer, h):
            attn = layer.linear_attn
            n = self.linear_slot[i]
            qkv, z, g, beta = self.gdn_projections(i, attn, h)
            conv_state, state, mixed, cores = past_conv[n], past_rec[n], [], []
            for t in range(steps):
                y, conv_state = self.conv_step(i, qkv[:, t : t + 1], conv_state)
                mixed.append(y)
                conv_at[t].append(conv_state)
            sizes = self.qkv_sizes(attn)
            q, k, v = self.qkv_heads(attn, *torch.split(torch.cat(mixed, dim=1), sizes, dim=-1))
            for t in range(steps):
                at = slice(t, t + 1)
                core, state = self.recurrence(q[:, at], k[:, at], v[:, at], g[:, at], beta[:, at], state, prompt=False)
                cores.append(core)
                rec_at[t].append(state)
            return self.gdn_output(attn, torch.cat(cores, dim=1), z)

        full_mixer = self.chunk_full_mixer(rope, past_kv, past_len, kv)

        hidden = self.run_layers(hidden, linear_mixer, full_mixer)
        logits = self.logits(hidden)
        # every position's state of every layer an output of its own: the runtime binds each into its place in a
        # position-major buffer, so the states are written once where they stay (a stacked output would copy them)
        per_position = [state for states in conv_at for state in states] + [s for states in rec_at for s in states]
        if contract.kv_in_place:
            return logits, hidden.float(), *per_position, *kv
        return logits, hidden.float(), *per_position, torch.stack(kv)


MTP_LAYER = -1
"""Index of the MTP head's decoder layer among a graph's :meth:`_TextGraph.decoder_layers` (after the model's)."""


class MtpGraph(_TextGraph):
    """The checkpoint's multi-token-prediction head (:mod:`.mtp`) over ``C`` positions, continuing from its own
    KV cache: the draft logits of the last real position and its output hidden state.

    Inputs: ``input_ids [1, C]``, the token at ``i + 1`` for each position ``i``; ``hidden_states [1, C,
    hidden]`` fp32, the target's hidden state at ``i`` (or, for a further draft step, the head's own
    ``mtp_hidden`` of the position before); ``chunk_mask [1, C]`` a prefix of ones over the real positions;
    ``attention_mask [1, L]`` the head's KV slots in use once they are written (a prefix of ones); ``position_ids
    [4, 1, C]`` the positions ``i`` (the target's mRoPE rows); ``image_embeds [C, hidden]`` the image embeddings
    of the image tokens among ``input_ids`` in order (vLLM merges them into the head's input embeddings too);
    the head's KV cache (:data:`MTP_KV`). Outputs ``logits [1, 1, V]`` fp32 and ``mtp_hidden [1, 1, hidden]``
    fp32 of the last real position, and the KV cache (slots ``past .. past + C - 1`` written as the chunk graph
    writes its own).
    """

    def __init__(self, model: nn.Module, contract: ShapeContract):
        if not isinstance(getattr(model, "mtp", None), nn.Module):
            raise ValueError("the model has no MTP head (export.mtp.attach_mtp)")
        object.__setattr__(self, "_mtp_layer", model.mtp.layers[0])  # (registered below, as part of self.mtp)
        super().__init__(model, contract)
        self.mtp = model.mtp

    def decoder_layers(self) -> list[tuple[int, nn.Module, str]]:
        return [(MTP_LAYER, self._mtp_layer, "full_attention")]

    def layer(self, i: int) -> nn.Module:
        return self._mtp_layer

    def forward(self, input_ids, hidden_states, chunk_mask, attention_mask, position_ids, image_embeds, past_kv):
        contract, mtp, layer = self.contract, self.mtp, self._mtp_layer
        if not contract.kv_in_place:
            past_kv = past_kv.unbind(0)
        n_new = chunk_mask.sum(dim=-1)  # [1]
        past_len = attention_mask.sum(dim=-1) - n_new
        embeds = self.text.embed_tokens(input_ids)
        embeds = layers.inject_image_embeds(embeds, input_ids, image_embeds, contract.image_token_id)
        dtype = embeds.dtype
        both = torch.cat(
            [self.norm(mtp.pre_fc_norm_embedding, embeds), self.norm(mtp.pre_fc_norm_hidden, hidden_states.to(dtype))],
            dim=-1,
        )
        x = mtp.fc(both)
        rope = self.rotary(x, position_ids)
        attn = layer.self_attn
        q, k, v, gate = self.attention_qkv(MTP_LAYER, attn, self.norm(layer.input_layernorm, x), rope)
        out, k_all, v_all = self.chunk_attention(attn, q, k, v, past_kv[0], past_kv[1], past_len, None)
        x = x + self.attention_output(attn, out, gate)
        x = x + self.mlp(MTP_LAYER, layer, self.norm(layer.post_attention_layernorm, x))
        x = self.norm(mtp.norm, x)
        last = (n_new - 1).view(-1, 1, 1).expand(x.shape[0], 1, x.shape[2])
        x = torch.gather(x, 1, last)
        logits = self.logits(x)
        if contract.kv_in_place:
            return logits, x.float(), k_all, v_all
        return logits, x.float(), torch.stack([k_all, v_all])
