"""Cross-checks of loaded graphs against the manifest, shared by every runtime backend (no torch,
no runtime import).

A backend describes each graph it loaded as a :class:`GraphSpec`: the graph's own contract (read
from its ``metadata_props``), its input and output names with their shapes and element types.
The ``check_*`` functions compare that description with the manifest's
:class:`~qwen35_onnx.contract.ShapeContract`. The capacity comes from two sources that must agree:
the manifest and the graphs' own static shapes (decode ``attention_mask`` width ==
``past_kv_cache`` token axis == ``present_kv_cache`` token axis, and prefill's
``present_kv_cache`` token axis). With several KV tiers (``kv_tiers`` in the manifest) the decode, chunk, verify
and MTP graphs take the KV width symbolic (``kv_width``, and only then) and each prefill bucket's KV output is the
smallest tier that holds the bucket. Any disagreement is a
:class:`~qwen35_onnx.contract.ContractError` raised at load time, before the first decode step;
there is no silent fallback to another flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..contract import KV_WIDTH, STATE_NAMES, ContractError, GraphKind, KvMode, PrefillLogits, ShapeContract

#: Element type (ONNX's type string, the same for every backend) of each contract dtype.
ONNX_TYPES = {"fp32": "tensor(float)", "fp16": "tensor(float16)", "bf16": "tensor(bfloat16)", "int8": "tensor(int8)"}
#: Tensors that cross between the host and the graphs, fp32 in every export dtype: (graph kind,
#: 'input'/'output', name).
HOST_FP32 = (
    ("vision", "input", "pixel_values"),
    ("vision", "output", "image_embeds"),
    ("prefill", "input", "image_embeds"),
    ("prefill", "output", "logits"),
    ("chunk", "input", "image_embeds"),
    ("chunk", "output", "logits"),
    ("decode", "output", "logits"),
    ("verify", "output", "logits"),
    ("verify", "output", "hidden_states"),
    ("mtp", "input", "hidden_states"),
    ("mtp", "input", "image_embeds"),
    ("mtp", "output", "logits"),
    ("mtp", "output", "mtp_hidden"),
)


def _check_host_types(graph: GraphSpec, kind: str) -> None:
    for graph_kind, io, name in HOST_FP32:
        if graph_kind == kind:
            _expect(
                f"{graph.name} {io} {name} element type",
                graph.types.get(name),
                ONNX_TYPES["fp32"],
                "the contract keeps host-facing tensors fp32 in every dtype:",
            )


@dataclass
class GraphSpec:
    """What a backend loaded for one graph, in backend-neutral terms.

    Shapes are lists whose entries are ints (static) or strings (symbolic / dynamic); element
    types are ONNX type strings, e.g. ``'tensor(float)'``, ``'tensor(int64)'``.
    """

    name: str
    contract: ShapeContract
    inputs: dict[str, list]
    outputs: dict[str, list]
    types: dict[str, str] = field(default_factory=dict)

    def dim(self, kind: str, tensor: str, axis: int):
        """Static size of ``tensor``'s ``axis`` (an int), or its symbolic name (a str)."""
        table = self.inputs if kind == "input" else self.outputs
        if tensor not in table:
            raise ContractError(f"{self.name} graph has no {kind} named {tensor!r} (has {sorted(table)})")
        return table[tensor][axis]


def _expect(what: str, actual, expected, source: str = "the manifest says") -> None:
    if actual != expected:
        raise ContractError(f"{what} is {actual!r} but {source} {expected!r}")


def check_metadata(contract: ShapeContract, graph: GraphSpec) -> None:
    """The graph's own contract (from ``metadata_props``) must equal the manifest's.

    Raises:
        ContractError: naming the graph and every field that differs, e.g. ``capacity: 64 != 128``.
    """
    diff = graph.contract.same_shapes(contract)
    if diff:
        raise ContractError(
            f"{graph.name} graph was exported with a different contract than manifest.json: {'; '.join(diff)} "
            "(were the graphs exported separately with different options?)"
        )


