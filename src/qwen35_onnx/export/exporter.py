"""Export a Qwen3.5 checkpoint folder to ``vision/`` and ``text/`` (prefill and decode) ONNX graphs
plus ``manifest.json`` and the tokenizer/processor files.

The export is atomic: everything is written into a temporary sibling folder and renamed into
place once complete, so an interrupted export never leaves a folder the runtime accepts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from .. import __version__
from ..contract import (
    KV_SCALES,
    KV_WIDTH,
    METADATA_KEY,
    STATE_NAMES,
    ContractError,
    Dtype,
    GraphKind,
    KvDtype,
    KvMode,
    Quantization,
    ShapeContract,
    check_image_budget,
    check_max_images,
    check_vision_grids,
    read_manifest,
    write_manifest,
)
from ..image_grids import default_grids
from ..paths import check_checkpoint_folder, has_mtp_weights
from .options import (
    ALL_COMPONENTS,
    ANY_GRID,
    STATIC_GRIDS,
    ExportError,
    ExportOptions,
    component_options,
    fit_capacity,
)
from .weight_source import CheckpointWeights, WeightsError, peak_rss_bytes
from .weights import WeightsFileWriter

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration",)
SUPPORTED_MODEL_TYPES = ("qwen3_5",)
OPSET = 18
BF16_OPSET = 22
"""Default-domain opset of bf16 exports: opset 22 is the first where Conv (the patch embedding and
the causal conv) and the other operators of our graphs accept bfloat16 (ONNX operator spec)."""


def torch_dtype(name: str):
    """The torch dtype of a contract dtype (a :class:`~qwen35_onnx.contract.Dtype` or a state dtype: int8 KV codes
    too)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[name]


TEXT_DIR = "text"
VISION_DIR = "vision"
POS_EMBED_TAPS = 4
"""Position-embedding taps per patch: Qwen3.5 resamples its table bilinearly (2 x 2 taps)."""
"""Folder of the prefill and decode graphs and of their shared weights file."""
VISION_DATA = "model.onnx.data"
"""External-data file of the vision graph (its tensors of 1 KiB or more)."""
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def check_architecture(config) -> None:
    """Raise ExportError unless ``config`` is a Qwen3.5 vision-language config with only
    ``linear_attention``/``full_attention`` layers."""
    model_type = getattr(config, "model_type", None)
    archs = tuple(getattr(config, "architectures", None) or ())
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ExportError(
            f"unsupported architecture: model_type {model_type!r} (architectures {list(archs)}); "
            f"qwen35-onnx exports {', '.join(SUPPORTED_ARCHITECTURES)} (model_type 'qwen3_5')"
        )
    text = config.text_config
    bad = sorted(set(text.layer_types) - {"linear_attention", "full_attention"})
    if bad:
        raise ExportError(f"unsupported layer types {bad} in text_config.layer_types")
    absent = [t for t in ("linear_attention", "full_attention") if t not in text.layer_types]
    if absent:
        raise ExportError(
            f"text_config.layer_types {list(text.layer_types)} has no {absent[0]!r} layer; qwen35-onnx exports the "
            "hybrid Qwen3.5 stack, which has both linear_attention and full_attention layers"
        )
    if text.linear_num_value_heads % text.linear_num_key_heads:
        raise ExportError(
            f"linear_num_value_heads {text.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {text.linear_num_key_heads}"
        )


