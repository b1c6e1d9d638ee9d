"""Image loading, fixed-grid patches, prompt encoding and streaming detokenization
(qwen35_onnx.conversation.processor), on a tiny locally trained tokenizer + processor folder."""

import ast
import json
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

import qwen35_onnx
from qwen35_onnx.conversation.detokenizer import TextStreamer
from qwen35_onnx.conversation.images import fit_to_grid, load_image
from qwen35_onnx.conversation.processor import Preprocessor

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE_TOKEN_ID = SPECIAL.index("<|image_pad|>")  # special tokens get the first ids, in order
IMAGE_SIZE = 128  # patch 16 -> grid (1, 8, 8) -> 64 patches, 16 image tokens
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
                # deliberately unlike 128 x 128: pixel_values must pin the size itself
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
    return Preprocessor.from_pretrained(folder, IMAGE_SIZE, IMAGE_TOKEN_ID)


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


# ---- fit_to_grid / pixel_values -----------------------------------------------------------------


@pytest.mark.parametrize("size", [(1, 1), (3000, 200), (200, 3000), (640, 480), (128, 128), (129, 127), (31, 500)])
def test_any_size_gives_exactly_the_grid(pre, size):
    values, grid = pre.pixel_values(gradient(size))
    assert grid == (1, 8, 8) == pre.grid_thw
    assert values.dtype == np.float32 and values.shape == (64, 3 * 2 * 16 * 16)
    assert values.flags.c_contiguous and np.isfinite(values).all()
    assert pre.n_image_tokens == 16


def test_pad_to_centred_square_then_resize():
    out = fit_to_grid(Image.new("RGB", (300, 100), (255, 255, 255)), 96)
    assert out.size == (96, 96) and out.mode == "RGB"
    pixels = np.asarray(out).astype(int)
    assert (pixels[:30] == 0).all() and (pixels[66:] == 0).all()  # black bars above and below
    assert (pixels[35:61] == 255).all()
    tall = np.asarray(fit_to_grid(Image.new("RGB", (100, 300), (255, 255, 255)), 96))
    assert (tall[:, :30] == 0).all() and (tall[:, 66:] == 0).all()
    # exactly: pad to a centred 300x300 square, then a bicubic resize
    image = gradient((300, 100))
    square = Image.new("RGB", (300, 300), (0, 0, 0))
    square.paste(image, (0, 100))
    expected = square.resize((96, 96), Image.Resampling.BICUBIC)
    np.testing.assert_array_equal(np.asarray(fit_to_grid(image, 96)), np.asarray(expected))


def test_fitted_square_is_unchanged():
    image = gradient((128, 128))
    np.testing.assert_array_equal(np.asarray(fit_to_grid(image, 128)), np.asarray(image))


def test_pixel_values_match_the_processor_on_a_fitted_image(pre):
    image = gradient((128, 128))
    direct = pre.image_processor(
        images=[image], size={"shortest_edge": 128 * 128, "longest_edge": 128 * 128}, return_tensors="np"
    )
    values, _ = pre.pixel_values(image)
    np.testing.assert_array_equal(values, direct["pixel_values"])
    assert values.min() >= -1 and values.max() <= 1  # mean/std 0.5 normalisation


@pytest.mark.parametrize("image_size", [100, 0, 16])
def test_image_size_must_be_a_multiple_of_patch_times_merge(folder, image_size):
    with pytest.raises(ValueError, match=f"image_size {image_size} .* 32"):
        Preprocessor.from_pretrained(folder, image_size, IMAGE_TOKEN_ID)


def test_unknown_image_token_id_is_rejected(folder):
    with pytest.raises(ValueError, match="image_token_id 100000"):
        Preprocessor.from_pretrained(folder, IMAGE_SIZE, 100000)


# ---- encode -------------------------------------------------------------------------------------


def test_encode_expands_the_image_placeholder(pre):
    ids = pre.encode("What colour is the cat?", pre.n_image_tokens)
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
        pre = processor.Preprocessor.from_pretrained({str(folder)!r}, 128, {IMAGE_TOKEN_ID})
        values, grid = pre.pixel_values(Image.new("RGB", (300, 200), (1, 2, 3)))
        ids = pre.encode("hello", pre.n_image_tokens)
        pos, deltas = positions.mrope_position_ids(ids, pre.image_token_id, grid, 2)
        mask = masks.prepare_decode_mask(ids * 0 + 1, 64, 64)
        assert values.shape == (64, 1536) and grid == (1, 8, 8) and pos.shape == (4, 1, ids.shape[1])
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
    assert np.asarray(fit_to_grid(image, 32)).mean() == pytest.approx(128, abs=1)


def test_very_thin_image_does_not_build_a_huge_square(monkeypatch):
    from qwen35_onnx.conversation import images

    thin = Image.new("RGB", (100_000, 1), (255, 255, 255))
    sizes = []
    real_new = Image.new
    monkeypatch.setattr(
        images.Image, "new", lambda mode, size, *a, **k: sizes.append(size) or real_new(mode, size, *a, **k)
    )
    out = fit_to_grid(thin, 64)
    assert out.size == (64, 64)
    assert all(max(size) <= images.MAX_PAD_SIDE for size in sizes), sizes
    pixels = np.asarray(out)
    assert pixels.max() > 200 and pixels[0].max() == 0  # a bright line on black
