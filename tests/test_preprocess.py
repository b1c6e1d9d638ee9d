"""Image loading, patches sized by the checkpoint processor's own resolution rule (any grid or an
export's static grids, detail and per-call token limits), prompt encoding and streaming
detokenization (qwen35_onnx.conversation.processor), on a tiny locally trained tokenizer +
processor folder."""

import ast
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import qwen35_onnx
from qwen35_onnx.conversation.detokenizer import TextStreamer
from qwen35_onnx.conversation.images import load_image, to_rgb
from qwen35_onnx.conversation.processor import ImageSizing, Preprocessor
from qwen35_onnx.image_grids import default_grids, fit_budget, processor_grid

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE_TOKEN_ID = SPECIAL.index("<|image_pad|>")  # special tokens get the first ids, in order
PATCH, MERGE = 16, 2  # one image token: 32 x 32 pixels
MIN_PIXELS = 128 * 128  # the export's processor range: 16 image tokens at least ...
MAX_PIXELS = 4096 * 4096
IMAGE_TOKENS = 64  # ... and a budget of 64 tokens per image
BUDGET_PIXELS = IMAGE_TOKENS * (PATCH * MERGE) ** 2  # 256 x 256
SIZING = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Describe the image in one sentence.",
    "What colour is the cat on the left? The cat is black and white.",
    "user assistant system image picture photo",
    "Ünïcödé naïve café 日本語のテキスト 🙂🐱",
]


def build_processor_folder(folder: Path) -> Path:
    """Tiny byte-level BPE tokenizer + chat template + Qwen2-VL processor config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "do_resize": True,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": True,
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                # deliberately unlike the export's range (SIZING): pixel_values must pin it itself
                "size": {"shortest_edge": 256 * 256, "longest_edge": 1024 * 1024},
            }
        )
    )
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_processor_folder(tmp_path_factory.mktemp("processor"))


@pytest.fixture(scope="module")
def pre(folder) -> Preprocessor:
    return Preprocessor.from_pretrained(folder, SIZING, IMAGE_TOKEN_ID)


@pytest.fixture(scope="module")
def reference(folder) -> Qwen2VLImageProcessorPil:
    """transformers' processor of the folder, loaded on its own (the reference for the patches)."""
    return Qwen2VLImageProcessorPil.from_pretrained(folder)


def gradient(size, mode="RGB") -> Image.Image:
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(255, 0, h, dtype=np.float32)[:, None, None]
    rgb = np.concatenate(
        [np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)), np.full((h, w, 1), 128, np.float32)], axis=2
    )
    return Image.fromarray(rgb.astype(np.uint8), "RGB").convert(mode)


# ---- load_image ---------------------------------------------------------------------------------


def test_rgba_is_composited_on_white(tmp_path):
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:2, :, 3] = 255  # top half opaque red-ish, bottom half fully transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    image = load_image(tmp_path / "a.png")
    assert image.mode == "RGB" and image.size == (4, 4)
    pixels = np.asarray(image)
    assert pixels[0, 0].tolist() == [200, 0, 0]
    assert pixels[3, 3].tolist() == [255, 255, 255]


def test_palette_with_transparency_is_composited_on_white(tmp_path):
    image = Image.new("P", (3, 3), 1)
    image.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    image.info["transparency"] = 1
    image.save(tmp_path / "p.png", transparency=1)
    assert np.asarray(load_image(tmp_path / "p.png"))[1, 1].tolist() == [255, 255, 255]


@pytest.mark.parametrize(
    "mode, suffix",
    [("L", ".png"), ("P", ".png"), ("CMYK", ".jpg"), ("LA", ".png"), ("1", ".bmp"), ("RGB", ".jpg"), ("RGBA", ".webp")],
)
def test_any_mode_becomes_rgb(tmp_path, mode, suffix):
    path = tmp_path / f"image{suffix}"
    gradient((40, 30), mode).save(path)
    image = load_image(path)
    assert image.mode == "RGB" and image.size == (40, 30)


def test_exif_orientation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    gradient((40, 30)).save(tmp_path / "rot.jpg", exif=exif)
    assert load_image(tmp_path / "rot.jpg").size == (30, 40)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.png"
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image(path)


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40])
def test_corrupt_file_is_a_value_error_naming_the_path(tmp_path, content):
    path = tmp_path / "broken.png"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.png"):
        load_image(path)


