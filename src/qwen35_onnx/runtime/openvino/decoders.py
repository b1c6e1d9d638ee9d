"""OpenVINO decode-step execution with device-resident state (no torch).

:class:`OpenVinoDecoder` keeps two infer requests on the compiled decode graph and two sets of
state tensors (A/B); request ``p`` reads set ``1 - p`` and writes set ``p``, both bound once per
generation, so a step only writes the token, mask and positions into bound host arrays and runs;
nothing of the states crosses numpy. :class:`OpenVinoHostDecoder` (``--host-state-roundtrip``)
copies every state through numpy every step instead.

Both expose ``step(input_ids, attention_mask, position_ids) -> logits [1, 1, V]`` fp32.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from ...contract import STATE_NAMES, ShapeContract
from ..backend import host_inputs

STATE_TYPES = {"fp32": ov.Type.f32, "fp16": ov.Type.f16, "bf16": ov.Type.bf16, "int8": ov.Type.i8}
"""OpenVINO element types of the contract's state dtypes."""


def run_request(request: ov.InferRequest) -> None:
    """Run synchronously without building an output dictionary (``InferRequest.infer`` copies
    every output to numpy unless told otherwise)."""
    request.start_async()
    request.wait()


def set_inputs(request: ov.InferRequest, feeds: dict[str, np.ndarray]) -> None:
    """Write host ``feeds`` into ``request``'s input tensors: copied into a static input's own tensor, or, where
    the input's shape differs (a tiered export's dynamic KV width: another tier), set as a tensor of its own (a
    copy)."""
    for name, value in feeds.items():
        tensor = request.get_tensor(name)
        if tuple(tensor.shape) == value.shape:
            np.copyto(tensor.data, value)
        else:
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(value)))


def fresh_tensor(port) -> ov.Tensor:
    return ov.Tensor(port.get_element_type(), port.get_shape())


class OpenVinoDecoder:
    """Device-resident decode state with A/B buffers.

    Two infer requests on the compiled decode graph; set ``p`` of the state tensors is written at
    steps of parity ``p`` and read at the next step; the prefill's state tensors serve as set 1
    (read by step 0). Every binding is made here, once: the three host inputs are numpy arrays
    shared with both requests' input tensors, and each request writes its own logits tensor.

    Args:
        compiled: the compiled decode graph (with a tiered export's KV width dynamic: the decoder runs it at
            the width of ``states``).
        contract: the export contract.
        states: the prefill outputs ``present_conv_states``, ``present_recurrent_states``,
            ``present_kv_cache`` as OpenVINO tensors (taken over by this decoder).
    """

    def __init__(self, compiled: ov.CompiledModel, contract: ShapeContract, states: dict[str, ov.Tensor]):
        self.requests = [compiled.create_infer_request() for _ in (0, 1)]
        names = [f"present_{state}" for state in STATE_NAMES]
        self.buffers = [  # (each of the states' own shape: the KV width a tier's where the graph's is dynamic)
            {name: ov.Tensor(compiled.output(name).get_element_type(), states[name].get_shape()) for name in names},
            {name: states[name] for name in names},
        ]
        self.width = int(states["present_kv_cache"].get_shape()[3])
        self.host = host_inputs(contract, contract.slots, self.width)
        shared = {name: ov.Tensor(array, shared_memory=True) for name, array in self.host.items()}
        self.logits = []
        for parity, request in enumerate(self.requests):
            for name, tensor in shared.items():
                request.set_tensor(name, tensor)
            for state in STATE_NAMES:
                request.set_tensor(f"past_{state}", self.buffers[1 - parity][f"present_{state}"])
                request.set_tensor(f"present_{state}", self.buffers[parity][f"present_{state}"])
            logits = fresh_tensor(compiled.output("logits"))
            request.set_tensor("logits", logits)
            self.logits.append(logits.data)  # a numpy view of the tensor
        self.steps = 0

    def states(self) -> dict[str, ov.Tensor]:
        """The states after the last step (the prefill's before the first), this decoder's tensors."""
        return dict(self.buffers[(self.steps - 1) % 2 if self.steps else 1])

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        active_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one decode step; returns logits ``[S, 1, V]`` fp32 (a host copy)."""
        parity = self.steps % 2
        host = self.host
        np.copyto(host["input_ids"], input_ids)
        np.copyto(host["attention_mask"], attention_mask)
        np.copyto(host["position_ids"], position_ids)
        if "active_rows" in host:
            np.copyto(host["active_rows"], active_rows)
        run_request(self.requests[parity])
        self.steps += 1
        return self.logits[parity].copy()  # the view is rewritten two steps later


class OpenVinoHostDecoder:
    """Copy-to-host fallback (``--host-state-roundtrip``): every state goes through numpy between
    steps."""

    def __init__(self, compiled: ov.CompiledModel, contract: ShapeContract, states: dict[str, np.ndarray]):
        self.request = compiled.create_infer_request()
        self.past = {name: np.asarray(states[f"present_{name}"]) for name in STATE_NAMES}

    def states(self) -> dict[str, np.ndarray]:
        """The states after the last step, as host arrays (this decoder's own)."""
        return {f"present_{name}": value for name, value in self.past.items()}

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        active_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one decode step; returns logits ``[S, 1, V]`` fp32."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if active_rows is not None:
            feeds["active_rows"] = active_rows
        feeds.update({f"past_{name}": self.past[name] for name in STATE_NAMES})
        outputs = self.request.infer(feeds)  # copies the inputs in and the outputs out
        for name in STATE_NAMES:
            self.past[name] = outputs[f"present_{name}"]
        return outputs["logits"]
