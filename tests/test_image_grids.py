"""Image grids without graphs: the processor's rule, the default static grids, the choice of a
static grid, the budget and grid checks of an export, and the per-call limits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.image_grids import (
    ASPECT_RATIOS,
    choose_grid,
    default_grids,
    fit_budget,
    grid_tokens,
    parse_grids,
    processor_grid,
)

PATCH, MERGE = 16, 2
MIN_PIXELS, MAX_PIXELS = 65536, 16777216  # the published Qwen3.5 processor
FACTOR = PATCH * MERGE


def published(height, width, max_pixels=MAX_PIXELS):
    return processor_grid(height, width, PATCH, MERGE, MIN_PIXELS, max_pixels)


def test_processor_grid_is_transformers_smart_resize():
    # the example: a 320 x 213 photo gets a 14 x 20 patch grid (70 tokens) from the published processor
    assert published(213, 320) == (14, 20)
    assert grid_tokens((14, 20), MERGE) == 70
    # a 640 x 480 photo at a budget of 256 tokens (262144 pixels)
    assert published(480, 640, 256 * FACTOR**2) == (26, 36)
    with pytest.raises(ValueError, match="aspect ratio"):
        published(10, 2500)


@pytest.mark.parametrize("budget", [64, 96, 256, 1024, 4096])
def test_default_grids_cover_the_common_aspect_ratios_within_the_budget(budget):
    grids = default_grids(budget, PATCH, MERGE, MIN_PIXELS, MAX_PIXELS)
    assert grids == tuple(sorted(set(grids)))
    for h, w in grids:
        assert h % MERGE == 0 and w % MERGE == 0
        assert MIN_PIXELS <= h * w * PATCH**2 <= budget * FACTOR**2
    if budget >= 96:  # at the minimum (64 tokens) the processor's floor rounding leaves most ratios below min_pixels
        for across, down in ASPECT_RATIOS:
            best = min(abs(math.log((w / h) / (across / down))) for h, w in grids)
            assert best < 0.2, (across, down, grids)
    if budget < 256:  # near the minimum the floor rounding leaves grids below min_pixels, dropped
        return
    # photos of a default ratio larger than the budget get exactly transformers' grid
    photos = [(640, 480), (1024, 768), (1920, 1080), (1080, 1920), (512, 512), (2048, 1024), (4000, 4000)]
    for width, height in photos + [(4000, 3000), (3840, 2160), (8192, 4096)]:
        if width * height > budget * FACTOR**2:
            assert published(height, width, budget * FACTOR**2) in grids, (width, height)


def test_choose_grid_takes_the_processors_grid_when_exported_else_the_closest():
    grids = [(16, 16), (14, 20), (20, 14), (26, 36)]
    assert choose_grid(480, 640, grids, (14, 20)) == (14, 20)
    # a 3:2 landscape whose processor grid (20, 30) is not exported: 26 x 36 (aspect 1.38, 936 patches)
    # is closer in shape and size than 14 x 20 (aspect 1.43 but 280 patches)
    assert choose_grid(320, 480, grids, (20, 30)) == (26, 36)
    assert choose_grid(480, 320, grids, (30, 20)) == (20, 14)
    with pytest.raises(ValueError, match="no grid"):
        choose_grid(1, 1, [], (2, 2))


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 100), w=st.integers(1, 100), tokens=st.integers(1, 400))
def test_fit_budget_never_exceeds_the_budget(h, w, tokens):
    grid = (2 * h, 2 * w)
    fitted = fit_budget(grid, tokens, MERGE)
    assert fitted[0] % MERGE == 0 and fitted[1] % MERGE == 0 and min(fitted) >= MERGE
    if grid_tokens(grid, MERGE) <= tokens:
        assert fitted == grid
    elif tokens >= 1:
        assert grid_tokens(fitted, MERGE) <= max(tokens, 1)


def test_parse_grids():
    assert parse_grids("16x16, 26X36") == ((16, 16), (26, 36))
    for bad in ("16", "16x", "ax2", "16x16x2"):
        with pytest.raises(ValueError, match="HxW"):
            parse_grids(bad)


# ---- export-time checks ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def config(checkpoint):
    from qwen35_onnx.export.exporter import load_config

    return load_config(checkpoint)


def contract_for(config, **options):
    from qwen35_onnx.export.exporter import build_contract
    from qwen35_onnx.export.options import ExportOptions

    return build_contract(*config, ExportOptions(**{"capacity": 512, **options}), (MIN_PIXELS, MAX_PIXELS))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(image_tokens=32),
            r"--image-tokens 32 gives 32768 pixels .* below the image processor's min_pixels 65536",
        ),
        (dict(image_tokens=20000), r"above the image processor's max_pixels 16777216: use at most 16384"),
        (dict(image_tokens=600), r"--image-tokens 600 needs .* 600 image tokens, more than the capacity 512"),
        (dict(image_tokens=128, max_images=5), r"--max-images 5 with --image-tokens 128 needs 5 x 128 = 640"),
        (
            dict(vision_grids=((15, 16),)),
            r"vision grid 15x16: both sides must be multiples of the spatial merge size 2",
        ),
        (dict(vision_grids=((32, 34),)), r"vision grid 32x34 is 272 image tokens .* above the budget of 256"),
        (dict(vision_grids=((16, 16), (16, 16))), r"vision grid 16x16 is listed twice"),
        (dict(vision_grids=((2, 512),)), r"vision grid 2x512: an aspect ratio above the image processor's limit"),
        (dict(vision_grids=((0, 16),)), r"vision grid 0x16 must be two positive integers"),
    ],
)
def test_bad_budgets_and_grids_fail_before_any_graph(config, options, message):
    from qwen35_onnx.export.options import ExportError

    with pytest.raises(ExportError, match=message):
        contract_for(config, **options)


def test_contract_records_the_grids_and_the_processor_range(config):
    from qwen35_onnx.contract import ShapeContract

    contract = contract_for(config, vision_grids="static")
    assert contract.vision_grids == default_grids(256, PATCH, MERGE, MIN_PIXELS, MAX_PIXELS)
    assert (contract.min_pixels, contract.max_pixels, contract.image_tokens) == (MIN_PIXELS, MAX_PIXELS, 256)
    assert contract.n_image_rows == 256 and contract.image_max_pixels == 256 * FACTOR**2
    assert ShapeContract.from_json(contract.to_json()) == contract
    assert contract_for(config).vision_grids == () and not contract_for(config).static_vision


def test_the_processor_range_is_read_in_both_spellings(tmp_path):
    import json

    from qwen35_onnx.export.exporter import processor_pixel_range
    from qwen35_onnx.export.options import ExportError

    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 1003520}}))
    assert processor_pixel_range(tmp_path) == (3136, 1003520)
    path.write_text(json.dumps({"min_pixels": 4096, "max_pixels": 802816}))
    assert processor_pixel_range(tmp_path) == (4096, 802816)
    # both spellings: min_pixels / max_pixels win, as in Qwen2VLImageProcessorPil.__init__
    path.write_text(json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 1003520}, "max_pixels": 200000}))
    assert processor_pixel_range(tmp_path) == (3136, 200000)
    path.write_text('{"size": {"shortest_edge": 3136, "longest_edge": Infinity}}')
    with pytest.raises(ExportError, match="pixel range"):
        processor_pixel_range(tmp_path)
    path.write_text(json.dumps({"min_pixels": 4096, "max_pixels": 802816, "patch_size": 14, "merge_size": 2}))

    class Vision:
        patch_size, spatial_merge_size = 16, 2

    with pytest.raises(ExportError, match=r"patch_size / merge_size \(14, 2\) differ .* \(16, 2\)"):
        processor_pixel_range(tmp_path, Vision)
    for bad in ({}, {"min_pixels": 10, "max_pixels": 5}, {"size": {"shortest_edge": "a", "longest_edge": 9}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ExportError, match="pixel range"):
            processor_pixel_range(tmp_path)
    path.unlink()
    with pytest.raises(ExportError, match="cannot be read"):
        processor_pixel_range(tmp_path)


# ---- per-call limits -------------------------------------------------------------------------
def test_per_call_limits_and_detail():
    from qwen35_onnx.conversation.processor import ImageSizing

    any_grid = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, 256)
    assert any_grid.grid(480, 640) == ((26, 36), (26, 36))
    assert any_grid.grid(480, 640, max_image_tokens=100)[0] == published(480, 640, 100 * FACTOR**2)
    low = any_grid.grid(480, 640, detail="low")[0]
    assert low == published(480, 640, MIN_PIXELS) and grid_tokens(low, MERGE) <= 64
    for limit, message in (
        (63, "below the image processor's minimum of 64 tokens"),
        (257, "above this export's budget of 256"),
    ):
        with pytest.raises(ValueError, match=message):
            any_grid.grid(480, 640, max_image_tokens=limit)
    with pytest.raises(ValueError, match="image detail 'medium' must be one of auto, low, high"):
        any_grid.grid(480, 640, detail="medium")

    static = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, 256, [(16, 16), (14, 20), (26, 36), (32, 32)])
    assert static.grid(480, 640)[0] == (26, 36)
    assert static.grid(480, 640, detail="low")[0] == (14, 20)
    assert static.grid(480, 640, max_image_tokens=100)[0] == (14, 20)
    small = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, 256, [(26, 36), (32, 32)])
    with pytest.raises(ValueError, match="below this export's smallest vision grid"):
        small.grid(480, 640, max_image_tokens=100)


def test_detail_is_checked_with_the_messages(photo):
    from qwen35_onnx.conversation.messages import ChatInputError, normalize_messages

    url = str(photo)

    def part(detail):
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}

    _, images = normalize_messages(
        [{"role": "user", "content": [part("low"), part("high"), {"type": "image", "image": url}]}]
    )
    assert [image.detail for image in images] == ["low", "high", "auto"]
    with pytest.raises(ChatInputError, match="'ultra' must be one of auto, low, high") as err:
        normalize_messages([{"role": "user", "content": [part("ultra")]}])
    assert err.value.param == "messages[0].content[0].image_url.detail"
