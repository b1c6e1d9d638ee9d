"""The one small interface between the shared runtime code and a runtime backend (no torch).

Everything that is the same on every runtime lives beside this module: the decode loop
(:mod:`.generation`), prompt checks and positions (:mod:`.prompt`, :mod:`.positions`), masks,
sampling and the contract checks (:mod:`.checks`). A backend only

- loads (compiles) the graphs and describes each one as a :class:`~.checks.GraphSpec` for the
  shared checks (:class:`GraphSet`: vision and decode at once, each prefill bucket on first use);
- runs the vision graph (host in, host out);
- runs a prefill graph: host feeds in, the last logits on the host and the three states in the
  runtime's own device-resident form out (host arrays with ``host_state_roundtrip``);
- runs a chunk graph (chunked prefill): host feeds and the past states in, the logits and the new
  states out (:meth:`Backend.run_chunk`);
- moves states to and from host arrays (:meth:`Backend.states_to_host`,
  :meth:`Backend.states_from_host`: what a :class:`~.snapshots.StateSnapshot` keeps);
- builds a :class:`Decoder` from those states, whose ``step`` runs one decode step;
- says what memory its graphs share (:meth:`Backend.shared_weight_bytes`) and drops prefill
  graphs on request (:meth:`Backend.unload_prefill`).

Two backends, each in its own package: ONNX Runtime (:mod:`.onnxruntime`) and OpenVINO
(:mod:`.openvino`); :func:`~.select.open_backend` picks one by name and hands it the
:class:`RuntimeOptions` every surface shares. The backends import this module, never each other.
"""

from __future__ import annotations

import abc
import functools
import numbers
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..contract import MAX_DRAFT_TOKENS, ContractError, KvMode, ShapeContract, plain
from ..onnxfile.complete import check_export_files, check_external_data
from ..options import option
from .checks import (
    GraphSpec,
    check_chunk,
    check_decode,
    check_metadata,
    check_mtp,
    check_prefill,
    check_verify,
    check_vision,
)
from .draft_buffers import MtpCache, VerifyBuffers
from .kv_codec import KvCodec
from .vision_positions import vision_position_inputs


class Runtime(StrEnum):
    """The runtimes that run an export."""

    ONNXRUNTIME, OPENVINO = "onnxruntime", "openvino"


class Precision(StrEnum):
    """Inference precision: f32 (the default; parity with transformers), bf16 / f16 (OpenVINO only:
    its ``INFERENCE_PRECISION_HINT``; inputs, outputs and states stay fp32)."""

    F32, BF16, F16 = "f32", "bf16", "f16"


THREADS_ENV = "QWEN35_ONNX_THREADS"
"""Environment variable: the intra-op threads when :attr:`RuntimeOptions.threads` is 0."""


