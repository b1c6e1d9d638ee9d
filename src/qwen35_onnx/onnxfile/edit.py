"""Read and rewrite the main graph of an ONNX model in its protobuf wire format, without the
``onnx`` package (an export-only dependency).

:func:`read_model` lists the main graph's nodes and initializers (with their external-data
references: file, offset, length); :func:`write_model` writes the model back with some nodes
replaced or dropped, some initializers dropped and external-data initializers added. Every other
field is copied byte for byte. The ONNX Runtime backend uses it to change the layout of weights
at load time and to point saved graphs at shared data; graph files are a few megabytes (weights live in
external data), so this takes milliseconds.

Field numbers (onnx/onnx.proto): ModelProto 7 graph, 8 opset_import; OperatorSetIdProto 1 domain,
2 version; GraphProto 1 node, 5 initializer, 12 output; NodeProto 1 input, 2 output, 3 name,
4 op_type, 5 attribute, 7 domain; AttributeProto 1 name, 3 i, 6 g, 8 ints, 11 graphs, 20 type;
TensorProto 1 dims, 2 data_type, 8 name, 13 external_data, 14 data_location;
StringStringEntryProto 1 key, 2 value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .scan import OnnxScanError, read_varint, wire_entries

FLOAT = 1
"""``TensorProto.DataType`` of fp32."""
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
_ATTR_INT = 2  # AttributeProto.AttributeType.INT


@dataclass
class Initializer:
    """One initializer of the main graph. ``location`` is the external-data file name (relative
    to the graph's folder) or None for data stored in the graph file; ``offset`` and ``length``
    are bytes in that file; ``data_type`` is ONNX's ``TensorProto.DataType`` (1: fp32)."""

    name: str
    dims: tuple[int, ...]
    data_type: int
    location: str | None = None
    offset: int = 0
    length: int = 0
    external: tuple[tuple[str, str], ...] = ()
    """Every ``external_data`` entry (key, value) in file order, ONNX Runtime's ``prepacked_N``
    entries included."""


@dataclass
class Node:
    """One node: ``ints`` holds its integer attributes (``{'perm': [1, 0]}``, ``{'transB': [1]}``)."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    name: str = ""
    domain: str = ""
    ints: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Model:
    """What :func:`read_model` found, and where (byte spans) for :func:`write_model`.

    ``subgraph_inputs``: every name a node inside a subgraph (Scan, Loop, If bodies) reads, i.e.
    main-graph values those bodies may capture; ``outputs``: the main graph's output names;
    ``domains``: the operator-set domains the model imports ('' is ai.onnx).
    """

    data: bytes
    nodes: list[Node]
    initializers: dict[str, Initializer]
    subgraph_inputs: set[str]
    outputs: set[str]
    domains: set[str]
    graph_span: tuple[int, int] = (0, 0)
    node_spans: list[tuple[int, int]] = field(default_factory=list)
    initializer_spans: dict[str, tuple[int, int]] = field(default_factory=dict)


def _text(buf, span) -> str:
    return bytes(buf[span[0] : span[1]]).decode("utf-8")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _ints(buf, wire: int, value) -> list[int]:
    """A repeated int64 field entry, packed (wire 2) or not (wire 0)."""
    if wire == 0:
        return [_signed(value)]
    out, pos = [], value[0]
    while pos < value[1]:
        item, pos = read_varint(buf, pos)
        out.append(_signed(item))
    return out


def _node(buf, span, subgraph_inputs: set[str] | None) -> Node:
    node = Node("", [], [])
    for number, wire, value, _, _ in wire_entries(buf, *span):
        if number == 1 and wire == 2:
            node.inputs.append(_text(buf, value))
        elif number == 2 and wire == 2:
            node.outputs.append(_text(buf, value))
        elif number == 3 and wire == 2:
            node.name = _text(buf, value)
        elif number == 4 and wire == 2:
            node.op_type = _text(buf, value)
        elif number == 7 and wire == 2:
            node.domain = _text(buf, value)
        elif number == 5 and wire == 2:
            name, ints = "", []
            for a_number, a_wire, a_value, _, _ in wire_entries(buf, *value):
                if a_number == 1 and a_wire == 2:
                    name = _text(buf, a_value)
                elif a_number == 3 and a_wire == 0:
                    ints.append(_signed(a_value))
                elif a_number == 8:
                    ints += _ints(buf, a_wire, a_value)
                elif a_number in (6, 11) and a_wire == 2 and subgraph_inputs is not None:
                    _subgraph_inputs(buf, a_value, subgraph_inputs)
            if ints:
                node.ints[name] = ints
    return node


def _subgraph_inputs(buf, span, found: set[str]) -> None:
    """Add the inputs of every node of the GraphProto at ``span`` (and of its subgraphs)."""
    for number, wire, value, _, _ in wire_entries(buf, *span):
        if number == 1 and wire == 2:
            found.update(_node(buf, value, found).inputs)


def _initializer(buf, span) -> Initializer:
    tensor = Initializer("", (), 0)
    dims, external, location = [], {}, 0
    for number, wire, value, _, _ in wire_entries(buf, *span):
        if number == 1 and wire in (0, 2):
            dims += _ints(buf, wire, value)
        elif number == 2 and wire == 0:
            tensor.data_type = value
        elif number == 8 and wire == 2:
            tensor.name = _text(buf, value)
        elif number == 14 and wire == 0:
            location = value
        elif number == 13 and wire == 2:
            entry = {n: _text(buf, v) for n, w, v, _, _ in wire_entries(buf, *value) if w == 2}
            external[entry.get(1, "")] = entry.get(2, "")
            tensor.external += ((entry.get(1, ""), entry.get(2, "")),)
    tensor.dims = tuple(dims)
    if location == _EXTERNAL:
        tensor.location = external.get("location")
        tensor.offset = int(external.get("offset", 0))
        tensor.length = int(external.get("length", 0))
    return tensor


def read_model(data: bytes) -> Model:
    """Parse the serialized ModelProto ``data`` (nodes of the main graph, its initializers, ...).

    Raises:
        OnnxScanError: not a well-formed ONNX protobuf, or no main graph.
    """
    buf = memoryview(data)
    model = Model(data, [], {}, set(), set(), set())
    found = False
    for number, wire, value, _, _ in wire_entries(buf):
        if number == 8 and wire == 2:
            domain = next((_text(buf, v) for n, w, v, _, _ in wire_entries(buf, *value) if n == 1 and w == 2), "")
            model.domains.add("" if domain == "ai.onnx" else domain)
        elif number == 7 and wire == 2:
            found, model.graph_span = True, value
    if not found:
        raise OnnxScanError("the model has no main graph")
    for number, wire, value, start, end in wire_entries(buf, *model.graph_span):
        if wire != 2:
            continue
        if number == 1:
            model.nodes.append(_node(buf, value, model.subgraph_inputs))
            model.node_spans.append((start, end))
        elif number == 5:
            tensor = _initializer(buf, value)
            model.initializers[tensor.name] = tensor
            model.initializer_spans[tensor.name] = (start, end)
        elif number == 12:
            model.outputs.add(
                next((_text(buf, v) for n, w, v, _, _ in wire_entries(buf, *value) if n == 1 and w == 2), "")
            )
    return model


# ---- writing ------------------------------------------------------------------------------
def _enc_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _enc_varint(number << 3) + _enc_varint(value)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _enc_varint(number << 3 | 2) + _enc_varint(len(payload)) + payload


def _str_field(number: int, text: str) -> bytes:
    return _bytes_field(number, text.encode("utf-8"))


def encode_node(node: Node) -> bytes:
    """Serialize ``node`` as a NodeProto (integer attributes: one value as ``i``, several as ``ints``)."""
    out = b"".join(_str_field(1, name) for name in node.inputs)
    out += b"".join(_str_field(2, name) for name in node.outputs)
    if node.name:
        out += _str_field(3, node.name)
    out += _str_field(4, node.op_type)
    for name, values in node.ints.items():
        if len(values) == 1:
            attr = _str_field(1, name) + _varint_field(3, values[0]) + _varint_field(20, _ATTR_INT)
        else:
            attr = _str_field(1, name) + b"".join(_varint_field(8, v) for v in values) + _varint_field(20, 7)
        out += _bytes_field(5, attr)
    if node.domain:
        out += _str_field(7, node.domain)
    return out


def identity_model(opset: int = 17) -> bytes:
    """A ModelProto of one Identity node from input ``x`` to output ``y``, both fp32 ``[1]``
    (IR version 8, default domain at ``opset``): a graph to run when only a run's side effects
    matter (:func:`qwen35_onnx.runtime.onnxruntime.sessions.shrink_shared_arena`)."""

    def value_info(name: str) -> bytes:
        shape = _bytes_field(2, _bytes_field(1, _varint_field(1, 1)))  # TensorShapeProto: one dim of 1
        tensor = _bytes_field(1, _varint_field(1, 1) + shape)  # TypeProto.tensor_type: FLOAT
        return _str_field(1, name) + _bytes_field(2, tensor)

    graph = _bytes_field(1, encode_node(Node("Identity", ["x"], ["y"]))) + _str_field(2, "identity")
    graph += _bytes_field(11, value_info("x")) + _bytes_field(12, value_info("y"))
    return _varint_field(1, 8) + _bytes_field(7, graph) + _bytes_field(8, _str_field(1, "") + _varint_field(2, opset))


def encode_initializer(tensor: Initializer) -> bytes:
    """Serialize an external-data initializer as a TensorProto (dims, type, name, location)."""
    if tensor.location is None:
        raise ValueError(f"initializer {tensor.name!r}: only external-data initializers can be written")
    out = b"".join(_varint_field(1, d) for d in tensor.dims) + _varint_field(2, tensor.data_type)
    out += _str_field(8, tensor.name)
    for key, value in (("location", tensor.location), ("offset", str(tensor.offset)), ("length", str(tensor.length))):
        out += _bytes_field(13, _str_field(1, key) + _str_field(2, value))
    return out + _varint_field(14, _EXTERNAL)


def _with_external(buf, span: tuple[int, int], entries) -> bytes:
    """The TensorProto at ``span`` (an entry of the graph, key included) with its
    ``external_data`` replaced by ``entries`` ((key, value) pairs); every other field as it was."""
    _, _, value, _, _ = next(wire_entries(buf, *span))
    kept = b"".join(bytes(buf[start:end]) for number, _, _, start, end in wire_entries(buf, *value) if number != 13)
    return _bytes_field(5, kept + b"".join(_bytes_field(13, _str_field(1, k) + _str_field(2, v)) for k, v in entries))


def write_model(
    model: Model,
    nodes: dict[int, Node | None] | None = None,
    drop: set[str] = frozenset(),
    add: list[Initializer] = (),
    domains: dict[str, int] | None = None,
    external: dict[str, list[tuple[str, str]]] | None = None,
) -> bytes:
    """The model with node ``i`` replaced by ``nodes[i]`` (None: dropped), the initializers named
    in ``drop`` removed, ``add`` appended (external-data initializers), the ``external_data``
    entries of the initializers named in ``external`` replaced by the given (key, value) pairs,
    and an ``opset_import`` for each domain of ``domains`` (``{domain: version}``) the model does
    not import yet.

    Raises:
        ValueError: an initializer of ``add`` without external data.
    """
    nodes = nodes or {}
    buf = model.data
    cuts = {
        span: (b"" if nodes[i] is None else _bytes_field(1, encode_node(nodes[i])))
        for i, span in enumerate(model.node_spans)
        if i in nodes
    }
    cuts.update(
        {
            model.initializer_spans[name]: _with_external(buf, model.initializer_spans[name], entries)
            for name, entries in (external or {}).items()
            if name not in drop
        }
    )
    cuts.update({model.initializer_spans[name]: b"" for name in drop})
    parts, pos = [], model.graph_span[0]
    for start, end in sorted(cuts):
        parts += [buf[pos:start], cuts[(start, end)]]
        pos = end
    parts += [buf[pos : model.graph_span[1]]]
    parts += [_bytes_field(5, encode_initializer(t)) for t in add]
    graph = b"".join(parts)
    tail = buf[model.graph_span[1] :]
    # the graph entry's key and length prefix precede its span: rewrite them
    prefix = _enc_varint(7 << 3 | 2)
    key_start = model.graph_span[0] - len(_enc_varint(model.graph_span[1] - model.graph_span[0])) - len(prefix)
    if buf[key_start : key_start + len(prefix)] != prefix:
        raise OnnxScanError("unexpected encoding of the model's graph field")
    imports = b"".join(
        _bytes_field(8, _str_field(1, d) + _varint_field(2, v))
        for d, v in (domains or {}).items()
        if d not in model.domains
    )
    return bytes(buf[:key_start]) + _bytes_field(7, graph) + bytes(tail) + imports
