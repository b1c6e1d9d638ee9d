"""KV width tiers (``--kv-tiers``) of portable exports: a sequence's KV cache held at the smallest of a few widths
that holds it and moved up when it fills, so that a step costs the width in use, not the capacity. Greedy tokens
equal to transformers across tier moves on ONNX Runtime and OpenVINO, a chat continued from a kept state across a
move, decode slots at the width of the widest sequence, the graphs' symbolic width and its checks, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qwen35_onnx.contract import (
    KV_WIDTH,
    ContractError,
    KvMode,
    Ops,
    ShapeContract,
    default_kv_tiers,
    read_manifest,
)
from qwen35_onnx.export.options import ExportError, ExportOptions
from qwen35_onnx.runtime.checks import check_decode
from qwen35_onnx.runtime.generation import Generation
from qwen35_onnx.runtime.masks import CapacityExhausted
from qwen35_onnx.runtime.sampling import SamplingConfig

from .conftest import CAPACITY, random_prompt, shared_export
from .test_generation import Recorder, contract, prompt

TIERS = (32, 64, CAPACITY)
CHUNKS = (8, 32)
GREEDY = SamplingConfig()
RUNTIMES = ["onnxruntime", "openvino"]


@pytest.fixture(scope="session")
def tiered_export(checkpoint, tmp_path_factory):
    """The demo checkpoint, portable operators, capacity 128 at KV tiers 32, 64 and 128, prefill chunks 8 and 32, two
    decode slots (a generation alone runs in the slot pool too: one export for every test here)."""
    options = {"ops": "portable", "kv_tiers": TIERS[:-1], "prefill_chunks": CHUNKS, "slots": 2}
    return shared_export(tmp_path_factory, checkpoint, "tiered", **options)


class MoveSpy:
    """Records each move of a generation to another KV tier: ``(tokens held, from width, to width)``."""

    def __init__(self, monkeypatch):
        self.moves: list[tuple[int, int, int]] = []
        move = Generation._move_to

        def spy(generation, width):
            self.moves.append((generation.length, generation.width, width))
            return move(generation, width)

        monkeypatch.setattr(Generation, "_move_to", spy)


# ---- the option and the contract -------------------------------------------------------------------------
def test_default_tiers_follow_the_operators_and_the_kv_cache():
    assert default_kv_tiers(65536, Ops.PORTABLE, KvMode.FIXED) == (2048, 8192, 32768, 65536)
    assert default_kv_tiers(4096, Ops.PORTABLE, KvMode.FIXED) == (2048, 4096)
    assert default_kv_tiers(2048, Ops.PORTABLE, KvMode.FIXED) == (2048,)
    assert default_kv_tiers(65536, Ops.ORT, KvMode.FIXED) == (65536,)
    assert default_kv_tiers(65536, Ops.PORTABLE, KvMode.DYNAMIC) == (65536,)
    assert ExportOptions(ops="portable").tiers == (2048, 8192, 32768, 65536)
    assert ExportOptions().tiers == (65536,)  # --ops ort: one width
    assert ExportOptions(ops="portable", kv_tiers=()).tiers == (65536,)  # --kv-tiers none
    assert ExportOptions(ops="portable", capacity=128, kv_tiers=(32, 64)).tiers == TIERS  # the capacity added
    assert ExportOptions(ops="portable", capacity=128, kv_tiers=TIERS).tiers == TIERS
    assert ExportOptions(ops="ort", kv_tiers=(65536,)).contract_values()["kv_tiers"] == (65536,)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_tiers=(64, 32)), r"--kv-tiers: KV tiers must be strictly increasing, got 32 after 64"),
        (dict(kv_tiers=(32, 256)), r"--kv-tiers: KV tier 256 is above the capacity 128"),
        (dict(kv_tiers=(16,)), r"--kv-tiers: KV tier 16 must be a multiple of 32 tokens \(at least 32\)"),
        (dict(kv_tiers=(48,)), r"--kv-tiers: KV tier 48 must be a multiple of 32 tokens"),
        (dict(kv_tiers=(32, "x")), r"--kv-tiers: KV tier 'x' must be an integer"),
        (dict(kv_tiers="32"), r"--kv-tiers '32' must be a list of widths in tokens, or none"),
        (dict(kv_tiers=(32, 64), ops="ort"), r"--kv-tiers 32,64,128 needs --ops portable: with --ops ort .* one width"),
        (
            dict(kv_tiers=(32, 64), kv_mode="dynamic", prefill_chunks=()),
            r"--kv-tiers 32,64,128 needs --kv-cache fixed: a dynamic KV cache grows by one token a step already",
        ),
    ],
)
def test_bad_tiers_are_one_clear_error(options, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions(**{"capacity": CAPACITY, "ops": "portable", **options}).validate()


def test_a_bad_tiers_value_on_the_command_line_is_one_error_line():
    from typer.testing import CliRunner

    from qwen35_onnx.cli import app

    result = CliRunner().invoke(app, ["export", "--model-id", "m", "--output-dir", "o", "--kv-tiers", "2048,8k"])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --kv-tiers '2048,8k' must be comma-separated integers, e.g. 2048,8192,32768, or none"
    )


def test_manifests_without_tiers_hold_one_width_and_tiers_round_trip():
    c = contract(capacity=CAPACITY, buckets=(32, CAPACITY))
    data = c.to_dict()
    assert data["kv_tiers"] == [CAPACITY] and not c.tiered and c.kv_width_dim == CAPACITY
    del data["kv_tiers"]  # a manifest written before 0.15.0
    assert ShapeContract.from_dict(data).kv_tiers == (CAPACITY,)
    tiered = ShapeContract.from_dict({**data, "kv_tiers": list(TIERS)})
    assert tiered.tiered and tiered.kv_width_dim == KV_WIDTH and ShapeContract.from_json(tiered.to_json()) == tiered
    assert [tiered.tier_for(n) for n in (1, 32, 33, 100)] == [32, 32, 64, 128]
    assert tiered.prefill_kv_width(32) == 32 and c.prefill_kv_width(32) == CAPACITY
    assert tiered.same_shapes(c) == ["kv_tiers: (32, 64, 128) != (128,)"]
    with pytest.raises(ContractError, match="the last KV tier 64 must be the capacity 128"):
        ShapeContract.from_dict({**data, "kv_tiers": [32, 64]})
    with pytest.raises(ContractError, match="KV tiers 32,64,128 need ops portable"):
        ShapeContract.from_dict({**data, "kv_tiers": list(TIERS), "ops": "ort"})


# ---- the generation on a backend that records its runs (no graph) ---------------------------------------------
class TierRecorder(Recorder):
    """:class:`tests.test_generation.Recorder` whose prefill writes its KV at the bucket's tier (its cache the
    slot index + 1 in every used slot) and whose decoders record the width of the states they were built from."""

    def __init__(self, contract):
        from qwen35_onnx.runtime.kv_codec import KvCodec

        super().__init__(contract)
        self.decoders: list[int] = []
        self.kv_codec = KvCodec(contract)  # (no export folder behind it: an fp32 cache, nothing converted)

    def run_prefill(self, bucket, feeds):
        logits, _ = super().run_prefill(bucket, feeds)
        kv = np.zeros(self.contract.kv_shape(self.contract.prefill_kv_width(bucket)), dtype=np.float32)
        kv[:, :, :, :bucket] = np.arange(1, bucket + 1, dtype=np.float32)[:, None]
        return logits, {"present_kv_cache": kv}

    def states_to_host(self, states, kv_length=None):
        return {name: np.array(value[:, :, :, :kv_length]) for name, value in states.items()}

    def states_from_host(self, arrays, kv_dtype=None, width=None):
        kv = np.zeros(self.contract.kv_shape(width), dtype=np.float32)
        kv[:, :, :, : arrays["present_kv_cache"].shape[3]] = arrays["present_kv_cache"]
        return {"present_kv_cache": kv}

    def decoder(self, states):
        self.decoders.append(states["present_kv_cache"].shape[3])
        self.kv = states["present_kv_cache"]
        step = super().decoder(states)
        step.states = lambda: states
        return step


def test_each_step_runs_at_the_smallest_tier_that_holds_it_and_moves_up_once_per_tier():
    c = dataclasses.replace(contract(capacity=CAPACITY, buckets=(32, CAPACITY)), kv_tiers=TIERS)
    c.validate()
    backend = TierRecorder(c)
    generation = Generation(backend, prompt(c, 30))
    assert generation.width == 32
    generation.prefill()
    for token in range(CAPACITY - 30):
        generation.step(token % 10)
    widths = [mask.shape[1] for _, mask, _ in backend.steps]
    assert widths == [c.tier_for(30 + i + 1) for i in range(CAPACITY - 30)]  # the tier of the slot it writes
    assert backend.decoders == [32, 64, 128] and generation.tier_moves == 2
    assert backend.kv[0, 0, 0, :30, 0].tolist() == list(range(1, 31))  # the prompt's KV slots moved with it
    with pytest.raises(CapacityExhausted, match="next token needs slot 128 but capacity is 128"):
        generation.step(1)
    with pytest.raises(ValueError, match="prefill KV width 48 is not one of the export's KV tiers 32,64,128"):
        generation = Generation(Recorder(c, kv_width=48), prompt(c, 30))
        generation.prefill()


# ---- exports: the graphs and their checks -------------------------------------------------------------------
@pytest.mark.slow
def test_tiered_graphs_take_the_kv_width_symbolic(tiered_export, fixed_export):
    """The decode and chunk graphs have one symbolic dimension, ``kv_width``, on the mask's width and the KV
    cache's token axis (their other dimensions static); the checks accept it only where the manifest lists tiers,
    and a static width only where it lists one."""
    from qwen35_onnx.runtime.backend import RuntimeOptions
    from qwen35_onnx.runtime.onnxruntime.sessions import OrtGraphSet

    contract = read_manifest(tiered_export)
    assert contract.kv_tiers == TIERS and contract.chunk_size == 64
    graphs = OrtGraphSet(tiered_export, contract, RuntimeOptions())
    for spec in (graphs.decode, graphs.chunk(8)):
        assert spec.inputs["attention_mask"][1] == KV_WIDTH
        assert spec.inputs["past_kv_cache"][3] == spec.outputs["present_kv_cache"][3] == KV_WIDTH
        symbolic = [d for shape in (*spec.inputs.values(), *spec.outputs.values()) for d in shape if isinstance(d, str)]
        assert set(symbolic) == {KV_WIDTH}
    with pytest.raises(ContractError, match="attention_mask width is symbolic .'kv_width'., which only an export"):
        check_decode(dataclasses.replace(contract, kv_tiers=(CAPACITY,)), graphs.decode)
    static = OrtGraphSet(fixed_export, read_manifest(fixed_export), RuntimeOptions()).decode
    with pytest.raises(ContractError, match="attention_mask width is 128 but manifest.json lists the KV tiers 32,64"):
        check_decode(dataclasses.replace(static.contract, kv_tiers=TIERS), static)


def test_a_bucket_prefill_writes_its_kv_at_the_smallest_tier_that_holds_it(fixed_export, reference_model):
    """The prefill graph module (torch) of a tiered export pads its KV output to the bucket's tier, not the capacity,
    with the same values as the capacity-wide one."""
    import torch

    from qwen35_onnx.export.graphs import PrefillGraph

    one = read_manifest(fixed_export)
    tiered = dataclasses.replace(one, kv_tiers=TIERS)
    outputs = {}
    for c in (one, tiered):
        ids = torch.arange(1, 34).view(1, -1)
        positions = torch.arange(33).view(1, 1, -1).expand(4, 1, 33)
        embeds = torch.zeros(c.n_image_rows, c.image_embed_dim)
        with torch.no_grad():
            outputs[c.tiered] = PrefillGraph(reference_model, c)(ids, torch.ones_like(ids), positions, embeds)
    assert outputs[True][3].shape[3] == 64 and outputs[False][3].shape[3] == CAPACITY
    assert torch.equal(outputs[True][3], outputs[False][3][:, :, :, :64])
    assert torch.equal(outputs[True][0], outputs[False][0])


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_states_move_to_a_wider_tier_with_one_copy(tiered_export, runtime):
    """``Backend.widen_states``: fresh buffers of the wider tier holding the conv and recurrent states and the KV
    slots in use (the rest zero), the states moved from left as they were."""
    from qwen35_onnx.pipeline import Pipeline

    backend = Pipeline.from_exported(tiered_export, runtime=runtime).backend
    states = backend.zero_states(32)
    views = backend.state_views(states)
    for i, view in enumerate(views.values()):
        view[...] = i + 1
    new = backend.widen_states(states, 64, 20)
    wide = backend.state_views(new)
    assert backend.state_shape(new["present_kv_cache"])[3] == 64
    assert (wide["present_conv_states"] == 1).all() and (wide["present_recurrent_states"] == 2).all()
    kv = wide["present_kv_cache"]
    assert kv.shape[3] == 64 and (kv[:, :, :, :20] == 3).all() and (kv[:, :, :, 20:] == 0).all()
    assert (views["present_kv_cache"] == 3).all()


# ---- parity across tier moves -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_tokens_across_two_tier_moves_match_transformers(tiered_export, reference_model, runtime, monkeypatch):
    """A 20-token prompt and 100 new tokens: prefilled at the 32-token tier, moved up to 64 and to 128 while it
    decodes (the slot pool with it, and back down to 32 when it ends), the tokens transformers gives."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import reference_generate_prepared

    spy = MoveSpy(monkeypatch)
    pipe = Pipeline.from_exported(tiered_export, runtime=runtime)
    prepared = pipe.prepare_ids(random_prompt(pipe, 20, seed=20))
    result = pipe.generate_prepared(prepared, 100, GREEDY)
    expected = reference_generate_prepared(reference_model, prepared, 100, pipe.contract.eos_token_ids)
    assert result.token_ids == expected and len(expected) == 100
    assert spy.moves == [(32, 32, 64), (64, 64, 128)]
    assert pipe.slot_pool.resizes == 3 and pipe.slot_pool.width == 32  # up twice, down once
    if runtime == "openvino":
        assert pipe.backend.graphs.decode.dynamic  # one compile of the decode graph for every tier


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_decode_step_at_a_small_tier_reads_only_that_tier(tiered_export, runtime):
    """The decoder's bound state and mask tensors are the tier's width: 32 tokens after a short prompt, 64 after
    the move up, and never the capacity."""
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(tiered_export, runtime=runtime)
    generation = pipe.generation(pipe.prepare_ids(random_prompt(pipe, 10, seed=1)))
    generation.prefill()

    def widths() -> set[int]:
        decoder = pipe.slot_pool.decoder
        if runtime == "onnxruntime":
            kv = [buffers["present_kv_cache"].shape()[3] for buffers in decoder.buffers]
            return {*kv, *(host["attention_mask"].shape[1] for host in decoder.hosts.values())}
        names = ("attention_mask", "past_kv_cache", "present_kv_cache")
        return {
            request.get_tensor(n).shape[1 if n == "attention_mask" else 3]
            for request in decoder.requests
            for n in names
        }

    for _ in range(22):  # up to 32 tokens
        generation.step(5)
    assert widths() == {32} and generation.length == 32 == generation.width
    generation.step(5)
    assert widths() == {64} and generation.width == 64
    generation.close()