def test_truncated_file_is_a_value_error(tmp_path):
    good = tmp_path / "good.jpg"
    gradient((64, 64)).save(good)
    (tmp_path / "cut.jpg").write_bytes(good.read_bytes()[:300])
    with pytest.raises(ValueError, match="cut.jpg"):
        load_image(tmp_path / "cut.jpg")


def test_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        load_image(tmp_path)


# ---- pixel_values: the checkpoint processor's own resolution rule --------------------------------


def processor_values(processor, image, max_pixels: int, min_pixels: int = MIN_PIXELS):
    """``Qwen2VLImageProcessorPil`` on the raw image with the given pixel range: (values, (1, h, w))."""
    out = processor(images=[image], size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def resized_values(processor, image, grid):
    """The processor's patches of ``image`` resized (bicubic) to exactly ``grid`` patches."""
    size = (grid[1] * PATCH, grid[0] * PATCH)
    out = processor(images=[image.resize(size, Image.Resampling.BICUBIC)], do_resize=False, return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == (1, *grid)
    return out["pixel_values"]


def closest_grid(height, width, grids, preferred):
    """image_grids' documented rule, written out: ``preferred`` when present, else the smallest
    |log(aspect / the image's)| + 1/2 |log(patches / preferred's)|, ties to the fewer patches."""
    if tuple(preferred) in grids:
        return tuple(preferred)

    def cost(g):
        aspect = abs(math.log((g[1] / g[0]) / (width / height)))
        size = abs(math.log(g[0] * g[1] / (preferred[0] * preferred[1])))
        return (round(aspect + size / 2, 9), g[0] * g[1])

    return min(grids, key=cost)


# (width, height): tiny (below min_pixels, upscaled), square, odd, photo, 6:1 panoramas both ways,
# 15:1 strips, within and over the budget
SHAPES = [(1, 1), (7, 10), (129, 127), (256, 256), (640, 480), (1200, 200), (200, 1200), (3000, 200), (100, 30)]


@pytest.mark.parametrize("size", SHAPES)
def test_pixel_values_are_the_processors_at_the_budget(pre, reference, size):
    """Any grid: exactly what transformers' processor gives the raw image with ``size =
    {shortest_edge: min_pixels, longest_edge: the budget's pixels}`` (no padding, no square)."""
    image = gradient(size)
    values, grid = pre.pixel_values(image)
    expected, expected_grid = processor_values(reference, image, BUDGET_PIXELS)
    assert grid == expected_grid
    assert values.dtype == np.float32 and values.flags.c_contiguous
    assert values.shape == (grid[1] * grid[2], 3 * 2 * PATCH * PATCH)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)
    assert values.min() >= -1 and values.max() <= 1  # mean/std 0.5 normalisation
    # and that is the processor's own smart_resize grid, within the budget and min_pixels
    w, h = size
    assert grid[1:] == processor_grid(h, w, PATCH, MERGE, MIN_PIXELS, BUDGET_PIXELS)
    assert grid[1] % MERGE == 0 and grid[2] % MERGE == 0
    assert MIN_PIXELS <= grid[1] * grid[2] * PATCH**2 <= BUDGET_PIXELS
    assert pre.sizing.grid(h, w) == (grid[1:], grid[1:])


def test_known_grids(pre):
    """Worked examples (16 px patches, 2 x 2 merge, 16..64 image tokens): the aspect ratio is kept,
    nothing is padded."""
    expected = {
        (1, 1): (8, 8),  # upscaled to min_pixels (128 x 128)
        (256, 256): (16, 16),  # exactly the budget
        (640, 480): (12, 18),  # 4:3 -> 384 x 576, 54 tokens
        (1200, 200): (6, 38),  # 6:1 -> 96 x 608, 57 tokens
        (200, 1200): (38, 6),
    }
    for (w, h), grid in expected.items():
        assert pre.pixel_values(gradient((w, h)))[1] == (1, *grid), (w, h)


def test_the_processor_range_is_pinned_not_read_from_the_folder(pre):
    """The folder's preprocessor_config.json says 256 x 256 .. 1024 x 1024 pixels; the export's
    sizing (min 128 x 128, budget 64 tokens) decides."""
    image = gradient((1200, 200))
    unpinned = pre.image_processor(images=[image], return_tensors="np")["image_grid_thw"][0].tolist()
    assert unpinned != [1, 6, 38]
    assert pre.pixel_values(image)[1] == (1, 6, 38)
    assert pre.pixel_values(gradient((1, 1)))[1] == (1, 8, 8)  # the folder's min would give 16 x 16


def test_tiny_image_upscaled_over_the_budget_is_fitted(folder, reference):
    """With min_pixels equal to the budget (the demo checkpoint's 65536 pixels at 64 tokens), the
    processor's rounding up can exceed the budget: the grid is scaled back within it (aspect
    kept) and the image resized to exactly that grid."""
    pre = Preprocessor.from_pretrained(folder, ImageSizing(PATCH, MERGE, 65536, 16777216, 64), IMAGE_TOKEN_ID)
    image = gradient((100, 30))
    grid, exact = pre.sizing.grid(30, 100)
    assert exact == processor_grid(30, 100, PATCH, MERGE, 65536, 65536) == (10, 30)  # 75 tokens
    assert grid == fit_budget(exact, 64, MERGE)
    assert grid[0] * grid[1] // MERGE**2 <= 64 and grid[0] % MERGE == 0 and grid[1] % MERGE == 0
    assert abs(math.log((grid[1] / grid[0]) / (exact[1] / exact[0]))) < 0.2
    values, thw = pre.pixel_values(image)
    assert thw == (1, *grid)
    np.testing.assert_allclose(values, resized_values(reference, image, grid), rtol=0, atol=1e-6)
    # an image already at min_pixels keeps the processor's grid
    photo = gradient((256, 256))
    values, thw = pre.pixel_values(photo)
    expected, expected_grid = processor_values(reference, photo, 65536, 65536)
    assert thw == expected_grid == (1, 16, 16)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)


