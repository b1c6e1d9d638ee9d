"""Weight-only quantization of the exported text graphs: every MatMul whose weight is a constant
gets int4 or int8 weights, symmetric, with one fp32 scale per ``block_size`` weights along the
input axis (K) of each output column. Both formats use the same rule, ONNX Runtime's (MLAS): the
block's largest-magnitude weight ``m`` gives ``scale = m / -2**(bits-1)`` and
``q = round(w / scale)`` clipped to ``[-2**(bits-1), 2**(bits-1) - 1]``, so an int4 export holds
the same numbers in either format.

The format follows ``--ops``:

- ``ort``: ONNX Runtime's own tool
  (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``) replaces the MatMul
  by a ``com.microsoft`` ``MatMulNBits`` node with the export's ``--quant-accuracy-level`` as its
  ``accuracy_level`` (default 4: activations quantized to int8 per block inside the kernel, ONNX
  Runtime's fast CPU path; 0 computes in the input's type).
- ``portable``: standard ONNX weight quantization, readable by any ONNX runtime and NPU
  toolchain. Each weight ``W[K, N]`` becomes an ``INT4`` or ``INT8`` initializer of the same shape
  and a scale in the weight's dtype ``[ceil(K / block_size), N]``, feeding a blocked ``DequantizeLinear``
  (``axis=0``, ``block_size``; no zero point: the ONNX spec's default zero point is 0, i.e.
  symmetric) whose output is the MatMul's weight. Blocked quantization (the ``block_size``
  attribute, a scale of the input's rank) and the INT4 type arrive in opset 21 (ONNX operator
  spec, DequantizeLinear-21), so the graph's default-domain opset is converted from the
  exporter's 18 to 21 with ``onnx.version_converter`` (the operators of our graphs only gained
  types between 18 and 21) and the IR version raised to 10. ONNX Runtime's graph optimizer fuses
  each DequantizeLinear + MatMul pair back into MatMulNBits (``DQMatMulToMatMulNBits``, weights
  kept packed); OpenVINO 2026.4 reads the graph and keeps the weights compressed. ONNX Runtime's
  tool has this format too (``quant_format=QuantFormat.QDQ``) but for int4 only: with 8 bits it
  logs an error and leaves the MatMul in fp32; hence the small transform here, which gives
  bit-identical int4 weights and scales (a test checks it).

Measured (``tests/test_portable_quantize.py`` checks the structure, the fusion, the agreement
with ``--ops ort`` and with OpenVINO): on the demo checkpoint trained 200 steps
(``checkpoints.train_checkpoint``), last-logit cosine against fp32 is the same in both formats,
int4 0.9982 and int8 1.0000. ONNX Runtime fuses every pair into MatMulNBits (accuracy level 4, its
default for this fusion, or the export's ``--quant-accuracy-level``). Decode at 0.8B, 2 cores
(bench of 0.5.0): portable int4 on ONNX Runtime 39-53 ms per token against 32-36 ms for
``--ops ort`` int4 (the portable graph's unfused operators, not the weights); OpenVINO's CPU
plugin runs the same portable int4 graph in 36-40 ms, its fully connected layers holding i4
weights (compiled decode graph 2.1 GB resident against 5.9 GB for fp32), logits within 1e-6 of
ONNX Runtime's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from ..contract import DEFAULT_QUANT_ACCURACY_LEVEL

QUANTIZE_BITS = {"int4": 4, "int8": 8}
DQ_OPSET = 21
"""Default-domain opset of portable quantized graphs: the first with blocked DequantizeLinear and INT4."""
DQ_IR_VERSION = 10
"""First IR version with the INT4 / UINT4 types (the one opset 21 goes with)."""
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
"""Weight types quantized (the scales keep the weight's type, which the MatMul computes in)."""
_CHUNK = 1 << 24
"""Weights quantized per slice of at most this many elements (bounds the temporaries at 0.8B)."""


def quantize_graph(path: Path, scheme: str, block_size: int, external_data: bool, ops: str = "ort",
                   accuracy_level: int = DEFAULT_QUANT_ACCURACY_LEVEL) -> int:
    """Quantize the graph at ``path`` in place; returns the number of quantized MatMuls
    (``MatMulNBits`` nodes for ``ops='ort'``, ``DequantizeLinear`` nodes for ``ops='portable'``).

    ``accuracy_level`` (see :data:`~qwen35_onnx.contract.QUANT_ACCURACY_LEVELS`) is written into
    each MatMulNBits node (``ops='ort'``); a portable graph has no place for it (ONNX Runtime
    reads it from the manifest when it fuses the graph, see ``runtime.sessions``).
    Metadata (the contract) is kept. The weights are saved as the graph was (inline, or in its
    own ``<name>.data`` file with ``external_data``); the exporter then moves them into the
    shared weights file of the text graphs.

    Raises:
        ValueError: unknown scheme or ops, or a block size that is not a power of two from 16 to 256.
    """
    if scheme not in QUANTIZE_BITS:
        raise ValueError(f"quantization {scheme!r} must be one of {', '.join(QUANTIZE_BITS)}")
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"quantization block size {block_size} must be a power of two from 16 to 256")
    if ops == "portable":
        model = onnx.load(str(path), load_external_data=False)
        model = to_dq_opset(model)
        onnx.load_external_data_for_model(model, str(path.parent))
        count = quantize_dq(model, QUANTIZE_BITS[scheme], block_size)
    elif ops == "ort":
        model, count = _quantize_nbits(onnx.load(str(path)), QUANTIZE_BITS[scheme], block_size, accuracy_level)
    else:
        raise ValueError(f"ops {ops!r} must be 'portable' or 'ort'")
    for old in path.parent.glob(path.name + ".data"):
        old.unlink()
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external_data,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
    )
    return count


