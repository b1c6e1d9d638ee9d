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
    pixel values ``[sum of h*w, patch_dim]`` fp32 (the images' patches one after the other; None
    for a text-only prompt), each image's patch grid ``(t, h, w)`` in prompt order
    (``image_grids``), position ids ``[4, 1, S]`` int64, ``rope_deltas``, the prefill ``bucket``
    (tokens) it will run in, whether the rendered prompt ends inside an open ``<think>`` block
    (``opens_reasoning``: the reply starts as reasoning), and for a chat the positions where a later
    prompt is likely to repeat this one (``snapshot_points``: after the system prompt, before the
    generation prompt; where a state snapshot is worth keeping)."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None
    position_ids: np.ndarray
    rope_deltas: int
    bucket: int
    image_grids: tuple[tuple[int, int, int], ...] = ()
    opens_reasoning: bool = False
    snapshot_points: tuple[int, ...] = ()

    @property
    def n_images(self) -> int:
        return len(self.image_grids)

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
    contract: ShapeContract,
    input_ids: np.ndarray,
    pixel_values: np.ndarray | None = None,
    image_grids=(),
) -> PreparedPrompt:
    """Check already tokenized input against ``contract`` and compute its positions
    (:func:`~.positions.mrope_position_ids`).

    Args:
        input_ids: int ``[1, S]``; holds ``t*h*w / merge**2`` image tokens per image, each image's
            tokens one contiguous run.
        pixel_values: fp32 ``[sum of t*h*w, patch_dim]`` (the images' patches one after the other)
            or None.
        image_grids: each image's patch grid ``(t, h, w)`` (or ``(h, w)``), in prompt order; one
            per image, none without ``pixel_values``.

    Raises:
        ValueError: bad shape, token ids outside the vocabulary, image tokens that do not match
            the images, more image tokens than a bucket prefill's rows (``max_images`` x ``image_tokens``;
            chunked prefill has no such limit), a grid the export does not serve, or a prompt longer than the
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
    grids = tuple(_grid(g) for g in image_grids)
    if pixel_values is None and grids:
        raise ValueError(f"{len(grids)} image grids were given without pixel_values")
    vision_tokens = sum(t * h * w for t, h, w in grids) // c.spatial_merge_size**2
    if not c.prefill_chunks and vision_tokens > c.n_image_rows:
        # (chunked prefill takes any number of images; a bucket's prefill graph has rows for max_images)
        raise ValueError(
            f"the prompt holds {len(grids)} images (or video frame pairs) of {vision_tokens} image tokens, more than "
            f"the {c.n_image_rows} rows of this export's prefill graphs (max_images {c.max_images} x "
            f"{c.image_tokens}); re-export with --prefill-chunks, or with more --max-images"
        )
    for _, h, w in grids:
        c.check_grid((h, w))
    if pixel_values is not None:
        pixel_values = np.asarray(pixel_values)
        rows = sum(t * h * w for t, h, w in grids)
        if (
            not grids
            or pixel_values.ndim != 2
            or pixel_values.shape != (rows, c.patch_dim)
            or pixel_values.dtype.kind not in "fiu"
        ):
            raise ValueError(
                f"pixel_values must be numbers of shape [{rows}, {c.patch_dim}] (the patches of the image grids "
                f"{[g[1:] for g in grids]}, one image after the other), got {pixel_values.dtype} "
                f"{tuple(pixel_values.shape)}"
            )
        if not np.isfinite(pixel_values).all():
            raise ValueError("pixel_values hold NaN or infinite values")
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
    positions, rope_deltas = mrope_position_ids(ids, c.image_token_id, list(grids), c.spatial_merge_size)
    return PreparedPrompt(ids, pixel_values, positions, int(rope_deltas), bucket, grids)


def _grid(grid) -> tuple[int, int, int]:
    """``(h, w)`` or ``(1, h, w)`` as ``(1, h, w)`` ints.

    Raises:
        ValueError: anything else (video grids with t > 1 are not served).
    """
    values = tuple(int(v) for v in np.asarray(grid).reshape(-1))
    if len(values) == 2:
        values = (1, *values)
    if len(values) != 3 or values[0] != 1 or min(values) < 1:
        raise ValueError(f"an image grid must be (h, w) or (1, h, w) with positive sides, got {grid!r}")
    return values
