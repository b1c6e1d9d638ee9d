"""llama.cpp's checkpoint converter (``convert_hf_to_gguf.py``) run on a Qwen3.5 checkpoint whose
tokenizer was trained locally (a script: ``python -P llamacpp_convert.py`` reads a JSON spec on stdin;
it runs in the converter's own virtual environment, where this project is not installed, so it
imports the standard library, transformers and the vendored converter only).
:func:`qwen35_onnx.bench.llamacpp.convert` runs it.

Why a wrapper: the converter identifies a BPE tokenizer's pre-tokenizer by hashing the ids it gives a
fixed text (``TextModel.get_vocab_base_pre``, llama.cpp PR 6920) and refuses any hash it does not
know. The ids depend on the vocabulary, so a tokenizer trained locally with Qwen3.5's exact
pre-tokenizer has an unknown hash although llama.cpp implements its pre-tokenizer (``qwen35``). This
script checks the pre-tokenizer itself instead: the ``Split`` regex in ``tokenizer.json`` must equal
transformers' Qwen3.5 ``PRETOKENIZE_REGEX``, the regex llama.cpp's ``qwen35`` pre-tokenizer ports
(``src/llama-vocab.cpp``); then the hash check answers ``qwen35`` for this tokenizer only (a known
hash keeps the converter's own answer). Any other regex is refused with both regexes named. The
bench then checks llama.cpp's token ids against transformers' on a sample text
(:func:`qwen35_onnx.bench.llamacpp.check_tokenizer`).

Spec: ``{"source": vendored llama.cpp folder, "checkpoint": folder, "outfile": path, "outtype":
"bf16"|"f16"|..., "mmproj": bool, "no_mtp": bool}``.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "qwen35"
"""llama.cpp's name for Qwen3.5's pre-tokenizer (``tokenizer.ggml.pre``)."""


def split_regex(checkpoint: Path) -> str | None:
    """The pattern of the ``Split`` pre-tokenizer in the checkpoint's ``tokenizer.json`` (None: none)."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    for step in spec.get("pretokenizers", [spec]):
        if step.get("type") == "Split":
            return step.get("pattern", {}).get("Regex")
    return None


def check_pre_tokenizer(checkpoint: Path) -> None:
    """Raise SystemExit naming both regexes unless the checkpoint's pre-tokenizer is Qwen3.5's."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    found = split_regex(checkpoint)
    if found != PRETOKENIZE_REGEX:
        raise SystemExit(
            f"{checkpoint}/tokenizer.json: pre-tokenizer regex {found!r} is not Qwen3.5's {PRETOKENIZE_REGEX!r}; "
            f"llama.cpp's {PRE_TOKENIZER!r} pre-tokenizer would split text differently"
        )


def main(spec: dict) -> None:
    source, checkpoint = Path(spec["source"]), Path(spec["checkpoint"])
    check_pre_tokenizer(checkpoint)
    sys.path.insert(0, str(source))
    import conversion.base as base

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # an unknown hash: the regex was checked above
            return PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    argv = [str(checkpoint), "--outfile", spec["outfile"], "--outtype", spec["outtype"]]
    argv += ["--mmproj"] if spec.get("mmproj") else []
    argv += ["--no-mtp"] if spec.get("no_mtp") and not spec.get("mmproj") else []
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()))
