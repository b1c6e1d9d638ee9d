"""One weights file for all text graphs of an export, written one tensor at a time.

Every prefill bucket graph and the decode graph hold the same text weights. Saved one by one,
each graph would carry its own copy (for Qwen3.5-0.8B in fp32, 3.4 GB per graph).
:class:`WeightsFileWriter` writes every initializer of at least ``min_bytes`` bytes of each graph
into one external-data file next to the graphs, storing each distinct tensor once; the graphs
keep only references (ONNX external data: location, offset, length). Tensors of 64 KiB or more
start at 64 KiB offsets, so ONNX Runtime can memory-map them.

Memory: a tensor is materialized only while it is written (lazy weights read from the
checkpoint, see :mod:`.lazy_weights`); a tensor whose ``key`` was written already (the same
checkpoint weight in another bucket's graph) is not computed again. Other tensors are told
apart by dtype, shape and SHA-256 of their bytes.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from ..contract import TEXT_WEIGHTS

ALIGN = 64 * 1024
"""Alignment (bytes) of tensors of at least this size in the shared file."""


def _proto_initializers(graph: onnx.GraphProto):
    """Initializers of ``graph`` and of every subgraph (e.g. a Scan body)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _proto_initializers(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _proto_initializers(sub)


def _read_external(tensor: onnx.TensorProto, folder: Path) -> bytes:
    """The bytes of one externally stored tensor (only this tensor is read)."""
    info = {e.key: e.value for e in tensor.external_data}
    with open(folder / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"])) if "length" in info else f.read()


def _buffer(tensor: ir.TensorProtocol) -> bytes | memoryview:
    """The bytes of ``tensor`` as ONNX stores them (little-endian), without a copy where the
    tensor's numpy array already has that layout (sub-byte types are packed by ``tobytes``)."""
    if tensor.dtype.bitwidth < 8 or sys.byteorder != "little":
        return tensor.tobytes()
    array = np.ascontiguousarray(tensor.numpy())
    return memoryview(array.reshape(-1).view(np.uint8))


class WeightsFileWriter:
    """Writes graphs of one folder with their large initializers in one shared file ``data_name``.

    :meth:`add_model` writes a traced graph (ONNX IR, weights possibly lazy); :meth:`add`
    rewrites a graph file already in the folder (a graph kept from a previous export: its
    tensors are read one at a time from its old data file, which is deleted unless it is the
    shared file); :meth:`finish` puts the file in place. Meant to run inside the export's
    temporary folder: an interrupted export is discarded whole.

    Raises (:meth:`add`, :meth:`add_model`):
        ValueError: a graph outside the folder.
    """

    def __init__(self, folder: Path, data_name: str = TEXT_WEIGHTS, min_bytes: int = 1024):
        self.folder, self.data_name, self.min_bytes = Path(folder), data_name, min_bytes
        self.staging = self.folder / (data_name + ".tmp")
        self.out = open(self.staging, "wb")
        self.index: dict[object, tuple[int, int]] = {}
        self.small: dict[object, ir.Tensor] = {}
        self.graphs = 0
        self.references = 0

    def _check(self, path: Path) -> Path:
        path = Path(path)
        if path.parent != self.folder:
            raise ValueError(f"graph {str(path)!r} is not in {str(self.folder)!r}")
        return path

    def _store(self, dtype: int, key, produce: Callable[[], bytes | memoryview]) -> tuple[int, int]:
        """Offset and length of a tensor in the shared file, writing it when new."""
        if key is not None and key in self.index:
            return self.index[key]
        raw = produce()
        # bytes, not shapes: a tied model's int4 embedding rows and lm_head blocks are one tensor
        content = (dtype, hashlib.sha256(raw).digest())
        if content not in self.index:
            align = ALIGN if len(raw) >= ALIGN else 64
            self.out.write(b"\0" * (-self.out.tell() % align))
            self.index[content] = (self.out.tell(), len(raw))
            self.out.write(raw)
        if key is not None:
            self.index[key] = self.index[content]
        self.references += 1
        return self.index[content]

    def _keep_small(self, value: ir.Value) -> None:
        """Give a small initializer with a ``key`` (stored inline in each graph) the tensor computed
        for the first graph that had it: the scales of a quantized weight in one block are under
        ``min_bytes`` while its codes are not, and computing them again would read and quantize the
        checkpoint weight once more per graph."""
        key = getattr(value.const_value, "key", None)
        if key is None:
            return
        if key not in self.small:
            tensor = value.const_value
            self.small[key] = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=value.name)
        value.const_value = self.small[key]

    def add_model(
        self, model: ir.Model, path: Path, convert: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
    ) -> None:
        """Write the initializers of ``model`` of at least ``min_bytes`` into the shared file
        (materializing one at a time; a tensor with a ``key`` attribute seen before is not
        computed again, nor is a smaller one, kept inline) and save the graph at ``path``
        referencing them. ``convert`` is applied to the serialized graph (weights already
        external) before it is saved."""
        path = self._check(path)
        for graph in model.graphs():
            for value in graph.initializers.values():
                tensor = value.const_value
                if tensor is None:
                    continue
                if tensor.nbytes < self.min_bytes:
                    self._keep_small(value)
                    continue
                offset, length = self._store(
                    int(tensor.dtype), getattr(tensor, "key", None), lambda tensor=tensor: _buffer(tensor)
                )
                value.const_value = ir.ExternalTensor(
                    self.data_name,
                    offset,
                    length,
                    tensor.dtype,
                    shape=tensor.shape,
                    name=value.name,
                    base_dir=self.folder,
                )
        proto = ir.to_proto(model)
        if convert is not None:
            proto = convert(proto)
        onnx.save_model(proto, str(path))
        self.graphs += 1

    def add(self, path: Path) -> None:
        """Move the large initializers of the graph file at ``path`` into the shared file,
        one tensor at a time, and rewrite the graph."""
        path = self._check(path)
        model = onnx.load(str(path), load_external_data=False)
        old_files = set()
        for tensor in _proto_initializers(model.graph):
            external = tensor.data_location == onnx.TensorProto.EXTERNAL
            size = (
                int(next((e.value for e in tensor.external_data if e.key == "length"), 0))
                if external
                else len(tensor.raw_data)
            )
            if (not external and not tensor.HasField("raw_data")) or size < self.min_bytes:
                if external:  # a small tensor kept outside: bring it inline
                    tensor.raw_data = _read_external(tensor, self.folder)
                    old_files |= {e.value for e in tensor.external_data if e.key == "location"}
                    del tensor.external_data[:]
                    tensor.data_location = onnx.TensorProto.DEFAULT
                continue
            if external:
                old_files |= {e.value for e in tensor.external_data if e.key == "location"}

                def produce(tensor=tensor):
                    return _read_external(tensor, self.folder)
            else:

                def produce(tensor=tensor):
                    return tensor.raw_data

            offset, length = self._store(tensor.data_type, None, produce)
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            for key, value in (("location", self.data_name), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL
        tmp = path.with_name(path.name + ".tmp")
        onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
        for name in old_files - {self.data_name}:
            (self.folder / name).unlink(missing_ok=True)
        self.graphs += 1

    def finish(self) -> dict[str, int]:
        """Put the shared file in place (replacing a previous one).

        Returns:
            ``{"graphs": ..., "tensors": ..., "unique": ..., "bytes": ...}``: graphs written,
            references written, distinct tensors stored, size of the shared file in bytes.
        """
        size = self.out.tell()
        self.out.close()
        os.replace(self.staging, self.folder / self.data_name)
        unique = len({v for v in self.index.values()})
        return {"graphs": self.graphs, "tensors": self.references, "unique": unique, "bytes": size}