def _check_tensor(graph: GraphSpec, kind: str, name: str, shape: list, dtype: str) -> None:
    """``name`` is a ``kind`` ('input'/'output') of ``graph`` with ``shape`` and element type ``dtype``."""
    table = graph.inputs if kind == "input" else graph.outputs
    if name not in table:
        raise ContractError(
            f"{graph.name} graph has no {kind} {name!r}; the manifest expects one of shape {shape} "
            f"(has {sorted(table)})"
        )
    _expect(f"{graph.name} {kind} {name} shape", table[name], shape)
    _expect(f"{graph.name} {kind} {name} element type", graph.types.get(name), ONNX_TYPES[dtype])


def _state_dtype(contract: ShapeContract, state: str, what: str) -> str:
    """The element type of ``state`` in a graph of kind ``what``: the prompt's graphs (prefill, chunk) hold the KV
    cache in the contract's ``prompt_kv_dtype``, the decode and verify graphs in its ``kv_precision``."""
    if state == "kv_cache" and what in ("prefill", "chunk"):
        return contract.prompt_kv_dtype
    return contract.state_dtype(state)


def _check_states(
    contract: ShapeContract, graph: GraphSpec, kind: str, prefix: str, shape_of=None, what: str = "decode"
) -> None:
    shape_of = shape_of or contract.state_shape
    for state in STATE_NAMES[:2]:  # the KV cache's shape is checked with the capacity
        _check_tensor(graph, kind, f"{prefix}_{state}", list(shape_of(state)), contract.state_dtype(state))
    _expect(
        f"{graph.name} {kind} {prefix}_kv_cache element type",
        graph.types.get(f"{prefix}_kv_cache"),
        ONNX_TYPES[_state_dtype(contract, "kv_cache", what)],
    )


def _check_names(graph: GraphSpec, kind: str, expected: list[str]) -> None:
    """The graph's ``kind`` names are exactly ``expected`` (an extra input would be left unfed by
    one decoder and demanded by another)."""
    table = graph.inputs if kind == "input" else graph.outputs
    extra, missing = sorted(set(table) - set(expected)), [n for n in expected if n not in table]
    if extra or missing:
        raise ContractError(
            f"{graph.name} graph {kind}s do not match the manifest: unexpected {extra}, missing {missing} "
            "(a graph of another kind or layout in this export? re-export the folder with this version)"
        )


def kv_width_axes(contract: ShapeContract, key: str) -> dict[str, int]:
    """Which axis of which input or output of the graph listed under ``key`` is the symbolic KV width
    (:data:`~qwen35_onnx.contract.KV_WIDTH`): ``attention_mask``'s 1 and the stacked KV cache's 3 (the MTP head's
    too) in the decode, chunk, verify and MTP graphs of an export with several KV tiers; none otherwise (every
    dimension static)."""
    kinds = (GraphKind.DECODE, GraphKind.CHUNK, GraphKind.VERIFY, GraphKind.MTP)
    if not contract.tiered or GraphKind.of(key) not in kinds:
        return {}
    names = ("past_kv_cache", "present_kv_cache", "past_mtp_kv_cache", "present_mtp_kv_cache")
    return {"attention_mask": 1, **dict.fromkeys(names, 3)}


def _check_capacity(contract: ShapeContract, widths: dict[str, object]) -> None:
    """The KV widths of a decode, chunk, verify or MTP graph (``widths``: what -> the size in its shape) are the
    manifest's capacity, or with several KV tiers all the symbolic :data:`~qwen35_onnx.contract.KV_WIDTH`."""
    expected = contract.kv_width_dim
    for what, width in widths.items():
        if width == expected:
            continue
        listing = ", ".join(f"{k} = {v!r}" for k, v in widths.items())
        tiers = ",".join(map(str, contract.kv_tiers))
        if contract.tiered:
            raise ContractError(
                f"KV width mismatch: {what} is {width!r} but manifest.json lists the KV tiers {tiers}, whose graphs "
                f"take the KV width symbolic ({KV_WIDTH!r}) ({listing}); re-export all graphs with the same --kv-tiers"
            )
        if isinstance(width, str):
            raise ContractError(
                f"KV width mismatch: {what} is symbolic ({width!r}), which only an export with several KV tiers has, "
                f"but manifest.json lists one width, the capacity {contract.capacity} ({listing}); re-export all "
                "graphs with the same --max-seq-len and --kv-tiers"
            )
        raise ContractError(
            f"capacity mismatch: {what} is {width!r} but manifest capacity is {contract.capacity} "
            f"({listing}); re-export all graphs with the same --max-seq-len"
        )


