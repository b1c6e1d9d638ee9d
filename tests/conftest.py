"""Shared fixtures: the demo checkpoint and its exports, built once per test session.

Exports use a small capacity (CAPACITY tokens) so that the suite stays fast; everything
else is the real flow (`from_pretrained` on a local folder, `torch.onnx.export`, ORT).
"""

from __future__ import annotations

from pathlib import Path

import pytest

CAPACITY = 128
MAX_NEW_TOKENS = 40
PROMPT = "Describe this image."


@pytest.fixture(scope="session", autouse=True)
def prepacked_cache_dir(tmp_path_factory) -> Path:
    """ONNX Runtime's pre-packed weights caches of this session's exports go to a temporary folder
    (``QWEN35_ONNX_PREPACKED_CACHE``, inherited by subprocesses), not the user's cache."""
    import os

    folder = tmp_path_factory.mktemp("ort-prepacked")
    before = os.environ.get("QWEN35_ONNX_PREPACKED_CACHE")
    os.environ["QWEN35_ONNX_PREPACKED_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("QWEN35_ONNX_PREPACKED_CACHE", None)
    else:
        os.environ["QWEN35_ONNX_PREPACKED_CACHE"] = before


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from qwen35_onnx.checkpoints import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo")


@pytest.fixture(scope="session")
def photo() -> Path:
    from qwen35_onnx.checkpoints import photo_path

    return photo_path()


def export_to(checkpoint: Path, out: Path, **options) -> Path:
    """Export with capacity CAPACITY and ``options``; returns ``out``."""
    from qwen35_onnx.export.exporter import ExportOptions, export

    export(checkpoint, out, ExportOptions(capacity=CAPACITY, **options))
    return out


@pytest.fixture(scope="session")
def wide_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The demo architecture widened to 214 MB of fp32 text weights (hidden 512, MLP 4096, tied
    embeddings as in the published Qwen3.5-0.8B): weights large enough to measure their memory."""
    import shutil

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("ckpt") / "wide"
    shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("model*.safetensors*", "config.json"))
    config = Qwen3_5Config.from_pretrained(checkpoint)
    config.text_config.hidden_size = config.vision_config.out_hidden_size = 512
    config.text_config.intermediate_size = 4096
    config.text_config.initializer_range = 0.02
    config.text_config.tie_word_embeddings = config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def fixed_export(checkpoint, tmp_path_factory) -> Path:
    """Portable operators (the default --ops ort has its own fixture in test_fused_and_quantized)."""
    return export_to(checkpoint, tmp_path_factory.mktemp("exp") / "fixed", kv_mode="fixed", ops="portable")


@pytest.fixture(scope="session")
def dynamic_export(checkpoint, tmp_path_factory) -> Path:
    return export_to(checkpoint, tmp_path_factory.mktemp("exp") / "dynamic", kv_mode="dynamic", ops="portable")


@pytest.fixture(scope="session")
def small_export(checkpoint, tmp_path_factory) -> Path:
    """Half the capacity of `fixed_export` (to mix graphs of different capacities)."""
    from qwen35_onnx.export.exporter import ExportOptions, export

    out = tmp_path_factory.mktemp("exp") / "small"
    export(checkpoint, out, ExportOptions(capacity=CAPACITY // 2, ops="portable"))
    return out


@pytest.fixture(scope="session")
def reference_model(checkpoint):
    from qwen35_onnx.verify import load_reference

    return load_reference(checkpoint)


@pytest.fixture(scope="session")
def reference_tokens(fixed_export, reference_model, photo) -> list[int]:
    """Greedy transformers tokens for the demo prompt (shared by all parity tests)."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import reference_generate

    pipe = Pipeline.from_exported(fixed_export)
    prepared = pipe.prepare(photo, PROMPT)
    c = pipe.contract
    return reference_generate(reference_model, prepared, c.grid_thw, MAX_NEW_TOKENS, c.eos_token_ids)


@pytest.fixture(scope="session")
def trained_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The demo checkpoint after 200 training steps, trained once per session for the quantization
    and the OpenVINO bf16 tests: random weights are a chaotic worst case for anything that
    perturbs the computation (quantization, bf16), see ``checkpoints.train_checkpoint``."""
    from qwen35_onnx.checkpoints import train_checkpoint

    return train_checkpoint(checkpoint, tmp_path_factory.mktemp("ckpt") / "trained", steps=200)


@pytest.fixture(scope="session")
def trained_export(trained_checkpoint, tmp_path_factory):
    """``trained_export(ops, dtype="fp32", **options) -> Path``: an export of the trained demo
    checkpoint with one prefill bucket of CAPACITY tokens, built on first request and shared by
    every test of the session (the quantization, dtype and OpenVINO tests compare the same
    exports)."""
    root = tmp_path_factory.mktemp("trained-exports")
    built: dict[tuple, Path] = {}

    def get(ops: str, dtype: str = "fp32", **options) -> Path:
        key = (ops, dtype, *sorted(options.items()))
        if key not in built:
            name = "-".join([ops, dtype] + [f"{k}-{v}" for k, v in sorted(options.items())])
            built[key] = export_to(trained_checkpoint, root / name, ops=ops, dtype=dtype,
                                   prefill_buckets=(CAPACITY,), **options)
        return built[key]

    return get


def random_prompt(pipe, length: int, seed: int):
    """[1, length] token ids of ordinary (non-special, non-image) tokens of ``pipe``'s tokenizer."""
    import numpy as np

    specials = set(pipe.preprocessor.tokenizer.all_special_ids) | {pipe.contract.image_token_id}
    pool = np.array([t for t in range(pipe.contract.vocab_size) if t not in specials])
    return np.random.default_rng(seed).choice(pool, size=(1, length))


def forced_logits(pipe, prepared, tokens: list[int]) -> list:
    """The logits ``[V]`` (fp64 copies) ``pipe`` gives before each of ``tokens`` when they are fed
    one after another (teacher forcing through the pipeline's own decode loop): entry ``i`` is
    the prediction for ``tokens[i]`` after the prompt and ``tokens[:i]``."""
    import numpy as np

    from qwen35_onnx.pipeline import GenerationStream
    from qwen35_onnx.runtime.sampling import StopStrings

    seen = []

    def sampler(logits):
        seen.append(np.array(logits, dtype=np.float64))
        return tokens[len(seen) - 1]

    for _ in pipe._generate(prepared, len(tokens), sampler, StopStrings(()), GenerationStream()):
        pass
    return seen


def split_margin(pipe, prepared, tokens: list[int], other: list[int]) -> tuple[int, float]:
    """Where two greedy runs part and how close a call it was for ``pipe``: ``(i, margin)`` with
    ``i`` the first index where ``tokens`` (``pipe``'s greedy tokens) and ``other`` differ and
    ``margin`` = ``pipe``'s logit of ``tokens[i]`` minus its logit of ``other[i]`` there (>= 0; a
    near tie is a margin that is small next to the logits' spread); ``(len, inf)`` when they agree."""
    i = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), None)
    if i is None:
        return min(len(tokens), len(other)), float("inf")
    logits = forced_logits(pipe, prepared, tokens[: i + 1])[i]
    return i, float(logits[tokens[i]] - logits[other[i]])