def eos_token_ids(generation_config, config) -> tuple[int, ...]:
    """All end-of-sequence ids of the checkpoint's generation config (falls back to the model config)."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = getattr(config.text_config, "eos_token_id", None) or getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def chunk_size_for(lengths: Sequence[int], preferred: int) -> int:
    """Largest power of two <= ``preferred`` that divides every length (tokens).

    Prefill lengths (buckets, or multiples of the chunk size up to capacity) are whole chunks,
    so the graphs never pad internally and all buckets share one graph structure.
    """
    chunk = 1
    while chunk * 2 <= preferred and all(n % (chunk * 2) == 0 for n in lengths):
        chunk *= 2
    return chunk


def processor_pixel_range(model_dir: str | Path, vision_config=None) -> tuple[int, int]:
    """The checkpoint image processor's ``(min_pixels, max_pixels)`` from ``preprocessor_config.json``:
    ``size.shortest_edge`` / ``size.longest_edge`` (transformers 5 spelling) or ``min_pixels`` /
    ``max_pixels`` (earlier spelling), the latter winning where both are given (as
    ``Qwen2VLImageProcessorPil.__init__`` does). With ``vision_config``, the processor's
    ``patch_size`` / ``merge_size`` must be the vision tower's.

    Raises:
        ExportError: no readable ``preprocessor_config.json``; neither spelling gives two positive,
            finite numbers with min <= max; patching that differs from the vision tower's.
    """
    path = Path(model_dir) / "preprocessor_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"the checkpoint's image processor settings {str(path)!r} cannot be read: {exc}") from None
    size = data.get("size") if isinstance(data, dict) and isinstance(data.get("size"), dict) else {}
    data = data if isinstance(data, dict) else {}
    low = data.get("min_pixels", size.get("shortest_edge"))
    high = data.get("max_pixels", size.get("longest_edge"))
    ok = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 1 <= v <= 2**62
        for v in (low, high)
    )
    if not ok or low > high:
        raise ExportError(
            f"{str(path)!r} must give the image processor's pixel range as size.shortest_edge / size.longest_edge "
            f"(or min_pixels / max_pixels), positive with min <= max; got {low!r} / {high!r}"
        )
    if vision_config is not None:
        theirs = (data.get("patch_size", 14), data.get("merge_size", 2))  # transformers' defaults
        ours = (vision_config.patch_size, vision_config.spatial_merge_size)
        if theirs != ours:
            raise ExportError(
                f"{str(path)!r}: the image processor's patch_size / merge_size {theirs} differ from the vision "
                f"tower's patch_size / spatial_merge_size {ours} (config.json)"
            )
    return int(low), int(high)


FROM_VISION_CONFIG = "patch_size temporal_patch_size spatial_merge_size in_channels".split()
"""Contract fields that are the checkpoint's ``vision_config`` attributes of the same names."""
FROM_TEXT_CONFIG = (
    "hidden_size vocab_size linear_num_value_heads linear_key_head_dim linear_value_head_dim "
    "num_key_value_heads head_dim"
).split()
"""Contract fields that are the checkpoint's ``text_config`` attributes of the same names."""


def build_contract(
    config,
    generation_config,
    options: ExportOptions,
    pixel_range: tuple[int, int] = (65536, 16777216),
    has_mtp: bool = False,
) -> ShapeContract:
    """The contract of an export of ``config`` (a ``Qwen3_5Config``) with ``options``.

    Args:
        pixel_range: the checkpoint image processor's ``(min_pixels, max_pixels)``
            (:func:`processor_pixel_range`; by default the published Qwen3.5 processor's).
        has_mtp: the checkpoint carries a multi-token-prediction head (``mtp.*`` tensors,
            :func:`~qwen35_onnx.paths.has_mtp_weights`): the default draft tokens
            (:meth:`.options.ExportOptions.drafts`).

    Raises:
        ExportError: unsupported architecture; an image-token budget or a vision grid outside the
            processor's pixel range or the budget; image tokens over the capacity; capacity above
            the model's ``max_position_embeddings``.
    """
    check_architecture(config)
    vision, text = config.vision_config, config.text_config
    min_pixels, max_pixels = pixel_range
    grids = options.vision_grids
    processor = (vision.patch_size, vision.spatial_merge_size, min_pixels, max_pixels)
    try:
        check_image_budget(options.image_tokens, *processor)
        if grids == STATIC_GRIDS:
            grids = default_grids(options.image_tokens, *processor)
        elif grids == ANY_GRID:
            grids = ()
        check_vision_grids(grids, options.image_tokens, *processor)
        check_max_images(options.max_images, options.image_tokens, options.capacity)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    options.check_embedding_blocks(text.hidden_size)
    max_positions = getattr(text, "max_position_embeddings", None)
    if max_positions and options.capacity > max_positions:
        raise ExportError(
            f"--max-seq-len {options.capacity} is above the model's max_position_embeddings {max_positions}"
        )
    pad = getattr(generation_config, "pad_token_id", None) if generation_config is not None else None
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    contract = ShapeContract(
        **{**options.contract_values(has_mtp), "vision_grids": tuple(tuple(g) for g in grids)},
        **{name: getattr(vision, name) for name in FROM_VISION_CONFIG},
        **{name: getattr(text, name) for name in FROM_TEXT_CONFIG},
        batch=1,
        image_embed_dim=vision.out_hidden_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        pos_embed_side=int(vision.num_position_embeddings**0.5),
        layer_types=tuple(text.layer_types),
        conv_dim=2 * key_dim + text.linear_num_value_heads * text.linear_value_head_dim,
        conv_kernel=text.linear_conv_kernel_dim,
        chunk_size=chunk_size_for((options.capacity, *options.buckets), options.chunk_size),
        image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        eos_token_ids=eos_token_ids(generation_config, config),
        pad_token_id=None if pad is None else int(pad),
        exporter_version=__version__,
    )
    contract.validate()
    check_slot_memory(contract)
    return contract


SLOT_MEMORY_SHARE = 0.5
"""Most of this machine's physical memory the decode states of all slots may take (``--slots``): the
weights, the activations and the prefill's own state need the rest."""