def test_aspect_ratio_limit_is_a_clear_error(pre):
    """The processor refuses aspect ratios above 200; a 100 000 x 1 strip is refused before any
    large image is built, and one just within the limit gets a grid within the budget."""
    with pytest.raises(ValueError, match="aspect ratio"):
        pre.pixel_values(Image.new("RGB", (100_000, 1), (255, 255, 255)))
    values, grid = pre.pixel_values(gradient((4000, 20)))  # 200:1
    assert grid[1] * grid[2] // MERGE**2 <= IMAGE_TOKENS and values.shape[0] == grid[1] * grid[2]


# ---- static grids -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def static_pre(folder) -> Preprocessor:
    grids = default_grids(IMAGE_TOKENS, PATCH, MERGE, MIN_PIXELS, MAX_PIXELS)
    return Preprocessor.from_pretrained(
        folder, ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS, grids), IMAGE_TOKEN_ID
    )


@pytest.mark.parametrize("size", SHAPES)
def test_static_grids_take_the_processors_grid_when_present_else_the_closest(static_pre, reference, size):
    w, h = size
    grids = static_pre.sizing.grids
    exact = processor_grid(h, w, PATCH, MERGE, MIN_PIXELS, BUDGET_PIXELS)
    expected = closest_grid(h, w, grids, exact)
    image = gradient(size)
    values, grid = static_pre.pixel_values(image)
    assert grid == (1, *expected) and expected in grids
    assert static_pre.sizing.grid(h, w) == (expected, exact)
    if expected == exact:  # the processor's own output
        reference, _ = processor_values(reference, image, BUDGET_PIXELS)
    else:  # resized (bicubic) to the chosen grid, never padded
        reference = resized_values(reference, image, expected)
    np.testing.assert_allclose(values, reference, rtol=0, atol=1e-6)


def test_static_grid_choices(static_pre):
    """The default grids at 64 tokens hold the photo's, the 4:3 photo's and the tiny image's own
    grids; a 6:1 panorama (processor grid 6 x 38) gets the widest grid, 10 x 22."""
    sizing = static_pre.sizing
    assert {(16, 16), (12, 18), (8, 8), (10, 22)} <= set(sizing.grids)
    assert sizing.grid(256, 256)[0] == (16, 16)
    assert sizing.grid(480, 640)[0] == (12, 18)
    assert sizing.grid(1, 1)[0] == (8, 8)
    assert sizing.grid(200, 1200) == ((10, 22), (6, 38))
    assert sizing.grid(1200, 200) == ((22, 10), (38, 6))
    # one user grid: every image runs at it
    only = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS, [(16, 16)])
    assert only.grid(200, 1200) == ((16, 16), (6, 38))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([None, 16, 20, 40, 64]), st.booleans())
