"""The OpenVINO backend (no torch): the static graphs of a fixed-KV ``--ops portable`` export,
each read and compiled once (decode at load, each vision grid and each prefill bucket on first use)
for an OpenVINO device (CPU here; GPU or NPU where present) with an inference precision hint.

Checked before anything compiles:

- the export: fixed KV (a dynamic-mode export is refused: its decode KV grows by one token per
  step, so a static compiler would compile the decode graph again for every token; NPU
  compilers take static shapes only); no operator outside the ONNX standard that OpenVINO cannot
  read (``--ops ort`` exports are refused naming the operators);
- each graph: read by OpenVINO's ONNX reader (a failure is a ContractError with its summary),
  no dynamic dimension on any input or output (``Model.is_dynamic()``; the any-grid vision graph's patch
  count and a tiered export's KV width excepted, see below), the contract in its
  ``metadata_props`` (OpenVINO keeps them in the model's ``rt_info['framework']``) equal to the
  manifest's, and its input/output shapes and element types cross-checked by the shared
  :mod:`qwen35_onnx.runtime.checks` functions, exactly as on ONNX Runtime.

Vision: a static-grid export's graph of each grid compiles on first use. The any-grid vision graph (the default
export) is compiled once with its patch count dynamic where the device takes dynamic shapes (the CPU plugin
does: one copy of the weights, each new grid specialised inside OpenVINO on its first run); with
``RuntimeOptions.vision_grid_cache`` N >= 1, or where the device refuses a dynamic compile (NPU compilers), it is
reshaped to each image's or video frame pair's grid and compiled static on first use (:class:`VisionGridCache`),
the N most recently used kept (4 after a refusal). The CPU plugin shares no weights between compiled models:
each static grid holds its own copy of the vision weights (0.42 GB at Qwen3.5-0.8B,
``benchmarks/video/amd-epyc-2c-qwen3.5-0.8b.json``).

KV tiers: the decode, chunk, verify and MTP graphs of an export with several KV tiers take the KV width as one
symbolic dimension (``kv_width``); each is compiled once with it dynamic (one copy of its weights for every tier)
and each run sets the tensors of the generation's tier; a device that refuses the dynamic compile is named at
load.

Decode states stay in OpenVINO tensors (:mod:`.decoders`); speculative decoding's verify and MTP runs write into
host buffers bound as OpenVINO tensors (:mod:`.speculative`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from ...contract import KV_WIDTH, METADATA_KEY, STATE_NAMES, ContractError, KvMode, Ops, ShapeContract, plain
from ...onnxfile.complete import check_export_files
from ...onnxfile.scan import OnnxScanError, scan
from ..backend import STATE_NUMPY_DTYPES, Backend, Decoder, GraphSet, Runtime, RuntimeOptions, fill_state
from ..checks import GraphSpec, check_vision, kv_width_axes
from ..draft_buffers import MtpCache, VerifyBuffers
from .decoders import STATE_TYPES, OpenVinoDecoder, OpenVinoHostDecoder, fresh_tensor, run_request, set_inputs
from .speculative import run_mtp, run_verify

DEFAULT_GRID_CACHE = 4
"""Compiled vision grids kept where a device refuses the any-grid graph's dynamic compile."""

#: OpenVINO's capability name of each precision (``OPTIMIZATION_CAPABILITIES`` of a device).
CAPABILITIES = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}

#: Operators outside the ONNX standard that OpenVINO's ONNX reader converts: ONNX Runtime's
#: MatMulNBits, which portable quantized exports before 0.4.0 held (they now use the standard
#: blocked DequantizeLinear). Measured with OpenVINO 2026.4: read and compiled, with the same
#: agreement to fp32 as ONNX Runtime's kernel.
READABLE_FOREIGN_OPERATORS = frozenset({"com.microsoft.MatMulNBits"})

#: ONNX type string of OpenVINO element types (the shared checks compare ONNX type strings).
ONNX_TYPE_OF = {
    "f32": "tensor(float)",
    "f16": "tensor(float16)",
    "bf16": "tensor(bfloat16)",
    "f64": "tensor(double)",
    "i64": "tensor(int64)",
    "i32": "tensor(int32)",
    "i8": "tensor(int8)",
    "u8": "tensor(uint8)",
    "boolean": "tensor(bool)",
}


