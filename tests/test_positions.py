"""mRoPE position ids (qwen35_onnx.runtime.positions) against transformers' Qwen3.5.

Reference: ``Qwen3_5Model.get_rope_index`` and what
``Qwen3_5ForConditionalGeneration.generate()`` actually feeds the text model at
prefill and at each decode step (transformers 5.24).
"""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.runtime.positions import decode_position_ids, mrope_position_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300
IMAGE_ID = 250
MERGE = 2


def tiny_config():
    return transformers.Qwen3_5Config(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [3, 3, 2],
                "mrope_interleaved": True,
            },
            eos_token_id=VOCAB - 1,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
        ),
        image_token_id=IMAGE_ID,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
    )


@functools.cache
def tiny_model():
    torch.manual_seed(0)
    return transformers.Qwen3_5ForConditionalGeneration(tiny_config()).eval()


def reference_rope_index(ids: np.ndarray, grid):
    """transformers' get_rope_index for batch 1: ([3, 1, S] int64, rope_deltas int)."""
    input_ids = torch.from_numpy(ids)
    mm = (input_ids == IMAGE_ID).int()
    thw = None if grid is None else torch.tensor([grid])
    with torch.no_grad():
        pos, deltas = tiny_model().model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=thw)
    return pos.numpy(), int(deltas.item())


def prompt(prefix: int, grid, suffix: int, seed: int = 0) -> np.ndarray:
    """[1, S] ids: `prefix` text tokens, the image run for `grid` (if any), `suffix` text tokens."""
    rng = np.random.default_rng(seed)
    n_image = 0 if grid is None else grid[0] * grid[1] * grid[2] // MERGE**2
    text = rng.integers(0, 240, size=prefix + suffix)  # never IMAGE_ID
    ids = np.concatenate([text[:prefix], np.full(n_image, IMAGE_ID), text[prefix:]])
    return ids[None].astype(np.int64)


GRIDS = st.tuples(st.integers(1, 2), st.integers(1, 8).map(lambda v: 2 * v), st.integers(1, 8).map(lambda v: 2 * v))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), GRIDS, st.integers(0, 12))
def test_matches_get_rope_index(prefix, grid, suffix):
    ids = prompt(prefix, grid, suffix)
    ours, deltas = mrope_position_ids(ids, IMAGE_ID, grid, MERGE)
    ref, ref_deltas = reference_rope_index(ids, grid)
    assert ours.dtype == np.int64 and ours.shape == (4, 1, ids.shape[1])
    np.testing.assert_array_equal(ours[0, 0], np.arange(ids.shape[1]))
    np.testing.assert_array_equal(ours[1:], ref)
    assert deltas == ref_deltas and isinstance(deltas, int)


def multi_image_prompt(texts, grids, seed: int = 0) -> np.ndarray:
    """[1, S] ids: texts[0] text tokens, image run of grids[0], texts[1] text tokens, ...,
    then texts[-1] (len(texts) == len(grids) + 1); runs are separated by >= 1 text token."""
    rng = np.random.default_rng(seed)
    parts = []
    for i, n_text in enumerate(texts):
        parts.append(rng.integers(0, 240, size=n_text))
        if i < len(grids):
            t, h, w = grids[i]
            parts.append(np.full(t * h * w // MERGE**2, IMAGE_ID))
    return np.concatenate(parts)[None].astype(np.int64)


@settings(max_examples=40, deadline=None)
@given(st.lists(GRIDS, min_size=2, max_size=4), st.data())
def test_several_images_match_get_rope_index(grids, data):
    texts = (
        [data.draw(st.integers(0, 6))]
        + [data.draw(st.integers(1, 6)) for _ in grids[1:]]
        + [data.draw(st.integers(0, 6))]
    )
    ids = multi_image_prompt(texts, grids)
    ours, deltas = mrope_position_ids(ids, IMAGE_ID, grids, MERGE)
    input_ids = torch.from_numpy(ids)
    with torch.no_grad():
        ref, ref_deltas = tiny_model().model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == IMAGE_ID).int(), image_grid_thw=torch.tensor(grids)
        )
    np.testing.assert_array_equal(ours[0, 0], np.arange(ids.shape[1]))
    np.testing.assert_array_equal(ours[1:], ref.numpy())
    assert deltas == int(ref_deltas.item())


