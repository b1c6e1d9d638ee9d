"""Several streams at once: the export's decode slots against one stream, and our server against llama.cpp's
``llama-server --parallel`` under the same client load (``qwen35-onnx bench --streams 1,2,4,8``).

Two measurements, both greedy, fixed prompts of about :data:`PROMPT_WORDS` words, every stream asking for the
same ``max_tokens``:

1. **Slots, in process** (:func:`group_load`): N generations started at once in a
   :class:`~qwen35_onnx.group.GenerationGroup` on an export with ``--slots`` >= N, the group's rounds run to the
   end. Every token is stamped when the round that made it ends. Reported per N: aggregate decode tokens/s
   while all N decode (no prefill in that window, as ``llama-batched-bench`` times its generation phase) and
   over the whole run (the tokens after each stream's first, from the first stream's first token to the last
   token: the newcomers' prefill runs included), p50/p95 inter-token latency (every gap between two tokens of
   one stream), p50 time to first token. The bytes a decode step copies between slot buffers are 0 by
   construction (the states stay in their slots); the bytes copied when a sequence joins its slot are
   reported. Then the decode step's own cost at each N rows
   (:func:`step_scaling`): the most a load of N streams can gain on this machine.
2. **Servers, over HTTP** (:func:`http_load`, :func:`arrival_ttft`): ``qwen35-onnx serve`` on that export and
   ``llama-server --parallel P`` on the GGUF of the bench's ``llama.cpp Q4_0 pure`` row, the same threads, each
   driven by the official ``openai`` client: P concurrent requests (aggregate tokens/s: the completion tokens
   each server counts, over the wall time), then the time to first token of requests that arrive while P - 1
   others run (one-token requests: their latency; the p95 of :data:`ARRIVALS` of them).

Source of the protocol: vLLM's ``benchmark_serving`` (concurrent requests, TTFT and ITL percentiles) and
llama.cpp's server bench (``--parallel`` slots).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "ARRIVALS",
    "LoadResult",
    "arrival_ttft",
    "group_load",
    "http_load",
    "report_lines",
    "run_streams",
    "serve_llama",
    "serve_ours",
    "step_scaling",
]

PROMPT_WORDS = 24
"""Words of each stream's prompt (about 30-40 tokens with the chat template)."""
ARRIVALS = 8
"""Requests that arrive, one after another, while the other slots' streams run (:func:`arrival_ttft`)."""
TOPICS = ("rivers", "stars", "bridges", "forests", "cities", "oceans", "mountains", "deserts", "trains", "gardens")