@dataclass(frozen=True)
class RuntimeOptions:
    """How an export is run (``generate``, ``chat``, ``serve``, ``verify`` and
    :meth:`~qwen35_onnx.pipeline.Pipeline.from_exported` take these).

    Attributes:
        runtime: ONNX Runtime (the default) or OpenVINO.
        device: ONNX Runtime 'cpu' or 'cuda'; OpenVINO a device name ('CPU', 'GPU', 'NPU', ... as
            present; lowercase accepted).
        precision: 'f32', or with OpenVINO 'bf16' / 'f16' (its inference precision hint).
        threads: intra-op threads, at most the CPUs this process may run on (:func:`usable_cpus`);
            0: ``$QWEN35_ONNX_THREADS`` if set (e.g. for several processes on one machine), else the
            runtime's default (see :attr:`intra_op_threads`).
        host_state_roundtrip: copy every state to host every decode step (for comparison).
        draft_tokens: speculative decoding with the export's MTP head, this many draft tokens a round (1 to the
            export's ``--draft-tokens``; 0: off), see :mod:`.speculative`.
        profile_dir: ONNX Runtime only: profile every graph session (its profiler: each node's
            kernel time, in microseconds) and write each profile into this folder as
            ``<graph>_<time>.json`` (Chrome trace format) when the session ends; '' (the default):
            no profiling. ``qwen35-onnx bench --profile`` reads them.
        vision_grid_cache: OpenVINO with an any-grid export: 0 (the default) compiles the vision graph once with
            its patch count dynamic (one copy of the weights; a device that refuses dynamic shapes gets 4); N >= 1
            reshapes it to each grid and compiles it static on first use, the N most recently used kept (each
            compiled grid holds its own copy of the vision weights: OpenVINO's CPU plugin shares none).
    """

    runtime: Runtime = option(
        Runtime.ONNXRUNTIME, "--runtime", "onnxruntime or openvino (static graphs of a fixed-KV --ops portable export)."
    )
    device: str = option(
        "cpu", "--device", "onnxruntime: cpu or cuda; openvino: an OpenVINO device (cpu, gpu, npu, ... as present)."
    )
    precision: Precision = option(
        Precision.F32,
        "--precision",
        "f32 (parity with transformers); openvino also bf16 or f16 (its inference precision hint).",
    )
    threads: int = option(
        0,
        "--threads",
        f"Intra-op threads, at most the usable CPUs (0: ${THREADS_ENV} if set, else the runtime's default).",
    )
    host_state_roundtrip: bool = option(
        False, "--host-state-roundtrip", "Copy states to host every decode step (for comparison)."
    )
    draft_tokens: int = option(
        0,
        "--draft-tokens",
        "Speculative decoding: draft this many tokens a round with the export's MTP head and check them in one run "
        "(1 to the export's --draft-tokens; 0: off). Greedy output is unchanged (fp32 exports; int4 rounds "
        "slightly differently), sampled output keeps its distribution; a speculation slower than plain decoding "
        "stops itself.",
    )
    profile_dir: str = option(
        "",
        "--profile-dir",
        "onnxruntime: write each graph session's profile (per-node kernel times, JSON) into this folder.",
    )
    vision_grid_cache: int = option(
        0,
        "--vision-grid-cache",
        "openvino with an any-grid export: 0 compiles the vision graph once with its patch count dynamic (one copy "
        "of the weights; where the device refuses that, 4); N >= 1 compiles it for each grid, static, on first use "
        "and keeps the N most recently used (each with its own copy of the vision weights).",
    )

    def validate(self) -> None:
        """Check the names and numbers (the device is checked by the backend that opens it).

        Raises:
            ValueError: naming the value and the choices.
        """
        if self.runtime not in tuple(Runtime):
            raise ValueError(f"runtime {plain(self.runtime)!r} must be one of {', '.join(Runtime)}")
        if self.precision not in tuple(Precision):
            raise ValueError(f"precision {plain(self.precision)!r} must be one of {', '.join(Precision)}")
        if self.runtime == Runtime.ONNXRUNTIME and self.precision != Precision.F32:
            raise ValueError(
                f"precision {plain(self.precision)!r} needs runtime 'openvino' (ONNX Runtime runs the graphs in their "
                "exported dtype: precision f32)"
            )
        if isinstance(self.threads, bool) or not isinstance(self.threads, numbers.Integral) or self.threads < 0:
            raise ValueError(f"threads must be an integer >= 0 (0: the runtime's default), got {self.threads!r}")
        if self.threads > usable_cpus():
            raise ValueError(
                f"threads {self.threads} is more than the {usable_cpus()} CPUs this process may run on "
                "(more threads than CPUs only wait for each other)"
            )
        cache = self.vision_grid_cache
        if isinstance(cache, bool) or not isinstance(cache, numbers.Integral) or cache < 0:
            raise ValueError(
                f"vision_grid_cache must be an integer >= 0 (0: one dynamic compile; N: compiled grids kept), "
                f"got {cache!r}"
            )
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, numbers.Integral):
            raise ValueError(
                f"draft_tokens must be an integer from 0 (off) to {MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}"
            )
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens {self.draft_tokens} must be from 0 (off) to {MAX_DRAFT_TOKENS}")
        if self.draft_tokens and self.runtime == Runtime.ONNXRUNTIME and str(self.device).lower() != "cpu":
            raise ValueError(
                f"draft_tokens {self.draft_tokens}: speculative decoding on ONNX Runtime runs on the CPU (its "
                f"per-position states are host buffers), not on device {self.device!r}; run with draft_tokens 0 there"
            )
        if not isinstance(self.host_state_roundtrip, bool):
            raise ValueError(f"host_state_roundtrip must be true or false, got {self.host_state_roundtrip!r}")
        if not isinstance(self.profile_dir, (str, os.PathLike)):
            raise ValueError(f"profile_dir must be a folder path or '', got {self.profile_dir!r}")
        if str(self.profile_dir) and self.runtime != Runtime.ONNXRUNTIME:
            raise ValueError(
                f"profile_dir {str(self.profile_dir)!r} needs runtime 'onnxruntime' (ONNX Runtime's profiler), "
                f"not {plain(self.runtime)!r}"
            )
        self.intra_op_threads  # noqa: B018 - a bad environment value fails here, naming it

    @property
    def intra_op_threads(self) -> int:
        """The intra-op thread count the backend asks for: :attr:`threads`, else
        ``$QWEN35_ONNX_THREADS``, else 0 (the runtime's default).

        Raises:
            ValueError: ``$QWEN35_ONNX_THREADS`` is not an integer from 0 to :func:`usable_cpus`.
        """
        if self.threads:
            return int(self.threads)
        text = os.environ.get(THREADS_ENV, "").strip()
        if not text:
            return 0
        if not text.isdigit() or int(text) > usable_cpus():
            raise ValueError(f"${THREADS_ENV} {text!r} must be an integer from 0 to {usable_cpus()} (the usable CPUs)")
        return int(text)


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Decoder(Protocol):
    """One generation's decode state, kept by the backend between steps."""

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        active_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one decode step on ``input_ids`` ``[S, 1]``, ``attention_mask`` ``[S, W]`` (fixed KV: W the
        KV width of the states the decoder was built from, the capacity or a KV tier; one column more per step in
        dynamic mode) and ``position_ids`` ``[4, S, 1]``
        (int64), ``S`` the export's decode slots (1 unless exported with ``--slots``; then also
        ``active_rows`` ``[S]`` bool, the rows that step, see :class:`~.slots.SlotPool`); returns the
        logits ``[S, 1, V]`` fp32 as a host array the caller owns: the decoder does not write into it
        again while it, or a view of it, is referenced (it may reuse it once it is dropped)."""
        ...

    def states(self) -> dict[str, Any]:
        """The states after the last step (or the ones the decoder started from), keyed
        ``present_conv_states``, ``present_recurrent_states``, ``present_kv_cache``, in the backend's
        form; the decoder's own buffers (copy them before the next step)."""
        ...