#: The vision graph's inputs (pixel_values first; the other three computed per grid on the host,
#: see :mod:`.vision_positions`) and their element types.
VISION_INPUT_TYPES = {
    "pixel_values": "tensor(float)",
    "pos_embed_indices": "tensor(int64)",
    "pos_embed_weights": "tensor(float)",
    "rotary_position_ids": "tensor(int64)",
}


def check_vision(contract: ShapeContract, vision: GraphSpec, grid: tuple[int, int] | None) -> None:
    """The inputs of :data:`VISION_INPUT_TYPES`, each with one row per patch; ``pixel_values [N,
    patch_dim]`` and ``image_embeds [N / merge**2, image_embed_dim]`` where N is the static
    ``grid``'s patch count, or symbolic in the any-grid graph (``grid`` None)."""
    _check_names(vision, "input", list(VISION_INPUT_TYPES))
    _check_names(vision, "output", ["image_embeds"])
    for name, onnx_type in VISION_INPUT_TYPES.items():
        _expect(f"{vision.name} input {name} element type", vision.types.get(name), onnx_type)
    patches = vision.dim("input", "pixel_values", 0)
    if grid is not None:
        tokens = grid[0] * grid[1] // contract.spatial_merge_size**2
        _expect(
            f"{vision.name} input pixel_values shape",
            vision.inputs["pixel_values"],
            [grid[0] * grid[1], contract.patch_dim],
        )
        _expect(
            f"{vision.name} output image_embeds shape",
            vision.outputs["image_embeds"],
            [tokens, contract.image_embed_dim],
        )
    else:
        if isinstance(patches, int):
            raise ContractError(
                f"{vision.name} graph takes {patches} patches only, but the manifest lists it as the any-grid graph "
                "(a dynamic patch count); re-export the vision graph"
            )
        _expect(f"{vision.name} input pixel_values columns", vision.dim("input", "pixel_values", 1), contract.patch_dim)
        _expect(
            f"{vision.name} output image_embeds columns",
            vision.dim("output", "image_embeds", 1),
            contract.image_embed_dim,
        )
    _check_host_types(vision, "vision")


DECODE_HOST_INPUTS = ["input_ids", "attention_mask", "position_ids"]
CHUNK_HOST_INPUTS = ["input_ids", "chunk_mask", "attention_mask", "position_ids", "image_embeds"]


def check_chunk(contract: ShapeContract, chunk: GraphSpec, size: int) -> None:
    """As :func:`check_decode` with the chunk graph's host inputs (:data:`CHUNK_HOST_INPUTS`):
    ``input_ids`` and ``chunk_mask`` ``[1, size]``, ``image_embeds [size, image_embed_dim]``
    fp32, and one logits row with ``prefill_logits='last'``."""
    hidden = ["hidden_states"] if contract.draft_tokens else []
    check_decode(contract, chunk, CHUNK_HOST_INPUTS, "chunk", hidden)
    if hidden:  # the MTP head reads every position's
        _check_tensor(chunk, "output", "hidden_states", [contract.batch, size, contract.hidden_size], "fp32")
    for name in ("input_ids", "chunk_mask"):
        _expect(f"{chunk.name} {name} shape", chunk.inputs.get(name), [contract.batch, size])
    _expect(f"{chunk.name} image_embeds shape", chunk.inputs.get("image_embeds"), [size, contract.image_embed_dim])
    if contract.prefill_logits == PrefillLogits.LAST:
        _expect(f"{chunk.name} logits rows", chunk.dim("output", "logits", 1), 1)


