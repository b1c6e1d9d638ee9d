"""``qwen35-onnx quantize``: the quantization of an existing export (no new trace) is the export that
``export --quantize`` writes with the same other options: the same graphs (node for node, attribute for
attribute, the tensors at the same places of the same weights file; only the trace's own names may
differ), the same weights file byte for byte, the same manifest. The suite's quantized exports of the
trained checkpoint are made this way (tests/conftest.py ``trained_export``), one trace for all of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest

from qwen35_onnx.contract import MANIFEST_NAME, read_manifest
from qwen35_onnx.export.options import ExportError, QuantizeOptions

from .conftest import CAPACITY, TIED_OPTIONS, export_to, quantized_copy
from .test_cli import invoke_cli

pytestmark = pytest.mark.slow


def canonical(graph: onnx.GraphProto) -> tuple:
    """``graph`` without its names: each node's domain, operator, input and output counts and attributes (subgraphs
    the same way), each initializer's type, shape and bytes (inline, or its offset and length in the data file)."""
    nodes = []
    for node in graph.node:
        attributes = []
        for a in sorted(node.attribute, key=lambda a: a.name):
            if a.type == onnx.AttributeProto.GRAPH:
                attributes.append((a.name, canonical(a.g)))
            else:
                copy = onnx.AttributeProto()
                copy.CopyFrom(a)
                attributes.append((a.name, copy.SerializeToString()))
        nodes.append((node.domain, node.op_type, len(node.input), len(node.output), tuple(attributes)))
    tensors = [
        (t.data_type, tuple(t.dims), t.raw_data, tuple(sorted((e.key, e.value) for e in t.external_data)))
        for t in graph.initializer
    ]
    return tuple(nodes), tuple(tensors)


def contract_of(model: onnx.ModelProto) -> str:
    return next(p.value for p in model.metadata_props if p.key == "qwen35_onnx.contract")


def test_quantize_gives_the_graphs_and_weights_of_export_quantize(
    tied_checkpoint, tied_export, trained_checkpoint, trained_export, tmp_path_factory, tmp_path
):
    """Against ``export --quantize``: the tied checkpoint at int4 on ``--ops ort`` (the lm_head reads the shared
    table through a Transpose in the float export and gets a quantized copy of its own; the embedding becomes
    GatherBlockQuantized) and the trained one at int8 on ``--ops portable`` (blocked DequantizeLinear, opset 21). The
    quantized copies are the suite's own (tests/conftest.py), which other tests use. An fp32 KV cache: an int8 one is
    calibrated by torch at each export, to the last bit only as reproducible as its matrix products (a quantized copy
    keeps the float export's scales)."""
    cases = [
        (
            export_to(tied_checkpoint, tmp_path / "ort-int4", **TIED_OPTIONS, quantize="int4"),
            quantized_copy(tmp_path_factory, tied_export, "tied-int4", quantize="int4"),
        ),
        (
            export_to(
                trained_checkpoint,
                tmp_path / "portable-int8",
                ops="portable",
                prefill_buckets=(CAPACITY,),
                quantize="int8",
            ),
            trained_export("portable", quantize="int8"),
        ),
    ]
    for direct, derived in cases:
        contract = read_manifest(derived)
        assert contract == read_manifest(direct)
        assert (derived / MANIFEST_NAME).read_text() == (direct / MANIFEST_NAME).read_text()

        def files(folder: Path) -> list[str]:
            return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

        assert files(direct) == files(derived)
        assert (direct / "text/weights.data").read_bytes() == (derived / "text/weights.data").read_bytes()
        for rel in contract.graphs.values():
            a = onnx.load(str(direct / rel), load_external_data=False)
            b = onnx.load(str(derived / rel), load_external_data=False)
            assert (a.ir_version, list(a.opset_import)) == (b.ir_version, list(b.opset_import)), rel
            assert contract_of(a) == contract_of(b) == contract.to_json(), rel
            assert canonical(a.graph) == canonical(b.graph), rel
    tied = [onnx.load(str(out / "text/decode.onnx"), load_external_data=False) for out in (tied_export, cases[0][1])]
    transposes = [[n.op_type for n in model.graph.node].count("Transpose") for model in tied]
    assert transposes[1] == transposes[0] - 1
    assert "GatherBlockQuantized" in {n.op_type for n in tied[1].graph.node}