def check_slot_memory(contract: ShapeContract, physical: int | None = None) -> None:
    """The states of every decode slot, ``slots x`` :meth:`~qwen35_onnx.contract.ShapeContract.slot_state_bytes`
    (conv, recurrent and capacity-wide KV state), must fit :data:`SLOT_MEMORY_SHARE` of ``physical`` bytes
    (default: this machine's physical memory). With ``--ops ort`` the KV cache is not counted: the runtime
    reserves it and commits what the sequences write (``host_memory.py``), so the slots' capacity costs
    address space, and the memory a conversation takes is its own.

    Raises:
        ExportError: naming the bytes of one slot, of all slots, and the budget.
    """
    if contract.slots == 1:
        return
    if physical is None:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_slot = contract.slot_state_bytes(kv=not contract.kv_in_place)
    budget = int(physical * SLOT_MEMORY_SHARE)
    if contract.slots * per_slot > budget:
        raise ExportError(
            f"--slots {contract.slots} needs {contract.slots * per_slot:,} bytes of decode state ({per_slot:,} bytes "
            f"a slot at capacity {contract.capacity}), over the budget of {budget:,} bytes (half of this machine's "
            f"{physical:,} bytes of memory); use fewer slots or a smaller --max-seq-len"
        )


# ----------------------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphJob:
    """One ONNX file to write: ``key`` in the contract's ``graphs``, the graph kind
    (vision/prefill/decode), its path relative to the export root, and for a prefill bucket
    its static length (``None``: vision, decode, or the dynamic-length prefill)."""

    key: str
    kind: GraphKind
    path: str
    bucket: int | None = None
    grid: tuple[int, int] | None = None


def graph_jobs(contract: ShapeContract, components: Sequence[GraphKind] = tuple(GraphKind)) -> list[GraphJob]:
    """The graphs of an export: in ``vision/``, one static graph per vision grid
    (``grid_{h}x{w}.onnx``) or the any-grid graph ``model.onnx``, sharing one weights file; in
    ``text/``, one prefill per bucket (fixed mode) or one dynamic-length prefill (dynamic mode), and
    decode, which share one weights file (``text/weights.data``, see :mod:`.weights`)."""
    jobs = []
    for kind in components:
        if kind == GraphKind.PREFILL and contract.prefill_chunks:
            continue  # a chunked export prefills in chunks only
        if kind == GraphKind.PREFILL and contract.prefill_buckets:
            jobs += [
                GraphJob(contract.prefill_graph_key(b), kind, f"{TEXT_DIR}/prefill_{b}.onnx", b)
                for b in contract.prefill_buckets
            ]
        elif kind == GraphKind.CHUNK:
            jobs += [
                GraphJob(contract.chunk_graph_key(c), kind, f"{TEXT_DIR}/chunk_{c}.onnx", c)
                for c in contract.prefill_chunks
            ]
        elif kind == GraphKind.VERIFY:
            jobs += [
                GraphJob(contract.verify_graph_key(c), kind, f"{TEXT_DIR}/verify_{c}.onnx", c)
                for c in contract.verify_sizes
            ]
        elif kind == GraphKind.MTP:
            jobs += [
                GraphJob(contract.mtp_graph_key(c), kind, f"{TEXT_DIR}/mtp_{c}.onnx", c) for c in contract.mtp_sizes
            ]
        elif kind == GraphKind.VISION:
            jobs += [
                GraphJob(contract.vision_graph_key(g), kind, f"{VISION_DIR}/grid_{g[0]}x{g[1]}.onnx", grid=g)
                for g in contract.vision_grids
            ] or [GraphJob(contract.vision_graph_key(None), kind, f"{VISION_DIR}/model.onnx")]
        else:
            jobs.append(GraphJob(str(kind), kind, f"{TEXT_DIR}/{kind}.onnx"))
    return jobs


