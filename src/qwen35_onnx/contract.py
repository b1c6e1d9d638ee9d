"""The fixed-shape contract: the one place where capacity, image grid, layer counts,
state shapes, dtypes and token ids live.

The exporter writes a :class:`ShapeContract` into ``manifest.json`` at the export root
and into every graph's ``metadata_props`` (key :data:`METADATA_KEY`); the runtime reads
it back and cross-checks it against the graphs' own input/output shapes. This module
imports neither torch nor onnxruntime so that both sides share it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

FORMAT_VERSION = 3
"""Version of the manifest layout; bumped when a field changes meaning (2: image-token budget and
vision grids instead of one image size; 3: the conv state time-major, ``[.., K-1, conv_dim]``)."""

METADATA_KEY = "qwen35_onnx.contract"
"""Key of the contract JSON in each graph's ``metadata_props``."""

MANIFEST_NAME = "manifest.json"


class GraphKind(StrEnum):
    """The kinds of graph of an export: vision, prefill (from an empty state, one per bucket),
    chunk (prefill continuing from a state, one per chunk size), decode, and in an export with draft
    tokens (:attr:`ShapeContract.draft_tokens`) mtp (the checkpoint's multi-token-prediction head, one
    per size) and verify (k + 1 tokens checked at once, one per draft length k)."""

    VISION, PREFILL, CHUNK, DECODE, MTP, VERIFY = "vision", "prefill", "chunk", "decode", "mtp", "verify"

    @classmethod
    def of(cls, key: str) -> GraphKind:
        """The kind of the graph listed under ``key`` in a manifest (``vision_16x16``: vision,
        ``prefill_512``: prefill, ``chunk_64``: chunk).

        Raises:
            ContractError: a key of no known kind.
        """
        for kind in cls:
            if key == kind or key.startswith(f"{kind}_"):
                return kind
        raise ContractError(f"graph key {key!r} is of no known kind ({', '.join(cls)})")


TEXT_WEIGHTS = "weights.data"
KV_SCALES = "kv_scales.npy"
"""The int8 KV cache's scales beside the text graphs (``--kv-dtype int8``): ``[n_full, 2, Hkv, D]`` fp32, keys' then
values' per-channel scale of each full-attention layer; the decode graph holds the same values (the runtime
converts the prompt's cache with them)."""
"""The one external-data file the prefill and decode graphs share, beside them in ``text/``."""


class KvMode(StrEnum):
    """``--kv-cache``: one constant KV width (capacity) and static graphs, or a growing KV cache."""

    FIXED, DYNAMIC = "fixed", "dynamic"


class Dtype(StrEnum):
    """Export dtypes (``--dtype``): of the weights, the activations, the conv state and the KV cache.
    The Gated DeltaNet recurrent state is fp32 in every dtype, and the graphs' host-facing tensors
    (``pixel_values``, ``image_embeds``, ``logits``) are fp32 in every dtype."""

    FP32, FP16, BF16 = "fp32", "fp16", "bf16"


class KvDtype(StrEnum):
    """``--kv-dtype``: the precision of the KV cache, independent of the weights and the activations (which
    :class:`Dtype` sets): ``fp32`` (transformers' numbers: the parity format), ``fp16`` and ``bf16`` (half the
    bytes; bf16 runs on OpenVINO), ``int8`` (a quarter of fp32's bytes: symmetric per-channel scales of each
    full-attention layer's keys and values, calibrated at export on the checkpoint itself).

    It is the cache's precision from the first decode step on (the decode and verify graphs) and in kept
    states; the prompt's graphs (prefill buckets and chunks) hold it in the activations' dtype
    (:attr:`ShapeContract.prompt_kv_dtype`), where attention over many new tokens runs fastest, and the
    runtime converts the cache once when a generation passes from its prompt to its reply
    (``runtime/kv_codec.py``)."""

    FP32, FP16, BF16, INT8 = "fp32", "fp16", "bf16", "int8"


DEFAULT_QUANTIZED_KV_DTYPE = KvDtype.INT8
"""The KV precision of a quantized ``--ops ort`` export by default, chosen by measurement (0.8B int4, 2 cores,
``benchmarks/kv_precision.py``): the prompt's graphs keep fp32, so the time to first token is fp32's, and a decode
step at 8k tokens of context took half fp32's time (ONNX Runtime's GroupQueryAttention reads a quarter of the
bytes); top-1 agreement with an fp32 cache 99.3 % over 1,024 teacher-forced tokens on the random-weight 0.8B, the
same greedy tokens on the trained test checkpoint."""


class PrefillLogits(StrEnum):
    """``--prefill-logits``: the last real token's logits, or every position's."""

    LAST, ALL = "last", "all"


class Ops(StrEnum):
    """Operator sets: standard ONNX only, or ONNX Runtime fused contrib operators."""

    PORTABLE, ORT = "portable", "ort"


class Quantization(StrEnum):
    """``--quantize``: weight-only quantization of the text graphs."""

    NONE, INT4, INT8 = "none", "int4", "int8"


#: ONNX Runtime's MatMulNBits ``accuracy_level``: the type a quantized MatMul computes in on the
#: CPU (0 unset = the input's type, 1 fp32, 2 fp16, 3 bf16, 4 int8: activations quantized to int8
#: per block; ONNX Runtime's contrib operator spec, MatMulNBits).
QUANT_ACCURACY_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_QUANT_ACCURACY_LEVEL = 4
DEFAULT_QUANT_BLOCK_SIZE = 128
"""Weights per quantization scale by default (``--quant-block-size``). Chosen by measurement (issue
19, ``benchmarks/README.md``): at 0.8B int4 against block 32, decode 0.82-0.91x the time and prefill
of 512 tokens 0.85x (ONNX Runtime's packed layout for int8 activations keeps an fp32 scale and an
fp32 block sum per block: 0.75 bytes per weight at block 32, 0.56 at 128, the bytes per weight of
llama.cpp's Q4_0), with the same greedy agreement with fp32 on the trained demo checkpoint
(teacher-forced top-1 over 5 prompts x 64 tokens: 76.9 % at 128 and 64, 75.3 % at 32)."""


def is_quant_block_size(block_size) -> bool:
    """A quantization block size (weights per scale) is an int, a power of two from 16 to 256."""
    ok_type = isinstance(block_size, int) and not isinstance(block_size, bool)
    return ok_type and 16 <= block_size <= 256 and not block_size & (block_size - 1)


