"""Accuracy of the int4 block size: teacher-forced top-1 agreement with fp32, and first-logit cosine.

Not part of the test suite (the wide checkpoint trains for about 6 minutes on 2 cores). For each of
5 text prompts, fp32's 64 greedy tokens are fed to an ``--ops ort`` int4 export of the same trained
checkpoint at each block size; a token agrees when the int4 export's argmax before it is fp32's.

Checkpoints (built under ``WORK_DIR``, cached):

- ``demo``: the demo checkpoint after ``STEPS`` training steps (``tests/training.py``); hidden 128,
  so a block of 256 covers no more weights than one of 128 except in the MLP's down projection and
  the attention's output projection, and the float embedding is kept (``GatherBlockQuantized``
  needs the hidden size to be a multiple of the block);
- ``wide``: the demo architecture widened (hidden 512, MLP 1536, Gated DeltaNet and attention
  head dim 64, 8 attention heads), random weights then ``STEPS`` training steps: every quantized
  weight has K >= 256.

Usage (from the repository root, in the development environment)::

    .venv/bin/python benchmarks/block_agreement.py demo|wide [STEPS] [--work-dir /tmp/block-agreement]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' training helpers

from tests.conftest import forced_logits  # noqa: E402
from tests.training import train_checkpoint  # noqa: E402

from qwen35_onnx.checkpoints import build_demo_checkpoint  # noqa: E402
from qwen35_onnx.export.exporter import export  # noqa: E402
from qwen35_onnx.export.options import ExportOptions  # noqa: E402
from qwen35_onnx.pipeline import Pipeline  # noqa: E402

BLOCKS = (32, 64, 128, 256)
PROMPTS = (
    "Write a short story about a cat and a dog.",
    "What is the capital of France? Explain.",
    "def fibonacci(n):",
    "List three colours of the sky at sunset.",
    "Translate 'good morning' into German and say why.",
)
NEW_TOKENS = 64


def widen(src: Path, dst: Path) -> None:
    """The ``wide`` checkpoint's random weights: the demo's files with a wider text config."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model*.safetensors*", "config.json"))
    config = Qwen3_5Config.from_pretrained(src)
    text = config.text_config
    text.hidden_size = config.vision_config.out_hidden_size = 512
    text.intermediate_size = 1536
    text.linear_key_head_dim = text.linear_value_head_dim = text.head_dim = 64
    text.num_attention_heads = 8
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", choices=("demo", "wide"))
    parser.add_argument("steps", type=int, nargs="?", default=300)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/block-agreement"))
    args = parser.parse_args()
    root = args.work_dir
    demo = build_demo_checkpoint(root / "demo")
    start = demo
    if args.checkpoint == "wide":
        start = root / "wide"
        if not start.exists():
            widen(demo, start)
    trained = root / f"trained-{args.checkpoint}-{args.steps}"
    if not trained.exists():
        train_checkpoint(start, trained, steps=args.steps)
    float_embedding = {"quantize_embedding": False} if args.checkpoint == "demo" else {}

    def pipeline(name: str, **options) -> Pipeline:
        out = root / f"{trained.name}-{name}"
        if not out.exists():
            fixed = dict(capacity=512, image_tokens=64, prefill_buckets=(512,), prefill_chunks=(), ops="ort")
            export(trained, out, ExportOptions(**fixed, **options))
        return Pipeline.from_exported(out)

    reference = pipeline("fp32")
    blocks = {b: pipeline(f"int4-b{b}", quantize="int4", quant_block_size=b, **float_embedding) for b in BLOCKS}
    agreement = {b: [] for b in BLOCKS}
    cosine = {b: [] for b in BLOCKS}
    for prompt in PROMPTS:
        tokens = reference.generate(None, prompt, max_new_tokens=NEW_TOKENS).token_ids
        expected = forced_logits(reference, reference.prepare(None, prompt), tokens)
        for b, pipe in blocks.items():
            got = forced_logits(pipe, pipe.prepare(None, prompt), tokens)
            agreement[b].append(np.mean([g.argmax() == e.argmax() for g, e in zip(got, expected)]))
            a, c = expected[0], got[0]
            cosine[b].append(a @ c / np.linalg.norm(a) / np.linalg.norm(c))
    for b in BLOCKS:
        per_prompt = ", ".join(f"{x:.1%}" for x in agreement[b])
        print(
            f"{trained.name} block {b}: agreement {np.mean(agreement[b]):.1%} ({per_prompt}), "
            f"first-logit cosine {np.mean(cosine[b]):.4f}"
        )


if __name__ == "__main__":
    main()
