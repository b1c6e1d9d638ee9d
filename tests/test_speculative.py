"""Speculative decoding with the checkpoint's MTP head (issue 39): the MTP and verify graphs, exactness of
greedy speculative decoding against plain decoding and transformers, rejection sampling's distribution, and
the errors.

The trained test checkpoint gets an MTP head trained by self-distillation on its own outputs
(``tests/training.py``: acceptance about 0.5 for one draft); the drafter that proposes the target's own tokens at
a chosen rate covers the acceptance rates the head does not reach.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from .conftest import PHOTO_GRID, build_once, export_to

SPEC_CAPACITY = 96
SPEC_CHUNKS = (8, 32)
TEXT_PROMPT = "Describe the weather in a few words please."


@pytest.fixture(scope="session")
def mtp_checkpoint(trained_checkpoint, tmp_path_factory):
    """The trained test checkpoint with an MTP head (``mtp.*`` tensors, as the published checkpoints carry) trained
    by self-distillation (:func:`tests.training.train_mtp_head`)."""
    from .training import train_mtp_head

    return build_once(tmp_path_factory, "checkpoint-mtp", lambda out: train_mtp_head(trained_checkpoint, out))


@pytest.fixture(scope="session")
def mtp_export(mtp_checkpoint, tmp_path_factory):
    """``mtp_export(ops) -> Path``: --ops ort with 4 draft tokens (the default for a checkpoint with an MTP head);
    --ops portable with 2 (its verify graphs are the same code at every size, and each costs about 20 s of export
    here) and the photo's static vision grid, which OpenVINO runs too."""

    def get(ops: str):
        options = {"ops": ops, "prefill_chunks": SPEC_CHUNKS, "capacity": SPEC_CAPACITY}
        if ops == "portable":
            options["vision_grids"] = (PHOTO_GRID,)
            options["draft_tokens"] = 2
        return build_once(tmp_path_factory, f"export-mtp-{ops}", lambda out: export_to(mtp_checkpoint, out, **options))

    return get


def open_pipeline(mtp_export, runtime: str, **options):
    """A pipeline on the MTP export a runtime runs: ``'ort'`` and ``'portable'`` (ONNX Runtime on the export of
    those operators), ``'openvino'`` (the portable export)."""
    from qwen35_onnx.pipeline import Pipeline

    if runtime == "openvino":
        return Pipeline.from_exported(mtp_export("portable"), runtime="openvino", **options)
    return Pipeline.from_exported(mtp_export(runtime), **options)


def oracle(truth: list[int], rate: float, seed: int):
    """A drafter that proposes the target's own next tokens (``truth``, the plain greedy continuation after the
    prompt), each replaced by another token with probability ``1 - rate``."""
    rng = random.Random(seed)
    emitted: list[int] = []

    def drafter(token: int, n: int) -> list[int]:
        emitted.append(token)
        at = len(emitted)
        drafts = truth[at : at + n] + [0] * max(0, at + n - len(truth))
        return [t if rng.random() < rate else (t + 1) % 1000 for t in drafts]

    return drafter


def speculative_greedy(pipe, prepared, n: int, draft_tokens: int, drafter=None) -> tuple[list[int], object]:
    """``n`` greedy tokens of ``prepared`` (fewer at an end-of-sequence token) through :class:`Speculation` rounds
    (decode steps where no round fits); returns the tokens and the generation's timings."""
    from qwen35_onnx.runtime.generation import Generation
    from qwen35_onnx.runtime.masks import CapacityExhausted
    from qwen35_onnx.runtime.sampling import Sampler, SamplingConfig
    from qwen35_onnx.runtime.speculative import Speculation

    generation = Generation(pipe.backend, prepared)
    speculation = Speculation(generation, draft_tokens, drafter)
    sampler = Sampler(SamplingConfig())
    tokens = [sampler(generation.prefill())]
    while len(tokens) < n and tokens[-1] not in pipe.stop_token_ids:
        if speculation.drafts_for():
            emitted = []
            for token in speculation.round(tokens[-1], sampler)[: n - len(tokens)]:
                emitted.append(token)
                if token in pipe.stop_token_ids:
                    break
            tokens += emitted
            speculation.commit(len(emitted))
            continue
        try:
            tokens.append(sampler(generation.step(tokens[-1])))
        except CapacityExhausted:
            break
        speculation.stop()
    return tokens, generation.timings