MAX_ASPECT_RATIO = 200
"""The image processor's largest aspect ratio (transformers' ``smart_resize`` refuses anything above)."""

DEFAULT_CAPACITY = 65_536
"""The default capacity (``--max-seq-len``, tokens), or the checkpoint's ``max_position_embeddings`` where that is
smaller: the first request of a coding agent is 10-22k tokens of system prompt and tools, and with the KV cache
committed as it is written (``host_memory.py``) an unused capacity costs address space, not memory."""

STANDARD_BUCKETS = (32, 512, 1024, 2048)
"""Prefill length tiers of the reference system (tokens)."""
MIN_CAPACITY = 2
KV_WIDTH = "kv_width"
"""Name of the symbolic KV width (the token axis of ``attention_mask`` and of every KV input and output) of the
decode, chunk, verify and MTP graphs of an export with several KV tiers (:attr:`ShapeContract.kv_tiers`)."""
FIRST_KV_TIER = 2048
KV_TIER_GROWTH = 4
"""Default KV tiers of a portable fixed-KV export (:func:`default_kv_tiers`): :data:`FIRST_KV_TIER` tokens, then
each :data:`KV_TIER_GROWTH` times the one before, below the capacity, plus the capacity (65,536: 2,048, 8,192,
32,768, 65,536). A step at a tier costs its width (the portable decode graph scatters the new token into the whole
cache and masks attention over it), so a sequence pays at most 4x its length, and a move up (the states copied
once into wider buffers) happens a handful of times in a conversation."""
KV_TIER_MULTIPLE = 32
"""Every KV tier below the capacity is a multiple of this many tokens, and the smallest tier at least this wide:
a narrower tier saves less than one tier move (a copy of the states) costs, and widths in whole blocks of 32
keep a static compiler's tiling of the token axis (the prefill buckets of the reference system are multiples of
32 too)."""
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
"""Bytes per element of each state dtype."""


#: The decode states, in graph I/O order: conv state and recurrent state of the Gated DeltaNet
#: layers, KV cache of the full-attention layers.
STATE_NAMES = ("conv_states", "recurrent_states", "kv_cache")
MAX_SLOTS = 64
MAX_DRAFT_TOKENS = 4
"""Most draft tokens a verify graph checks (``export --draft-tokens``): reported acceptance falls with each
further draft position (0.6-0.8 for the first two, issue 39), and a verify run's cost grows with its tokens."""
"""Most decode slots (``--slots``) an export may have: beyond this the S-row decode step is compute-bound on
any CPU (every row is a matrix row of every product) and the states of the idle rows still cost memory."""
_STATE_DTYPE_KEYS = dict(zip(STATE_NAMES, ("conv", "recurrent", "kv")))  # keys of ShapeContract.state_dtypes


def plain(value: Any) -> Any:
    """``value`` with a mode (a ``StrEnum`` member) as its plain string, for messages: ``'fixed'``,
    not ``<KvMode.FIXED: 'fixed'>``."""
    return value.value if isinstance(value, StrEnum) else value


class ContractError(ValueError):
    """A contract is missing, malformed, or disagrees with a graph or another contract."""


class PromptTooLongError(ValueError):
    """A prompt has more tokens than the export's largest prefill bucket (or its capacity): ``prompt_len``, its
    tokens (None when not known)."""

    def __init__(self, message: str, prompt_len: int | None = None):
        super().__init__(message)
        self.prompt_len = prompt_len