def test_every_grid_fits_the_budget_and_the_export(width, height, limit, static):
    """For any image size and limit: a grid of whole merge blocks within the limit, the processor's
    own grid whenever the export can run it, and one of the export's grids when they are static."""
    if max(width, height) / min(width, height) > 200:
        return
    grids = default_grids(IMAGE_TOKENS, PATCH, MERGE, MIN_PIXELS, MAX_PIXELS) if static else ()
    sizing = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS, grids)
    grid, exact = sizing.grid(height, width, limit)
    tokens = limit or IMAGE_TOKENS
    assert exact == processor_grid(height, width, PATCH, MERGE, MIN_PIXELS, tokens * (PATCH * MERGE) ** 2)
    assert grid[0] % MERGE == 0 and grid[1] % MERGE == 0 and grid[0] * grid[1] // MERGE**2 <= tokens
    if static:
        assert grid == closest_grid(height, width, [g for g in grids if g[0] * g[1] <= tokens * MERGE**2], exact)
    elif exact[0] * exact[1] <= tokens * MERGE**2:
        assert grid == exact
    else:
        assert grid == fit_budget(exact, tokens, MERGE)


# ---- detail and max_image_tokens ----------------------------------------------------------------


@pytest.mark.parametrize("size", [(640, 480), (1200, 200), (256, 256), (7, 10)])
def test_detail_low_is_the_processor_at_min_pixels(pre, static_pre, reference, size):
    """``detail: low``: the processor's grid with max_pixels = min_pixels (any grid: exactly its
    output; static grids: the closest grid to it), never more tokens than 'auto'."""
    w, h = size
    image = gradient(size)
    values, grid = pre.pixel_values(image, detail="low")
    expected, expected_grid = processor_values(reference, image, MIN_PIXELS)
    assert grid == expected_grid
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)
    auto = pre.pixel_values(image, detail="auto")[1]
    assert grid[1] * grid[2] <= auto[1] * auto[2]
    assert pre.pixel_values(image, detail="high")[1] == pre.pixel_values(image)[1]
    low = processor_grid(h, w, PATCH, MERGE, MIN_PIXELS, MIN_PIXELS)
    static_grid = static_pre.pixel_values(image, detail="low")[1][1:]
    assert static_grid == closest_grid(h, w, static_pre.sizing.grids, low)
    auto = static_pre.pixel_values(image)[1][1:]
    assert static_grid[0] * static_grid[1] <= auto[0] * auto[1]


def test_detail_low_of_a_photo(pre):
    assert pre.pixel_values(gradient((640, 480)), detail="low")[1] == (1, 6, 8)  # 12 tokens


@pytest.mark.parametrize("detail", ["medium", "", None, "LOW"])
def test_unknown_detail_is_refused(pre, detail):
    with pytest.raises(ValueError, match=r"image detail .* must be one of auto, low, high"):
        pre.pixel_values(gradient((64, 64)), detail=detail)


@pytest.mark.parametrize("limit", [16, 20, 40, 64])
def test_max_image_tokens_caps_the_processors_max_pixels(pre, reference, limit):
    image = gradient((1200, 900))
    values, grid = pre.pixel_values(image, max_image_tokens=limit)
    expected, expected_grid = processor_values(reference, image, limit * (PATCH * MERGE) ** 2)
    assert grid == expected_grid and grid[1] * grid[2] // MERGE**2 <= limit
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)
    assert pre.sizing.limit(limit) == limit and pre.sizing.limit(None) == IMAGE_TOKENS


@pytest.mark.parametrize("limit", [16, 20, 53, 54])
@pytest.mark.parametrize("size", [(1200, 200), (640, 480), (256, 256)])
def test_max_image_tokens_on_static_grids(static_pre, size, limit):
    """Only the grids within the limit, the closest to the processor's grid at the limit."""
    w, h = size
    grids = [g for g in static_pre.sizing.grids if g[0] * g[1] // MERGE**2 <= limit]
    exact = processor_grid(h, w, PATCH, MERGE, MIN_PIXELS, limit * (PATCH * MERGE) ** 2)
    grid = static_pre.pixel_values(gradient(size), max_image_tokens=limit)[1]
    assert grid == (1, *closest_grid(h, w, grids, exact))
    if limit == 16:
        assert grid == (1, 8, 8)  # the one grid of at most 16 tokens


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (15, r"max_image_tokens 15 is below the image processor's minimum of 16 tokens \(min_pixels 16384\)"),
        (0, r"max_image_tokens 0 is below the image processor's minimum of 16 tokens"),
        (65, r"max_image_tokens 65 is above this export's budget of 64 image tokens"),
        (16.0, r"max_image_tokens must be an integer, got 16.0"),
        (True, r"max_image_tokens must be an integer, got True"),
        ("32", r"max_image_tokens must be an integer, got '32'"),
    ],
)
def test_bad_max_image_tokens_are_refused(pre, limit, message):
    with pytest.raises(ValueError, match=message):
        pre.pixel_values(gradient((64, 64)), max_image_tokens=limit)