class GraphSet(abc.ABC):
    """The graphs of one export as one backend loaded them. Decode and the any-grid vision graph
    load (and are cross-checked) at once; each prefill graph (one per bucket in fixed mode) and each
    static vision grid loads on first use and is cross-checked then, before it runs, so unused
    buckets and grids cost no memory. Each graph is loaded once per GraphSet (a prefill graph until
    :meth:`unload_prefill`).

    A backend implements :meth:`_read` (open one graph file and describe it) and may implement
    :meth:`_prepare` (compile it, after it passed the checks).

    Raises (constructor and :meth:`prefill`):
        ContractError: a graph is missing, or disagrees with the manifest (see :mod:`.checks`).
    """

    def __init__(self, root: Path, contract: ShapeContract):
        self.root, self.contract = Path(root), contract
        self._prefill: dict[int | None, GraphSpec] = {}
        self._chunk: dict[int, GraphSpec] = {}
        self._verify: dict[int, GraphSpec] = {}
        self._mtp: dict[int, GraphSpec] = {}
        self._vision: dict[tuple[int, int] | None, GraphSpec] = {}
        check_export_files(self.root, contract)
        if not contract.static_vision:
            self.vision(None)
        self.decode = self._load("decode", check_decode)

    @abc.abstractmethod
    def _read(self, key: str, path: Path) -> GraphSpec:
        """Open the graph file ``path`` (manifest key ``key``) and describe it.

        Raises:
            ContractError: the file is missing, unreadable, or carries no qwen35-onnx contract.
        """

    def _prepare(self, graph: GraphSpec) -> GraphSpec:
        """Make a checked graph ready to run (e.g. compile it); the default does nothing."""
        return graph

    def _load(self, key: str, check) -> GraphSpec:
        if key not in self.contract.graphs:
            raise ContractError(f"manifest.json lists no {key!r} graph (has {sorted(self.contract.graphs)})")
        path = self.root / self.contract.graphs[key]
        check_external_data(key, path)
        graph = self._read(key, path)
        check_metadata(self.contract, graph)
        check(self.contract, graph)
        return self._prepare(graph)

    def vision(self, grid: tuple[int, int] | None) -> GraphSpec:
        """The vision graph for an image of patch grid ``(h, w)``: the any-grid graph (loaded with the
        set), or the static graph of that grid (loaded, compiled and cross-checked on its first use).

        Raises:
            ContractError: a grid the export does not serve (see
                :meth:`~qwen35_onnx.contract.ShapeContract.check_grid`), or a graph that disagrees
                with the manifest.
        """
        if grid is not None:
            self.contract.check_grid(tuple(grid))
        key = tuple(grid) if grid is not None and self.contract.static_vision else None
        if key not in self._vision:
            name = self.contract.vision_graph_key(key)
            self._vision[key] = self._load(name, lambda contract, graph: check_vision(contract, graph, key))
        return self._vision[key]

    @property
    def loaded_grids(self) -> list[tuple[int, int] | None]:
        """The vision grids whose graphs are loaded (None: the any-grid graph)."""
        return list(self._vision)

    def prefill(self, bucket: int | None) -> GraphSpec:
        """The prefill graph for ``bucket`` tokens (``None``: the dynamic-length graph)."""
        if bucket not in self._prefill:
            key = self.contract.prefill_graph_key(bucket)
            self._prefill[bucket] = self._load(key, lambda contract, graph: check_prefill(contract, graph, bucket))
        return self._prefill[bucket]

    def _sized(self, loaded: dict, size: int, sizes, key: str, check, missing: str) -> GraphSpec:
        """The graph of ``size`` among ``sizes`` kept in ``loaded`` (loaded and cross-checked with ``check`` on its
        first use, under manifest key ``key``); a ContractError saying ``missing`` for a size the export lacks."""
        if size not in loaded:
            if size not in sizes:
                raise ContractError(missing)
            loaded[size] = self._load(key, lambda contract, graph: check(contract, graph, size))
        return loaded[size]

    def chunk(self, size: int) -> GraphSpec:
        """The chunk graph of ``size`` tokens (loaded and cross-checked on its first use).

        Raises:
            ContractError: the export has no chunk graph of that size, or it disagrees with the manifest.
        """
        c = self.contract
        missing = f"the export has no prefill chunk of {size} tokens (chunks {list(c.prefill_chunks)})"
        return self._sized(self._chunk, size, c.prefill_chunks, c.chunk_graph_key(size), check_chunk, missing)

    def verify(self, size: int) -> GraphSpec:
        """The verify graph of ``size`` tokens (a draft length of ``size - 1``; loaded and cross-checked on its
        first use).

        Raises:
            ContractError: the export has no verify graph of that size, or it disagrees with the manifest.
        """
        c = self.contract
        missing = (
            f"the export has no verify graph of {size} tokens (draft tokens {size - 1}; the export verifies up to "
            f"{c.draft_tokens})"
        )
        return self._sized(self._verify, size, c.verify_sizes, c.verify_graph_key(size), check_verify, missing)

    def mtp(self, size: int) -> GraphSpec:
        """The MTP graph of ``size`` positions (loaded and cross-checked on its first use).

        Raises:
            ContractError: the export has no MTP graph of that size, or it disagrees with the manifest.
        """
        c = self.contract
        missing = f"the export has no MTP graph of {size} positions (sizes {list(c.mtp_sizes)})"
        return self._sized(self._mtp, size, c.mtp_sizes, c.mtp_graph_key(size), check_mtp, missing)

    @property
    def loaded_chunks(self) -> list[int]:
        """The chunk sizes whose graphs are loaded."""
        return list(self._chunk)

    @property
    def loaded_buckets(self) -> list[int | None]:
        """The prefill buckets loaded now, least recently used first."""
        return list(self._prefill)

    def unload_prefill(self) -> None:
        """Drop every loaded prefill and chunk graph; each loads again on its next use."""
        self._prefill.clear()
        self._chunk.clear()


