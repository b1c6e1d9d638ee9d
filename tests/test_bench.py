"""The benchmark's bookkeeping (the benchmark itself runs with `make bench`, not here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from qwen35_onnx.bench.protocol import PeerResult, decode_weight_bytes
from qwen35_onnx.bench.report import report
from qwen35_onnx.contract import read_manifest


def test_decode_weight_bytes_skips_the_embedding_table(fixed_export):
    contract = read_manifest(fixed_export)
    path = fixed_export / contract.graphs["decode"]
    model = onnx.load(str(path))
    total = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    embedding = contract.vocab_size * contract.hidden_size * 4
    assert decode_weight_bytes(path) == total - embedding


def test_report_has_ratios_flatness_and_floor(tmp_path: Path):
    fast = PeerResult(
        "fast", {32: 1.0, 2048: 8.0}, {32: 1.0, 2048: 1.1}, 900.0, decode_bytes=10**9, peak_rss_bytes=2_500_000_000
    )
    slow = PeerResult("slow", {32: 2.0, 2048: 16.0}, {32: 4.0, 2048: 8.0}, 200.0, decode_bytes=10**9)
    markdown = report([fast, slow], bandwidths={"probe": 10.0, "slower": 5.0}, out_dir=tmp_path, state_bytes={32: 0})
    rows = {}
    for line in markdown.splitlines():  # the first table (the ratio table repeats the names)
        if line.startswith(("| fast", "| slow")):
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
    # prefill x2, decode x2, flatness, e2e, floor (1 GB at 10 GB/s = 100 ms), x floor, peak RSS GB
    assert rows["slow"] == ["2.0", "16.0", "4.00", "8.00", "2.00", "200.0", "100.000", "0.04", "-"]
    assert rows["fast"][-1] == "2.50"
    assert "Prefill: median of" not in markdown  # the reference protocol: not restated
    assert "Read bandwidth: 10.0 GB/s (measured in this run, the best of: probe 10.0, slower 5.0)" in markdown
    assert np.isclose(float(rows["fast"][4]), 1.1)
    assert "| slow | 4.00 | 1.00 |" in markdown  # ratio row/column
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.md").read_text() == markdown
    sampled = PeerResult(
        "ort int4", {32: 1.0}, {32: 1.0}, 9.0, decode_bytes=10**9, peak_rss_bytes=3 * 10**9, peak_sampled=True
    )
    assert "| 3.00* |" in report([sampled], bandwidths={"probe": 10.0}, out_dir=tmp_path, state_bytes={32: 0})


def test_floor_target_reads_each_length_and_round_against_the_bytes_a_step_reads():
    from qwen35_onnx.bench.protocol import merge_rounds
    from qwen35_onnx.bench.report import floor_target_lines

    # 1 GB of weights at 10 GB/s: 100 ms; the states add 0.1 GB at 512 tokens (110 ms)
    ours = merge_rounds(
        [PeerResult("ort int4", {}, {32: d32, 512: d512}, decode_bytes=10**9) for d32, d512 in [(110, 130), (120, 125)]]
    )
    (line,) = [line for line in floor_target_lines([ours], 10.0, {32: 0, 512: 10**8}) if line.startswith("- ")]
    assert "32: 115.00 / 100.00 ms = 1.15x (met) [rounds: 1.10x, 1.20x; met in 1 of 2]" in line
    assert "512: 127.50 / 110.00 ms = 1.16x (missed) [rounds: 1.19x, 1.14x; met in 1 of 2]" in line
    # just over the target reads over it (rounded up); a row without step bytes, or none: no line
    (near,) = floor_target_lines([PeerResult("ort int4", {}, {32: 115.01}, decode_bytes=10**9)], 10.0, {})[-1:]
    assert near.endswith("32: 115.01 / 100.00 ms = 1.16x (missed)")
    assert floor_target_lines([PeerResult("ort int4", {}, {32: 1.0})], 10.0, {}) == []
    assert floor_target_lines([PeerResult("llama.cpp Q4_0", {}, {32: 1.0}, decode_bytes=1)], 10.0, {}) == []


def test_target_lines_compare_our_openvino_int4_with_the_peer():
    from qwen35_onnx.bench.report import target_lines

    ours = PeerResult("openvino int4 f32", {}, {32: 50.0, 512: 55.0}, None)
    peer = PeerResult("ov-genai int4 f32", {}, {32: 60.0, 512: 66.0}, None)
    (line,) = [line for line in target_lines([ours, peer]) if line.startswith("- ")]
    assert "32: 50.00 vs 60.00 ms (1.20x)" in line and "512: 55.00 vs 66.00 ms (1.20x)" in line
    assert target_lines([ours]) == []


def test_run_bench_refuses_unknown_rows_before_any_export(tmp_path: Path):
    import pytest

    from qwen35_onnx.bench.speed import ROWS, run_bench

    assert {
        "openvino fp32 f32",
        "openvino fp32 bf16",
        "openvino int4 f32",
        "openvino int4 bf16",
        "ov-genai int4 f32",
    } <= set(ROWS)
    with pytest.raises(ValueError, match=r"bench rows \['openvino int3'\]: unknown \['openvino int3'\]; choices: "):
        run_bench(tmp_path / "checkpoint", tmp_path / "out", rows=["openvino int3"])
    with pytest.raises(ValueError, match=r"bench rows \[\]: none given"):
        run_bench(tmp_path / "checkpoint", tmp_path / "out", rows=[])
    with pytest.raises(ValueError, match=r"prefill_runs must be an integer >= 1, got 0"):
        run_bench(tmp_path / "checkpoint", tmp_path / "out", prefill_runs=0)
    with pytest.raises(ValueError, match=r"rounds must be an integer >= 1, got 0"):
        run_bench(tmp_path / "checkpoint", tmp_path / "out", rounds=0)
    assert not (tmp_path / "out").exists()


def test_run_bench_checks_lengths_and_work_dir_before_any_export(tmp_path: Path):
    import json

    import pytest

    from qwen35_onnx.bench.speed import run_bench

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    message = r"--lengths: the longest, 3841 tokens, plus 256 decode tokens is more than the model's max_position_em"
    with pytest.raises(ValueError, match=message):
        run_bench(checkpoint, tmp_path / "out", lengths=(32, 3841))
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    with pytest.raises(ValueError, match=r"--work-dir '.*a-file/tiny' is inside '.*a-file', a file, not a folder"):
        run_bench(checkpoint, in_the_way / "tiny", lengths=(32,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "checkpoint"]


def test_bench_cli_checks_rows_before_building_a_checkpoint(tmp_path: Path):
    from typer.testing import CliRunner

    from qwen35_onnx.cli import app

    result = CliRunner().invoke(app, ["bench", "--rows", "ort int4,foo", "--work-dir", str(tmp_path)])
    assert (
        result.exit_code != 0
        and "--rows 'ort int4,foo': bench rows" in result.output
        and "unknown ['foo']" in result.output
    )
    result = CliRunner().invoke(app, ["bench", "--prefill-runs", "0", "--work-dir", str(tmp_path)])
    assert result.exit_code != 0 and "--prefill-runs 0 must be at least 1" in result.output
    result = CliRunner().invoke(app, ["bench", "--rounds", "0", "--work-dir", str(tmp_path)])
    assert result.exit_code != 0 and "--rounds 0 must be at least 1" in result.output
    result = CliRunner().invoke(app, ["bench", "--rounds", "2", "--memory", str(tmp_path / "x")])
    assert result.exit_code != 0 and "--rounds 2: the side-by-side bench's option" in result.output
    assert not any(tmp_path.iterdir())


def test_image_section_names_why_the_photo_prompt_was_not_timed(small_export):
    """With a bucket too small for the photo's prompt (the bench's ``--lengths 32``), the vision graph
    is still timed and the row's time to first token is left out with the reason, instead of the
    whole bench stopping."""
    from qwen35_onnx.bench.vision import image_costs, image_lines
    from qwen35_onnx.pipeline import Pipeline

    cost = image_costs("small", Pipeline.from_exported(small_export), runs=1)
    assert cost.vision and all(v["ms"] > 0 for v in cost.vision)
    assert cost.ttft_ms is None and "more than the largest prefill bucket 32" in cost.skipped, cost.skipped
    assert image_lines([cost])[-1].endswith("| - | - | - | - |")


def test_rows_are_measured_in_turn_and_each_figure_is_the_median_over_the_rounds():
    """``bench --rounds 3``: A B C, A C, A C (B could not run: not tried again), the extras
    (image, prompts by length) in the first round only; medians per length, the largest peak."""
    import pytest

    from qwen35_onnx.bench.protocol import merge_rounds
    from qwen35_onnx.bench.speed import measure_in_rounds

    calls, between = [], []
    times = {"A": iter([10.0, 30.0, 20.0]), "C": iter([5.0, 7.0, 6.0])}

    def measure(row, first):
        calls.append((row, first))
        if row == "B":
            return None
        ms = next(times[row])
        result = PeerResult(row, {32: ms}, {32: ms / 10}, 100 / ms, peak_rss_bytes=int(ms * 1e9))
        if first:
            result.image = {"ttft_ms": ms}
            result.skipped = [f"{row}: a part not measured"]
        return result

    a, c = measure_in_rounds(["A", "B", "C"], 3, measure, lambda: between.append(len(calls)), log=lambda m: None)
    assert calls == [("A", True), ("B", True), ("C", True), ("A", False), ("C", False), ("A", False), ("C", False)]
    assert between == list(range(7))  # before every measurement
    assert a.name == "A" and a.prefill_ms == {32: 20.0} and a.decode_ms == {32: 2.0} and a.e2e_tokens_per_s == 5.0
    assert a.peak_rss_bytes == 30 * 10**9 and a.image == {"ttft_ms": 10.0} and a.skipped == ["A: a part not measured"]
    assert [r["prefill_ms"][32] for r in a.rounds] == [10.0, 30.0, 20.0]
    assert c.prefill_ms == {32: 6.0} and len(c.rounds) == 3
    (once,) = measure_in_rounds(["C"], 1, lambda row, first: PeerResult(row, {32: 1.0}, {32: 1.0}), log=print)
    assert once.rounds == [] and once.peak_rss_bytes  # one round: as measured, the peak from VmHWM
    with pytest.raises(ValueError, match=r"merge_rounds needs results of one row, got \['A', 'C'\]"):
        merge_rounds([a, c])


def test_targets_show_the_ratio_of_every_round(tmp_path: Path):
    from qwen35_onnx.bench.protocol import merge_rounds
    from qwen35_onnx.bench.report import llamacpp_target_lines

    def rounds(name, prefill, decode):
        return merge_rounds([PeerResult(name, {512: p}, {32: d}) for p, d in zip(prefill, decode)])

    ours = rounds("ort int4", [1000.0, 1100.0, 1000.0], [15.0, 16.0, 15.0])
    pure = rounds("llama.cpp Q4_0 pure", [1600.0, 1600.0, 1400.0], [15.0, 17.0, 16.0])
    lines = llamacpp_target_lines([ours, pure])
    (prefill,) = [line for line in lines if line.startswith("- prefill")]
    assert "512: 1600.0 / 1000.0 ms = 1.60x (met) [rounds: 1.60x, 1.45x, 1.40x; met in 1 of 3]" in prefill
    (decode,) = [line for line in lines if line.startswith("- decode, llama.cpp Q4_0 pure")]
    assert "32: 16.0 / 15.0 ms = 1.06x (met) [rounds: 1.00x, 1.06x, 1.06x; met in 3 of 3]" in decode
    markdown = report([ours, pure], bandwidths={"probe": 10.0}, out_dir=tmp_path, state_bytes={32: 0})
    assert markdown.startswith("Read bandwidth") and "Rounds: 3 (`--rounds`)" in markdown
    # a ratio just under its target reads under it (rounded down), and one round: no per-round list
    near = llamacpp_target_lines([PeerResult("ort int4", {512: 1000.0}, {}), PeerResult(pure.name, {512: 1499.7}, {})])
    assert "512: 1499.7 / 1000.0 ms = 1.49x (missed)" in near[-1] and "rounds" not in near[-1]
    exact = llamacpp_target_lines([PeerResult("ort int4", {512: 1000.0}, {}), PeerResult(pure.name, {512: 1150.0}, {})])
    assert "= 1.15x (missed)" in exact[-1]  # 1.15 < 1.5, shown as 1.15 (not 1.14 from 114.999...)


def test_peak_memory_by_length_and_the_ik_llama_cpp_targets_at_their_lengths():
    """Agent lengths: the peak memory by length (the largest over the rounds) in its own table, and
    the targets against ik_llama.cpp each read at its own lengths (issue 56 up to 512 tokens, issue 54
    from 8k)."""
    from qwen35_onnx.bench.protocol import merge_rounds
    from qwen35_onnx.bench.report import ik_target_lines, memory_by_length_lines

    lengths = (32, 1024, 8192)
    ours = merge_rounds(
        [
            PeerResult("ort int4", dict.fromkeys(lengths, p), dict.fromkeys(lengths, d), peak_rss_by_length=peaks)
            for p, d, peaks in [(100.0, 10.0, {32: 10**9, 8192: 2 * 10**9}), (100.0, 10.0, {32: 3 * 10**9})]
        ]
    )
    assert ours.peak_rss_by_length == {32: 3 * 10**9, 8192: 2 * 10**9}
    ik = PeerResult("ik_llama.cpp Q4_0 pure", dict.fromkeys(lengths, 110.0), dict.fromkeys(lengths, 11.0))
    ik.peak_rss_by_length = {32: 5 * 10**8, 1024: 6 * 10**8, 8192: 7 * 10**8}
    table = memory_by_length_lines([ours, ik, PeerResult("transformers eager", {32: 1.0}, {32: 1.0})], 33024)
    assert "KV capacity of 33024 tokens" in table[1]
    assert table[3:] == [
        "| peer | 32 | 1024 | 8192 |",
        "|---|---|---|---|",
        "| ort int4 | 3.00 | - | 2.00 |",
        "| ik_llama.cpp Q4_0 pure | 0.50 | 0.60 | 0.70 |",
    ]
    assert memory_by_length_lines([PeerResult("x", {32: 1.0}, {32: 1.0})]) == []
    lines = [line for line in ik_target_lines([ours, ik]) if line.startswith("- ")]
    assert lines == [
        "- decode, ik_llama.cpp Q4_0 pure / ort int4, target >= 1.15x: 32: 11.0 / 10.0 ms = 1.10x (missed)",
        "- prefill, ik_llama.cpp Q4_0 pure / ort int4, target >= 1.2x: 32: 110.0 / 100.0 ms = 1.10x (missed)",
        "- prefill, ik_llama.cpp Q4_0 pure / ort int4, target >= 1.0x: 8192: 110.0 / 100.0 ms = 1.10x (met)",
        "- decode, ik_llama.cpp Q4_0 pure / ort int4, target >= 1.0x: 8192: 11.0 / 10.0 ms = 1.10x (met)",
    ]


def test_bench_pipeline_counts_each_lengths_peak_afresh():
    """Each length's peak memory is its own (the previous length's freed memory handed back, the
    kernel's peak reset), the row's peak the largest, its load before the lengths included."""
    from types import SimpleNamespace

    import pytest

    from qwen35_onnx.bench.memory import reset_peak
    from qwen35_onnx.bench.protocol import Protocol
    from qwen35_onnx.bench.speed import bench_pipeline

    if not reset_peak():
        pytest.skip("the kernel does not let this process reset its peak (/proc/self/clear_refs)")

    class Generation:
        def __init__(self, tokens: int):
            self.tokens = tokens

        def prefill(self):
            held = bytearray(self.tokens * 2**17)  # 128 KiB a token while it runs
            held[::4096] = b"x" * len(held[::4096])
            return np.zeros(8)

        def step(self, token):
            return np.zeros(8)

    backend = SimpleNamespace(shared_weight_bytes=dict, unload_prefill=lambda: None, load_prefill=lambda b: None)
    pipe = SimpleNamespace(
        backend=backend,
        prepare_ids=lambda ids: SimpleNamespace(tokens=ids.shape[1], bucket=None),
        generation=lambda prepared: Generation(prepared.tokens),
        generate_prepared=lambda prepared, max_new_tokens, sampling: SimpleNamespace(token_ids=[1] * max_new_tokens),
    )
    prompts = {n: np.zeros((1, n), np.int64) for n in (512, 32)}  # the longer first: its peak must not stay
    result = bench_pipeline("fake", pipe, prompts, Protocol.with_prefill_runs(1))
    assert set(result.peak_rss_by_length) == {32, 512} and not result.peak_sampled
    assert result.peak_rss_by_length[512] - result.peak_rss_by_length[32] > 40 * 2**20
    assert result.peak_rss_bytes >= result.peak_rss_by_length[512]


def test_int4_product_model_computes_its_codes_times_its_scales():
    # the bandwidth probe's (and benchmarks/int4_kernel_rate.py's) graph: MatMulNBits' layout, unsigned
    # codes around the default zero point 8, low nibble first
    import onnxruntime as ort
    from onnx import numpy_helper

    from qwen35_onnx.bench.protocol import int4_product_model

    k, n, block = 64, 8, 32
    model = int4_product_model(k, n, block_size=block, accuracy_level=1, tokens="M")
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    codes, scales = weights["b"], weights["s"]
    assert codes.shape == (n, k // block, block // 2) and scales.shape == (n, k // block)
    nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, k).astype(np.float32) - 8
    dense = (nibbles * np.repeat(scales, block, axis=1)).T  # [K, N]
    x = np.random.default_rng(1).standard_normal((3, k), dtype=np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"a": x})[0], x @ dense, rtol=1e-4, atol=1e-5)


def test_the_bench_records_what_its_exports_cost(tmp_path: Path):
    """bench.json's ``exports``: the seconds of an export the bench made (noted beside the folder, so a cached export
    keeps them), None where it made none, and the folder's bytes."""
    from qwen35_onnx.bench.speed import export_cost

    folder = tmp_path / "ort-int4"
    (folder / "text").mkdir(parents=True)
    (folder / "text" / "weights.data").write_bytes(b"x" * 1000)
    (folder / "manifest.json").write_text("{}")
    assert export_cost(folder, 2048) == {"export_s": None, "disk_bytes": 1002, "capacity": 2048}
    (tmp_path / "ort-int4.export.json").write_text('{"export_s": 12.5}')
    assert export_cost(folder, 2048)["export_s"] == 12.5


def test_run_info_names_the_program_before_the_arguments():
    """A stored result's ``command``: the CLI's (``qwen35-onnx``) or a benchmark script's path, then the
    arguments shell-quoted."""
    from qwen35_onnx.bench.results import run_info

    assert run_info(["--lengths", "32,512"])["command"] == "qwen35-onnx --lengths 32,512"
    script = run_info(["--out", "a b.json"], program="benchmarks/kv_tiers.py")["command"]
    assert script == "benchmarks/kv_tiers.py --out 'a b.json'"