def check_decode(
    contract: ShapeContract,
    decode: GraphSpec,
    host_inputs: list[str] = DECODE_HOST_INPUTS,
    what: str = "decode",
    extra_outputs: list[str] = (),
) -> None:
    """Input and output names exactly as the contract says (``host_inputs`` and the states); state
    shapes and element types; and in fixed mode: mask width == past KV width == present KV width ==
    capacity (for every entry when the graph takes the states one entry at a time). ``what``
    names the graph kind in errors (decode, or chunk for :func:`check_chunk`). The decode graph has one
    row per slot (:attr:`ShapeContract.slots`: tokens, mask rows, positions, states and logits), a chunk
    graph one."""
    dynamic = what == "decode" and contract.dynamic_rows
    if what == "decode":
        host_inputs = contract.decode_host_inputs
        if "active_rows" in host_inputs and "active_rows" in decode.inputs:
            found = decode.inputs["active_rows"]
            if not (dynamic and len(found) == 1 and not isinstance(found[0], int)):
                _expect(f"{what} active_rows shape", found, [contract.slots])
            _expect(f"{what} active_rows element type", decode.types.get("active_rows"), "tensor(bool)")
    for kind, prefix, fixed in (
        ("input", "past", list(host_inputs)),
        ("output", "present", ["logits", *extra_outputs]),
    ):
        _check_names(
            decode, kind, fixed + [n for state in STATE_NAMES for n in contract.decode_state_names(state, prefix)]
        )
    _check_host_types(decode, what)
    rows = contract.slots if what == "decode" else contract.batch
    shape_of = contract.slot_state_shape if what == "decode" else contract.state_shape
    for kind, name in (("input", "input_ids"), ("input", "attention_mask"), ("output", "logits")):
        found = decode.dim(kind, name, 0)
        if dynamic and not isinstance(found, int):
            continue  # the rows in use, 1 to slots
        _expect(f"{what} {name} rows (decode slots{', dynamic' if dynamic else ''})", found, rows)
    if contract.kv_in_place:
        for kind, prefix in (("input", "past"), ("output", "present")):
            table = decode.inputs if kind == "input" else decode.outputs
            for state in STATE_NAMES:
                entry = list(shape_of(state)[1:])
                for name in contract.decode_state_names(state, prefix):
                    if state == "kv_cache":
                        _check_capacity(contract, {f"{what} {name} token axis": table[name][2]})
                    found = table.get(name)
                    if dynamic and found is not None and not isinstance(found[0], int):
                        entry = [found[0], *entry[1:]]  # the rows in use
                    _check_tensor(decode, kind, name, entry, _state_dtype(contract, state, what))
        _check_capacity(contract, {f"{what} attention_mask width": decode.dim("input", "attention_mask", 1)})
        return
    _check_states(contract, decode, "input", "past", shape_of, what)
    _check_states(contract, decode, "output", "present", shape_of, what)
    if contract.kv_mode == KvMode.FIXED:
        _check_capacity(
            contract,
            {
                f"{what} attention_mask width": decode.dim("input", "attention_mask", 1),
                f"{what} past_kv_cache token axis": decode.dim("input", "past_kv_cache", 3),
                f"{what} present_kv_cache token axis": decode.dim("output", "present_kv_cache", 3),
            },
        )


def check_verify(contract: ShapeContract, verify: GraphSpec, size: int) -> None:
    """The verify graph of ``size`` tokens (:class:`~qwen35_onnx.export.graphs.VerifyGraph`): the decode graph's
    host inputs and past states (one row); outputs ``logits [1, size, V]`` and ``hidden_states [1, size, hidden]``
    fp32, the conv and recurrent state after each position of each linear layer
    (:meth:`~qwen35_onnx.contract.ShapeContract.verify_state_names`, one entry's shape each) and the KV cache as
    the chunk graph's (capacity wide)."""
    kv = contract.decode_state_names("kv_cache", "present")
    past = [n for state in STATE_NAMES for n in contract.decode_state_names(state, "past")]
    per_position = {state: contract.verify_state_names(state, size) for state in STATE_NAMES[:2]}
    _check_names(verify, "input", DECODE_HOST_INPUTS + past)
    _check_names(
        verify,
        "output",
        ["logits", "hidden_states", *per_position["conv_states"], *per_position["recurrent_states"], *kv],
    )
    _check_host_types(verify, "verify")
    b = contract.batch
    _expect(f"{verify.name} input_ids shape", verify.inputs.get("input_ids"), [b, size])
    _expect(f"{verify.name} logits shape", verify.outputs.get("logits"), [b, size, contract.vocab_size])
    _expect(f"{verify.name} hidden_states shape", verify.outputs.get("hidden_states"), [b, size, contract.hidden_size])
    for state, names in per_position.items():
        entry = list(contract.state_shape(state)[1:])
        for name in names:
            _check_tensor(verify, "output", name, entry, contract.state_dtype(state))
    widths = {f"{verify.name} attention_mask width": verify.dim("input", "attention_mask", 1)}
    for name in contract.decode_state_names("kv_cache", "past"):
        widths[f"{verify.name} {name} token axis"] = verify.inputs[name][-2]
    for name in kv:
        widths[f"{verify.name} {name} token axis"] = verify.outputs[name][-2]
    _check_capacity(contract, widths)