class Backend(abc.ABC):
    """A runtime that runs the graphs of one export.

    Attributes:
        runtime: which runtime this is.
        contract: the manifest's contract.
        graphs: the loaded, cross-checked graphs.
        device: the device the graphs run on, in the runtime's words.
        precision: the inference precision.
        host_state_roundtrip: states go through host arrays between steps (for comparison).
    """

    runtime: Runtime
    contract: ShapeContract
    graphs: GraphSet
    device: str
    precision: Precision
    host_state_roundtrip: bool

    def load_prefill(self, bucket: int | None) -> None:
        """Load (compile) and cross-check the prefill graph of ``bucket`` now, before it runs; on an
        export with prefill chunks, every chunk graph (``bucket`` is then the prompt's length).

        Raises:
            ContractError: the graph is missing or disagrees with the manifest.
        """
        if self.contract.prefill_chunks:
            for size in self.contract.prefill_chunks:
                self.graphs.chunk(size)
            return
        self.graphs.prefill(bucket)

    def unload_prefill(self) -> None:
        """Drop the loaded prefill and chunk graphs (they load again on next use) and hand their memory
        back (their weights; ONNX Runtime's shared activation arena stays for the next run, see
        :class:`~qwen35_onnx.runtime.onnxruntime.sessions.Activations`)."""
        from ..host_memory import release_freed_memory

        self.graphs.unload_prefill()
        release_freed_memory()

    def shared_weight_bytes(self) -> dict[str, int]:
        """Bytes of weights the loaded graphs share instead of each holding its own copy, by kind
        (empty where they share nothing); see each backend."""
        return {}

    def run_vision(self, grid: tuple[int, int], pixel_values: np.ndarray) -> np.ndarray:
        """The vision graph of ``grid`` (patches down, across) on one image's patches ``[h * w,
        patch_dim]`` fp32, with the grid's position-embedding taps and rotary ids
        (:func:`~.vision_positions.vision_position_inputs`); returns its embeddings ``[h * w /
        merge**2, image_embed_dim]`` fp32 (a host array the caller owns).

        Raises:
            ContractError: a grid the export does not serve.
            ValueError: ``pixel_values`` of another shape than the grid's.
        """
        c = self.contract
        h, w = grid
        if pixel_values.shape != (h * w, c.patch_dim):
            raise ValueError(
                f"pixel_values of a {h}x{w} grid must have shape {(h * w, c.patch_dim)}, got {pixel_values.shape}"
            )
        graph = self.graphs.vision((h, w))
        feeds = vision_position_inputs((1, h, w), c.pos_embed_side, c.spatial_merge_size)
        return self._run_vision(graph, {"pixel_values": pixel_values, **feeds})

    @abc.abstractmethod
    def _run_vision(self, graph: GraphSpec, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Run a vision graph (as :meth:`GraphSet.vision` loaded it) on host ``feeds``; returns
        ``image_embeds`` as a host array the caller owns."""

    @abc.abstractmethod
    def run_prefill(self, bucket: int | None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, Any]]:
        """Prefill graph of ``bucket`` on host ``feeds`` (``input_ids``, ``attention_mask``,
        ``position_ids``, ``image_embeds``); returns the logits ``[1, R, V]`` (host) and the
        states ``present_conv_states``, ``present_recurrent_states``, ``present_kv_cache`` in the
        backend's device-resident form (host arrays with ``host_state_roundtrip``), fresh for
        each call."""

    @abc.abstractmethod
    def run_chunk(
        self, size: int, feeds: dict[str, np.ndarray], states: dict[str, Any]
    ) -> tuple[np.ndarray, dict[str, Any], np.ndarray | None]:
        """The chunk graph of ``size`` tokens (:class:`~qwen35_onnx.export.graphs.ChunkGraph`) on host
        ``feeds`` (``input_ids``, ``chunk_mask``, ``attention_mask``, ``position_ids``,
        ``image_embeds``) after ``states`` (keyed as :meth:`run_prefill` returns them, which this
        call takes over: the KV cache may be written in place); returns the logits ``[1, R, V]``
        (host), the new states in the same form, and in an export with draft tokens the hidden states of
        every position ``[1, size, hidden]`` fp32 (host; else None).

        Raises:
            ContractError: the export has no chunk graph of ``size``.
        """

    def check_speculation(self) -> None:
        """Whether this backend, on its device, runs speculative decoding (the verify and MTP graphs): on the CPU
        (the per-position states and the MTP head's cache are host buffers; ONNX Runtime's CUDA would need device
        buffers, OpenVINO's GPU and NPU were not tried).

        Raises:
            ContractError: another device, named.
        """
        if str(self.device).lower() != "cpu":
            raise ContractError(
                f"speculative decoding on {self.runtime} runs on the CPU (its per-position states are host "
                f"buffers), not on device {self.device!r}; run with --draft-tokens 0"
            )

    def run_verify(
        self, size: int, feeds: dict[str, np.ndarray], states: dict[str, Any], buffers: VerifyBuffers
    ) -> tuple[np.ndarray, np.ndarray, Any]:
        """The verify graph of ``size`` tokens (:class:`~qwen35_onnx.export.graphs.VerifyGraph`) on host ``feeds``
        (``input_ids [1, size]``, ``attention_mask [1, L]``, ``position_ids [4, 1, size]``) after ``states`` (keyed
        as :meth:`run_prefill` returns them; the KV cache may be written in place), writing the states of every
        position into ``buffers`` (from :meth:`verify_buffers`, not the ones ``states`` point into). Returns the
        logits ``[1, size, V]`` and hidden states ``[1, size, hidden]`` (host, fp32) and the run's result for
        :meth:`states_after`.

        Raises:
            ContractError: this backend does not run speculative decoding, or the export has no such graph.
        """
        raise ContractError(f"the {self.runtime} backend does not run speculative decoding")

    def verify_buffers(self, width: int | None = None) -> VerifyBuffers:
        """Host buffers for the states of every position of a verify run (the largest one,
        :attr:`ShapeContract.draft_tokens` + 1 positions; a KV cache ``width`` tokens wide, default the capacity); a
        speculation alternates two of them.

        Raises:
            ContractError: see :meth:`check_speculation`.
        """
        self.check_speculation()
        return VerifyBuffers.new(self.contract, width)

    def states_after(self, result: Any, position: int) -> dict[str, Any]:
        """The states after ``position`` (0-based, among the verify run's tokens) of a :meth:`run_verify` result,
        keyed as :meth:`run_prefill` returns them: views of the run's buffers, no copy (the KV cache holds every
        position's slots; the mask decides which are in use); host arrays with :attr:`host_state_roundtrip`."""
        return result.states_after(position, host=self.host_state_roundtrip)

    def run_mtp(self, size: int, feeds: dict[str, np.ndarray], kv: MtpCache) -> tuple[np.ndarray, np.ndarray, Any]:
        """The MTP graph of ``size`` positions (:class:`~qwen35_onnx.export.graphs.MtpGraph`) on host ``feeds``
        after the head's KV cache ``kv`` (from :meth:`mtp_cache`, which this call takes over); returns the draft
        logits ``[1, 1, V]`` and ``mtp_hidden [1, 1, hidden]`` (host, fp32) and the KV cache after the run."""
        raise ContractError(f"the {self.runtime} backend does not run speculative decoding")

    def mtp_cache(self, width: int | None = None) -> MtpCache:
        """The MTP head's empty KV cache (:meth:`ShapeContract.mtp_kv_shape_at` ``width``, default the capacity;
        zeros, host buffers).

        Raises:
            ContractError: see :meth:`check_speculation`.
        """
        self.check_speculation()
        return MtpCache.new(self.contract, width)

    @abc.abstractmethod
    def states_to_host(self, states: dict[str, Any], kv_length: int | None = None) -> dict[str, np.ndarray]:
        """Host copies (the caller owns them) of ``states`` keyed as :meth:`run_prefill` returns them;
        with ``kv_length`` only the KV cache's first ``kv_length`` slots."""

    @functools.cached_property
    def export_id(self) -> str:
        """:func:`~.snapshots.export_fingerprint` of this export (what a state snapshot is tied to)."""
        from .snapshots import export_fingerprint

        return export_fingerprint(self.graphs.root, self.contract)

    @abc.abstractmethod
    def states_from_host(
        self, arrays: dict[str, np.ndarray], kv_dtype: str | None = None, width: int | None = None
    ) -> dict[str, Any]:
        """States in the backend's form (fresh buffers) holding the host ``arrays`` keyed
        ``present_conv_states``, ``present_recurrent_states``, ``present_kv_cache`` (the contract's
        stacked shapes and dtypes, the KV cache in ``kv_dtype``, by default the decode graphs'
        :attr:`~qwen35_onnx.contract.ShapeContract.kv_precision`, and ``width`` tokens wide: a KV tier, by default
        the capacity; the KV cache may hold fewer slots than the width, as a snapshot's does: the other slots are
        zero)."""

    def zero_states(self, width: int | None = None) -> dict[str, Any]:
        """The states of an empty prompt: zeros in the contract's stacked shapes and dtypes (fixed
        KV, ``width`` tokens wide, default the capacity), in the backend's form, for the prompt's graphs (the KV
        cache in :attr:`~qwen35_onnx.contract.ShapeContract.prompt_kv_dtype`)."""
        kv_dtype = self.contract.prompt_kv_dtype
        return self.states_from_host(zero_state_arrays(self.contract, kv_dtype), kv_dtype=kv_dtype, width=width)

    @functools.cached_property
    def kv_codec(self) -> KvCodec:
        """How this export's KV cache passes between its prompt graphs and its decode graphs (:mod:`.kv_codec`).

        Raises:
            ContractError: an int8 export without its scales.
        """
        return KvCodec.for_export(self.graphs.root, self.contract)

    def decode_states(self, states: dict[str, Any], length: int) -> dict[str, Any]:
        """``states`` of the prompt's graphs (a prefill's or the chunks', keyed as :meth:`run_prefill` returns them)
        in the form the decode and verify graphs take: the KV cache's first ``length`` slots converted to the
        contract's KV precision (new buffers of the same KV width; :mod:`.kv_codec`), or ``states`` themselves
        where the two dtypes agree."""
        if not self.contract.converts_kv:
            return states
        width = self.state_shape(states["present_kv_cache"])[3]
        arrays = self.states_to_host(states, kv_length=length)
        arrays["present_kv_cache"] = self.kv_codec.to_decode(arrays["present_kv_cache"])
        return self.states_from_host(arrays, width=width)

    def prompt_states_from_host(self, arrays: dict[str, np.ndarray], width: int | None = None) -> dict[str, Any]:
        """States for the prompt's graphs from host ``arrays`` in the decode form (a kept
        :class:`~.snapshots.StateSnapshot`'s): :meth:`states_from_host` (the KV cache ``width`` tokens wide) with
        the KV cache converted to :attr:`~qwen35_onnx.contract.ShapeContract.prompt_kv_dtype`."""
        kv_dtype = self.contract.prompt_kv_dtype
        if self.contract.converts_kv:
            arrays = {**arrays, "present_kv_cache": self.kv_codec.to_prompt(arrays["present_kv_cache"])}
        return self.states_from_host(arrays, kv_dtype=kv_dtype, width=width)

    def widen_states(
        self, states: dict[str, Any], width: int, length: int, kv_dtype: str | None = None
    ) -> dict[str, Any]:
        """States whose KV cache is ``width`` tokens wide (another KV tier: a move up, or down in a slot pool)
        holding ``states``' conv and recurrent states and their first ``length`` KV slots (``length <= width``), in
        fresh buffers of this backend's form with the KV cache in ``kv_dtype`` (that of ``states``: by default the
        decode graphs', the prompt graphs' ``prompt_kv_dtype`` for a prefill's states). The KV slots are copied
        once, host array to host array where the host can address them (:meth:`state_views`), else through host
        copies. ``states`` are left as they were."""
        try:
            old = self.state_views(states)["present_kv_cache"]
        except ContractError:  # states on a device: through the host
            arrays = self.states_to_host(states, kv_length=length)
            return self.states_from_host(arrays, kv_dtype=kv_dtype, width=width)
        new = self.states_from_host(self.states_to_host(states, kv_length=0), kv_dtype=kv_dtype, width=width)
        np.copyto(self.state_views(new)["present_kv_cache"][:, :, :, :length], old[:, :, :, :length])
        return new

    @abc.abstractmethod
    def decoder(self, states: dict[str, Any]) -> Decoder:
        """A decoder that starts from the prefill ``states`` (which it takes over)."""

    @staticmethod
    @abc.abstractmethod
    def state_shape(value: Any) -> list[int]:
        """Shape of one state as :meth:`run_prefill` returned it."""

    def slot_decoder(self, width: int | None = None) -> Decoder:
        """A decoder over the states of every decode slot of the export (:attr:`ShapeContract.slots`
        rows, zeros: :meth:`ShapeContract.slot_state_shape`, the KV cache ``width`` tokens wide, default the
        capacity), for :class:`~.slots.SlotPool`.

        Raises:
            ContractError: a device whose states the host cannot address (slots are copied in and out
                of the states as host arrays, see :meth:`state_views`).
        """
        return self.decoder(self._zero_slot_states(width))

    def _zero_slot_states(self, width: int | None = None) -> dict[str, Any]:
        """Zeros in the slot-wide shapes (the KV cache ``width`` tokens wide), in this backend's form (by default
        host arrays)."""
        arrays = {}
        for state in ("conv_states", "recurrent_states", "kv_cache"):
            dtype = self.contract.state_dtype(state)
            if dtype not in STATE_NUMPY_DTYPES:
                raise ContractError(f"{state} of a {dtype} export cannot be held in host memory (numpy has no {dtype})")
            shape = self.contract.slot_state_shape(state, width)
            arrays[f"present_{state}"] = np.zeros(shape, STATE_NUMPY_DTYPES[dtype])
        return arrays

    def state_views(self, states: dict[str, Any]) -> dict[str, np.ndarray]:
        """Host arrays that ARE ``states`` (same memory, writable; ``present_*`` keys): how a slot's rows
        are read and written without a copy of the others (by default the states are host arrays).

        Raises:
            ContractError: the states live on a device the host cannot address.
        """
        if not all(isinstance(value, np.ndarray) for value in states.values()):
            raise ContractError(f"the {self.runtime} states are not host arrays: decode slots cannot address them")
        return dict(states)


STATE_NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
"""numpy dtypes of the state dtypes numpy can hold (a bf16 export keeps its states on the runtime)."""


def fill_state(target: np.ndarray, value: np.ndarray, zeroed: bool = False) -> None:
    """Write the host state ``value`` into ``target`` (its full shape): a KV cache narrower than the
    target fills its first slots and the rest become zero (left as they are where ``target`` is ``zeroed``
    already, e.g. :func:`~qwen35_onnx.host_memory.reserve_zeros`: writing zeros there would commit every page of the
    capacity)."""
    if target.shape == value.shape:
        np.copyto(target, value)
        return
    width = value.shape[3]
    target[:, :, :, :width] = value
    if not zeroed:
        target[:, :, :, width:] = 0


def host_inputs(contract: ShapeContract, rows: int, width: int | None = None) -> dict[str, np.ndarray]:
    """Zeroed host buffers of the decode graph's inputs other than the states
    (:attr:`ShapeContract.decode_host_inputs`), for a step of ``rows`` rows: ``input_ids [rows, 1]``,
    ``attention_mask [rows, width]`` (a KV tier, default the capacity), ``position_ids [4, rows, 1]`` int64, and
    with several slots ``active_rows [rows]`` bool."""
    host = {
        "input_ids": np.zeros((rows, 1), dtype=np.int64),
        "attention_mask": np.zeros((rows, width or contract.capacity), dtype=np.int64),
        "position_ids": np.zeros((4, rows, 1), dtype=np.int64),
    }
    if "active_rows" in contract.decode_host_inputs:
        host["active_rows"] = np.zeros(rows, dtype=np.bool_)
    return host


def zero_state_arrays(contract: ShapeContract, kv_dtype: str | None = None) -> dict[str, np.ndarray]:
    """Host zeros of the three states (``present_*`` keys, stacked), the KV cache holding no slot (``[2 * n_full,
    1, Hkv, 0, D]``, as a snapshot of no tokens: :meth:`Backend.states_from_host` makes it as wide as asked, where a
    backend can without committing the width's memory) in ``kv_dtype`` (by default the decode graphs').

    Raises:
        ContractError: a state dtype numpy cannot hold (bf16).
    """
    arrays = {}
    for state in ("conv_states", "recurrent_states", "kv_cache"):
        dtype = kv_dtype if state == "kv_cache" and kv_dtype else contract.state_dtype(state)
        if dtype not in STATE_NUMPY_DTYPES:
            raise ContractError(f"{state} of a {dtype} export cannot be held in host memory (numpy has no {dtype})")
        shape = list(contract.state_shape(state))
        if state == "kv_cache" and contract.kv_mode == KvMode.FIXED:
            shape[3] = 0
        arrays[f"present_{state}"] = np.zeros(shape, dtype=STATE_NUMPY_DTYPES[dtype])
    return arrays
