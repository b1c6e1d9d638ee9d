"""Chunked prefill continuing from a state, state snapshots and conversations that continue from
them (issue: prefill that costs what the prompt costs): tokens equal to transformers (a
from-scratch prefill) for prompts around the chunk size and up to the capacity, on ONNX Runtime
(both --ops) and OpenVINO; chats whose turns continue from kept states; a re-rendered history;
the state cache's byte limit; bad input."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from qwen35_onnx.contract import ContractError
from qwen35_onnx.export.options import ExportError, ExportOptions
from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.chunks import plan_chunks
from qwen35_onnx.runtime.sampling import SamplingConfig
from qwen35_onnx.runtime.snapshots import SnapshotCache, StateSnapshot
from qwen35_onnx.verify import chat_parity, reference_generate_prepared

from .conftest import IMAGE_CAPACITY as CHUNK_CAPACITY
from .conftest import PREFILL_CHUNKS as CHUNKS
from .conftest import random_prompt

CHUNK = CHUNKS[-1]  # 32
NEW_TOKENS = 32
GREEDY = SamplingConfig()
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="session")
def chunk_export(image_exports):
    """``chunk_export(ops)``: capacity 256, chunks 8 and 32, two images of up to 96 tokens per prompt;
    ``--ops ort`` with the any-grid vision graph, ``--ops portable`` with static grids, the photo's
    among them (OpenVINO runs it). Conftest's image exports, shared with tests/test_vision_grids.py
    (whose tests do not depend on the prefill form, nor these on the image budget)."""
    return lambda ops: image_exports("any-ort" if ops == "ort" else "static")


@pytest.mark.slow
@pytest.mark.parametrize("runtime_ops", ["onnxruntime-ort", "onnxruntime-portable", "openvino-portable"])
def test_prompt_lengths_around_the_chunk_match_transformers(chunk_export, reference_model, runtime_ops):
    """1, C-1, C, C+1, 3C+5 tokens and a prompt that fills the capacity but for the new tokens: greedy
    tokens equal to transformers' (which prefills from scratch)."""
    runtime, ops = runtime_ops.split("-")
    pipe = Pipeline.from_exported(chunk_export(ops), runtime=runtime)
    lengths = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, CHUNK_CAPACITY - NEW_TOKENS]
    if runtime == "openvino":
        lengths = [1, CHUNK + 1, 3 * CHUNK + 5]
    for length in lengths:
        prepared = pipe.prepare_ids(random_prompt(pipe, length, seed=length))
        ours = pipe.generate_prepared(prepared, NEW_TOKENS, GREEDY).token_ids
        theirs = reference_generate_prepared(reference_model, prepared, NEW_TOKENS, pipe.contract.eos_token_ids)
        assert ours == theirs, f"{length} tokens"
    assert sorted(pipe.backend.graphs.loaded_chunks) == sorted(CHUNKS)
    assert pipe.backend.graphs.loaded_buckets == []  # chunked exports prefill in chunks only