# ---- the graphs -----------------------------------------------------------------------------------------
def test_export_lists_mtp_and_verify_graphs(mtp_export, checkpoint):
    """A checkpoint with an MTP head exports MTP graphs (sizes 1, drafts + 1 and the chunks) and a verify graph
    per draft length; without ``mtp.*`` tensors the export has none, and asking for drafts fails."""
    from qwen35_onnx.contract import read_manifest
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportError, ExportOptions

    contract = read_manifest(mtp_export("ort"))
    assert contract.draft_tokens == 4
    assert contract.mtp_sizes == (1, 5, 8, 32) and contract.verify_sizes == (2, 3, 4, 5)
    assert {k for k in contract.graphs if k.startswith(("mtp_", "verify_"))} == {
        "mtp_1", "mtp_5", "mtp_8", "mtp_32", "verify_2", "verify_3", "verify_4", "verify_5"
    }  # fmt: skip
    with pytest.raises(ExportError, match=r"--draft-tokens 2: the checkpoint has no multi-token-prediction head"):
        export(checkpoint, "/tmp/never-written", ExportOptions(capacity=SPEC_CAPACITY, image_tokens=64, draft_tokens=2))
    with pytest.raises(ExportError, match=r"--draft-tokens: draft tokens 5 must be an integer from 0 to 4"):
        ExportOptions(draft_tokens=5).validate()