def resolve_device(core: ov.Core, device: str) -> str:
    """OpenVINO's name for ``device`` ('cpu' -> 'CPU'; 'GPU', 'GPU.1', 'NPU' where present).

    Raises:
        ValueError: the device is not available, naming the value and the choices.
    """
    available = list(core.available_devices)
    families = sorted({d.split(".")[0] for d in available} - set(available))
    name = device.upper() if isinstance(device, str) else device
    if name not in available and name not in families:
        raise ValueError(
            f"device {device!r} is not an OpenVINO device here; choices: {', '.join(available + families)}"
        )
    return name


def check_precision(core: ov.Core, device: str, precision: str) -> None:
    """``precision`` ('f32', 'bf16', 'f16') is one of ``device``'s optimization capabilities.

    Raises:
        ValueError: naming the precision, the device and what it supports.
    """
    capabilities = list(core.get_property(device, "OPTIMIZATION_CAPABILITIES"))
    if CAPABILITIES[precision] not in capabilities:
        supported = [p for p, cap in CAPABILITIES.items() if cap in capabilities]
        raise ValueError(
            f"precision {plain(precision)!r} is not supported by OpenVINO device {device} "
            f"(it supports {', '.join(supported) or 'none of ' + ', '.join(CAPABILITIES)})"
        )


def _summary(exc: BaseException) -> str:
    """The useful lines of an OpenVINO exception (its summary, not its C++ source locations)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line.lstrip("- ") for line in lines if line.startswith("--")]
    if useful:
        return "; ".join(useful)
    useful = [line for line in lines if not line.startswith(("Exception from", "Check '"))]
    return (useful or lines or [type(exc).__name__])[-1]


def _refuse_foreign(key: str, path: Path, found) -> None:
    unreadable = [op for op in found if op not in READABLE_FOREIGN_OPERATORS]
    if unreadable:
        raise ContractError(
            f"{key} graph {str(path)!r} uses operators outside the ONNX standard that OpenVINO cannot read: "
            f"{', '.join(unreadable)} (ONNX Runtime's fused operators); re-export with --ops portable"
        )


@dataclass
class CompiledGraph(GraphSpec):
    """One graph read by OpenVINO (``model``, until compiled), then compiled (``compiled``) with
    one infer request (``request``, used by vision and prefill runs)."""

    model: ov.Model | None = None
    compiled: ov.CompiledModel | None = None
    request: ov.InferRequest | None = None
    dynamic: bool = False
    """Compiled with a dynamic dimension (the any-grid vision graph's patch count, or the KV width of a tiered
    export's decode, chunk, verify and MTP graphs): each run sets the tensors of its own shapes."""


@dataclass
class VisionGridCache:
    """The any-grid vision graph compiled for each grid, least recently used first, at most ``capacity`` kept (0:
    one dynamic compile instead, see :class:`OpenVinoGraphSet`);
    each grid's compile time in ms (``compile_ms``, kept after its graph is dropped) and how many compiles
    (``compiles``: a grid dropped and used again compiles again)."""

    capacity: int = 0
    graphs: OrderedDict = field(default_factory=OrderedDict)
    refused: str | None = None
    """Why the device refused the dynamic compile (capacity 0 was asked for), None otherwise."""
    compile_ms: dict = field(default_factory=dict)
    compiles: int = 0

    def get(self, grid: tuple[int, int]) -> CompiledGraph | None:
        graph = self.graphs.get(grid)
        if graph is not None:
            self.graphs.move_to_end(grid)
        return graph

    def put(self, grid: tuple[int, int], graph: CompiledGraph, compile_ms: float) -> None:
        self.graphs[grid] = graph
        self.compile_ms[grid] = compile_ms
        self.compiles += 1
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)


