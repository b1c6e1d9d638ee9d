"""Quantize the text graphs of an existing export without tracing the checkpoint again
(``qwen35-onnx quantize``).

An export made without ``--quantize`` holds its text graphs with float weights. This module reads
those graphs back (ONNX IR, weights memory-mapped from ``text/weights.data``), applies the same
weight-only quantization the exporter applies after tracing (:func:`.quantize.quantize_model`, with
the new contract in each graph's metadata) and writes a new export folder: the result is the export
``export --quantize ...`` writes with the source's other options: the same graphs operator for operator (only
the trace's own node names may differ), the same weights file byte for byte (``tests/test_requantize.py``), in the
time of the quantization alone (the trace is the long part of an export: minutes at 0.8B).

What cannot change without a new trace stays the source's: the operators (``--ops``), the dtype and
the KV cache's precision. ``export --quantize`` on ``--ops ort`` defaults to an int8 KV cache; an
export made without ``--quantize`` keeps its ``--kv-dtype`` here (export it with ``--kv-dtype int8``
first for that pairing).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..contract import (
    MANIFEST_NAME,
    METADATA_KEY,
    TEXT_WEIGHTS,
    GraphKind,
    Quantization,
    ShapeContract,
    read_manifest,
    write_manifest,
)
from ..onnxfile.complete import check_export_files, check_external_data
from .exporter import TEXT_DIR, _swap_into_place, _umask, check_replaceable, graph_jobs, output_folder
from .options import ExportError, ExportOptions, QuantizeOptions
from .weights import WeightsFileWriter

log = logging.getLogger(__name__)


def quantized_contract(contract: ShapeContract, options: QuantizeOptions) -> ShapeContract:
    """``contract`` (an unquantized export's) with ``options``' quantization: the contract ``export`` writes
    for the same checkpoint with the source's options plus these.

    Raises:
        ExportError: the source is quantized already; a quantization the source's options refuse (the
            rules of ``export``: block size, accuracy level, the embedding's block against the hidden size).
    """
    if contract.quantize != Quantization.NONE:
        raise ExportError(
            f"the export is quantized already (--quantize {contract.quantize}, --quant-block-size "
            f"{contract.quant_block_size}); quantize an export made without --quantize"
        )
    wanted = ExportOptions.from_contract(
        contract,
        quantize=options.quantize,
        quant_block_size=options.quant_block_size,
        quant_accuracy_level=options.quant_accuracy_level,
        quantize_embedding=options.quantize_embedding,
    )
    wanted.validate()
    wanted.check_embedding_blocks(contract.hidden_size)
    return replace(
        contract,
        quantize=wanted.quantize,
        quant_block_size=wanted.quant_block_size,
        quant_accuracy_level=wanted.quant_accuracy_level,
        quantize_embedding=wanted.embedding_quantized,
    )


def _check_folders(src: Path, out: Path, overwrite: bool) -> None:
    if out == src or src in out.parents or out in src.parents:
        raise ExportError(f"--output-dir {str(out)!r} overlaps the source export {str(src)!r}; choose another folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output-dir {str(out)!r} is a file, not a folder")
    check_replaceable(out, overwrite)


def _keyed(model) -> None:
    """Give each external initializer of ``model`` a key naming its bytes in the source's data file, so that a
    weight the text graphs share is quantized once and stored once (as the exporter's checkpoint keys do)."""
    import onnx_ir as ir

    from .lazy_weights import SourcedTensor

    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                key = ("source", tensor.location, tensor.offset, tensor.length)
                value.const_value = SourcedTensor(lambda t=tensor: t, tensor.dtype, tensor.shape, key, value.name)


def _transpose_shared_weights(model) -> int:
    """Give each ``MatMul`` whose weight is ``Transpose(W)`` of a float initializer ``W`` that something else uses
    too (a tied lm_head: the table also feeds the embedding's ``Gather``) a transposed copy of ``W`` of its own, which
    the quantizer then finds; the exporter traces a quantized export that way (``lm_head_t``), where the float export
    keeps one copy of the table. Returns the number of copies made."""
    import onnx_ir as ir

    from .lazy_weights import SourcedTensor
    from .quantize import FLOAT_TYPES

    graph, count = model.graph, 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        tensor = source.const_value if source is not None and source.is_initializer() else None
        uses = node.outputs[0].uses()
        if (
            tensor is None
            or len(tensor.shape) != 2
            or tensor.dtype not in FLOAT_TYPES
            or not uses
            or any(use.node.op_type != "MatMul" or use.idx != 1 for use in uses)
        ):
            continue
        shape = [tensor.shape[1], tensor.shape[0]]
        copy = ir.Value(name=f"{source.name}_t", shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype))
        key = (getattr(tensor, "key", source.name), "transpose")
        copy.const_value = SourcedTensor(
            lambda t=tensor: ir.Tensor(np.ascontiguousarray(t.numpy().T), dtype=t.dtype),
            tensor.dtype,
            shape,
            key,
            copy.name,
        )
        node.outputs[0].replace_all_uses_with(copy, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.register_initializer(copy)
        if not source.uses() and not source.is_graph_output():
            graph.initializers.pop(source.name)
        count += 1
    return count


def quantize_export(
    export_dir: str | os.PathLike, output_dir: str | os.PathLike, options: QuantizeOptions, show_progress: bool = False
) -> ShapeContract:
    """Write a quantized copy of the export at ``export_dir`` to ``output_dir``; returns its contract.

    The text graphs (prefill, chunk, decode, verify, MTP) get ``options``' weight-only quantization, one
    weight at a time (:func:`.quantize.quantize_model`: int4 or int8, MatMulNBits for ``--ops ort``, blocked
    DequantizeLinear for ``--ops portable``), into one new weights file; the vision graphs and every other
    file are copied, each graph with the new contract in its metadata. Written into a temporary sibling
    folder and renamed into place at the end: an interrupted run leaves nothing.

    Raises:
        ExportError: ``options`` refused (:meth:`.options.QuantizeOptions.validate`, :func:`quantized_contract`);
            ``output_dir`` overlaps the source, is a file, or is a non-empty folder (without ``overwrite``,
            or that is not an export).
        ContractError: ``export_dir`` is not a complete export (no manifest, a graph or weights file missing,
            short or unreadable).
    """
    import onnx
    import onnx_ir as ir

    from .quantize import quantize_for_contract

    options.validate()
    src, out = Path(export_dir).expanduser().resolve(), output_folder(output_dir)
    contract = read_manifest(src)
    new = quantized_contract(contract, options)
    check_export_files(src, contract)
    for key, rel in contract.graphs.items():  # every graph readable and every byte of weights it reads there
        check_external_data(key, src / rel)
    if sorted(job.path for job in graph_jobs(contract)) != sorted(contract.graphs.values()):
        raise ExportError(
            f"{str(src)!r} has another graph layout ({sorted(contract.graphs.values())}) than this version writes: "
            "export it again with this version"
        )
    _check_folders(src, out, options.overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise ExportError(f"--output-dir {str(out)!r} cannot be created: {exc}") from exc
    tmp.chmod(0o777 & ~_umask())
    try:
        graphs = set(contract.graphs.values())
        text_data = f"{TEXT_DIR}/{TEXT_WEIGHTS}"
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            if path.is_file() and rel not in graphs and rel not in (MANIFEST_NAME, text_data):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, tmp / rel)
        (tmp / TEXT_DIR).mkdir(exist_ok=True)
        writer = WeightsFileWriter(tmp / TEXT_DIR)
        items = [(job.key, job.path) for job in graph_jobs(contract)]  # the exporter's order: the same weights file
        for key, rel in tqdm(items, desc="quantize", unit="graph", disable=not show_progress, file=sys.stderr):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if GraphKind.of(key) == GraphKind.VISION:  # not quantized (as export): the new contract only
                proto = onnx.load(str(src / rel), load_external_data=False)
                onnx.helper.set_model_props(
                    proto, {**{e.key: e.value for e in proto.metadata_props}, METADATA_KEY: new.to_json()}
                )
                onnx.save_model(proto, str(tmp / rel))
                continue
            model = ir.load(src / rel)
            _keyed(model)
            _transpose_shared_weights(model)
            model.metadata_props[METADATA_KEY] = new.to_json()
            quantize_for_contract(model, new)
            writer.add_model(model, tmp / rel)
        writer.finish()
        write_manifest(tmp, new)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("quantized %s to %s (%s)", src, out, new.quantize)
    return new