@pytest.mark.parametrize("runtime", ["ort", "portable", "openvino"])
def test_hidden_states_and_mtp_graph_match_the_reference(mtp_export, mtp_checkpoint, runtime):
    """The chunk graphs' hidden states are transformers' ``last_hidden_state`` (after the final norm: what
    lm_head reads, vLLM's MTP input), and the MTP graph computes vLLM's ``Qwen3_5MultiTokenPredictor`` on them
    (the torch reference :class:`~qwen35_onnx.export.mtp.MtpHead` with the checkpoint's ``mtp.*`` weights)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from qwen35_onnx.export import layers
    from qwen35_onnx.export.mtp import load_mtp_head
    from qwen35_onnx.runtime.generation import Generation

    pipe = open_pipeline(mtp_export, runtime)
    prepared = pipe.prepare(None, TEXT_PROMPT)
    generation = Generation(pipe.backend, prepared)
    seen = []
    generation.chunk_observer = lambda start, real, hidden: seen.append((start, hidden))
    generation.prefill()
    ours = np.concatenate([h for _, h in seen])
    n = prepared.prompt_len
    assert [s for s, _ in seen][0] == 0 and ours.shape == (n, pipe.contract.hidden_size)

    model = Qwen3_5ForConditionalGeneration.from_pretrained(mtp_checkpoint).eval()
    head = load_mtp_head(mtp_checkpoint)
    ids = torch.from_numpy(prepared.input_ids)
    positions = torch.from_numpy(prepared.position_ids)
    with torch.no_grad():
        reference = model.model.language_model(input_ids=ids, position_ids=positions).last_hidden_state[0].numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)

    # the MTP head over positions 0 .. n-2 (each with the token after it), in one run of the graph of 32
    size, m = 32, n - 1
    feeds = {
        "input_ids": np.zeros((1, size), np.int64),
        "hidden_states": np.zeros((1, size, pipe.contract.hidden_size), np.float32),
        "chunk_mask": np.zeros((1, size), np.int64),
        "attention_mask": np.zeros((1, pipe.contract.capacity), np.int64),
        "position_ids": np.zeros((4, 1, size), np.int64),
        "image_embeds": np.zeros((size, pipe.contract.image_embed_dim), np.float32),
    }
    feeds["input_ids"][0, :m] = prepared.input_ids[0, 1:n]
    feeds["hidden_states"][0, :m] = ours[:m]
    feeds["chunk_mask"][0, :m] = 1
    feeds["attention_mask"][0, :m] = 1
    feeds["position_ids"][:, :, :m] = prepared.position_ids[:, :, :m]
    logits, mtp_hidden, _ = pipe.backend.run_mtp(size, feeds, pipe.backend.mtp_cache())
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids[:, 1:n])
        rope = layers.mrope_cos_sin(model.model.language_model.rotary_emb, embeds, positions[1:, :, : n - 1])
        causal = torch.full((m, m), float("-inf")).triu(1)[None, None]
        out = head(embeds, torch.from_numpy(reference[None, :m]), rope, causal)
        expected_logits = model.lm_head(out)[0, -1].numpy()
    np.testing.assert_allclose(mtp_hidden[0, 0], out[0, -1].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[0, 0], expected_logits, rtol=1e-4, atol=1e-4)


# ---- exactness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", ["ort", "portable", "openvino"])
def test_speculative_greedy_equals_plain_and_transformers(mtp_export, mtp_checkpoint, photo, runtime):
    """Greedy speculative decoding gives exactly plain greedy decoding's tokens, which are transformers': text
    and image prompts, every draft length, the MTP head's own drafts and drafts of the target's own tokens at
    acceptance 0.5 and 0.9; 64 tokens (the image prompt: 24, its prompt fills the rest); ONNX Runtime with both
    ``--ops`` and OpenVINO."""
    from transformers import Qwen3_5ForConditionalGeneration

    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.verify import reference_generate_prepared

    from .conftest import IMAGE_TOKENS

    pipe = open_pipeline(mtp_export, runtime)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(mtp_checkpoint).eval()
    drafts = pipe.contract.draft_tokens
    for image, n in ((None, 64), (photo, 24)):
        prepared = pipe.prepare(image, TEXT_PROMPT, max_image_tokens=IMAGE_TOKENS if image else None)
        plain = pipe.generate_prepared(prepared, n, SamplingConfig()).token_ids
        reference = reference_generate_prepared(model, prepared, n, ())
        assert plain == reference[: len(plain)]
        for k in range(1, drafts + 1):
            tokens, timings = speculative_greedy(pipe, prepared, n, k)
            assert tokens == plain, (image, k)
            assert timings.verify_runs > 0
            for rate in (0.5, 0.9):
                tokens, timings = speculative_greedy(pipe, prepared, n, k, oracle(plain, rate, seed=k))
                assert tokens == plain, (image, k, rate)
                assert timings.accepted > 0
    # through the pipeline's own loop (the MTP head's drafts): the self-distilled head's drafts are often kept
    prepared = pipe.prepare(None, TEXT_PROMPT)
    plain = pipe.generate_prepared(prepared, 64, SamplingConfig()).token_ids
    for k in (1, drafts):
        result = pipe.generate_prepared(prepared, 64, SamplingConfig(), draft_tokens=k)
        assert result.token_ids == plain
        timings = result.timings
        assert timings.drafted == k * timings.verify_runs and timings.decode_steps == len(plain) - 1
        assert timings.acceptance > (0.4 if k == 1 else 0.15), (k, timings.acceptance)


@pytest.mark.parametrize("runtime", ["ort", "portable", "openvino"])
def test_speculation_at_the_capacity_keeps_every_token(mtp_export, runtime):
    """Near the capacity, where a round's token and drafts no longer fit (a verify run writes all their KV slots),
    decode steps fill the last slots: the same tokens and finish reason as plain decoding, none lost."""
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pipe = open_pipeline(mtp_export, runtime)
    pipe.stop_token_ids = ()  # (no end of sequence: every generation runs into the capacity)
    prepared = pipe.prepare(None, TEXT_PROMPT)
    plain = pipe.generate_prepared(prepared, None, SamplingConfig())
    assert plain.finish_reason == "length" and len(plain.token_ids) == pipe.token_room(prepared)
    for k in (1, pipe.contract.draft_tokens):
        tokens, _ = speculative_greedy(pipe, prepared, len(plain.token_ids) + 5, k, oracle(plain.token_ids, 1.0, 0))
        assert tokens == plain.token_ids
        result = pipe.generate_prepared(prepared, None, SamplingConfig(), draft_tokens=k)
        assert result.token_ids == plain.token_ids and result.finish_reason == "length"


def test_no_rounds_after_a_prompt_tail_fed_by_decode_steps(mtp_export):
    """A prompt so near the capacity that its last tokens go through decode steps (no chunk fits there): the MTP
    head has no hidden state for them, so no round runs; the tokens are plain decoding's."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.generation import Generation
    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.runtime.speculative import Speculation

    pipe = Pipeline.from_exported(mtp_export("ort"))
    pipe.stop_token_ids = ()
    ids = pipe.prepare(None, TEXT_PROMPT).input_ids[0]
    prepared = pipe.prepare_ids(np.resize(ids, SPEC_CAPACITY - 3)[None])
    # a snapshot point 6 tokens before the capacity ends a chunk there: no chunk fits after it
    prepared.snapshot_points = (SPEC_CAPACITY - 6,)
    generation = Generation(pipe.backend, prepared, snapshot_at=prepared.snapshot_points)
    speculation = Speculation(generation, 1)
    generation.prefill()
    assert generation.decoder is not None  # the prompt's tail went through decode steps
    assert not speculation.usable and speculation.drafts_for() == 0 and generation.chunk_observer is None
    plain = pipe.generate_prepared(prepared, None, SamplingConfig(), draft_tokens=0, state_cache=pipe.state_cache())
    spoken = pipe.generate_prepared(prepared, None, SamplingConfig(), draft_tokens=1, state_cache=pipe.state_cache())
    assert spoken.token_ids == plain.token_ids and spoken.timings.verify_runs == 0


