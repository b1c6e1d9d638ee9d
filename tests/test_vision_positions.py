"""Vision position inputs (qwen35_onnx.runtime.vision_positions) against transformers.

Reference: ``get_vision_interpolation_indices_and_weights`` and ``get_vision_position_ids`` in
transformers 5.24 ``transformers/vision_utils.py``, called with one image grid.
"""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.runtime.vision_positions import (
    interpolation_taps,
    rotary_position_ids,
    vision_position_inputs,
)

torch = pytest.importorskip("torch")
vision_utils = pytest.importorskip("transformers.vision_utils")


@st.composite
def cases(draw):
    merge = draw(st.sampled_from([1, 2]))
    t = draw(st.integers(1, 2))
    h, w = (merge * draw(st.integers(1, 64 // merge)) for _ in range(2))
    side = draw(st.integers(2, 48))
    mode = draw(st.sampled_from(["bilinear", "bicubic"]))
    align_corners = draw(st.booleans())
    return (t, h, w), side, merge, mode, align_corners


@settings(max_examples=60, deadline=None)
@given(cases())
def test_matches_transformers(case):
    grid, side, merge, mode, align_corners = case
    grid_thw = torch.tensor([grid])
    ref_indices, ref_weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid_thw, side, mode=mode, align_corners=align_corners, spatial_merge_size=merge
    )
    ref_ids = vision_utils.get_vision_position_ids(grid_thw, merge)

    inputs = vision_position_inputs(grid, side, merge, mode, align_corners)
    indices, weights, ids = (inputs[k] for k in ("pos_embed_indices", "pos_embed_weights", "rotary_position_ids"))
    n, taps = grid[0] * grid[1] * grid[2], 4 if mode == "bilinear" else 16
    assert (indices.dtype, weights.dtype, ids.dtype) == (np.int64, np.float32, np.int64)
    assert indices.shape == weights.shape == (n, taps) and ids.shape == (n, 2)
    np.testing.assert_array_equal(indices, ref_indices.numpy())
    np.testing.assert_allclose(weights, ref_weights.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ids, ref_ids.numpy())


def test_small_known_case():
    # a 2x2 table stretched to 2x4 with align_corners: rows hit the table rows exactly, columns
    # land at 0, 1/3, 2/3, 1; merge 2 orders the patches block by block
    indices, weights = interpolation_taps((1, 2, 4), side=2, merge=2)
    np.testing.assert_array_equal(
        rotary_position_ids((1, 2, 4), 2),
        [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]],
    )
    # patch 1 is (row 0, col 1): src col 1/3 -> table cols 0 and 1 weighted 2/3 and 1/3
    np.testing.assert_array_equal(indices[1], [0, 1, 2, 3])
    np.testing.assert_allclose(weights[1], [2 / 3, 1 / 3, 0, 0], atol=1e-7)
    # patch 7 is (row 1, col 3): the bottom-right corner, its far taps clamped to the border
    np.testing.assert_array_equal(indices[7], [3, 3, 3, 3])
    np.testing.assert_allclose(weights[7], [1, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(weights.sum(1), 1, atol=1e-6)
    # t = 2 repeats the frame
    two, _ = interpolation_taps((2, 2, 4), side=2, merge=2)
    np.testing.assert_array_equal(two, np.tile(indices, (2, 1)))


def test_side_one_is_constant():
    indices, weights = interpolation_taps((1, 3, 5), side=1, merge=1, mode="bicubic", align_corners=False)
    assert indices.shape == (15, 16) and not indices.any()
    np.testing.assert_allclose(weights.sum(1), 1, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(grid_thw=(1, 2)), "(1, 2)"),
        (dict(grid_thw=(0, 2, 2)), "t must be a positive int, got 0"),
        (dict(grid_thw=(1, 2.0, 2)), "h must be a positive int, got 2.0"),
        (dict(grid_thw=(1, 2, True)), "w must be a positive int, got True"),
        (dict(grid_thw=(1, 4, 6), merge=4), "(4, 6) must both be divisible by merge = 4"),
        (dict(merge=0), "merge must be a positive int, got 0"),
        (dict(side=0), "side must be a positive int, got 0"),
        (dict(mode="nearest"), "'nearest'"),
    ],
)
def test_bad_arguments(kwargs, words):
    args = dict(grid_thw=(1, 4, 4), side=8, merge=2) | kwargs
    with pytest.raises(ValueError) as err:
        vision_position_inputs(**args)
    assert words in str(err.value)
    if "side" not in kwargs and "mode" not in kwargs:  # the rotary ids check the grid the same way
        with pytest.raises(ValueError, match=re.escape(str(err.value))):
            rotary_position_ids(args["grid_thw"], args["merge"])
