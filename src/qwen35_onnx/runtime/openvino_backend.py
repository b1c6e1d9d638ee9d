"""The OpenVINO backend (no torch): the static graphs of a fixed-KV ``--ops portable`` export,
each read and compiled once (vision and decode at load, each prefill bucket on first use) for an
OpenVINO device (CPU here; GPU or NPU where present) with an inference precision hint.

Checked before anything compiles:

- the export: fixed KV (a dynamic-mode export is refused: its decode KV grows by one token per
  step, so a static compiler would compile the decode graph again for every token; NPU
  compilers take static shapes only); no operator outside the ONNX standard that OpenVINO cannot
  read (``--ops ort`` exports are refused naming the operators);
- each graph: read by OpenVINO's ONNX reader (a failure is a ContractError with its summary),
  no dynamic dimension on any input or output (``Model.is_dynamic()``), the contract in its
  ``metadata_props`` (OpenVINO keeps them in the model's ``rt_info['framework']``) equal to the
  manifest's, and its input/output shapes and element types cross-checked by the shared
  :mod:`.checks` functions, exactly as on ONNX Runtime.

Decode states stay in OpenVINO tensors: :class:`OpenVinoDecoder` keeps two infer requests on the
compiled decode graph and two sets of state tensors (A/B); request ``p`` reads set ``1 - p`` and
writes set ``p``, both bound once per generation, so a step only writes the token, mask and
positions into bound host arrays and runs; nothing of the states crosses numpy.
:class:`OpenVinoHostDecoder` (``--host-state-roundtrip``) copies every state through numpy
every step instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from ..contract import METADATA_KEY, STATE_NAMES, ContractError, ShapeContract
from .backend import Backend, Decoder, GraphSet
from .checks import GraphSpec, check_export_files
from .onnx_scan import OnnxScanError, scan

#: OpenVINO's capability name of each precision (``OPTIMIZATION_CAPABILITIES`` of a device).
CAPABILITIES = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}

#: Operators outside the ONNX standard that OpenVINO's ONNX reader converts: ONNX Runtime's
#: MatMulNBits, which portable quantized exports before 0.4.0 held (they now use the standard
#: blocked DequantizeLinear). Measured with OpenVINO 2026.4: read and compiled, with the same
#: agreement to fp32 as ONNX Runtime's kernel.
READABLE_FOREIGN_OPERATORS = frozenset({"com.microsoft.MatMulNBits"})

#: ONNX type string of OpenVINO element types (the shared checks compare ONNX type strings).
ONNX_TYPE_OF = {
    "f32": "tensor(float)", "f16": "tensor(float16)", "bf16": "tensor(bfloat16)", "f64": "tensor(double)",
    "i64": "tensor(int64)", "i32": "tensor(int32)", "i8": "tensor(int8)", "u8": "tensor(uint8)",
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
        raise ValueError(f"device {device!r} is not an OpenVINO device here; choices: {', '.join(available + families)}")
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
            f"precision {precision!r} is not supported by OpenVINO device {device} "
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


class OpenVinoGraphSet(GraphSet):
    """The graphs of one export compiled by OpenVINO (see :class:`~.backend.GraphSet`); every graph
    is read, checked (static, metadata, shapes) and then compiled, once.

    Raises (constructor and :meth:`prefill`):
        ContractError: a graph is missing, unreadable, dynamic, or disagrees with the manifest,
            or does not compile.
    """

    def __init__(self, root: Path, contract: ShapeContract, core: ov.Core, device: str, config: dict):
        self.core, self.device, self.config = core, device, config
        super().__init__(root, contract)

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
        tables: dict[str, dict[str, list]] = {"input": {}, "output": {}}
        types: dict[str, str] = {}
        for kind, ports in (("input", model.inputs), ("output", model.outputs)):
            for port in ports:
                name = next((n for n in sorted(port.get_names()) if n in graph_names), port.get_any_name())
                shape = port.get_partial_shape()
                if shape.is_dynamic:
                    raise ContractError(
                        f"{key} graph {kind} {name!r} has the dynamic shape {shape}: OpenVINO would compile it with a "
                        "dynamic dimension, and the fixed-shape contract needs every dimension static "
                        "(re-export the graph with this version, --kv-cache fixed)"
                    )
                tables[kind][name] = [int(d.get_length()) for d in shape]
                type_name = port.get_element_type().get_type_name()
                types[name] = ONNX_TYPE_OF.get(type_name, type_name)
        if model.is_dynamic():
            raise ContractError(f"{key} graph {str(path)!r} has a dynamic dimension inside: OpenVINO cannot compile it statically")
        graph = CompiledGraph(name=key, contract=contract, inputs=tables["input"], outputs=tables["output"], types=types)
        graph.model = model
        return graph

    def _prepare(self, graph: CompiledGraph) -> CompiledGraph:
        try:
            graph.compiled = self.core.compile_model(graph.model, self.device, self.config)
        except RuntimeError as exc:
            raise ContractError(f"{graph.name} graph cannot be compiled by OpenVINO for {self.device}: {_summary(exc)}") from None
        graph.model = None  # the compiled model holds what it needs
        graph.request = graph.compiled.create_infer_request()
        return graph

    def unload_prefill(self) -> None:
        """Drop the compiled prefill graphs; they compile again on next use. Each compiled graph
        holds its own weights (portable int4 at 0.8B on CPU: about 0.6 GB more proportional
        resident memory per bucket), unlike ONNX Runtime's sessions, which share them."""
        self._prefill.clear()


def _run(request: ov.InferRequest) -> None:
    """Run synchronously without building an output dictionary (``InferRequest.infer`` copies
    every output to numpy unless told otherwise)."""
    request.start_async()
    request.wait()


