"""The benchmark's protocol and bookkeeping, shared by every row (numpy only).

Protocol of the reference system: prefill = median of 5 runs after 2 warm-ups at each length;
decode = median of 10 steps after 3 warm-ups from the state left by a prefill of that length;
plus end-to-end tokens/s of a 128-token greedy generation (:class:`Protocol`). Times are
milliseconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Protocol", "PeerResult", "decode_weight_bytes", "median_ms", "read_bandwidth_gbps"]


@dataclass(frozen=True)
class Protocol:
    """How often each figure is measured: prefill = median of ``prefill_runs`` runs after
    ``prefill_warmup``; decode = median of ``decode_runs`` steps after ``decode_warmup``; end to
    end = ``e2e_tokens`` greedy tokens from the shortest prompt."""

    prefill_warmup: int = 2
    prefill_runs: int = 5
    decode_warmup: int = 3
    decode_runs: int = 10
    e2e_tokens: int = 128

    @classmethod
    def with_prefill_runs(cls, runs: int) -> Protocol:
        """The reference protocol with ``runs`` timed prefill runs after ``min(2, runs)`` warm-ups.

        Raises:
            ValueError: ``runs`` below 1.
        """
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"prefill_runs must be an integer >= 1, got {runs!r}")
        return cls(prefill_warmup=min(2, runs), prefill_runs=runs)

    @property
    def is_reference(self) -> bool:
        return self == Protocol()


@dataclass
class PeerResult:
    """One peer's numbers: per-length prefill ms and decode ms/token, end-to-end tokens/s."""

    name: str
    prefill_ms: dict[int, float] = field(default_factory=dict)
    decode_ms: dict[int, float] = field(default_factory=dict)
    e2e_tokens_per_s: float | None = None
    decode_bytes: int | None = None
    peak_rss_bytes: int | None = None
    """Peak resident memory (bytes) of the process that ran the peer, while it ran."""
    peak_sampled: bool = False
    """``peak_rss_bytes`` is the largest ``Pss`` sampled after each measurement instead of the
    kernel's ``VmHWM``: for sessions that map the shared pre-packed weights, whose pages VmRSS
    counts once per session (see :mod:`qwen35_onnx.runtime.onnxruntime.prepacked`)."""
    image: dict | None = None
    """An image prompt's time to first token, where the peer measured one (``{"ttft_ms",
    "prompt_tokens"}``, see :mod:`.vision`)."""
    note: str = ""
    ttft_ms: dict[int, float] = field(default_factory=dict)
    """Time to first token (ms) by prompt length (section "Prefill", :mod:`.prefill`)."""
    conversation: object | None = None
    """Turn 4 of a conversation (a :class:`~.prefill.ConversationCost`), where measured."""


def median_ms(fn, warmup: int, runs: int) -> float:
    """Median wall time of ``fn()`` in ms over ``runs`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def read_bandwidth_gbps(size_bytes: int = 2**30, repeats: int = 5) -> float:
    """Measured memory read bandwidth in GB/s: best of ``repeats`` runs of ONNX Runtime's
    ReduceSum over a ``size_bytes`` fp32 buffer on all cores (a pure read, by the runtime the
    peers use; a NumPy copy also writes and gives about 15 % less)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = size_bytes // 4
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
        "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(np.ones(n, dtype=np.float32)))
    binding.bind_output("y")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        best = min(best, time.perf_counter() - start)
    return 4 * n / best / 1e9


#: (operator, input) pairs that index a table by token: one row is read per decode step.
GATHERED = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2)}


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads from the ONNX graph at ``path``: every initializer
    (inline or external data) except tables that are only indexed by Gather or
    GatherBlockQuantized (the token embedding: one row per token), each stored tensor counted
    once (a tied model's quantized embedding and lm_head are one tensor under two names)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    uses: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    stored: dict[tuple, int] = {}
    for tensor in model.graph.initializer:
        if tensor.name in uses and uses[tensor.name] <= GATHERED:
            continue
        external = {e.key: e.value for e in tensor.external_data}
        if "length" in external:
            stored[(external.get("location"), external.get("offset", "0"))] = int(external["length"])
        else:
            stored[("inline", tensor.name)] = onnx.numpy_helper.to_array(tensor).nbytes
    return sum(stored.values())
