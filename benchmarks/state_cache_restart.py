"""A 16k-token agent prefix served twice across a server restart: time to first token cold, then from the kept state
on disk (``serve --state-cache-dir``).

Not part of the test suite. The prefix is what coding agents send first: a long system prompt (rules, project
notes) and tool schemas (``--tools`` functions with described parameters), grown until the rendered prompt holds
``--prefix-tokens`` tokens of the export's own tokenizer and template. Then:

1. ``qwen35-onnx serve --state-cache-dir DIR`` starts (a fresh folder); session 1 asks a question after the prefix,
   streamed, greedy: its time to first token is the cold one (every token prefilled; the server's first request);
2. the server is stopped (SIGTERM: it finishes writing its kept states) and started again on the same folder;
3. session 2 (same system prompt and tools, another question) is the new server's first request: its time to first
   token is the one from disk (the state after the system prompt and tools read back, its question prefilled).

Time to first token: the request sent to its first streamed text (content or reasoning). The result also holds each
request's prompt and cached tokens, the folder's bytes, the restart's stop and start times, and the ratio
``from_disk / cold`` (the acceptance: at most 0.10).

Usage (from the repository root, in the development environment; an export with prefill chunks)::

    nice -n 5 .venv/bin/python benchmarks/state_cache_restart.py --model /tmp/bench/qwen3.5-0.8b/ort-int4-64k \\
        --preset qwen3.5-0.8b --out benchmarks/state_cache/amd-epyc-2c-qwen3.5-0.8b.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import httpx
import openai
from cluster_load import Server, write_result  # (this folder's: `serve` in a subprocess, the result stored)
from transformers import AutoTokenizer

from qwen35_onnx.bench.results import run_info

AREAS = ["parsers", "the build", "the test suite", "migrations", "the HTTP layer", "caching", "logging", "the CLI"]
VERBS = ["read", "search", "edit", "run", "list", "compare", "format", "lint", "inspect", "rename"]


def system_prompt(paragraphs: int) -> str:
    """A coding agent's system prompt of ``paragraphs`` rule paragraphs (deterministic, varied text)."""
    lines = ["You are a coding agent working in the user's repository. Follow these rules exactly."]
    for i in range(paragraphs):
        area, other = AREAS[i % len(AREAS)], AREAS[(3 * i + 1) % len(AREAS)]
        lines.append(
            f"Rule {i + 1}. When a task touches {area}, first read the files that define it and the tests that cover "
            f"it, then explain in one sentence what you will change and why. Never change {other} in the same step "
            f"unless the user asked for it; if a change there is needed, say so and wait. Keep diffs small, run the "
            f"narrowest test that covers the change (case {i * 7 % 97}), and report the command and its result."
        )
    return "\n\n".join(lines)


def tools(count: int) -> list[dict]:
    """``count`` OpenAI tool schemas with described parameters."""
    out = []
    for i in range(count):
        verb, area = VERBS[i % len(VERBS)], AREAS[i % len(AREAS)]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"{verb}_{i}",
                    "description": f"{verb.capitalize()} files that belong to {area}; returns the result as text. "
                    f"Use it before any change to {area}, never for files outside the repository.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string", "description": "A path relative to the repository root."},
                            "pattern": {"type": "string", "description": f"What to look for in {area}."},
                            "limit": {"type": "integer", "description": "Most lines to return (default 200)."},
                        },
                        "required": ["path"],
                    },
                },
            }
        )
    return out


