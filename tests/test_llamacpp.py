"""The bench's llama.cpp peer (``qwen35_onnx.bench.llamacpp``) without building llama.cpp: the
converter wrapper's pre-tokenizer check, the reading of ``llama-bench`` / ``llama-mtmd-cli`` output
(through stand-in scripts that print what the real tools print), peak memory per process, and the
targets read off the results. The real tools run in ``qwen35-onnx bench`` (``benchmarks/README.md``)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_onnx.bench import llamacpp_convert
from qwen35_onnx.bench.llamacpp import (
    CMAKE_FLAGS,
    IK_LLAMA_CPP,
    LLAMA_CPP,
    LLAMACPP_ROWS,
    LlamaCpp,
    LlamaCppPeer,
    _run_measured,
    bench_llamacpp,
    bench_llamacpp_row,
    gguf_for,
    image_ttft,
)
from qwen35_onnx.bench.protocol import PeerResult, Protocol
from qwen35_onnx.bench.report import llamacpp_target_lines


def _tool(folder: Path, name: str, body: str) -> None:
    """A stand-in for one llama.cpp tool: a Python script named ``name`` in ``folder``."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport sys, json\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_pre_tokenizer_check_accepts_qwen35s_regex_and_names_any_other(checkpoint, tmp_path):
    """The converter's hash check is answered only for a tokenizer whose Split regex is Qwen3.5's."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    assert llamacpp_convert.split_regex(Path(checkpoint)) == PRETOKENIZE_REGEX
    llamacpp_convert.check_pre_tokenizer(Path(checkpoint))  # the demo tokenizer: Qwen3.5's pre-tokenizer

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    for step in spec["pre_tokenizer"]["pretokenizers"]:
        if step["type"] == "Split":
            step["pattern"]["Regex"] = r"\s+|\w+"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match=r"pre-tokenizer regex '\\\\s\+\|\\\\w\+' is not Qwen3.5's") as info:
        llamacpp_convert.check_pre_tokenizer(other)
    assert repr(PRETOKENIZE_REGEX) in str(info.value) and "'qwen35'" in str(info.value)


def test_the_converter_wrapper_refuses_before_running_the_converter(checkpoint, tmp_path):
    """As a script in its own environment: a tokenizer that is not Qwen3.5's stops it with exit
    status 1 and the reason on stderr, and nothing is written."""
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (other / "tokenizer.json").write_text(json.dumps(spec))
    script = Path(llamacpp_convert.__file__)
    request = {"source": str(tmp_path / "no-llama.cpp"), "checkpoint": str(other), "outfile": str(tmp_path / "x.gguf")}
    done = subprocess.run(
        [sys.executable, "-P", str(script)],
        input=json.dumps({**request, "outtype": "bf16"}),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "pre-tokenizer regex None is not Qwen3.5's" in done.stderr
    assert not (tmp_path / "x.gguf").exists()


LLAMA_BENCH = """
args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1] if flag in args else None
open(sys.argv[0] + ".calls", "a").write(" ".join(args[2:]) + "\\n")  # less -m MODEL
tests = []
if value("-pg"):
    assert value("-p") == "0" and value("-n") == "0"  # the end-to-end test alone
    p, n = map(int, value("-pg").split(","))
    tests.append({"n_prompt": p, "n_gen": n, "n_depth": 0, "samples_ns": [2_000_000_000]})
elif value("-gp"):  # ik_llama.cpp: N prefilled tokens, then D timed ones; no n_depth in its output
    assert value("-p") == "0" and value("-n") == "0"
    d, n = map(int, value("-gp").split(","))
    tests.append({"n_prompt": d, "n_gen": n, "samples_ns": [n * 15_000_000, n * 16_000_000, n * 40_000_000]})
elif value("-p") != "0":
    for p in map(int, value("-p").split(",")):
        samples = [p * 3_000_000, p * 2_000_000, p * 9_000_000]
        tests.append({"n_prompt": p, "n_gen": 0, "n_depth": 0, "samples_ns": samples})
else:
    n = int(value("-n"))
    for d in map(int, value("-d").split(",")):
        samples = [n * 15_000_000, n * 16_000_000, n * 40_000_000]
        tests.append({"n_prompt": 0, "n_gen": n, "n_depth": d, "samples_ns": samples})
