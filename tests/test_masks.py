"""Property tests for the fixed-width decode mask (qwen35_onnx.runtime.masks)."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from qwen35_onnx.runtime.masks import CapacityExhausted, advance_mask, prepare_decode_mask

CAPACITY = st.integers(min_value=1, max_value=64)
MASK_DTYPES = st.sampled_from([np.int64, np.int32, np.uint8, np.bool_, np.float32])


@st.composite
def valid_prompt(draw):
    """(mask [1, S] as a contiguous prefix of ones + trailing zeros, capacity)."""
    capacity = draw(CAPACITY)
    length = draw(st.integers(1, capacity))
    ones = draw(st.integers(1, length))
    mask = np.zeros((1, length), dtype=draw(MASK_DTYPES))
    mask[0, :ones] = 1
    return mask, capacity


@given(valid_prompt())
def test_valid_prefix_is_accepted_and_padded(case):
    mask, capacity = case
    before = mask.copy()
    padded = prepare_decode_mask(mask, capacity, capacity)
    assert padded.dtype == np.int64 and padded.shape == (1, capacity)
    length, ones = mask.shape[1], int(mask.sum())
    assert (padded[0, :ones] == 1).all() and (padded[0, ones:] == 0).all()
    np.testing.assert_array_equal(padded[0, :length], mask[0].astype(np.int64))
    np.testing.assert_array_equal(mask, before)  # input untouched
    assert padded is not mask


@given(valid_prompt(), st.integers(2, 4))
def test_batch_other_than_one_is_rejected(case, batch):
    mask, capacity = case
    with pytest.raises(ValueError, match=f"batch is {batch}"):
        prepare_decode_mask(np.repeat(mask, batch, axis=0), capacity, capacity)
    with pytest.raises(ValueError, match="batch is 0"):
        prepare_decode_mask(mask[:0], capacity, capacity)


@given(valid_prompt())
def test_wrong_rank_is_rejected(case):
    mask, capacity = case
    with pytest.raises(ValueError, match="1-D"):
        prepare_decode_mask(mask[0], capacity, capacity)
    with pytest.raises(ValueError, match="3-D"):
        prepare_decode_mask(mask[None], capacity, capacity)


@given(CAPACITY, st.integers(1, 10))
def test_prompt_longer_than_capacity_is_rejected(capacity, extra):
    mask = np.ones((1, capacity + extra), dtype=np.int64)
    with pytest.raises(ValueError, match=f"prompt length {capacity + extra} exceeds .* capacity {capacity}"):
        prepare_decode_mask(mask, capacity, capacity)


@given(valid_prompt(), st.integers(1, 4096))
def test_prefill_width_mismatch_is_rejected(case, width):
    mask, capacity = case
    assume(width != capacity)
    with pytest.raises(ValueError, match=f"prefill KV width {width} != decode capacity {capacity}.*--max-seq-len"):
        prepare_decode_mask(mask, capacity, width)


@given(valid_prompt(), st.data())
def test_values_other_than_zero_one_are_rejected(case, data):
    mask, capacity = case
    mask = mask.astype(np.float64)
    bad = data.draw(
        st.one_of(
            st.integers(-5, 5).filter(lambda v: v not in (0, 1)).map(float),
            st.sampled_from([0.5, np.nan, np.inf]),
        )
    )
    where = data.draw(st.integers(0, mask.shape[1] - 1))
    mask[0, where] = bad
    with pytest.raises(ValueError, match=f"must be 0 or 1, got .* at position {where}"):
        prepare_decode_mask(mask, capacity, capacity)


def test_non_numeric_mask_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        prepare_decode_mask(np.array([["1", "1"]]), 4, 4)


@given(CAPACITY, st.data())
def test_non_contiguous_mask_is_rejected(capacity, data):
    assume(capacity >= 2)
    length = data.draw(st.integers(2, capacity))
    bits = data.draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
    row = np.array(bits, dtype=np.int64)
    ones = int(row.sum())
    assume(ones > 0 and not row[:ones].all())  # some 1 follows a 0
    with pytest.raises(ValueError, match="contiguous prefix"):
        prepare_decode_mask(row[None], capacity, capacity)


@given(CAPACITY, st.data())
def test_all_zero_mask_is_rejected(capacity, data):
    length = data.draw(st.integers(0, capacity))
    with pytest.raises(ValueError, match="no 1"):
        prepare_decode_mask(np.zeros((1, length), dtype=np.int64), capacity, capacity)


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True])
def test_bad_capacity_is_rejected(capacity):
    with pytest.raises(ValueError, match="capacity"):
        prepare_decode_mask(np.ones((1, 1)), capacity, capacity)


@given(valid_prompt())
def test_advance_mask_fills_slots_in_order_until_capacity(case):
    mask, capacity = case
    padded = prepare_decode_mask(mask, capacity, capacity)
    start = int(mask.sum())
    for expected in range(start, capacity):
        assert advance_mask(padded) == expected
        assert int(padded.sum()) == expected + 1
        assert padded[0, : expected + 1].all() and not padded[0, expected + 1 :].any()
    before = padded.copy()
    with pytest.raises(CapacityExhausted, match=f"slot {capacity} but capacity is {capacity}") as info:
        advance_mask(padded)
    assert isinstance(info.value, ValueError)
    assert (info.value.next_pos, info.value.capacity) == (capacity, capacity)
    np.testing.assert_array_equal(padded, before)


def test_advance_mask_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"\[1, capacity\]"):
        advance_mask(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match=r"\[1, capacity\]"):
        advance_mask(np.zeros(4, dtype=np.int64))
