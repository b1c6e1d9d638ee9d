"""ONNX Runtime sessions for the exported graphs (no torch): providers, one
``InferenceSession`` per graph, described for the shared cross-checks of
:mod:`qwen35_onnx.runtime.checks`, and the graph set that loads them with one copy of the
weights (:mod:`.shared_weights`, :mod:`.prepacked`).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...contract import METADATA_KEY, TEXT_WEIGHTS, ContractError, Dtype, GraphKind, Ops, Quantization, ShapeContract
from ...host_memory import available_memory, release_freed_memory, trim_heap
from ...onnxfile.edit import identity_model
from ..backend import GraphSet, RuntimeOptions
from ..checks import GraphSpec
from .prepacked import (
    PACKED,
    PrepackedCache,
    PrepackedCacheError,
    default_directory,
    mapped_starts,
    release_new_pages,
    warn_unavailable,
)
from .shared_weights import SharedWeights, relayout_for

DEVICES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class Activations(StrEnum):
    """Where an ONNX Runtime CPU session's activation memory lives between runs."""

    OWN = "own"
    """The session's own CPU arena with ONNX Runtime's memory pattern: what a run needs stays
    allocated for the next one (decode: one token's activations)."""
    SHARED = "shared"
    """The process's one shared CPU arena (:func:`shared_arena`), tensor by tensor (no memory
    pattern): the vision, prefill and chunk sessions reuse the same memory, so the process holds
    the largest run's live activations once, not one block per loaded graph, and a run writes to
    pages already mapped (freshly mapped memory cost 0.8B int4 prefill 20-25 %: 111,000 page
    faults, 0.43 GB, per 512-token run; ``docs/design.md``). The arena lives as long as the process:
    dropping a session or a generation leaves it allocated for the next run; the states a
    generation keeps are allocated outside it (:func:`.decoders.bind_state_output`). On a GPU the
    host side of these sessions runs without an arena."""


KEPT_ACTIVATION_TOKENS = 512
"""Positions (prompt tokens of a prefill or chunk run, image tokens of a vision run) up to which a
run leaves the shared arena's memory allocated for the next run (the default largest chunk); a
wider run hands what it added back to the system at its end (ONNX Runtime's arena shrinkage), so
one long bucketed prompt or one large image does not keep its activations (0.8B: the arena
holds 0.42 GB after a 512-token prefill, growing with the width)."""


@functools.lru_cache(maxsize=1)
def shared_arena() -> bool:
    """Register the process's shared ONNX Runtime CPU arena once (``create_and_register_allocator``;
    growing in powers of two, which at 0.8B held 0.05-0.1 GB less resident memory after a
    512-token prefill and an image than growing by what is requested); sessions opt in with the
    ``session.use_env_allocators`` config entry. It replaces a shared CPU allocator registered
    before in this process (ONNX Runtime keeps the last one registered); sessions that do not opt in
    are not affected. Returns False where this ONNX Runtime cannot (those sessions then run without
    an arena, as before it)."""
    try:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 0}))
    except Exception:  # an ONNX Runtime build without it; its own errors derive from Exception only
        return False
    return True


_THREAD_POOL: list[int] = []
"""The intra-op threads of the process's shared thread pool once :func:`shared_thread_pool` made it (0: ONNX
Runtime's default; -1: ONNX Runtime's global pools were made before by other code, at a size unknown here)."""