n_ctx = max(t["n_prompt"] + t["n_gen"] + t.get("n_depth", 0) for t in tests)
buffer = bytearray(30 * 2**20 + n_ctx * 2**17)  # resident memory the parent reads back, growing with the context
buffer[:: 4096] = b"x" * len(buffer[:: 4096])
assert value("-t") == "2" and value("-o") == "json"
print(json.dumps(tests))
"""

MTMD_CLI = """
print("main: loading model", file=sys.stderr)
print("0.05.549.453 I encoding mtmd batch, n_chunks = 1 (done = 1, total = 3)", file=sys.stderr)
print("0.06.391.260 I decoding image batch 1/1, n_tokens_batch = 234", file=sys.stderr)
print("0.07.320.838 I llama_perf_context_print: prompt eval time =    1742.26 ms /   251 tokens (6.94 ms)",
      file=sys.stderr)
assert "--image-max-tokens" in sys.argv and sys.argv[sys.argv.index("--image-max-tokens") + 1] == "256"
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_llama_cpp_build_leaves_its_amx_path_out_on_a_cpu_that_has_amx():
    """llama.cpp compiles its AMX kernels when the compiler defines ``__AMX_INT8__``; the vendored
    version's crash on the first product (llama.cpp#20824) is kept out by the build's C and C++
    flags, which must win over the native ``-march`` of an AMX CPU (Sapphire Rapids here)."""
    for lang, key in (("c", "-DCMAKE_C_FLAGS="), ("c++", "-DCMAKE_CXX_FLAGS=")):
        (flags,) = [f.removeprefix(key).split() for f in CMAKE_FLAGS if f.startswith(key)]
        cmd = ["gcc", "-x", lang, *flags, "-march=sapphirerapids", "-dM", "-E", "-"]
        macros = subprocess.run(cmd, input="", capture_output=True, text=True, check=True).stdout
        assert "__AVX512VNNI__" in macros  # the rest of the native instruction set stays
        assert "__AMX_INT8__" not in macros and "__AMX_TILE__" not in macros and "__AMX_BF16__" not in macros
    baseline = subprocess.run(
        ["gcc", "-march=sapphirerapids", "-dM", "-E", "-"], input="", capture_output=True, text=True, check=True
    ).stdout
    assert "__AMX_INT8__" in baseline  # without the flags that -march would compile them in


@pytest.mark.parametrize("engine", [LLAMA_CPP, IK_LLAMA_CPP], ids=lambda e: e.name)
def test_bench_llamacpp_reads_llama_bench_medians_and_peak_memory_by_length(tmp_path, engine):
    """One llama-bench process per figure and length, decode at a depth as each engine's llama-bench
    spells it (mainline ``-d``, ik_llama.cpp ``-gp``), the row's options on every run."""
    _tool(tmp_path, "llama-bench", LLAMA_BENCH)
    model = tmp_path / "model-Q4_0.gguf"
    model.write_bytes(b"\0" * 1000)
    llama = LlamaCpp(tmp_path, tmp_path, engine)
    result = bench_llamacpp("x", llama, model, (512, 32), Protocol(), threads=2, options=["-rtr", "1"])
    # prefill: the median of the samples (3, 2, 9 ms per token -> 3); decode: each repetition / steps, median
    assert result.prefill_ms == {32: 96.0, 512: 1536.0}
    assert result.decode_ms == {32: 16.0, 512: 16.0}
    assert result.e2e_tokens_per_s == pytest.approx(64.0)  # 128 tokens in 2 s
    assert result.decode_bytes == 1000
    # the stand-in's own resident memory, per process: 128 KiB more per context token
    assert set(result.peak_rss_by_length) == {32, 512}
    assert result.peak_rss_by_length[32] > 30 * 2**20
    assert result.peak_rss_by_length[512] - result.peak_rss_by_length[32] > 50 * 2**20
    assert result.peak_rss_bytes == max(result.peak_rss_by_length.values())
    decode = {
        "llama.cpp": ["-p 0 -n 10 -d 32", "-p 0 -n 10 -d 512"],
        "ik_llama.cpp": ["-p 0 -n 0 -gp 32,10", "-p 0 -n 0 -gp 512,10"],
    }[engine.name]
    assert (tmp_path / "llama-bench.calls").read_text().splitlines() == [
        "-t 2 -o json -p 32 -n 0 -r 5 -rtr 1",
        f"-t 2 -o json {decode[0]} -r 3 -rtr 1",
        "-t 2 -o json -p 512 -n 0 -r 5 -rtr 1",
        f"-t 2 -o json {decode[1]} -r 3 -rtr 1",
        "-t 2 -o json -p 0 -n 0 -pg 32,128 -r 1 -rtr 1",
    ]


