"""Speculative decoding's graph runs on ONNX Runtime (CPU, no torch): the verify graph, whose conv and recurrent
states of every position go into the buffers a speculation alternates
(:class:`~qwen35_onnx.runtime.draft_buffers.VerifyBuffers`: a round writes the pair its states do not point into,
and the accepted position's states are views of it, no copy), and the MTP head's graph with its own KV cache
(:class:`~qwen35_onnx.runtime.draft_buffers.MtpCache`).

The KV caches are written in place with ``--ops ort`` (GroupQueryAttention over the capacity-wide entries: the
slots of rejected drafts are left to be written over); with ``--ops portable`` a run returns the whole cache, into
the buffer of an A/B pair that the run does not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ...contract import ShapeContract
from ..draft_buffers import MtpCache, VerifyBuffers
from .decoders import bind_entries, host_present, run_host_outputs

MTP_KV = "mtp_kv_cache"


@dataclass
class VerifyResult:
    """What a verify run left: the buffers holding each position's conv and recurrent states, and the KV cache
    after it (an OrtValue, or a host array on the host path)."""

    buffers: VerifyBuffers
    kv: object

    def states_after(self, position: int, host: bool = False) -> dict:
        """The states after ``position`` (0-based), keyed ``present_*``: OrtValues over the buffers' rows (no
        copy), or with ``host`` the host arrays."""
        conv, rec = self.buffers.conv[position], self.buffers.rec[position]
        if host:
            return {"present_conv_states": conv, "present_recurrent_states": rec, "present_kv_cache": self.kv}
        wrap = ort.OrtValue.ortvalue_from_numpy
        return {"present_conv_states": wrap(conv), "present_recurrent_states": wrap(rec), "present_kv_cache": self.kv}


def _bind_host(binding: ort.IOBinding, feeds: dict[str, np.ndarray]) -> None:
    for name, value in feeds.items():
        binding.bind_cpu_input(name, np.ascontiguousarray(value))


def _bind_array_output(binding: ort.IOBinding, name: str, array: np.ndarray) -> None:
    binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def run_verify_bound(
    session: ort.InferenceSession,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    states: dict,
    buffers: VerifyBuffers,
    options: ort.RunOptions | None = None,
) -> tuple[np.ndarray, np.ndarray, VerifyResult]:
    """One verify run with IOBinding on the CPU: host ``feeds``; the past ``states`` (``present_*`` OrtValues,
    stacked; bound entry by entry where the graph takes them so); each position's conv and recurrent states into
    the first rows of ``buffers``; the KV cache in place (``--ops ort``) or into ``buffers.kv``. Returns the
    logits ``[1, C, V]``, the hidden states ``[1, C, hidden]`` and the :class:`VerifyResult`."""
    size = int(feeds["input_ids"].shape[1])
    binding = session.io_binding()
    _bind_host(binding, feeds)
    binding.bind_output("logits", "cpu")
    binding.bind_output("hidden_states", "cpu")
    for state in ("conv_states", "recurrent_states"):
        past = states[f"present_{state}"]
        if contract.kv_in_place:
            bind_entries(binding, contract, "cpu", state, "past", past)
        else:
            binding.bind_ortvalue_input(f"past_{state}", past)
    for _, name, place in buffers.places(contract, size):  # each state where it stays
        _bind_array_output(binding, name, place)
    kv = states["present_kv_cache"]
    if contract.kv_in_place:
        bind_entries(binding, contract, "cpu", "kv_cache", "past", kv)
        bind_entries(binding, contract, "cpu", "kv_cache", "present", kv)  # in place
    else:
        binding.bind_ortvalue_input("past_kv_cache", kv)
        _bind_array_output(binding, "present_kv_cache", buffers.kv)
        kv = ort.OrtValue.ortvalue_from_numpy(buffers.kv)
    session.run_with_iobinding(binding, options)
    logits, hidden = (value.numpy() for value in binding.get_outputs()[:2])
    return logits, hidden, VerifyResult(buffers, kv)


def run_verify_host(
    session: ort.InferenceSession,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    states: dict,
    buffers: VerifyBuffers,
    options: ort.RunOptions | None = None,
) -> tuple[np.ndarray, np.ndarray, VerifyResult]:
    """:func:`run_verify_bound` with every state through numpy (``--host-state-roundtrip``): the per-position
    states are copied into ``buffers``; the KV cache comes back stacked (a new array)."""
    outputs = run_host_outputs(session, contract, feeds, states, options)
    for _, name, place in buffers.places(contract, int(feeds["input_ids"].shape[1])):
        place[...] = outputs[name]
    kv = host_present(contract, outputs, "kv_cache")
    return outputs["logits"], outputs["hidden_states"], VerifyResult(buffers, kv)


def run_mtp(
    session: ort.InferenceSession,
    contract: ShapeContract,
    feeds: dict[str, np.ndarray],
    cache: MtpCache,
    options: ort.RunOptions | None = None,
) -> tuple[np.ndarray, np.ndarray, MtpCache]:
    """One run of an MTP graph with IOBinding on the CPU: host ``feeds`` after ``cache`` (updated: in place, or
    its other buffer becomes current). Returns the draft logits ``[1, 1, V]``, ``mtp_hidden [1, 1, hidden]`` and
    the cache."""
    binding = session.io_binding()
    _bind_host(binding, feeds)
    binding.bind_output("logits", "cpu")
    binding.bind_output("mtp_hidden", "cpu")
    kv = cache.kv
    if contract.kv_in_place:
        entry = kv.nbytes // 2
        for j in range(2):
            for prefix, bind in (("past", binding.bind_input), ("present", binding.bind_output)):
                bind(f"{prefix}_{MTP_KV}.{j}", "cpu", 0, kv.dtype, list(kv.shape[1:]), kv.ctypes.data + j * entry)
    else:
        binding.bind_cpu_input(f"past_{MTP_KV}", kv)
        _bind_array_output(binding, f"present_{MTP_KV}", cache.next)
    session.run_with_iobinding(binding, options)
    cache.flip()
    logits, hidden = (value.numpy() for value in binding.get_outputs()[:2])
    return logits, hidden, cache