def agent_prefix(model: Path, target: int, n_tools: int) -> tuple[dict, list[dict], int]:
    """The system message and tools whose rendered prompt (with a short question) holds at least ``target`` tokens,
    and that count."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    schemas = tools(n_tools)
    paragraphs = 8
    while True:
        system = {"role": "system", "content": system_prompt(paragraphs)}
        text = tokenizer.apply_chat_template(
            [system, {"role": "user", "content": "Hi."}], tools=schemas, add_generation_prompt=True, tokenize=False
        )
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n >= target:
            return system, schemas, n
        paragraphs = max(paragraphs + 1, min(2 * paragraphs, int(paragraphs * target / n * 1.01)))


def ask(url: str, messages: list[dict], schemas: list[dict]) -> dict:
    """One streamed, greedy request: time to first text and the usage."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    sent = time.monotonic()
    first, usage = None, None
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=schemas,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content or getattr(choice.delta, "reasoning_content", None) or ""
            if piece and first is None:
                first = time.monotonic()
    ended = time.monotonic()
    return {
        "ttft_s": round((first or ended) - sent, 3),
        "total_s": round(ended - sent, 3),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def disk_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("qwen35_onnx_state_cache_disk_") or line.startswith("qwen35_onnx_state_cache_bytes"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("qwen35_onnx_state_cache_")] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an export with prefill chunks")
    parser.add_argument("--preset", default=None, help="the checkpoint's preset name, recorded in the result")
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--tools", type=int, default=24, help="tool schemas in the prefix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/state-cache-restart"))
    parser.add_argument("--out", type=Path, help="write the result (JSON) here")
    args = parser.parse_args()
    system, schemas, prefix_tokens = agent_prefix(args.model, args.prefix_tokens, args.tools)
    print(f"agent prefix: {prefix_tokens} tokens with a short question ({len(schemas)} tools)", flush=True)
    states = args.work_dir / "states"
    shutil.rmtree(states, ignore_errors=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    serve = ["--model", str(args.model), "--threads", str(args.threads), "--state-cache-dir", str(states)]
    sessions = [
        [system, {"role": "user", "content": "List the files that define the CLI and say what each one does."}],
        [system, {"role": "user", "content": "Find where the HTTP layer logs errors and summarise how."}],
    ]
    started = time.monotonic()
    server = Server(serve, args.work_dir / "serve-1.log")
    start_cold = time.monotonic() - started
    try:
        cold = ask(server.url, sessions[0], schemas)
        print(f"cold: {cold}", flush=True)
    finally:
        stopping = time.monotonic()
        server.stop()  # SIGTERM: the kept states are written before it exits
        stop_s = time.monotonic() - stopping
    files = sorted(states.rglob("*.state"))
    started = time.monotonic()
    server = Server(serve, args.work_dir / "serve-2.log")
    start_disk = time.monotonic() - started
    try:
        disk = ask(server.url, sessions[1], schemas)
        metrics = disk_metrics(server.url)
        print(f"from disk: {disk}", flush=True)
    finally:
        server.stop()
    manifest = json.loads((args.model / "manifest.json").read_text())
    ratio = disk["ttft_s"] / cold["ttft_s"]
    result = {
        "run": run_info(program="benchmarks/state_cache_restart.py"),
        "model": str(args.model),
        "preset": args.preset,
        "export": {k: manifest.get(k) for k in ("capacity", "prefill_chunks", "slots", "ops", "quantize")},
        "threads": args.threads,
        "prefix_tokens": prefix_tokens,
        "tools": len(schemas),
        "cold": cold,
        "from_disk": disk,
        "ttft_ratio": round(ratio, 4),
        "acceptance_ttft_ratio_max": 0.10,
        "kept_files": len(files),
        "kept_bytes": sum(f.stat().st_size for f in files),
        "server_stop_s": round(stop_s, 2),
        "server_start_s": {"cold": round(start_cold, 2), "restart": round(start_disk, 2)},
        "metrics_after": metrics,
    }
    print(
        f"TTFT cold {cold['ttft_s']:.2f} s, from disk {disk['ttft_s']:.2f} s: {100 * ratio:.1f} % "
        f"({disk['cached_tokens']} of {disk['prompt_tokens']} tokens from disk; {len(files)} files, "
        f"{result['kept_bytes'] / 2**20:.0f} MiB)",
        flush=True,
    )
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