def prompts(count: int) -> list[str]:
    """``count`` distinct prompts of :data:`PROMPT_WORDS` words (deterministic)."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        words = f"Please write a long and detailed essay about {topic} number {i} covering".split()
        filler = "history science culture and the future of".split()
        while len(words) < PROMPT_WORDS:
            words.append(filler[len(words) % len(filler)])
        out.append(" ".join(words[:PROMPT_WORDS]) + ".")
    return out


@dataclass
class LoadResult:
    """One load: ``streams`` concurrent generations of ``max_tokens``; times in milliseconds."""

    streams: int
    tokens: int
    wall_ms: float
    decode_tokens_per_s: float
    itl_p50_ms: float
    itl_p95_ms: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(streams: int, start: float, stamps: list[list[float]], extra: dict | None = None) -> LoadResult:
    """A :class:`LoadResult` from each stream's token (or chunk) times ``stamps`` (seconds, ``time.perf_counter``)
    after ``start``; ``extra["all_decoding_tokens_per_s"]``: the tokens per second while every stream decodes
    (from the last stream's first token to the first stream's last: no prefill in it, as llama.cpp's
    ``llama-batched-bench`` times its text-generation phase)."""
    stamps = [s for s in stamps if s]
    tokens = sum(len(s) for s in stamps)
    first = min(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    gaps = np.concatenate([np.diff(s) for s in stamps if len(s) > 1] or [np.zeros(0)]) * 1000
    ttft = np.array([s[0] - start for s in stamps]) * 1000
    decoded = tokens - len(stamps)
    rate = decoded / (last - first) if last > first else 0.0
    # every stream decoding: from the last stream's first token to the first stream's last one
    begin, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    window = sum(int(np.count_nonzero((np.array(s) > begin) & (np.array(s) <= end))) for s in stamps)
    extra = {**(extra or {}), "all_decoding_tokens_per_s": window / (end - begin) if end > begin else 0.0}
    return LoadResult(
        streams,
        tokens,
        1000 * (last - start),
        rate,
        float(np.percentile(gaps, 50)) if gaps.size else 0.0,
        float(np.percentile(gaps, 95)) if gaps.size else 0.0,
        float(np.percentile(ttft, 50)),
        float(np.percentile(ttft, 95)),
        extra,
    )


def group_load(pipe, streams: int, max_tokens: int) -> LoadResult:
    """``streams`` generations of ``max_tokens`` greedy tokens started at once in a group of ``pipe`` (an export
    with at least that many slots), run round by round; see the module docstring.

    Raises:
        ValueError: more streams than the export's slots.
    """
    from ..runtime.sampling import SamplingConfig

    if streams > pipe.contract.slots:
        slots = pipe.contract.slots
        raise ValueError(f"{streams} streams need an export with --slots {streams} or more (it has {slots})")
    group = pipe.group()
    pool = group.pool
    copied, steps, rows = pool.bytes_copied, pool.steps, pool.rows_stepped
    no_thinking = {"enable_thinking": False}
    prepared = [pipe.prepare_chat([{"role": "user", "content": p}], no_thinking) for p in prompts(streams)]
    start = time.perf_counter()
    runs = [pipe.stream_prepared(p, max_tokens, SamplingConfig(), group=group) for p in prepared]
    stamps: list[list[float]] = [[] for _ in runs]
    while group.members:
        group.step()
        now = time.perf_counter()
        for stamp, run in zip(stamps, runs):
            stamp.extend([now] * (len(run.result.token_ids) - len(stamp)))
    extra = {
        "decode_steps": pool.steps - steps,
        "mean_rows": (pool.rows_stepped - rows) / max(1, pool.steps - steps),
        "bytes_copied_per_step": 0,
        "bytes_copied_per_join": (pool.bytes_copied - copied) / streams,
    }
    return summarize(streams, start, stamps, extra)


def step_scaling(pipe, counts: list[int], steps: int = 24) -> list[dict]:
    """The decode step's own cost at 1 row and each of ``counts`` rows: that many sequences of one short prompt
    held in the slots of ``pipe``, ``steps`` decode steps of them all (after 4 to warm up), timed step by step.
    ``[{"rows", "step_ms" (median), "x_1_row", "ideal_speedup"}]`` (``x_1_row``: against the 1-row step;
    ``ideal_speedup``: rows over that, the most a load of that many streams can gain in decode tokens/s).

    Raises:
        ValueError: a count above the export's slots.
    """
    from ..runtime.generation import Generation

    if max(counts) > pipe.contract.slots:
        raise ValueError(f"{max(counts)} rows need an export with --slots {max(counts)} or more")
    pool = pipe.slot_pool
    prepared = pipe.prepare(None, prompts(1)[0])
    out = []
    for rows in sorted({1, *counts}):
        generations = []
        try:
            for _ in range(rows):
                generations.append(Generation(pipe.backend, prepared, pool=pool))
                generations[-1].prefill()
            times = []
            for i in range(steps + 4):
                begin = time.perf_counter()
                pool.step([(g, 5) for g in generations])
                if i >= 4:
                    times.append(1000 * (time.perf_counter() - begin))
        finally:
            for g in generations:
                g.close()
        out.append({"rows": rows, "step_ms": float(np.median(times))})
    for r in out:
        r["x_1_row"] = r["step_ms"] / out[0]["step_ms"]
        r["ideal_speedup"] = r["rows"] / r["x_1_row"]
    return out


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(cmd: list[str], port: int, what: str, env: dict | None = None, timeout: float = 600.0):
    """Run ``cmd`` (a server on ``port``) until its ``/health`` answers 200; stop it on exit.

    Raises:
        RuntimeError: it exited or did not answer within ``timeout`` seconds (the end of its output named).
    """
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}: {''.join(output)[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer /health within {timeout:.0f} s: {''.join(output)[-2000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_ours(export: Path, threads: int, max_queue: int = 8):
    """``qwen35-onnx serve`` on ``export`` (its decode slots) with ``threads`` intra-op threads; a context manager
    giving the base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "qwen35_onnx.cli", "serve", "--model", str(export), "--port", str(port)]
    cmd += ["--threads", str(threads), "--max-queue", str(max_queue)]
    return _server(cmd, port, "qwen35-onnx serve")