def check_capacity(capacity: int) -> None:
    """Check ``--max-seq-len`` (capacity, in tokens).

    Raises:
        ValueError: capacity is not an int >= :data:`MIN_CAPACITY` (prefill needs at least
            one token and decode one more slot).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < MIN_CAPACITY:
        raise ValueError(f"--max-seq-len (capacity) must be an integer >= {MIN_CAPACITY}, got {capacity!r}")


def check_dummy_seq_len(dummy_seq_len: int, capacity: int) -> None:
    """Check the trace length used for export against capacity (tokens).

    The prefill trace needs ``1 <= dummy_seq_len <= capacity``; the decode trace appends one
    token to a past of ``dummy_seq_len`` tokens, so it needs ``dummy_seq_len + 1 <= capacity``.

    Raises:
        ValueError: naming the dummy length and the limit it broke.
    """
    if isinstance(dummy_seq_len, bool) or not isinstance(dummy_seq_len, int) or dummy_seq_len < 1:
        raise ValueError(f"--dummy-seq-len must be an integer >= 1, got {dummy_seq_len!r}")
    if dummy_seq_len + 1 > capacity:
        raise ValueError(
            f"--dummy-seq-len {dummy_seq_len} leaves no decode slot: dummy-seq-len + 1 must be <= "
            f"--max-seq-len {capacity}"
        )


def check_image_budget(image_tokens: int, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int) -> None:
    """Check ``--image-tokens`` (the image-token budget of one image) against the checkpoint's image
    processor: its pixels (``image_tokens * (patch_size * merge_size)**2``) must lie in
    ``[min_pixels, max_pixels]``.

    Raises:
        ValueError: not an integer >= 1, or its pixels outside the processor's range (naming both).
    """
    if isinstance(image_tokens, bool) or not isinstance(image_tokens, int) or image_tokens < 1:
        raise ValueError(f"--image-tokens must be an integer >= 1, got {image_tokens!r}")
    factor = patch_size * merge_size
    pixels = image_tokens * factor**2
    if pixels < min_pixels:
        raise ValueError(
            f"--image-tokens {image_tokens} gives {pixels} pixels ({factor}x{factor} per token), below the image "
            f"processor's min_pixels {min_pixels}: use at least {-(-min_pixels // factor**2)} tokens"
        )
    if pixels > max_pixels:
        raise ValueError(
            f"--image-tokens {image_tokens} gives {pixels} pixels ({factor}x{factor} per token), above the image "
            f"processor's max_pixels {max_pixels}: use at most {max_pixels // factor**2} tokens"
        )


def check_vision_grids(
    grids, image_tokens: int, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> None:
    """Check static vision grids ``(h, w)`` (patches down, across): positive multiples of the merge
    size, no repeats, and pixels (``h * w * patch_size**2``) at most ``min(max_pixels, the budget's pixels)``.
    A grid below the image processor's ``min_pixels`` is allowed: no image gets it from the processor, but a
    video's frame pairs do (the video processor's pixel range covers all frames together).

    Raises:
        ValueError: naming the grid and the limit it broke.
    """
    seen = set()
    budget = min(max_pixels, image_tokens * (patch_size * merge_size) ** 2)
    for grid in grids:
        ok = isinstance(grid, (tuple, list)) and len(grid) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in grid)
        if not ok:
            text = "x".join(map(str, grid)) if isinstance(grid, (tuple, list)) else repr(grid)
            raise ValueError(f"vision grid {text} must be two positive integers (patches down, across)")
        h, w = grid
        if max(h, w) > MAX_ASPECT_RATIO * min(h, w):
            raise ValueError(
                f"vision grid {h}x{w}: an aspect ratio above the image processor's limit of {MAX_ASPECT_RATIO}:1"
            )
        if h % merge_size or w % merge_size:
            raise ValueError(
                f"vision grid {h}x{w}: both sides must be multiples of the spatial merge size {merge_size}"
            )
        pixels = h * w * patch_size**2
        if pixels > budget:
            raise ValueError(
                f"vision grid {h}x{w} is {h * w // merge_size**2} image tokens ({pixels} pixels), above the budget of "
                f"{image_tokens} tokens ({budget} pixels with max_pixels {max_pixels})"
            )
        if (h, w) in seen:
            raise ValueError(f"vision grid {h}x{w} is listed twice")
        seen.add((h, w))


def check_max_images(max_images: int, n_image_tokens: int, capacity: int) -> None:
    """Check ``--max-images`` (images per prompt) with ``n_image_tokens`` (the budget) each against
    the capacity (tokens).

    Raises:
        ValueError: ``max_images`` is not an integer >= 1, or its image tokens alone
            (``max_images * n_image_tokens``) do not fit the capacity.
    """
    if isinstance(max_images, bool) or not isinstance(max_images, int) or max_images < 1:
        raise ValueError(f"--max-images must be an integer >= 1, got {max_images!r}")
    if max_images * n_image_tokens > capacity:
        raise ValueError(
            f"--max-images {max_images} with --image-tokens {n_image_tokens} needs {max_images} x {n_image_tokens} = "
            f"{max_images * n_image_tokens} image tokens, more than the capacity {capacity} (--max-seq-len)"
        )


def check_slots(slots, kv_mode: KvMode, prefill_chunks) -> None:
    """Decode slots (``--slots``): an integer from 1 to :data:`MAX_SLOTS`; more than one needs a fixed KV
    cache (each slot's rows are capacity wide, the write slot computed per row) and prefill chunks (a new
    request prefills into one slot while the others decode).

    Raises:
        ValueError: naming the value and the rule.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots {slots!r} must be an integer from 1 to {MAX_SLOTS}")
    if slots == 1:
        return
    if kv_mode != KvMode.FIXED:
        raise ValueError(
            f"slots {slots} needs a fixed KV cache (--kv-cache fixed): a dynamic cache grows by one column for "
            "every row at once, so rows of different lengths cannot share it"
        )
    if not prefill_chunks:
        raise ValueError(
            f"slots {slots} needs prefill chunks (--prefill-chunks): a request joining the running ones prefills "
            "through the chunk graphs, one chunk between two decode steps"
        )


def check_draft_tokens(draft_tokens, kv_mode: KvMode, prefill_chunks) -> None:
    """Draft tokens of an export (``--draft-tokens``): an integer from 0 (no MTP and verify graphs) to
    :data:`MAX_DRAFT_TOKENS`; more than 0 needs a fixed KV cache and prefill chunks (the verify graph writes its
    tokens' KV slots in a capacity-wide cache, and the MTP head reads the target's hidden state at every prompt
    position, which the chunk graphs return).

    Raises:
        ValueError: naming the value and the rule.
    """
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens {draft_tokens!r} must be an integer from 0 to {MAX_DRAFT_TOKENS}")
    if draft_tokens and kv_mode != KvMode.FIXED:
        raise ValueError(f"draft tokens {draft_tokens} need a fixed KV cache (--kv-cache fixed)")
    if draft_tokens and not prefill_chunks:
        raise ValueError(
            f"draft tokens {draft_tokens} need prefill chunks (--prefill-chunks): the MTP head reads the hidden state "
            "of every prompt position, which the chunk graphs return"
        )


def default_kv_tiers(capacity: int, ops: Ops, kv_mode: KvMode) -> tuple[int, ...]:
    """The default KV tiers (tokens) of an export: with ``--ops portable`` and a fixed KV cache, widths growing
    by :data:`KV_TIER_GROWTH` from :data:`FIRST_KV_TIER` below ``capacity``, plus ``capacity``; otherwise (and
    where the capacity is at most the first tier) one width, the capacity. ``--ops ort`` keeps one width: its
    GroupQueryAttention reads only the used length (``seqlens_k``) and its cache is committed as it is
    written, so one width already costs what is used."""
    if ops != Ops.PORTABLE or kv_mode != KvMode.FIXED:
        return (capacity,)
    tiers, width = [], FIRST_KV_TIER
    while width < capacity:
        tiers.append(width)
        width *= KV_TIER_GROWTH
    return (*tiers, capacity)