def test_a_llama_bench_that_reports_another_length_is_refused(tmp_path):
    """ik_llama.cpp's decode test reports its context as n_prompt (mainline: n_depth): read as the other
    field it would file decode at depth 0; each reading checks the length it asked for."""
    assert IK_LLAMA_CPP.depth_of({"n_prompt": 512, "n_gen": 10}) == 512
    assert LLAMA_CPP.depth_of({"n_prompt": 0, "n_gen": 10, "n_depth": 512}) == 512
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0")
    ik = LlamaCpp(tmp_path, tmp_path, IK_LLAMA_CPP)
    body = 'p = 7 if "-gp" in sys.argv else int(sys.argv[sys.argv.index("-p") + 1]) + {extra}\n'
    body += 'print(json.dumps([{{"n_prompt": p, "n_gen": 10, "samples_ns": [1]}}]))'
    _tool(tmp_path, "llama-bench", body.format(extra=0))
    with pytest.raises(RuntimeError, match="llama-bench decode at 32: it reports a context of 7 tokens"):
        bench_llamacpp("x", ik, model, (32,), Protocol(), threads=2)
    _tool(tmp_path, "llama-bench", body.format(extra=1))
    with pytest.raises(RuntimeError, match="llama-bench -p 32: it reports a prompt of 33 tokens"):
        bench_llamacpp("x", ik, model, (32,), Protocol(), threads=2)
    _tool(tmp_path, "llama-bench", "print(json.dumps([]))")
    with pytest.raises(RuntimeError, match="llama-bench -p 32: 0 tests in its output, expected 1"):
        bench_llamacpp("x", ik, model, (32,), Protocol(), threads=2)


def test_a_tools_peak_memory_is_its_own_not_the_bench_processes(tmp_path):
    """Started straight from a large process, a tool's ru_maxrss is at least that process's peak
    (Linux keeps it across execve); the bench's tools report their own (:mod:`.child_peak`)."""
    _tool(tmp_path, "tool", "buffer = bytearray(20 * 2**20); buffer[::4096] = b'x' * len(buffer[::4096])")
    held = bytearray(400 * 2**20)
    held[::4096] = b"x" * len(held[::4096])  # the bench process's own memory
    _, _, peak = _run_measured([str(tmp_path / "tool")], "tool")
    assert 20 * 2**20 < peak < 200 * 2**20
    del held
    with pytest.raises(FileNotFoundError, match="tool: no program"):
        _run_measured([str(tmp_path / "missing")], "tool")


def test_a_failing_llama_cpp_tool_is_named_with_its_output(tmp_path):
    _tool(tmp_path, "llama-bench", 'print("error: failed to load model", file=sys.stderr); sys.exit(3)')
    with pytest.raises(RuntimeError, match=r"llama-bench failed \(exit 3\): error: failed to load model"):
        bench_llamacpp("x", LlamaCpp(tmp_path, tmp_path), tmp_path / "m.gguf", (32,), Protocol(), threads=2)


