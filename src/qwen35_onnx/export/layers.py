"""Static-shape building blocks of the exported graphs (torch, traced by ``torch.onnx.export``).

Each function mirrors a piece of ``transformers/models/qwen3_5/modeling_qwen3_5.py`` but is
written so that the traced ONNX graph has a size independent of the sequence length and no
data-dependent Python control flow:

- the chunked gated delta rule scans over chunks with ``torch._higher_order_ops.scan``
  (exported as one ONNX ``Scan``), and inverts each chunk's unit lower-triangular system with
  a fixed number of matrix products;
- the KV slot write, image injection and masks are computed from tensors, not Python ints.

Shapes use: B batch, S tokens, L capacity (KV slots), H heads, D head dim, C chunk size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last axis as transformers' ``l2norm`` (FLA convention): ``x / sqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def repeat_heads(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    """``x.repeat_interleave(n_rep, dim)`` written as expand + reshape (friendlier to export)."""
    if n_rep == 1:
        return x
    shape = list(x.shape)
    x = x.unsqueeze(dim + 1)
    expanded = shape[: dim + 1] + [n_rep] + shape[dim + 1 :]
    x = x.expand(*expanded)
    shape[dim] = shape[dim] * n_rep
    return x.reshape(*shape)


# ----------------------------------------------------------------------------------------
# Causal depthwise conv with state (Gated DeltaNet input mixing)
# ----------------------------------------------------------------------------------------
def causal_conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, n_valid: torch.Tensor, past: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over a whole prompt or one chunk of it, and the conv state it
    leaves.

    Mirrors ``causal_conv1d_fn`` and the prefill branch of the transformers cache; the state is
    held time-major (transformers holds it ``[B, D, K]``, channel-major), see
    :attr:`~qwen35_onnx.contract.ShapeContract.conv_state_shape`.

    Args:
        x: ``[B, D, S]`` q/k/v projections, packed or one part of them (padded tokens already zeroed).
        weight: ``[D, 1, K]`` depthwise kernel (``nn.Conv1d.weight``, or its rows of that part).
        n_valid: ``[B]`` int64, number of real tokens (a contiguous prefix).
        past: ``[B, K-1, D]`` the conv state of the tokens before ``x`` (a chunk continuing a
            prompt); None: a prompt's start (zeros).

    Returns:
        ``(y [B, D, S], conv_state [B, K-1, D])``; the state holds the inputs of the last
        ``K-1`` real tokens, oldest first (from ``past`` where fewer are new), so right padding
        does not leak into it.
    """
    kernel = weight.shape[-1]
    seq_len = x.shape[-1]
    if past is None:
        padded = F.pad(x, (kernel - 1, 0))  # [B, D, K-1+S]
    else:
        padded = torch.cat([past.to(x.dtype).transpose(1, 2), x], dim=-1)
    y = F.conv1d(padded, weight, groups=x.shape[1])[..., :seq_len]
    return F.silu(y), conv_state_of_prompt(padded, n_valid, kernel).transpose(1, 2)


