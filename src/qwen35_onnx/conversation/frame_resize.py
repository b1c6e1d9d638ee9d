"""Resize uint8 RGB frames exactly as the checkpoint's video processor does (numpy, no torch).

transformers' ``Qwen3VLVideoProcessor`` resizes the decoded uint8 frames with torchvision
(``tvF.resize(..., antialias=True)``), which on x86 CPUs runs PyTorch's uint8 antialiased kernel
(``aten/src/ATen/native/cpu/UpSampleKernelAVXAntialias.h``, after Pillow-SIMD's ``ImagingResample``):

* separable: the width first, then the height, each pass rounding to uint8;
* per output pixel, Pillow's antialiased taps: ``center = scale * (i + 0.5)`` with ``scale = in / out``, the
  input pixels ``[int(center - support + 0.5), int(center + support + 0.5))`` (``support`` the filter's
  support times ``max(scale, 1)``), weights ``filter((j - center + 0.5) / max(scale, 1))`` normalised to sum 1;
* the weights in fixed point: ``precision`` the most bits (up to 22) that keep the largest weight under
  2**15 when doubled, each weight ``w * 2**precision`` rounded half away from zero to an integer; a pixel is
  ``clip((2**(precision-1) + sum(x * w_int)) >> precision, 0, 255)``.

The integer sums are computed as banded matrix products in float32 where every partial sum stays below 2**24
(exact there), else float64.

Pillow's own resize differs from it by one level in a few pixels (its fixed point has other bits). Checked
bit for bit against torchvision in ``tests/test_video.py``.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["FILTERS", "resize_frames"]


def _bicubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    return np.maximum(1.0 - np.abs(x), 0.0)


FILTERS = {3: (_bicubic, 2.0), 2: (_bilinear, 1.0)}
"""PIL resampling code -> (filter, support): 3 bicubic (Keys, a = -0.5), 2 bilinear."""


@functools.lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int, resample: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(indices [out, K], weights [out, K] int32, precision)`` of one axis (module docstring); unused taps
    point at pixel 0 with weight 0."""
    kernel, support = FILTERS[resample]
    scale = in_size / out_size
    support = support * scale if scale >= 1.0 else support
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    rows = []
    for i in range(out_size):
        center = scale * (i + 0.5)
        start = max(int(center - support + 0.5), 0)
        size = min(int(center + support + 0.5), in_size) - start
        w = kernel((np.arange(size) + start - center + 0.5) * invscale)
        total = w.sum()
        rows.append((start, w / total if total != 0 else w))
    largest = max(float(w.max()) for _, w in rows)
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    taps = max(len(w) for _, w in rows)
    indices = np.zeros((out_size, taps), dtype=np.intp)
    weights = np.zeros((out_size, taps), dtype=np.int32)
    for i, (start, w) in enumerate(rows):
        scaled = w * (1 << precision)
        indices[i, : len(w)] = np.arange(start, start + len(w))
        weights[i, : len(w)] = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5))
    return indices, weights, precision


BLOCK = 32
"""Output pixels computed together by one matrix product (each block reads its inputs' span only)."""


@functools.lru_cache(maxsize=64)
def _bands(in_size: int, out_size: int, resample: int) -> tuple[tuple, int, type]:
    """The taps of an axis as banded matrices: per block of :data:`BLOCK` outputs ``(start, stop, matrix)`` with
    ``matrix`` ``[stop - start, block]`` holding the integer weights, the precision, and the float type in which
    the products and sums are exact (float32 while ``255 * sum |w|`` stays below 2**24, else float64)."""
    indices, weights, precision = _taps(in_size, out_size, resample)
    exact = 255 * int(np.abs(weights).sum(axis=1).max()) < 2**24
    dtype = np.float32 if exact else np.float64
    bands = []
    for begin in range(0, out_size, BLOCK):
        end = min(begin + BLOCK, out_size)
        idx, w = indices[begin:end], weights[begin:end]
        used = w != 0
        start = int(idx[used].min()) if used.any() else 0
        stop = int(idx[used].max()) + 1 if used.any() else 1
        matrix = np.zeros((stop - start, end - begin), dtype=dtype)
        rows, cols = np.nonzero(used)
        np.add.at(matrix, (idx[rows, cols] - start, rows), w[rows, cols])
        bands.append((begin, end, start, stop, matrix))
    return tuple(bands), precision, dtype


def _pass(frames: np.ndarray, out_size: int, axis: int, resample: int) -> np.ndarray:
    """One axis (1: height, 2: width) of uint8 ``[T, H, W, C]`` resized to ``out_size``: the integer sums of the
    module docstring as banded matrix products in a float type that holds them exactly, then shifted and clipped."""
    bands, precision, dtype = _bands(frames.shape[axis], out_size, resample)
    moved = np.moveaxis(frames, axis, -1)
    lead = moved.shape[:-1]
    x = moved.reshape(-1, moved.shape[-1]).astype(dtype)
    acc = np.empty((x.shape[0], out_size), dtype=dtype)
    for begin, end, start, stop, matrix in bands:
        np.matmul(x[:, start:stop], matrix, out=acc[:, begin:end])
    acc += dtype(1 << (precision - 1))
    acc /= dtype(1 << precision)  # a power of two: exact
    out = np.clip(np.floor(acc), 0, 255).astype(np.uint8).reshape(*lead, out_size)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


def resize_frames(frames: np.ndarray, height: int, width: int, resample: int = 3) -> np.ndarray:
    """Frames resized as torchvision resizes uint8 frames with antialiasing (module docstring).

    Args:
        frames: uint8 ``[T, H, W, C]``.
        height, width: the output size in pixels (>= 1).
        resample: PIL resampling code: 3 bicubic (the video processor's), 2 bilinear.

    Returns:
        uint8 ``[T, height, width, C]``.

    Raises:
        ValueError: another resampling code.
    """
    if resample not in FILTERS:
        raise ValueError(f"video resampling {resample} is not supported (2 bilinear or 3 bicubic)")
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if width != frames.shape[2]:
        frames = _pass(frames, width, 2, resample)
    if height != frames.shape[1]:
        frames = _pass(frames, height, 1, resample)
    return frames
