"""Where a prefill and a decode step spend their time (``qwen35-onnx bench --profile EXPORT``):
ONNX Runtime's profiler on an export's sessions (:attr:`~qwen35_onnx.runtime.backend.RuntimeOptions.
profile_dir`), read back per graph run.

For each prompt length ``n``: the prefill of ``n`` random ordinary tokens (one warm-up, then
``runs`` runs) and decode steps from the state it leaves (3 warm-ups, then ``steps``), run by
:class:`~qwen35_onnx.runtime.generation.Generation` as every surface runs them. From the profile:
each timed run's ``model_run`` (the session's own time for the run) and its nodes' kernel times
(``*_kernel_time`` events, microseconds), grouped by operator and by node. The step's fixed
overhead is split into what happens outside the session (the wall time of ``Generation.step``
minus ``model_run``: the host's mask / positions, IOBinding, the logits' copy) and inside it
between kernels (``model_run`` minus the kernels' sum: the executor's own per-node cost).
Bytes a decode step reads: :func:`~.protocol.decode_weight_bytes` of the graph the session loaded
(the pre-packed weights where the cache holds them) plus the states at ``n`` tokens.

Times are milliseconds per run (per prefill, per decode step).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["GraphProfile", "profile_export", "profile_lines", "read_profile"]


@dataclass
class GraphProfile:
    """One graph's timed runs: ``wall_ms`` (the caller's clock around each run), ``run_ms`` (the
    session's ``model_run``), ``kernel_ms`` (the sum of its nodes' kernel times), and per run
    ``by_op`` (operator -> ms, count of nodes) and ``by_node`` (node name -> (operator, ms)), the
    medians over the runs."""

    graph: str
    tokens: int
    runs: int = 0
    wall_ms: float = 0.0
    run_ms: float = 0.0
    kernel_ms: float = 0.0
    by_op: dict[str, tuple[float, int]] = field(default_factory=dict)
    by_node: dict[str, tuple[str, float]] = field(default_factory=dict)
    step_bytes: int | None = None


def read_profile(path: Path, last: int) -> list[dict]:
    """The last ``last`` runs of the ONNX Runtime profile at ``path``: for each, ``{"run_us", "nodes":
    {name: (operator, us)}}`` (the node events of a run are those inside its ``model_run``)."""
    events = json.loads(Path(path).read_text())
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    runs = runs[-last:] if last else runs
    out = [{"run_us": r["dur"], "start": r["ts"], "end": r["ts"] + r["dur"], "nodes": {}} for r in runs]
    starts = [r["start"] for r in out]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if i >= 0 and e["ts"] <= out[i]["end"]:
            name = e["name"][: -len("_kernel_time")]
            op = e.get("args", {}).get("op_name", "?")
            prev = out[i]["nodes"].get(name, (op, 0))[1]
            out[i]["nodes"][name] = (op, prev + e["dur"])
    return out


def _summarize(profile: GraphProfile, runs: list[dict], walls: list[float]) -> GraphProfile:
    profile.runs = len(runs)
    profile.wall_ms = statistics.median(walls)
    profile.run_ms = statistics.median(r["run_us"] for r in runs) / 1000
    profile.kernel_ms = statistics.median(sum(us for _, us in r["nodes"].values()) for r in runs) / 1000
    ops: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = {}
    nodes: dict[str, list[float]] = defaultdict(list)
    kinds: dict[str, str] = {}
    for r in runs:
        per_op: dict[str, float] = defaultdict(float)
        for name, (op, us) in r["nodes"].items():
            per_op[op] += us
            nodes[name].append(us)
            kinds[name] = op
        for op, us in per_op.items():
            ops[op].append(us)
        for op in per_op:
            counts[op] = sum(1 for o, _ in r["nodes"].values() if o == op)
    by_op = {op: (statistics.median(v) / 1000, counts[op]) for op, v in ops.items()}
    profile.by_op = dict(sorted(by_op.items(), key=lambda kv: -kv[1][0]))
    by_node = {n: (kinds[n], statistics.median(v) / 1000) for n, v in nodes.items()}
    profile.by_node = dict(sorted(by_node.items(), key=lambda kv: -kv[1][1]))
    return profile


def _sessions(backend) -> dict[str, object]:
    """The ONNX Runtime sessions the backend holds now: {graph key: GraphSession}."""
    graphs = backend.graphs
    found = {"decode": graphs.decode}
    for table in (graphs._prefill, graphs._chunk):
        for spec in table.values():
            found[spec.name] = spec
    return found


def profile_export(
    export_dir: Path, lengths=(32, 512), runs: int = 3, steps: int = 10, threads: int = 0, log=print
) -> list[GraphProfile]:
    """Profile the export at ``export_dir`` on ONNX Runtime (see the module docstring): for each of
    ``lengths`` (prompt tokens) the prefill graphs that ran (as one :class:`GraphProfile` per
    length, all the graph runs of one prefill together) and the decode step.

    Raises:
        ContractError: an export ONNX Runtime cannot run.
        ValueError: a length that leaves no decode slot below the capacity.
    """
    from ..pipeline import Pipeline
    from .protocol import decode_weight_bytes, step_state_bytes
    from .speed import step_graph

    results = []
    with tempfile.TemporaryDirectory(prefix="qwen35-profile-") as folder:
        for n in lengths:
            pipe = Pipeline.from_exported(export_dir, profile_dir=folder, threads=threads)
            contract = pipe.contract
            if n >= contract.capacity:
                raise ValueError(f"--lengths: {n} tokens leave no decode slot below the capacity {contract.capacity}")
            ids = np.random.default_rng(n).integers(0, min(contract.vocab_size, 1000), size=(1, n)).astype(np.int64)
            prepared = pipe.prepare_ids(ids)
            log(f"[profile] prefill of {n} tokens, {runs} runs after 1 ...")
            walls = []
            for i in range(runs + 1):
                generation = pipe.generation(prepared)
                start = time.perf_counter()
                logits = generation.prefill()
                if i:
                    walls.append(1000 * (time.perf_counter() - start))
            token = int(np.argmax(logits))
            log(f"[profile] {steps} decode steps after 3 ...")
            step_walls = []
            for i in range(steps + 3):
                start = time.perf_counter()
                token = int(np.argmax(generation.step(token)))
                if i >= 3:
                    step_walls.append(1000 * (time.perf_counter() - start))
            sessions = _sessions(pipe.backend)
            files = {key: Path(spec.session.end_profiling()) for key, spec in sessions.items()}
            prefill_runs = [run for key, f in files.items() if key != "decode" for run in read_profile(f, 0)]
            prefill_runs.sort(key=lambda r: r["start"])
            per_prefill = max(1, len(prefill_runs) // (runs + 1))  # graph runs of one prefill (chunks)
            merged = []
            for k in range(runs):  # the timed prefills: the last ``runs`` groups
                group = prefill_runs[len(prefill_runs) - (runs - k) * per_prefill :][:per_prefill]
                nodes: dict[str, tuple[str, float]] = {}
                for r in group:
                    for name, (op, us) in r["nodes"].items():
                        nodes[name] = (op, nodes.get(name, (op, 0))[1] + us)
                merged.append({"run_us": sum(r["run_us"] for r in group), "nodes": nodes})
            keys = "+".join(sorted(k for k in files if k != "decode")) or "prefill"
            results.append(_summarize(GraphProfile(f"prefill ({keys}, {per_prefill} run(s))", n), merged, walls))
            decode = _summarize(GraphProfile("decode", n), read_profile(files["decode"], steps), step_walls)
            decode.step_bytes = decode_weight_bytes(step_graph(pipe, Path(export_dir))) + step_state_bytes(contract, n)
            results.append(decode)
            del pipe, generation, sessions
    return results


def profile_lines(profiles: list[GraphProfile], top: int = 12) -> list[str]:
    """Markdown: per graph and length the run's time split (wall, session, kernels) and the top
    operators and nodes."""
    lines = []
    for p in profiles:
        outside = p.wall_ms - p.run_ms
        between = p.run_ms - p.kernel_ms
        lines += [
            "",
            f"### {p.graph}, {p.tokens} tokens ({p.runs} runs, medians)",
            "",
            f"wall {p.wall_ms:.2f} ms = session {p.run_ms:.2f} ms (kernels {p.kernel_ms:.2f} ms + between kernels "
            f"{between:.2f} ms) + outside the session {outside:.2f} ms; "
            f"{sum(c for _, c in p.by_op.values())} nodes",
        ]
        if p.step_bytes:
            lines[-1] += f"; bytes read per step {p.step_bytes / 1e9:.3f} GB"
        lines += ["", "| operator | nodes | ms | share of kernels |", "|---|---:|---:|---:|"]
        for op, (ms, count) in list(p.by_op.items())[:top]:
            lines.append(f"| {op} | {count} | {ms:.3f} | {ms / p.kernel_ms:.1%} |")
        lines += ["", "| node | operator | ms |", "|---|---|---:|"]
        for name, (op, ms) in list(p.by_node.items())[:top]:
            lines.append(f"| {name} | {op} | {ms:.3f} |")
    return lines