def conv_state_of_prompt(padded: torch.Tensor, n_valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """Conv state after a right-padded prompt: the inputs of its last K-1 *real* tokens.

    Args:
        padded: ``[B, D, K-1+S]``, the prompt's conv inputs left-padded with K-1 zeros.
        n_valid: ``[B]`` int64, real tokens (a contiguous prefix).

    Returns:
        ``[B, D, K-1]`` (channel-major); they sit at padded positions ``n_valid .. n_valid + K - 2``.
    """
    idx = n_valid.view(-1, 1) + torch.arange(kernel - 1, device=padded.device).view(1, -1)  # [B, K-1]
    idx = idx.unsqueeze(1).expand(padded.shape[0], padded.shape[1], kernel - 1)
    return torch.gather(padded, 2, idx)


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the causal conv (mirrors ``causal_conv1d_update``), time-major: the
    window is two contiguous blocks (state, then the new token) and the new state one contiguous
    slice of it, where the channel-major layout of transformers needs strided copies and two
    transposes per layer (0.8B decode: 0.5-0.9 ms a step, ``benchmarks/README.md``, issue 19).

    Args:
        x: ``[B, 1, D]``; conv_state: ``[B, K-1, D]``; weight: ``[K, D]`` (the depthwise kernel
            transposed).

    Returns:
        ``(y [B, 1, D] after SiLU, new conv_state [B, K-1, D])``.
    """
    window = torch.cat([conv_state, x], dim=1)  # [B, K, D]
    y = (window * weight).sum(dim=1, keepdim=True)
    return F.silu(y), window[:, 1:]


# ----------------------------------------------------------------------------------------
# Gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025)
# ----------------------------------------------------------------------------------------
def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """Inverse of ``I + A`` for strictly lower-triangular ``A`` of size C x C (last two axes).

    ``A`` is nilpotent (``A^C = 0``), so ``(I + A)^-1 = sum_k (-A)^k = prod_j (I + (-A)^(2^j))``
    for ``j < ceil(log2 C)``: a fixed count of matrix products, independent of the sequence
    length. It replaces transformers' ``solve_triangular`` (not exportable) and its unrolled
    forward substitution (C-1 steps).
    """
    size = a.shape[-1]
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    power = -a
    inverse = eye + power
    for _ in range(max(0, math.ceil(math.log2(size)) - 1)):
        power = power @ power
        inverse = inverse @ (eye + power)
    return inverse


def gated_delta_rule_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over a prompt; mirrors transformers' ``torch_chunk_gated_delta_rule``.

    Args:
        query, key: ``[B, S, Hk, Dk]``; value: ``[B, S, Hv, Dv]`` (Hv a multiple of Hk).
        g: ``[B, S, Hv]`` log decay (<= 0; 0 for padded tokens means "no decay").
        beta: ``[B, S, Hv]`` write strength (0 for padded tokens means "no write").
        initial_state: ``[B, Hv, Dk, Dv]`` fp32.
        chunk_size: C, a fixed export-time constant.

    Returns:
        ``(out [B, S, Hv, Dv] in query's dtype, final_state [B, Hv, Dk, Dv] fp32)``.
        The intra-chunk work is batched over all chunks; the inter-chunk recurrence is one
        ``scan`` whose body is the same for every length.
    """
    in_dtype = query.dtype
    batch, seq_len, n_k, d_k = key.shape
    n_v, d_v = value.shape[-2:]
    query = repeat_heads(query, n_v // n_k, dim=2)
    key = repeat_heads(key, n_v // n_k, dim=2)
    # -> [B, H, S, D] fp32
    query, key, value = (t.transpose(1, 2).float() for t in (query, key, value))
    beta, g = beta.transpose(1, 2).float(), g.transpose(1, 2).float()
    query = l2norm(query) * (d_k**-0.5)
    key = l2norm(key)

    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n_chunks = (seq_len + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, n_v, n_chunks, chunk_size, *t.shape[3:])

    k_beta = chunks(key * beta.unsqueeze(-1))
    v_beta = chunks(value * beta.unsqueeze(-1))
    query, key = chunks(query), chunks(key)
    cum = chunks(g).cumsum(dim=-1)  # [B, H, N, C]

    pos = torch.arange(chunk_size, device=query.device)
    lower = pos.view(-1, 1) >= pos.view(1, -1)  # causal incl. diagonal
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)
    decay = torch.exp(torch.where(lower, diff, torch.full_like(diff, float("-inf"))))  # [B,H,N,C,C]

    strictly_lower = pos.view(-1, 1) > pos.view(1, -1)
    a = torch.where(strictly_lower, (k_beta @ key.transpose(-1, -2)) * decay, torch.zeros_like(decay))
    t_inv = unit_lower_inverse(a)
    new_values = t_inv @ v_beta  # u
    k_cumdecay = t_inv @ (k_beta * cum.exp().unsqueeze(-1))  # w
    intra = (query @ key.transpose(-1, -2)) * decay
    q_decayed = query * cum.exp().unsqueeze(-1)
    k_decayed = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [B, H, N]

    def step(state, u, w, q, attn, k, d):
        v_new = u - w @ state
        out = q @ state + attn @ v_new
        state = state * d[..., None, None] + k.transpose(-1, -2) @ v_new
        return state, out

    def to_scan(t: torch.Tensor) -> torch.Tensor:  # chunk axis first
        return t.movedim(2, 0)

    def body(state, xs):
        u, w, q, attn, k, d = xs
        return step(state, u, w, q, attn, k, d)

    final_state, outs = scan(
        body,
        initial_state.float(),
        [to_scan(t) for t in (new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay)],
    )
    # outs: [N, B, H, C, Dv] -> [B, S, H, Dv]
    out = outs.movedim(0, 2).reshape(batch, n_v, n_chunks * chunk_size, d_v)[:, :, :seq_len]
    return out.transpose(1, 2).to(in_dtype), final_state


def gated_delta_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token gated delta rule; mirrors transformers' ``torch_recurrent_gated_delta_rule``.

    Args:
        query, key: ``[B, 1, Hk, Dk]``; value: ``[B, 1, Hv, Dv]``; g, beta: ``[B, 1, Hv]``;
        state: ``[B, Hv, Dk, Dv]`` fp32.

    Returns:
        ``(out [B, 1, Hv, Dv], new state [B, Hv, Dk, Dv] fp32)``.
    """
    in_dtype = query.dtype
    n_k, d_k = key.shape[-2:]
    n_v = value.shape[-2]
    query = repeat_heads(query, n_v // n_k, dim=2)[:, 0].float()  # [B, H, Dk]
    key = repeat_heads(key, n_v // n_k, dim=2)[:, 0].float()
    value = value[:, 0].float()  # [B, H, Dv]
    query = l2norm(query) * (d_k**-0.5)
    key = l2norm(key)
    state = state.float() * g[:, 0].float().exp()[..., None, None]
    kv_mem = (state * key.unsqueeze(-1)).sum(dim=-2)  # [B, H, Dv]
    delta = (value - kv_mem) * beta[:, 0].float().unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * query.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(1).to(in_dtype), state


# ----------------------------------------------------------------------------------------
# Interleaved multimodal RoPE
# ----------------------------------------------------------------------------------------
def mrope_rows(mrope_section: list[int], n_freqs: int) -> list[int]:
    """Which position row (0 = temporal, 1 = height, 2 = width) drives each rotary frequency.

    Interleaved layout of transformers' ``Qwen3_5TextRotaryEmbedding.recomposition_frequencies``:
    frequency ``j`` uses height when ``j % 3 == 1`` and ``j < 3 * section[1]``, width when
    ``j % 3 == 2`` and ``j < 3 * section[2]``, temporal otherwise.
    """
    rows = [0] * n_freqs
    for row in (1, 2):
        for j in range(row, min(3 * mrope_section[row], n_freqs), 3):
            rows[j] = row
    return rows


def mrope_cos_sin(rotary_emb, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[B, S, rotary_dim]`` for mRoPE position rows ``position_ids [3, B, S]``.

    Same arithmetic as ``Qwen3_5TextRotaryEmbedding.forward`` (fp32 ``position * inv_freq``),
    but the per-frequency row choice is one Gather with a constant index instead of the
    in-place slice assignments there (which export as ScatterND nodes).
    """
    inv_freq = rotary_emb.inv_freq.float()
    rows = torch.tensor(mrope_rows(rotary_emb.mrope_section, inv_freq.shape[0]), device=hidden.device)
    positions = position_ids.float().index_select(0, rows)  # [F, B, S]
    freqs = positions.permute(1, 2, 0) * inv_freq  # [B, S, F]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos() * rotary_emb.attention_scaling
    sin = emb.sin() * rotary_emb.attention_scaling
    return cos.to(hidden.dtype), sin.to(hidden.dtype)


# ----------------------------------------------------------------------------------------
# Attention, KV cache and image injection
# ----------------------------------------------------------------------------------------
def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention with grouped KV heads; the same result as transformers'
    ``eager_attention_forward`` (``repeat_kv``, then every query head against its KV head).

    For one query token (decode) the ``n_rep = Hq / Hkv`` query heads that share a KV head
    (heads ``h * n_rep ... h * n_rep + n_rep - 1``, ``repeat_kv``'s order) are the columns of one
    matrix and the scores are ``key @ query^T``: the cache, the large operand, is read once per
    KV head in its stored ``[L, D]`` layout and never expanded to ``Hq`` heads. Measured on the
    Qwen3.5-0.8B decode sizes (6 layers, ``Hq`` 8, ``Hkv`` 2, D 256, L 1280): 56 -> 6.6 ms on
    OpenVINO CPU and 16.6 -> 6.2 ms on ONNX Runtime, bit-identical outputs. Several query tokens
    (the portable prefill) keep the expanded form, which measured 8-11 % faster there (S 1024 and
    2048); ``--ops ort`` prefills with GroupQueryAttention instead (``_TextGraph.prompt_attention``).

    Args:
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Sk, D]``;
        allowed: bool, broadcastable to ``[B, 1, Sq, Sk]``.

    Returns:
        ``[B, Sq, Hq, D]``. Rows with nothing allowed (padded queries) give a finite mean.
    """
    batch, n_heads, n_query, dim = query.shape
    n_kv = key.shape[1]
    n_rep = n_heads // n_kv
    if n_query == 1:
        grouped = query.reshape(batch, n_kv, n_rep, dim)
        scores = (key @ grouped.transpose(-1, -2)).transpose(-1, -2) * scaling  # [B, Hkv, n_rep, Sk]
        allowed = allowed.reshape(allowed.shape[0], 1, 1, allowed.shape[-1])
    else:
        key = repeat_heads(key, n_rep, dim=1)
        value = repeat_heads(value, n_rep, dim=1)
        scores = (query @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = probs @ value  # [B, Hkv, n_rep, D] (one query) or [B, Hq, Sq, D]
    return out.reshape(batch, n_heads, n_query, dim).transpose(1, 2)


def write_kv_slot(cache: torch.Tensor, new: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Write one token's k or v into a fixed-capacity cache (one ``ScatterElements`` node).

    Args:
        cache: ``[B, Hkv, L, D]``; new: ``[B, Hkv, 1, D]``; slot: ``[B]`` int64, the write slot
            (``cache_pos = sum(mask) - 1``).

    Returns:
        ``[B, Hkv, L, D]``, ``cache`` with ``new`` at token index ``slot``.
    """
    index = slot.view(-1, 1, 1, 1).expand(new.shape)
    return cache.scatter(2, index, new)


def inject_image_embeds(
    inputs_embeds: torch.Tensor, input_ids: torch.Tensor, image_embeds: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """Replace image-token embeddings by image embeddings, without ``masked_scatter``.

    The running count of image tokens (cumsum, minus one, clamped) indexes the image rows,
    a gather builds a ``[B, S, H]`` tensor and ``where`` keeps it at image-token positions,
    so every intermediate keeps the shape of ``input_ids``.

    Args:
        inputs_embeds: ``[B, S, H]``; input_ids: ``[B, S]`` int64; image_embeds: ``[N, H]``.
    """
    is_image = input_ids == image_token_id
    rows = (is_image.long().cumsum(dim=-1) - 1).clamp(min=0, max=image_embeds.shape[0] - 1)
    gathered = image_embeds.to(inputs_embeds.dtype)[rows]  # [B, S, H]
    return torch.where(is_image.unsqueeze(-1), gathered, inputs_embeds)
