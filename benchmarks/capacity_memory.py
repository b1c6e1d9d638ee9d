"""What a capacity costs in memory: the default 65,536-token export against a 2,048-token one, and against
llama.cpp's server with the same context (issue 54's memory acceptance).

Not part of the test suite (it exports the preset several times and prefills 8,192 tokens). Each measurement
runs in a process of its own (``--measure``), so that one's memory is not another's:

- ``load``: Pss (``/proc/self/smaps_rollup``; the pre-packed weights are a shared file mapping, so Pss, not
  RSS, is this process's share) after ``Pipeline.from_exported`` and after a 32-token greedy reply to a short
  prompt;
- ``8k``: the same after a prompt of 8,192 random ordinary tokens and 32 decode steps, and the process's peak
  (``VmHWM``);
- ``slots``: an export of 4 decode slots, four short requests decoding together (``Pipeline.group``), Pss
  after;
- llama.cpp: ``llama-server -c 65536`` (f16 KV, as it allocates its cache at load) answering one 8,192-token
  prompt with 32 tokens; its peak resident memory (``VmHWM`` of the server process).

Exports (``--quantize int4`` of the preset, under ``--work-dir``, built once): ``2k-fp32kv`` (capacity 2,048 and
an fp32 cache: 0.14.0's default), ``2k`` (capacity 2,048, this version's KV default), ``64k`` (the default
capacity), ``64k-4slots`` (the same with ``--slots 4``).

Usage (from the repository root; llama.cpp built by the bench: ``--llama-server`` and ``--gguf`` point at its
build and the Q4_0 pure file the bench converted)::

    .venv/bin/python benchmarks/capacity_memory.py --preset qwen3.5-0.8b \\
        --llama-server benchmarks/out/.llama.cpp/build/bin/llama-server \\
        --gguf benchmarks/out/qwen3.5-0.8b/llama.cpp/model-Q4_0-pure.gguf

Writes ``benchmarks/capacity/MACHINE-PRESET.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

EXPORTS = {
    "2k-fp32kv": dict(capacity=2048, kv_dtype="fp32"),
    "2k": dict(capacity=2048),
    "64k": dict(),
    "64k-4slots": dict(slots=4),
}
LONG = 8192


def status(field: str) -> int:
    """A ``/proc/self/status`` or ``smaps_rollup`` field in bytes."""
    source = "/proc/self/smaps_rollup" if field == "Pss" else "/proc/self/status"
    for line in Path(source).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(export: Path, what: str) -> dict:
    """One measurement in this process (see the module docstring)."""
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(export)
    out = {"after_load": status("Pss")}
    # ordinary text tokens: no special token, no image or video placeholder (ids 1000-1010 of the demo vocabulary)
    specials = set(pipe.preprocessor.tokenizer.all_special_ids) | set(range(1000, 1011))
    pool = np.array([t for t in range(2000) if t not in specials])
    if what == "slots":
        from qwen35_onnx.runtime.sampling import SamplingConfig

        group = pipe.group()
        for i in range(4):
            pipe.stream_prepared(
                pipe.prepare(None, f"Question {i}: what is {i} + {i}?"), 32, SamplingConfig(), group=group
            )
        group.run()
        out["after_four_streams"] = status("Pss")
    else:
        pipe.generate(None, "Hello, who are you?", max_new_tokens=32)
        out["after_short_reply"] = status("Pss")
        if what == "8k":
            ids = np.random.default_rng(0).choice(pool, size=(1, LONG))
            generation = pipe.generation(pipe.prepare_ids(ids))
            token = int(np.argmax(generation.prefill()))
            for _ in range(32):
                token = int(np.argmax(generation.step(token)))
            out["after_8k_prompt"] = status("Pss")
    out["peak_rss"] = status("VmHWM")
    return out


def llama_server_peak(server: Path, gguf: Path, context: int, threads: int = 2) -> dict:
    """``llama-server -c context`` answering one prompt of :data:`LONG` tokens: its ``VmHWM`` (bytes)."""
    port = 8765
    proc = subprocess.Popen(
        [str(server), "-m", str(gguf), "-c", str(context), "-t", str(threads), "--port", str(port), "-np", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        after_load = _vm(proc.pid, "VmRSS")
        prompt = list(np.random.default_rng(0).integers(100, 2000, size=LONG).tolist())
        body = json.dumps({"prompt": prompt, "n_predict": 32, "cache_prompt": False}).encode()
        request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=3600).read()
        return {"after_load_rss": after_load, "peak_rss": _vm(proc.pid, "VmHWM"), "context": context}
    finally:
        proc.terminate()
        proc.wait(30)


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmarks" / "out" / "capacity")
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--measure", nargs=2, metavar=("EXPORT", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return
    from qwen35_onnx.bench.results import machine_slug, run_info
    from qwen35_onnx.checkpoints import build_demo_checkpoint
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportOptions

    args.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build_demo_checkpoint(args.work_dir / args.preset, preset=args.preset)
    run = run_info(program="benchmarks/capacity_memory.py")
    result = {"run": run, "preset": args.preset, "exports": {}, "measures": {}}
    for name, options in EXPORTS.items():
        out = args.work_dir / f"{args.preset}-int4-{name}"
        if not (out / "manifest.json").is_file():
            export(checkpoint, out, ExportOptions(quantize="int4", overwrite=True, **options))
        contract = json.loads((out / "manifest.json").read_text())
        result["exports"][name] = {k: contract.get(k) for k in ("capacity", "slots", "kv_dtype", "quantize", "ops")}
        wanted = {"2k-fp32kv": ["load"], "2k": ["load"], "64k": ["load", "8k"], "64k-4slots": ["slots"]}[name]
        for what in wanted:
            command = [sys.executable, __file__, "--measure", str(out), what]
            line = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            result["measures"][f"{name} {what}"] = json.loads(line)
            print(name, what, result["measures"][f"{name} {what}"], flush=True)
    if args.llama_server and args.gguf:
        result["llama.cpp"] = llama_server_peak(args.llama_server, args.gguf, 65536)
        print("llama.cpp", result["llama.cpp"], flush=True)
    path = ROOT / "benchmarks" / "capacity" / f"{machine_slug(result['run'])}-{args.preset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"stored {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
