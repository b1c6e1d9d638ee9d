"""Sampling, stop strings and bucket selection (fast, property-based)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwen35_onnx.contract import check_buckets, select_bucket
from qwen35_onnx.runtime.sampling import Sampler, SamplingConfig, StopStrings

buckets_st = st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True).map(sorted).map(tuple)


@given(buckets=buckets_st, prompt_len=st.integers(1, 5000))
def test_bucket_selection(buckets, prompt_len):
    capacity = buckets[-1]
    if prompt_len <= buckets[-1]:
        chosen = select_bucket(prompt_len, buckets, capacity, 1)
        assert chosen in buckets and chosen >= prompt_len
        assert all(b < prompt_len for b in buckets if b < chosen), "the smallest bucket that holds it"
    else:
        with pytest.raises(
            ValueError, match=f"prompt is {prompt_len} tokens, more than the largest prefill bucket {buckets[-1]}"
        ):
            select_bucket(prompt_len, buckets, capacity, 1)


@given(prompt_len=st.integers(-5, 0) | st.just(True) | st.just(2.5))
def test_bucket_selection_rejects_bad_lengths(prompt_len):
    with pytest.raises(ValueError, match="prompt length must be an integer >= 1"):
        select_bucket(prompt_len, (32,), 32, 32)


@given(prompt_len=st.integers(1, 300), chunk=st.sampled_from([1, 2, 16, 64]))
def test_no_buckets_rounds_up_to_chunks(prompt_len, chunk):
    capacity = 256
    if prompt_len > capacity:
        with pytest.raises(ValueError, match=f"more than the capacity {capacity}"):
            select_bucket(prompt_len, (), capacity, chunk)
    else:
        n = select_bucket(prompt_len, (), capacity, chunk)
        assert n % chunk == 0 and prompt_len <= n < prompt_len + chunk


@given(buckets=st.lists(st.integers(-3, 100), min_size=1, max_size=5))
def test_check_buckets(buckets):
    valid = all(1 <= b <= 64 for b in buckets) and all(a < b for a, b in zip(buckets, buckets[1:]))
    if valid:
        check_buckets(tuple(buckets), 64)
    else:
        with pytest.raises(ValueError):
            check_buckets(tuple(buckets), 64)


def test_greedy_is_argmax_first_on_ties():
    assert Sampler(SamplingConfig())(np.array([0.0, 3.0, 3.0, 1.0])) == 1


@given(seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_tokens(seed):
    logits = np.random.default_rng(0).normal(size=50)
    config = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=seed)
    a, b = Sampler(config), Sampler(config)
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


@given(k=st.integers(1, 10), seed=st.integers(0, 1000))
def test_top_k_only_picks_top_tokens(k, seed):
    logits = np.random.default_rng(seed).normal(size=30)
    top = set(np.argsort(-logits)[:k].tolist())
    sampler = Sampler(SamplingConfig(temperature=1.5, top_k=k, seed=seed))
    assert {sampler(logits) for _ in range(30)} <= top


def test_top_p_keeps_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.7, seed=0))
    assert {sampler(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(SamplingConfig(**kwargs))


text_st = st.text(alphabet="abc\n", max_size=40)


@given(
    text=text_st,
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_strings_any_split(text, stops, cuts):
    """Whatever the split into pieces, the output is the text cut before the first stop string."""
    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    filt = StopStrings(stops)
    out = "".join(filt.feed(p) for p in pieces)
    if not filt.stopped:
        out += filt.flush()
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        # the earliest stop string that completes first while streaming is the one that ends first
        end_first = min((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
        assert filt.stopped
        assert out == text[: end_first[1]] or out == text[: min(hits)]
        assert not any(s in out for s in stops)
    else:
        assert out == text and not filt.stopped


def test_stop_string_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""])