def serve_llama(llama, model: Path, parallel: int, threads: int, context: int):
    """``llama-server --parallel`` on the GGUF ``model`` (``context`` tokens for each of the ``parallel`` slots,
    ``threads`` threads); a context manager giving the base URL."""
    port = free_port()
    cmd = [llama.tool("llama-server"), "-m", str(model), "--port", str(port), "--parallel", str(parallel)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", str(context * parallel), "--no-webui", "--jinja"]
    return _server(cmd, port, "llama-server")


def _complete(client, prompt: str, max_tokens: int) -> int:
    """One chat request (not streamed); returns its completion tokens (``usage``)."""
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    return reply.usage.completion_tokens


def http_load(base_url: str, streams: int, max_tokens: int) -> dict:
    """``streams`` concurrent requests of ``max_tokens`` tokens (the official ``openai`` client, greedy):
    ``{"tokens", "wall_ms", "tokens_per_s"}`` (completion tokens as each server's ``usage`` counts them, over the
    wall time until the last request ended). Tokens are counted, not streamed chunks: a random-weight model's
    replies are mostly bytes that form no character, which a server holds back."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=1200)
    texts = prompts(streams)
    counts = [0] * streams
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            counts[i] = _complete(client, texts[i], max_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    _complete(client, "Warm up.", 4)
    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"a request of the load failed: {errors[0]!r}")
    return {"tokens": sum(counts), "wall_ms": 1000 * wall, "tokens_per_s": sum(counts) / wall}


def arrival_ttft(base_url: str, background: int, max_tokens: int, arrivals: int = ARRIVALS) -> dict:
    """Time to first token (ms) of ``arrivals`` requests sent one after another while ``background`` requests run
    (each of ``max_tokens``, sent again as they end): each arrival asks for one token, so its latency is its time
    to first token (queue, prefill and the first step, among the running requests); ``{"p50", "p95",
    "samples"}``."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=1200)
    stop = threading.Event()
    texts = prompts(background + arrivals)

    def keep_busy(i: int) -> None:
        while not stop.is_set():
            _complete(client, texts[i], max_tokens)

    workers = [threading.Thread(target=keep_busy, args=(i,), daemon=True) for i in range(background)]
    for w in workers:
        w.start()
    time.sleep(2.0)  # the background requests are decoding
    samples = []
    try:
        for i in range(arrivals):
            start = time.perf_counter()
            _complete(client, texts[background + i], 1)
            samples.append(1000 * (time.perf_counter() - start))
    finally:
        stop.set()
        for w in workers:
            w.join()
    values = np.array(samples)
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)), "samples": samples}


PARALLEL = 4
"""Slots of both servers in the HTTP comparison (``llama-server --parallel 4``)."""
PEER_ROW = "llama.cpp Q4_0 pure"
"""The bench row whose GGUF llama-server serves (every tensor Q4_0, as this project's int4)."""