def shared_thread_pool(threads: int = 0) -> bool:
    """Run every ONNX Runtime session this project makes in this process on one shared pool of ``threads``
    intra-op worker threads (0: ONNX Runtime's default, one per physical core), made by the first call (ONNX
    Runtime's global thread pools, ``set_global_thread_pool_sizes``). The command line does this for its
    commands (``generate``, ``chat``, ``verify``, ``serve``, ``bench --streams``); a Python program opts in by
    calling it before it loads an export. ONNX Runtime's rule then holds for the whole process: every session
    in it, a program's own ones included, must be made with ``use_per_session_threads = False`` (see
    :func:`session_options`; ONNX Runtime refuses others with "use_per_session_threads must be false when using
    a global thread pool").

    Why: ONNX Runtime's worker threads spin for a while after a run. With a pool per session, the threads of
    the graph that just ran (a prefill chunk) spin on the cores the next graph (a decode step) needs:
    alternating them on 2 cores, a 3-row decode step after a chunk took 48-57 ms instead of 26-31, and a
    newcomer's time to first token among 3 running streams rose from about 0.50 to 0.65 s (0.8B int4,
    AMD EPYC 2 cores, ONNX Runtime 1.32). On one shared pool the spinning threads are the ones the next graph
    runs on; one stream alone decodes as fast as before.

    Returns:
        True: the pool is in use (made now, or before with the same ``threads``; 0 accepts any size).
        False: other code in this process made ONNX Runtime's global pools first; the sessions run on those,
        at their size.

    Raises:
        ValueError: ``threads`` not an integer from 0 to the usable CPUs, or other than the pool made before (a
            pool's size is fixed).
    """
    from ..backend import usable_cpus

    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= usable_cpus():
        raise ValueError(
            f"a shared thread pool needs threads from 0 to {usable_cpus()} (the usable CPUs; 0: ONNX Runtime's "
            f"default), got {threads!r}"
        )
    if not _THREAD_POOL:
        try:
            ort.set_global_thread_pool_sizes(threads, 1)
            _THREAD_POOL.append(threads)
        except Exception:  # made before by other code (ONNX Runtime raises its own Fail): those pools rule
            _THREAD_POOL.append(-1)
    if _THREAD_POOL[0] == -1:
        return False
    if threads and _THREAD_POOL[0] != threads:
        raise ValueError(
            f"this process's shared ONNX Runtime thread pool has {_THREAD_POOL[0] or 'the default number of'} "
            f"threads; {threads} cannot be had in the same process (a pool's size is fixed)"
        )
    return True


def session_options() -> ort.SessionOptions:
    """New ``SessionOptions`` for a session of this process: on its shared thread pool once
    :func:`shared_thread_pool` made one (ONNX Runtime refuses a session with a pool of its own then)."""
    options = ort.SessionOptions()
    if _THREAD_POOL:
        options.use_per_session_threads = False
    return options


@functools.lru_cache(maxsize=1)
def _identity_session() -> ort.InferenceSession:
    """A one-node session on the shared arena (:func:`shrink_shared_arena`)."""
    options = session_options()
    options.add_session_config_entry("session.use_env_allocators", "1")
    return ort.InferenceSession(identity_model(), sess_options=options, providers=["CPUExecutionProvider"])


def shrink_shared_arena() -> None:
    """Hand the memory of the shared arena (:func:`shared_arena`) that no tensor uses back to the
    system: one run of a one-node graph with ONNX Runtime's arena shrinkage. A no-op where no
    session registered the arena. For when a process is done with its runs for a while (the
    bench, between rows); a next run maps its memory again."""
    if shared_arena.cache_info().currsize == 0 or not shared_arena():
        return
    _identity_session().run(None, {"x": np.zeros(1, np.float32)}, run_options(KEPT_ACTIVATION_TOKENS + 1))


def run_options(tokens: int) -> ort.RunOptions | None:
    """The RunOptions of a run over ``tokens`` positions (:data:`KEPT_ACTIVATION_TOKENS`): None up to
    :data:`KEPT_ACTIVATION_TOKENS`; above it, shrink the CPU arena at the end of the run (ONNX
    Runtime's ``memory.enable_memory_arena_shrinkage``)."""
    if tokens <= KEPT_ACTIVATION_TOKENS:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
"""ONNX Runtime's NOT_IMPLEMENTED message for an operator without a kernel for the graph's types."""


def providers_for(device: str) -> list[str]:
    """ONNX Runtime providers for ``device`` ('cpu' or 'cuda').

    Raises:
        ValueError: unknown device, or the installed onnxruntime lacks its provider.
    """
    if device not in DEVICES:
        raise ValueError(f"device {device!r} must be one of {', '.join(DEVICES)}")
    provider = DEVICES[device]
    available = ort.get_available_providers()
    if provider not in available:
        raise ValueError(f"device {device!r} needs {provider}, but this onnxruntime only has {available}")
    return [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]


