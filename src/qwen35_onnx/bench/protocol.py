"""The benchmark's protocol and bookkeeping, shared by every row (numpy only).

Protocol of the reference system: prefill = median of 5 runs after 2 warm-ups at each length;
decode = median of 10 steps after 3 warm-ups from the state left by a prefill of that length;
plus end-to-end tokens/s of a 128-token greedy generation (:class:`Protocol`). Times are
milliseconds.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

__all__ = [
    "Protocol",
    "PeerResult",
    "decode_weight_bytes",
    "median_ms",
    "merge_rounds",
    "read_bandwidth_gbps",
    "read_bandwidths",
    "step_state_bytes",
]


LONG_PROMPT = 2048
"""Prompt lengths (tokens) above which a prefill is timed once (:meth:`Protocol.prefill_at`)."""


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

    def prefill_at(self, length: int) -> tuple[int, int]:
        """``(warm-ups, runs)`` of the prefill of ``length`` tokens: the protocol's up to
        :data:`LONG_PROMPT` tokens; above it one run without a warm-up (agent lengths: a 32k-token prefill
        takes minutes on 2 cores, and the shorter lengths before it have loaded and warmed every graph; the
        rounds of ``bench --rounds`` give the figure its repetitions)."""
        return (self.prefill_warmup, self.prefill_runs) if length <= LONG_PROMPT else (0, 1)


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
    peak_rss_by_length: dict[int, int] = field(default_factory=dict)
    """Peak resident memory (bytes) by length (tokens): while the peer prefilled and decoded at that
    length (this project's rows: its process, the peak counted afresh at each length; llama.cpp's:
    its processes of that length, see :func:`~.llamacpp.bench_llamacpp`)."""
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
    skipped: list[str] = field(default_factory=list)
    """Parts of this row that could not be measured, each with its reason (listed under the tables)."""
    rounds: list[dict] = field(default_factory=list)
    """With ``bench --rounds N`` (N > 1): each round's ``{"prefill_ms", "decode_ms",
    "e2e_tokens_per_s"}``, in order; the fields above then hold the medians over them
    (:func:`merge_rounds`)."""


def merge_rounds(rounds: list[PeerResult]) -> PeerResult:
    """One row measured in several rounds (each row in turn, A B C A B C) as one result: prefill ms,
    decode ms/token and end-to-end tokens/s are the medians over the rounds at each length, the peak
    memory the largest; the image, prefill-by-length and conversation figures are the first round's
    (later rounds time the core figures only); the peak memory by length the largest at each length.
    Each round's own figures are kept in ``rounds``.

    Raises:
        ValueError: ``rounds`` is empty or mixes rows.
    """
    if not rounds or len({r.name for r in rounds}) != 1:
        raise ValueError(f"merge_rounds needs results of one row, got {[r.name for r in rounds]}")
    first = rounds[0]
    if len(rounds) == 1:
        return first

    def median_by_length(figure: str) -> dict[int, float]:
        by_length = [getattr(r, figure) for r in rounds]
        return {n: statistics.median(d[n] for d in by_length if n in d) for n in by_length[0]}

    e2e = [r.e2e_tokens_per_s for r in rounds if r.e2e_tokens_per_s is not None]
    peaks = [r.peak_rss_bytes for r in rounds if r.peak_rss_bytes is not None]
    by_length = {}
    for r in rounds:
        for n, peak in r.peak_rss_by_length.items():
            by_length[n] = max(by_length.get(n, 0), peak)
    return replace(
        first,
        prefill_ms=median_by_length("prefill_ms"),
        decode_ms=median_by_length("decode_ms"),
        e2e_tokens_per_s=statistics.median(e2e) if e2e else None,
        peak_rss_bytes=max(peaks) if peaks else None,
        peak_rss_by_length=by_length,
        rounds=[
            {"prefill_ms": r.prefill_ms, "decode_ms": r.decode_ms, "e2e_tokens_per_s": r.e2e_tokens_per_s}
            for r in rounds
        ],
    )


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


def int4_product_model(k: int, n: int, *, block_size: int, accuracy_level: int, tokens: int | str = 1, seed: int = 0):
    """A one-node ONNX Runtime ``MatMulNBits`` graph (``com.microsoft``): ``a [tokens, K]`` fp32 ->
    ``y [tokens, N]`` fp32, against random 4-bit codes ``[N, K / block_size, block_size / 2]`` uint8
    and fp32 scales ``[N, K / block_size]`` (symmetric, no zero points); ``tokens`` a number or a
    dimension name. The bench's bandwidth probe and ``benchmarks/int4_kernel_rate.py`` time it.

    Returns:
        an ``onnx.ModelProto`` (opsets 17 and ``com.microsoft`` 1).
    """
    from onnx import TensorProto, helper, numpy_helper

    blocks = k // block_size
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(n, blocks, block_size // 2), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block_size, accuracy_level=accuracy_level,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "int4_product",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [tokens, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, n])],
        [numpy_helper.from_array(codes, "b"), numpy_helper.from_array(scales, "s")],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def read_bandwidths(size_bytes: int = 2**30, repeats: int = 5) -> dict[str, float]:
    """Memory read bandwidth in GB/s measured two ways on all cores, best of ``repeats`` runs each:
    ``"ReduceSum"``: ONNX Runtime's ReduceSum over a ``size_bytes`` fp32 buffer (a pure read; a NumPy
    copy also writes and gives about 15 % less); ``"MatMulNBits"``: ONNX Runtime's int4 matrix-vector
    product (one row of activations, block 128, int8 activations) over ``size_bytes / 2`` of 4-bit codes,
    counting the codes and scales it reads: the kernel a decode step spends most of its time in,
    which streams faster than ReduceSum on the 2-core AMD EPYC machine (46-55 against 34 GB/s)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ..runtime.onnxruntime.sessions import session_options

    def best(model, feeds: dict[str, np.ndarray], output: str) -> float:
        options = session_options()
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        binding.bind_output(output)
        session.run_with_iobinding(binding)  # warm-up
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    n = size_bytes // 4
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
        "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = {"ReduceSum": 4 * n / best(model, {"x": np.ones(n, dtype=np.float32)}, "y") / 1e9}

    k, block = 4096, 128
    rows = size_bytes // k  # N: size_bytes / 2 of 4-bit codes of a [K, N] weight (its proto stays below 2 GB)
    model = int4_product_model(k, rows, block_size=block, accuracy_level=4, tokens=1)
    read = rows * k // 2 + rows * (k // block) * 4  # codes and fp32 scales
    out["MatMulNBits"] = read / best(model, {"a": np.ones((1, k), np.float32)}, "y") / 1e9
    return out