def check_mtp(contract: ShapeContract, mtp: GraphSpec, size: int) -> None:
    """The MTP graph of ``size`` positions (:class:`~qwen35_onnx.export.graphs.MtpGraph`): host inputs
    ``input_ids``, ``chunk_mask [1, size]``, ``hidden_states [1, size, hidden]`` fp32, ``attention_mask [1, L]``,
    ``position_ids``, ``image_embeds``; its KV cache ``[2, 1, Hkv, L, D]`` (or its two entries); outputs
    ``logits [1, 1, V]`` and ``mtp_hidden [1, 1, hidden]`` fp32."""
    entries = [".0", ".1"] if contract.kv_in_place else [""]
    host = ["input_ids", "hidden_states", "chunk_mask", "attention_mask", "position_ids", "image_embeds"]
    _check_names(mtp, "input", host + [f"past_mtp_kv_cache{e}" for e in entries])
    _check_names(mtp, "output", ["logits", "mtp_hidden"] + [f"present_mtp_kv_cache{e}" for e in entries])
    _check_host_types(mtp, "mtp")
    b, h = contract.batch, contract.hidden_size
    for name, shape in (("input_ids", [b, size]), ("chunk_mask", [b, size]), ("hidden_states", [b, size, h])):
        _expect(f"{mtp.name} {name} shape", mtp.inputs.get(name), shape)
    _expect(f"{mtp.name} logits shape", mtp.outputs.get("logits"), [b, 1, contract.vocab_size])
    _expect(f"{mtp.name} mtp_hidden shape", mtp.outputs.get("mtp_hidden"), [b, 1, h])
    widths = {f"{mtp.name} attention_mask width": mtp.dim("input", "attention_mask", 1)}
    for e in entries:
        for kind, name in (("input", f"past_mtp_kv_cache{e}"), ("output", f"present_mtp_kv_cache{e}")):
            widths[f"{mtp.name} {name} token axis"] = mtp.dim(kind, name, -2)
    _check_capacity(contract, widths)
    kv = list(contract.mtp_kv_shape_at(contract.kv_width_dim))
    kv = kv[1:] if contract.kv_in_place else kv
    for e in entries:
        _check_tensor(mtp, "input", f"past_mtp_kv_cache{e}", kv, contract.mtp_kv_dtype)
        _check_tensor(mtp, "output", f"present_mtp_kv_cache{e}", kv, contract.mtp_kv_dtype)


def check_prefill(contract: ShapeContract, prefill: GraphSpec, bucket: int | None) -> None:
    """State shapes; in fixed mode the KV output width equals the smallest KV tier that holds the bucket (the
    capacity with one tier) and a bucket graph's
    inputs have exactly ``bucket`` tokens; logits have 1 row with ``prefill_logits='last'``."""
    _check_states(contract, prefill, "output", "present", what="prefill")
    _check_host_types(prefill, "prefill")
    if contract.kv_mode == KvMode.FIXED and bucket is not None:
        width, expected = prefill.dim("output", "present_kv_cache", 3), contract.prefill_kv_width(bucket)
        if width != expected and contract.tiered:
            raise ContractError(
                f"{prefill.name} present_kv_cache token axis is {width!r} but the manifest's KV tiers "
                f"{','.join(map(str, contract.kv_tiers))} put a {bucket}-token bucket at the tier {expected}; "
                "re-export all graphs with the same --kv-tiers"
            )
        if width != expected:
            _check_capacity(contract, {"prefill present_kv_cache token axis": width})
    _expect(
        f"{prefill.name} input image_embeds shape",
        prefill.inputs.get("image_embeds"),
        [contract.n_image_rows, contract.image_embed_dim],
    )
    if bucket is not None:
        _expect(f"{prefill.name} input_ids shape", prefill.inputs.get("input_ids"), [contract.batch, bucket])
    if contract.prefill_logits == PrefillLogits.LAST:
        _expect(f"{prefill.name} logits rows", prefill.dim("output", "logits", 1), 1)