def _landscape() -> Image.Image:
    """A 3:2 noise picture below the processor's minimum pixels: 14 x 20 patches, 70 tokens. (A 480 x 320
    one takes the whole budget of 96 tokens, and the fourth turn's prompt 259 tokens, over the capacity of
    256; with this one it is 234 tokens, and the 6 new tokens fit.)"""
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("runtime_ops", ["onnxruntime-ort", "onnxruntime-portable", "openvino-portable"])
def test_four_turn_chat_with_images_continues_from_snapshots(
    chunk_export, checkpoint, reference_model, photo, runtime_ops
):
    """Images in turns 1 and 3; each turn through a state cache gives the tokens of the same turn
    prefilled from scratch, takes its first tokens from a kept state from turn 2 on, and the last
    turn equals transformers on the raw images."""
    runtime, ops = runtime_ops.split("-")
    pipe = Pipeline.from_exported(chunk_export(ops), runtime=runtime)
    cache = pipe.state_cache(64 << 20)
    second = photo if ops == "portable" else _landscape()  # portable: the static grids (the photo's among them)
    turns = [
        [{"type": "image", "image": photo}, {"type": "text", "text": "What is this?"}],
        "Tell me more.",
        [{"type": "image", "image": second}, {"type": "text", "text": "And this one?"}],
        "Compare them.",
    ]
    messages = [{"role": "system", "content": "You describe images."}]
    for i, content in enumerate(turns):
        messages.append({"role": "user", "content": content})
        fresh = pipe.chat(messages, 6, GREEDY, chat_template_kwargs=NO_THINKING)
        kept = pipe.chat(messages, 6, GREEDY, chat_template_kwargs=NO_THINKING, state_cache=cache)
        assert kept.generation.token_ids == fresh.generation.token_ids, f"turn {i + 1}"
        assert fresh.generation.cached_tokens == 0
        if i:
            assert kept.generation.cached_tokens > 0, f"turn {i + 1} prefilled its whole history again"
            assert kept.generation.cached_tokens < kept.prompt_tokens
        assert cache.nbytes <= cache.max_bytes
        messages.append({"role": "assistant", "content": kept.content})
    messages.pop()
    parity = chat_parity(
        pipe, checkpoint, messages, 6, model=reference_model, chat_template_kwargs=NO_THINKING, result=kept.generation
    )
    assert parity.ours == parity.reference
    assert cache.stats()["hits"] == 3


@pytest.mark.slow
def test_rerendered_history_is_not_continued_past_the_difference(chunk_export):
    """The template drops an earlier reply's reasoning (thinking on), and a client may send back a
    reply other than the one generated: the state is continued only up to where the new prompt's ids
    first differ from a kept state's, and the tokens equal a from-scratch prefill."""
    pipe = Pipeline.from_exported(chunk_export("ort"))
    cache = pipe.state_cache(64 << 20)
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    first = pipe.chat(messages, 8, GREEDY, state_cache=cache)  # thinking on: the reply is reasoning
    prompt = pipe.prepare_chat(messages)
    history = max(prompt.snapshot_points)
    held = np.concatenate([prompt.input_ids[0], first.generation.token_ids[:-1]])  # the last state kept
    assert 0 < history < first.prompt_tokens
    for reply in (first.generation.text, "Something else entirely."):
        turn = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
        prepared = pipe.prepare_chat(turn)
        fresh = pipe.chat(turn, 8, GREEDY)
        kept = pipe.chat(turn, 8, GREEDY, state_cache=cache)
        assert kept.generation.token_ids == fresh.generation.token_ids
        cached = kept.generation.cached_tokens
        assert cached >= history, "the history before the first reply was not reused"
        assert np.array_equal(prepared.input_ids[0, :cached], held[:cached])


