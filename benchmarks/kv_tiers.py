"""KV width tiers (``export --kv-tiers``) against one width: decode ms/token of a portable export on OpenVINO at a
few depths, with the default tiers and with ``--kv-tiers none`` (every step at the capacity).

Not part of the test suite (it needs two exports of a large preset). For each export in ``--exports`` (a label and
a folder, exported from the same checkpoint with the same options but ``--kv-tiers``) and each depth in
``--depths``, in a process of its own (its Pss its own): a generation holding ``depth`` tokens at the KV tier that
holds them (the width a chunked prefill of that many tokens leaves), its states zeros (a decode step's cost does
not depend on the values it reads: no operator of the portable decode graph branches on them), then
``--warmup`` decode steps (the first one may move the generation up a tier: the tier that holds ``depth + 1``
tokens) and ``--steps`` timed ones; the median step time, the width the timed steps ran at, and the process's Pss
after them. ``--rounds N`` measures the exports N times in turn (A B A B), each figure the median over the rounds,
so a slow spell of a shared machine lands on both.

Usage (from the repository root, in the development environment)::

    qwen35-onnx export --model-id CKPT --output-dir /tmp/b/tiers --ops portable --quantize int4
    qwen35-onnx export --model-id CKPT --output-dir /tmp/b/one --ops portable --quantize int4 --kv-tiers none
    nice -n 5 .venv/bin/python benchmarks/kv_tiers.py --exports tiers=/tmp/b/tiers,one-width=/tmp/b/one \\
        --preset qwen3.5-0.8b --depths 512,8192 --rounds 2 --out benchmarks/kv_tiers/amd-epyc-2c-qwen3.5-0.8b.json

Writes the result (run info, the exports' contracts, per export and depth the step times) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qwen35_onnx.bench.results import run_info
from qwen35_onnx.contract import read_manifest


def pss_bytes() -> int:
    """This process's proportional set size (bytes)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(export: Path, depths: list[int], steps: int, warmup: int, threads: int) -> dict:
    """Decode step times of ``export`` on OpenVINO at each of ``depths`` (see the module docstring)."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.generation import Generation

    begin = time.perf_counter()
    pipe = Pipeline.from_exported(export, runtime="openvino", threads=threads)
    load_s = time.perf_counter() - begin
    contract, backend = pipe.contract, pipe.backend
    specials = set(pipe.preprocessor.tokenizer.all_special_ids) | {contract.image_token_id}
    ordinary = np.array([t for t in range(contract.vocab_size) if t not in specials])
    rows = []
    for depth in depths:
        ids = np.random.default_rng(depth).choice(ordinary, size=(1, depth))
        prepared = pipe.prepare_ids(ids)
        start_width = contract.tier_for(depth)
        generation = Generation(backend, prepared, states=backend.zero_states(start_width))
        token, times = int(ids[0, -1]), []
        for i in range(warmup + steps):
            began = time.perf_counter()
            logits = generation.step(token)
            elapsed = time.perf_counter() - began
            token = int(np.argmax(logits))
            if i >= warmup:
                times.append(1000 * elapsed)
        rows.append(
            {
                "depth": depth,
                "start_width": start_width,
                "width": generation.width,
                "tier_moves": generation.tier_moves,
                "step_ms": times,
                "median_ms": statistics.median(times),
                "pss_bytes": pss_bytes(),
            }
        )
        del generation
    return {"load_s": load_s, "depths": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exports", required=True, help="label=folder,label=folder")
    parser.add_argument("--preset", default="qwen3.5-0.8b", help="the checkpoint the exports were made from")
    parser.add_argument("--depths", default="512,8192")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # (a measuring subprocess)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if args.one:
        print(json.dumps(measure(args.one, depths, args.steps, args.warmup, args.threads)))
        return
    exports = dict(item.split("=", 1) for item in args.exports.split(","))
    runs: dict[str, list[dict]] = {label: [] for label in exports}
    for round_ in range(args.rounds):
        for label, folder in exports.items():
            command = [sys.executable, __file__, "--one", folder, "--exports", args.exports, "--depths", args.depths]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            medians = [row["median_ms"] for row in runs[label][-1]["depths"]]
            print(f"round {round_ + 1} {label}: " + ", ".join(f"{d}: {m:.1f} ms" for d, m in zip(depths, medians)))
    result = {
        "run": run_info(program="benchmarks/kv_tiers.py"),
        "preset": args.preset,
        "runtime": "openvino",
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "exports": {},
    }
    for label, folder in exports.items():
        contract = read_manifest(Path(folder))
        rows = []
        for i, depth in enumerate(depths):
            per_round = [r["depths"][i] for r in runs[label]]
            rows.append(
                {
                    "depth": depth,
                    "width": per_round[0]["width"],
                    "start_width": per_round[0]["start_width"],
                    "median_ms": statistics.median(r["median_ms"] for r in per_round),
                    "round_medians_ms": [r["median_ms"] for r in per_round],
                    "pss_bytes": max(r["pss_bytes"] for r in per_round),
                }
            )
        result["exports"][label] = {
            "folder": folder,
            "capacity": contract.capacity,
            "kv_tiers": list(contract.kv_tiers),
            "ops": str(contract.ops),
            "quantize": str(contract.quantize),
            "kv_dtype": str(contract.kv_precision),
            "prefill_chunks": list(contract.prefill_chunks),
            "load_s": [r["load_s"] for r in runs[label]],
            "depths": rows,
        }
    labels = list(exports)
    if len(labels) == 2:
        a, b = (result["exports"][label]["depths"] for label in labels)
        result["ratio"] = {
            f"{labels[1]} / {labels[0]}": {str(x["depth"]): y["median_ms"] / x["median_ms"] for x, y in zip(a, b)}
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
