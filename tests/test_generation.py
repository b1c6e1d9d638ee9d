"""The one decode loop (runtime/generation.py) on a backend that records what it is asked to run:
the mask and positions each step feeds, the capacity, the checks before any graph, the timings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qwen35_onnx.contract import ContractError, KvMode, ShapeContract
from qwen35_onnx.runtime.backend import Backend
from qwen35_onnx.runtime.generation import Generation
from qwen35_onnx.runtime.masks import CapacityExhausted
from qwen35_onnx.runtime.prompt import prepare_ids

VOCAB = 16


def contract(capacity: int = 12, kv_mode: KvMode = KvMode.FIXED, buckets: tuple[int, ...] = (4, 8)) -> ShapeContract:
    """A small contract (one Gated DeltaNet and one full-attention layer, no real graph behind it)."""
    # fmt: off
    c = ShapeContract(
        capacity=capacity, kv_mode=kv_mode, dtype="fp32", batch=1, image_tokens=1, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, image_embed_dim=8, min_pixels=1024, max_pixels=4096, pos_embed_side=2,
        hidden_size=8, vocab_size=VOCAB,
        layer_types=("linear_attention", "full_attention"), conv_dim=6, conv_kernel=4, linear_num_value_heads=1,
        linear_key_head_dim=2, linear_value_head_dim=2, num_key_value_heads=1, head_dim=2, chunk_size=4,
        prefill_buckets=buckets if kv_mode == KvMode.FIXED else (), prefill_logits="last", ops="portable",
        quantize="none", quant_block_size=32, image_token_id=15, vision_start_token_id=13, vision_end_token_id=14,
        eos_token_ids=(12,), pad_token_id=0, exporter_version="test",
    )
    # fmt: on
    c.validate()
    return c


class Recorder(Backend):
    """A backend whose graphs return fixed logits and record their inputs."""

    runtime, device, precision, host_state_roundtrip = "onnxruntime", "cpu", "f32", False

    def __init__(self, contract: ShapeContract, kv_width: int | None = None, logits: float = 0.0):
        self.contract, self.kv_width, self.logits = contract, kv_width, logits
        self.loaded, self.prefills, self.steps = [], [], []

    def load_prefill(self, bucket):
        self.loaded.append(bucket)

    def _run_vision(self, graph, feeds):
        raise AssertionError("no image in these prompts")

    def run_chunk(self, size, feeds, states):
        raise AssertionError("these exports have no prefill chunks")

    def states_to_host(self, states, kv_length=None):
        raise AssertionError("no snapshots in these tests")

    states_from_host = states_to_host

    def run_prefill(self, bucket, feeds):
        self.prefills.append((bucket, {k: v.copy() for k, v in feeds.items()}))
        width = self.kv_width or (self.contract.capacity if self.contract.kv_mode == KvMode.FIXED else bucket)
        kv = np.zeros(self.contract.kv_shape(width), dtype=np.float32)
        return np.full((1, 1, VOCAB), self.logits, dtype=np.float32), {"present_kv_cache": kv}

    def decoder(self, states):
        recorder = self

        class Step:
            def step(self, input_ids, attention_mask, position_ids):
                recorder.steps.append((input_ids.copy(), attention_mask.copy(), position_ids.copy()))
                return np.full((1, 1, VOCAB), recorder.logits, dtype=np.float32)

        return Step()

    @staticmethod
    def state_shape(value):
        return list(value.shape)


def prompt(c: ShapeContract, length: int):
    return prepare_ids(c, np.arange(1, length + 1).reshape(1, -1) % 10)


def test_each_step_claims_the_next_slot_and_feeds_its_positions():
    c = contract()
    backend = Recorder(c)
    generation = Generation(backend, prompt(c, 5))
    assert backend.loaded == [8] and not backend.prefills  # loaded and checked, nothing run yet
    generation.prefill()
    ((bucket, feeds),) = backend.prefills
    assert bucket == 8 and feeds["attention_mask"].tolist() == [[1] * 5 + [0] * 3]
    for step, token in enumerate((7, 3, 9)):
        assert generation.length == 5 + step
        generation.step(token)
        ids, mask, positions = backend.steps[-1]
        assert ids.tolist() == [[token]]
        assert mask.shape == (1, c.capacity) and mask.sum() == 6 + step and mask[0, : 6 + step].all()
        assert positions.reshape(-1).tolist() == [5 + step] * 4  # text-only: rope_deltas 0
    assert generation.timings.decode_steps == 3 and generation.timings.vision_ms is None


def test_capacity_is_exhausted_without_running_a_step():
    c = contract(capacity=8)
    backend = Recorder(c)
    generation = Generation(backend, prompt(c, 6))
    generation.prefill()
    generation.step(1)
    generation.step(2)  # slots 6 and 7: the cache is full
    with pytest.raises(CapacityExhausted, match="next token needs slot 8 but capacity is 8"):
        generation.step(3)
    assert len(backend.steps) == 2


def test_dynamic_mode_appends_a_mask_column_per_step():
    c = contract(kv_mode=KvMode.DYNAMIC)
    backend = Recorder(c)
    generation = Generation(backend, prompt(c, 3))  # padded to the chunk size, 4
    generation.prefill()
    generation.step(1)
    generation.step(2)
    assert [mask.shape[1] for _, mask, _ in backend.steps] == [5, 6]
    assert backend.steps[-1][1].tolist() == [[1, 1, 1, 0, 1, 1]]


def test_order_of_use_and_bad_states_are_refused():
    c = contract()
    generation = Generation(Recorder(c), prompt(c, 3))
    with pytest.raises(RuntimeError, match="prefill before the first decode step"):
        generation.step(1)
    generation.prefill()
    with pytest.raises(RuntimeError, match="prefilled already"):
        generation.prefill()
    with pytest.raises(ValueError, match="prefill KV width 6 != decode capacity 12"):
        Generation(Recorder(c, kv_width=6), prompt(c, 3)).prefill()


def test_states_of_another_generation_continue_without_a_prefill():
    c = contract()
    first = Recorder(c)
    source = Generation(first, prompt(c, 4))
    source.prefill()
    second = Recorder(c)
    generation = Generation(second, prompt(c, 4), states=source.states)
    assert not second.loaded and not second.prefills
    generation.step(5)
    assert second.steps[0][1].sum() == 5


def test_non_finite_logits_are_an_error_naming_the_step():
    c = contract()
    generation = Generation(Recorder(c, logits=np.nan), prompt(c, 3))
    with pytest.raises(ContractError, match="the prefill logits are not finite"):
        generation.prefill()


def test_a_bad_prompt_mask_is_refused_before_any_graph_runs(monkeypatch):
    c = contract()
    p = prompt(c, 5)
    ids, mask, positions = p.padded(c.pad_token_id)
    mask[0, 2] = 0
    monkeypatch.setattr(p, "padded", lambda pad: (ids, mask, positions))
    backend = Recorder(c)
    with pytest.raises(ValueError, match="contiguous prefix of ones"):
        Generation(backend, p)
    assert not backend.prefills


def test_contract_modes_are_plain_strings_in_the_manifest_and_enums_in_memory():
    import json

    c = contract()
    data = json.loads(c.to_json())
    assert (data["kv_mode"], data["ops"], data["dtype"]) == ("fixed", "portable", "fp32")
    again = ShapeContract.from_json(c.to_json())
    assert again == c and isinstance(again.kv_mode, KvMode)
    other = dataclasses.replace(again, ops="ort")
    assert again.same_shapes(other) == ["ops: 'portable' != 'ort'"]
    with pytest.raises(ContractError, match="kv_mode 'paged' is not one of fixed, dynamic"):
        ShapeContract.from_dict({**data, "kv_mode": "paged"})