@dataclass
class GraphSession(GraphSpec):
    """One graph loaded by ONNX Runtime: its session, the file it was loaded from (the export's
    graph, or the pre-packed weights cache's saved copy of it), and its description (contract from
    ``metadata_props``, I/O shapes and ONNX element types such as ``'tensor(float)'``)."""

    session: ort.InferenceSession | None = None
    path: Path | None = None

    @classmethod
    def load(
        cls,
        name: str,
        path: Path,
        device: str = "cpu",
        threads: int = 0,
        config: dict[str, str] | None = None,
        dtype: Dtype = Dtype.FP32,
        weights: SharedWeights | None = None,
        activations: Activations = Activations.OWN,
        save_to: tuple[Path, str] | None = None,
        profile_dir: Path | None = None,
    ) -> GraphSession:
        """Load ``path`` with the providers of ``device``; ``threads`` 0 lets ORT choose (on the process's
        shared thread pool once :func:`shared_thread_pool` made one: its size, which ``threads`` must match);
        ``config``: session config entries (``SessionOptions.add_session_config_entry``);
        ``dtype``: the export's dtype (named in the error when ONNX Runtime lacks a kernel);
        ``weights``: read the external data from these shared mappings (see
        :mod:`.shared_weights`; None: ONNX Runtime maps and copies it for this session alone);
        ``activations``: where the activation memory lives between runs (:class:`Activations`; on
        CPU); ``save_to``: ``(graph file, data
        file name)``: also save the optimized graph there, its pre-packed weights in the data file
        (for :mod:`.prepacked`); ``profile_dir``: profile the session (ONNX Runtime's profiler),
        its file ``<profile_dir>/<name>_<time>.json`` written when the session ends.

        Raises:
            ContractError: the file is missing, unreadable, or carries no qwen35-onnx contract.
            ValueError: ``threads`` other than the process's shared thread pool's.
        """
        if not path.is_file():
            raise ContractError(f"{name} graph {str(path)!r} not found")
        options = session_options()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if _THREAD_POOL:
            if threads and _THREAD_POOL[0] != -1 and threads != _THREAD_POOL[0]:
                size = _THREAD_POOL[0]
                raise ValueError(
                    f"threads {threads}: this process runs ONNX Runtime on one shared pool of "
                    f"{size or 'the default number of'} threads (shared_thread_pool); ask for "
                    f"{f'{size} threads or 0' if size else '0 threads'}"
                )
        elif threads:
            options.intra_op_num_threads = threads
        if activations == Activations.SHARED:
            if device == "cpu" and shared_arena():
                options.enable_mem_pattern = False
                options.add_session_config_entry("session.use_env_allocators", "1")
            else:  # no arena that every bucket keeps a block of (the host side of a GPU session)
                options.enable_cpu_mem_arena = False
        if profile_dir is not None and save_to is None:  # a session made only to save a graph is not profiled
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(profile_dir) / name)
        for key, value in (config or {}).items():
            options.add_session_config_entry(key, value)
        if save_to is not None:
            options.optimized_model_filepath = str(save_to[0])
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", save_to[1])
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
            options.log_severity_level = 3  # not the warning that a saved graph is specific to this machine
        providers = providers_for(device)
        try:
            if weights is None:
                session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
            else:
                session = weights.open_session(path, options, providers)
        except Exception as exc:  # ORT raises its own classes (InvalidProtobuf, Fail, ...)
            missing = MISSING_KERNEL.search(str(exc))
            if missing:
                op, version, node = missing.groups()
                advice = (
                    "run this bf16 export with --runtime openvino, or re-export with --dtype fp16 or fp32"
                    if dtype == Dtype.BF16
                    else "re-export with --dtype fp32"
                )
                raise ContractError(
                    f"{name} graph {str(path)!r}: ONNX Runtime's {providers[0]} has no kernel for the operator {op} "
                    f"(opset {version}, node {node!r}) with the element types of this {dtype} export; {advice}"
                ) from exc
            raise ContractError(f"{name} graph {str(path)!r} cannot be loaded by ONNX Runtime: {exc}") from exc
        meta = session.get_modelmeta().custom_metadata_map
        if METADATA_KEY not in meta:
            raise ContractError(
                f"{name} graph {str(path)!r} has no {METADATA_KEY!r} metadata: not a qwen35-onnx export"
            )
        return cls(
            name=name,
            session=session,
            path=Path(path),
            contract=ShapeContract.from_json(meta[METADATA_KEY]),
            inputs={i.name: list(i.shape) for i in session.get_inputs()},
            outputs={o.name: list(o.shape) for o in session.get_outputs()},
            types={t.name: t.type for t in [*session.get_inputs(), *session.get_outputs()]},
        )


