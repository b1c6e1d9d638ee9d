"""Host buffers of speculative decoding, the same on every backend (numpy only): the states of every position of
a verify run (:class:`VerifyBuffers`) and the MTP head's KV cache (:class:`MtpCache`).

A backend binds the buffers' rows where its graphs write (ONNX Runtime's IOBinding, OpenVINO's shared-memory
tensors), so the states after the accepted position are read by the next run where they were written, no copy.
A bf16 export's states are held as their raw 16 bits (numpy has no bf16: ``np.float16`` arrays that the backend
binds as bf16).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..contract import ShapeContract

HOST_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float16, "int8": np.int8}
"""numpy dtypes holding each state dtype (bf16: its raw bits, two bytes, as float16)."""


def _zeros(contract: ShapeContract, state: str, shape) -> np.ndarray:
    dtype = contract.mtp_kv_dtype if state == "mtp_kv_cache" else contract.state_dtype(state)
    return np.zeros(shape, dtype=HOST_DTYPES[dtype])


@dataclass
class VerifyBuffers:
    """Host buffers for one verify run's per-position states: ``conv [P, n_linear, 1, K-1, conv_dim]`` and
    ``rec [P, n_linear, 1, Hv, Dk, Dv]`` (P = the export's draft tokens + 1; a run of C tokens fills the first C),
    and, where the KV cache is not written in place, the whole cache after the run ``kv``
    (:meth:`~qwen35_onnx.contract.ShapeContract.state_shape` of ``'kv_cache'``, as wide as the generation's KV
    tier). ``bound``: what a backend made of them once (e.g. its tensors over the rows), kept with them."""

    conv: np.ndarray
    rec: np.ndarray
    kv: np.ndarray | None = None
    bound: dict = field(default_factory=dict)

    @classmethod
    def new(cls, contract: ShapeContract, width: int | None = None) -> VerifyBuffers:
        """Zero buffers, the KV cache ``width`` tokens wide (default: the capacity)."""
        positions = contract.draft_tokens + 1
        conv = _zeros(contract, "conv_states", (positions, *contract.state_shape("conv_states")))
        rec = _zeros(contract, "recurrent_states", (positions, *contract.state_shape("recurrent_states")))
        kv = None if contract.kv_in_place else _zeros(contract, "kv_cache", contract.state_shape("kv_cache", width))
        return cls(conv, rec, kv)

    def places(self, contract: ShapeContract, size: int) -> Iterator[tuple[str, str, np.ndarray]]:
        """``(state, output name, its place)`` of each per-position state output of a verify run of ``size``
        tokens (:meth:`~qwen35_onnx.contract.ShapeContract.verify_state_names`): a row ``[1, ...]`` of the
        position-major buffers (a view)."""
        for state, buffer in (("conv_states", self.conv), ("recurrent_states", self.rec)):
            flat = buffer.reshape(-1, *buffer.shape[2:])  # [P * n_linear, 1, ...]
            for name, place in zip(contract.verify_state_names(state, size), flat):
                yield state, name, place


@dataclass
class MtpCache:
    """The MTP head's KV cache ``[2, 1, Hkv, L, D]`` (L the capacity, or a KV tier: :meth:`widen`): one buffer
    written in place (``--ops ort``), or an A/B pair whose ``current`` one holds the cache (a run reads it and
    writes the other, then :meth:`flip`)."""

    buffers: list[np.ndarray] = field(default_factory=list)
    current: int = 0

    @classmethod
    def new(cls, contract: ShapeContract, width: int | None = None) -> MtpCache:
        """Zero buffers ``width`` tokens wide (default: the capacity)."""
        count = 1 if contract.kv_in_place else 2
        shape = contract.mtp_kv_shape_at(width or contract.capacity)
        return cls([_zeros(contract, "mtp_kv_cache", shape) for _ in range(count)])

    @property
    def width(self) -> int:
        """The KV slots the cache holds (its token axis)."""
        return int(self.kv.shape[3])

    def widen(self, width: int) -> None:
        """Hold the cache in buffers ``width`` tokens wide (a wider KV tier), its slots copied once."""
        old = self.kv
        self.buffers = [np.zeros((*old.shape[:3], width, old.shape[4]), dtype=old.dtype) for _ in self.buffers]
        self.current = 0
        self.kv[:, :, :, : old.shape[3]] = old

    @property
    def kv(self) -> np.ndarray:
        """The buffer holding the cache now."""
        return self.buffers[self.current]

    @property
    def next(self) -> np.ndarray:
        """The buffer a run writes (the other of an A/B pair; the same one in place)."""
        return self.buffers[(self.current + 1) % len(self.buffers)]

    def flip(self) -> None:
        """After a successful run that wrote :attr:`next`: that buffer holds the cache (a failed run leaves the
        cache as it was)."""
        self.current = (self.current + 1) % len(self.buffers)