class OpenVinoGraphSet(GraphSet):
    """The graphs of one export compiled by OpenVINO (see :class:`~qwen35_onnx.runtime.backend.GraphSet`);
    every graph is read, checked (static, metadata, shapes) and then compiled, once. Each compiled
    graph holds its own weights, unlike ONNX Runtime's sessions, which share them
    (:meth:`~qwen35_onnx.runtime.backend.Backend.unload_prefill` drops the prefill graphs).

    Raises (constructor and :meth:`prefill`):
        ContractError: a graph is missing, unreadable, dynamic, or disagrees with the manifest,
            or does not compile.
    """

    def __init__(
        self, root: Path, contract: ShapeContract, core: ov.Core, device: str, config: dict, grid_cache: int = 0
    ):
        self.core, self.device, self.config = core, device, config
        self.grids = VisionGridCache(grid_cache)
        super().__init__(root, contract)

    @property
    def dynamic_vision(self) -> bool:
        """The any-grid vision graph runs as one compile with a dynamic patch count (not one per grid)."""
        return not self.contract.static_vision and self.grids.capacity == 0

    def vision(self, grid: tuple[int, int] | None) -> CompiledGraph:
        """As the base class; with the any-grid graph, that graph reshaped to ``grid`` and compiled
        (:class:`VisionGridCache`)."""
        graph = super().vision(grid)
        if self.contract.static_vision or grid is None or self.dynamic_vision:
            return graph
        grid = (int(grid[0]), int(grid[1]))
        cached = self.grids.get(grid)
        if cached is not None:
            return cached
        patches = grid[0] * grid[1]
        model = graph.model.clone()
        shapes = {}
        for port in model.inputs:
            rest = [d.get_length() for d in list(port.get_partial_shape())[1:]]
            shapes[port] = ov.PartialShape([patches, *rest])
        try:
            model.reshape(shapes)
        except RuntimeError as exc:
            raise ContractError(
                f"vision graph cannot be reshaped to the {grid[0]}x{grid[1]} grid: {_summary(exc)}"
            ) from None
        static = self._describe(
            f"{graph.name} {grid[0]}x{grid[1]}", model, graph.contract, set(graph.inputs) | set(graph.outputs)
        )
        check_vision(self.contract, static, grid)
        start = time.perf_counter()
        compiled = self._prepare(static)
        self.grids.put(grid, compiled, 1000 * (time.perf_counter() - start))
        return compiled

    @property
    def loaded_grids(self) -> list[tuple[int, int] | None]:
        """The compiled vision grids: a static export's loaded grids; the any-grid graph's compiled ones (least
        recently used first)."""
        if self.contract.static_vision or self.dynamic_vision:
            return super().loaded_grids
        return list(self.grids.graphs)

    def _read(self, key: str, path: Path) -> CompiledGraph:
        if not path.is_file():
            raise ContractError(f"{key} graph {str(path)!r} not found")
        try:
            onnx_names = scan(path)
        except (OSError, OnnxScanError) as exc:
            raise ContractError(f"{key} graph {str(path)!r} is not a readable ONNX file: {exc}") from None
        _refuse_foreign(key, path, onnx_names.foreign_operators())
        try:
            model = self.core.read_model(str(path))
        except RuntimeError as exc:
            raise ContractError(f"{key} graph {str(path)!r} cannot be read by OpenVINO: {_summary(exc)}") from None
        if not model.has_rt_info(["framework", METADATA_KEY]):
            raise ContractError(f"{key} graph {str(path)!r} has no {METADATA_KEY!r} metadata: not a qwen35-onnx export")
        contract = ShapeContract.from_json(model.get_rt_info(["framework", METADATA_KEY]).astype(str))
        graph_names = set(onnx_names.inputs) | set(onnx_names.outputs)
        any_grid = key == self.contract.vision_graph_key(None) and not self.contract.static_vision
        widths = kv_width_axes(self.contract, key)
        return self._describe(key, model, contract, graph_names, dynamic_patches=any_grid, path=path, widths=widths)

    @staticmethod
    def _describe(
        key: str,
        model: ov.Model,
        contract,
        graph_names,
        dynamic_patches: bool = False,
        path: Path | None = None,
        widths: dict[str, int] | None = None,
    ) -> CompiledGraph:
        """The :class:`CompiledGraph` (not yet compiled) of an OpenVINO ``model``: its ports' shapes and types.
        ``dynamic_patches``: the any-grid vision graph, whose first dimension (the patch count) is left dynamic
        (named ``patches``) for :meth:`vision` to reshape; ``widths``: the ports whose axis is the symbolic KV width
        of a tiered export (:func:`~qwen35_onnx.runtime.checks.kv_width_axes`, named ``kv_width``); any other
        dynamic dimension is refused."""
        tables: dict[str, dict[str, list]] = {"input": {}, "output": {}}
        types: dict[str, str] = {}
        widths = widths or {}
        for kind, ports in (("input", model.inputs), ("output", model.outputs)):
            for port in ports:
                name = next((n for n in sorted(port.get_names()) if n in graph_names), port.get_any_name())
                shape = port.get_partial_shape()
                dims = list(shape)
                free = {0} if dynamic_patches else {widths[name]} if name in widths else set()
                if any(d.is_dynamic for axis, d in enumerate(dims) if axis not in free):
                    raise ContractError(
                        f"{key} graph {kind} {name!r} has the dynamic shape {shape}: OpenVINO would compile it with a "
                        "dynamic dimension, and the fixed-shape contract needs every dimension static "
                        "(re-export the graph with this version, --kv-cache fixed)"
                    )
                symbol = "patches" if dynamic_patches else KV_WIDTH
                tables[kind][name] = [symbol if d.is_dynamic else int(d.get_length()) for d in dims]
                type_name = port.get_element_type().get_type_name()
                types[name] = ONNX_TYPE_OF.get(type_name, type_name)
        if model.is_dynamic() and not (dynamic_patches or widths):
            where = f"{str(path)!r}" if path is not None else key
            raise ContractError(
                f"{key} graph {where} has a dynamic dimension inside: OpenVINO cannot compile it statically"
            )
        graph = CompiledGraph(
            name=key, contract=contract, inputs=tables["input"], outputs=tables["output"], types=types
        )
        graph.model = model
        return graph

    def _prepare(self, graph: CompiledGraph) -> CompiledGraph:
        if graph.model is not None and graph.model.is_dynamic() and kv_width_axes(self.contract, graph.name):
            return self._compile_tiered(graph)
        if graph.model is not None and graph.model.is_dynamic():  # the any-grid vision graph
            if self.grids.capacity:
                return graph  # compiled per grid (vision)
            try:
                graph.compiled = self.core.compile_model(graph.model, self.device, self.config)
            except RuntimeError as exc:  # a device that takes static shapes only: one compile per grid
                self.grids.capacity = DEFAULT_GRID_CACHE
                self.grids.refused = _summary(exc)
                return graph
            graph.model, graph.dynamic = None, True
            graph.request = graph.compiled.create_infer_request()
            return graph
        try:
            graph.compiled = self.core.compile_model(graph.model, self.device, self.config)
        except RuntimeError as exc:
            raise ContractError(
                f"{graph.name} graph cannot be compiled by OpenVINO for {self.device}: {_summary(exc)}"
            ) from None
        graph.model = None  # the compiled model holds what it needs
        graph.request = graph.compiled.create_infer_request()
        return graph

    def _compile_tiered(self, graph: CompiledGraph) -> CompiledGraph:
        """Compile a tiered export's decode, chunk, verify or MTP graph once with its KV width dynamic: one copy of
        its weights for every KV tier (the CPU plugin shares none between compiled models), each run given the
        tensors of its tier.

        Raises:
            ContractError: the device refuses a dynamic dimension (a static compiler reshapes the graph to each
                tier instead: ``Model.reshape``).
        """
        try:
            graph.compiled = self.core.compile_model(graph.model, self.device, self.config)
        except RuntimeError as exc:
            tiers = ",".join(map(str, self.contract.kv_tiers))
            raise ContractError(
                f"{graph.name} graph cannot be compiled by OpenVINO for {self.device} with its KV width dynamic (KV "
                f"tiers {tiers}): {_summary(exc)}; export with --kv-tiers none for this device"
            ) from None
        graph.model, graph.dynamic = None, True
        graph.request = graph.compiled.create_infer_request()
        return graph


