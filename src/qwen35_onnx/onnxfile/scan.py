"""A tiny reader of ONNX files without the ``onnx`` package (which is an export-only dependency):
the operators a graph uses and the names of its inputs and outputs, read straight from the
protobuf wire format. Weights are skipped by length, never decoded, so a graph file of a few
megabytes is scanned in milliseconds.

Used to refuse, before a runtime reads a graph, operators that runtime cannot read (naming them).

Field numbers (onnx/onnx.proto): ModelProto 7 graph, 20 functions; GraphProto 1 node, 11 input,
12 output; NodeProto 4 op_type, 5 attribute, 7 domain; AttributeProto 6 g, 11 graphs;
FunctionProto 7 node; ValueInfoProto 1 name.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

#: Operator domains of the ONNX standard ('' is ai.onnx).
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


class OnnxScanError(ValueError):
    """The file is not a well-formed ONNX protobuf."""


@dataclass
class GraphScan:
    """What :func:`scan` found: ``operators`` as ``(domain, op_type)`` pairs (subgraphs and
    functions included), and the main graph's input and output names in order."""

    operators: set[tuple[str, str]] = field(default_factory=set)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def foreign_operators(self) -> list[str]:
        """Operators outside the ONNX standard, as sorted ``'domain.OpType'`` strings."""
        return sorted(f"{domain}.{op}" for domain, op in self.operators if domain not in STANDARD_DOMAINS)


def wire_entries(buf, start: int = 0, end: int | None = None):
    """Yield ``(number, wire, value, entry_start, entry_end)`` for the protobuf fields of
    ``buf[start:end]``: length-delimited values as ``(start, end)``, and the byte span of the whole
    entry (key included), which :mod:`.edit` needs to rewrite a message."""
    end = len(buf) if end is None else end
    pos = start
    while pos < end:
        entry = pos
        key, pos = read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
        elif wire == 2:
            length, pos = read_varint(buf, pos)
            value = (pos, pos + length)
            pos += length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise OnnxScanError(f"unsupported protobuf wire type {wire} at byte {pos}")
        if pos > end:
            raise OnnxScanError(f"field {number} runs past the end of its message (byte {pos} > {end})")
        yield number, wire, value, entry, pos


def _fields(buf: memoryview, start: int = 0, end: int | None = None):
    """Yield ``(field_number, wire_type, value)``; length-delimited values as ``(start, end)``."""
    for number, wire, value, _, _ in wire_entries(buf, start, end):
        yield number, wire, value


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise OnnxScanError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise OnnxScanError("varint too long")


def _text(buf: memoryview, span) -> str:
    return bytes(buf[span[0] : span[1]]).decode("utf-8", "replace")


def _nodes(buf: memoryview, span, node_field: int, found: set) -> None:
    """Collect the operators of the message at ``span`` whose nodes are field ``node_field``."""
    for number, wire, value in _fields(buf, *span):
        if number == node_field and wire == 2:
            _node(buf, value, found)


def _node(buf: memoryview, span, found: set) -> None:
    domain, op_type = "", ""
    for number, wire, value in _fields(buf, *span):
        if wire != 2:
            continue
        if number == 4:
            op_type = _text(buf, value)
        elif number == 7:
            domain = _text(buf, value)
        elif number == 5:  # attribute: subgraphs of Scan / Loop / If
            for a_number, a_wire, a_value in _fields(buf, *value):
                if a_wire == 2 and a_number in (6, 11):
                    _nodes(buf, a_value, 1, found)
    found.add((domain, op_type))


def scan(path: str | Path) -> GraphScan:
    """Scan the ONNX file at ``path``.

    Raises:
        OSError: the file cannot be read.
        OnnxScanError: the file is not a well-formed ONNX protobuf.
    """
    result = GraphScan()
    with open(path, "rb") as handle:
        if Path(path).stat().st_size == 0:
            raise OnnxScanError("empty file")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            buf = memoryview(mapped)
            try:
                for number, wire, value in _fields(buf):
                    if wire != 2:
                        continue
                    if number == 7:  # the main graph
                        for g_number, g_wire, g_value in _fields(buf, *value):
                            if g_wire != 2:
                                continue
                            if g_number == 1:
                                _node(buf, g_value, result.operators)
                            elif g_number in (11, 12):
                                name = next(
                                    (_text(buf, v) for n, w, v in _fields(buf, *g_value) if n == 1 and w == 2), ""
                                )
                                (result.inputs if g_number == 11 else result.outputs).append(name)
                    elif number == 20:  # local functions
                        _nodes(buf, value, 7, result.operators)
            finally:
                buf.release()
    return result