@pytest.mark.slow
def test_a_chat_continues_from_a_kept_state_across_a_tier_move(tiered_export, reference_model):
    """Turn 1 (11 tokens) decodes past the 32-token tier; its kept state, taken at the 64-token tier, starts turn 2
    (which moves up to 128): the same tokens as turn 2 prefilled from scratch, and as transformers."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.snapshots import StateSnapshot
    from qwen35_onnx.verify import reference_generate_prepared

    pipe = Pipeline.from_exported(tiered_export)
    pool, eos = pipe.slot_pool, pipe.contract.eos_token_ids
    first = pipe.prepare_ids(random_prompt(pipe, 11, seed=11))
    generation = Generation(pipe.backend, first, pool=pool)
    tokens = greedy(generation, 30, ())
    assert generation.width == 64 == pool.width and generation.tier_moves == 1
    kept = generation.snapshot()  # 40 tokens: the prompt and the replies fed
    generation.close()
    assert isinstance(kept, StateSnapshot) and kept.length == 40
    ids = np.concatenate([first.input_ids[0], tokens[:-1], random_prompt(pipe, 20, seed=3)[0]])[None]
    second = pipe.prepare_ids(ids)
    ours = {}
    for name, start in (("continued", kept), ("fresh", None)):
        g = Generation(pipe.backend, second, start=start, pool=pool)
        ours[name] = greedy(g, 40, eos)
        assert g.cached_tokens == (40 if start else 0) and g.tier_moves == 1 and g.width == CAPACITY
        g.close()
    assert ours["continued"] == ours["fresh"] == reference_generate_prepared(reference_model, second, 40, eos)
    assert len(ours["fresh"]) == 40  # (60 prompt tokens at the 64-token tier, moved up to 128)


def greedy(generation: Generation, n: int, eos) -> list[int]:
    """``n`` greedy tokens of ``generation`` (prefill and decode steps; fewer at one of ``eos``)."""
    tokens = [int(np.argmax(generation.prefill()))]
    while len(tokens) < n and tokens[-1] not in eos:
        tokens.append(int(np.argmax(generation.step(tokens[-1]))))
    return tokens


# ---- decode slots ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_long_and_a_short_request_together_get_their_own_tokens(tiered_export, runtime):
    """Two decode slots: a long request (30 prompt tokens, 60 new: up to the 128-token tier) and a short one (6 and
    10, which alone stays at 32) decoded together: each gets the tokens it gets alone (the short one's rows at the
    long one's width); the pool runs at the width of the widest sequence and moves down once the long one leaves."""
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(tiered_export, runtime=runtime)
    requests = [(random_prompt(pipe, 30, seed=30), 60), (random_prompt(pipe, 6, seed=6), 10)]
    requests = [(pipe.prepare_ids(ids), n) for ids, n in requests]
    alone = [pipe.generate_prepared(p, n, GREEDY).token_ids for p, n in requests]
    pool = pipe.slot_pool
    group = pipe.group()
    streams = [pipe.stream_prepared(p, n, GREEDY, group=group) for p, n in requests]
    widths = []
    while group.step():
        widths.append(pool.width)
    assert [s.result.token_ids for s in streams] == alone
    assert widths[:2] == [32, 32] and max(widths) == CAPACITY and pool.width == 32 and pool.busy == 0