def check_kv_tiers(tiers, capacity: int, ops: Ops, kv_mode: KvMode) -> None:
    """Check KV tiers (tokens): strictly increasing integers, the last one the capacity, the others multiples of
    :data:`KV_TIER_MULTIPLE` from :data:`KV_TIER_MULTIPLE` up; more than one only with ``--ops portable`` and a
    fixed KV cache.

    Raises:
        ValueError: naming the offending tier and the limit it broke.
    """
    if not isinstance(tiers, (tuple, list)) or not tiers:
        raise ValueError(f"KV tiers {tiers!r} must be a list of widths in tokens, the last one the capacity")
    previous = 0
    for width in tiers:
        if isinstance(width, bool) or not isinstance(width, int):
            raise ValueError(f"KV tier {width!r} must be an integer (tokens)")
        if width > capacity:
            raise ValueError(f"KV tier {width} is above the capacity {capacity}")
        if width <= previous:
            raise ValueError(f"KV tiers must be strictly increasing, got {width} after {previous}")
        if width < capacity and (width < KV_TIER_MULTIPLE or width % KV_TIER_MULTIPLE):
            raise ValueError(
                f"KV tier {width} must be a multiple of {KV_TIER_MULTIPLE} tokens (at least {KV_TIER_MULTIPLE}): "
                "a narrower tier saves less than a move up costs"
            )
        previous = width
    if tiers[-1] != capacity:
        raise ValueError(f"the last KV tier {tiers[-1]} must be the capacity {capacity}")
    if len(tiers) == 1:
        return
    shown = ",".join(map(str, tiers))
    if kv_mode != KvMode.FIXED:
        raise ValueError(
            f"KV tiers {shown} need a fixed KV cache (kv_mode is {plain(kv_mode)!r}): a dynamic cache grows by one "
            "token a step already"
        )
    if ops != Ops.PORTABLE:
        raise ValueError(
            f"KV tiers {shown} need ops portable: with ops {plain(ops)!r} GroupQueryAttention reads only the used "
            "length of one capacity-wide cache, whose memory is committed as it is written, so one width already "
            "costs what is used"
        )


def tier_for(tiers, tokens: int) -> int:
    """The smallest of ``tiers`` (KV widths, increasing) that holds ``tokens`` KV slots.

    Raises:
        ValueError: ``tokens`` is above the largest tier (the capacity).
    """
    for width in tiers:
        if tokens <= width:
            return width
    raise ValueError(f"{tokens} KV slots are more than the capacity {tiers[-1]}")


def default_buckets(capacity: int) -> tuple[int, ...]:
    """The standard tiers below capacity, plus capacity itself (tokens)."""
    return tuple(b for b in STANDARD_BUCKETS if b < capacity) + (capacity,)


def check_buckets(buckets, capacity: int) -> None:
    """Check prefill buckets (tokens): strictly increasing integers in ``[1, capacity]``.

    Raises:
        ValueError: naming the offending bucket and the limit.
    """
    _check_lengths(buckets, capacity, "prefill bucket", 1)


def _check_lengths(lengths, capacity: int, what: str, minimum: int, why: str = "") -> None:
    """``lengths`` (tokens) are strictly increasing integers in ``[minimum, capacity]``; a ValueError
    naming ``what``, the offending value and the limit otherwise."""
    previous = minimum - 1
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
            raise ValueError(f"{what} {n!r} must be an integer >= {minimum}{why}")
        if n > capacity:
            raise ValueError(f"{what} {n} is above the capacity {capacity}")
        if n <= previous:
            raise ValueError(f"{what}s must be strictly increasing, got {n} after {previous}")
        previous = n


DEFAULT_CHUNKS = (8, 32, 128, 512)
"""Default prefill chunk sizes (tokens), chosen by measurement (0.8B int4 on 2 cores, README
"Prefill chunks"): from 64 tokens up a chunk costs about the same per token, and each run adds
about one decode step's time (every weight read once), so small sizes cut the padding of short
prompts and the DP mixes them."""


def default_chunks(capacity: int) -> tuple[int, ...]:
    """:data:`DEFAULT_CHUNKS` up to ``capacity`` (the capacity itself when it is below all of them)."""
    return tuple(c for c in DEFAULT_CHUNKS if c <= capacity) or (capacity,)


def check_chunks(chunks, capacity: int, kv_mode: KvMode) -> None:
    """Check prefill chunk sizes (tokens): strictly increasing integers in ``[2, capacity]``, fixed KV
    only (a chunk writes its KV slots inside a capacity-wide cache).

    Raises:
        ValueError: naming the offending size and the limit.
    """
    if chunks and kv_mode != KvMode.FIXED:
        raise ValueError(f"prefill chunks {list(chunks)} need a fixed KV cache (kv_mode is {plain(kv_mode)!r})")
    _check_lengths(chunks, capacity, "prefill chunk size", 2, " (one token is a decode step)")