def trace_seq_len(job: GraphJob, contract: ShapeContract, dummy_seq_len: int) -> int:
    """Trace length in tokens: a bucket's own length; for the dynamic-length prefill,
    ``dummy_seq_len`` rounded up to whole chunks, at least two chunks when capacity allows
    (``torch.export`` specialises a size of 1); for decode, a past of ``dummy_seq_len``."""
    if job.bucket is not None:
        return job.bucket
    if job.kind != GraphKind.PREFILL:
        return dummy_seq_len
    chunk = contract.chunk_size
    n_chunks = max(2, -(-dummy_seq_len // chunk))
    return min(n_chunks, contract.capacity // chunk) * chunk


def vision_trace_grid(job: GraphJob, contract: ShapeContract) -> tuple[int, int]:
    """Patch grid a vision graph is traced at: a static graph's own grid; for the any-grid graph,
    one merge block high and up to 4 wide (within the budget; ``torch.export`` specialises sizes 0
    and 1, so the patch count is at least 2 merge blocks)."""
    if job.grid is not None:
        return job.grid
    merge = contract.spatial_merge_size
    return merge, merge * max(2, min(4, contract.image_tokens))


def dummy_inputs(kind: GraphKind, contract: ShapeContract, seq_len: int, grid: tuple[int, int] | None = None):
    """Example inputs for tracing a graph of ``kind`` (the values only matter for shapes; ``grid``
    the patch grid of a vision graph)."""
    import torch

    b = contract.batch
    if kind == GraphKind.VISION:
        n = grid[0] * grid[1]
        return (
            torch.randn(n, contract.patch_dim),
            torch.randint(0, contract.pos_embed_side**2, (n, POS_EMBED_TAPS)),
            torch.rand(n, POS_EMBED_TAPS),
            torch.randint(0, max(grid), (n, 2)),
        )
    if kind == GraphKind.PREFILL:
        ids = torch.randint(0, contract.vocab_size, (b, seq_len))
        return (
            ids,
            torch.ones(b, seq_len, dtype=torch.long),
            torch.arange(seq_len).view(1, 1, -1).expand(4, b, seq_len).contiguous(),
            torch.randn(contract.n_image_rows, contract.image_embed_dim),
        )
    if kind == GraphKind.CHUNK:  # seq_len new tokens (the chunk size) after a past of one token
        ids = torch.randint(0, contract.vocab_size, (b, seq_len))
        mask = torch.zeros(b, contract.capacity, dtype=torch.long)
        mask[:, : seq_len + 1] = 1
        return (
            ids,
            torch.ones(b, seq_len, dtype=torch.long),
            mask,
            torch.arange(1, seq_len + 1).view(1, 1, -1).expand(4, b, seq_len).contiguous(),
            torch.randn(seq_len, contract.image_embed_dim),
            *past_states(contract, contract.capacity, kv_dtype=contract.prompt_kv_dtype),
        )
    if kind == GraphKind.VERIFY:  # seq_len tokens (the graph's size) after a past of one token
        mask = torch.zeros(b, contract.capacity, dtype=torch.long)
        mask[:, : seq_len + 1] = 1
        return (
            torch.randint(0, contract.vocab_size, (b, seq_len)),
            mask,
            torch.arange(1, seq_len + 1).view(1, 1, -1).expand(4, b, seq_len).contiguous(),
            *past_states(contract, contract.capacity),
        )
    if kind == GraphKind.MTP:  # seq_len positions after one
        mask = torch.zeros(b, contract.capacity, dtype=torch.long)
        mask[:, : seq_len + 1] = 1
        kv = torch.zeros(contract.mtp_kv_shape, dtype=torch_dtype(contract.mtp_kv_dtype))
        return (
            torch.randint(0, contract.vocab_size, (b, seq_len)),
            torch.randn(b, seq_len, contract.hidden_size),
            torch.ones(b, seq_len, dtype=torch.long),
            mask,
            torch.arange(1, seq_len + 1).view(1, 1, -1).expand(4, b, seq_len).contiguous(),
            torch.randn(seq_len, contract.image_embed_dim),
            tuple(kv.unbind(0)) if contract.kv_in_place else kv,
        )
    # decode: a past of seq_len tokens plus the new one, on every slot (rows)
    rows = contract.slots
    kv_len = contract.capacity if contract.kv_mode == KvMode.FIXED else seq_len
    mask_len = contract.capacity if contract.kv_mode == KvMode.FIXED else seq_len + 1
    mask = torch.zeros(rows, mask_len, dtype=torch.long)
    mask[:, : seq_len + 1] = 1
    active = (torch.ones(rows, dtype=torch.bool),) if rows > 1 else ()
    return (
        torch.randint(0, contract.vocab_size, (rows, 1)),
        mask,
        torch.full((4, rows, 1), seq_len, dtype=torch.long),
        *active,
        *past_states(contract, kv_len, rows),
    )


def past_states(contract: ShapeContract, kv_len: int, rows: int = 1, kv_dtype: str | None = None) -> tuple:
    """Zero past states as the decode (``rows``: its slots) and chunk graphs (one row) take them: three
    stacked tensors (the KV ``kv_len`` tokens wide, in ``kv_dtype``: by default the decode graph's, the chunk
    graphs' is the contract's ``prompt_kv_dtype``), or with :attr:`ShapeContract.kv_in_place` three tuples of
    entries."""
    import torch

    def shape(name: str) -> list[int]:
        stacked = list(contract.state_shape(name))
        stacked[1] = rows
        if name == "kv_cache":
            stacked[3] = kv_len
        return stacked

    dtype = {name: torch_dtype(contract.state_dtype(name)) for name in STATE_NAMES}
    if kv_dtype is not None:
        dtype["kv_cache"] = torch_dtype(kv_dtype)
    if contract.kv_in_place:  # every state one entry at a time
        return tuple(
            tuple(torch.zeros(shape(name)[1:], dtype=dtype[name]) for _ in range(shape(name)[0]))
            for name in STATE_NAMES
        )
    return tuple(torch.zeros(shape(name), dtype=dtype[name]) for name in STATE_NAMES)


def kv_width_shapes(kind: GraphKind, contract: ShapeContract) -> tuple:
    """``torch.export`` dynamic shapes of a decode, chunk, verify or MTP graph of an export with several KV tiers:
    one dimension, :data:`~qwen35_onnx.contract.KV_WIDTH` (from the smallest tier to the capacity), on
    ``attention_mask``'s width and the KV cache's token axis, so that nothing in the graph is specialised to one
    width (in the order of each graph module's ``forward`` arguments; the decode graph's states are its
    ``*rest``)."""
    from torch.export import Dim

    width = Dim(KV_WIDTH, min=contract.kv_tiers[0], max=contract.capacity)
    mask, kv = {1: width}, {3: width}
    if kind == GraphKind.DECODE:
        active = (None,) if contract.slots > 1 else ()
        return (None, mask, None, (*active, None, None, kv))
    if kind == GraphKind.CHUNK:
        return (None, None, mask, None, None, None, None, kv)
    if kind == GraphKind.VERIFY:
        return (None, mask, None, None, None, kv)
    if kind == GraphKind.MTP:
        return (None, None, None, mask, None, None, kv)
    raise ValueError(f"a {kind} graph has no KV width")


def dynamic_shapes(job: GraphJob, contract: ShapeContract):
    """``torch.export`` dynamic shapes: none for vision, prefill buckets and fixed decode; the
    chunk count for the dynamic-length prefill; the past length for dynamic decode; with several KV tiers the KV
    width of the decode, chunk, verify and MTP graphs (:func:`kv_width_shapes`)."""
    from torch.export import Dim

    if contract.tiered and job.kind in (GraphKind.DECODE, GraphKind.CHUNK, GraphKind.VERIFY, GraphKind.MTP):
        return kv_width_shapes(job.kind, contract)
    if job.kind == GraphKind.VISION:
        if job.grid is not None:
            return None
        patches = contract.spatial_merge_size**2 * Dim("image_tokens", min=2, max=contract.image_tokens)
        return ({0: patches},) * 4
    if job.bucket is not None or job.kind in (GraphKind.MTP, GraphKind.VERIFY):
        return None
    if job.kind == GraphKind.PREFILL:
        max_chunks = contract.capacity // contract.chunk_size
        if max_chunks == 1:
            return None
        seq = contract.chunk_size * Dim("n_chunks", min=1, max=max_chunks)
        return ({1: seq}, {1: seq}, {2: seq}, None)
    if contract.kv_mode == KvMode.FIXED:
        if job.kind == GraphKind.DECODE and contract.dynamic_rows:
            rows = Dim("rows", min=1, max=contract.slots)
            entries = tuple(tuple({0: rows} for _ in range(contract.state_shape(name)[0])) for name in STATE_NAMES)
            return ({0: rows}, {0: rows}, {1: rows}, ({0: rows}, *entries))  # (DecodeGraph.forward's *rest)
        return None
    past = Dim("past_len", min=1, max=contract.capacity - 1)
    return (None, {1: past + 1}, None, (None, None, {3: past}))  # (the states: DecodeGraph.forward's *rest)


def graph_module(kind: GraphKind, model, contract: ShapeContract):
    from .graphs import ChunkGraph, DecodeGraph, MtpGraph, PrefillGraph, VerifyGraph, VisionGraph

    if kind == GraphKind.VISION:
        visual = model.model.visual
        resampling = (visual.interpolation_mode, visual.interpolation_align_corners)
        if resampling != ("bilinear", True):
            raise ExportError(
                f"the vision tower resamples its position embeddings with {resampling}; the runtime computes the "
                "taps for ('bilinear', align_corners=True), Qwen3.5's"
            )
        return VisionGraph(visual, contract)
    graphs = {
        GraphKind.PREFILL: PrefillGraph,
        GraphKind.CHUNK: ChunkGraph,
        GraphKind.DECODE: DecodeGraph,
        GraphKind.VERIFY: VerifyGraph,
        GraphKind.MTP: MtpGraph,
    }
    return graphs[kind](model, contract)


def io_names(kind: GraphKind, contract: ShapeContract, job_size: int | None = None) -> tuple[list[str], list[str]]:
    """Input and output names of a graph of ``kind`` (the decode state names depend on
    :attr:`ShapeContract.kv_in_place`, see :meth:`ShapeContract.decode_state_names`; a verify graph's on its
    tokens, ``job_size``)."""
    from .graphs import (
        CHUNK_INPUTS,
        HIDDEN_OUTPUT,
        MTP_INPUTS,
        MTP_KV,
        MTP_OUTPUTS,
        PREFILL_INPUTS,
        TEXT_OUTPUTS,
        VERIFY_INPUTS,
        VISION_INPUTS,
        VISION_OUTPUTS,
    )

    if kind == GraphKind.VISION:
        return VISION_INPUTS, VISION_OUTPUTS
    if kind == GraphKind.PREFILL:
        return PREFILL_INPUTS, TEXT_OUTPUTS
    if kind == GraphKind.MTP:
        per_entry = contract.kv_in_place
        past = [f"past_{MTP_KV}.{j}" for j in range(2)] if per_entry else [f"past_{MTP_KV}"]
        present = [f"present_{MTP_KV}.{j}" for j in range(2)] if per_entry else [f"present_{MTP_KV}"]
        return MTP_INPUTS + past, MTP_OUTPUTS + present
    host = {GraphKind.CHUNK: CHUNK_INPUTS, GraphKind.VERIFY: VERIFY_INPUTS}.get(kind)
    inputs = host or [*contract.decode_host_inputs, *STATE_NAMES]
    past = [n for state in STATE_NAMES for n in contract.decode_state_names(state, "past")]
    present = [n for state in STATE_NAMES for n in contract.decode_state_names(state, "present")]
    if kind == GraphKind.VERIFY:  # the conv and recurrent state of every position and layer, position-major
        per_position = [n for state in STATE_NAMES[:2] for n in contract.verify_state_names(state, job_size)]
        present = [*per_position, *contract.decode_state_names("kv_cache", "present")]
    hidden = [HIDDEN_OUTPUT] if kind == GraphKind.VERIFY or (kind == GraphKind.CHUNK and contract.draft_tokens) else []
    return inputs[: -len(STATE_NAMES)] + past, ["logits", *hidden, *present]


def collapse_reshapes(model) -> None:
    """Replace each ``Reshape(Reshape(x))`` of ``model`` (an ``onnx_ir`` model, in place) by one
    Reshape (onnxscript's ``reshape_reshape_rule``): after the optimizer has turned the one-token
    transposes into reshapes, the decode graph's q, k and v go ``[B, 1, H*D] -> [B, H, 1, D] ->
    [B, 1, H*D]`` around mRoPE and GroupQueryAttention (3 nodes per full-attention layer, each a
    kernel launch at every step)."""
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.rules.common import reshape_reshape_rule

    rewrite(model, pattern_rewrite_rules=[reshape_reshape_rule])


SKIPPED_REWRITE_RULES = frozenset({"SlicesSplit"})
"""onnxscript default rewrite rules :func:`optimize_graph` leaves out. ``SlicesSplit`` (two ``Slice`` nodes of one
tensor into one ``Split``) is a two-node pattern matched against every pair of Slice nodes: it took 13 % of the
whole export time of the demo checkpoint (27 s of 205 s over five exports: portable fp32 / fp16 / bf16, ort fp32
with chunks, ort int4 with an int8 KV cache; AMD EPYC 2 cores) and matched nothing in any of them: the graphs are
the same without it, byte for byte."""


def optimize_graph(program) -> None:
    """``program.optimize()`` (``torch.onnx.ONNXProgram``: onnxscript's optimizer, constant folding, the default
    rewrite rules, unused nodes removed; the opset-23 fusions) without :data:`SKIPPED_REWRITE_RULES`. Where the
    installed onnxscript keeps its default rules elsewhere, the whole default set runs (the same graphs, slower)."""
    from unittest import mock

    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not isinstance(rules, tuple):
        program.optimize()
        return
    kept = tuple(rule for rule in rules if getattr(rule, "name", None) not in SKIPPED_REWRITE_RULES)
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", kept):
        program.optimize()


def export_graph(
    job: GraphJob,
    model,
    contract: ShapeContract,
    root: Path,
    dummy_seq_len: int,
    source: CheckpointWeights,
    writer: WeightsFileWriter,
) -> Path:
    """Trace one graph of the empty ``model`` (:func:`.weight_source.empty_model`) with
    ``torch.onnx.export`` (dynamo) and write it to ``root / job.path`` with the contract in its
    ``metadata_props``, its weights read from ``source`` one tensor at a time into
    ``writer``'s file: lazy initializers (:mod:`.lazy_weights`), weight transposes folded
    lazily, onnxscript's optimizer (and :func:`collapse_reshapes`), weight-only quantization of the text graphs
    (:func:`.quantize.quantize_model`). Returns the ONNX file path."""
    import torch

    from .fused import TRANSLATIONS
    from .lazy_weights import attach_weights, fold_weight_transposes

    module = graph_module(job.kind, model, contract).eval()
    inputs, outputs = io_names(job.kind, contract, job.bucket)
    path = root / job.path
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), quiet_torch_export():
        program = torch.onnx.export(
            module,
            dummy_inputs(
                job.kind, contract, trace_seq_len(job, contract, dummy_seq_len), vision_trace_grid(job, contract)
            ),
            dynamo=True,
            opset_version=BF16_OPSET if contract.dtype == Dtype.BF16 else OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=dynamic_shapes(job, contract),
            custom_translation_table=TRANSLATIONS,
            optimize=False,
            verbose=False,
            report=False,
        )
        attach_weights(program.model, module, source, model)
        fold_weight_transposes(program.model)
        optimize_graph(program)
        collapse_reshapes(program.model)
    ir_model = program.model
    ir_model.metadata_props[METADATA_KEY] = contract.to_json()
    ir_model.metadata_props["qwen35_onnx.graph"] = job.key
    if contract.quantize != Quantization.NONE and job.kind != GraphKind.VISION:
        from .quantize import quantize_for_contract

        quantize_for_contract(ir_model, contract)
    writer.add_model(ir_model, path)
    return path


# ----------------------------------------------------------------------------------------
# Whole export
# ----------------------------------------------------------------------------------------
def load_config(model_id: str | Path):
    """Config and generation config of a local Hugging Face folder (no weights yet).

    Raises:
        ExportError: the folder is missing, has no readable ``config.json`` or no weight files, or
            is not Qwen3.5.
    """
    from transformers import AutoConfig, GenerationConfig

    try:
        path = check_checkpoint_folder(model_id)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"--model-id {str(model_id)!r}: config.json cannot be read: {exc}") from exc
    check_architecture(config)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        generation_config = None
    return config, generation_config


def open_weights(model_id: str | Path, config, dtype: Dtype = Dtype.FP32):
    """The empty model of ``config`` in ``dtype`` (:func:`.weight_source.empty_model`) and the
    checkpoint's weights, read one tensor at a time in that dtype.

    Raises:
        ExportError: missing or unreadable weight files.
    """
    from .weight_source import empty_model

    model = empty_model(config, torch_dtype(dtype))
    try:
        source = CheckpointWeights(Path(model_id), torch_dtype(dtype))
    except WeightsError as exc:
        raise ExportError(f"--model-id {str(model_id)!r}: {exc}") from exc
    return model, source


def copy_processor_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer, chat template, image- and video-processor and config files next to the graphs."""
    for name in PROCESSOR_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _check_output(out: Path, model_dir: Path, options: ExportOptions) -> None:
    """Refuse output folders that would lose data or cannot hold an export."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output-dir {str(out)!r} is a file, not a folder")
    if out == model_dir or out in model_dir.parents:
        raise ExportError(
            f"--output-dir {str(out)!r} holds the checkpoint --model-id {str(model_dir)!r}; choose another folder"
        )
    if options.component != ALL_COMPONENTS:
        if not out.is_dir():
            raise ExportError(
                f"--component {options.component} updates an existing export, but {str(out)!r} does not exist; "
                "export with --component all first"
            )
        return
    check_replaceable(out, options.overwrite)