@pytest.mark.slow
def test_state_cache_keeps_to_its_byte_limit_and_shares_a_system_prompt(chunk_export):
    """Two conversations with the same system prompt share its kept state; a cache smaller than a
    few snapshots drops the least recently used and never holds more than its limit."""
    pipe = Pipeline.from_exported(chunk_export("ort"))
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 3}
    cache = pipe.state_cache(64 << 20)
    first = [system, {"role": "user", "content": "What is one plus one?"}]
    pipe.chat(first, 4, GREEDY, chat_template_kwargs=NO_THINKING, state_cache=cache)
    second = [system, {"role": "user", "content": "Name a colour."}]
    fresh = pipe.chat(second, 4, GREEDY, chat_template_kwargs=NO_THINKING)
    kept = pipe.chat(second, 4, GREEDY, chat_template_kwargs=NO_THINKING, state_cache=cache)
    a, b = (pipe.prepare_chat(m, NO_THINKING).input_ids[0] for m in (first, second))
    common = int(np.argmax(a[: len(b)] != b[: len(a)]))
    assert 0 < kept.generation.cached_tokens <= common  # the system prompt's state, nothing of the other question
    assert kept.generation.token_ids == fresh.generation.token_ids
    chats = [[{"role": "user", "content": question}] for question in ("a", "b", "c", "d")]
    everything = SnapshotCache(64 << 20)
    for chat in chats:
        pipe.chat(chat, 3, GREEDY, chat_template_kwargs=NO_THINKING, state_cache=everything)
    small = SnapshotCache(everything.nbytes // 2)
    for chat in chats:
        pipe.chat(chat, 3, GREEDY, chat_template_kwargs=NO_THINKING, state_cache=small)
        assert small.nbytes <= small.max_bytes
    assert 0 < len(small) < len(everything)


def test_bad_chunk_sizes_name_the_value_and_the_limit():
    for chunks, message in (((0,), ">= 2"), ((300,), "above the capacity 256"), ((64, 32), "strictly increasing")):
        with pytest.raises(ExportError, match=message):
            ExportOptions(capacity=256, prefill_chunks=chunks).validate()
    with pytest.raises(ExportError, match="prefills in chunks only"):
        ExportOptions(capacity=256, prefill_chunks=(32,), prefill_buckets=(256,)).validate()
    assert ExportOptions(capacity=256, prefill_chunks=(32,)).contract_values()["prefill_buckets"] == ()
    with pytest.raises(ExportError, match="fixed KV"):
        ExportOptions(capacity=256, kv_mode="dynamic", prefill_chunks=(32,), prefill_buckets=None).validate()


@pytest.mark.slow
def test_snapshot_of_another_export_or_capacity_and_a_tiny_cache_are_refused(chunk_export, chat_export):
    pipe = Pipeline.from_exported(chunk_export("ort"))
    prepared = pipe.prepare_ids(random_prompt(pipe, 20, seed=1))
    generation = pipe.generation(prepared)
    generation.prefill()
    snapshot = generation.snapshot()
    assert snapshot.length == 20
    longer = pipe.prepare_ids(np.concatenate([prepared.input_ids, random_prompt(pipe, 5, seed=2)], axis=1))
    from qwen35_onnx.runtime.generation import Generation

    Generation(pipe.backend, longer, start=snapshot)  # the same export: accepted
    other = dataclasses.replace(snapshot, export="0123456789abcdef")
    with pytest.raises(ContractError, match="another export.*0123456789abcdef"):
        Generation(pipe.backend, longer, start=other)
    with pytest.raises(ContractError, match="capacity 128 tokens; this export's capacity is 256"):
        Generation(pipe.backend, longer, start=dataclasses.replace(snapshot, capacity=128))
    with pytest.raises(ValueError, match="not a prefix"):
        Generation(pipe.backend, pipe.prepare_ids(random_prompt(pipe, 30, seed=3)), start=snapshot)
    with pytest.raises(ValueError, match="state cache limit 1000 bytes is below one state snapshot"):
        pipe.state_cache(1000)
    with pytest.raises(ValueError, match="positive number of bytes"):
        SnapshotCache(0)
    with pytest.raises(ContractError, match="no prefill chunks"):
        Pipeline.from_exported(chat_export).state_cache()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 300),
    start_frac=st.floats(0, 0.99),
    sizes=st.sets(st.integers(2, 80), min_size=1, max_size=3),
    room=st.integers(0, 90),
    image_at=st.one_of(st.none(), st.integers(0, 299)),
    cut_frac=st.one_of(st.none(), st.floats(0, 1)),
)
def test_chunk_plans_cover_the_prompt_within_the_capacity(n, start_frac, sizes, room, image_at, cut_frac):
    ids = np.full(n, 7)
    if image_at is not None and image_at < n:
        ids[image_at] = 99
    start = int(start_frac * n) if n > 1 else 0
    start = min(start, n - 1)
    capacity = n + room
    cuts = () if cut_frac is None else (start + int(cut_frac * (n - start)),)
    try:
        pieces = plan_chunks(ids, start, sorted(sizes), capacity, 99, cuts)
    except ValueError as exc:  # PromptTooLongError: only when an image token sits in an unfittable tail
        assert image_at is not None and "image token" in str(exc)
        return
    at = start
    for i, piece in enumerate(pieces):
        assert piece.start == at and piece.real >= 1
        assert piece.size == 1 or piece.size in sizes
        assert piece.start + max(piece.size, 1) <= capacity
        if piece.size == 1:
            assert ids[piece.start] != 99 and all(p.size == 1 for p in pieces[i:])
        elif piece.real < piece.size:
            assert piece.end in (n, *cuts)
        at = piece.end
    assert at == n
    for cut in cuts:
        if start < cut < n:
            assert any(p.end == cut for p in pieces)