@pytest.mark.parametrize("runtime", ["ort", "portable", "openvino"])
def test_speculation_continues_a_conversation_from_kept_states(mtp_export, runtime):
    """A chat continued from the state cache's kept states: the speculative turns equal the plain ones."""
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pipe = open_pipeline(mtp_export, runtime)
    replies, k = {}, min(3, pipe.contract.draft_tokens)
    for drafts in (0, k):
        pipe.draft_tokens = drafts
        cache, messages, replies[drafts] = pipe.state_cache(), [], []
        for question in ("Hello there.", "And then?", "Why?"):
            messages.append({"role": "user", "content": question})
            result = pipe.chat(messages, max_new_tokens=12, sampling=SamplingConfig(), state_cache=cache)
            timings = result.generation.timings
            replies[drafts].append((result.generation.token_ids, result.generation.cached_tokens, timings.verify_runs))
            messages.append({"role": "assistant", "content": result.content})
    assert [r[:2] for r in replies[k]] == [r[:2] for r in replies[0]]
    assert replies[k][2][1] > 0 and all(r[2] > 0 for r in replies[k]) and not any(r[2] for r in replies[0])


def test_kept_states_carry_the_mtp_heads_state(mtp_export):
    """A speculative turn's kept states carry the MTP head's state (its KV slots of the positions it read, the
    target's hidden states of the rest): at the prefill's snapshot point it equals the head's state after a fresh
    prefill of the same tokens, and the next turn's speculation starts its head from the reply's snapshot."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.generation import Generation
    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.runtime.speculative import Speculation

    pipe = Pipeline.from_exported(mtp_export("ort"), draft_tokens=2)
    cache, messages = pipe.state_cache(), [{"role": "user", "content": "Hello there."}]
    reply = pipe.chat(messages, max_new_tokens=12, sampling=SamplingConfig(), state_cache=cache)
    kept = sorted(cache._items.values(), key=lambda snapshot: snapshot.length)
    assert len(kept) == 2 and all(s.mtp_kv is not None for s in kept)
    point, end = kept
    assert end.reply and not point.reply and end.length > point.length
    assert point.mtp_kv.shape[3] + len(point.mtp_hidden) == point.length

    fresh = Generation(pipe.backend, pipe.prepare_ids(np.array([[*point.token_ids, 11]])))
    speculation = Speculation(fresh, 2)
    fresh.prefill()
    b = point.mtp_kv.shape[3]
    np.testing.assert_allclose(speculation.cache.kv[:, :, :, :b], point.mtp_kv, rtol=1e-5, atol=1e-5)

    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "And then?"}]
    generation = pipe.generation(pipe.prepare_chat(messages), cache)
    assert generation.start is end
    speculation = Speculation(generation, 2)
    assert speculation.restored == end.length
    np.testing.assert_array_equal(speculation.cache.kv[:, :, :, : end.mtp_kv.shape[3]], end.mtp_kv)
    with pytest.raises(ValueError, match="does not cover the snapshot's"):
        end.with_head_state(end.mtp_kv, end.mtp_hidden[:0])


# ---- sampling ---------------------------------------------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """On a vocabulary of 6 tokens, the first token a round emits (draft kept, or the residual draw) follows the
    target's distribution p whatever the draft distribution q: a chi-square test over 40000 rounds at the 0.001
    level (critical value 20.52 for 5 degrees of freedom); and with q = p every draft is kept."""
    from qwen35_onnx.runtime.sampling import Sampler, SamplingConfig
    from qwen35_onnx.runtime.speculative import accept_sampled

    sampler = Sampler(SamplingConfig(temperature=1.0, seed=3))
    target = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05]))
    p = sampler.probabilities(target)
    for q in (np.array([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]), np.full(6, 1 / 6), np.array([0, 0, 0, 0, 0.5, 0.5])):
        counts = np.zeros(6)
        rounds = 40000
        for _ in range(rounds):
            draft = sampler.draw(q)
            first = accept_sampled([draft], [q], np.stack([target, target]), sampler)[0]
            counts[first] += 1
        expected = p * rounds
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.52, (q, counts, expected)
    kept = sum(
        len(accept_sampled([sampler.draw(p)], [p], np.stack([target, target]), sampler)) == 2 for _ in range(500)
    )
    assert kept == 500


def test_sampled_speculation_runs_through_the_pipeline(mtp_export):
    """Sampling with speculation: a seeded generation is reproducible and every token comes from the vocabulary."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pipe = Pipeline.from_exported(mtp_export("ort"))
    prepared = pipe.prepare(None, TEXT_PROMPT)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=11)
    first = pipe.generate_prepared(prepared, 24, sampling, draft_tokens=2)
    again = pipe.generate_prepared(prepared, 24, sampling, draft_tokens=2)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 24
    assert first.timings.verify_runs > 0


