"""Constrained decoding's cost per token on a vocabulary the size of Qwen3.5's, with the published
added tokens (issue 43).

Not part of the test suite. The published tokenizer cannot be downloaded here, so the script builds
one of its shape: a byte-level BPE of 248,044 entries (the 256 byte tokens, then random ASCII words
and CJK characters grown one byte at a time, each a merge of its prefix and its last byte, so the
vocabulary is prefix-closed as a trained one is), the Qwen3.5 pre-tokenizer, and the 33 published
added tokens after it (ids 248044-248076, :data:`qwen35_onnx.presets.PUBLISHED_ADDED_TOKENS`, with
their ``special`` flags). Then, in one process:

- the llguidance tokenizer's build: llguidance's own reading (``llguidance.hf.from_tokenizer``) and
  this project's (:func:`qwen35_onnx.conversation.grammar.grammar_tokenizer`), seconds;
- for a required tool call and a strict nested JSON schema: ``--replies`` replies driven by random
  logits under :class:`~qwen35_onnx.conversation.grammar.TokenConstraint` (mask, sample, accept, as
  ``Pipeline`` does), the grammar's milliseconds per token (mask + accept), median and p95 of the
  replies' means; with llguidance's own reading, whether the tool call fails (the issue's HTTP 500);
- with ``--export DIR``: the export's decode step in the same process (greedy, a short chat prompt),
  milliseconds, so that the grammar's share of a step is a ratio measured side by side.

Usage (from the repository root, in the development environment)::

    .venv/bin/python benchmarks/grammar_vocab.py [--replies 5] [--threads 2] [--export DIR] [--out FILE]

The JSON printed (and written to ``--out``) names the machine (CPU model, cores), the date and the
versions; ``benchmarks/grammar_vocab.json`` is the stored result the README cites.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from qwen35_onnx import __version__
from qwen35_onnx.bench.constrained import CASES
from qwen35_onnx.conversation.grammar import GrammarCompiler, GrammarError, TokenConstraint
from qwen35_onnx.conversation.tools import parse_reply_format
from qwen35_onnx.presets import PUBLISHED_ADDED_TOKENS

BASE_SIZE = 248044  # the published Qwen3.5 tokenizer's entries before its added tokens


def synthetic_tokenizer(base_size: int = BASE_SIZE, seed: int = 0):
    """A ``Qwen3_5Tokenizer`` with ``base_size`` byte-level BPE entries (see the module docstring)
    and the published added tokens after them."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen3_5Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def mapped(text: str) -> str:
        return "".join(piece for piece, _ in byte_level.pre_tokenize_str(text))

    rng = random.Random(seed)
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # the 256 bytes
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyzetaoinshr"
    while len(vocab) < base_size:
        if rng.random() < 0.1:
            word = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))
        else:
            word = (" " if rng.random() < 0.6 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        token = mapped(word)
        for end in range(2, len(token) + 1):
            if len(vocab) >= base_size:
                break
            if token[:end] not in vocab:
                merges.append((token[: end - 1], token[end - 1]))
                vocab[token[:end]] = len(vocab)
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in PUBLISHED_ADDED_TOKENS])
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def drive(constraint: TokenConstraint, size: int, stops: set[int], seed: int, steps: int = 400) -> tuple[int, float]:
    """One reply under ``constraint`` from random logits: (tokens, grammar seconds: mask + accept)."""
    rng, seconds = np.random.default_rng(seed), 0.0
    for n in range(1, steps + 1):
        logits = rng.normal(scale=2.0, size=size).astype(np.float32)
        start = time.perf_counter()
        masked = constraint.mask(logits)
        seconds += time.perf_counter() - start
        token = int(np.argmax(masked))
        start = time.perf_counter()
        constraint.accept(token)
        seconds += time.perf_counter() - start
        if token in stops:
            return n, seconds
    return steps, seconds


class _OwnReading(GrammarCompiler):
    """The compiler as it was before issue 43: llguidance's own reading of the tokenizer."""

    @property
    def llg_tokenizer(self):
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._stops)
        return self._llg_tokenizer


def decode_ms(export: str, threads: int) -> float:
    """Median decode step (ms) of ``export``: a greedy 48-token chat reply."""
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(export, threads=threads)
    prepared = pipe.prepare_chat([{"role": "user", "content": "Describe a pet."}], {"enable_thinking": False})
    result = pipe.generate_prepared(prepared, 48)
    return result.timings.decode_ms_per_token


def machine() -> dict:
    """The CPU model, the cores this process may use, the date (UTC) and the versions measured."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {"qwen35-onnx": __version__, **{name: version(name) for name in ("llguidance", "onnxruntime")}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=5, help="replies per case (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="decode threads with --export (>= 1)")
    parser.add_argument("--export", default=None, help="an export whose decode step is timed alongside")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args()
    for name in ("replies", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    start = time.perf_counter()
    tokenizer = synthetic_tokenizer()
    out = {"machine": machine(), "replies": args.replies}
    out.update(tokenizer_entries=len(tokenizer), tokenizer_build_s=round(time.perf_counter() - start, 2))
    stops = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    compilers = {"own reading": _OwnReading(tokenizer, stops), "project": GrammarCompiler(tokenizer, stops)}
    for name, compiler in compilers.items():
        start = time.perf_counter()
        size = compiler.llg_tokenizer.vocab_size
        out[f"llg_tokenizer_s ({name})"] = round(time.perf_counter() - start, 2)
    for case, kwargs in CASES.items():
        reply = parse_reply_format(kwargs.get("tools"), kwargs.get("tool_choice"), None, kwargs.get("response_format"))
        for name, compiler in compilers.items():
            per_token, failures = [], []
            for seed in range(args.replies):
                try:
                    tokens, seconds = drive(compiler.constraint(reply), size, set(stops), seed)
                    per_token.append(1000 * seconds / tokens)
                except GrammarError as exc:
                    failures.append(str(exc))
            row = {"failed": len(failures), "first_failure": failures[0] if failures else None}
            if per_token:
                row["ms_per_token_median"] = round(statistics.median(per_token), 3)
                row["ms_per_token_max"] = round(max(per_token), 3)
            out[f"{case} ({name})"] = row
    if args.export:
        from qwen35_onnx.contract import read_manifest

        c = read_manifest(args.export)
        out["export"] = {
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "ops": c.ops,
            "quantize": c.quantize,
            "quant_block_size": c.quant_block_size,
            "capacity": c.capacity,
            "threads": args.threads,
        }
        out["decode_ms_per_step"] = round(decode_ms(args.export, args.threads), 2)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
