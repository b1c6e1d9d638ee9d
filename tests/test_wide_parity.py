"""Parity at the Qwen3.5-4B layer widths (issue 9, item 7): a checkpoint with the 4B preset's
text widths (hidden 2560, MLP 9216, 16 query / 4 KV heads of 256, Gated DeltaNet 16 key / 32
value heads of 128: the 2:1 value/key ratio) but 2 layers (1 Gated DeltaNet + 1 full attention),
the demo vocabulary and a 1-block vision tower of the 4B's width, random fp32 weights. Greedy
tokens with an image equal transformers' for 32 tokens, with both operator sets."""

from __future__ import annotations

import copy

import pytest

from .conftest import CAPACITY, PROMPT, export_to

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
WIDE_SEED = 4  # greedy: no end of sequence in 32 tokens, top-two logit gap >= 0.08 (transformers, fp32)


@pytest.fixture(scope="module")
def wide_checkpoint(checkpoint, tmp_path_factory):
    """The demo checkpoint's tokenizer and processor files with a 4B-width model (2 layers, about
    1 GB in fp32)."""
    import shutil

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from qwen35_onnx.presets import QWEN35_4B_PRESET, TINY_PRESET

    preset = copy.deepcopy(QWEN35_4B_PRESET)
    preset["text_config"].update(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        vocab_size=TINY_PRESET["text_config"]["vocab_size"],
        initializer_range=0.05,  # clearer greedy margins than 0.02 with random weights
    )
    preset["vision_config"].update(depth=1)
    out = tmp_path_factory.mktemp("ckpt") / "wide"
    shutil.copytree(checkpoint, out)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WIDE_SEED)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**preset)).to(torch.float32).eval()
    model.generation_config = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint).generation_config
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def wide_reference(wide_checkpoint):
    """transformers' model of the wide checkpoint, loaded once for both ``--ops`` (its greedy tokens
    for the photo are computed once: :func:`~tests.conftest.remember_generations`)."""
    from qwen35_onnx.verify import load_reference

    from .conftest import remember_generations

    return remember_generations(load_reference(wide_checkpoint))


@pytest.mark.parametrize("ops", ["ort", "portable"])
def test_4b_widths_greedy_parity_with_transformers(ops, wide_checkpoint, wide_reference, photo, tmp_path):
    from qwen35_onnx.contract import read_manifest
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import token_parity

    from .conftest import split_margin

    # one bucket of the capacity: the photo's 64 image tokens and the text are 78 tokens
    out = export_to(wide_checkpoint, tmp_path / ops, ops=ops, prefill_buckets=(CAPACITY,))
    contract = read_manifest(out)
    assert (contract.hidden_size, contract.head_dim, contract.num_key_value_heads) == (2560, 256, 4)
    assert (contract.linear_num_value_heads, contract.linear_key_head_dim) == (32, 128)
    pipe = Pipeline.from_exported(out)
    result = pipe.generate(photo, PROMPT, max_new_tokens=NEW_TOKENS)
    parity = token_parity(pipe, wide_checkpoint, photo, PROMPT, NEW_TOKENS, result=result, model=wide_reference)
    print(f"4B widths, --ops {ops}: {parity.line()}")
    if not parity.ok:
        split, margin = split_margin(pipe, pipe.prepare(photo, PROMPT), parity.ours, parity.reference)
        pytest.fail(f"tokens part at {split}: our margin for our token there {margin:.2e}")
    assert len(result.token_ids) == NEW_TOKENS  # no early end of sequence: 32 tokens compared