# ---- bad input -------------------------------------------------------------------------------------------
def test_bad_draft_tokens_fail_before_any_graph_runs(mtp_export, tmp_path):
    """Draft tokens out of range, more than the export verifies, and an MTP graph from another export: clear
    errors, before a graph runs."""
    from qwen35_onnx.contract import ContractError
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.backend import RuntimeOptions
    from qwen35_onnx.runtime.speculative import check_draft_tokens

    for bad, match in ((5, r"draft_tokens 5 must be from 0 \(off\) to 4"), (-1, "must be from 0"), (True, "integer")):
        with pytest.raises(ValueError, match=match):
            RuntimeOptions(draft_tokens=bad).validate()
    with pytest.raises(ValueError, match="speculative decoding on ONNX Runtime runs on the CPU"):
        RuntimeOptions(draft_tokens=2, device="cuda").validate()
    RuntimeOptions(draft_tokens=2, runtime="openvino").validate()
    with pytest.raises(ContractError, match=r"draft tokens 3 is more than this export verifies \(2, its --draft"):
        check_draft_tokens(3, 2)
    portable = mtp_export("portable")
    pipe = Pipeline.from_exported(portable)
    with pytest.raises(ValueError, match="draft_tokens applies to a generation alone"):
        pipe.stream(None, "hi", 4, draft_tokens=1, group=pipe.group())

    # an MTP graph of another export (--ops ort) in place of this one's: refused when speculation starts
    broken = tmp_path / "broken"
    shutil.copytree(portable, broken)
    shutil.copy(mtp_export("ort") / "text" / "mtp_1.onnx", broken / "text" / "mtp_1.onnx")
    pipe = Pipeline.from_exported(broken, draft_tokens=1)
    with pytest.raises(ContractError, match="mtp_1"):
        pipe.generate(None, "hi", 4)