def test_max_image_tokens_below_the_smallest_static_grid_is_refused(folder):
    sizing = ImageSizing(PATCH, MERGE, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS, [(16, 16), (12, 18)])
    pre = Preprocessor.from_pretrained(folder, sizing, IMAGE_TOKEN_ID)
    with pytest.raises(
        ValueError, match=r"max_image_tokens 40 is below this export's smallest vision grid \(54 tokens\)"
    ):
        pre.pixel_values(gradient((64, 64)), max_image_tokens=40)
    assert pre.pixel_values(gradient((64, 64)), max_image_tokens=54)[1] == (1, 12, 18)


# ---- Preprocessor and ImageSizing ---------------------------------------------------------------


def test_sizing_of_a_contract():
    from qwen35_onnx.export.exporter import build_contract
    from qwen35_onnx.export.options import ExportOptions
    from qwen35_onnx.presets import tiny_config

    options = ExportOptions(capacity=4096, image_tokens=96, vision_grids="static")  # (the demo sizes' positions)
    contract = build_contract(tiny_config(), None, options)
    sizing = ImageSizing.of(contract)
    assert (sizing.patch_size, sizing.merge_size, sizing.factor) == (16, 2, 32)
    assert (sizing.min_pixels, sizing.max_pixels) == (contract.min_pixels, contract.max_pixels)
    assert sizing.image_tokens == 96 and sizing.grids == contract.vision_grids != ()
    assert sizing.min_tokens == -(-contract.min_pixels // 32**2)


def test_processor_with_another_patch_size_is_rejected(folder):
    with pytest.raises(ValueError, match=r"patch_size / merge_size \(16, 2\) differ from the export's \(14, 2\)"):
        Preprocessor.from_pretrained(folder, ImageSizing(14, 2, MIN_PIXELS, MAX_PIXELS, IMAGE_TOKENS), IMAGE_TOKEN_ID)


def test_unknown_image_token_id_is_rejected(folder):
    with pytest.raises(ValueError, match="image_token_id 100000"):
        Preprocessor.from_pretrained(folder, SIZING, 100000)


def test_folder_without_image_processor_is_rejected(folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "no-processor")
    (other / "preprocessor_config.json").unlink()
    with pytest.raises(OSError, match=r"has no image processor \(preprocessor_config.json\)"):
        Preprocessor.from_pretrained(other, SIZING, IMAGE_TOKEN_ID)


# ---- encode -------------------------------------------------------------------------------------


def test_encode_expands_the_image_placeholder(pre):
    ids = pre.encode("What colour is the cat?", 16)
    assert ids.dtype == np.int64 and ids.ndim == 2 and ids.shape[0] == 1
    row = ids[0].tolist()
    tok = pre.tokenizer
    start = row.index(tok.convert_tokens_to_ids("<|vision_start|>"))
    assert row[start + 1 : start + 17] == [IMAGE_TOKEN_ID] * 16
    assert row[start + 17] == tok.convert_tokens_to_ids("<|vision_end|>")
    assert row.count(IMAGE_TOKEN_ID) == 16
    assert row[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(row, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "What colour is the cat?" in tok.decode(row, skip_special_tokens=True)


def test_encode_chat_gives_each_image_its_own_count(pre):
    """Images of different grids in one conversation: each placeholder becomes that image's tokens,
    in order."""
    counts = [pre.pixel_values(gradient(size))[1] for size in ((1200, 200), (1, 1))]
    counts = [h * w // MERGE**2 for _, h, w in counts]
    assert counts == [57, 16]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    ids, text = pre.encode_chat(messages, counts)
    row = ids[0].tolist()
    tok = pre.tokenizer
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    firsts = [i + 1 for i, t in enumerate(row) if t == start]
    assert len(firsts) == 2
    for first, n in zip(firsts, counts):
        assert row[first : first + n] == [IMAGE_TOKEN_ID] * n
        assert row[first + n] == tok.convert_tokens_to_ids("<|vision_end|>")
    assert row.count(IMAGE_TOKEN_ID) == sum(counts)
    assert text.count("<|image_pad|>") == 2  # the prompt before the expansion
    with pytest.raises(ValueError, match="the messages hold 2 images but 1 image-token counts were given"):
        pre.encode_chat(messages, [57])
    with pytest.raises(ValueError, match=r"every image needs at least one image token, got \[57, 0\]"):
        pre.encode_chat(messages, [57, 0])


def test_encode_rejects_a_prompt_holding_the_placeholder(pre):
    with pytest.raises(ValueError, match="2 image placeholders"):
        pre.encode("sneaky <|image_pad|>", 16)


def test_encode_rejects_negative_count(pre):
    with pytest.raises(ValueError, match="n_image_tokens must be >= 0, got -1"):
        pre.encode("hi", -1)


def test_encode_text_only_prompt(pre):
    ids = pre.encode("hi", 0)
    assert ids.ndim == 2 and ids.shape[0] == 1
    assert not (ids == pre.image_token_id).any()


# ---- TextStreamer -------------------------------------------------------------------------------


def stream(tokenizer, ids):
    streamer = TextStreamer(tokenizer)
    pieces = [streamer.put(i) for i in ids]
    return pieces, streamer.end()


def test_streamer_holds_back_split_multibyte_characters(pre):
    tok = pre.tokenizer
    text = "Ünïcödé 日本語 🙂🐱 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == text == tok.decode(ids)
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # at least one character really was split across tokens


def test_streamer_skips_special_tokens(pre):
    tok = pre.tokenizer
    ids = tok("<|im_start|>assistant\nA cat.<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == "assistant\nA cat."


def test_streamer_end_flushes_an_incomplete_character(pre):
    tok = pre.tokenizer
    ids = tok("🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # the emoji is split into byte tokens
    pieces, tail = stream(tok, ids[:-1])
    assert pieces == [""] * (len(ids) - 1)
    assert tail.endswith("\ufffd")


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40))
def test_streamed_text_equals_full_decode(pre, text):
    ids = pre.tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(pre.tokenizer, ids)
    assert "".join(pieces) + tail == pre.tokenizer.decode(ids, skip_special_tokens=True)


# ---- torch-free ---------------------------------------------------------------------------------


def src_root() -> str:
    return str(Path(next(iter(qwen35_onnx.__path__))).parent)


def test_runtime_sources_do_not_import_torch():
    package = Path(next(iter(qwen35_onnx.__path__)))
    for path in sorted(
        [*package.glob("runtime/**/*.py"), *package.glob("conversation/*.py"), *package.glob("onnxfile/*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                assert name.split(".")[0] not in {"torch", "torchvision"}, f"{path.name} imports {name}"


def test_preprocess_runs_where_torch_is_not_installed(folder):
    """transformers imports torch whenever it is installed (image_utils.py), so hide torch and
    torchvision the way a torch-free install looks to importlib, then run the whole flow."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None        # find_spec() -> None, import -> ImportError
        sys.modules["torchvision"] = None
        from qwen35_onnx.runtime import masks, positions
        from qwen35_onnx.conversation import processor
        from PIL import Image
        sizing = processor.ImageSizing({PATCH}, {MERGE}, {MIN_PIXELS}, {MAX_PIXELS}, {IMAGE_TOKENS})
        pre = processor.Preprocessor.from_pretrained({str(folder)!r}, sizing, {IMAGE_TOKEN_ID})
        values, grid = pre.pixel_values(Image.new("RGB", (300, 200), (1, 2, 3)))
        ids = pre.encode("hello", grid[1] * grid[2] // 4)
        pos, deltas = positions.mrope_position_ids(ids, pre.image_token_id, grid, 2)
        mask = masks.prepare_decode_mask(ids * 0 + 1, 128, 128)
        assert values.shape == (216, 1536) and grid == (1, 12, 18) and pos.shape == (4, 1, ids.shape[1])
        loaded = sorted(m for m, v in sys.modules.items()
                        if v is not None and m.split(".")[0] in ("torch", "torchvision"))
        assert not loaded, loaded
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src_root(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


# ---- high bit depth and extreme shapes ----------------------------------------------------------


def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path):
    values = np.linspace(40, 65527, 64 * 64).reshape(64, 64).astype(np.uint16)
    path = tmp_path / "g16.png"
    Image.fromarray(values).save(path)
    rgb = np.asarray(load_image(path)).astype(float)
    assert rgb.shape == (64, 64, 3)
    assert abs(rgb.mean() - values.mean() / 257) < 1.0


def test_float_image_in_unit_range_is_scaled():
    image = Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32), "F")
    rgb = to_rgb(image)
    assert rgb.mode == "RGB" and np.asarray(rgb).mean() == pytest.approx(128, abs=1)
