"""The one small interface between the shared decode loop and a runtime (no torch).

:class:`~qwen35_onnx.pipeline.Pipeline` owns everything that is the same on every runtime:
preprocessing, positions, masks, sampling, stop criteria, the decode loop and the contract
checks (:mod:`.checks`). A backend only

- loads (compiles) the graphs and describes each one as a :class:`~.checks.GraphSpec` for the
  shared checks (:class:`GraphSet`: vision and decode at once, each prefill bucket on first use);
- runs the vision graph (host in, host out);
- runs a prefill graph: host feeds in, the last logits on the host and the three states in the
  runtime's own device-resident form out (host arrays with ``host_state_roundtrip``);
- builds a :class:`Decoder` from those states, whose ``step`` runs one decode step.

Two backends: ONNX Runtime (:mod:`.ort_backend`, the default) and OpenVINO
(:mod:`.openvino_backend`). :func:`open_backend` picks one and checks the options first.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..contract import ContractError, ShapeContract
from .checks import GraphSpec, check_decode, check_export_files, check_metadata, check_prefill, check_vision

RUNTIMES = ("onnxruntime", "openvino")
PRECISIONS = ("f32", "bf16", "f16")
"""Inference precision: f32 (the default; parity with transformers), bf16 / f16 (OpenVINO only:
its ``INFERENCE_PRECISION_HINT``; inputs, outputs and states stay fp32)."""


class Decoder(Protocol):
    """One generation's decode state, kept by the backend between steps."""

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run one decode step on ``input_ids`` ``[1, 1]``, ``attention_mask`` ``[1, capacity]``
        (fixed KV; one column more per step in dynamic mode) and ``position_ids`` ``[4, 1, 1]``
        (int64); returns the logits ``[1, 1, V]`` fp32 as a host array the caller owns."""
        ...


class GraphSet(abc.ABC):
    """The graphs of one export as one backend loaded them. Vision and decode load (and are
    cross-checked) at once; each prefill graph (one per bucket in fixed mode) loads on first use
    and is cross-checked then, before it runs, so unused buckets cost no memory. Each graph is
    loaded once per GraphSet.

    A backend implements :meth:`_read` (open one graph file and describe it) and may implement
    :meth:`_prepare` (compile it, after it passed the checks).

    Raises (constructor and :meth:`prefill`):
        ContractError: a graph is missing, or disagrees with the manifest (see :mod:`.checks`).
    """

    def __init__(self, root: Path, contract: ShapeContract):
        self.root, self.contract = Path(root), contract
        self._prefill: dict[int | None, GraphSpec] = {}
        check_export_files(self.root, contract)
        self.vision = self._load("vision", check_vision)
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
        graph = self._read(key, self.root / self.contract.graphs[key])
        check_metadata(self.contract, graph)
        check(self.contract, graph)
        return self._prepare(graph)

    def prefill(self, bucket: int | None) -> GraphSpec:
        """The prefill graph for ``bucket`` tokens (``None``: the dynamic-length graph)."""
        if bucket not in self._prefill:
            key = self.contract.prefill_graph_key(bucket)
            self._prefill[bucket] = self._load(key, lambda contract, graph: check_prefill(contract, graph, bucket))
        return self._prefill[bucket]


class Backend(abc.ABC):
    """A runtime that runs the graphs of one export.

    Attributes:
        runtime: one of :data:`RUNTIMES`.
        contract: the manifest's contract.
        graphs: the loaded, cross-checked graphs.
        device: the device the graphs run on, in the runtime's words.
        precision: one of :data:`PRECISIONS`.
        host_state_roundtrip: states go through host arrays between steps (for comparison).
    """

    runtime: str
    contract: ShapeContract
    graphs: GraphSet
    device: str
    precision: str
    host_state_roundtrip: bool

    @abc.abstractmethod
    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        """Vision graph on one image's patches ``[n_patches, patch_dim]`` fp32; returns its
        embeddings ``[n_image_tokens, image_embed_dim]`` (a host array the caller owns)."""

    @abc.abstractmethod
    def run_prefill(self, bucket: int | None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, Any]]:
        """Prefill graph of ``bucket`` on host ``feeds`` (``input_ids``, ``attention_mask``,
        ``position_ids``, ``image_embeds``); returns the logits ``[1, R, V]`` (host) and the
        states ``present_conv_states``, ``present_recurrent_states``, ``present_kv_cache`` in the
        backend's device-resident form (host arrays with ``host_state_roundtrip``), fresh for
        each call."""

    @abc.abstractmethod
    def decoder(self, states: dict[str, Any]) -> Decoder:
        """A decoder that starts from the prefill ``states`` (which it takes over)."""

    @staticmethod
    @abc.abstractmethod
    def state_shape(value: Any) -> list[int]:
        """Shape of one state as :meth:`run_prefill` returned it."""


def check_runtime_options(runtime: str, precision: str) -> None:
    """Check the runtime and precision names (the device is checked by the backend).

    Raises:
        ValueError: naming the value and the choices.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} must be one of {', '.join(RUNTIMES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} must be one of {', '.join(PRECISIONS)}")
    if runtime == "onnxruntime" and precision != "f32":
        raise ValueError(
            f"precision {precision!r} needs runtime 'openvino' (ONNX Runtime runs the graphs in their "
            "exported dtype: precision f32)"
        )


def open_backend(root: Path, contract: ShapeContract, runtime: str = "onnxruntime", device: str = "cpu",
                 precision: str = "f32", threads: int = 0, host_state_roundtrip: bool = False) -> Backend:
    """Load the graphs of the export at ``root`` with ``runtime``.

    Args:
        runtime: 'onnxruntime' or 'openvino'.
        device: ONNX Runtime: 'cpu' or 'cuda'; OpenVINO: a device name ('CPU', 'GPU', 'NPU', ...;
            lowercase accepted).
        precision: 'f32', or with OpenVINO 'bf16' / 'f16' (its inference precision hint).
        threads: intra-op threads, 0 lets the runtime choose.
        host_state_roundtrip: copy every state to host every decode step (for comparison).

    Raises:
        ValueError: unknown runtime, device or precision (naming the value and the choices), or
            the runtime is not installed.
        ContractError: see :class:`GraphSet`; with OpenVINO also exports it cannot run (operators
            it cannot read, dynamic shapes).
    """
    check_runtime_options(runtime, precision)
    if runtime == "onnxruntime":
        from .ort_backend import OrtBackend

        return OrtBackend(root, contract, device=device, threads=threads, host_state_roundtrip=host_state_roundtrip)
    try:
        from .openvino_backend import OpenVinoBackend
    except ImportError as exc:
        raise ValueError(
            f"runtime 'openvino' needs the openvino package (pip install 'qwen35-onnx[openvino]'): {exc}"
        ) from None
    return OpenVinoBackend(root, contract, device=device, precision=precision, threads=threads,
                           host_state_roundtrip=host_state_roundtrip)
