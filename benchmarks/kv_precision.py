"""The KV cache's precision (``--kv-dtype``): agreement with an fp32 cache, and speed and memory at agent depths.

Not part of the test suite (it exports the 0.8B preset once per precision and prefills tens of thousands of
tokens). For each precision in ``--kv-dtypes``, an ``--ops ort --quantize int4`` export of the same checkpoint
(the default capacity) is measured on:

- agreement: a long prompt (``--agreement-tokens`` of the tokenizer corpus), then ``--forced`` tokens that the
  fp32-cache export chose greedily are fed to each export (teacher forcing through the product's generation
  object, tests/conftest.py's ``forced_logits``); a position agrees when the export's argmax is fp32's;
- speed: time to first token of a prompt of each ``--lengths`` (random ordinary tokens, the bench's), and the
  decode ms/token at that depth (median of 10 steps after 3);
- memory: the process's Pss after each length (``/proc/self/smaps_rollup``); the precisions run one after the
  other in one process, so a later precision's Pss includes what the earlier ones left mapped (only the first
  precision's is a figure of its own: ``benchmarks/capacity_memory.py`` measures memory one process each).

The trained test checkpoint (``--checkpoint trained``: the demo checkpoint after 200 training steps,
tests/training.py) answers "same greedy tokens over a long prompt": its greedy reply to the long prompt with each
cache against fp32's.

Usage (from the repository root, in the development environment)::

    .venv/bin/python benchmarks/kv_precision.py --checkpoint qwen3.5-0.8b --lengths 1024,8192,32768
    .venv/bin/python benchmarks/kv_precision.py --checkpoint trained --lengths 1024

Writes ``benchmarks/kv_precision/MACHINE-CHECKPOINT.json`` (run info, per precision: agreement, time to first
token and decode ms/token per length, Pss).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' training and teacher-forcing helpers

from tests.conftest import forced_logits  # noqa: E402
from tests.training import train_checkpoint  # noqa: E402

from qwen35_onnx.bench.results import machine_slug, run_info  # noqa: E402
from qwen35_onnx.checkpoints import build_demo_checkpoint, tokenizer_corpus  # noqa: E402
from qwen35_onnx.export.exporter import export  # noqa: E402
from qwen35_onnx.export.options import ExportOptions  # noqa: E402
from qwen35_onnx.pipeline import Pipeline  # noqa: E402


def pss_bytes() -> int:
    """This process's proportional set size (bytes)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def checkpoint_at(name: str, work: Path) -> Path:
    """The checkpoint ``name`` (a preset, or ``trained``), built once under ``work``."""
    if name == "trained":
        demo = build_demo_checkpoint(work / "demo")
        trained = work / "trained"
        return trained if trained.is_dir() else train_checkpoint(demo, trained, steps=200)
    return build_demo_checkpoint(work / name, preset=name)


def exported(checkpoint: Path, work: Path, kv_dtype: str, capacity: int | None) -> Path:
    """The ``--ops ort --quantize int4`` export of ``checkpoint`` with ``--kv-dtype kv_dtype`` (built once)."""
    out = work / f"{checkpoint.name}-int4-kv-{kv_dtype}"
    if not (out / "manifest.json").is_file():
        options = dict(quantize="int4", kv_dtype=kv_dtype, overwrite=True)
        if capacity:
            options["capacity"] = capacity
        export(checkpoint, out, ExportOptions(**options))
    return out


def long_prompt(pipe: Pipeline, tokens: int) -> np.ndarray:
    """``[1, tokens]`` ids of the tokenizer corpus (real text: the agreement prompt)."""
    ids = pipe.preprocessor.tokenizer("\n".join(tokenizer_corpus()))["input_ids"]
    if len(ids) < tokens:
        ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return np.asarray([ids[:tokens]], dtype=np.int64)


def random_prompt(pipe: Pipeline, tokens: int, seed: int) -> np.ndarray:
    """``[1, tokens]`` random ordinary token ids (the bench's prompts)."""
    specials = set(pipe.preprocessor.tokenizer.all_special_ids) | {pipe.contract.image_token_id}
    pool = np.array([t for t in range(min(pipe.contract.vocab_size, 200_000)) if t not in specials])
    return np.random.default_rng(seed).choice(pool, size=(1, tokens))


def speed(pipe: Pipeline, lengths: list[int]) -> dict[str, dict]:
    """Time to first token (ms), decode ms/token at that depth and Pss (bytes) after it, per prompt length."""
    rows = {}
    for n in lengths:
        prepared = pipe.prepare_ids(random_prompt(pipe, n, seed=n))
        generation = pipe.generation(prepared)
        start = time.perf_counter()
        token = int(np.argmax(generation.prefill()))
        ttft = 1000 * (time.perf_counter() - start)
        times = []
        for i in range(13):
            start = time.perf_counter()
            token = int(np.argmax(generation.step(token)))
            if i >= 3:
                times.append(1000 * (time.perf_counter() - start))
        rows[str(n)] = {"ttft_ms": round(ttft, 1), "decode_ms": round(float(np.median(times)), 2), "pss": pss_bytes()}
        print(f"  {n} tokens: first token {ttft:.0f} ms, decode {np.median(times):.2f} ms/token", flush=True)
        generation.close()
        del generation
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="qwen3.5-0.8b", help="a preset (qwen3.5-0.8b ...) or 'trained'")
    parser.add_argument("--kv-dtypes", default="fp32,fp16,int8")
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--agreement-tokens", type=int, default=2048)
    parser.add_argument("--forced", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=None, help="the exports' capacity (default: the default)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmarks" / "out" / "kv-precision")
    args = parser.parse_args()
    dtypes = args.kv_dtypes.split(",")
    if dtypes[0] != "fp32":
        dtypes.insert(0, "fp32")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = checkpoint_at(args.checkpoint, args.work_dir)
    result = {"run": run_info(program="benchmarks/kv_precision.py"), "checkpoint": args.checkpoint, "precisions": {}}
    reference_tokens = None
    for dtype in dtypes:
        print(f"--kv-dtype {dtype}", flush=True)
        pipe = Pipeline.from_exported(exported(checkpoint, args.work_dir, dtype, args.capacity))
        prompt = pipe.prepare_ids(long_prompt(pipe, args.agreement_tokens))
        if reference_tokens is None:  # fp32: the greedy reply every other precision is forced along
            generation = pipe.generation(prompt)
            token = int(np.argmax(generation.prefill()))
            reference_tokens = [token]
            for _ in range(args.forced - 1):
                token = int(np.argmax(generation.step(token)))
                reference_tokens.append(token)
            generation.close()
        logits = forced_logits(pipe, prompt, reference_tokens)
        chosen = [int(np.argmax(row)) for row in logits]
        agree = float(np.mean([a == b for a, b in zip(chosen, reference_tokens)]))
        first = next((i for i, (a, b) in enumerate(zip(chosen, reference_tokens)) if a != b), len(chosen))
        print(f"  agreement with fp32 over {args.forced} forced tokens: {agree:.4f} (first {first} equal)", flush=True)
        result["precisions"][dtype] = {
            "agreement": round(agree, 4),
            "first_equal": first,
            "speed": speed(pipe, lengths),
        }
        del pipe
    out = ROOT / "benchmarks" / "kv_precision" / f"{machine_slug(result['run'])}-{args.checkpoint}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"stored {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