def test_no_draft_tokens_on_an_export_without_mtp(small_export):
    """An export of a checkpoint without an MTP head refuses draft tokens, naming why."""
    from qwen35_onnx.contract import ContractError
    from qwen35_onnx.pipeline import Pipeline

    with pytest.raises(ContractError, match="this export has no MTP graph to draft with"):
        Pipeline.from_exported(small_export, draft_tokens=1)


# ---- the server ------------------------------------------------------------------------------------------
def test_serve_with_draft_tokens(mtp_export, tmp_path):
    """``serve --draft-tokens 2`` on an export of one slot: the openai client's streamed and whole replies equal
    the plain greedy reply, ``usage`` reports the draft tokens kept and dropped, ``/metrics`` counts them, and
    identical requests sent at once each get that same reply."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    from .test_server import ServerProcess, scrape

    export = mtp_export("ort")
    messages = [{"role": "user", "content": "Hello there."}]
    plain = Pipeline.from_exported(export).chat(messages, max_new_tokens=20, sampling=SamplingConfig())
    server = ServerProcess(
        ["--model", str(export), "--port", "0", "--model-name", "mtp", "--threads", "1", "--draft-tokens", "2"]
        + ["--max-queue", "4"],
        tmp_path / "server.log",
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        whole = client.chat.completions.create(model="mtp", messages=messages, max_tokens=20, temperature=0)
        parts = client.chat.completions.create(
            model="mtp",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(parts)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].message.content == streamed == plain.content
        details = whole.usage.completion_tokens_details
        drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
        assert drafted > 0 and chunks[-1].usage.completion_tokens_details is not None
        metrics = scrape(server, key=None)
        assert metrics[("qwen35_onnx_spec_decode_draft_tokens_total", ())] == 2 * drafted
        # three identical requests at once (one slot: they take turns) each get the reply the request gets alone
        with ThreadPoolExecutor(3) as pool:
            replies = list(
                pool.map(
                    lambda _: (
                        client.chat.completions.create(model="mtp", messages=messages, max_tokens=20, temperature=0)
                        .choices[0]
                        .message.content
                    ),
                    range(3),
                )
            )
        assert replies == [plain.content] * 3
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_speculation_stops_itself_where_plain_decoding_is_faster(mtp_export):
    """The first tokens go through timed plain steps; after the warm-up and judged rounds a speculation slower than
    that stops for the rest of the generation (plain steps from there: the same tokens), one faster goes on."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.generation import Generation
    from qwen35_onnx.runtime.sampling import Sampler, SamplingConfig
    from qwen35_onnx.runtime.speculative import JUDGED_AFTER_ROUNDS, PLAIN_STEPS, WARM_ROUNDS, Speculation

    pipe = Pipeline.from_exported(mtp_export("ort"))
    pipe.stop_token_ids = ()  # (40 tokens whatever comes)
    prepared = pipe.prepare(None, TEXT_PROMPT)
    plain = pipe.generate_prepared(prepared, 40, SamplingConfig(), draft_tokens=0).token_ids
    for plain_ms, stops in ((1e-6, True), (1e9, False)):
        generation = Generation(pipe.backend, prepared)
        speculation = Speculation(generation, 2)
        sampler = Sampler(SamplingConfig())
        tokens = [sampler(generation.prefill())]
        while len(tokens) < 40:
            if speculation.measuring:
                tokens.append(sampler(speculation.plain_step(tokens[-1])))
                if not speculation.measuring:
                    assert speculation.plain_steps == PLAIN_STEPS and speculation.plain_step_ms > 0
                    speculation.plain_step_ms = plain_ms
            elif speculation.drafts_for() and speculation.worth_it():
                emitted = speculation.round(tokens[-1], sampler)[: 40 - len(tokens)]
                tokens += emitted
                speculation.commit(len(emitted))
            else:
                tokens.append(sampler(generation.step(tokens[-1])))
                speculation.stop()
        assert tokens == plain[: len(tokens)] and len(tokens) == 40
        assert speculation.stopped_slower is stops
        judged = WARM_ROUNDS + JUDGED_AFTER_ROUNDS
        assert speculation.rounds == judged if stops else speculation.rounds > judged