def run_streams(
    checkpoint: Path, work_dir: Path, counts: list[int], max_tokens: int = 128, peer: bool = True, log=print
) -> dict:
    """The whole ``bench --streams`` run (see the module docstring): export the checkpoint at int4 with
    ``max(counts)`` decode slots into ``work_dir`` (cached), the in-process loads at each of ``counts`` streams,
    then (``peer``) both servers at :data:`PARALLEL` streams. Writes ``work_dir/streams.json`` and
    ``streams.md``; returns the report.

    Raises:
        ValueError: a stream count below 1 or above :data:`~qwen35_onnx.contract.MAX_SLOTS`.
        RuntimeError: a server or llama.cpp's build failed (named, with the end of its output).
    """
    from ..contract import MAX_SLOTS, Quantization
    from ..export.exporter import export
    from ..export.options import ExportOptions
    from ..pipeline import Pipeline
    from ..runtime.backend import RuntimeOptions, usable_cpus
    from ..runtime.select import share_threads
    from .results import run_info
    from .speed import _is_cached

    if not counts or any(n < 1 or n > MAX_SLOTS for n in counts):
        raise ValueError(f"--streams {counts}: stream counts must be from 1 to {MAX_SLOTS}")
    counts = sorted(set(counts))
    threads = usable_cpus()
    slots = max(max(counts), PARALLEL if peer else 1)
    folder = Path(work_dir) / f"ort-int4-slots-{slots}"
    options = ExportOptions(quantize=Quantization.INT4, slots=slots, overwrite=True)
    if not _is_cached(folder, options):
        log(f"[bench] exporting {checkpoint.name} at int4 with {slots} decode slots into {folder} ...")
        export(checkpoint, folder, options)
    report: dict = {"run": run_info(), "export": str(folder), "slots": slots, "threads": threads}
    report["max_tokens"] = max_tokens
    share_threads(RuntimeOptions(threads=threads))  # as serve runs: chunks between decode steps on one pool
    pipe = Pipeline.from_exported(folder, threads=threads)
    group_load(pipe, 1, 8)  # warm-up: every graph loaded, the arenas grown
    report["slots_in_process"] = []
    for n in counts:
        log(f"[bench] {n} stream(s) in one group ...")
        report["slots_in_process"].append(group_load(pipe, n, max_tokens).to_dict())
    log(f"[bench] the decode step at {', '.join(map(str, counts))} rows ...")
    report["step_scaling"] = step_scaling(pipe, counts)
    del pipe
    if peer:
        from .llamacpp import gguf_for, prepare_llamacpp

        report["servers"] = {}
        log(f"[bench] qwen35-onnx serve, {PARALLEL} streams ...")
        with serve_ours(folder, threads) as url:
            load = http_load(url, PARALLEL, max_tokens)
            load["arrival_ttft_ms"] = arrival_ttft(url, PARALLEL - 1, max_tokens)
            report["servers"]["qwen35-onnx serve"] = load
        llama_peer = prepare_llamacpp(checkpoint, Path(work_dir), log)
        model = gguf_for(PEER_ROW, llama_peer.llama, llama_peer.bf16, log)
        log(f"[bench] llama-server --parallel {PARALLEL} ({model.name}), {PARALLEL} streams ...")
        with serve_llama(llama_peer.llama, model, PARALLEL, threads, options.capacity) as url:
            load = http_load(url, PARALLEL, max_tokens)
            load["arrival_ttft_ms"] = arrival_ttft(url, PARALLEL - 1, max_tokens)
            report["servers"][f"llama-server --parallel {PARALLEL}"] = load
    Path(work_dir, "streams.json").write_text(json.dumps(report, indent=2))
    Path(work_dir, "streams.md").write_text("\n".join(report_lines(report)) + "\n")
    return report


def report_lines(report: dict) -> list[str]:
    """The report as Markdown tables (ratios against the first row of each table)."""
    run = report["run"]
    lines = [
        f"Streams at once ({run.get('cpu', '?')}, {report['threads']} threads, {run.get('date', '?')}, "
        f"v{run.get('version', '?')}); export {Path(report['export']).name}, {report['max_tokens']} tokens a stream",
        "",
        "| streams | decode tokens/s, all decoding | x 1 stream | tokens/s, first token to last | x 1 stream "
        "| ITL p50 ms | ITL p95 ms | x 1 stream | TTFT p50 ms | rows/step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = report["slots_in_process"]
    base = rows[0]

    def steady(r: dict) -> float:
        return r["extra"].get("all_decoding_tokens_per_s", r["decode_tokens_per_s"])

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "-"

    for r in rows:
        lines.append(
            f"| {r['streams']} | {steady(r):.1f} | {ratio(steady(r), steady(base))} "
            f"| {r['decode_tokens_per_s']:.1f} | {ratio(r['decode_tokens_per_s'], base['decode_tokens_per_s'])} "
            f"| {r['itl_p50_ms']:.1f} | {r['itl_p95_ms']:.1f} | {ratio(r['itl_p95_ms'], base['itl_p95_ms'])} "
            f"| {r['ttft_p50_ms']:.0f} | {r['extra'].get('mean_rows', 0):.2f} |"
        )
    scaling = report.get("step_scaling")
    if scaling:
        lines += [
            "",
            "| rows in a decode step | step ms | x 1 row | rows / (x 1 row): the most a load can gain |",
            "|---:|---:|---:|---:|",
        ]
        for r in scaling:
            lines.append(f"| {r['rows']} | {r['step_ms']:.1f} | {r['x_1_row']:.2f} | {r['ideal_speedup']:.2f} |")
    servers = report.get("servers")
    if servers:
        lines += [
            "",
            f"| server, {PARALLEL} requests at once | tokens/s | TTFT of an arrival under load, p50 ms | p95 ms |",
            "|---|---:|---:|---:|",
        ]
        for name, r in servers.items():
            ttft = r["arrival_ttft_ms"]
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ttft['p50']:.0f} | {ttft['p95']:.0f} |")
    return lines