def test_quantize_command_writes_an_export_that_generates(trained_export, tmp_path, photo):
    from qwen35_onnx.pipeline import Pipeline

    from .conftest import PROMPT

    source = trained_export("ort")
    out = tmp_path / "int8"
    done = invoke_cli("quantize", "--model", str(source), "--output-dir", str(out), "--quantize", "int8")
    assert done.returncode == 0, done.stderr
    assert "quantized" in done.stderr and "int8" in done.stderr
    contract = read_manifest(out)
    assert (contract.quantize, contract.quantize_embedding, contract.kv_dtype) == ("int8", True, "fp32")
    # the same tokens as the suite's own int8 copy of the same export (made by the Python API)
    tokens = Pipeline.from_exported(out).generate(photo, PROMPT, max_new_tokens=8).token_ids
    assert (
        tokens
        == Pipeline.from_exported(trained_export("ort", quantize="int8", kv_dtype="fp32"))
        .generate(photo, PROMPT, max_new_tokens=8)
        .token_ids
    )
    assert not list(tmp_path.glob(".int8.tmp-*"))


def test_bad_quantize_requests_fail_with_one_line_and_write_nothing(trained_export, tmp_path):
    source = trained_export("ort")
    quantized = trained_export("ort", quantize="int4")
    stray = tmp_path / "stray"  # a folder of the user's
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    webapp = tmp_path / "webapp"  # a folder of the user's with a manifest.json of its own
    webapp.mkdir()
    (webapp / MANIFEST_NAME).write_text('{"name": "my web app"}')
    damaged = tmp_path / "damaged"  # an export whose weights file was cut short
    shutil.copytree(source, damaged)
    with open(damaged / "text/weights.data", "r+b") as data:
        data.truncate(1000)
    before = {p: p.read_bytes() for p in (*source.rglob("*"), *damaged.rglob("*")) if p.is_file()}
    out = str(tmp_path / "a")
    cases = [
        (["--model", str(source), "--output-dir", out], ["--quantize is required", "int4 or int8"]),
        (["--model", str(source), "--output-dir", out, "--quantize", "int3"], ["--quantize 'int3'", "int4 or int8"]),
        (["--model", str(quantized), "--output-dir", out, "--quantize", "int8"], ["quantized already"]),
        (
            ["--model", str(source), "--output-dir", out, "--quantize", "int4", "--quant-block-size", "48"],
            ["--quant-block-size 48", "power of two"],
        ),
        (["--model", str(source), "--output-dir", "", "--quantize", "int4"], ["--output-dir ''", "empty"]),
        (
            ["--model", str(source), "--output-dir", str(source / "text"), "--quantize", "int4"],
            ["overlaps the source export"],
        ),
        (["--model", str(source), "--output-dir", str(stray), "--quantize", "int4"], ["not empty", "--overwrite"]),
        (
            ["--model", str(source), "--output-dir", str(stray), "--quantize", "int4", "--overwrite"],
            ["only replaces a previous qwen35-onnx export", "manifest.json"],
        ),
        (
            ["--model", str(source), "--output-dir", str(webapp), "--quantize", "int4", "--overwrite"],
            ["only replaces a previous qwen35-onnx export", str(webapp)],
        ),
        (
            ["--model", str(damaged), "--output-dir", out, "--quantize", "int4"],
            ["weights.data", "has 1000 bytes", "incomplete or damaged"],
        ),
        (["--model", str(tmp_path / "missing"), "--output-dir", out, "--quantize", "int4"], ["does not exist"]),
    ]
    for args, fragments in cases:
        done = invoke_cli("quantize", *args)
        assert done.returncode == 2, (args, done.stderr)
        line = done.stderr.strip()
        assert line.startswith("error: ") and "\n" not in line and "Traceback" not in line, (args, line)
        for fragment in fragments:
            assert fragment in line, (args, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "stray", "webapp"]
    assert [p.name for p in stray.iterdir()] == ["notes.txt"]
    assert [p.name for p in webapp.iterdir()] == [MANIFEST_NAME]
    assert before == {p: p.read_bytes() for p in (*source.rglob("*"), *damaged.rglob("*")) if p.is_file()}


def test_an_interrupted_quantize_leaves_nothing(trained_export, tmp_path, monkeypatch):
    from qwen35_onnx.export import requantize

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("qwen35_onnx.export.quantize.quantize_model", broken)
    with pytest.raises(KeyboardInterrupt):
        requantize.quantize_export(trained_export("ort"), tmp_path / "out", QuantizeOptions(quantize="int4"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ExportError, match="--quantize is required"):
        requantize.quantize_export(trained_export("ort"), tmp_path / "out", QuantizeOptions())