def test_snapshot_cache_finds_the_longest_prefix_by_ids_and_images():
    def snap(ids, images=()):
        ids = np.asarray(ids, dtype=np.int64)
        return StateSnapshot("e", 64, ids, tuple(images), np.zeros(4), np.zeros(4), np.zeros((1, 1, 1, len(ids), 1)))

    cache = SnapshotCache(10_000)
    cache.put(snap([1, 2]))
    cache.put(snap([1, 2, 3, 4]))
    cache.put(snap([5, 9, 9], ["img-a"]))
    assert cache.longest_prefix("e", np.array([1, 2, 3, 4, 5]), ()).length == 4
    assert cache.longest_prefix("e", np.array([1, 2, 3, 7]), ()).length == 2
    assert cache.longest_prefix("e", np.array([1, 2, 3, 4]), ()).length == 2  # a whole prompt is never taken
    assert cache.longest_prefix("other", np.array([1, 2, 3, 4, 5]), ()) is None
    assert cache.longest_prefix("e", np.array([5, 9, 9, 1]), ["img-b"]) is None  # same ids, another image
    assert cache.longest_prefix("e", np.array([5, 9, 9, 1]), ["img-a"]).length == 3
    assert cache.stats()["hits"] == 4 and cache.stats()["misses"] == 2


@pytest.mark.slow
def test_openai_client_resending_a_conversation_gets_cached_tokens(chunk_export, tmp_path):
    """A live server with a small state cache: an OpenAI client that resends the whole conversation
    every turn gets the replies of a from-scratch prefill, ``usage.prompt_tokens_details.cached_tokens``
    > 0 from turn 2 on, and ``/health`` counts the hits and keeps the bytes within the limit."""
    import httpx
    import openai

    from .test_server import ServerProcess

    export = chunk_export("ort")
    pipe = Pipeline.from_exported(export)
    limit = 16 << 20
    proc = ServerProcess(
        ["--model", str(export), "--port", "0", "--threads", "1", "--state-cache-bytes", str(limit)],
        tmp_path / "server.log",
    )
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "You answer briefly."}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question number {turn}?"})
            reply = client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=6,
                temperature=0,
                extra_body={"chat_template_kwargs": NO_THINKING},
            )
            fresh = pipe.chat(messages, 6, GREEDY, chat_template_kwargs=NO_THINKING)
            assert reply.choices[0].message.content == fresh.content, f"turn {turn + 1}"
            cached = reply.usage.prompt_tokens_details.cached_tokens
            assert (cached > 0) == (turn > 0), f"turn {turn + 1}: {cached} cached tokens"
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        other = [messages[0], {"role": "user", "content": "Another conversation, same system prompt."}]
        reply = client.chat.completions.create(
            model="m", messages=other, max_tokens=2, temperature=0, extra_body={"chat_template_kwargs": NO_THINKING}
        )
        assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the system prompt's kept state
        cache = httpx.get(f"{proc.url}/health", timeout=10).json()["state_cache"]
        assert cache["hits"] == 4 and cache["bytes"] <= cache["max_bytes"] == limit
    finally:
        proc.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
    from qwen35_onnx.server.app import create_app
    from qwen35_onnx.server.options import ServerOptions

    with pytest.raises(ValueError, match="--state-cache-bytes: state cache limit 4096 bytes is below one state"):
        create_app(pipe, ServerOptions(model_name="m", state_cache_bytes=4096))
    with pytest.raises(ValueError, match="--state-cache-bytes must be >= 0"):
        create_app(pipe, ServerOptions(model_name="m", state_cache_bytes=-1))