@pytest.mark.parametrize("runtime", ["ort", "openvino"])
def test_speculation_with_host_state_roundtrip(mtp_export, runtime):
    """``--host-state-roundtrip`` (every state through numpy): the verify runs' per-position states go into the
    same host buffers and the tokens equal plain decoding's."""
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pipe = open_pipeline(mtp_export, runtime, host_state_roundtrip=True)
    prepared = pipe.prepare(None, TEXT_PROMPT)
    plain = pipe.generate_prepared(prepared, 32, SamplingConfig(), draft_tokens=0).token_ids
    tokens, timings = speculative_greedy(pipe, prepared, 32, 2, oracle(plain, 0.9, seed=2))
    assert tokens == plain and timings.accepted > 0


# ---- the bench's report ----------------------------------------------------------------------------------
def test_speculative_bench_report_lines():
    """``bench --speculative``'s Markdown: the parts against a step, the rates by draft length, and llama.cpp's MTP
    drafting beside them, or why it was not measured; a round's expected tokens are 1 + a + ... + a^k."""
    from qwen35_onnx.bench.speculative import expected_tokens, report_lines

    assert expected_tokens(2, 0.5) == pytest.approx(1.75) and expected_tokens(1, 0.0) == 1
    report = {
        "n_tokens": 128,
        "plain_tokens_per_s": 60.0,
        "costs": {"step_ms": 16.0, "verify_ms": {1: 21.0}, "draft_step_ms": 5.0, "mtp_kept_ms": {1: 5.5}},
        "rows": [{"k": 1, "rate": 0.7, "acceptance": 0.7, "tokens_per_s": 48.0, "x_plain": 0.8, "same": None}],
        "llama.cpp": {
            "gguf": "/w/llama.cpp-mtp/model-Q4_0-pure.gguf",
            "plain_tokens_per_s": 45.0,
            "rows": [{"k": 1, "tokens_per_s": 30.0, "x_plain": 30 / 45, "acceptance": 0.01}],
        },
    }
    lines = report_lines(report)
    assert "| 1 | 21.0 | 1.31 | 5.5 | 0.34 |" in lines
    assert "| 1 | 0.7 | 0.70 | 48.0 | 0.80 | - |" in lines
    assert "| 1 | 30.0 | 0.67 | 0.01 |" in lines and any("model-Q4_0-pure.gguf" in line for line in lines)
    report["llama.cpp"] = {"error": "llama-server exited with 1"}
    assert report_lines(report)[-1] == "llama.cpp MTP drafting: not measured (llama-server exited with 1)"
