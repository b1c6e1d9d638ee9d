"""A prompt checked against the contract: token ids, image patches, mRoPE positions and the
prefill bucket it runs in (numpy only, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import ShapeContract
from .positions import mrope_position_ids

__all__ = ["PreparedPrompt", "prepare_ids"]


@dataclass
class PreparedPrompt:
    """Host-side inputs of one request, checked against the contract: ids ``[1, S]`` int64,
    pixel values ``[n_images * n_patches, patch_dim]`` fp32 (the images' patches one after the
    other; None for a text-only prompt), position ids ``[4, 1, S]`` int64, ``rope_deltas``, the
    prefill ``bucket`` (tokens) it will run in, and whether the rendered prompt ends inside an
    open ``<think>`` block (``opens_reasoning``: the reply starts as reasoning)."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None
    position_ids: np.ndarray
    rope_deltas: int
    bucket: int
    n_images: int = 0
    opens_reasoning: bool = False

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])

    def padded(self, pad_token_id: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids ``[1, bucket]``, attention mask ``[1, bucket]`` and position ids ``[4, 1, bucket]``
        (int64), right-padded to the prefill bucket with ``pad_token_id`` (0 if None); the padded
        positions are masked out exactly inside the graph."""
        pad = self.bucket - self.prompt_len
        ids = np.pad(self.input_ids, ((0, 0), (0, pad)), constant_values=pad_token_id or 0)
        mask = np.zeros((1, self.bucket), dtype=np.int64)
        mask[0, : self.prompt_len] = 1
        positions = np.pad(self.position_ids, ((0, 0), (0, 0), (0, pad)))
        return ids, mask, positions


def prepare_ids(
    contract: ShapeContract, input_ids: np.ndarray, pixel_values: np.ndarray | None = None
) -> PreparedPrompt:
    """Check already tokenized input against ``contract`` and compute its positions
    (:func:`~.positions.mrope_position_ids`).

    Args:
        input_ids: int ``[1, S]``; holds ``n_image_tokens`` image tokens per image, each
            image's tokens one contiguous run.
        pixel_values: fp32 ``[n_images * n_patches, patch_dim]`` (1 <= n_images <=
            ``max_images``) or None.

    Raises:
        ValueError: bad shape, token ids outside the vocabulary, image tokens that do not
            match the images, more images than ``max_images``, or a prompt longer than the
            largest bucket / capacity.
    """
    c = contract
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be integers of shape [1, S] with S >= 1, got {ids.dtype} {ids.shape}")
    low, high = int(ids.min()), int(ids.max())  # Python ints: no wrap-around for uint64
    if low < 0 or high >= c.vocab_size:
        raise ValueError(f"token ids must lie in [0, {c.vocab_size}), got min {low} max {high}")
    ids = ids.astype(np.int64)
    bucket = c.select_bucket(int(ids.shape[1]))
    n_images = 0
    if pixel_values is not None:
        pixel_values = np.asarray(pixel_values)
        rows = pixel_values.shape[0] if pixel_values.ndim == 2 else 0
        if (
            pixel_values.ndim != 2
            or pixel_values.shape[1] != c.patch_dim
            or rows == 0
            or rows % c.n_patches
            or pixel_values.dtype.kind not in "fiu"
        ):
            raise ValueError(
                f"pixel_values must be numbers of shape [n_images * {c.n_patches}, {c.patch_dim}] (the exported "
                f"grid, images one after the other), got {pixel_values.dtype} {tuple(pixel_values.shape)}"
            )
        n_images = rows // c.n_patches
        if n_images > c.max_images:
            raise ValueError(f"pixel_values hold {n_images} images, more than the export's max_images {c.max_images}")
        if not np.isfinite(pixel_values).all():
            raise ValueError("pixel_values hold NaN or infinite values")
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
    grids = [c.grid_thw] * n_images
    positions, rope_deltas = mrope_position_ids(ids, c.image_token_id, grids, c.spatial_merge_size)
    return PreparedPrompt(ids, pixel_values, positions, int(rope_deltas), bucket, n_images)
