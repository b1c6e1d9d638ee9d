"""The benchmark's bookkeeping (the benchmark itself runs with `make bench`, not here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from qwen35_onnx.bench import PeerResult, decode_weight_bytes, report
from qwen35_onnx.contract import read_manifest


def test_decode_weight_bytes_skips_the_embedding_table(fixed_export):
    contract = read_manifest(fixed_export)
    path = fixed_export / contract.graphs["decode"]
    model = onnx.load(str(path))
    total = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    embedding = contract.vocab_size * contract.hidden_size * 4
    assert decode_weight_bytes(path) == total - embedding


def test_report_has_ratios_flatness_and_floor(tmp_path: Path):
    fast = PeerResult("fast", {32: 1.0, 2048: 8.0}, {32: 1.0, 2048: 1.1}, 900.0, decode_bytes=10**9)
    slow = PeerResult("slow", {32: 2.0, 2048: 16.0}, {32: 4.0, 2048: 8.0}, 200.0, decode_bytes=10**9)
    markdown = report([fast, slow], bandwidth_gbps=10.0, out_dir=tmp_path, state_bytes={32: 0})
    rows = {}
    for line in markdown.splitlines():  # the first table (the ratio table repeats the names)
        if line.startswith(("| fast", "| slow")):
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
    # prefill x2, decode x2, flatness, e2e, floor (1 GB at 10 GB/s = 100 ms), x floor
    assert rows["slow"][:8] == ["2.0", "16.0", "4.00", "8.00", "2.00", "200.0", "100.000", "0.0"]
    assert np.isclose(float(rows["fast"][4]), 1.1)
    assert "| slow | 4.00 | 1.00 |" in markdown  # ratio row/column
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.md").read_text() == markdown