def read_bandwidth_gbps(size_bytes: int = 2**30, repeats: int = 5) -> float:
    """The best of :func:`read_bandwidths` (GB/s)."""
    return max(read_bandwidths(size_bytes, repeats).values())


def step_state_bytes(contract, length: int) -> int:
    """Bytes of the states one decode step reads at ``length`` tokens of context: the conv and
    recurrent states and ``length`` KV slots per layer, each in its dtype (the KV cache's
    :attr:`~qwen35_onnx.contract.ShapeContract.kv_precision`)."""
    from ..contract import DTYPE_BYTES

    return sum(
        int(np.prod(shape)) * DTYPE_BYTES[contract.state_dtype(state)]
        for state, shape in (
            ("conv_states", contract.conv_state_shape),
            ("recurrent_states", contract.recurrent_state_shape),
            ("kv_cache", contract.kv_shape(length)),
        )
    )


#: (operator, input) pairs that index a table by token: one row is read per decode step.
GATHERED = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2)}


#: (operator, input) pairs folded into the pre-packed blob of the operator's weight (input 1):
#: MatMulNBits' scales and zero points, read when a session packs its weights, never at run time.
FOLDED = {("MatMulNBits", 2), ("MatMulNBits", 3)}


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads from the ONNX graph at ``path``: every initializer
    (inline or external data) except tables that are only indexed by Gather or
    GatherBlockQuantized (the token embedding: one row per token), each stored tensor counted
    once (a tied model's quantized embedding and lm_head are one tensor under two names).

    A graph ONNX Runtime saved with its pre-packed weights (:mod:`qwen35_onnx.runtime.onnxruntime.
    prepacked`: an initializer's ``external_data`` lists ``prepacked_N = key|offset;length;...``)
    counts what the kernels read: the packed blobs instead of the weights they were packed from
    (MLAS's int4 layout for int8 activations holds the codes, an fp32 scale and an fp32 block sum
    per block, 1.5x the codes at block 32), and not the scales folded into them (:data:`FOLDED`)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    uses: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    externals = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}
    packed = {name for name, ext in externals.items() if any(k.startswith("prepacked_") for k in ext)}
    folded = {
        node.input[i]
        for node in model.graph.node
        if node.op_type == "MatMulNBits" and len(node.input) > 1 and node.input[1] in packed
        for i in range(2, len(node.input))
        if node.input[i] and uses[node.input[i]] <= FOLDED
    }
    stored: dict[tuple, int] = {}
    for tensor in model.graph.initializer:
        if tensor.name in uses and uses[tensor.name] <= GATHERED or tensor.name in folded:
            continue
        external = externals[tensor.name]
        if tensor.name in packed:
            for key, value in external.items():
                if key.startswith("prepacked_"):
                    offset, length = value.split("|")[1].split(";")[:2]
                    stored[(external.get("location"), "packed", offset)] = int(length)
        elif "length" in external:
            stored[(external.get("location"), external.get("offset", "0"))] = int(external["length"])
        else:
            stored[("inline", tensor.name)] = onnx.numpy_helper.to_array(tensor).nbytes
    return sum(stored.values())


def run_tool(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a peer's tool ``cmd`` (text output captured; ``kwargs`` go to :func:`subprocess.run`).

    Raises:
        RuntimeError: it exited non-zero; the message names ``what``, the exit status and the last
            15 lines of its stderr (else stdout).
    """
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode:
        raise RuntimeError(tool_failure(what, done.returncode, done.stderr or done.stdout))
    return done


def tool_failure(what: str, returncode: int, output: str | None) -> str:
    """The message of a peer's tool that failed: ``what``, its exit status (a signal by name: a
    negative ``returncode`` is the signal that killed it, as :mod:`subprocess` reports it) and the
    last 15 lines of ``output``, or that it printed nothing (a crash often prints nothing)."""
    status = f"exit {returncode}"
    if returncode < 0:
        try:
            status += f", killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    tail = "\n".join((output or "").strip().splitlines()[-15:])
    return f"{what} failed ({status}): {tail or '(no output)'}"
