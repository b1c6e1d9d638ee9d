"""One copy of an export's text weights for every ONNX Runtime session of the export (CPU).

All text graphs of an export (each prefill bucket and decode) read one external-data file,
``text/weights.data``. Left to itself, ONNX Runtime memory-maps that file once per session and
then copies most of it into each session while loading (pre-packing, constant folding of the
transposed tied ``lm_head``); why that matters, with numbers: ``docs/design.md``.

:class:`SharedWeights` maps each external-data file once (read-only, shared pages) and hands the
mapping to every session as an in-memory external file read in place
(``add_external_initializers_from_files_in_memory`` with
``session.use_external_initializer_file_buffers_directly``: zero copy, where
``add_external_initializers`` copies). Then:

- fp32 exports (``relayout``): no pre-packing, so no session copies a weight. Unpacked, narrow
  weights ``[K, N]`` (K > N) and the transposed ``lm_head`` are slower for the M = 1 decode
  MatMul, so the graphs are rewritten before loading (:mod:`qwen35_onnx.onnxfile.edit`): a narrow
  ``MatMul(x, W)`` becomes ``FusedMatMul(x, W^T, transB=1)``, and ``MatMul(x, Transpose(W))``
  reads ``W^T``; each ``W^T`` is made once per export (anonymous memory, shared by all sessions)
  and the file pages of ``W`` read to make it are released. The export then holds one copy of
  its text weights (file pages + the transposed ones).
- quantized exports (MatMulNBits dequantizes at every call without pre-packing) and fp16 / bf16:
  pre-packing stays on, so each session keeps its own packed weights (unless the pre-packed
  weights cache, :mod:`.prepacked`, serves them); only the unpacked rest (the token embedding,
  scales, norms) is shared, and the file pages read by pre-packing are released.

A mapping and the transposed weights live as long as any session made from them.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...contract import Dtype, Quantization
from ...onnxfile.edit import FLOAT, Initializer, Model, Node, read_model, write_model

PREPACKED_OPS = frozenset({"MatMul", "FusedMatMul", "Gemm", "MatMulNBits", "DequantizeLinear", "Conv"})
"""Operators whose constant inputs ONNX Runtime may copy at load (pre-packing, or the
DequantizeLinear + MatMul -> MatMulNBits fusion): their file pages are released after a
pre-packing session loads (pages still read later come back from the page cache on access)."""
MS_DOMAIN = "com.microsoft"


def relayout_for(dtype: str, quantize: str) -> bool:
    """Whether an export's text graphs run unpacked from the shared weights, narrow MatMul weights
    transposed (see the module docstring): fp32 exports without quantization."""
    return dtype == Dtype.FP32 and quantize == Quantization.NONE


class SharedWeights:
    """The external-data files of one export's text graphs, each memory-mapped once, shared by
    the ONNX Runtime sessions that :meth:`open_session` creates.

    Args:
        relayout: run unpacked with narrow MatMul weights transposed (fp32 exports, see
            :func:`relayout_for`); False keeps ONNX Runtime's pre-packing (one packed copy per
            session).
    """

    def __init__(self, relayout: bool):
        self.relayout = relayout
        self._maps: dict[Path, tuple[mmap.mmap, np.ndarray]] = {}
        self._transposed: dict[tuple, ort.OrtValue] = {}
        self._lock = threading.Lock()

    def _map(self, path: Path) -> tuple[mmap.mmap, np.ndarray]:
        path = path.resolve()
        if path not in self._maps:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = (mapped, np.frombuffer(mapped, dtype=np.uint8))
        return self._maps[path]

    def mapped_bytes(self) -> int:
        """Bytes of the files mapped so far."""
        return sum(len(array) for _, array in self._maps.values())

    def transposed_bytes(self) -> int:
        """Bytes of the transposed weights made so far (anonymous memory)."""
        return sum(int(np.prod(v.shape())) * 4 for v in self._transposed.values())

    def open_session(self, path: Path, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
        """Create the ONNX Runtime session of the graph file ``path`` reading its external data
        from the shared mappings (``options`` is completed here; the graph's external-data files
        must be in its folder).

        Raises:
            OSError: a graph or external-data file cannot be read.
            OnnxScanError: the graph file is not a well-formed ONNX model.
            Exception: whatever ``ort.InferenceSession`` raises.
        """
        path = Path(path)
        model = read_model(path.read_bytes())
        with self._lock:
            files = {t.location for t in model.initializers.values() if t.location is not None}
            for name in sorted(files):
                _, array = self._map(path.parent / name)
                options.add_external_initializers_from_files_in_memory([name], [array], [len(array)])
            options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
            if self.relayout:
                options.add_session_config_entry("session.disable_prepacking", "1")
                data, released = self._relayout(model, path.parent, options)
            else:
                data = model.data
                released = _weights_of(model, PREPACKED_OPS)
        session = ort.InferenceSession(data, sess_options=options, providers=providers)
        session._qwen35_shared_weights = self  # the mappings must outlive the session
        with self._lock:
            for tensor in released:
                self._release(path.parent, tensor)
        return session

    def _release(self, folder: Path, tensor: Initializer) -> None:
        """Drop this process's pages of ``tensor``'s bytes in its mapping (they are re-read from the
        page cache if anything touches them again)."""
        mapped, _ = self._map(folder / tensor.location)
        start = -(-tensor.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (tensor.offset + tensor.length) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _transpose(self, folder: Path, tensor: Initializer) -> ort.OrtValue:
        key = (str((folder / tensor.location).resolve()), tensor.offset, tensor.length, tensor.dims)
        if key not in self._transposed:
            _, array = self._map(folder / tensor.location)
            weight = array[tensor.offset : tensor.offset + tensor.length].view(np.float32).reshape(tensor.dims)
            self._transposed[key] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(weight.T))
        return self._transposed[key]

    def _relayout(self, model: Model, folder: Path, options: ort.SessionOptions) -> tuple[bytes, list[Initializer]]:
        """Rewrite ``model`` so that each MatMul reads its weight in the layout the unpacked M = 1
        kernel streams fastest; returns the model bytes and the original weights now unread."""
        inits = model.initializers
        consumers: dict[str, list[int]] = {}
        for i, node in enumerate(model.nodes):
            for name in node.inputs:
                consumers.setdefault(name, []).append(i)

        def movable(name: str) -> Initializer | None:
            """A 2-D fp32 external weight no subgraph reads."""
            t = inits.get(name)
            ok = t is not None and t.location is not None and t.data_type == FLOAT and len(t.dims) == 2
            return t if ok and name not in model.subgraph_inputs else None

        edits: dict[int, Node | None] = {}
        added: dict[str, Initializer] = {}
        sources: dict[str, Initializer] = {}
        for i, node in enumerate(model.nodes):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Transpose" and node.ints.get("perm", [1, 0]) == [1, 0]:
                weight, out = movable(node.inputs[0]), node.outputs[0]
                uses = consumers.get(out, [])
                if (
                    weight
                    and uses
                    and out not in model.outputs
                    and out not in model.subgraph_inputs
                    and all(
                        model.nodes[j].op_type == "MatMul"
                        and model.nodes[j].inputs[1:] == [out]
                        and out not in model.nodes[j].inputs[:1]
                        for j in uses
                    )
                ):
                    edits[i] = None
                    added[out] = Initializer(
                        out, weight.dims[::-1], FLOAT, weight.location, weight.offset, weight.length
                    )
                    sources[out] = weight
            elif node.op_type == "MatMul" and len(node.inputs) == 2:
                weight = movable(node.inputs[1])
                if weight and weight.dims[0] > weight.dims[1] and node.inputs[0] != node.inputs[1]:
                    name = weight.name + "/transposed"
                    edits[i] = Node(
                        "FusedMatMul", [node.inputs[0], name], list(node.outputs), node.name, MS_DOMAIN, {"transB": [1]}
                    )
                    added[name] = Initializer(
                        name, weight.dims[::-1], FLOAT, weight.location, weight.offset, weight.length
                    )
                    sources[name] = weight
        if not edits:
            return model.data, []
        for name, weight in sources.items():
            # the placeholder's external data (the original bytes, same size) is never read: the
            # session takes the transposed values from here
            options.add_initializer(name, self._transpose(folder, weight))
        still_read = {
            name
            for i, node in enumerate(model.nodes)
            if i not in edits or edits[i] is not None
            for name in (edits.get(i) or node).inputs
        }
        unused = {w.name for w in sources.values()} - still_read - model.subgraph_inputs - model.outputs
        data = write_model(model, edits, drop=unused, add=list(added.values()), domains={MS_DOMAIN: 1})
        return data, list({w.name: w for w in sources.values()}.values())


def _weights_of(model: Model, ops: frozenset[str]) -> list[Initializer]:
    """External initializers read by nodes of ``ops``."""
    names = {name for node in model.nodes if node.op_type in ops for name in node.inputs}
    return [t for name, t in model.initializers.items() if name in names and t.location is not None]
