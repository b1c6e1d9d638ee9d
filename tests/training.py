"""Test-only: a briefly trained copy of the demo checkpoint, for the tests that measure how much a
change of arithmetic (quantization, fp16, bf16) moves the output."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from qwen35_onnx.checkpoints import tokenizer_corpus

TRAINING_THREADS = 2


def train_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, *, steps: int = 200, seed: int = 0, texts: list[str] | None = None
) -> Path:
    """Copy the checkpoint at ``src`` to ``dst`` after ``steps`` steps of language-model training
    on ``texts`` (default: the tokenizer corpus; next-token cross-entropy over 8 windows of 128 tokens per step,
    AdamW, learning rate 3e-3; vision tower untouched). About 0.2 s per step on 2 CPU cores.

    What it is for: weight-only quantization error depends on whether the network amplifies
    small weight perturbations. Random weights (the demo checkpoint) are close to chaotic, so
    int4 noise (about 9 % per weight at block 32) decorrelates the logits entirely (last-logit
    cosine 0.60 against fp32); after 300 steps the same architecture gives 0.997. Quantization
    accuracy is therefore measured on a trained copy (``tests/test_fused_and_quantized.py``).

    Returns:
        Path: ``dst`` (absolute); written atomically (temporary sibling, then rename).

    Raises:
        ValueError: ``steps`` < 1.
        FileExistsError: ``dst`` exists.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    if steps < 1:
        raise ValueError(f"steps {steps} must be >= 1")
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.training-", dir=dst.parent))
    try:
        shutil.copytree(src, staging, dirs_exist_ok=True)
        corpus = "\n".join(tokenizer_corpus() if texts is None else texts)
        ids = AutoTokenizer.from_pretrained(src)(corpus, return_tensors="pt").input_ids[0]
        model = Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
        threads = torch.get_num_threads()
        # the weights depend on the thread count (the order of float sums): always 2, the 2-core
        # machines' default that the measured numbers of the quantization and dtype tests were made with
        torch.set_num_threads(TRAINING_THREADS)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
                model.train()
                for _ in range(steps):
                    starts = torch.randint(0, ids.numel() - 129, (8,)).tolist()
                    batch = torch.stack([ids[i : i + 128] for i in starts])
                    loss = model(input_ids=batch, labels=batch).loss
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        finally:
            torch.set_num_threads(threads)
        model.eval().save_pretrained(staging)
        (staging / ".qwen35_onnx_demo").unlink(missing_ok=True)  # no longer the demo checkpoint
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


def json_chats(n: int = 3000, seed: int = 7) -> list[str]:
    """``n`` chat turns (Qwen3.5 template text) whose replies are small compact JSON objects (1-4
    keys; values short strings, integers, booleans, string arrays, nested objects up to depth 2),
    half with an empty reasoning block and half with a few words of reasoning: training text for a
    test checkpoint that writes JSON replies, as a chat model asked for JSON does."""
    rng = random.Random(seed)
    words = "the a photo image person cat dog sky blue red green small large city river car house tree book".split()

    def text(most: int = 3) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, most)))

    def value(depth: int):
        r = rng.random()
        if r < 0.4:
            return text()
        if r < 0.6:
            return rng.randrange(1000)
        if r < 0.7:
            return rng.random() < 0.5
        if r < 0.85:
            return [text(2) for _ in range(rng.randint(0, 3))]
        return obj(depth + 1) if depth < 2 else text()

    def obj(depth: int = 0) -> dict:
        return {rng.choice(words): value(depth) for _ in range(rng.randint(1, 4))}

    chats = []
    for _ in range(n):
        reasoning = "\n\n" if rng.random() < 0.5 else f"\n{text(8)}\n"
        reply = json.dumps(obj(), separators=(",", ":"))
        chats.append(
            f"<|im_start|>user\n{text(6).capitalize()}?<|im_end|>\n<|im_start|>assistant\n"
            f"<think>{reasoning}</think>\n\n{reply}<|im_end|>\n"
        )
    return chats


def train_mtp_head(
    src: str | os.PathLike, dst: str | os.PathLike, *, steps: int = 150, seed: int = 0, texts: list[str] | None = None
) -> Path:
    """Copy the checkpoint at ``src`` (trained: :func:`train_checkpoint`) to ``dst`` with an MTP head trained by
    self-distillation on the model's own outputs: at each position ``i`` of windows of ``texts`` (default: the
    tokenizer corpus; 8 windows of 128 tokens per step, AdamW, learning rate 3e-3), the head reads the model's
    hidden state at ``i`` (``last_hidden_state``) and the token at ``i + 1`` and learns the model's own
    distribution for position ``i + 2`` (its softmax at ``i + 1``; KL divergence), the frozen model's embedding
    and lm_head shared, as the published heads are used (:mod:`qwen35_onnx.export.mtp`). The published
    checkpoints ship trained heads; this one makes acceptance measurable on the test checkpoint.

    Returns:
        Path: ``dst`` (absolute), written atomically.
    """
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from qwen35_onnx.export import layers
    from qwen35_onnx.export.mtp import MtpHead, write_mtp_head

    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.training-", dir=dst.parent))
    try:
        shutil.copytree(src, staging, dirs_exist_ok=True)
        corpus = "\n".join(tokenizer_corpus() if texts is None else texts)
        ids = AutoTokenizer.from_pretrained(src)(corpus, return_tensors="pt").input_ids[0]
        model = Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
        text = model.model.language_model
        for p in model.parameters():
            p.requires_grad_(False)
        threads = torch.get_num_threads()
        torch.set_num_threads(TRAINING_THREADS)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                head = MtpHead(model.config.text_config)
                optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
                width = 128
                causal = torch.full((width - 1, width - 1), float("-inf")).triu(1)[None, None]
                positions = torch.arange(width - 1).view(1, 1, -1).expand(3, 8, -1)
                head.train()
                for _ in range(steps):
                    starts = torch.randint(0, ids.numel() - width - 1, (8,)).tolist()
                    batch = torch.stack([ids[i : i + width] for i in starts])
                    with torch.no_grad():
                        hidden = text(input_ids=batch).last_hidden_state  # [8, W, H]
                        target = F.log_softmax(model.lm_head(hidden[:, 1:]), dim=-1)  # the model at i + 1
                        embeds = text.embed_tokens(batch[:, 1:])  # the token at i + 1
                        rope = layers.mrope_cos_sin(text.rotary_emb, embeds, positions)
                    out = head(embeds, hidden[:, :-1], rope, causal)
                    draft = F.log_softmax(model.lm_head(out), dim=-1)
                    loss = F.kl_div(draft, target, log_target=True, reduction="batchmean")
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        finally:
            torch.set_num_threads(threads)
        write_mtp_head(staging, head.eval())
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst
