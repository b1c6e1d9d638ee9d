"""Memory-bounded export: the exporter traces an empty model and reads each checkpoint tensor
only while it writes it, so at no time does it hold more than a few tensors' worth of weights
(Qwen3.5-4B: 9.1 GB of bf16 weights, 18 GB in fp32)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from qwen35_onnx.export import weight_source
from qwen35_onnx.export.exporter import export
from qwen35_onnx.export.options import ExportError, ExportOptions

from .conftest import CAPACITY, IMAGE_TOKENS


class _Tracker:
    """Wraps ``CheckpointWeights.tensor``: counts reads and the bytes of checkpoint tensors
    alive at once (weak references: a tensor counts until it is garbage)."""

    def __init__(self, monkeypatch):
        self.reads: dict[str, int] = {}
        self.alive: dict[int, int] = {}
        self.peak = 0
        original = weight_source.CheckpointWeights.tensor
        tracker = self

        def tensor(source, name):
            value = original(source, name)
            tracker.reads[name] = tracker.reads.get(name, 0) + 1
            key = id(value)
            tracker.alive[key] = value.numel() * value.element_size()
            weakref.finalize(value, tracker.alive.pop, key, None)
            tracker.peak = max(tracker.peak, sum(tracker.alive.values()))
            return value

        monkeypatch.setattr(weight_source.CheckpointWeights, "tensor", tensor)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_export_holds_one_tensor_at_a_time(checkpoint, tmp_path, monkeypatch, quantize):
    """Three text graphs (two buckets and decode) and vision: every checkpoint tensor of 64 KiB
    or more is read once for the whole export (a graph that needs it again reuses what was
    written; onnxscript's optimizer reads some small ones again to fold them), the bytes read
    are at most 1.1x the checkpoint's, and the checkpoint tensors alive at once never exceed
    twice the largest tensor (a merged projection reads its parts together). (An fp32 KV cache: an int8 one's
    calibration reads the text weights once more, one decoder layer at a time: tests/test_kv_dtype.py.)"""
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    nbytes = {k: int(np.prod(shape)) * 4 for k, shape in sizes.items()}
    tracker = _Tracker(monkeypatch)
    export(
        checkpoint,
        tmp_path / "out",
        ExportOptions(
            capacity=CAPACITY,
            image_tokens=IMAGE_TOKENS,
            prefill_buckets=(64, CAPACITY),
            quantize=quantize,
            kv_dtype="fp32",
        ),
    )
    assert set(tracker.reads) == set(nbytes)  # every tensor of the checkpoint is used
    repeated = {k: n for k, n in tracker.reads.items() if n > 1 and nbytes[k] >= 64 * 1024}
    assert not repeated, repeated
    assert sum(n * nbytes[k] for k, n in tracker.reads.items()) <= 1.1 * sum(nbytes.values())
    largest = max(nbytes.values())
    assert tracker.peak <= 2 * largest, (tracker.peak, largest, sum(nbytes.values()))
    assert tracker.peak < sum(nbytes.values()) / 4


def test_empty_model_is_not_resident():
    """The empty model of the 4B preset (18 GB of fp32 parameters) takes no resident memory:
    its parameters are allocated but never written."""
    from qwen35_onnx.presets import preset_config

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    before = rss()
    model = weight_source.empty_model(preset_config("qwen3.5-4b"), torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 17e9
    assert rss() - before < 1e9


def test_missing_or_misshapen_tensor_is_a_clear_error(checkpoint, tmp_path):
    """A checkpoint without a tensor the config needs, or with another shape, fails the export
    with the tensor's name, and leaves no output folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    # a vision tensor: the vision graph is exported first, so the export fails before tracing any other
    name = next(k for k in weights if k.startswith("model.visual.") and k.endswith("mlp.linear_fc2.weight"))
    for broken, what in (
        ({k: v for k, v in weights.items() if k != name}, "has no tensor"),
        ({**weights, name: weights[name][:, :-1].contiguous()}, "has shape"),
    ):
        folder = tmp_path / "ckpt"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(checkpoint, folder)
        save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ExportError, match=what) as info:
            export(
                folder, tmp_path / "out", ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS, component="all")
            )
        assert name in str(info.value)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
