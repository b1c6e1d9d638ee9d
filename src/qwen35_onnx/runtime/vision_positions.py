"""Per-image position inputs of the vision graph, in numpy (no torch).

The vision tower resamples its square learned position-embedding table (``side x side``) to each
image's patch grid and rotates attention by each patch's (row, col). Both depend only on the
image's ``grid_thw``, so the host computes them here, one image grid at a time, and feeds them to
the vision graph as inputs: one graph with a dynamic patch count, or several graphs exported for
static grids, all take the same three extra inputs (:func:`vision_position_inputs`).

The embedding resampling is a fixed gather-and-weight: patch ``i`` takes
``sum_k table[indices[i, k]] * weights[i, k]`` over 4 taps (bilinear) or 16 (bicubic, Keys kernel
with ``a = -0.75``), with out-of-table taps clamped to the border. Qwen3.5 uses bilinear with
``align_corners=True`` (``Qwen3_5VisionModel.__init__``). Patches come in spatial-merge-block
order: ``merge x merge`` blocks in raster order, raster order inside each block, and the whole
frame repeated ``t`` times.

Source: ``get_vision_interpolation_indices_and_weights``, ``_interpolation_axis_taps_weights``
and ``get_vision_position_ids`` in transformers 5.24 ``transformers/vision_utils.py``. The
arithmetic is float32 step by step in the same order as torch there, so indices are identical
and weights agree to float32 rounding.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["MODES", "interpolation_taps", "rotary_position_ids", "vision_position_inputs"]

#: Interpolation mode -> tap offsets along one axis, relative to ``floor(src)``.
MODES = {"bilinear": np.arange(0, 2), "bicubic": np.arange(-1, 3)}

_F32 = np.float32


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_grid(grid_thw, merge) -> tuple[int, int, int, int]:
    merge = _positive_int("merge", merge)
    try:
        t, h, w = grid_thw
    except (TypeError, ValueError):
        raise ValueError(f"grid_thw must be three positive ints (t, h, w), got {grid_thw!r}") from None
    t, h, w = (_positive_int(f"grid_thw {axis}", v) for axis, v in zip("thw", (t, h, w)))
    if h % merge or w % merge:
        raise ValueError(f"grid_thw (h, w) = ({h}, {w}) must both be divisible by merge = {merge}")
    return t, h, w, merge


def _axis_taps(size: int, side: int, mode: str, align_corners: bool) -> tuple[np.ndarray, np.ndarray]:
    """Taps into a ``side``-long table and their weights for target positions ``0..size-1``:
    int64 and float32, both ``[size, n]`` (n = 2 or 4)."""
    index = np.arange(size, dtype=_F32)
    if align_corners:  # ends map to ends; a 1-long axis maps to 0
        src = index * _F32(side - 1) / _F32(max(size - 1, 1))
    else:  # half-pixel centres
        src = (index + _F32(0.5)) * _F32(side) / _F32(size) - _F32(0.5)
    floor = np.floor(src)
    offsets = MODES[mode]
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(_F32))
    if mode == "bilinear":
        weights = np.maximum(_F32(1) - d, _F32(0))
    else:  # Keys cubic convolution, a = -0.75
        a = -0.75
        near = ((_F32(a + 2) * d - _F32(a + 3)) * d * d) + _F32(1)
        far = ((_F32(a) * d - _F32(5 * a)) * d + _F32(8 * a)) * d - _F32(4 * a)
        weights = np.where(d <= 1, near, far)
    return taps, weights.astype(_F32, copy=False)


def _block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of one frame's patches in spatial-merge-block order, each int64 ``[h*w]``."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return (a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols))


def interpolation_taps(
    grid_thw: tuple[int, int, int], side: int, merge: int, mode: str = "bilinear", align_corners: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices and weights that resample the ``side x side`` position-embedding table to
    one image grid, as ``F.interpolate(mode=mode, align_corners=align_corners)`` with border
    clamping.

    Args:
        grid_thw: ``(t, h, w)`` patches; ``h`` and ``w`` divisible by ``merge``.
        side: the table's side length (``sqrt(num_position_embeddings)``), >= 1.
        merge: spatial merge size (patch order; ``1`` is raster order), >= 1.
        mode: ``"bilinear"`` (4 taps) or ``"bicubic"`` (16 taps).
        align_corners: as in ``F.interpolate``.

    Returns:
        ``(indices, weights)``: int64 and float32, both ``[t*h*w, taps]``; ``indices`` index the
        row-major flattened table (``row * side + col``).

    Raises:
        ValueError: a bad grid, ``side``, ``merge`` or ``mode``.
    """
    t, h, w, merge = _check_grid(grid_thw, merge)
    side = _positive_int("side", side)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    h_taps, h_weights = _axis_taps(h, side, mode, align_corners)
    w_taps, w_weights = _axis_taps(w, side, mode, align_corners)
    rows, cols = _block_order(h, w, merge)
    n = h_taps.shape[1]
    # separable 2-D kernel: every row tap with every column tap
    indices = (h_taps[rows, :, None] * side + w_taps[cols, None, :]).reshape(-1, n * n)
    weights = (h_weights[rows, :, None] * w_weights[cols, None, :]).reshape(-1, n * n)
    return np.tile(indices, (t, 1)), np.tile(weights, (t, 1))


def rotary_position_ids(grid_thw: tuple[int, int, int], merge: int) -> np.ndarray:
    """(row, col) of each patch of one image grid for the vision rotary embedding.

    Args:
        grid_thw: ``(t, h, w)`` patches; ``h`` and ``w`` divisible by ``merge``.
        merge: spatial merge size, >= 1.

    Returns:
        int64 ``[t*h*w, 2]`` in spatial-merge-block order, each frame repeated ``t`` times.

    Raises:
        ValueError: a bad grid or ``merge``.
    """
    t, h, w, merge = _check_grid(grid_thw, merge)
    return np.tile(np.stack(list(_block_order(h, w, merge)), axis=-1), (t, 1))


def vision_position_inputs(
    grid_thw: tuple[int, int, int], side: int, merge: int, mode: str = "bilinear", align_corners: bool = True
) -> dict[str, np.ndarray]:
    """The three position inputs of the vision graph for one image grid (``N = t*h*w``):
    ``pos_embed_indices`` int64 ``[N, taps]``, ``pos_embed_weights`` float32 ``[N, taps]``
    (:func:`interpolation_taps`) and ``rotary_position_ids`` int64 ``[N, 2]``
    (:func:`rotary_position_ids`). Raises ValueError as those do."""
    indices, weights = interpolation_taps(grid_thw, side, merge, mode, align_corners)
    return {
        "pos_embed_indices": indices,
        "pos_embed_weights": weights,
        "rotary_position_ids": rotary_position_ids(grid_thw, merge),
    }
