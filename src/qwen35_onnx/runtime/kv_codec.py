"""The KV cache between a prompt and its reply (numpy only, no torch).

An export's prompt graphs (prefill buckets and chunks) hold the KV cache in the activations' dtype
(:attr:`~qwen35_onnx.contract.ShapeContract.prompt_kv_dtype`), where attention over many new tokens runs fastest
(ONNX Runtime's GroupQueryAttention reads an fp32 cache at its GEMM rate; over an int8 cache it dequantizes per
query head, 2.3x the time of a 512-token chunk at 8k tokens of context, ``benchmarks/kv_precision.py``); its
decode and verify graphs hold it in the contract's :attr:`~qwen35_onnx.contract.ShapeContract.kv_precision`,
whose bytes a decode step reads (an int8 cache reads a quarter of fp32's). :class:`KvCodec` converts a cache
from one to the other: once when a generation passes from its prompt to its reply, and when a kept state (kept
in the decode dtype) starts a new prompt. Codes: symmetric int8 with the export's per-channel scales
(``text/kv_scales.npy``, :data:`~qwen35_onnx.contract.KV_SCALES`; the decode graph's GroupQueryAttention writes
new tokens with the same scales), ``round(x / scale)`` clamped to [-128, 127]; bf16 held as its raw bits in
float16 arrays (numpy has no bf16), rounded to nearest even.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..contract import KV_SCALES, ContractError, ShapeContract

__all__ = ["KvCodec"]

_FLOAT = {"fp32": np.float32, "fp16": np.float16}


class KvCodec:
    """Converts stacked KV caches ``[2 * n_full, B, Hkv, P, D]`` (entry ``2n`` the keys of full-attention layer
    ``n``, ``2n + 1`` its values) between the prompt graphs' dtype and the decode graphs' dtype of ``contract``.

    Args:
        contract: the export's contract.
        scales: ``[n_full, 2, Hkv, D]`` fp32, the int8 cache's per-channel scales (None where the cache is not int8).

    Raises:
        ContractError: an int8 cache without scales of that shape.
    """

    def __init__(self, contract: ShapeContract, scales: np.ndarray | None = None):
        self.prompt, self.decode = contract.prompt_kv_dtype, contract.kv_precision
        self.inverse = self.scales = None
        if self.decode == "int8":
            want = (contract.n_full, 2, contract.num_key_value_heads, contract.head_dim)
            if scales is None or tuple(scales.shape) != want:
                found = "none" if scales is None else list(scales.shape)
                raise ContractError(f"the int8 KV cache's scales must be {list(want)} fp32, found {found}")
            self.scales = scales.astype(np.float32).reshape(contract.n_full * 2, 1, want[2], 1, want[3])
            self.inverse = (1.0 / self.scales).astype(np.float32)

    @classmethod
    def for_export(cls, root: str | Path, contract: ShapeContract) -> KvCodec:
        """The codec of the export at ``root`` (its ``text/kv_scales.npy`` where the cache is int8).

        Raises:
            ContractError: an int8 export whose scales file is missing or malformed.
        """
        if contract.kv_precision != "int8":
            return cls(contract)
        path = Path(root) / "text" / KV_SCALES
        try:
            scales = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ContractError(
                f"{str(path)!r}: the int8 KV cache's scales cannot be read ({exc}); re-export the model"
            ) from exc
        return cls(contract, scales)

    @property
    def converts(self) -> bool:
        """The prompt's and the decode graphs' caches are of different dtypes."""
        return self.prompt != self.decode

    def to_decode(self, kv: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``kv`` (the prompt graphs' dtype) in the decode graphs' dtype, written into ``out`` (same shape) or a new
        array. An int8 code is ``clip(rint(x / scale), -128, 127)``."""
        return self._convert(kv, out, self.prompt, self.decode)

    def to_prompt(self, kv: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``kv`` (the decode graphs' dtype) in the prompt graphs' dtype (int8: code times scale)."""
        return self._convert(kv, out, self.decode, self.prompt)

    def _convert(self, kv: np.ndarray, out: np.ndarray | None, source: str, target: str) -> np.ndarray:
        if out is None:
            out = np.empty(kv.shape, dtype=np.int8 if target == "int8" else _FLOAT.get(target, np.float16))
        if source == target:
            np.copyto(out, kv)
            return out
        for j in range(kv.shape[0]):  # one entry at a time: the temporaries stay one layer's keys or values
            values = _to_float32(kv[j], source)
            if target == "int8":
                np.multiply(values, self.inverse[j], out=values)
                np.rint(values, out=values)
                np.clip(values, -128, 127, out=values)
                out[j] = values
            elif source == "int8":
                np.multiply(values, self.scales[j], out=values)
                _from_float32(values, target, out[j])
            else:
                _from_float32(values, target, out[j])
        return out


def _to_float32(entry: np.ndarray, dtype: str) -> np.ndarray:
    """A new fp32 copy of one cache entry held in ``dtype`` (bf16: raw bits in a float16 array)."""
    if dtype == "bf16":
        return (entry.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return entry.astype(np.float32)


def _from_float32(values: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write fp32 ``values`` into ``out`` in ``dtype`` (bf16: round to nearest even, raw bits)."""
    if dtype != "bf16":
        out[...] = values
        return
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    out.view(np.uint16)[...] = rounded.astype(np.uint16)