def test_second_image_continues_after_the_first():
    # two 128 px images (4 x 4 merged tokens each) with 2 text tokens between: the second image
    # starts where the first left the running position (start + 4), plus the 2 text tokens
    ids = multi_image_prompt([1, 2, 1], [(1, 8, 8), (1, 8, 8)])
    pos, deltas = mrope_position_ids(ids, IMAGE_ID, [(1, 8, 8), (1, 8, 8)], MERGE)
    assert pos[1:, 0, 1].tolist() == [1, 1, 1]  # first image token
    assert pos[1:, 0, 17].tolist() == [5, 5, 5]  # first text token after image 1: 1 + 4
    assert pos[1:, 0, 19].tolist() == [7, 7, 7]  # second image's first token
    assert pos[1:, 0, 34].tolist() == [7, 10, 10]  # its last token
    assert pos[1:, 0, 35].tolist() == [11, 11, 11]  # trailing text
    assert deltas == 12 - ids.shape[1]


def test_images_of_different_grids_match_get_rope_index():
    """One prompt with the photo, a 6:1 panorama, a tall one and a tiny image, each on its own
    processor grid, given as the runtime holds them (a tuple of ``(1, h, w)`` tuples)."""
    grids = ((1, 16, 16), (1, 6, 38), (1, 38, 6), (1, 8, 8))
    ids = multi_image_prompt([3, 2, 1, 4, 2], grids)
    ours, deltas = mrope_position_ids(ids, IMAGE_ID, grids, MERGE)
    input_ids = torch.from_numpy(ids)
    with torch.no_grad():
        ref, ref_deltas = tiny_model().model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == IMAGE_ID).int(), image_grid_thw=torch.tensor(grids)
        )
    np.testing.assert_array_equal(ours[1:], ref.numpy())
    assert deltas == int(ref_deltas.item())
    # 3 text tokens (0..2), the photo from 3 (running position 3 + 16 // 2 = 11 after it), 2 text
    # tokens (11, 12), then the panorama: 3 x 19 merged tokens from 13, advancing by its long side
    # (38 // 2 = 19), not by its 57 tokens
    start = 3 + 64 + 2
    assert ours[1:, 0, start].tolist() == [13, 13, 13]
    assert ours[1:, 0, start + 56].tolist() == [13, 13 + 2, 13 + 18]  # its last token
    assert ours[1:, 0, start + 57].tolist() == [13 + 19] * 3  # the text after it


def test_more_runs_than_grids_is_rejected():
    ids = multi_image_prompt([1, 2, 1], [(1, 8, 8), (1, 8, 8)])
    with pytest.raises(ValueError, match=r"32 image tokens .* in 2 contiguous runs but 1 image grids"):
        mrope_position_ids(ids, IMAGE_ID, [(1, 8, 8)], MERGE)


@pytest.mark.parametrize(
    "prefix, grid, suffix",
    [
        (4, (1, 8, 8), 6),
        (0, (1, 8, 8), 3),
        (5, (1, 4, 12), 0),
        (3, (1, 12, 4), 2),
        (1, (2, 4, 6), 1),
        (7, None, 0),
        # grids of the checkpoint processor's rule at a 64-token budget: the 256 x 256 photo, a 6:1
        # panorama each way (no square padding any more), a 200:1 strip fitted to the budget
        (2, (1, 16, 16), 3),
        (2, (1, 6, 38), 3),
        (1, (1, 38, 6), 4),
        (3, (1, 2, 128), 1),
    ],
)
def test_known_layouts(prefix, grid, suffix):
    ids = prompt(prefix, grid, suffix)
    ours, deltas = mrope_position_ids(ids, IMAGE_ID, grid, MERGE)
    ref, ref_deltas = reference_rope_index(ids, grid)
    np.testing.assert_array_equal(ours[1:], ref)
    assert deltas == ref_deltas


def test_worked_example_128px():
    # 128 px, patch 16 -> grid (1, 8, 8) -> 16 image tokens on a 4 x 4 merged grid.
    ids = prompt(4, (1, 8, 8), 6)
    pos, deltas = mrope_position_ids(ids, IMAGE_ID, (1, 8, 8), MERGE)
    assert pos[1:, 0, 4:20].tolist() == [
        [4] * 16,
        [4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7],
        [4, 5, 6, 7] * 4,
    ]
    assert pos[1:, 0, 20:].tolist() == [[8, 9, 10, 11, 12, 13]] * 3  # 4 + max(8, 8) // 2 = 8
    assert deltas == 13 + 1 - 26


def test_text_only_prompt():
    ids = prompt(9, None, 0)
    pos, deltas = mrope_position_ids(ids, IMAGE_ID, None, MERGE)
    np.testing.assert_array_equal(pos[:, 0], np.tile(np.arange(9), (4, 1)))
    assert deltas == 0


