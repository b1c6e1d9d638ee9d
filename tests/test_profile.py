"""Where a step's time and bytes go: ``qwen35-onnx bench --profile`` (ONNX Runtime's profiler read
back per graph run, ``qwen35_onnx.bench.profile``), the ``profile_dir`` runtime option behind it, and
the bytes a decode step reads when its weights are ONNX Runtime's pre-packed ones."""

from __future__ import annotations

import json

import onnx
import pytest

from qwen35_onnx.bench.profile import profile_export, profile_lines, read_profile
from qwen35_onnx.bench.protocol import decode_weight_bytes
from qwen35_onnx.runtime.backend import RuntimeOptions


def test_read_profile_groups_kernel_times_by_run(tmp_path):
    events = [
        {"cat": "Session", "name": "model_run", "ts": 100, "dur": 50},
        {"cat": "Node", "name": "mm_kernel_time", "ts": 110, "dur": 20, "args": {"op_name": "MatMulNBits"}},
        {"cat": "Node", "name": "mm_fence_before", "ts": 109, "dur": 0, "args": {"op_name": "MatMulNBits"}},
        {
            "cat": "Node",
            "name": "norm_kernel_time",
            "ts": 131,
            "dur": 5,
            "args": {"op_name": "SimplifiedLayerNormalization"},
        },
        {"cat": "Session", "name": "model_run", "ts": 300, "dur": 40},
        {"cat": "Node", "name": "mm_kernel_time", "ts": 305, "dur": 30, "args": {"op_name": "MatMulNBits"}},
        {"cat": "Node", "name": "outside_kernel_time", "ts": 200, "dur": 9, "args": {"op_name": "Add"}},  # no run
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    first, second = read_profile(path, 0)
    assert (first["run_us"], first["nodes"]) == (
        50,
        {"mm": ("MatMulNBits", 20), "norm": ("SimplifiedLayerNormalization", 5)},
    )
    assert second["nodes"] == {"mm": ("MatMulNBits", 30)}
    (last,) = read_profile(path, 1)
    assert last["run_us"] == 40


def test_profile_dir_is_an_onnxruntime_option():
    RuntimeOptions(profile_dir="/tmp/somewhere").validate()
    with pytest.raises(ValueError, match=r"profile_dir '/tmp/p' needs runtime 'onnxruntime' .*not 'openvino'"):
        RuntimeOptions(runtime="openvino", profile_dir="/tmp/p").validate()
    with pytest.raises(ValueError, match=r"profile_dir must be a folder path or '', got 3"):
        RuntimeOptions(profile_dir=3).validate()


@pytest.mark.slow
def test_profile_export_splits_each_step(fixed_export):
    """One prefill length on the demo export: the prefill's graph runs and the decode steps profiled,
    the kernels' sum within the session's time within the caller's, operators counted."""
    prefill, decode = profile_export(fixed_export, lengths=(8,), runs=2, steps=3)
    assert prefill.graph.startswith("prefill (") and prefill.runs == 2 and decode.runs == 3
    for p in (prefill, decode):
        assert 0 < p.kernel_ms <= p.run_ms <= p.wall_ms
        assert sum(ms for ms, _ in p.by_op.values()) == pytest.approx(p.kernel_ms, rel=0.2)
        assert "MatMul" in p.by_op and len(p.by_node) >= sum(count for _, count in p.by_op.values()) // 2
    assert decode.step_bytes > decode_weight_bytes(fixed_export / "text" / "decode.onnx")  # + the states
    text = "\n".join(profile_lines([prefill, decode]))
    assert "### decode, 8 tokens (3 runs, medians)" in text and "| MatMul |" in text


@pytest.mark.slow
def test_decode_bytes_count_onnx_runtimes_packed_weights(trained_export):
    """With the pre-packed weights cache a decode step reads MatMulNBits' packed blobs (codes, an fp32
    scale and an fp32 block sum per block for int8 activations), not the export's codes and scales."""
    from qwen35_onnx.bench.speed import step_graph
    from qwen35_onnx.pipeline import Pipeline

    out = trained_export("ort", quantize="int4")
    pipe = Pipeline.from_exported(out)
    saved = step_graph(pipe, out)
    exported = out / pipe.contract.graphs["decode"]
    assert saved != exported and saved.is_file()  # the cache's copy of the decode graph
    model = onnx.load(str(saved), load_external_data=False)
    inits = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}
    extra = quantized = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        n, k, block = attrs["N"], attrs["K"], attrs["block_size"]
        blocks = -(-k // block)
        (blob,) = [v for key, v in inits[node.input[1]].items() if key.startswith("prepacked_")]
        packed = int(blob.split("|")[1].split(";")[1])
        codes, scales = n * blocks * block // 2, n * blocks * 4
        block_sums = -(-n // 16) * 16 * blocks * 4
        assert 0 <= packed - (codes + scales + block_sums) < 256  # MLAS's layout, up to its alignment
        extra += packed - codes - scales
        quantized += codes + scales
    # the other weights (norms, conv kernels, ...) as ONNX Runtime saved them (it may fold or share some)
    others = decode_weight_bytes(exported) - quantized
    assert extra > others >= 0
    assert abs(decode_weight_bytes(saved) - decode_weight_bytes(exported) - extra) <= others


@pytest.mark.slow
def test_measure_memory_reads_the_text_run_before_the_image(trained_export):
    """``bench --memory``: resident memory after a text prompt (vision weights mapped, not yet read)
    and after an image too; with the pre-packed cache the pages are file pages, read from Pss."""
    import json
    import subprocess
    import sys

    out = trained_export("ort", quantize="int4")
    # in a process of its own, as `bench --memory` runs: a test worker's own heap (whatever the tests
    # before this one left, trimmed while it measures) would move its resident memory either way
    measure = (
        "import json, sys; from qwen35_onnx.bench.memory import measure_memory; "
        "r = measure_memory(sys.argv[1], compare=False, log=lambda m: None); "
        "print(json.dumps(dict(tokens=r.text_tokens, baseline=r.baseline, text=r.text, ran=r.ran, lines=r.lines())))"
    )
    done = subprocess.run([sys.executable, "-c", measure, str(out)], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 126  # the test capacity, 128, less 2
    # VmRSS, not Pss: other processes (the other worker) map the same libraries meanwhile, which
    # lowers this process's Pss by more than the tiny test model adds
    assert report["baseline"]["VmRSS"] < report["text"]["VmRSS"] <= report["ran"]["VmRSS"]
    assert "Pss" in report["baseline"] and "Pss" in report["text"] and "Pss" in report["ran"]
    text = "\n".join(report["lines"])
    assert "after a prefill of 126 tokens and a decode step (text only): VmRSS" in text
    assert "after running vision too (the largest grid): VmRSS" in text and "pre-packed weights cache" in text