class OrtGraphSet(GraphSet):
    """The graphs of one export as ONNX Runtime sessions (see
    :class:`~qwen35_onnx.runtime.backend.GraphSet`: vision and decode at once, prefill buckets on
    first use, every graph cross-checked against the manifest). On CPU every session of an export
    reads one copy of the weights: fp32 exports share one map of the text weights
    (:attr:`weights`, see :mod:`.shared_weights`); quantized, fp16 and bf16 exports load every
    graph through the pre-packed weights cache (:attr:`prepacked`, see :mod:`.prepacked`;
    ``prepacked_cache``: True for its default folder (``$QWEN35_ONNX_PREPACKED_CACHE``, ``off``
    there turns it off), a folder, or False). ``share_weights=False`` gives each session its own
    (for comparison). Vision, prefill and chunk sessions share one CPU arena
    (:attr:`Activations.SHARED`; with an arena each, every loaded graph kept the activation memory
    of its last run, and without any, each run wrote to freshly mapped memory; ``docs/design.md``).

    Loaded prefill sessions are at most ``max_prefill_sessions`` (None: no fixed number; the least
    recently used go first). Where each session holds its own pre-packed weights (the cache off
    or unusable, e.g. too little disk, which warns; or ``share_weights=False``), they are also
    bounded by memory: before another one loads, the least recently used are dropped until the
    system's available memory (``MemAvailable``) holds one more session's weights
    (:meth:`session_cost`) plus :data:`MEMORY_RESERVE`. A dropped bucket loads again on its next
    use.

    Raises (constructor and :meth:`prefill`):
        ContractError: a graph is missing, or disagrees with the manifest.
        ValueError: ``max_prefill_sessions`` below 1, or ``prepacked_cache`` neither a bool nor a
            folder.
    """

    def __init__(
        self,
        root: Path,
        contract: ShapeContract,
        options: RuntimeOptions,
        *,
        share_weights: bool = True,
        max_prefill_sessions: int | None = None,
        prepacked_cache: bool | Path = True,
    ):
        if max_prefill_sessions is not None and (isinstance(max_prefill_sessions, bool) or max_prefill_sessions < 1):
            raise ValueError(f"max_prefill_sessions must be None or an integer >= 1, got {max_prefill_sessions!r}")
        device = self.device = options.device
        self.threads = options.intra_op_threads
        self.profile_dir = Path(options.profile_dir) if str(options.profile_dir) else None
        relayout = relayout_for(contract.dtype, contract.quantize)
        self.prepacked: PrepackedCache | None = None
        """The pre-packed weights cache every graph loads through (quantized, fp16 and bf16
        exports on CPU; see :mod:`.prepacked`), or None."""
        if not isinstance(prepacked_cache, (bool, str, os.PathLike)):
            raise ValueError(f"prepacked_cache must be True, False or a folder, got {prepacked_cache!r}")
        folder = default_directory() if prepacked_cache is True else prepacked_cache or None
        if share_weights and device == "cpu" and not relayout and folder is not None:
            try:
                self.prepacked = PrepackedCache(
                    root,
                    {"onnxruntime": ort.__version__, "config": session_config(contract)},
                    Path(folder),
                    "int" if contract.quantize != Quantization.NONE else "float16",
                )
            except PrepackedCacheError as exc:
                warn_unavailable(exc)
        self.weights = SharedWeights(relayout) if share_weights and device == "cpu" and not self.prepacked else None
        self.max_prefill_sessions = max_prefill_sessions
        super().__init__(root, contract)

    @property
    def packs_per_session(self) -> bool:
        """Whether every session holds its own copy of the (pre-packed) weights in host memory
        (the bound below reads the host's available memory; a GPU's is its provider's)."""
        return self.device == "cpu" and (self.weights is None or not self.weights.relayout) and self.prepacked is None

    def session_cost(self) -> int:
        """Bytes one more prefill session is expected to hold: 1.5 x the text weights file for
        exports whose sessions pack their own weights (4B int4: 2.6 GB file, 3.7 GB measured for
        a packed bucket), else 0 (they share the mapped weights)."""
        if not self.packs_per_session:
            return 0
        files = {
            (self.root / rel).parent / TEXT_WEIGHTS
            for key, rel in self.contract.graphs.items()
            if GraphKind.of(key) != GraphKind.VISION
        }
        return int(1.5 * sum(f.stat().st_size for f in files if f.is_file()))

    def prefill(self, bucket: int | None) -> GraphSession:
        """The prefill session for ``bucket`` (see :class:`OrtGraphSet` for which stay loaded)."""
        if bucket in self._prefill:
            self._prefill[bucket] = self._prefill.pop(bucket)  # most recently used last
        elif self._prefill and (self.packs_per_session or self.max_prefill_sessions is not None):
            self._make_room()
        return super().prefill(bucket)

    def _make_room(self) -> None:
        """Drop least recently used prefill sessions for one more (see :class:`OrtGraphSet`)."""
        cost = self.session_cost()  # 0 where sessions share their weights: only the fixed bound applies
        while self._prefill and (
            (self.max_prefill_sessions is not None and len(self._prefill) >= self.max_prefill_sessions)
            or (cost > 0 and available_memory() < cost + MEMORY_RESERVE)
        ):
            del self._prefill[next(iter(self._prefill))]
            release_freed_memory()

    def _read(self, key: str, path: Path) -> GraphSession:
        activations = Activations.OWN if GraphKind.of(key) == GraphKind.DECODE else Activations.SHARED
        if self.prepacked is not None:
            cache = self.prepacked
            try:
                return self._read_cached(key, path, activations)
            except (PrepackedCacheError, ContractError) as exc:
                # ContractError: ONNX Runtime failed while saving (e.g. a full disk), a damaged
                # saved graph (forgotten: made again next time), or a graph that cannot load at
                # all, which loading it the usual way below then reports
                if isinstance(exc, ContractError):
                    cache.forget(key)
                self._prepacked_in_use = cache  # its sessions still map its files: keep use.lock held
                self.prepacked, self.weights = None, SharedWeights(False)
                graph = self._read(key, path)
                warn_unavailable(exc)
                return graph
        # each vision graph has its own weights (a static-grid export loads a grid on its first image)
        weights = None if GraphKind.of(key) == GraphKind.VISION else self.weights
        return self._session(key, path, weights=weights, activations=activations)

    def _session(self, key: str, path: Path, **extra) -> GraphSession:
        """:meth:`GraphSession.load` of ``path`` with this set's device, threads, the export's session
        config and dtype, and ``extra`` (its ``weights``, ``activations``, ``save_to``)."""
        return GraphSession.load(
            key,
            path,
            self.device,
            self.threads,
            session_config(self.contract),
            self.contract.dtype,
            profile_dir=self.profile_dir,
            **extra,
        )

    def _read_cached(self, key: str, path: Path, activations: Activations) -> GraphSession:
        """Load ``key`` from the pre-packed weights cache (saving it there first if needed)."""

        def save(target: Path, data_name: str) -> None:
            self._session(key, path, activations=activations, save_to=(target, data_name))
            trim_heap()  # the packed weights of that session

        saved = self.prepacked.graph(key, path, save)
        packed = self.prepacked.path / PACKED
        before = mapped_starts(packed)
        graph = self._session(key, saved, activations=activations)
        self.prepacked.released += release_new_pages(packed, before)
        trim_heap()  # what loading allocated and freed (4B: about 0.17 GB per graph)
        return graph


MEMORY_RESERVE = 1 << 30
"""Bytes of available memory kept free when deciding whether another prefill session fits."""


def session_config(contract: ShapeContract) -> dict[str, str]:
    """Session config entries an export needs: a portable quantized export (blocked
    DequantizeLinear, which ONNX Runtime fuses into MatMulNBits when it loads the graph) gets the
    manifest's ``quant_accuracy_level`` as ``session.qdq_matmulnbits_accuracy_level`` (ONNX
    Runtime's session option for that fusion; its own default is 4)."""
    if contract.quantize != Quantization.NONE and contract.ops == Ops.PORTABLE:
        return {"session.qdq_matmulnbits_accuracy_level": str(contract.quant_accuracy_level)}
    return {}
