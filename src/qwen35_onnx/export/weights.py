"""One weights file for all text graphs of an export.

Every prefill bucket graph and the decode graph hold the same text weights. Saved one by one,
each graph would carry its own copy (for Qwen3.5-0.8B in fp32, 3.4 GB per graph).
:class:`SharedWeights` moves every initializer of at least ``min_bytes`` bytes of each graph,
as soon as the graph is written, into one external-data file next to the graphs, storing each
distinct tensor (same dtype, shape and bytes) once; the graphs keep only references (ONNX
external data: location, offset, length). Tensors of 64 KiB or more start at 64 KiB offsets,
so ONNX Runtime can memory-map them and the sessions of several buckets share pages.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx.external_data_helper import set_external_data

ALIGN = 64 * 1024
"""Alignment (bytes) of tensors of at least this size in the shared file."""


def _initializers(graph: onnx.GraphProto):
    """Initializers of ``graph`` and of every subgraph (e.g. a Scan body)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _initializers(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _initializers(sub)


def _data_files(model: onnx.ModelProto, folder: Path) -> set[Path]:
    """External-data files the initializers of ``model`` (stored in ``folder``) reference."""
    names = set()
    for tensor in _initializers(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            names |= {e.value for e in tensor.external_data if e.key == "location"}
    return {folder / name for name in names}


class SharedWeights:
    """Collects graphs of one folder into one shared weights file ``data_name``.

    :meth:`add` reads a graph (inline weights or its own external-data files, which are
    deleted once read unless they are a previous shared file), appends its tensors not
    stored yet to a staging file and keeps the graph, without weights, in memory;
    :meth:`finish` puts the staging file in place (replacing a previous shared file) and
    rewrites the graphs. Meant to run inside the export's temporary folder: an interrupted
    export is discarded whole.

    Raises (:meth:`add`):
        ValueError: a graph outside the folder.
    """

    def __init__(self, folder: Path, data_name: str = "weights.data", min_bytes: int = 1024):
        self.folder, self.data_name, self.min_bytes = Path(folder), data_name, min_bytes
        self.staging = self.folder / (data_name + ".tmp")
        self.out = open(self.staging, "wb")
        self.index: dict[tuple, tuple[int, int]] = {}
        self.graphs: list[tuple[Path, onnx.ModelProto]] = []
        self.references = 0

    def add(self, path: Path) -> None:
        """Move the large initializers of the graph at ``path`` into the shared file."""
        path = Path(path)
        if path.parent != self.folder:
            raise ValueError(f"graph {str(path)!r} is not in {str(self.folder)!r}")
        model = onnx.load(str(path), load_external_data=False)
        own_files = _data_files(model, self.folder)
        onnx.load_external_data_for_model(model, str(self.folder))
        for tensor in _initializers(model.graph):
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < self.min_bytes:
                continue
            raw = tensor.raw_data
            key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(raw).digest())
            if key not in self.index:
                align = ALIGN if len(raw) >= ALIGN else 64
                self.out.write(b"\0" * (-self.out.tell() % align))
                self.index[key] = (self.out.tell(), len(raw))
                self.out.write(raw)
            offset, length = self.index[key]
            set_external_data(tensor, location=self.data_name, offset=offset, length=length)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
            self.references += 1
        for old in own_files - {self.folder / self.data_name}:
            old.unlink(missing_ok=True)
        self.graphs.append((path, model))

    def finish(self) -> dict[str, int]:
        """Put the shared file in place and rewrite every added graph.

        Returns:
            ``{"graphs": ..., "tensors": ..., "unique": ..., "bytes": ...}``: graphs rewritten,
            references written, distinct tensors stored, size of the shared file in bytes.
        """
        size = self.out.tell()
        self.out.close()
        os.replace(self.staging, self.folder / self.data_name)
        for path, model in self.graphs:
            tmp = path.with_name(path.name + ".tmp")
            onnx.save_model(model, str(tmp))
            os.replace(tmp, path)
        return {"graphs": len(self.graphs), "tensors": self.references, "unique": len(self.index), "bytes": size}