def state_tensor(port, shape) -> ov.Tensor:
    """A new tensor of ``port``'s element type and ``shape`` (a state output: its shape is the past state's, the KV
    width a tier's where the graph's is dynamic)."""
    return ov.Tensor(port.get_element_type(), list(shape))


class OpenVinoBackend(Backend):
    """OpenVINO with ``options``: its device and inference precision, threads, host-state roundtrip
    (default :class:`~qwen35_onnx.runtime.backend.RuntimeOptions` with ``device='cpu'``).

    Raises:
        ValueError: device not available, or precision it does not support.
        ContractError: the export cannot run on OpenVINO (dynamic KV, ``--ops ort``), or see
            :class:`OpenVinoGraphSet`.
    """

    runtime = Runtime.OPENVINO

    def __init__(self, root: Path, contract: ShapeContract, options: RuntimeOptions | None = None):
        options = options or RuntimeOptions(runtime=Runtime.OPENVINO)
        core = ov.Core()
        self.device = resolve_device(core, options.device)
        precision, threads = options.precision, options.intra_op_threads
        check_precision(core, self.device, precision)
        self.contract, self.precision, self.host_state_roundtrip = contract, precision, options.host_state_roundtrip
        root = Path(root)
        if contract.kv_mode != KvMode.FIXED:
            raise ContractError(
                f"the export at {str(root)!r} has a dynamic KV cache (--kv-cache {contract.kv_mode}), which OpenVINO "
                "would have to compile again for every decode step; re-export with --kv-cache fixed for OpenVINO"
            )
        check_export_files(root, contract)
        if contract.ops != Ops.PORTABLE:
            path = root / contract.graphs["decode"]
            try:
                found = scan(path).foreign_operators()
            except (OSError, OnnxScanError):
                found = ["ONNX Runtime's com.microsoft operators"]
            raise ContractError(
                f"the export at {str(root)!r} was made with --ops {contract.ops}: its text graphs use operators "
                f"outside the ONNX standard that OpenVINO cannot read ({', '.join(found)}); re-export with --ops "
                "portable"
            )
        config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.graphs = OpenVinoGraphSet(root, contract, core, self.device, config, options.vision_grid_cache)

    def _run_vision(self, graph: CompiledGraph, feeds: dict[str, np.ndarray]) -> np.ndarray:
        request = graph.request
        for name, value in feeds.items():
            if graph.dynamic:  # each run's own shapes
                request.set_tensor(name, ov.Tensor(np.ascontiguousarray(value)))
            else:
                np.copyto(request.get_tensor(name).data, value)
        run_request(request)
        return request.get_tensor("image_embeds").data.copy()

    def run_prefill(self, bucket: int | None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        graph = self.graphs.prefill(bucket)
        request = graph.request
        for name, value in feeds.items():
            np.copyto(request.get_tensor(name).data, value)
        states = {}
        if not self.host_state_roundtrip:
            for name in graph.outputs:  # fresh tensors each run: the next prompt must not overwrite these
                if name != "logits":
                    states[name] = fresh_tensor(graph.compiled.output(name))
                    request.set_tensor(name, states[name])
        run_request(request)
        logits = request.get_tensor("logits").data.copy()
        if self.host_state_roundtrip:
            states = {name: request.get_tensor(name).data.copy() for name in graph.outputs if name != "logits"}
        return logits, states

    def run_chunk(self, size: int, feeds: dict[str, np.ndarray], states: dict) -> tuple[np.ndarray, dict, object]:
        graph = self.graphs.chunk(size)
        request = graph.request
        set_inputs(request, feeds)
        new = {}
        for state in STATE_NAMES:
            past = states[f"present_{state}"]
            request.set_tensor(f"past_{state}", past if isinstance(past, ov.Tensor) else ov.Tensor(past))
            new[f"present_{state}"] = state_tensor(graph.compiled.output(f"present_{state}"), self.state_shape(past))
            request.set_tensor(f"present_{state}", new[f"present_{state}"])
        run_request(request)
        logits = request.get_tensor("logits").data.copy()
        hidden = request.get_tensor("hidden_states").data.copy() if self.contract.draft_tokens else None
        if self.host_state_roundtrip:
            new = {name: tensor.data.copy() for name, tensor in new.items()}
        return logits, new, hidden

    def run_verify(self, size: int, feeds: dict[str, np.ndarray], states: dict, buffers: VerifyBuffers):
        return run_verify(self.graphs.verify(size).request, self.contract, feeds, states, buffers)

    def run_mtp(self, size: int, feeds: dict[str, np.ndarray], kv: MtpCache):
        return run_mtp(self.graphs.mtp(size).request, self.contract, feeds, kv)

    def states_to_host(self, states: dict, kv_length: int | None = None) -> dict[str, np.ndarray]:
        arrays = {}
        for name, value in states.items():
            array = value.data if isinstance(value, ov.Tensor) else value
            if kv_length is not None and name == "present_kv_cache":
                array = array[:, :, :, :kv_length]
            arrays[name] = np.array(array, copy=True)
        return arrays

    def states_from_host(
        self, arrays: dict[str, np.ndarray], kv_dtype: str | None = None, width: int | None = None
    ) -> dict:
        """As the base class; a bf16 state's host array holds its raw bits as float16 (what
        ``ov.Tensor.data`` shows of a bf16 tensor, and :meth:`states_to_host` returns)."""
        states = {}
        for name, value in arrays.items():
            state = name.removeprefix("present_")
            shape = list(self.contract.state_shape(state, width))
            if self.host_state_roundtrip:
                states[name] = np.empty(shape, dtype=value.dtype)
                fill_state(states[name], value)
                continue
            dtype = kv_dtype if state == "kv_cache" and kv_dtype else self.contract.state_dtype(state)
            tensor = ov.Tensor(STATE_TYPES[dtype], shape)
            fill_state(tensor.data, value)
            states[name] = tensor
        return states

    def zero_states(self, width: int | None = None) -> dict:
        """Zero states made on the runtime (a bf16 export's too: numpy has no bf16), the KV cache in the prompt
        graphs' dtype."""
        c = self.contract
        if self.host_state_roundtrip:
            return super().zero_states(width)
        states = {}
        for state in STATE_NAMES:
            dtype = c.prompt_kv_dtype if state == "kv_cache" else c.state_dtype(state)
            tensor = ov.Tensor(STATE_TYPES[dtype], list(c.state_shape(state, width)))
            tensor.data[...] = 0
            states[f"present_{state}"] = tensor
        return states

    def _zero_slot_states(self, width: int | None = None) -> dict:
        c, states = self.contract, {}
        for state in STATE_NAMES:
            shape = list(c.slot_state_shape(state, width))
            if self.host_state_roundtrip:
                if c.state_dtype(state) not in STATE_NUMPY_DTYPES:
                    raise ContractError(f"{state} of a {c.state_dtype(state)} export cannot be held in host memory")
                states[f"present_{state}"] = np.zeros(shape, dtype=STATE_NUMPY_DTYPES[c.state_dtype(state)])
                continue
            tensor = ov.Tensor(STATE_TYPES[c.state_dtype(state)], shape)
            tensor.data[...] = 0
            states[f"present_{state}"] = tensor
        return states

    def state_views(self, states: dict) -> dict[str, np.ndarray]:
        """Host views of the states (OpenVINO's CPU tensors are host memory; a bf16 state shows its raw bits
        as float16, as :meth:`states_to_host` returns them)."""
        return {name: value.data if isinstance(value, ov.Tensor) else value for name, value in states.items()}

    def decoder(self, states: dict) -> Decoder:
        if self.host_state_roundtrip:
            return OpenVinoHostDecoder(self.graphs.decode.compiled, self.contract, states)
        return OpenVinoDecoder(self.graphs.decode.compiled, self.contract, states)

    @staticmethod
    def state_shape(value) -> list[int]:
        return list(value.get_shape()) if isinstance(value, ov.Tensor) else list(value.shape)
