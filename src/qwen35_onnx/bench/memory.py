"""Resident memory of a Pipeline with every graph of an export loaded, against the budget of one
weight copy (``qwen35-onnx bench --memory EXPORT``; ONNX Runtime, CPU; no torch).

Prints: the weight bytes (text and vision external-data files), the decode state buffers, the
process's resident memory (``VmRSS``, split into file-backed and anonymous pages, and ``Pss``)
after loading vision, decode and every prefill bucket and again after running each graph once,
the budget: one copy of the weights (:attr:`MemoryReport.weights_once`) + states + 0.5 GB (judged by
``Pss``: ONNX Runtime maps the shared
pre-packed weights once per session, and ``VmRSS`` counts a shared page once per mapping), and
decode ms/token with the shared weights and with a decode session that holds its own copy (ONNX Runtime's
default), side by side: the two
decoders start from runs of the same prefill (deterministic) and take turns (see :data:`BLOCK`; median of
``steps`` steps after 3 warm-ups each). GB are 10^9 bytes.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..contract import DTYPE_BYTES

BUDGET_FACTOR, BUDGET_SLACK = 1.2, 0.5e9
"""The budget: one copy of the weights (:attr:`MemoryReport.weights_once`: the pre-packed cache's bytes, or
``BUDGET_FACTOR`` x the export's weight bytes without one) + state bytes + ``BUDGET_SLACK`` bytes."""
WARMUP = 3
TEXT_TOKENS = 512
"""The text prompt run before the memory is read (tokens; at most the capacity less 2): the length
llama.cpp's ``llama-bench`` prefills in the bench's llama.cpp rows."""
BLOCK, SWITCH_PAUSE_S = 5, 0.05
"""Decode timing: each decoder runs ``BLOCK`` steps in turn, after a pause of ``SWITCH_PAUSE_S``
seconds. Alternating every single step lets the idle worker threads of the session that just ran
(ONNX Runtime spins them for a while) compete with the other on the cores, which measured
differences of up to 15 % between identical sessions on 2 cores; in blocks they agree within 0.5 %."""


def resident() -> dict[str, int]:
    """This process's memory in bytes: ``VmRSS``, ``VmHWM`` (the peak of VmRSS, see
    :func:`reset_peak`), ``RssAnon``, ``RssFile`` (``/proc/self/status``) and ``Pss``
    (``/proc/self/smaps_rollup``: shared pages divided among their mappings).

    Raises:
        OSError: no ``/proc`` (not Linux).
    """
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                key, _, value = line.partition(":")
                if key == "Pss":
                    out["Pss"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current resident memory (Linux ``clear_refs`` value 5,
    ``proc(5)``), so that :func:`resident` then gives the peak of what follows. Returns False
    where the kernel does not allow it (the peak then covers the whole process life)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def weight_bytes(root: Path, graphs: dict[str, str]) -> dict[str, int]:
    """Bytes of the external-data files the graphs of an export read, per kind: ``{'text': ...,
    'vision': ...}`` (each file counted once; ``graphs``: manifest key -> path under ``root``)."""
    from ..contract import GraphKind
    from ..onnxfile.edit import read_model

    files: dict[Path, str] = {}
    for key, rel in graphs.items():
        path = Path(root) / rel
        for tensor in read_model(path.read_bytes()).initializers.values():
            if tensor.location is not None:
                files.setdefault(
                    (path.parent / tensor.location).resolve(),
                    "vision" if GraphKind.of(key) == GraphKind.VISION else "text",
                )
    out = {"text": 0, "vision": 0}
    for path, kind in files.items():
        out[kind] += path.stat().st_size
    return out


def state_bytes(contract) -> int:
    """Bytes of the decode state buffers of :class:`~qwen35_onnx.runtime.onnxruntime.decoders.BoundDecoder`: two sets of
    conv and recurrent states and logits (A/B), the KV cache at capacity once (updated in place,
    ``--ops ort``) or twice; every one of them for each decode slot (``--slots``), plus one sequence's
    prefill states where there are several slots (a request prefills on states of its own)."""
    from ..contract import STATE_NAMES

    sizes = {s: int(np.prod(contract.state_shape(s))) * DTYPE_BYTES[contract.state_dtype(s)] for s in STATE_NAMES}
    kv_sets = 1 if contract.kv_in_place else 2
    one = 2 * (sizes["conv_states"] + sizes["recurrent_states"] + 4 * contract.vocab_size) + kv_sets * sizes["kv_cache"]
    if contract.slots == 1:
        return one
    return contract.slots * one + sum(sizes.values())


@dataclass
class MemoryReport:
    """What :func:`measure_memory` found; bytes, milliseconds."""

    weights: dict[str, int]
    states: int
    baseline: dict[str, int]
    loaded: dict[str, int]
    ran: dict[str, int]
    text: dict[str, int] = field(default_factory=dict)
    """After a text prompt's prefill and a decode step, before any image (the vision weights, mapped
    from the pre-packed cache, are not resident until an image runs)."""
    text_tokens: int = 0
    decode_ms: dict[str, float] = field(default_factory=dict)
    tokens_identical: bool | None = None
    shared: dict[str, int] = field(default_factory=dict)
    speculation: dict[str, int] = field(default_factory=dict)
    """An export with draft tokens: resident memory after loading its verify and MTP graphs and running speculative
    rounds (``after``), and what they must add at least: the head's own weights (``head_weights``, its tensors in
    the export's weights file), its KV cache and the verify runs' per-position state buffers (``buffers``)."""

    @property
    def weights_once(self) -> float:
        """One copy of the weights in the form the sessions read: the pre-packed weights cache's bytes where
        the sessions map one (int4 at ``accuracy_level`` 4: 1.6-1.7 x the export's bytes, ONNX Runtime's packed
        blocks with their sums for int8 activations; nothing else holds the weights), else
        :data:`BUDGET_FACTOR` x the export's weight bytes."""
        if "prepacked" in self.shared:
            return float(self.shared["prepacked"])
        return BUDGET_FACTOR * sum(self.weights.values())

    @property
    def budget(self) -> float:
        """:attr:`weights_once` + the decode state buffers + :data:`BUDGET_SLACK` (bytes)."""
        return self.weights_once + self.states + BUDGET_SLACK

    def lines(self) -> list[str]:
        def gb(n: float) -> str:
            return f"{n / 1e9:.2f} GB"

        def mem(m: dict) -> str:
            pss = f", Pss {gb(m['Pss'])}" if "Pss" in m else ""
            return f"VmRSS {gb(m['VmRSS'])} (file {gb(m['RssFile'])}, anonymous {gb(m['RssAnon'])}){pss}"

        w = self.weights
        out = [
            f"weights: {gb(sum(w.values()))} (text {gb(w['text'])}, vision {gb(w['vision'])})",
            f"decode state buffers: {gb(self.states)}",
            f"before loading: {mem(self.baseline)}",
            f"vision + decode + every prefill bucket loaded: {mem(self.loaded)}",
            f"after a prefill of {self.text_tokens} tokens and a decode step (text only): {mem(self.text)}",
            f"after running vision too (the largest grid): {mem(self.ran)}",
        ]
        if "mapped" in self.shared:
            out.append(
                f"shared text weights: {gb(self.shared['mapped'])} mapped once, "
                f"{gb(self.shared['transposed'])} of them held transposed"
            )
        if "prepacked" in self.shared:
            out.append(
                f"pre-packed weights cache: {gb(self.shared['prepacked'])} on disk, mapped by every session "
                "(VmRSS counts its pages once per session: read Pss)"
            )
        used = "Pss" if "Pss" in self.loaded else "VmRSS"
        form = "the pre-packed cache" if "prepacked" in self.shared else f"{BUDGET_FACTOR} x the export's"
        out.append(
            f"budget: weights once ({form}) {gb(self.weights_once)} + states {gb(self.states)} + "
            f"{gb(BUDGET_SLACK)} = {gb(self.budget)}; {used} loaded: "
            f"{'within' if self.loaded[used] <= self.budget else 'OVER'}, after running: "
            f"{'within' if self.ran[used] <= self.budget else 'OVER'}"
        )
        if self.speculation:
            spec, after = self.speculation, self.speculation["after"]
            added = {k: after[k] - self.ran[k] for k in ("VmRSS", "Pss") if k in after and k in self.ran}
            shown = ", ".join(f"{k} {'+' if v >= 0 else ''}{gb(v)}" for k, v in added.items())
            out.append(
                f"after loading the verify and MTP graphs and running speculative rounds: {mem(after)} ({shown}; "
                f"the MTP head's own weights {gb(spec['head_weights'])}, its KV cache and the verify buffers "
                f"{gb(spec['buffers'])})"
            )
        if len(self.decode_ms) == 2:
            own, shared = self.decode_ms["own copy"], self.decode_ms["shared"]
            out.append(
                f"decode ms/token (median, alternating steps): shared {shared:.2f}, own copy {own:.2f} "
                f"(shared / own {shared / own:.3f}); greedy tokens identical: {self.tokens_identical}"
            )
        return out


def _speculation_memory(pipe, prepared, export_dir: Path) -> dict:
    """Resident memory after loading every verify and MTP graph of ``pipe``'s export and running 4 speculative
    rounds of the longest draft length on ``prepared``, and the bytes they must add at least (see
    :attr:`MemoryReport.speculation`)."""
    from ..onnxfile.edit import read_model
    from ..runtime.sampling import Sampler, SamplingConfig
    from ..runtime.speculative import Speculation

    contract = pipe.contract
    generation = pipe.generation(prepared)
    speculation = Speculation(generation, contract.draft_tokens)
    sampler = Sampler(SamplingConfig())
    token = sampler(generation.prefill())
    for _ in range(4):
        emitted = speculation.round(token, sampler)
        speculation.commit(len(emitted))
        token = emitted[-1]
    gc.collect()
    after = resident()

    def stored(key: str) -> dict[tuple, int]:  # the graph's weights by where they are stored
        path = Path(export_dir) / contract.graphs[key]
        tensors = read_model(path.read_bytes()).initializers.values()
        return {(t.location, t.offset): t.length for t in tensors if t.location is not None}

    decode, mtp = stored("decode"), stored(contract.mtp_graph_key(1))
    head = sum(n for where, n in mtp.items() if where not in decode)  # the embedding and lm_head are decode's
    kv = int(np.prod(contract.mtp_kv_shape)) * DTYPE_BYTES[contract.mtp_kv_dtype]
    per_position = sum(int(np.prod(contract.state_shape(s))) * 4 for s in ("conv_states", "recurrent_states"))
    buffers = kv + 2 * (contract.draft_tokens + 1) * per_position
    return {"after": after, "head_weights": head, "buffers": buffers}


def _prompt(pipe, length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, min(pipe.contract.vocab_size, 1000), size=(1, length)).astype(np.int64)


def measure_memory(export_dir: Path, steps: int = 40, compare: bool = True, log=print) -> MemoryReport:
    """Load the export at ``export_dir`` with every graph, measure resident memory, then (with
    ``compare``) decode ``steps`` tokens alternately with the pipeline's decoder and one whose
    decode session holds its own weights (this loads that session: its copy adds to memory after
    the memory figures were taken).

    Raises:
        ContractError / ValueError: see :meth:`~qwen35_onnx.pipeline.Pipeline.from_exported`.
        OSError: no ``/proc`` (not Linux).
    """
    from ..pipeline import Pipeline
    from ..runtime.generation import Generation
    from ..runtime.onnxruntime.backend import OrtBackend
    from ..runtime.slots import SlotPool

    gc.collect()
    baseline = resident()
    start = time.perf_counter()
    pipe = Pipeline.from_exported(export_dir)
    contract = pipe.contract
    for bucket in [] if contract.prefill_chunks else contract.prefill_buckets or [None]:
        pipe.backend.load_prefill(bucket)
    for size in contract.prefill_chunks:
        pipe.backend.graphs.chunk(size)
    gc.collect()
    loaded = resident()
    log(
        f"[memory] loaded vision, decode and {len(contract.prefill_keys or contract.prefill_chunks)} prefill graph(s) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    text_tokens = min(TEXT_TOKENS, contract.capacity - 2)
    prepared = pipe.prepare_ids(_prompt(pipe, text_tokens))

    def begin(backend):
        """A generation on ``backend`` after one step from a fresh prefill of the pipeline (prefill
        is deterministic: every generation starts from the same states), and its next token (an export of
        several decode slots: in a slot of the backend's own pool, which holds every slot's states)."""
        if contract.slots > 1:
            pool = pipe.slot_pool if backend is pipe.backend else SlotPool(backend)
            generation = Generation(backend, prepared, pool=pool)
            token = int(np.argmax(generation.prefill()))
            return generation, int(np.argmax(generation.step(token)))
        prefill = pipe.generation(prepared)
        token = int(np.argmax(prefill.prefill()))
        generation = Generation(backend, prepared, states=prefill.states)
        return generation, int(np.argmax(generation.step(token)))

    generations = {"shared": begin(pipe.backend)}
    gc.collect()
    text = resident()
    side = contract.spatial_merge_size * math.isqrt(contract.image_tokens)  # the largest grid: the most memory
    grid = max(contract.vision_grids, key=lambda g: g[0] * g[1]) if contract.static_vision else (side, side)
    pipe.backend.run_vision(grid, np.zeros((grid[0] * grid[1], contract.patch_dim), dtype=np.float32))
    gc.collect()
    ran = resident()
    report = MemoryReport(
        weight_bytes(export_dir, contract.graphs),
        state_bytes(contract),
        baseline,
        loaded,
        ran,
        text=text,
        text_tokens=text_tokens,
        shared=pipe.backend.shared_weight_bytes(),
        speculation=_speculation_memory(pipe, prepared, export_dir) if contract.draft_tokens else {},
    )
    if not compare:
        return report
    own = OrtBackend(export_dir, contract, share_weights=False, prepacked_cache=False)  # ONNX Runtime's default
    generations["own copy"] = begin(own)
    runs = {name: {"token": token, "tokens": [], "ms": []} for name, (_, token) in generations.items()}
    order = list(generations)
    while min(len(r["ms"]) for r in runs.values()) < steps:
        if max(g.length for g, _ in generations.values()) + BLOCK >= contract.capacity:
            break
        for name in order:
            time.sleep(SWITCH_PAUSE_S)  # the other session's idle threads stop spinning
            r, (generation, _) = runs[name], generations[name]
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                r["token"] = int(np.argmax(generation.step(r["token"])))
                if len(r["tokens"]) >= WARMUP:
                    r["ms"].append(1000 * (time.perf_counter() - t0))
                r["tokens"].append(r["token"])
        order.reverse()  # who goes first alternates
    report.decode_ms = {name: statistics.median(r["ms"]) for name, r in runs.items() if r["ms"]}
    report.tokens_identical = runs["shared"]["tokens"] == runs["own copy"]["tokens"]
    return report