def select_bucket(prompt_len: int, buckets, capacity: int, chunk_size: int) -> int:
    """Smallest bucket >= ``prompt_len`` (tokens); without buckets, ``prompt_len`` rounded up to
    a multiple of ``chunk_size`` (at most ``capacity``).

    Raises:
        ValueError: ``prompt_len`` < 1.
        PromptTooLongError: ``prompt_len`` larger than the largest bucket (or the capacity),
            naming the prompt length and the limit.
    """
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt length must be an integer >= 1 token, got {prompt_len!r}")
    if buckets:
        for b in buckets:
            if prompt_len <= b:
                return b
        raise PromptTooLongError(
            f"prompt is {prompt_len} tokens, more than the largest prefill bucket {buckets[-1]} "
            f"(buckets {list(buckets)}, capacity {capacity})",
            prompt_len,
        )
    if prompt_len > capacity:
        raise PromptTooLongError(f"prompt is {prompt_len} tokens, more than the capacity {capacity}", prompt_len)
    return -(-prompt_len // chunk_size) * chunk_size


@dataclass(frozen=True)
class ShapeContract:
    """Everything both sides must agree on. Sizes are element counts, lengths are tokens.

    State layouts (batch ``B`` is :attr:`batch`, 1, for one sequence: the prefill and chunk graphs, a
    snapshot; the decode graph steps :attr:`slots` rows at once and takes the states of every slot, ``B =
    slots``, see :meth:`slot_state_shape`):

    - conv state: ``[n_linear, B, conv_kernel - 1, conv_dim]`` in :attr:`dtype`: the inputs of the
      last ``K-1`` tokens, oldest first, one row per token (time-major; transformers holds it
      channel-major, ``[B, conv_dim, K]``)
    - recurrent state: ``[n_linear, B, linear_num_value_heads, linear_key_head_dim,
      linear_value_head_dim]`` always fp32
    - KV cache: ``[2 * n_full, B, num_key_value_heads, capacity, head_dim]`` in fixed mode
      (k of full layer i at ``2*i``, v at ``2*i + 1``); the token axis grows in dynamic mode; in
      :attr:`kv_dtype` (int8: the codes, whose per-channel scales the graphs hold). With several
      :attr:`kv_tiers` the token axis is one of the tiers (the one that holds the sequence).
    """

    capacity: int
    kv_mode: KvMode
    dtype: Dtype
    batch: int
    # vision
    image_tokens: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    image_embed_dim: int
    min_pixels: int
    max_pixels: int
    pos_embed_side: int
    # text
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    conv_dim: int
    conv_kernel: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_key_value_heads: int
    head_dim: int
    chunk_size: int
    prefill_buckets: tuple[int, ...]
    prefill_logits: PrefillLogits
    ops: Ops
    quantize: Quantization
    quant_block_size: int
    # token ids
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    exporter_version: str
    max_images: int = 1
    quant_accuracy_level: int = DEFAULT_QUANT_ACCURACY_LEVEL
    quantize_embedding: bool = False
    vision_grids: tuple[tuple[int, int], ...] = ()
    prefill_chunks: tuple[int, ...] = ()
    slots: int = 1
    draft_tokens: int = 0
    kv_dtype: KvDtype | None = None
    """The KV cache's precision (None: :attr:`dtype`, as every export before 0.15.0)."""
    kv_tiers: tuple[int, ...] = ()
    """The KV widths (tokens, increasing, the last the capacity) a sequence's cache is held at: the smallest that
    holds it, moved up when it fills (:mod:`qwen35_onnx.runtime.generation`). With one (every export before
    0.15.0; empty here means the capacity) the graphs are fully static; with several the decode, chunk, verify and
    MTP graphs take the width symbolic (:data:`KV_WIDTH`) and each prefill bucket writes its KV at the smallest
    tier that holds it."""
    format_version: int = FORMAT_VERSION
    graphs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv_tiers:  # one width, the capacity (contracts written before 0.15.0)
            object.__setattr__(self, "kv_tiers", (self.capacity,))

    # ---- derived quantities -------------------------------------------------------
    @property
    def tiered(self) -> bool:
        """More than one KV tier: the decode, chunk, verify and MTP graphs take the KV width symbolic."""
        return len(self.kv_tiers) > 1

    def tier_for(self, tokens: int) -> int:
        """The smallest KV tier (tokens) that holds ``tokens`` KV slots (see :func:`tier_for`).

        Raises:
            ValueError: ``tokens`` above the capacity.
        """
        return tier_for(self.kv_tiers, tokens)

    @property
    def kv_width_dim(self) -> int | str:
        """The KV width of the decode, chunk, verify and MTP graphs as their shapes hold it: the capacity, or
        with several :attr:`kv_tiers` the symbolic :data:`KV_WIDTH`."""
        return KV_WIDTH if self.tiered else self.capacity

    def prefill_kv_width(self, bucket: int) -> int:
        """The token axis of a prefill bucket graph's ``present_kv_cache``: the smallest KV tier that holds the
        bucket (the capacity with one tier)."""
        return self.tier_for(bucket)

    @property
    def patch_dim(self) -> int:
        """Columns of ``pixel_values``: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def n_image_tokens(self) -> int:
        """The most image tokens one image may have (the budget, ``--image-tokens``)."""
        return self.image_tokens

    @property
    def max_patches(self) -> int:
        """The most patches one image may have: ``image_tokens * spatial_merge_size**2``."""
        return self.image_tokens * self.spatial_merge_size**2

    @property
    def image_max_pixels(self) -> int:
        """Largest resized image (pixels): the processor's ``max_pixels`` capped at the budget."""
        return min(self.max_pixels, self.image_tokens * (self.patch_size * self.spatial_merge_size) ** 2)

    @property
    def n_image_rows(self) -> int:
        """Rows of the prefill graph's ``image_embeds`` input: room for :attr:`max_images` images
        of at most :attr:`image_tokens` each, one after the other (unused rows are ignored)."""
        return self.max_images * self.image_tokens

    @property
    def static_vision(self) -> bool:
        """True when the export serves a fixed set of static grids (:attr:`vision_grids`), False when
        its one vision graph takes any grid up to the budget (a dynamic patch count)."""
        return bool(self.vision_grids)

    def vision_graph_key(self, grid: tuple[int, int] | None) -> str:
        """Key in :attr:`graphs` of the vision graph for a static ``(h, w)`` grid, or of the any-grid
        graph (``grid`` None)."""
        return "vision" if grid is None else f"vision_{grid[0]}x{grid[1]}"

    def vision_graph_keys(self) -> list[str]:
        """Keys of every vision graph of the export."""
        return [self.vision_graph_key(g) for g in self.vision_grids] or [self.vision_graph_key(None)]

    def check_grid(self, grid: tuple[int, int]) -> None:
        """Check that the export can run an image of patch grid ``(h, w)``.

        Raises:
            ContractError: a static-grid export without that grid, or a grid over the budget or
                not made of whole merge blocks, naming the grid and the limit.
        """
        h, w = grid
        merge = self.spatial_merge_size
        if h < 1 or w < 1 or h % merge or w % merge:
            raise ContractError(f"image grid {h}x{w} must be positive multiples of the spatial merge size {merge}")
        if self.static_vision and (h, w) not in self.vision_grids:
            raise ContractError(
                f"image grid {h}x{w} is not one of this export's vision grids {list(self.vision_grids)}"
            )
        if h * w > self.max_patches:
            raise ContractError(
                f"image grid {h}x{w} has {h * w // merge**2} image tokens, more than the export's budget "
                f"{self.image_tokens} (--image-tokens)"
            )

    @property
    def prefill_keys(self) -> list[str]:
        """Keys in :attr:`graphs` of the prefill graphs: one per bucket, the dynamic-length one in
        dynamic mode, none with prefill chunks."""
        if self.prefill_chunks:
            return []
        return [self.prefill_graph_key(b) for b in self.prefill_buckets or [None]]

    def prefill_graph_key(self, bucket: int | None) -> str:
        """Key in :attr:`graphs` of the prefill graph for ``bucket`` (None: the dynamic-length graph)."""
        return "prefill" if bucket is None else f"prefill_{bucket}"

    def chunk_graph_key(self, size: int) -> str:
        """Key in :attr:`graphs` of the chunk graph of ``size`` tokens."""
        return f"chunk_{size}"

    @property
    def verify_sizes(self) -> tuple[int, ...]:
        """Tokens of each verify graph: ``k + 1`` for every draft length ``k`` from 1 to :attr:`draft_tokens`
        (the last sampled token and its k drafts)."""
        return tuple(range(2, self.draft_tokens + 2)) if self.draft_tokens else ()

    @property
    def mtp_sizes(self) -> tuple[int, ...]:
        """Positions of each MTP graph: 1 (a draft step), ``draft_tokens + 1`` (the positions a verify run
        accepted) and each prefill chunk's size (the prompt's positions); none without draft tokens."""
        if not self.draft_tokens:
            return ()
        return tuple(sorted({1, self.draft_tokens + 1, *self.prefill_chunks}))

    def verify_state_names(self, state: str, size: int) -> list[str]:
        """The verify graph of ``size`` tokens' outputs for ``state`` (conv_states or recurrent_states): one per
        position ``t`` and linear layer ``n``, ``present_{state}.{t}.{n}``, position-major."""
        return [f"present_{state}.{t}.{n}" for t in range(size) for n in range(self.n_linear)]

    def verify_graph_key(self, size: int) -> str:
        """Key in :attr:`graphs` of the verify graph of ``size`` tokens."""
        return f"verify_{size}"

    def mtp_graph_key(self, size: int) -> str:
        """Key in :attr:`graphs` of the MTP graph of ``size`` positions."""
        return f"mtp_{size}"

    @property
    def mtp_kv_shape(self) -> tuple[int, ...]:
        """The MTP head's own KV cache (its one full-attention layer): ``[2, 1, num_key_value_heads, capacity,
        head_dim]`` (k at 0, v at 1), in the KV cache's dtype."""
        return self.mtp_kv_shape_at(self.capacity)

    def mtp_kv_shape_at(self, width: int) -> tuple[int, ...]:
        """:attr:`mtp_kv_shape` ``width`` tokens wide (a KV tier)."""
        return (2, self.batch, self.num_key_value_heads, width, self.head_dim)

    def select_bucket(self, prompt_len: int) -> int:
        """Prefill length (tokens) for a prompt of ``prompt_len`` tokens: the prompt's own length
        with prefill chunks (:attr:`prefill_chunks`: any length up to the capacity); else the
        smallest bucket that holds it in fixed mode; the next multiple of :attr:`chunk_size` in
        dynamic mode.

        Raises:
            ValueError: ``prompt_len`` < 1, or above the largest bucket / the capacity.
        """
        if self.prefill_chunks:
            return select_bucket(prompt_len, (), self.capacity, 1)
        return select_bucket(prompt_len, self.prefill_buckets, self.capacity, self.chunk_size)

    @property
    def n_linear(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def n_full(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def conv_state_shape(self) -> tuple[int, ...]:
        return (self.n_linear, self.batch, self.conv_kernel - 1, self.conv_dim)

    @property
    def recurrent_state_shape(self) -> tuple[int, ...]:
        return (
            self.n_linear,
            self.batch,
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
        )

    def kv_shape(self, length: int | None = None) -> tuple[int, ...]:
        """KV cache shape for ``length`` tokens (default: capacity)."""
        length = self.capacity if length is None else length
        return (2 * self.n_full, self.batch, self.num_key_value_heads, length, self.head_dim)

    def slot_state_shape(self, state: str, width: int | None = None) -> tuple[int, ...]:
        """Shape of ``state`` as the decode graph takes it: :meth:`state_shape` (the KV cache ``width`` tokens
        wide, default the capacity) with :attr:`slots` rows on the batch axis (axis 1), row ``s`` being slot
        ``s``'s state (the same as :meth:`state_shape` when :attr:`slots` is 1)."""
        shape = list(self.state_shape(state, width))
        shape[1] = self.slots
        return tuple(shape)

    @property
    def dynamic_rows(self) -> bool:
        """The decode graph's row axis is dynamic (1 to :attr:`slots`): with several slots and per-entry states
        (:attr:`kv_in_place`, ``--ops ort``), so that a step runs only the rows of the slots in use (the runtime
        keeps them first: :class:`~qwen35_onnx.runtime.slots.SlotPool`); a static compiler's graph
        (``--ops portable``) has :attr:`slots` rows, every step all of them."""
        return self.slots > 1 and self.kv_in_place

    @property
    def decode_host_inputs(self) -> list[str]:
        """The decode graph's inputs other than the states: ``input_ids``, ``attention_mask``, ``position_ids``,
        and with several slots ``active_rows`` (``[S]`` bool: False for a row whose slot sits the step out)."""
        names = ["input_ids", "attention_mask", "position_ids"]
        return [*names, "active_rows"] if self.slots > 1 else names

    def slot_state_bytes(self, kv: bool = True) -> int:
        """Bytes of one slot's conv, recurrent and (``kv``) KV state (capacity wide) in the export's dtypes."""
        names = STATE_NAMES if kv else STATE_NAMES[:2]
        return sum(int(math.prod(self.state_shape(s))) * DTYPE_BYTES[self.state_dtype(s)] for s in names)

    @property
    def quant_format(self) -> str:
        """How a quantized export stores its text weights (derived from :attr:`quantize` and
        :attr:`ops`, written to the manifest's ``derived`` section for its readers): ``'none'``;
        ``'MatMulNBits'`` (``--ops ort``: ONNX Runtime's ``com.microsoft`` operator);
        ``'DequantizeLinear'`` (``--ops portable``: standard ONNX, a blocked DequantizeLinear of
        opset 21 in front of each MatMul, int4/int8 weights and fp32 scales)."""
        if self.quantize == Quantization.NONE:
            return "none"
        return "MatMulNBits" if self.ops == Ops.ORT else "DequantizeLinear"

    @property
    def embedding_format(self) -> str:
        """How the token-embedding table is stored (derived from :attr:`quantize_embedding`,
        :attr:`quantize` and :attr:`ops`, written to the manifest's ``derived`` section):
        ``'float'`` (the export's dtype); ``'GatherBlockQuantized'`` (``--ops ort``: ONNX
        Runtime's ``com.microsoft`` operator over the export's int4/int8 blocks, the bytes of a
        tied model's lm_head); ``'DequantizeLinear int8'`` (``--ops portable``: Gather of int8
        codes and scales, then a blocked DequantizeLinear, standard ONNX)."""
        if not self.quantize_embedding:
            return "float"
        return "GatherBlockQuantized" if self.ops == Ops.ORT else "DequantizeLinear int8"

    @property
    def kv_in_place(self) -> bool:
        """True for ``--ops ort`` with fixed KV: the decode graph takes and returns every state
        one entry at a time (see :meth:`decode_state_names`), so the runtime binds each entry by
        address inside the stacked buffers the prefill returned and nothing is split or
        concatenated per step. The KV entries are updated in place (GroupQueryAttention writes
        the new token's slot and nothing else); on the CPU so are the recurrent entries (ONNX
        Runtime's LinearAttention reads its past state only to copy it into its present output),
        elsewhere they alternate between two stacked buffers (A/B) like the conv entries
        (``runtime.onnxruntime.decoders.BoundDecoder.updated_in_place``)."""
        return self.ops == Ops.ORT and self.kv_mode == KvMode.FIXED

    def state_shape(self, state: str, width: int | None = None) -> tuple[int, ...]:
        """Stacked shape of ``state`` (one of :data:`STATE_NAMES`), the KV cache ``width`` tokens wide (default:
        the capacity); entry ``j`` of a per-entry decode graph has this shape without the first axis."""
        shapes = {
            "conv_states": self.conv_state_shape,
            "recurrent_states": self.recurrent_state_shape,
            "kv_cache": self.kv_shape(width),
        }
        if state not in shapes:
            raise ValueError(f"unknown state {state!r}; expected one of {STATE_NAMES}")
        return shapes[state]

    def decode_state_names(self, state: str, prefix: str) -> list[str]:
        """Names of the decode graph's inputs (``prefix='past'``) or outputs (``'present'``) for
        ``state`` (one of :data:`STATE_NAMES`): ``['{prefix}_{state}']`` (one stacked tensor), or
        with :attr:`kv_in_place` one name per entry, ``'{prefix}_{state}.{j}'`` for
        ``j < state_shape(state)[0]``."""
        if self.kv_in_place:
            return [f"{prefix}_{state}.{j}" for j in range(self.state_shape(state)[0])]
        return [f"{prefix}_{state}"]

    @property
    def kv_precision(self) -> KvDtype:
        """The KV cache's precision: :attr:`kv_dtype`, or :attr:`dtype` where the manifest names none."""
        return KvDtype(self.kv_dtype or self.dtype)

    @property
    def prompt_kv_dtype(self) -> str:
        """The KV cache's dtype in the prompt's graphs (prefill buckets and chunks): the activations' :attr:`dtype`
        (see :class:`KvDtype`)."""
        return self.dtype

    @property
    def converts_kv(self) -> bool:
        """The prompt's graphs and the decode graph hold the KV cache in different dtypes (:class:`KvDtype`)."""
        return self.kv_precision != self.prompt_kv_dtype

    @property
    def mtp_kv_dtype(self) -> str:
        """The MTP head's own one-layer KV cache's dtype: :attr:`kv_precision` where it is a float type; with int8
        the export's :attr:`dtype` (its scales are calibrated for the model's layers only)."""
        return self.dtype if self.kv_precision == KvDtype.INT8 else self.kv_precision

    @property
    def state_dtypes(self) -> dict[str, str]:
        return {"conv": self.dtype, "recurrent": Dtype.FP32, "kv": self.kv_precision}

    def state_dtype(self, state: str) -> str:
        """Element dtype (e.g. ``'fp32'``) of ``state`` (one of :data:`STATE_NAMES`); the
        recurrent state is always fp32."""
        return self.state_dtypes[_STATE_DTYPE_KEYS[state]]

    # ---- serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with the derived shapes included for readers of the manifest."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["prefill_buckets"] = list(self.prefill_buckets)
        d["prefill_chunks"] = list(self.prefill_chunks)
        d["kv_tiers"] = list(self.kv_tiers)
        d["vision_grids"] = [list(g) for g in self.vision_grids]
        d["derived"] = {
            "vision": "static grids" if self.static_vision else "any grid",
            "max_patches": self.max_patches,
            "image_max_pixels": self.image_max_pixels,
            "patch_dim": self.patch_dim,
            "n_image_rows": self.n_image_rows,
            "n_linear": self.n_linear,
            "n_full": self.n_full,
            "conv_state_shape": list(self.conv_state_shape),
            "decode_rows": self.slots,
            "verify_sizes": list(self.verify_sizes),
            "mtp_sizes": list(self.mtp_sizes),
            "recurrent_state_shape": list(self.recurrent_state_shape),
            "kv_shape": list(self.kv_shape()) if self.kv_mode == KvMode.FIXED else "dynamic",
            "state_dtypes": self.state_dtypes,
            "quant_format": self.quant_format,
            "embedding_format": self.embedding_format,
        }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapeContract:
        """Inverse of :meth:`to_dict`.

        Raises:
            ContractError: unknown format version, missing or malformed fields.
        """
        if not isinstance(data, dict):
            raise ContractError(f"contract must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ContractError(
                f"contract format_version {version!r} is not supported (this runtime reads {FORMAT_VERSION}); "
                "re-export the model with this version of qwen35-onnx"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        # max_images: 1 in exports before 0.4.0; quant_accuracy_level: 4 before 0.5.0;
        # quantize_embedding: False before 0.6.0; vision_grids: none (any grid); prefill_chunks: none
        # before 0.8.0; slots: 1 before 0.10.0; draft_tokens: 0 before 0.11.0; kv_dtype: dtype, kv_tiers: one
        # width, the capacity, before 0.15.0
        optional = (
            "kv_dtype",
            "kv_tiers",
            "draft_tokens",
            "prefill_chunks",
            "graphs",
            "format_version",
            "max_images",
            "slots",
            "quant_accuracy_level",
            "quantize_embedding",
            "vision_grids",
        )
        missing = sorted(n for n in names if n not in data and n not in optional)
        if missing:
            raise ContractError(f"contract is missing fields: {', '.join(missing)}")
        kwargs = {k: data[k] for k in names if k in data}
        try:
            for key in ("layer_types", "eos_token_ids", "prefill_buckets"):
                if not isinstance(kwargs[key], list):
                    raise TypeError(f"{key} must be a list, got {kwargs[key]!r}")
                kwargs[key] = tuple(kwargs[key])
            graphs = kwargs.get("graphs") or {}
            if not isinstance(graphs, dict):
                raise TypeError(f"graphs must be an object, got {graphs!r}")
            kwargs["graphs"] = dict(graphs)
            grids = kwargs.get("vision_grids", [])
            if not isinstance(grids, list) or not all(isinstance(g, list) and len(g) == 2 for g in grids):
                raise TypeError(f"vision_grids must be a list of [h, w] pairs, got {grids!r}")
            kwargs["vision_grids"] = tuple(tuple(g) for g in grids)
            chunks = kwargs.get("prefill_chunks", [])
            if not isinstance(chunks, list):
                raise TypeError(f"prefill_chunks must be a list, got {chunks!r}")
            kwargs["prefill_chunks"] = tuple(chunks)
            tiers = kwargs.get("kv_tiers", [])
            if not isinstance(tiers, list):
                raise TypeError(f"kv_tiers must be a list, got {tiers!r}")
            kwargs["kv_tiers"] = tuple(tiers)
            for name, mode in _MODES.items():
                if kwargs.get(name) in tuple(mode):
                    kwargs[name] = mode(kwargs[name])
            contract = cls(**kwargs)
        except TypeError as exc:
            raise ContractError(f"malformed contract: {exc}") from exc
        contract.validate()
        return contract

    @classmethod
    def from_json(cls, text: str) -> ShapeContract:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ContractError(f"contract is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def validate(self) -> None:
        """Check internal consistency.

        Raises:
            ContractError: naming the field and the rule it broke.
        """
        for name, mode in _MODES.items():
            if getattr(self, name) not in tuple(mode) and not (name == "kv_dtype" and self.kv_dtype is None):
                raise ContractError(f"{name} {getattr(self, name)!r} is not one of {', '.join(mode)}")
        if self.kv_precision == KvDtype.BF16 and self.ops == Ops.ORT:
            raise ContractError(
                "kv_dtype bf16 needs ops portable (ONNX Runtime's GroupQueryAttention has no bf16 cache)"
            )
        if self.kv_precision != self.dtype and self.kv_mode != KvMode.FIXED:
            raise ContractError(f"kv_dtype {plain(self.kv_precision)} needs a fixed KV cache (kv_mode is dynamic)")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                low = 0 if f.name.endswith("_token_id") or f.name in ("quant_accuracy_level", "draft_tokens") else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < low:
                    raise ContractError(f"{f.name} must be an integer >= {low}, got {value!r}")
        for name in ("layer_types", "eos_token_ids", "prefill_buckets"):
            if name != "layer_types" and not all(
                isinstance(v, int) and not isinstance(v, bool) for v in getattr(self, name)
            ):
                raise ContractError(f"{name} must hold integers, got {list(getattr(self, name))!r}")
        if self.batch != 1:
            raise ContractError(f"batch {self.batch} is not supported (only batch 1)")
        try:
            check_slots(self.slots, self.kv_mode, self.prefill_chunks)
            check_draft_tokens(self.draft_tokens, self.kv_mode, self.prefill_chunks)
        except ValueError as exc:
            raise ContractError(str(exc)) from exc
        try:
            check_capacity(self.capacity)
            processor = (self.patch_size, self.spatial_merge_size, self.min_pixels, self.max_pixels)
            check_image_budget(self.image_tokens, *processor)
            check_vision_grids(self.vision_grids, self.image_tokens, *processor)
        except ValueError as exc:
            raise ContractError(str(exc)) from exc
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ContractError(f"unknown layer types {bad}")
        if self.quant_accuracy_level not in QUANT_ACCURACY_LEVELS:
            raise ContractError(
                f"quant_accuracy_level {self.quant_accuracy_level!r} is not one of {QUANT_ACCURACY_LEVELS}"
            )
        if not isinstance(self.quantize_embedding, bool):
            raise ContractError(f"quantize_embedding must be true or false, got {self.quantize_embedding!r}")
        if self.quantize_embedding and self.quantize == Quantization.NONE:
            raise ContractError("quantize_embedding needs a quantized export (quantize is 'none')")
        try:
            check_buckets(self.prefill_buckets, self.capacity)
            check_chunks(self.prefill_chunks, self.capacity, self.kv_mode)
            check_max_images(self.max_images, self.n_image_tokens, self.capacity)
            check_kv_tiers(self.kv_tiers, self.capacity, self.ops, self.kv_mode)
        except ValueError as exc:
            raise ContractError(str(exc)) from exc
        if self.kv_mode == KvMode.FIXED and not self.prefill_buckets and not self.prefill_chunks:
            raise ContractError("fixed kv_mode needs at least one prefill bucket or prefill chunk")
        if self.prefill_buckets and self.prefill_chunks:
            raise ContractError("an export prefills in buckets or in chunks, not both")
        for bucket in (*self.prefill_buckets, self.capacity):
            if bucket % self.chunk_size:
                raise ContractError(f"chunk_size {self.chunk_size} does not divide {bucket}")

    def same_shapes(self, other: ShapeContract) -> list[str]:
        """Fields (other than ``graphs``) on which two contracts disagree, as 'name: a != b'."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k}: {plain(a[k])!r} != {plain(b[k])!r}" for k in a if k != "graphs" and a[k] != b[k]]


_MODES = {
    "kv_mode": KvMode,
    "dtype": Dtype,
    "prefill_logits": PrefillLogits,
    "ops": Ops,
    "quantize": Quantization,
    "kv_dtype": KvDtype,
}
"""The contract's fields that hold a mode, and their choices."""


def write_manifest(root: Path, contract: ShapeContract) -> Path:
    """Write ``root/manifest.json`` atomically (temp file + rename); returns its path."""
    path = Path(root) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(contract.to_json())
    tmp.replace(path)
    return path


def read_manifest(root: Path) -> ShapeContract:
    """Read ``root/manifest.json``.

    Raises:
        ContractError: the folder is not a complete export (no manifest), or it is malformed.
    """
    path = Path(root) / MANIFEST_NAME
    if not Path(root).exists():
        raise ContractError(f"exported model folder {str(root)!r} does not exist")
    if not Path(root).is_dir():
        raise ContractError(f"exported model folder {str(root)!r} is a file, not a folder")
    if not path.is_file():
        raise ContractError(
            f"{str(path)!r} not found: {str(root)!r} is not a complete qwen35-onnx export (was the export interrupted?)"
        )
    try:
        return ShapeContract.from_json(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ContractError) as exc:
        raise ContractError(f"{str(path)!r}: {exc}") from exc
