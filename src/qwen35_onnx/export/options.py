"""The options of ``qwen35-onnx export``, each declared once (no torch).

:class:`ExportOptions` is the one declaration: each field's default, flag, help and whether it
shapes the contract (:func:`~qwen35_onnx.options.option`). The command line builds its options
from it, :meth:`ExportOptions.contract_fields` feeds the contract (the field names are the
contract's), and a one-graph re-export (``--component``) keeps an existing export's contract
options through :meth:`ExportOptions.from_contract`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from ..contract import (
    DEFAULT_CAPACITY,
    DEFAULT_QUANT_ACCURACY_LEVEL,
    DEFAULT_QUANT_BLOCK_SIZE,
    DEFAULT_QUANTIZED_KV_DTYPE,
    MAX_DRAFT_TOKENS,
    QUANT_ACCURACY_LEVELS,
    Dtype,
    GraphKind,
    KvDtype,
    KvMode,
    Ops,
    PrefillLogits,
    Quantization,
    ShapeContract,
    check_buckets,
    check_capacity,
    check_chunks,
    check_draft_tokens,
    check_dummy_seq_len,
    check_kv_tiers,
    check_slots,
    default_buckets,
    default_chunks,
    default_kv_tiers,
    is_quant_block_size,
    plain,
)
from ..image_grids import default_grids, format_grids, parse_grids
from ..options import declared, option

ALL_COMPONENTS = "all"
"""``--component`` value for a whole export."""


class ExportError(ValueError):
    """The checkpoint or the export options cannot be exported."""


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"32,512,1024"`` -> ``(32, 512, 1024)``.

    Raises:
        ValueError: not comma-separated integers, naming the text.
    """
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--prefill-buckets {text!r} must be comma-separated integers, e.g. 32,512,1024,2048"
        ) from None