def test_a_llama_cpp_tool_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    """A crash (llama.cpp's AMX path segfaulted silently on an AMX CPU) names the signal and says the
    tool printed nothing, instead of an empty tail after 'exit -11'."""
    _tool(tmp_path, "llama-bench", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(RuntimeError, match=r"llama-bench failed \(exit -11, killed by SIGSEGV\): \(no output\)$"):
        bench_llamacpp("x", LlamaCpp(tmp_path, tmp_path), tmp_path / "m.gguf", (32,), Protocol(), threads=2)


def test_image_ttft_reads_the_prompt_evaluation_and_image_tokens(tmp_path):
    _tool(tmp_path, "llama-mtmd-cli", MTMD_CLI)
    llama = LlamaCpp(tmp_path, tmp_path)
    out = image_ttft(llama, tmp_path / "m.gguf", tmp_path / "p.gguf", tmp_path / "photo.png", "What?", 256, runs=2)
    assert out["ttft_ms"] == pytest.approx(1742.26) and out["prompt_tokens"] == 251 and out["image_tokens"] == 234
    # mainline's log thread loses the timings at exit now and then: that run is made again
    lossy = "import pathlib\nruns = pathlib.Path(sys.argv[0] + '.runs')\nruns.write_text(runs.read_text() + 'x' if "
    lossy += "runs.exists() else 'x')\nif len(runs.read_text()) % 2:\n    sys.exit(0)\n" + MTMD_CLI
    _tool(tmp_path, "llama-mtmd-cli", lossy)
    again = image_ttft(llama, tmp_path / "m.gguf", tmp_path / "p.gguf", tmp_path / "photo.png", "What?", 256, runs=2)
    assert again["ttft_ms"] == pytest.approx(1742.26) and (tmp_path / "llama-mtmd-cli.runs").read_text() == "x" * 6
    _tool(tmp_path, "llama-mtmd-cli", 'print("nothing useful", file=sys.stderr)')
    with pytest.raises(RuntimeError, match="printed no image or prompt timings in 3 runs: nothing useful"):
        image_ttft(llama, tmp_path / "m.gguf", tmp_path / "p.gguf", tmp_path / "photo.png", "What?", 256, runs=1)


def test_gguf_for_quantizes_once_and_bf16_is_the_converters_file(tmp_path):
    calls = tmp_path / "calls.txt"
    _tool(
        tmp_path,
        "llama-quantize",
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n'); open(sys.argv[-2], 'wb').write(b'q')",
    )
    llama = LlamaCpp(tmp_path, tmp_path)
    bf16 = tmp_path / "model-BF16.gguf"
    bf16.write_bytes(b"b")
    assert gguf_for("llama.cpp BF16", llama, bf16) == bf16
    pure = gguf_for("llama.cpp Q4_0 pure", llama, bf16)
    assert pure.name == "model-Q4_0-pure.gguf" and pure.read_bytes() == b"q"
    assert gguf_for("llama.cpp Q4_0 pure", llama, bf16) == pure  # cached: llama-quantize ran once
    assert calls.read_text().splitlines() == [f"--pure {bf16} {tmp_path / 'partial-model-Q4_0-pure.gguf'} Q4_0"]


def test_llamacpp_targets_read_ratios_at_every_length():
    ours = PeerResult("ort int4", {32: 100.0, 512: 1000.0}, {32: 15.0, 512: 16.0}, None)
    pure = PeerResult("llama.cpp Q4_0 pure", {32: 120.0, 512: 1600.0}, {32: 16.0, 512: 15.0}, None)
    default = PeerResult("llama.cpp Q4_0", {32: 150.0, 512: 1800.0}, {32: 19.5, 512: 20.0}, None)
    lines = llamacpp_target_lines([ours, pure, default])
    decode_pure, decode_default, prefill = [line for line in lines if line.startswith("- ")]
    assert decode_pure.startswith("- decode, llama.cpp Q4_0 pure / ort int4, target >= 1.0x:")
    assert "32: 16.0 / 15.0 ms = 1.06x (met)" in decode_pure and "512: 15.0 / 16.0 ms = 0.93x (missed)" in decode_pure
    assert (
        "32: 19.5 / 15.0 ms = 1.30x (met)" in decode_default and "512: 20.0 / 16.0 ms = 1.25x (met)" in decode_default
    )
    assert "512: 1600.0 / 1000.0 ms = 1.60x (met)" in prefill and "32: 120.0 / 100.0 ms = 1.20x (missed)" in prefill
    assert llamacpp_target_lines([ours]) == []


IK_MTMD_CLI = """
assert "--perf" not in sys.argv and "-lv" not in sys.argv  # ik_llama.cpp always prints its timings
assert "--log-disable" in sys.argv and "-rtr" in sys.argv
print("encoding image slice...")
print("image slice encoded in 812 ms")
print("decoding image batch 1/1, n_tokens_batch = 234")
print("llama_print_timings: prompt eval time =    1742.26 ms /   251 tokens (    6.94 ms per token)", file=sys.stderr)
"""


def test_an_ik_llama_cpp_row_runs_its_engine_on_the_file_its_quantizer_writes(tmp_path):
    """The row plumbing: ik_llama.cpp's Q4_0 pure row measures the llama.cpp Q4_0 pure row's own file
    (mainline's llama-quantize, run once for both rows) with ik_llama.cpp's tools and ``-rtr``; its
    IQ4_KS row quantizes with ik_llama.cpp's llama-quantize; a build that was not prepared is named."""
    bins = {}
    for name in ("main", "ik"):
        folder = bins[name] = tmp_path / name
        folder.mkdir()
        _tool(folder, "llama-bench", LLAMA_BENCH)
        _tool(
            folder,
            "llama-quantize",
            "open(sys.argv[0] + '.calls', 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
            "open(sys.argv[-2], 'wb').write(b'q')",
        )
    _tool(bins["ik"], "llama-mtmd-cli", IK_MTMD_CLI)
    bf16 = tmp_path / "model-BF16.gguf"
    bf16.write_bytes(b"b")
    ik = LlamaCpp(bins["ik"], bins["ik"], IK_LLAMA_CPP)
    peer = LlamaCppPeer(LlamaCpp(bins["main"], bins["main"]), bf16, tmp_path / "mmproj-F16.gguf", {ik.engine.name: ik})
    image = {"path": tmp_path / "photo.png", "question": "What?", "max_image_tokens": 256}
    protocol = Protocol.with_prefill_runs(1)

    pure = bench_llamacpp_row("ik_llama.cpp Q4_0 pure", peer, (32,), protocol, image, log=lambda m: None)
    assert pure.decode_bytes == 1 and (tmp_path / "model-Q4_0-pure.gguf").is_file()
    assert (bins["main"] / "llama-quantize.calls").read_text().split()[-1] == "Q4_0"
    assert not (bins["main"] / "llama-bench.calls").exists()
    calls = (bins["ik"] / "llama-bench.calls").read_text().splitlines()
    assert len(calls) == 3 and all(c.endswith("-rtr 1") for c in calls)
    assert pure.image["ttft_ms"] == pytest.approx(1742.26) and pure.image["image_tokens"] == 234
    assert bench_llamacpp_row("llama.cpp Q4_0 pure", peer, (32,), protocol, log=lambda m: None).decode_ms
    assert len((bins["main"] / "llama-quantize.calls").read_text().splitlines()) == 1  # one file for both rows
    assert "-rtr" not in (bins["main"] / "llama-bench.calls").read_text()

    for row in ("ik_llama.cpp IQ4_KS pure", "ik_llama.cpp IQ4_KS pure rtr"):  # one file, as stored and repacked
        bench_llamacpp_row(row, peer, (32,), protocol, log=lambda m: None)
    calls = (bins["ik"] / "llama-bench.calls").read_text().splitlines()[3:]
    assert ["-rtr 1" in c for c in calls] == [False] * 3 + [True] * 3
    target = tmp_path / "model-IQ4_KS-pure-ik_llama.cpp.gguf"
    assert (bins["ik"] / "llama-quantize.calls").read_text().split() == [
        "--pure",
        str(bf16),
        str(target.with_name("partial-" + target.name)),
        "IQ4_KS",
    ]
    with pytest.raises(ValueError, match="quantized by ik_llama.cpp's llama-quantize, not llama.cpp's"):
        gguf_for("ik_llama.cpp IQ4_KS pure", peer.llama, bf16)
    alone = LlamaCppPeer(peer.llama, bf16, peer.mmproj)
    with pytest.raises(RuntimeError, match="ik_llama.cpp was not built for this bench"):
        bench_llamacpp_row("ik_llama.cpp Q4_0 pure", alone, (32,), protocol, log=lambda m: None)
    assert {spec.engine.name for spec in LLAMACPP_ROWS.values()} == {"llama.cpp", "ik_llama.cpp"}
