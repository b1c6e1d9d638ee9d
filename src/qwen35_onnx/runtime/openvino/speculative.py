"""Speculative decoding's graph runs on OpenVINO (no torch): the verify graph and the MTP head's graph of a
``--ops portable`` export, with the shared host buffers of :mod:`qwen35_onnx.runtime.draft_buffers` bound as
OpenVINO tensors over their memory (``ov.Tensor(array, shape, type)``: no copy; a bf16 state's raw bits bound as
bf16).

A verify run writes each position's conv and recurrent state into a row of the buffers (tensors made once per
buffer set and run size) and the whole KV cache after it into the buffers' ``kv`` (a portable graph returns the
cache: the two buffer sets a speculation alternates are its A/B pair); the states after the accepted position are
tensors over those rows, which the next run or a decoder reads where they are. The MTP head's cache is an A/B
pair of host buffers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from ...contract import STATE_NAMES, ShapeContract
from ..draft_buffers import MtpCache, VerifyBuffers
from .decoders import STATE_TYPES, run_request, set_inputs


def bound_tensor(contract: ShapeContract, state: str, array: np.ndarray) -> ov.Tensor:
    """An OpenVINO tensor over ``array``'s memory (C-contiguous) with ``state``'s element type."""
    return ov.Tensor(array, list(array.shape), STATE_TYPES[contract.state_dtype(state)])


@dataclass
class VerifyResult:
    """What a verify run left: the buffers holding each position's conv and recurrent states and the KV cache after
    the run."""

    buffers: VerifyBuffers
    contract: ShapeContract

    def states_after(self, position: int, host: bool = False) -> dict:
        """The states after ``position`` (0-based), keyed ``present_*``: tensors over the buffers' rows (no copy),
        or with ``host`` the host arrays themselves."""
        arrays = {
            "present_conv_states": self.buffers.conv[position],
            "present_recurrent_states": self.buffers.rec[position],
            "present_kv_cache": self.buffers.kv,
        }
        if host:
            return arrays
        return {name: bound_tensor(self.contract, name.removeprefix("present_"), a) for name, a in arrays.items()}


def _outputs(contract: ShapeContract, buffers: VerifyBuffers, size: int) -> dict[str, ov.Tensor]:
    """The tensors a verify run of ``size`` tokens writes its states into (made once per buffer set and size)."""
    key = ("openvino", size)
    if key not in buffers.bound:
        tensors = {name: bound_tensor(contract, state, place) for state, name, place in buffers.places(contract, size)}
        tensors["present_kv_cache"] = bound_tensor(contract, "kv_cache", buffers.kv)
        buffers.bound[key] = tensors
    return buffers.bound[key]


def _past(contract: ShapeContract, value, state: str) -> ov.Tensor:
    """``value`` as an input tensor: itself, or a tensor over the host array (C-contiguous: every state array is;
    a copy would be freed while the request still points into it)."""
    if isinstance(value, ov.Tensor):
        return value
    if not value.flags.c_contiguous:
        raise ValueError(f"the {state} host array must be C-contiguous to be bound as an OpenVINO input")
    return bound_tensor(contract, state, value)


def run_verify(
    request: ov.InferRequest,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    states: dict,
    buffers: VerifyBuffers,
) -> tuple[np.ndarray, np.ndarray, VerifyResult]:
    """One verify run on ``request`` (the compiled verify graph's): host ``feeds`` (``input_ids [1, C]``,
    ``attention_mask [1, L]``, ``position_ids [4, 1, C]``), the past ``states`` (``present_*``, OpenVINO tensors or
    host arrays, stacked), each position's states and the KV cache after the run into ``buffers`` (not the set
    ``states`` point into). Returns the logits ``[1, C, V]`` and hidden states ``[1, C, hidden]`` (fp32 host
    copies) and the :class:`VerifyResult`."""
    set_inputs(request, feeds)
    for state in STATE_NAMES:
        request.set_tensor(f"past_{state}", _past(contract, states[f"present_{state}"], state))
    for name, tensor in _outputs(contract, buffers, int(feeds["input_ids"].shape[1])).items():
        request.set_tensor(name, tensor)
    run_request(request)
    logits = request.get_tensor("logits").data.copy()
    hidden = request.get_tensor("hidden_states").data.copy()
    return logits, hidden, VerifyResult(buffers, contract)


def run_mtp(
    request: ov.InferRequest, contract: ShapeContract, feeds: dict[str, np.ndarray], cache: MtpCache
) -> tuple[np.ndarray, np.ndarray, MtpCache]:
    """One run of an MTP graph on ``request``: host ``feeds`` after ``cache`` (its other buffer becomes current).
    Returns the draft logits ``[1, 1, V]`` and ``mtp_hidden [1, 1, hidden]`` (fp32 host copies) and the cache."""
    set_inputs(request, feeds)
    request.set_tensor("past_mtp_kv_cache", bound_tensor(contract, "kv_cache", cache.kv))
    request.set_tensor("present_mtp_kv_cache", bound_tensor(contract, "kv_cache", cache.next))
    run_request(request)
    cache.flip()
    return request.get_tensor("logits").data.copy(), request.get_tensor("mtp_hidden").data.copy(), cache
