"""Tests for the tiny preset and the demo checkpoint (offline, a few seconds on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from qwen35_onnx import checkpoints  # noqa: E402
from qwen35_onnx.checkpoints import DEMO_SEED, build_demo_checkpoint  # noqa: E402
from qwen35_onnx.paths import demo_checkpoint_dir, photo_path  # noqa: E402
from qwen35_onnx.presets import PUBLISHED_ADDED_TOKENS, TINY_PRESET, preset_config, tiny_config  # noqa: E402

DEMO_MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
DEMO_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_dir)


def test_module_imports_without_torch():
    code = "import sys, qwen35_onnx.checkpoints; sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_tiny_preset_is_a_real_qwen35():
    config = tiny_config()
    text, vision = config.text_config, config.vision_config
    assert text.num_hidden_layers >= 8 and len(text.layer_types) == text.num_hidden_layers
    assert text.layer_types.count("full_attention") == 2
    assert text.layer_types[3] == text.layer_types[7] == "full_attention"
    assert text.num_key_value_heads < text.num_attention_heads  # GQA
    assert text.num_attention_heads % text.num_key_value_heads == 0
    assert text.linear_num_value_heads > text.linear_num_key_heads
    rope = text.rope_parameters
    assert 0 < rope["partial_rotary_factor"] < 1
    rotary_dim = int(text.head_dim * rope["partial_rotary_factor"])
    assert sum(rope["mrope_section"]) == rotary_dim // 2 == 8
    assert rope["mrope_interleaved"] is True
    assert vision.out_hidden_size == text.hidden_size
    assert not config.tie_word_embeddings and not text.tie_word_embeddings
    # tiny_config works on a copy
    config.text_config.layer_types[0] = "full_attention"
    assert TINY_PRESET["text_config"]["layer_types"][0] == "linear_attention"


def test_checkpoint_folder_is_complete(demo_dir):
    names = {p.name for p in demo_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        ".qwen35_onnx_demo",
    } <= names
    assert json.loads((demo_dir / ".qwen35_onnx_demo").read_text())["seed"] == DEMO_SEED
    assert [p.name for p in demo_dir.parent.iterdir()] == [demo_dir.name]  # no staging leftovers


def test_model_reloads_with_matching_token_ids(demo_dir, tokenizer):
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(demo_dir)
    config = model.config
    for part in ("text_config", "vision_config"):
        saved = getattr(config, part).to_dict()
        assert {key: saved[key] for key in TINY_PRESET[part]} == TINY_PRESET[part]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert config.text_config.vocab_size == len(tokenizer) == 1024
    ids = tokenizer.convert_tokens_to_ids
    assert config.image_token_id == ids("<|image_pad|>")
    assert config.video_token_id == ids("<|video_pad|>")
    assert config.vision_start_token_id == ids("<|vision_start|>")
    assert config.vision_end_token_id == ids("<|vision_end|>")
    generation = model.generation_config
    assert generation.eos_token_id == [ids("<|im_end|>"), ids("<|endoftext|>")]
    assert generation.pad_token_id == ids("<|endoftext|>") and generation.do_sample is False


def test_tokenizer_reloads_with_same_ids(demo_dir, tokenizer):
    from tokenizers import Tokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    text = DEMO_PROMPT + "<think>\n\n</think>\n\nAn astronaut in an orange suit, 1995. héllo 日本"
    raw = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert tokenizer(text).input_ids == raw.encode(text).ids
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    # the published added-token layout: 33 tokens after the base vocabulary, with their special flags
    assert [tokenizer.convert_tokens_to_ids(t) for t, _ in PUBLISHED_ADDED_TOKENS] == list(range(991, 1024))
    added = tokenizer.added_tokens_decoder
    assert [(added[i].content, added[i].special) for i in range(991, 1024)] == list(PUBLISHED_ADDED_TOKENS)
    assert tokenizer.decode(tokenizer.encode("<tool_call>x</tool_call>"), skip_special_tokens=True) == (
        "<tool_call>x</tool_call>"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    pre = json.loads((demo_dir / "tokenizer.json").read_text())["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["pattern"]["Regex"] == PRETOKENIZE_REGEX and pre[0]["behavior"] == "Isolated"
    assert pre[1]["type"] == "ByteLevel" and pre[1]["add_prefix_space"] is False


def test_chat_template(tokenizer):
    assert tokenizer.apply_chat_template(DEMO_MESSAGES, add_generation_prompt=True, tokenize=False) == DEMO_PROMPT
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )


def test_image_processor_loads_without_torchvision(demo_dir):
    processor = transformers.AutoImageProcessor.from_pretrained(demo_dir, backend="pil")
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    out = processor(images=[Image.open(photo_path())], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 16, 16]]  # 256x256 px, 16 px patches: 64 image tokens
    assert out["pixel_values"].shape == (256, 3 * 2 * 16 * 16)


def test_image_processor_has_the_published_pixel_range(demo_dir):
    """The published Qwen3.5 processor's range (64 image tokens at least, 16384 at most), which an
    export reads (min_pixels / max_pixels of its contract) and caps at its image-token budget."""
    from qwen35_onnx.export.exporter import processor_pixel_range

    config = json.loads((demo_dir / "preprocessor_config.json").read_text())
    assert config["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    assert processor_pixel_range(demo_dir) == (65536, 16777216)
    processor = transformers.AutoImageProcessor.from_pretrained(demo_dir, backend="pil")
    for size, grid in (((64, 48), [1, 14, 20]), ((256, 256), [1, 16, 16]), ((4000, 3000), [1, 188, 250])):
        out = processor(images=[Image.new("RGB", size)], return_tensors="np")
        assert out["image_grid_thw"].tolist() == [grid], size
        h, w = grid[1:]
        assert 65536 <= h * w * 16 * 16 <= 16777216


def test_cache_of_an_older_format_is_rebuilt(demo_dir, tmp_path, monkeypatch):
    """A demo checkpoint cached before the published processor range (format 2, 128x128 ..
    256x256 pixels) is rebuilt, not used with the old range."""
    import shutil

    assert json.loads((demo_dir / checkpoints._MARKER).read_text())["format_version"] >= 3
    old = shutil.copytree(demo_dir, tmp_path / "old")
    marker = json.loads((old / checkpoints._MARKER).read_text())
    (old / checkpoints._MARKER).write_text(json.dumps({**marker, "format_version": 2}))

    def fail(*args):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(checkpoints, "_write_checkpoint", fail)
    with pytest.raises(AssertionError, match="rebuilt"):
        build_demo_checkpoint(old)


def test_greedy_demo_generation_is_well_separated(demo_dir, tokenizer):
    """The property the parity tests rely on: no early eos, clear top-1/top-2 gaps."""
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(demo_dir).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(demo_dir, backend="pil")
    image = processor(images=[Image.open(photo_path())], return_tensors="pt")
    n_image_tokens = int(image["image_grid_thw"].prod()) // 4
    prompt = DEMO_PROMPT.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=image["pixel_values"],
            image_grid_thw=image["image_grid_thw"],
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
            max_new_tokens=40,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    assert len(new_tokens) == 40 and not set(new_tokens) & set(model.generation_config.eos_token_id)
    gaps = [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in out.logits)]
    assert min(gaps) > 1e-3


def test_cache_same_seed_is_not_rebuilt(demo_dir, monkeypatch):
    def fail(*args):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(checkpoints, "_write_checkpoint", fail)
    assert build_demo_checkpoint(demo_dir) == demo_dir
    with pytest.raises(AssertionError, match="rebuilt"):
        build_demo_checkpoint(demo_dir, overwrite=True)
    assert (demo_dir / "model.safetensors").is_file()  # a failed rebuild leaves the old one
    assert [p.name for p in demo_dir.parent.iterdir()] == [demo_dir.name]  # and no staging folder


def test_weights_deterministic_per_seed(demo_dir, tmp_path):
    weights = (demo_dir / "model.safetensors").read_bytes()
    again = build_demo_checkpoint(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == weights
    assert (again / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()
    # another seed replaces the cached folder with different weights
    build_demo_checkpoint(again, seed=DEMO_SEED + 1)
    assert json.loads((again / ".qwen35_onnx_demo").read_text())["seed"] == DEMO_SEED + 1
    assert (again / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_refuses_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_demo_checkpoint(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_demo_checkpoint_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN35_ONNX_CACHE", str(tmp_path))
    assert demo_checkpoint_dir() == tmp_path / "demo-checkpoint"
    monkeypatch.delenv("QWEN35_ONNX_CACHE")
    assert demo_checkpoint_dir() == Path.home() / ".cache/qwen35-onnx/demo-checkpoint"


def test_photo_is_a_small_jpeg():
    path = photo_path()
    assert path.stat().st_size < 40_000
    with Image.open(path) as image:
        assert image.format == "JPEG" and image.mode == "RGB" and max(image.size) <= 256


def test_published_0_8b_preset_sizes():
    """The Qwen3.5-0.8B preset has the published sizes (853 M parameters, tied embeddings)."""
    from qwen35_onnx.presets import PRESETS, preset_config

    config = preset_config("qwen3.5-0.8b")
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size) == (
        1024,
        24,
        3584,
        248320,
    )
    assert text.layer_types.count("full_attention") == 6 and text.layer_types[3] == "full_attention"
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 2, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim) == (16, 16, 128)
    assert config.vision_config.depth == 12 and config.vision_config.out_hidden_size == 1024
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert 850e6 < sum(p.numel() for p in model.parameters()) < 856e6
    assert PRESETS["tiny"] is TINY_PRESET
    with pytest.raises(
        ValueError, match="preset .huge. is not one of tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b, qwen3.5-9b"
    ):
        preset_config("huge")
    with pytest.raises(ValueError, match="preset 'huge'"):
        build_demo_checkpoint(Path("/nonexistent/x"), preset="huge")


def test_train_checkpoint_rejects_bad_arguments(demo_dir, tmp_path):
    from .training import train_checkpoint

    with pytest.raises(ValueError, match="steps 0 must be >= 1"):
        train_checkpoint(demo_dir, tmp_path / "t", steps=0)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        train_checkpoint(demo_dir, tmp_path / "exists", steps=1)
    trained = train_checkpoint(demo_dir, tmp_path / "one", steps=1)
    assert (trained / "model.safetensors").is_file() and not (trained / ".qwen35_onnx_demo").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


@pytest.mark.parametrize(
    "preset, text_sizes, heads, vision, tied, billions",
    [
        # hidden, layers (full attention), MLP; (q heads, KV heads, GDN key heads, GDN value heads);
        # vision (depth, width, out); tied lm_head; parameters (B) as transformers builds them
        ("qwen3.5-2b", (2048, 24, 6, 6144), (8, 2, 16, 16), (24, 1024, 2048), True, (2.20, 2.23)),
        # the reference system's listing of the 4B, except the lm_head: the published config ties it
        ("qwen3.5-4b", (2560, 32, 8, 9216), (16, 4, 16, 32), (24, 1024, 2560), True, (4.53, 4.55)),
        ("qwen3.5-9b", (4096, 32, 8, 12288), (16, 4, 16, 32), (27, 1152, 4096), False, (9.40, 9.42)),
    ],
)
def test_published_larger_presets(preset, text_sizes, heads, vision, tied, billions):
    """The 2B, 4B and 9B presets have the published sizes (heads of 256, Gated DeltaNet heads of
    128, vocabulary 248320, full attention every fourth layer) and are stored in bf16."""
    from qwen35_onnx.checkpoints import _marker
    from qwen35_onnx.presets import preset_dtype

    config = preset_config(preset)
    text = config.text_config
    hidden, layers, full, mlp = text_sizes
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size) == (
        hidden,
        layers,
        mlp,
        248320,
    )
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * full
    assert (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.linear_num_key_heads,
        text.linear_num_value_heads,
    ) == heads
    assert (text.head_dim, text.linear_key_head_dim, text.linear_value_head_dim) == (256, 128, 128)
    v = config.vision_config
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.num_heads) == (*vision, 16)
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tied
    assert billions[0] * 1e9 < sum(p.numel() for p in model.parameters()) < billions[1] * 1e9
    assert preset_dtype(preset) == "bf16" and _marker(0, preset)["dtype"] == "bf16"


def test_published_preset_checkpoint_is_stored_in_bf16(tmp_path, monkeypatch):
    """A published-size checkpoint is built and saved in bf16 and reloads as such (checked on a
    shrunken copy of the 0.8B preset: 4 layers and the demo vocabulary, so it builds in seconds)."""
    import copy

    from qwen35_onnx import presets

    small = copy.deepcopy(presets.QWEN35_0_8B_PRESET)
    small["text_config"].update(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        vocab_size=presets.TINY_PRESET["text_config"]["vocab_size"],
    )
    small["vision_config"].update(depth=1)
    monkeypatch.setitem(presets.PRESETS, "qwen3.5-0.8b", small)
    path = build_demo_checkpoint(tmp_path / "ckpt", preset="qwen3.5-0.8b")
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    assert build_demo_checkpoint(tmp_path / "ckpt", preset="qwen3.5-0.8b") == path  # cached