def output_folder(output_dir: str | os.PathLike) -> Path:
    """``--output-dir`` as an absolute path.

    Raises:
        ExportError: an empty path (which would name the current folder).
    """
    if not str(output_dir).strip():
        raise ExportError(f"--output-dir {str(output_dir)!r} is empty: give the folder to write")
    return Path(output_dir).expanduser().resolve()


def check_replaceable(out: Path, overwrite: bool) -> None:
    """An output folder that exists and is not empty may only be a previous qwen35-onnx export, replaced with
    ``overwrite``.

    Raises:
        ExportError: without ``overwrite``; a folder whose ``manifest.json`` is missing or is not an export's.
    """
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not overwrite:
        raise ExportError(f"--output-dir {str(out)!r} exists and is not empty; pass --overwrite to replace it")
    try:
        read_manifest(out)
    except ContractError as exc:
        raise ExportError(
            f"--overwrite only replaces a previous qwen35-onnx export, and {str(out)!r} is not one ({exc}); "
            "remove it yourself or choose another folder"
        ) from None


def export(
    model_id: str | Path,
    output_dir: str | Path,
    options: ExportOptions,
    show_progress: bool = False,
    explicit: Collection[str] | None = None,
) -> ShapeContract:
    """Export a checkpoint folder; returns the written contract.

    ``component='all'`` writes a new folder (replacing a previous export only with
    ``options.overwrite``); a single component replaces that graph in an existing export and
    keeps that export's contract options (see :func:`component_options`). All checks run
    before the weights are loaded; everything is written into a temporary sibling folder and
    moved into place at the end, so an interrupted export leaves nothing behind.

    Args:
        explicit: names of the options the user set (the CLI passes them); used to tell a
            deliberate conflict with an existing export from a default.

    Raises:
        ExportError: bad options, unsupported or unreadable checkpoint, or an output folder
            conflict, each naming the value and the rule it broke.
    """
    options.validate()
    out = output_folder(output_dir)
    model_dir = Path(model_id).expanduser().resolve()
    _check_output(out, model_dir, options)
    if options.component != ALL_COMPONENTS:
        existing = read_manifest(out)
        options = component_options(existing, options, explicit)
        options.validate()
    config, generation_config = load_config(model_dir)
    if options.component == ALL_COMPONENTS:
        options = fit_capacity(options, getattr(config.text_config, "max_position_embeddings", None), explicit)
        options.validate()
    pixel_range = processor_pixel_range(model_dir, config.vision_config)
    contract = build_contract(config, generation_config, options, pixel_range, has_mtp_weights(model_dir))
    contract = replace(contract, graphs={job.key: job.path for job in graph_jobs(contract)})
    if options.component != ALL_COMPONENTS and existing.same_shapes(contract):
        raise ExportError(
            f"--component {options.component}: the new graph would not match the graphs kept in {str(out)!r} "
            f"({'; '.join(existing.same_shapes(contract))}); re-export all graphs (--component all --overwrite)"
        )
    if options.component != ALL_COMPONENTS and existing.graphs != contract.graphs:
        raise ExportError(
            f"{str(out)!r} has another graph layout ({sorted(existing.graphs.values())}) than this version writes "
            f"({sorted(contract.graphs.values())}): re-export all graphs (--component all --overwrite)"
        )
    jobs = graph_jobs(contract, options.components)
    if not jobs:
        kinds = sorted({GraphKind.of(key) for key in contract.graphs})
        raise ExportError(
            f"--component {options.component}: the export in {str(out)!r} has no {options.component} graph "
            f"(it has {', '.join(kinds)} graphs)"
        )

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise ExportError(f"--output-dir {str(out)!r} cannot be created: {exc}") from exc
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; an export is ordinary data
    try:
        model, source = open_weights(model_dir, config, contract.dtype)
        if contract.draft_tokens:
            from .mtp import ExportMtpError, attach_mtp

            try:
                attach_mtp(model, torch_dtype(contract.dtype))
            except ExportMtpError as exc:
                raise ExportError(f"--model-id {str(model_dir)!r}: {exc}") from exc
        if options.component != ALL_COMPONENTS:
            keep = {job.path.split("/")[0] for job in graph_jobs(contract) if job.kind != options.component}
            for name in sorted(keep):
                if (out / name).is_dir():
                    shutil.copytree(out / name, tmp / name)
        text = None
        if contract.kv_precision == KvDtype.INT8 and any(job.kind != GraphKind.VISION for job in jobs):
            from .calibration import calibration_ids, kv_scales

            log.info("calibrating the int8 KV cache's scales on the checkpoint")
            model.kv_scales = kv_scales(model, source, calibration_ids(model_dir))
        if any(job.kind != GraphKind.VISION for job in jobs):
            (tmp / TEXT_DIR).mkdir(exist_ok=True)
            if contract.kv_precision == KvDtype.INT8:  # the runtime converts the prompt's cache with them
                import numpy as np
                import torch

                scales = torch.stack([torch.stack(pair) for pair in model.kv_scales]).float().numpy()
                np.save(tmp / TEXT_DIR / KV_SCALES, scales)  # [n_full, 2, Hkv, D]
            text = WeightsFileWriter(tmp / TEXT_DIR)
            exporting = {job.key for job in jobs}
            for key, path in contract.graphs.items():  # text graphs kept from the existing export
                if GraphKind.of(key) != GraphKind.VISION and key not in exporting:
                    text.add(tmp / path)
        vision = None
        if any(job.kind == GraphKind.VISION for job in jobs):
            (tmp / VISION_DIR).mkdir(exist_ok=True)
            vision = WeightsFileWriter(tmp / VISION_DIR, data_name=VISION_DATA)
        bar = tqdm(jobs, desc="export", unit="graph", disable=not show_progress, file=sys.stderr)
        for job in bar:
            bar.set_postfix_str(job.key)
            writer = vision if job.kind == GraphKind.VISION else text
            export_graph(job, model, contract, tmp, options.trace_len, source, writer)
        for writer in (vision, text):
            if writer is not None:
                writer.finish()
        copy_processor_files(model_dir, tmp)
        write_manifest(tmp, contract)
        _swap_into_place(tmp, out)
    except WeightsError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"--model-id {str(model_dir)!r}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("export peak resident memory %.2f GB", peak_rss_bytes() / 1e9)
    return contract


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def quiet_torch_export():
    """Silence torch's export-internal chatter (torchvision op registration notices, an
    'always_classified is unsupported' log line, onnxscript's optimizer's "Skipping constant folding
    for op Split with multiple outputs", deprecation warnings) that says nothing about the user's
    export; real failures still raise."""
    names = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the complete folder ``tmp`` (rename; the old folder is removed after)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
