"""One ``serve`` against ``serve --replicas 2`` (conversation routing, then round-robin) under the same
chat load: aggregate throughput, time to first token, and how often a resent conversation found its
kept state.

Not part of the test suite (each configuration loads the export and runs every conversation). The
load: ``--clients`` OpenAI clients at once, each holding a ``--turns``-turn conversation of its own
(no shared system prompt, so only a conversation's own state can be found), streamed, greedy,
``--max-tokens`` tokens a reply plus 8 x (client mod 4), so the clients drift apart (with replies of
one length they would arrive in lock-step, and round-robin would send each conversation to the same
replica every turn when the client count is even, to the other one every turn when it is odd).
Per configuration: completion tokens per second over the whole run (first request sent to last
reply ended), median and p95 time to first token (request sent to the
first streamed text), and over the turns after the first: the share that reported
``cached_tokens`` > 0 (the "hit rate": with round-robin a conversation soon has states on both
replicas, so most of its turns find some), the share the router sent to the replica holding the
longest prefix of their messages (the "home rate", from ``qwen35_onnx_cluster_routes_total``),
cached tokens / prompt tokens, and the tokens prefilled.

Configurations, on the machine's CPUs: ``single`` (one process, ``--threads`` = all CPUs),
``replicas-conversation`` and ``replicas-round-robin`` (``--replicas 2``, half the CPUs each).

Usage (from the repository root, in the development environment; the export needs prefill chunks)::

    .venv/bin/python benchmarks/cluster_load.py --model /tmp/bench/qwen3.5-0.8b/ort-int4 \\
        --out benchmarks/cluster/amd-epyc-2c-qwen3.5-0.8b.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from qwen35_onnx.bench.results import run_info
from qwen35_onnx.runtime.backend import usable_cpus

TOPICS = ["rivers", "castles", "comets", "orchards", "glaciers", "lighthouses", "deserts", "violins"]


class Server:
    """``qwen35-onnx serve`` in a subprocess (``env``: its environment), on a free port, until :meth:`stop`."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qwen35_onnx.cli", "serve", "--port", "0", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 600
        while not (found := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.url = found.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def write_result(path: Path, result: dict) -> None:
    """Store a benchmark's ``result`` as JSON at ``path`` (folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def conversation(url: str, client_id: int, turns: int, max_tokens: int, out: list) -> None:
    """One client's conversation; appends a record per turn to ``out``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    max_tokens += 8 * (client_id % 4)
    topic = TOPICS[client_id % len(TOPICS)]
    messages = [
        {
            "role": "user",
            "content": f"Client {client_id} here. Tell me about {topic}: where they are found, how they "
            "change over a year, and one thing people often get wrong about them.",
        }
    ]
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": f"Go on about {topic}, point {turn + 1}, in more detail."})
        sent = time.monotonic()
        first, text, usage = None, "", None
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                piece = choice.delta.content or getattr(choice.delta, "reasoning_content", None) or ""
                if piece and first is None:
                    first = time.monotonic()
                text += choice.delta.content or ""
        ended = time.monotonic()
        out.append(
            {
                "client": client_id,
                "turn": turn + 1,
                "sent": sent,
                "ttft_s": (first or ended) - sent,
                "ended": ended,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            }
        )
        messages.append({"role": "assistant", "content": text})


def run_load(url: str, clients: int, turns: int, max_tokens: int, first_client: int = 0) -> dict:
    records: list[dict] = []
    workers = [
        threading.Thread(target=conversation, args=(url, first_client + i, turns, max_tokens, records))
        for i in range(clients)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if len(records) != clients * turns:
        raise RuntimeError(f"{clients * turns - len(records)} requests failed (see the server log)")
    start = min(r["sent"] for r in records)
    wall = max(r["ended"] for r in records) - start
    ttft = sorted(r["ttft_s"] for r in records)
    later = [r for r in records if r["turn"] > 1]
    return {
        "requests": len(records),
        "wall_s": round(wall, 2),
        "completion_tokens": sum(r["completion_tokens"] for r in records),
        "throughput_tok_s": round(sum(r["completion_tokens"] for r in records) / wall, 2),
        "ttft_median_s": round(statistics.median(ttft), 3),
        "ttft_p95_s": round(ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))], 3),
        "hit_rate": round(sum(r["cached_tokens"] > 0 for r in later) / len(later), 3) if later else None,
        "cached_share": (
            round(sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later), 3) if later else None
        ),
        "prefilled_tokens_later_turns": sum(r["prompt_tokens"] - r["cached_tokens"] for r in later),
        "records": [{k: v for k, v in r.items() if k not in ("sent", "ended")} for r in records],
    }


def routes(url: str) -> dict[str, float]:
    """The router's decisions so far (``qwen35_onnx_cluster_routes_total``; empty for one process)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'cluster_routes_total\{decision="(\w+)"\} (\S+)', text)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an export with prefill chunks")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the result (JSON) here")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cluster-load"))
    args = parser.parse_args()
    cpus = usable_cpus()
    if cpus < 2:
        raise SystemExit(f"2 replicas need at least 2 CPUs, this machine has {cpus}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    configs = {
        "single": ["--threads", str(cpus)],
        "replicas-conversation": ["--replicas", "2", "--threads", str(cpus // 2), "--routing", "conversation"],
        "replicas-round-robin": ["--replicas", "2", "--threads", str(cpus // 2), "--routing", "round-robin"],
    }
    results = {}
    for name, extra in configs.items():
        log = args.work_dir / f"{name}.log"
        server = Server(["--model", str(args.model), "--max-queue", str(args.clients), *extra], log)
        try:
            run_load(server.url, 2, 1, 4, first_client=100)  # warm-up (both replicas): first runs of every graph
            before = routes(server.url)
            started = time.monotonic()
            results[name] = {"args": extra, **run_load(server.url, args.clients, args.turns, args.max_tokens)}
            r = results[name]
            after = routes(server.url)
            r["routes"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            sent = r["routes"].get("home", 0.0) + r["routes"].get("away", 0.0)
            r["home_rate"] = round(r["routes"].get("home", 0.0) / sent, 3) if sent else None
            print(
                f"{name:24s} {r['throughput_tok_s']:7.2f} tok/s  TTFT median {r['ttft_median_s']:.2f} s p95 "
                f"{r['ttft_p95_s']:.2f} s  hit rate {r['hit_rate']:.2f}  home rate {r['home_rate']}  cached share "
                f"{r['cached_share']:.2f}  prefilled {r['prefilled_tokens_later_turns']}  "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
        finally:
            server.stop()
    manifest = json.loads((args.model / "manifest.json").read_text())
    single = results["single"]
    for r in results.values():
        r["throughput_x_single"] = round(r["throughput_tok_s"] / single["throughput_tok_s"], 3)
        r["ttft_p95_x_single"] = round(r["ttft_p95_s"] / single["ttft_p95_s"], 3)
    result = {
        "run": run_info(program="benchmarks/cluster_load.py"),
        "model": str(args.model),
        "export": {k: manifest.get(k) for k in ("capacity", "prefill_chunks", "slots", "ops", "quantize")},
        "load": {"clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens, "cpus": cpus},
        "results": results,
    }
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