def _parse_lengths(text: str, message: str) -> tuple[int, ...]:
    """Comma-separated integers as a tuple; ``""`` or ``"none"`` -> ``()``; a ValueError saying ``message``
    otherwise."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(message) from None


def parse_chunks(text: str) -> tuple[int, ...]:
    """``"64,512"`` -> ``(64, 512)``; ``""`` or ``"none"`` -> ``()``.

    Raises:
        ValueError: not comma-separated integers, naming the text.
    """
    return _parse_lengths(text, f"--prefill-chunks {text!r} must be comma-separated integers, e.g. 64,512, or none")


def parse_kv_tiers(text: str) -> tuple[int, ...]:
    """``"2048,8192"`` -> ``(2048, 8192)``; ``"none"`` -> ``()`` (one width, the capacity).

    Raises:
        ValueError: not comma-separated integers, naming the text.
    """
    message = f"--kv-tiers {text!r} must be comma-separated integers, e.g. 2048,8192,32768, or none"
    return _parse_lengths(text, message)


def resolve_kv_tiers(tiers, capacity: int, ops: Ops, kv_mode: KvMode) -> tuple[int, ...]:
    """``--kv-tiers`` as the contract records it: by default (None) :func:`~qwen35_onnx.contract.default_kv_tiers`;
    ``()`` (``none``) one width, the capacity; a list with the capacity added where its last width is below it."""
    if tiers is None:
        return default_kv_tiers(capacity, ops, kv_mode)
    tiers = tuple(tiers)
    if not tiers or (isinstance(tiers[-1], int) and not isinstance(tiers[-1], bool) and tiers[-1] < capacity):
        return (*tiers, capacity)
    return tiers


DEFAULT_IMAGE_TOKENS = 256
"""Default image-token budget per image (about 512 x 512 pixels)."""
ANY_GRID = "any"
"""``--vision-grids`` value for one vision graph that takes any grid up to the budget (no static grids)."""
STATIC_GRIDS = "static"
"""``--vision-grids`` value for the default static grid set (:func:`~qwen35_onnx.image_grids.default_grids`)."""


def parse_vision_grids(text: str) -> tuple[tuple[int, int], ...] | str:
    """``"any"`` -> :data:`ANY_GRID`; ``"static"`` -> :data:`STATIC_GRIDS`; ``"16x16,26x36"`` ->
    ``((16, 16), (26, 36))``.

    Raises:
        ValueError: anything else, naming the text.
    """
    if text.strip().lower() in (ANY_GRID, STATIC_GRIDS):
        return text.strip().lower()
    try:
        return parse_grids(text)
    except ValueError as exc:
        raise ValueError(f"--vision-grids {text!r}: {exc}; or 'any' or 'static'") from None


@dataclass(frozen=True)
class ExportOptions:
    """Options of ``qwen35-onnx export``; see each field's help. ``capacity`` (tokens) and
    ``kv_mode`` are independent of every other option. Fields marked ``contract=True`` are
    written to the manifest under the same name."""

    # fmt: off
    capacity: int = option(DEFAULT_CAPACITY, "--max-seq-len", contract=True,
                           help="Capacity in tokens: KV cache and mask width (prompt and reply together); by default "
                                f"{DEFAULT_CAPACITY}, or the checkpoint's max_position_embeddings where smaller. With "
                                "--ops ort the KV cache costs memory for the tokens in use, not for the capacity.")
    kv_mode: KvMode = option(KvMode.FIXED, "--kv-cache", contract=True,
                             help="fixed (constant-width KV, static graphs) or dynamic (growing).")
    dtype: Dtype = option(Dtype.FP32, "--dtype", contract=True,
                          help="fp32, fp16 or bf16: weights, activations, conv state and KV cache (the recurrent state "
                               "and the host-facing pixel_values, image_embeds and logits stay fp32; bf16 runs on "
                               "OpenVINO).")
    kv_dtype: KvDtype | None = option(
        None, "--kv-dtype", contract=True,
        help="Precision of the KV cache from the first decode step on (the prompt's graphs keep --dtype's), "
             "independent of --dtype: fp32 (transformers' numbers), fp16, bf16 (--ops portable: OpenVINO) or int8 "
             "(per-channel scales calibrated on the checkpoint at export); by default int8 for a quantized --ops "
             "ort export with a fixed KV cache (measured: the same prefill and half the decode time at 8k tokens), "
             "else --dtype's.")
    kv_tiers: tuple[int, ...] | None = option(
        None, "--kv-tiers", contract=True, parse=parse_kv_tiers,
        help="Comma-separated KV widths in tokens (the capacity is always the last one), or none for one width. A "
             "sequence's KV cache is held at the smallest width that holds it and moved up when it fills, so a step "
             "costs the width in use, not the capacity. By default with --ops portable and --kv-cache fixed: 2048, "
             "then x4 below the capacity (2048,8192,32768 at 65536), plus the capacity; with --ops ort one width "
             "(its GroupQueryAttention reads only the used length, and its cache costs memory as it is written).")
    image_tokens: int = option(
        DEFAULT_IMAGE_TOKENS, "--image-tokens", contract=True,
        help="Image-token budget of one image (each token is 32x32 pixels with Qwen3.5's 16-pixel patches and 2x2 "
             "merge, so 256 tokens is about 512x512 pixels): caps the image processor's max_pixels.")
    vision_grids: tuple[tuple[int, int], ...] | str = option(
        ANY_GRID, "--vision-grids", contract=True, parse=parse_vision_grids,
        help="any (one vision graph, any patch grid up to the budget: every image gets exactly the image "
             "processor's grid; ONNX Runtime only), static (the default static grids: common aspect ratios at the "
             "budget and at min_pixels, each its own static graph, for static compilers such as OpenVINO), or a "
             "list of HxW patch grids, e.g. 16x16,26x36.")
    dummy_seq_len: int | None = option(None, "--dummy-seq-len",
                                       "Trace length in tokens; by default 8, at most capacity - 1.")
    component: str = option(ALL_COMPONENTS, "--component",
                            "all, vision, prefill, chunk or decode (one graph kind of an existing export, keeping its "
                            "settings).")
    prefill_buckets: tuple[int, ...] | None = option(
        None, "--prefill-buckets", contract=True, parse=parse_buckets,
        help="Comma-separated static prefill lengths, e.g. 32,512,1024,2048 (fixed mode), instead of prefill chunks; "
             "with --prefill-chunks none, those below capacity, plus capacity.")
    prefill_chunks: tuple[int, ...] | None = option(
        None, "--prefill-chunks", contract=True, parse=parse_chunks,
        help="Comma-separated chunk sizes in tokens (fixed mode): graphs that prefill a chunk continuing from the "
             "states before it, so a prompt costs its own length in whole chunks and a conversation continues from a "
             "kept state instead of prefilling its history again; by default 8,32,128,512 (those up to the capacity) "
             "unless --prefill-buckets is given; none: prefill buckets instead.")
    prefill_logits: PrefillLogits = option(PrefillLogits.LAST, "--prefill-logits", contract=True,
                                           help="last (the last real token) or all (every position, for verification).")
    ops: Ops = option(Ops.ORT, "--ops", contract=True,
                      help="ort (ONNX Runtime fused operators, KV cache updated in place) or portable (standard ONNX "
                           "operators only, for other runtimes and compilers).")
    quantize: Quantization = option(
        Quantization.NONE, "--quantize", contract=True,
        help="none, int4 or int8: weight-only quantization of the text graphs (MatMulNBits with --ops ort, standard "
             "blocked DequantizeLinear with --ops portable).")
    quant_block_size: int = option(DEFAULT_QUANT_BLOCK_SIZE, "--quant-block-size", contract=True,
                                   help="Weights per quantization scale (power of two from 16 to 256).")
    quant_accuracy_level: int = option(
        DEFAULT_QUANT_ACCURACY_LEVEL, "--quant-accuracy-level", contract=True,
        help="ONNX Runtime's MatMulNBits accuracy level of a quantized export: 0 unset, 1 fp32, 2 fp16, 3 bf16, "
             "4 int8 activations (fastest on CPU). Written into --ops ort graphs, read from the manifest for --ops "
             "portable.")
    quantize_embedding: bool | None = option(
        None, "--quantize-embedding/--no-quantize-embedding", contract=True,
        help="Quantize the token-embedding table with the text weights (GatherBlockQuantized with the export's bits "
             "for --ops ort, sharing a tied lm_head's bytes; int8 Gather + DequantizeLinear for --ops portable); by "
             "default on when --quantize is int4 or int8.")
    max_images: int = option(1, "--max-images", contract=True,
                             help="Images per prompt the prefill graphs take (each adds its image tokens to the "
                                  "prompt).")
    slots: int = option(1, "--slots", contract=True,
                        help="Decode slots: the decode graph steps this many sequences at once (one row each, "
                             "each with its own states, mask and positions), so a server decodes that many requests "
                             "together (continuous batching); 1 keeps the batch-1 graph for compilers that take no "
                             "batch. More than 1 needs --kv-cache fixed and prefill chunks.")
    draft_tokens: int | None = option(
        None, "--draft-tokens", contract=True,
        help="Most draft tokens a speculative decoding round checks (0 to 4): the checkpoint's multi-token-"
             "prediction head (its mtp.* tensors) as MTP graphs, and a verify graph for each draft length; by "
             "default 4 when the checkpoint has an MTP head and the export prefills in chunks with a fixed KV cache "
             "and one decode slot, else 0 (no MTP graphs: the export is as without MTP).")
    # fmt: on
    overwrite: bool = option(False, "--overwrite", "Replace a previous export in --output-dir.")
    chunk_size: int = 64
    """Largest Gated DeltaNet chunk (tokens, a power of two): the contract's ``chunk_size`` is the
    largest power of two up to this that divides the capacity and every bucket."""

    @staticmethod
    def contract_fields() -> list[str]:
        """Names of the options that shape the contract (the contract's fields of the same names)."""
        return [o.name for o in declared(ExportOptions) if o.contract]

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of the option ``name`` (its first spelling)."""
        return next(o.flag for o in declared(ExportOptions) if o.name == name).split("/")[0]

    def validate(self) -> None:
        """Raises ExportError naming the option and the rule it broke."""
        for o in declared(ExportOptions):
            value = getattr(self, o.name)
            if isinstance(o.type, type) and issubclass(o.type, StrEnum) and value not in tuple(o.type):
                raise ExportError(f"{o.flag} {plain(value)!r} must be one of {', '.join(o.type)}")
        try:
            check_capacity(self.capacity)
            check_dummy_seq_len(self.trace_len, self.capacity)
        except ValueError as exc:
            raise ExportError(str(exc)) from exc
        if self.component not in (ALL_COMPONENTS, *GraphKind):
            raise ExportError(f"--component {self.component!r} must be one of all, {', '.join(GraphKind)}")
        if self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ExportError(f"chunk size {self.chunk_size} must be a power of two")
        bs = self.quant_block_size
        if not is_quant_block_size(bs):
            raise ExportError(f"--quant-block-size {bs!r} must be a power of two from 16 to 256")
        level = self.quant_accuracy_level
        if isinstance(level, bool) or not isinstance(level, int) or level not in QUANT_ACCURACY_LEVELS:
            raise ExportError(
                f"--quant-accuracy-level {level!r} must be one of {', '.join(map(str, QUANT_ACCURACY_LEVELS))} "
                "(0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8)"
            )
        if level != DEFAULT_QUANT_ACCURACY_LEVEL and self.quantize == Quantization.NONE:
            raise ExportError(
                f"--quant-accuracy-level {level} applies to quantized exports only (add --quantize int4|int8)"
            )
        if self.quantize_embedding is not None and not isinstance(self.quantize_embedding, bool):
            raise ExportError(f"--quantize-embedding must be true or false, got {self.quantize_embedding!r}")
        if self.quantize_embedding and self.quantize == Quantization.NONE:
            raise ExportError("--quantize-embedding applies to quantized exports only (add --quantize int4|int8)")
        if self.dtype == Dtype.BF16 and self.ops == Ops.ORT:
            raise ExportError(
                "--dtype bf16 needs --ops portable: ONNX Runtime's fused operators (--ops ort) take fp32 and fp16 "
                "only, and OpenVINO, which runs bf16, reads portable graphs only"
            )
        if self.kv_dtype is not None and self.kv_dtype not in tuple(KvDtype):
            raise ExportError(f"--kv-dtype {plain(self.kv_dtype)!r} must be one of {', '.join(KvDtype)}")
        if self.kv_precision == KvDtype.BF16 and self.ops == Ops.ORT:
            raise ExportError(
                "--kv-dtype bf16 needs --ops portable: ONNX Runtime's GroupQueryAttention (--ops ort) keeps its KV "
                "cache in fp32, fp16 or int8; OpenVINO runs a bf16 cache from portable graphs"
            )
        if self.kv_precision != self.dtype and self.kv_mode != KvMode.FIXED:
            raise ExportError(
                f"--kv-dtype {plain(self.kv_precision)} with --dtype {plain(self.dtype)} needs --kv-cache fixed (a "
                "dynamic cache is kept in the activations' dtype)"
            )
        grids = self.vision_grids
        if grids not in (ANY_GRID, STATIC_GRIDS) and not isinstance(grids, (tuple, list)):
            raise ExportError(f"--vision-grids {grids!r} must be 'any', 'static' or a list of (h, w) patch grids")
        if isinstance(self.max_images, bool) or not isinstance(self.max_images, int) or self.max_images < 1:
            raise ExportError(f"--max-images must be an integer >= 1, got {self.max_images!r}")
        try:
            check_slots(self.slots, self.kv_mode, self.chunks)
        except ValueError as exc:
            raise ExportError(f"--slots: {exc}") from exc
        if self.draft_tokens is not None:
            try:
                check_draft_tokens(self.draft_tokens, self.kv_mode, self.chunks)
            except ValueError as exc:
                raise ExportError(f"--draft-tokens: {exc}") from exc
        if self.prefill_buckets is not None:
            if self.kv_mode != KvMode.FIXED:
                raise ExportError(
                    "--prefill-buckets needs --kv-cache fixed (dynamic mode has one dynamic-length prefill graph)"
                )
            if not self.prefill_buckets:
                raise ExportError("--prefill-buckets is empty; give at least one length")
            try:
                check_buckets(self.prefill_buckets, self.capacity)
            except ValueError as exc:
                raise ExportError(f"--prefill-buckets: {exc}") from exc

        if self.kv_tiers is not None and not isinstance(self.kv_tiers, (tuple, list)):
            raise ExportError(f"--kv-tiers {self.kv_tiers!r} must be a list of widths in tokens, or none")
        tiers = self.tiers
        try:
            check_kv_tiers(tiers, self.capacity, Ops.PORTABLE, KvMode.FIXED)
        except ValueError as exc:
            raise ExportError(f"--kv-tiers: {exc}") from exc
        shown = ",".join(map(str, tiers))
        if len(tiers) > 1 and self.kv_mode != KvMode.FIXED:
            raise ExportError(
                f"--kv-tiers {shown} needs --kv-cache fixed: a dynamic KV cache grows by one token a step already"
            )
        if len(tiers) > 1 and self.ops != Ops.PORTABLE:
            raise ExportError(
                f"--kv-tiers {shown} needs --ops portable: with --ops {plain(self.ops)} GroupQueryAttention reads "
                "only the used length of one capacity-wide KV cache, whose memory is committed as it is written, so "
                "one width already costs what is used (leave --kv-tiers out, or give none)"
            )

        if self.prefill_chunks is not None and not isinstance(self.prefill_chunks, (tuple, list)):
            raise ExportError(f"--prefill-chunks {self.prefill_chunks!r} must be a list of chunk sizes")
        try:
            check_chunks(self.chunks, self.capacity, self.kv_mode)
        except ValueError as exc:
            raise ExportError(f"--prefill-chunks: {exc}") from exc
        if self.prefill_chunks and self.prefill_buckets:
            raise ExportError(
                f"--prefill-buckets {','.join(map(str, self.prefill_buckets))} with --prefill-chunks "
                f"{','.join(map(str, self.prefill_chunks))}: a chunked export prefills in chunks only (any length up "
                "to the capacity); give one of them"
            )

    def check_embedding_blocks(self, hidden_size: int) -> None:
        """A quantized embedding on ``--ops ort`` (GatherBlockQuantized) needs whole blocks along the hidden axis.

        Raises:
            ExportError: ``hidden_size`` is not a multiple of ``quant_block_size`` for such an export.
        """
        if self.embedding_quantized and self.ops == Ops.ORT and hidden_size % self.quant_block_size:
            raise ExportError(
                f"the model's hidden size {hidden_size} is not a multiple of --quant-block-size "
                f"{self.quant_block_size}, which the quantized embedding (GatherBlockQuantized) needs; "
                "choose a smaller block size or add --no-quantize-embedding"
            )

    @property
    def chunks(self) -> tuple[int, ...]:
        """Prefill chunk sizes in tokens: as given; by default (None) :data:`~qwen35_onnx.contract.DEFAULT_CHUNKS`
        up to the capacity in fixed mode without ``prefill_buckets``, else none."""
        if self.prefill_chunks is not None:
            return tuple(self.prefill_chunks)
        if self.kv_mode != KvMode.FIXED or self.prefill_buckets is not None:
            return ()
        return default_chunks(self.capacity)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Prefill buckets in tokens: as given, or the standard tiers below capacity plus
        capacity (fixed mode); none in dynamic mode or with prefill chunks."""
        if self.kv_mode != KvMode.FIXED or self.chunks:
            return ()
        return tuple(self.prefill_buckets) if self.prefill_buckets else default_buckets(self.capacity)

    @property
    def tiers(self) -> tuple[int, ...]:
        """The KV tiers in tokens (:func:`resolve_kv_tiers`)."""
        return resolve_kv_tiers(self.kv_tiers, self.capacity, self.ops, self.kv_mode)

    @property
    def kv_precision(self) -> KvDtype:
        """The KV cache's precision: ``kv_dtype``; by default (None) int8 for a quantized ``--ops ort`` export with a
        fixed KV cache (:data:`~qwen35_onnx.contract.DEFAULT_QUANTIZED_KV_DTYPE`), else ``dtype``'s."""
        if self.kv_dtype is not None:
            return KvDtype(self.kv_dtype)
        if self.quantize != Quantization.NONE and self.ops == Ops.ORT and self.kv_mode == KvMode.FIXED:
            return DEFAULT_QUANTIZED_KV_DTYPE
        return KvDtype(self.dtype)

    @property
    def embedding_quantized(self) -> bool:
        """Whether the token-embedding table is quantized: ``quantize_embedding``, by default
        (None) whenever the text weights are."""
        return self.quantize != Quantization.NONE and self.quantize_embedding is not False

    @property
    def trace_len(self) -> int:
        """Trace length in tokens: ``dummy_seq_len``, or by default 8 capped at capacity - 1."""
        return self.dummy_seq_len if self.dummy_seq_len is not None else min(8, self.capacity - 1)

    @property
    def components(self) -> tuple[GraphKind, ...]:
        """The graph kinds this export writes."""
        return tuple(GraphKind) if self.component == ALL_COMPONENTS else (GraphKind(self.component),)

    def contract_values(self, has_mtp: bool = False) -> dict[str, Any]:
        """The contract-shaping options as the contract records them: defaults resolved
        (:attr:`buckets`, :attr:`embedding_quantized`, :meth:`drafts`; ``has_mtp``: the checkpoint has an MTP
        head)."""
        values = {name: getattr(self, name) for name in self.contract_fields()}
        values.update(
            prefill_buckets=self.buckets,
            prefill_chunks=self.chunks,
            quantize_embedding=self.embedding_quantized,
            draft_tokens=self.drafts(has_mtp),
            kv_dtype=self.kv_precision,
            kv_tiers=self.tiers,
        )
        return values

    def drafts(self, has_mtp: bool) -> int:
        """The export's draft tokens for a checkpoint with (``has_mtp``) or without an MTP head: as given; by
        default (None) :data:`~qwen35_onnx.contract.MAX_DRAFT_TOKENS` where the checkpoint has the head and the
        export prefills in chunks with a fixed KV cache and has one decode slot, else 0.

        Raises:
            ExportError: draft tokens asked of a checkpoint without an MTP head.
        """
        if self.draft_tokens is None:  # (an export of several slots decodes them together: no speculation there)
            wanted = has_mtp and self.chunks and self.kv_mode == KvMode.FIXED and self.slots == 1
            return MAX_DRAFT_TOKENS if wanted else 0
        if self.draft_tokens and not has_mtp:
            raise ExportError(
                f"--draft-tokens {self.draft_tokens}: the checkpoint has no multi-token-prediction head (no mtp.* "
                "tensors), which drafts the tokens; export it with --draft-tokens 0"
            )
        return self.draft_tokens

    @classmethod
    def from_contract(cls, contract: ShapeContract, **others) -> ExportOptions:
        """The options that made ``contract`` (the contract-shaping ones), ``others`` in place of those named
        there and added."""
        values = {name: getattr(contract, name) for name in cls.contract_fields()}
        values["prefill_buckets"] = contract.prefill_buckets or None  # none in dynamic mode
        values["vision_grids"] = contract.vision_grids or ANY_GRID
        return cls(**{**values, **others})


def _export_option(name: str) -> Any:
    """A field declared as ``export``'s option ``name`` (the same default, flag and help)."""
    field = next(f for f in dataclasses.fields(ExportOptions) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


@dataclass(frozen=True)
class QuantizeOptions:
    """Options of ``qwen35-onnx quantize`` (weight-only quantization of an existing export's text graphs,
    :mod:`.requantize`): ``export``'s quantization options, with the same flags, defaults and rules."""

    quantize: Quantization | None = option(
        None,
        "--quantize",
        help="int4 or int8 (required): the weight-only quantization to apply, as export's --quantize.",
    )
    quant_block_size: int = _export_option("quant_block_size")
    quant_accuracy_level: int = _export_option("quant_accuracy_level")
    quantize_embedding: bool | None = _export_option("quantize_embedding")
    overwrite: bool = _export_option("overwrite")

    def validate(self) -> None:
        """Raises ExportError: no quantization asked (``--quantize`` none or another value); the other options
        are checked against the source export's (:func:`.requantize.quantized_contract`)."""
        if self.quantize is None:
            raise ExportError("--quantize is required: int4 or int8 (the quantization to apply to the export)")
        if self.quantize not in (Quantization.INT4, Quantization.INT8):
            raise ExportError(
                f"--quantize {plain(self.quantize)!r} must be int4 or int8 (the quantization to apply to the export)"
            )


def _resolved_grids(grids, contract: ShapeContract):
    """``--vision-grids`` as an export with ``contract``'s budget and processor range records it
    (``static``: the default grid set), :data:`ANY_GRID` for no static grid."""
    if grids == STATIC_GRIDS:
        c = contract
        grids = default_grids(c.image_tokens, c.patch_size, c.spatial_merge_size, c.min_pixels, c.max_pixels)
    if isinstance(grids, (tuple, list)):
        return tuple(tuple(g) for g in grids) or ANY_GRID
    return grids


def fit_capacity(options: ExportOptions, max_positions: int | None, explicit: set[str] | None) -> ExportOptions:
    """``options`` with the default capacity lowered to the checkpoint's ``max_position_embeddings`` where that is
    smaller (a capacity the user gave, ``explicit``, is kept: an export past the model's positions is an error,
    raised when the contract is built). ``explicit`` None: a capacity other than :data:`DEFAULT_CAPACITY` counts
    as given."""
    given = "capacity" in explicit if explicit is not None else options.capacity != DEFAULT_CAPACITY
    if given or not max_positions or options.capacity <= max_positions:
        return options
    return replace(options, capacity=int(max_positions))


def component_options(existing: ShapeContract, options: ExportOptions, explicit: set[str] | None) -> ExportOptions:
    """Options for re-exporting one graph of an existing export: its contract options come from
    the existing manifest, so the updated folder stays consistent.

    Raises:
        ExportError: an option given explicitly (``explicit``; when None, any option that is
            not its default) differs from the existing export.
    """
    current = ExportOptions.from_contract(existing)
    defaults = ExportOptions()
    conflicts = []
    for name in ExportOptions.contract_fields():
        given, kept = getattr(options, name), getattr(current, name)
        if given is not None and name in ("prefill_buckets", "prefill_chunks"):
            given = tuple(given)
        if name == "vision_grids":
            given = _resolved_grids(given, existing)
        if name == "kv_tiers" and given is not None:
            given = resolve_kv_tiers(given, existing.capacity, existing.ops, existing.kv_mode)
        chosen = name in explicit if explicit is not None else given != getattr(defaults, name)
        if chosen and given != kept:
            shown = [format_grids(v) if isinstance(v, tuple) and name == "vision_grids" else v for v in (given, kept)]
            conflicts.append(f"{ExportOptions.flag(name)} {plain(shown[0])!r} (the export has {plain(shown[1])!r})")
    if conflicts:
        raise ExportError(
            "--component updates one graph of an existing export and keeps its contract, but "
            + "; ".join(conflicts)
            + ": export everything again with --component all --overwrite to change it"
        )
    return replace(options, **{name: getattr(current, name) for name in ExportOptions.contract_fields()})