def test_openvino_keeps_bf16_states_as_bf16_through_host_copies(checkpoint):
    """A bf16 export's states on OpenVINO: zero states and host copies (a snapshot's) stay bf16 tensors
    bit for bit (numpy has no bf16: the host arrays hold the raw bits)."""
    import openvino as ov

    from qwen35_onnx.contract import Dtype
    from qwen35_onnx.runtime.openvino.backend import OpenVinoBackend

    contract = _demo_contract(checkpoint)
    assert contract.dtype == Dtype.BF16
    backend = OpenVinoBackend.__new__(OpenVinoBackend)  # the state handling alone: no graphs
    backend.contract, backend.host_state_roundtrip = contract, False
    zeros = backend.zero_states()
    assert {t.get_element_type() for t in zeros.values()} == {ov.Type.bf16, ov.Type.f32}
    assert all(not t.data.any() for t in zeros.values())
    kv = zeros["present_kv_cache"]
    kv.data[...] = np.random.default_rng(0).standard_normal(kv.data.shape).astype(np.float16)
    copies = backend.states_to_host(zeros, kv_length=3)
    assert copies["present_kv_cache"].shape[3] == 3
    back = backend.states_from_host(backend.states_to_host(zeros))
    assert back["present_kv_cache"].get_element_type() == ov.Type.bf16
    assert np.array_equal(back["present_kv_cache"].data.view(np.uint16), kv.data.view(np.uint16))


def _demo_contract(checkpoint):
    """The contract an export of the demo checkpoint would have (no graphs written)."""
    from qwen35_onnx.export.exporter import build_contract, load_config

    config, generation_config = load_config(checkpoint)
    options = ExportOptions(capacity=64, image_tokens=64, dtype="bf16", ops="portable")
    return build_contract(config, generation_config, options)


def test_a_snapshot_keeps_each_image_started_among_its_tokens_even_when_runs_touch():
    """Two images whose token runs touch (ids 9 9 9 9: two images of two tokens) are two images: a
    snapshot after the second one's first token keeps both digests."""
    contract = SimpleNamespace(capacity=64)  # take() reads the capacity alone
    arrays = {
        "present_conv_states": np.zeros(1),
        "present_recurrent_states": np.zeros(1),
        "present_kv_cache": np.zeros((1, 1, 1, 8, 1)),
    }
    ids = np.array([1, 9, 9, 9, 9, 2])
    snapshot = StateSnapshot.take("e", contract, arrays, ids[:4], ("a", "b"), image_starts=[1, 3])
    assert snapshot.images == ("a", "b") and snapshot.kv_cache.shape[3] == 4
    assert not snapshot.is_prefix_of(ids, ("a", "c"))
    assert StateSnapshot.take("e", contract, arrays, ids[:3], ("a", "b"), image_starts=[1, 3]).images == ("a",)


def test_component_of_a_kind_the_export_has_not_is_refused(chunk_export, checkpoint, tmp_path):
    """Re-exporting the prefill (bucket) graph of a chunked export names the kinds it has."""
    import shutil

    from qwen35_onnx.export.exporter import export

    folder = shutil.copytree(chunk_export("ort"), tmp_path / "copy")
    with pytest.raises(ExportError, match="has no prefill graph.*chunk, decode, vision"):
        export(checkpoint, folder, ExportOptions(component="prefill"))
