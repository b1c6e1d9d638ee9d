"""Decode-step execution with device-resident state (no torch).

:class:`BoundDecoder` keeps the conv, recurrent and KV states in ONNX Runtime ``OrtValue``s
between steps and binds them with IOBinding. Output buffers (logits, conv, recurrent, and
KV in fixed mode) are preallocated twice and alternate A/B by step parity, so a step never
writes the buffer it reads. In dynamic mode the KV output grows by one token per step, so
ONNX Runtime allocates it each step. :class:`HostDecoder` is the copy-to-host fallback
(``--host-state-roundtrip``) kept for comparison.

Both expose ``step(input_ids, attention_mask, position_ids) -> logits [1, 1, V] fp32``.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..contract import ShapeContract
from .sessions import GraphSession

STATE_NAMES = ("conv_states", "recurrent_states", "kv_cache")
NP_DTYPES = {"fp32": np.float32}


class BoundDecoder:
    """IOBinding decode loop state. ``device`` is 'cpu' or 'cuda' (ORT device names).

    Args:
        decode: the decode graph session.
        contract: the export contract (capacity, state shapes, kv mode).
        states: the prefill outputs ``present_conv_states``, ``present_recurrent_states``,
            ``present_kv_cache`` as OrtValues (already on the device).
    """

    def __init__(self, decode: GraphSession, contract: ShapeContract, states: dict[str, ort.OrtValue], device: str = "cpu"):
        self.session = decode.session
        self.contract = contract
        self.device = device
        self.fixed = contract.kv_mode == "fixed"
        self.binding = self.session.io_binding()
        self.past = {name: states[f"present_{name}"] for name in STATE_NAMES}
        dtype = NP_DTYPES[contract.dtype]
        shapes = {
            "logits": ((contract.batch, 1, contract.vocab_size), dtype),
            "present_conv_states": (contract.conv_state_shape, dtype),
            "present_recurrent_states": (contract.recurrent_state_shape, np.float32),
        }
        if self.fixed:
            shapes["present_kv_cache"] = (contract.kv_shape(), dtype)
        # Two complete sets of output buffers: set p is written at steps of parity p.
        self.buffers = [
            {name: ort.OrtValue.ortvalue_from_shape_and_type(shape, dt, device, 0) for name, (shape, dt) in shapes.items()}
            for _ in range(2)
        ]
        self.steps = 0

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run one decode step; returns logits ``[1, 1, V]`` fp32 (a host copy)."""
        binding = self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", attention_mask)
        binding.bind_cpu_input("position_ids", position_ids)
        for name in STATE_NAMES:
            binding.bind_ortvalue_input(f"past_{name}", self.past[name])
        out = self.buffers[self.steps % 2]
        for name, value in out.items():
            binding.bind_ortvalue_output(name, value)
        if not self.fixed:
            binding.bind_output("present_kv_cache", self.device)
        self.session.run_with_iobinding(binding)
        if self.fixed:
            kv = out["present_kv_cache"]
        else:
            kv = binding.get_outputs()[len(out)]  # outputs come back in binding order
        self.past = {
            "conv_states": out["present_conv_states"],
            "recurrent_states": out["present_recurrent_states"],
            "kv_cache": kv,
        }
        self.steps += 1
        return out["logits"].numpy()


class HostDecoder:
    """Copy-to-host fallback: every state goes through numpy between steps."""

    def __init__(self, decode: GraphSession, contract: ShapeContract, states: dict[str, ort.OrtValue | np.ndarray]):
        self.session = decode.session
        self.past = {name: _to_numpy(states[f"present_{name}"]) for name in STATE_NAMES}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds.update({f"past_{name}": value for name, value in self.past.items()})
        outputs = dict(zip(self.output_names, self.session.run(None, feeds)))
        self.past = {name: outputs[f"present_{name}"] for name in STATE_NAMES}
        return outputs["logits"]


def _to_numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)
