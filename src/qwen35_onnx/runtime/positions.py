"""Position ids for Qwen3.5's multimodal RoPE (mRoPE), in numpy (no torch).

Our graphs take ``position_ids`` of shape ``[4, 1, S]`` (int64):

* row 0 -- the plain text position ``0..S-1`` (prefill) or ``next_pos`` (decode);
  transformers' ``Qwen3_5TextModel.forward`` splits it off as ``text_position_ids``
  and uses it only for mask construction / attention kwargs, never for RoPE;
* rows 1-3 -- temporal, height and width mRoPE positions, the three rows the
  rotary embedding (``Qwen3_5TextRotaryEmbedding``, interleaved mrope_section)
  actually consumes.

This is exactly the layout ``Qwen3_5ForConditionalGeneration.generate()`` feeds
the text model (transformers 5.24, ``_prepare_position_ids_for_generation``
concatenates ``[text_positions, get_rope_index(...)]``), at prefill and at every
decode step (``GenerationMixin._update_model_kwargs_for_generation`` appends
``position_ids[..., -1:] + 1`` to all four rows).

Source: ``Qwen3_5Model.get_rope_index`` / ``get_vision_position_ids`` and
``Qwen3_5Model.compute_3d_position_ids`` in
transformers/models/qwen3_5/modeling_qwen3_5.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["decode_position_ids", "mrope_position_ids"]


def mrope_position_ids(
    input_ids: np.ndarray,
    image_token_id: int,
    image_grid_thw,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """Prefill position ids and ``rope_deltas`` for a prompt holding any number of images.

    Mirrors ``Qwen3_5Model.get_rope_index`` for batch 1, with the image tokens found as
    ``input_ids == image_token_id`` (transformers reads the same thing from the processor's
    ``mm_token_type_ids`` and, like here, takes each contiguous run of image tokens as one
    image, consuming the image grids in order):

    * text spans count up from the running position ``p``: ``p, p+1, ...``;
    * an image span (``t * h * w / merge**2`` tokens, row-major over the merged
      ``(t, h/merge, w/merge)`` grid) gets ``(p + ti, p + hi, p + wi)``;
    * after each image the running position advances by ``max(h, w) // merge``
      (not by the number of image tokens, and ignoring ``t``, as in Qwen3.5), so the text
      after an image, and the next image, continue from there;
    * ``rope_deltas = max(position) + 1 - S``, so that a token at text position
      ``n >= S`` has mRoPE position ``n + rope_deltas`` on all three rows.

    Without images rows 1-3 equal row 0 and ``rope_deltas == 0``, as transformers does
    for text-only prompts.

    Args:
        input_ids: int ``[1, S]`` token ids, S >= 1, no padding (positions of bucket
            padding appended after the prompt do not matter to the graphs).
        image_token_id: id of the image placeholder token (``config.image_token_id``).
        image_grid_thw: the ``(t, h, w)`` patch grid (before merging) of each image in
            prompt order: a sequence of grids, one grid for a single image, or ``None``
            (or an empty sequence) for a text-only prompt.
        spatial_merge_size: ``config.vision_config.spatial_merge_size``.

    Returns:
        ``(position_ids, rope_deltas)``: int64 ``[4, 1, S]`` (row 0 text positions,
        rows 1-3 temporal/height/width), and a Python int (usually negative).

    Raises:
        ValueError: ``input_ids`` is not ``[1, S]`` with S >= 1; a grid is not three
            positive ints with h and w divisible by the merge size; the number of runs of
            image tokens differs from the number of grids; or a run's length differs from
            its grid's ``t * h * w / merge**2``.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape [1, S] with S >= 1, got {ids.shape}")
    length = ids.shape[1]
    text = np.arange(length, dtype=np.int64)
    grids = _grid_list(image_grid_thw, spatial_merge_size)
    runs = _runs(ids[0] == image_token_id)
    if len(runs) != len(grids):
        n_tokens = sum(end - start for start, end in runs)
        raise ValueError(
            f"input_ids hold {n_tokens} image tokens (id {image_token_id}) in {len(runs)} contiguous runs "
            f"but {len(grids)} image grids were given (one run of image tokens per image)"
        )
    mrope = np.empty((3, length), dtype=np.int64)
    position, cursor = 0, 0  # running mRoPE position, next unassigned token
    for (start, end), (t, h, w) in zip(runs, grids):
        grid_t, grid_h, grid_w = t, h // spatial_merge_size, w // spatial_merge_size
        expected = grid_t * grid_h * grid_w
        if end - start != expected:
            raise ValueError(
                f"the image-token run at positions {start}..{end - 1} has {end - start} tokens but image grid "
                f"{(t, h, w)} with merge {spatial_merge_size} needs {expected}"
            )
        mrope[:, cursor:start] = np.arange(start - cursor) + position
        position += start - cursor
        tt, hh, ww = np.meshgrid(np.arange(grid_t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
        mrope[:, start:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + position
        position += max(h, w) // spatial_merge_size
        cursor = end
    mrope[:, cursor:] = np.arange(length - cursor) + position

    position_ids = np.concatenate([text[None], mrope]).astype(np.int64)[:, None, :]
    rope_deltas = int(mrope.max()) + 1 - length
    return position_ids, rope_deltas


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in a 1-D boolean array."""
    padded = np.concatenate([[False], flags, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _grid_list(image_grid_thw, merge: int) -> list[tuple[int, int, int]]:
    """The grids as a list of checked ``(t, h, w)`` tuples (one grid or a sequence of them)."""
    if image_grid_thw is None:
        return []
    array = np.asarray(image_grid_thw)
    if array.size == 0:
        return []
    if array.ndim == 1:
        return [_check_grid(array, merge)]
    if array.ndim != 2 or array.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be (t, h, w) or a sequence of them, got shape {array.shape}")
    return [_check_grid(row, merge) for row in array]


def decode_position_ids(next_pos: int, rope_deltas: int) -> np.ndarray:
    """Position ids of the single token of one decode step.

    Row 0 is the text position ``next_pos`` (== its KV slot, from
    ``masks.advance_mask``); rows 1-3 are ``next_pos + rope_deltas``.

    Equal to what transformers 5.24 uses during cached generation:

    * ``generate()`` passes 4-row ids and extends them with ``position_ids[..., -1:]
      + 1`` each step, giving row 0 = ``next_pos`` and rows 1-3 = ``(S - 1 +
      rope_deltas) + 1 + k == next_pos + rope_deltas`` -- provided the prompt's last
      token is text (all three mRoPE rows then agree). A chat template ends with the
      text generation prompt, so this holds.
    * A plain forward without ``position_ids`` and without ``attention_mask`` goes
      through ``compute_3d_position_ids`` (``cache_length > 0`` branch), which
      returns only the 3 mRoPE rows ``cache_length + rope_deltas``; the text model
      then has no text row (``text_position_ids = None``) but the logits are the
      same, since row 0 does not enter RoPE.

    Args:
        next_pos: text position / KV slot of the new token, >= 0.
        rope_deltas: from :func:`mrope_position_ids`.

    Returns:
        int64 ``[4, 1, 1]``.

    Raises:
        ValueError: ``next_pos`` is negative or not an integer.
    """
    if isinstance(next_pos, bool) or not isinstance(next_pos, (int, np.integer)) or next_pos < 0:
        raise ValueError(f"next_pos must be a non-negative integer, got {next_pos!r}")
    mrope = int(next_pos) + int(rope_deltas)
    return np.array([next_pos, mrope, mrope, mrope], dtype=np.int64).reshape(4, 1, 1)


def _check_grid(image_grid_thw: tuple[int, int, int], merge: int) -> tuple[int, int, int]:
    """Return ``(t, h, w)`` as Python ints, or raise ValueError naming the bad value."""
    grid = tuple(int(v) for v in np.asarray(image_grid_thw).reshape(-1))
    if len(grid) != 3 or min(grid) <= 0:
        raise ValueError(f"image_grid_thw must be three positive ints (t, h, w), got {image_grid_thw!r}")
    if merge <= 0 or grid[1] % merge or grid[2] % merge:
        raise ValueError(
            f"image grid height {grid[1]} and width {grid[2]} must be divisible by the spatial merge size {merge}"
        )
    return grid