def test_decode_position_ids_layout():
    pos = decode_position_ids(30, -12)
    assert pos.dtype == np.int64 and pos.shape == (4, 1, 1)
    assert pos[:, 0, 0].tolist() == [30, 18, 18, 18]
    with pytest.raises(ValueError, match="non-negative"):
        decode_position_ids(-1, 0)


@pytest.mark.parametrize("prefix, grid, suffix", [(4, (1, 8, 8), 6), (2, (1, 4, 8), 3), (5, None, 0)])
def test_equals_what_generate_feeds_the_text_model(prefix, grid, suffix):
    """Prefill and every decode step: our 4-row ids == generate()'s, row for row."""
    model = tiny_model()
    ids = prompt(prefix, grid, suffix)
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["position_ids"].numpy().copy()), with_kwargs=True
    )
    kwargs = {}
    if grid is not None:
        kwargs = dict(
            pixel_values=torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16),
            image_grid_thw=torch.tensor([grid]),
        )
    input_ids = torch.from_numpy(ids)
    try:
        with torch.no_grad():
            model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=(input_ids == IMAGE_ID).int(),
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                **kwargs,
            )
    finally:
        hook.remove()

    prefill, deltas = mrope_position_ids(ids, IMAGE_ID, grid, MERGE)
    np.testing.assert_array_equal(seen[0], prefill)
    assert len(seen) == 4
    for step, reference in enumerate(seen[1:]):
        np.testing.assert_array_equal(reference, decode_position_ids(ids.shape[1] + step, deltas))


def test_decode_rows_equal_compute_3d_position_ids():
    """Plain forward without position_ids / attention_mask: transformers builds only the 3 mRoPE
    rows (cache_length + rope_deltas); they equal our rows 1-3, and the logits equal those
    obtained with our 4-row ids."""
    model = tiny_model()
    grid = (1, 4, 8)
    ids = prompt(3, grid, 4)
    input_ids = torch.from_numpy(ids)
    vision = dict(
        pixel_values=torch.randn(grid[1] * grid[2], 3 * 2 * 16 * 16),
        image_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=(input_ids == IMAGE_ID).int(),
    )
    _, deltas = mrope_position_ids(ids, IMAGE_ID, grid, MERGE)
    nxt = torch.tensor([[7]])
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["position_ids"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model.model.rope_deltas = None
            first = model(input_ids=input_ids, use_cache=True, **vision)
            auto = model(input_ids=nxt, cache=first.cache, mm_token_type_ids=torch.zeros_like(nxt))
            model.model.rope_deltas = None
            first = model(input_ids=input_ids, use_cache=True, **vision)
            ours = decode_position_ids(ids.shape[1], deltas)
            explicit = model(input_ids=nxt, cache=first.cache, position_ids=torch.from_numpy(ours))
    finally:
        hook.remove()
    assert seen[1].shape == (3, 1, 1)
    np.testing.assert_array_equal(seen[1].numpy(), ours[1:])
    torch.testing.assert_close(auto.logits, explicit.logits, rtol=0, atol=0)


def test_wrong_image_token_count_is_rejected():
    ids = prompt(3, (1, 8, 8), 2)
    with pytest.raises(ValueError, match=r"has 16 tokens but image grid \(1, 8, 12\) .* needs 24"):
        mrope_position_ids(ids, IMAGE_ID, (1, 8, 12), MERGE)


def test_split_image_run_is_rejected():
    ids = prompt(3, (1, 8, 8), 2)
    ids = np.concatenate([ids[:, :10], ids[:, 19:20], ids[:, 10:19], ids[:, 20:]], axis=1)
    with pytest.raises(ValueError, match="contiguous run"):
        mrope_position_ids(ids, IMAGE_ID, (1, 8, 8), MERGE)


@pytest.mark.parametrize("grid", [(1, 7, 8), (0, 8, 8), (1, 8), (1, -8, 8)])
def test_bad_grid_is_rejected(grid):
    with pytest.raises(ValueError, match="image"):
        mrope_position_ids(prompt(3, (1, 8, 8), 2), IMAGE_ID, grid, MERGE)


def test_image_tokens_without_grid_are_rejected():
    with pytest.raises(ValueError, match=r"16 image tokens .* in 1 contiguous runs but 0 image grids"):
        mrope_position_ids(prompt(3, (1, 8, 8), 2), IMAGE_ID, None, MERGE)


@pytest.mark.parametrize("shape", [(5,), (2, 5), (1, 0), (1, 1, 5)])
def test_bad_input_ids_shape_is_rejected(shape):
    with pytest.raises(ValueError, match=r"\[1, S\]"):
        mrope_position_ids(np.zeros(shape, dtype=np.int64), IMAGE_ID, None, MERGE)
