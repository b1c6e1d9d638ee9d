"""Weight-only quantization of the exported text graphs: every MatMul whose weight is a constant
gets int4 or int8 weights, symmetric, with one fp32 scale per ``block_size`` weights along the
input axis (K) of each output column. Both formats use the same rule, ONNX Runtime's (MLAS): the
block's largest-magnitude weight ``m`` gives ``scale = m / -2**(bits-1)`` and
``q = round(w / scale)`` clipped to ``[-2**(bits-1), 2**(bits-1) - 1]``, so an int4 export holds
the same numbers in either format.

The format follows ``--ops``:

- ``ort``: the MatMul becomes a ``com.microsoft`` ``MatMulNBits`` node, packed by ONNX Runtime's
  own kernels (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``, what its
  ``MatMulNBitsQuantizer`` tool calls; a test checks the nodes and tensors are the tool's, bit
  for bit), one weight at a time, with the export's ``--quant-accuracy-level`` as its
  ``accuracy_level`` (default 4: activations quantized to int8 per block inside the kernel, ONNX
  Runtime's fast CPU path; 0 computes in the input's type).
- ``portable``: standard ONNX weight quantization, readable by any ONNX runtime and NPU
  toolchain. Each weight ``W[K, N]`` becomes an ``INT4`` or ``INT8`` initializer of the same shape
  and a scale in the weight's dtype ``[ceil(K / block_size), N]``, feeding a blocked ``DequantizeLinear``
  (``axis=0``, ``block_size``; no zero point: the ONNX spec's default zero point is 0, i.e.
  symmetric) whose output is the MatMul's weight. Blocked quantization (the ``block_size``
  attribute, a scale of the input's rank) and the INT4 type arrive in opset 21 (ONNX operator
  spec, DequantizeLinear-21), so the graph's default-domain opset is converted from the
  exporter's 18 to 21 with onnxscript's version converter (the operators of our graphs only gained
  types between 18 and 21) and the IR version raised to 10. ONNX Runtime's graph optimizer fuses
  each DequantizeLinear + MatMul pair back into MatMulNBits (``DQMatMulToMatMulNBits``, weights
  kept packed); OpenVINO 2026.4 reads the graph and keeps the weights compressed. ONNX Runtime's
  tool has this format too (``quant_format=QuantFormat.QDQ``) but for int4 only: with 8 bits it
  logs an error and leaves the MatMul in fp32; hence the small transform here, which gives
  bit-identical int4 weights and scales (a test checks it).

The token-embedding table (the Gather of ``input_ids``) is quantized too unless the export says
otherwise (``--no-quantize-embedding``): row by row along the hidden axis, which is how
``MatMulNBits`` quantizes the lm_head's columns, as ``GatherBlockQuantized`` (``ort``; a tied
lm_head's bytes, stored once) or as int8 ``Gather`` + ``DequantizeLinear`` (``portable``), see
:func:`_quantize_embedding`; the README gives the accuracy measured for the choice.

``tests/test_portable_quantize.py`` checks the structure, the fusion, the agreement with ``--ops ort``
and with OpenVINO; the accuracy and speed measured are in ``docs/design.md``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..contract import DEFAULT_QUANT_ACCURACY_LEVEL, Ops, is_quant_block_size
from .lazy_weights import SourcedTensor, numpy_tensor

QUANTIZE_BITS = {"int4": 4, "int8": 8}
DQ_OPSET = 21
"""Default-domain opset of portable quantized graphs: the first with blocked DequantizeLinear and INT4."""
DQ_IR_VERSION = 10
"""First IR version with the INT4 / UINT4 types (the one opset 21 goes with)."""
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
"""Weight types quantized (the scales keep the weight's type, which the MatMul computes in)."""
_CHUNK = 1 << 24
"""Weights quantized per slice of at most this many elements (bounds the temporaries at 0.8B)."""
MS_DOMAIN = "com.microsoft"


def check_scheme(scheme: str, block_size: int, ops: str) -> int:
    """The bit width of ``scheme``.

    Raises:
        ValueError: unknown scheme or ops, or a block size that is not a power of two from 16 to 256.
    """
    if scheme not in QUANTIZE_BITS:
        raise ValueError(f"quantization {scheme!r} must be one of {', '.join(QUANTIZE_BITS)}")
    if not is_quant_block_size(block_size):
        raise ValueError(f"quantization block size {block_size} must be a power of two from 16 to 256")
    if ops not in tuple(Ops):
        raise ValueError(f"ops {ops!r} must be 'portable' or 'ort'")
    return QUANTIZE_BITS[scheme]


class _Parts:
    """The quantization of one weight, computed once when its first part is read and dropped
    once every part was read (each part is a lazy tensor of the graph)."""

    def __init__(self, weight: ir.TensorProtocol, quantize, n_parts: int):
        self.weight, self.quantize, self.n_parts = weight, quantize, n_parts
        self.result, self.taken = None, set()

    def get(self, i: int) -> np.ndarray:
        if self.result is None:
            self.result, self.taken = self.quantize(self.weight.numpy()), set()
        part = self.result[i]
        self.taken.add(i)
        if len(self.taken) == self.n_parts:
            self.result = None
        return part

    def tensor(self, i: int, name: str, dtype: ir.DataType, shape, tag: str) -> ir.Value:
        key = getattr(self.weight, "key", None)
        value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
        value.const_value = SourcedTensor(
            lambda: numpy_tensor(self.get(i), dtype),
            dtype,
            shape,
            None if key is None else (key, tag),
            name,
        )
        return value


def _weights(graph: ir.Graph):
    """(MatMul node, weight value) for every MatMul whose second input is a 2-D float initializer."""
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        weight = node.inputs[1]
        tensor = weight.const_value if weight is not None and weight.is_initializer() else None
        if tensor is not None and len(tensor.shape) == 2 and tensor.dtype in FLOAT_TYPES:
            yield node, weight


def quantize_model(
    model: ir.Model,
    scheme: str,
    block_size: int,
    ops: Ops = Ops.ORT,
    accuracy_level: int = DEFAULT_QUANT_ACCURACY_LEVEL,
    embedding_ids: str | None = None,
) -> int:
    """Quantize every MatMul of ``model`` (main graph) whose weight is a 2-D float initializer,
    in place; returns the number of quantized weights. The quantized tensors are lazy: each
    weight is read and quantized when the graph is written (:mod:`.weights`), one at a time.

    ``ops='ort'``: each MatMul becomes a ``com.microsoft`` ``MatMulNBits`` with
    ``accuracy_level`` (packed codes and scales as ONNX Runtime's ``MatMulNBitsQuantizer``
    writes them, computed by the same kernels, ``quantize_matmul_4bits`` / ``_8bits``).
    ``ops='portable'``: the weight becomes an INT4/INT8 initializer and scales in the weight's
    dtype feeding a blocked ``DequantizeLinear`` (axis 0); the model's default-domain opset is
    raised to :data:`DQ_OPSET` first (onnxscript's version converter; the operators of our
    graphs keep their meaning from 18 to 21, they only gain types) and the IR version to
    :data:`DQ_IR_VERSION`. A portable graph has no place for ``accuracy_level`` (ONNX Runtime
    reads it from the manifest when it fuses the graph, see ``runtime.onnxruntime.sessions.session_config``).

    ``embedding_ids``: the name of the token-ids graph input; the embedding table it gathers is
    quantized too (:func:`_quantize_embedding`; None keeps it in its float type).

    Raises:
        ValueError: see :func:`check_scheme`; an embedding whose hidden size is not a multiple
            of ``block_size`` with ``ops='ort'``.
    """
    bits = check_scheme(scheme, block_size, ops)
    graph = model.graph
    if ops == Ops.PORTABLE:
        from onnxscript import version_converter

        if model.opset_imports.get("", 0) < DQ_OPSET:
            version_converter.convert_version(model, DQ_OPSET)
        model.ir_version = max(model.ir_version or 0, DQ_IR_VERSION)
    else:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    replaced: dict[str, list[ir.Value]] = {}
    for node, weight in _weights(graph):
        tensor = weight.const_value
        k, n = (int(d) for d in tensor.shape)
        name = weight.name
        if name not in replaced:
            blocks = -(-k // block_size)
            if ops == Ops.ORT:
                parts = _Parts(tensor, lambda w: nbits_blocks(w, bits, block_size), 2)
                blob = block_size * bits // 8
                replaced[name] = [
                    parts.tensor(0, f"{name}_Q{bits}", ir.DataType.UINT8, [n, blocks, blob], "nbits"),
                    parts.tensor(1, f"{name}_scales", tensor.dtype, [n, blocks], "nbits-scales"),
                ]
                for value in replaced[name]:
                    graph.register_initializer(value)
            else:
                parts = _Parts(tensor, lambda w: _dq_blocks(w, bits, block_size), 2)
                qtype = ir.DataType.INT4 if bits == 4 else ir.DataType.INT8
                q = parts.tensor(0, f"{name}_q{bits}", qtype, [k, n], f"dq{bits}")
                scale = parts.tensor(1, f"{name}_scale", tensor.dtype, [blocks, n], f"dq{bits}-scale")
                graph.register_initializer(q)
                graph.register_initializer(scale)
                dq = ir.Node(
                    "",
                    "DequantizeLinear",
                    [q, scale],
                    attributes=[
                        ir.AttrInt64("axis", 0),
                        ir.AttrInt64("block_size", block_size),
                    ],
                    name=f"{node.name or name}_dq",
                )
                dq.outputs[0].name = f"{name}_dq"
                graph.insert_before(node, dq)
                replaced[name] = [dq.outputs[0]]
        if ops == Ops.ORT:
            attributes = [
                ir.AttrInt64("K", k),
                ir.AttrInt64("N", n),
                ir.AttrInt64("bits", bits),
                ir.AttrInt64("block_size", block_size),
            ]
            if accuracy_level:
                attributes.append(ir.AttrInt64("accuracy_level", accuracy_level))
            new = ir.Node(
                MS_DOMAIN,
                "MatMulNBits",
                [node.inputs[0], *replaced[name]],
                attributes=attributes,
                name=f"{node.name}_Q{bits}" if node.name else None,
            )
            ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
        else:
            node.replace_input_with(1, replaced[name][0])
    if embedding_ids is not None:
        replaced.update(_quantize_embedding(graph, embedding_ids, bits, block_size, ops))
    for name in replaced:
        value = graph.initializers.get(name)
        if value is not None and not value.uses() and not value.is_graph_output():
            graph.initializers.pop(name)
    return len(replaced)


def quantize_for_contract(model: ir.Model, contract) -> int:
    """:func:`quantize_model` of a text graph ``model`` with the quantization ``contract`` (a
    :class:`~qwen35_onnx.contract.ShapeContract` with ``quantize`` int4 or int8) records: its scheme, block size,
    operators, accuracy level and, where ``quantize_embedding``, the table the ``input_ids`` input gathers. Returns the
    number of quantized weights; raises as :func:`quantize_model`."""
    return quantize_model(
        model,
        contract.quantize,
        contract.quant_block_size,
        ops=contract.ops,
        accuracy_level=contract.quant_accuracy_level,
        embedding_ids="input_ids" if contract.quantize_embedding else None,
    )


def _quantize_embedding(graph: ir.Graph, ids_name: str, bits: int, block_size: int, ops: str) -> dict[str, list]:
    """Quantize the token-embedding table: the 2-D float initializer gathered (axis 0) by the
    graph input ``ids_name``. Returns ``{table name: new values}`` (empty when the graph has none).

    ``ort``: ``com.microsoft`` ``GatherBlockQuantized`` (``gather_axis=0``, ``quantize_axis=1``)
    over the table's rows quantized as ``MatMulNBits`` quantizes its weight columns, with the
    export's bits: the same bytes as the quantized lm_head of a tied model, which the weights file
    then stores once. ``portable``: ``Gather`` of int8 codes and of their scales, then a blocked
    ``DequantizeLinear`` along the hidden axis, standard ONNX (opset 21 has no INT4 ``Gather``,
    hence 8 bits whatever the export's bits).
    """
    ids = next((v for v in graph.inputs if v.name == ids_name), None)
    found = {}
    for node in [] if ids is None else list(ids.uses()):
        gather = node.node
        if gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx") or node.idx != 1:
            continue
        axis = gather.attributes.get("axis")
        table = gather.inputs[0]
        tensor = table.const_value if table.is_initializer() else None
        if (
            (axis is not None and axis.as_int() != 0)
            or tensor is None
            or len(tensor.shape) != 2
            or tensor.dtype not in FLOAT_TYPES
        ):
            continue
        vocab, hidden = (int(d) for d in tensor.shape)
        blocks = -(-hidden // block_size)
        name = table.name
        if name not in found:
            if ops == Ops.ORT:
                if hidden % block_size:
                    raise ValueError(
                        f"the embedding's hidden size {hidden} is not a multiple of the quantization "
                        f"block size {block_size}, which GatherBlockQuantized needs"
                    )
                parts = _Parts(tensor, lambda w: _rows(w, lambda c: nbits_blocks(c.T, bits, block_size)), 2)
                found[name] = [
                    parts.tensor(0, f"{name}_Q{bits}", ir.DataType.UINT8, [vocab, hidden * bits // 8], "nbits-rows"),
                    parts.tensor(1, f"{name}_scales", tensor.dtype, [vocab, blocks], "nbits-rows-scales"),
                ]
            else:
                parts = _Parts(
                    tensor,
                    lambda w: _rows(
                        w, lambda c: tuple(a.T for a in quantize_blocks(c.T, 8, block_size, scale_dtype=w.dtype))
                    ),
                    2,
                )
                found[name] = [
                    parts.tensor(0, f"{name}_q8", ir.DataType.INT8, [vocab, hidden], "dq8-rows"),
                    parts.tensor(1, f"{name}_scale", tensor.dtype, [vocab, blocks], "dq8-rows-scale"),
                ]
            for value in found[name]:
                graph.register_initializer(value)
        if ops == Ops.ORT:
            new = [
                ir.Node(
                    MS_DOMAIN,
                    "GatherBlockQuantized",
                    [found[name][0], ids, found[name][1]],
                    attributes=[
                        ir.AttrInt64("gather_axis", 0),
                        ir.AttrInt64("quantize_axis", 1),
                        ir.AttrInt64("block_size", block_size),
                        ir.AttrInt64("bits", bits),
                    ],
                    name=f"{gather.name or name}_Q{bits}",
                )
            ]
        else:
            codes = ir.Node("", "Gather", [found[name][0], ids], name=f"{gather.name or name}_codes")
            scales = ir.Node("", "Gather", [found[name][1], ids], name=f"{gather.name or name}_scales")
            new = [
                codes,
                scales,
                ir.Node(
                    "",
                    "DequantizeLinear",
                    [codes.outputs[0], scales.outputs[0]],
                    attributes=[
                        ir.AttrInt64("axis", -1),
                        ir.AttrInt64("block_size", block_size),
                    ],
                    name=f"{gather.name or name}_dq",
                ),
            ]
        ir.convenience.replace_nodes_and_values(graph, gather, [gather], new, gather.outputs, new[-1].outputs)
    return found


def _rows(table: np.ndarray, quantize) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` (a function of a slice of rows giving ``(codes, scales)`` with one row per
    table row) applied to ``table [V, H]`` a slice of rows at a time (bounded temporaries), the
    results concatenated: the row-wise quantization of an embedding table."""
    step = max(1, _CHUNK // max(1, table.shape[1]))
    codes, scales = zip(*(quantize(np.ascontiguousarray(table[r : r + step])) for r in range(0, len(table), step)))
    rows = len(table)
    return np.concatenate(codes).reshape(rows, -1), np.concatenate(scales).reshape(rows, -1)


def nbits_blocks(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``MatMulNBits`` codes and scales of ``weight`` ``[K, N]`` (fp32 or fp16; bf16 is computed
    in fp32 and its scales stored in bf16), symmetric, with ONNX Runtime's kernels.

    Returns:
        ``(packed, scales)``: ``packed`` ``[N, ceil(K / block_size), block_size * bits / 8]``
        uint8, ``scales`` ``[N, ceil(K / block_size)]`` in the weight's dtype.
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    k, n = weight.shape
    dtype = weight.dtype
    if dtype not in (np.float32, np.float16):
        weight = weight.astype(np.float32)
    blocks = -(-k // block_size)
    if blocks * block_size != k:
        weight = np.pad(weight, ((0, blocks * block_size - k), (0, 0)))
    weight = np.ascontiguousarray(weight)
    packed = np.zeros((n, blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros((n, blocks), weight.dtype)
    zero_points = np.zeros((n, -(-blocks * bits // 8)), np.uint8)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(
        packed, weight, scales, zero_points, block_size, n, k, True
    )
    return packed, scales.astype(dtype, copy=False)


def _dq_blocks(weight: np.ndarray, bits: int, block_size: int):
    import ml_dtypes

    q, scale = quantize_blocks(weight, bits, block_size, scale_dtype=weight.dtype)
    # ml_dtypes (an onnx dependency) gives ONNX's INT4 packing: two per byte, low nibble first
    return (q.astype(ml_dtypes.int4) if bits == 4 else q), scale


# ----------------------------------------------------------------------------------------
# --ops portable: blocked DequantizeLinear (opset 21)
# ----------------------------------------------------------------------------------------
def quantize_blocks(
    weight: np.ndarray, bits: int, block_size: int, scale_dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
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