# ----------------------------------------------------------------------------------------
# --ops ort: MatMulNBits
# ----------------------------------------------------------------------------------------
def _quantize_nbits(model: onnx.ModelProto, bits: int, block_size: int, accuracy_level: int) -> tuple[onnx.ModelProto, int]:
    # the quantizer and onnx_ir log every step at INFO level, and importing the quantizer
    # sets the root logger to INFO: levels are saved before the import and restored after
    loggers = [logging.getLogger(name) for name in ("onnxruntime.quantization", "onnx_ir", "")]
    levels = [lg.level for lg in loggers]
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        for lg in loggers:
            lg.setLevel(logging.WARNING)
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=bits,
            block_size=block_size,
            is_symmetric=True,
            accuracy_level=accuracy_level,
        )
        quantizer.process()
        quantized = quantizer.model.model
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return quantized, sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)


# ----------------------------------------------------------------------------------------
# --ops portable: blocked DequantizeLinear (opset 21)
# ----------------------------------------------------------------------------------------
def to_dq_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its default-domain opset converted to :data:`DQ_OPSET` (``onnx.version_converter``)
    and IR version at least :data:`DQ_IR_VERSION`. Initializers stored as external data stay references,
    so a graph loaded without its weights converts whatever its size (protobuf's 2 GB limit)."""
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current is None or current < DQ_OPSET:
        model = version_converter.convert_version(model, DQ_OPSET)
    model.ir_version = max(model.ir_version, DQ_IR_VERSION)
    return model


def quantize_blocks(weight: np.ndarray, bits: int, block_size: int, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric blocked quantization of ``weight`` ``[K, N]`` along K (ONNX Runtime's rule, see the
    module docstring), the codes rounded with the scale as stored in ``scale_dtype`` (fp32, or the
    fp16 / bf16 of a weight in that dtype, which is what the dequantization will multiply by).

    Returns:
        ``(q, scale)``: ``q`` ``[K, N]`` int8 holding values in ``[-2**(bits-1), 2**(bits-1) - 1]``,
        ``scale`` ``[ceil(K / block_size), N]`` in ``scale_dtype``; ``q * repeat(scale, block_size,
        axis=0)[:K]`` approximates ``weight``.
    """
    k, n = weight.shape
    blocks = -(-k // block_size)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = np.empty((k, n), np.int8)
    scale = np.empty((blocks, n), scale_dtype)
    step = max(1, _CHUNK // max(1, blocks * block_size))
    for c in range(0, n, step):
        w = weight[:, c : c + step].astype(np.float32, copy=False)
        if blocks * block_size != k:
            w = np.pad(w, ((0, blocks * block_size - k), (0, 0)))
        w = w.reshape(blocks, block_size, -1)
        peak = np.take_along_axis(w, np.abs(w).argmax(axis=1)[:, None, :], axis=1)[:, 0]
        s = (peak / low).astype(scale_dtype).astype(np.float32)  # the stored value
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
        qc = np.clip(np.rint(w * inv[:, None, :]), low, high).astype(np.int8)
        q[:, c : c + step] = qc.reshape(blocks * block_size, -1)[:k]
        scale[:, c : c + step] = s
    return q, scale


def _node_subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _subgraphs(graph: onnx.GraphProto):
    for node in graph.node:
        yield from _node_subgraphs(node)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Names read by the nodes of ``graph`` and of its subgraphs, and its outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
    for sub in _subgraphs(graph):
        used |= _used_names(sub)
    return used


def quantize_dq(model: onnx.ModelProto, bits: int, block_size: int) -> int:
    """Put a blocked ``DequantizeLinear`` (int4 or int8 weights, scales in the weight's dtype, axis
    0) in front of every MatMul of ``model`` whose weight (second input) is a 2-D fp32, fp16 or
    bf16 initializer, in place
    (subgraphs included; a weight feeding several MatMuls gets one DequantizeLinear). The model
    must already be at opset :data:`DQ_OPSET` (:func:`to_dq_opset`). Returns the number of
    DequantizeLinear nodes added."""
    import ml_dtypes

    replaced: set[str] = set()

    def visit(graph: onnx.GraphProto, outer: dict[str, onnx.TensorProto]) -> int:
        weights = {**outer, **{t.name: t for t in graph.initializer}}
        done: dict[str, str] = {}  # weight name -> DequantizeLinear output, in this graph
        nodes, count = [], 0
        for node in graph.node:
            for sub in _node_subgraphs(node):
                count += visit(sub, weights)
            tensor = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
            if tensor is not None and len(tensor.dims) == 2 and tensor.data_type in FLOAT_TYPES:
                name = tensor.name
                if name not in done:
                    weight = onnx.numpy_helper.to_array(tensor)
                    # the scale keeps the weight's dtype: DequantizeLinear's output type is its scale's
                    q, scale = quantize_blocks(weight, bits, block_size, scale_dtype=weight.dtype)
                    # ml_dtypes (an onnx dependency) gives ONNX's INT4 packing: two per byte, low nibble first
                    q_tensor = onnx.numpy_helper.from_array(q.astype(ml_dtypes.int4) if bits == 4 else q, f"{name}_q{bits}")
                    graph.initializer.extend([q_tensor, onnx.numpy_helper.from_array(scale, f"{name}_scale")])
                    done[name] = f"{name}_dq"
                    nodes.append(
                        onnx.helper.make_node(
                            "DequantizeLinear",
                            [q_tensor.name, f"{name}_scale"],
                            [done[name]],
                            name=f"{node.name or name}_dq",
                            axis=0,
                            block_size=block_size,
                        )
                    )
                    replaced.add(name)
                    count += 1
                node.input[1] = done[name]
            nodes.append(node)
        graph.ClearField("node")
        graph.node.extend(nodes)
        return count

    count = visit(model.graph, {})
    used = _used_names(model.graph)

    def drop(graph: onnx.GraphProto) -> None:
        keep = [t for t in graph.initializer if t.name not in replaced or t.name in used]
        if len(keep) != len(graph.initializer):
            graph.ClearField("initializer")
            graph.initializer.extend(keep)
        for sub in _subgraphs(graph):
            drop(sub)

    drop(model.graph)
    return count