def _fresh(port) -> ov.Tensor:
    return ov.Tensor(port.get_element_type(), port.get_shape())


class OpenVinoBackend(Backend):
    """OpenVINO on ``device`` with inference ``precision`` (see :func:`~.backend.open_backend`).

    Raises:
        ValueError: device not available, or precision it does not support.
        ContractError: the export cannot run on OpenVINO (dynamic KV, ``--ops ort``), or see
            :class:`OpenVinoGraphSet`.
    """

    runtime = "openvino"

    def __init__(self, root: Path, contract: ShapeContract, device: str = "cpu", precision: str = "f32",
                 threads: int = 0, host_state_roundtrip: bool = False):
        core = ov.Core()
        self.device = resolve_device(core, device)
        check_precision(core, self.device, precision)
        self.contract, self.precision, self.host_state_roundtrip = contract, precision, host_state_roundtrip
        root = Path(root)
        if contract.kv_mode != "fixed":
            raise ContractError(
                f"the export at {str(root)!r} has a dynamic KV cache (--kv-cache {contract.kv_mode}), which OpenVINO "
                "would have to compile again for every decode step; re-export with --kv-cache fixed for OpenVINO"
            )
        check_export_files(root, contract)
        if contract.ops != "portable":
            path = root / contract.graphs["decode"]
            try:
                found = scan(path).foreign_operators()
            except (OSError, OnnxScanError):
                found = ["ONNX Runtime's com.microsoft operators"]
            raise ContractError(
                f"the export at {str(root)!r} was made with --ops {contract.ops}: its text graphs use operators outside "
                f"the ONNX standard that OpenVINO cannot read ({', '.join(found)}); re-export with --ops portable"
            )
        config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.graphs = OpenVinoGraphSet(root, contract, core, self.device, config)

    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        request = self.graphs.vision.request
        np.copyto(request.get_tensor("pixel_values").data, pixel_values)
        _run(request)
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
                    states[name] = _fresh(graph.compiled.output(name))
                    request.set_tensor(name, states[name])
        _run(request)
        logits = request.get_tensor("logits").data.copy()
        if self.host_state_roundtrip:
            states = {name: request.get_tensor(name).data.copy() for name in graph.outputs if name != "logits"}
        return logits, states

    def decoder(self, states: dict) -> Decoder:
        if self.host_state_roundtrip:
            return OpenVinoHostDecoder(self.graphs.decode, self.contract, states)
        return OpenVinoDecoder(self.graphs.decode, self.contract, states)

    @staticmethod
    def state_shape(value) -> list[int]:
        return list(value.get_shape()) if isinstance(value, ov.Tensor) else list(value.shape)


class OpenVinoDecoder:
    """Device-resident decode state with A/B buffers.

    Two infer requests on the compiled decode graph; set ``p`` of the state tensors is written at
    steps of parity ``p`` and read at the next step; the prefill's state tensors serve as set 1
    (read by step 0). Every binding is made here, once: the three host inputs are numpy arrays
    shared with both requests' input tensors, and each request writes its own logits tensor.

    Args:
        decode: the compiled decode graph.
        contract: the export contract.
        states: the prefill outputs ``present_conv_states``, ``present_recurrent_states``,
            ``present_kv_cache`` as OpenVINO tensors (taken over by this decoder).
    """

    def __init__(self, decode: CompiledGraph, contract: ShapeContract, states: dict[str, ov.Tensor]):
        compiled = decode.compiled
        self.requests = [compiled.create_infer_request() for _ in (0, 1)]
        names = [f"present_{state}" for state in STATE_NAMES]
        self.buffers = [{name: _fresh(compiled.output(name)) for name in names}, {name: states[name] for name in names}]
        batch = contract.batch
        self.host = {
            "input_ids": np.zeros((batch, 1), dtype=np.int64),
            "attention_mask": np.zeros((batch, contract.capacity), dtype=np.int64),
            "position_ids": np.zeros((4, batch, 1), dtype=np.int64),
        }
        shared = {name: ov.Tensor(array, shared_memory=True) for name, array in self.host.items()}
        self.logits = []
        for parity, request in enumerate(self.requests):
            for name, tensor in shared.items():
                request.set_tensor(name, tensor)
            for state in STATE_NAMES:
                request.set_tensor(f"past_{state}", self.buffers[1 - parity][f"present_{state}"])
                request.set_tensor(f"present_{state}", self.buffers[parity][f"present_{state}"])
            logits = _fresh(compiled.output("logits"))
            request.set_tensor("logits", logits)
            self.logits.append(logits.data)  # a numpy view of the tensor
        self.steps = 0

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run one decode step; returns logits ``[1, 1, V]`` fp32 (a host copy)."""
        parity = self.steps % 2
        host = self.host
        np.copyto(host["input_ids"], input_ids)
        np.copyto(host["attention_mask"], attention_mask)
        np.copyto(host["position_ids"], position_ids)
        _run(self.requests[parity])
        self.steps += 1
        return self.logits[parity].copy()  # the view is rewritten two steps later


class OpenVinoHostDecoder:
    """Copy-to-host fallback (``--host-state-roundtrip``): every state goes through numpy between
    steps."""

    def __init__(self, decode: CompiledGraph, contract: ShapeContract, states: dict[str, np.ndarray]):
        self.request = decode.compiled.create_infer_request()
        self.past = {name: np.asarray(states[f"present_{name}"]) for name in STATE_NAMES}

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run one decode step; returns logits ``[1, 1, V]`` fp32."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds.update({f"past_{name}": self.past[name] for name in STATE_NAMES})
        outputs = self.request.infer(feeds)  # copies the inputs in and the outputs out
        for name in STATE_NAMES:
            self.past[name] = outputs[f"present_{name}"]
        return outputs["logits"]
