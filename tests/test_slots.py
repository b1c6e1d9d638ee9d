"""Decode slots (``--slots``): several sequences in one decode graph of S rows, each row the tokens transformers
gives for its sequence alone; a group of generations (the Python API); the slots' contract and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qwen35_onnx.contract import MAX_SLOTS, ContractError, check_slots, read_manifest
from qwen35_onnx.export.exporter import check_slot_memory
from qwen35_onnx.export.options import ExportError, ExportOptions
from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.generation import Generation
from qwen35_onnx.runtime.sampling import SamplingConfig
from qwen35_onnx.runtime.slots import NoFreeSlot, SlotPool
from qwen35_onnx.verify import reference_generate_prepared

from .conftest import IMAGE_BUDGET, IMAGE_CAPACITY, PHOTO_GRID, PREFILL_CHUNKS, processor_grids, shared_export

SLOTS = 4
GREEDY = SamplingConfig()
NO_THINKING = {"enable_thinking": False}
RUNS = ["onnxruntime-ort", "onnxruntime-portable", "openvino-portable"]


@pytest.fixture(scope="module")
def slot_export(checkpoint, tmp_path_factory, shapes):
    """``slot_export(ops)``: the demo checkpoint with :data:`SLOTS` decode slots, capacity IMAGE_CAPACITY, two
    images of up to IMAGE_BUDGET tokens, prefill chunks PREFILL_CHUNKS; ``ort``: the any-grid vision graph;
    ``portable``: static vision grids (the photo's and the landscape's: OpenVINO runs it)."""
    grids = {"ort": {}, "portable": {"vision_grids": tuple(sorted({PHOTO_GRID, processor_grids(shapes)[1]}))}}

    def get(ops: str):
        return shared_export(
            tmp_path_factory,
            checkpoint,
            f"slots-{ops}",
            ops=ops,
            slots=SLOTS,
            capacity=IMAGE_CAPACITY,
            image_tokens=IMAGE_BUDGET,
            max_images=2,
            prefill_chunks=PREFILL_CHUNKS,
            **grids[ops],
        )

    return get


def _pipe(slot_export, run: str) -> Pipeline:
    runtime, ops = run.split("-")
    return Pipeline.from_exported(slot_export(ops), runtime=runtime)


def _user(text: str, image=None) -> list[dict]:
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["onnxruntime-ort", "openvino-portable"])  # portable on ONNX Runtime: the next test
def test_rows_of_one_step_give_each_sequence_the_tokens_transformers_gives_it_alone(
    slot_export, reference_model, shapes, run
):
    """Four requests at once (two images of different grids, a short and a long text), a fifth that stops early on
    a stop string, a sixth cancelled mid-way, and a seventh that joins while three are mid-stream: every finished
    one has transformers' tokens for its prompt alone, the others a prefix of them."""
    pipe = _pipe(slot_export, run)
    eos = pipe.stop_token_ids
    requests = [
        (_user("Describe this image.", shapes["square"]), 12),
        (_user("What is in the picture?", shapes["landscape"]), 10),
        (_user("Hi"), 9),
        (_user("Tell me a long story about " + "a cat, a dog and a bird; " * 6), 11),
    ]
    prepared = [pipe.prepare_chat(m, NO_THINKING) for m, _ in requests]
    reference = [reference_generate_prepared(reference_model, p, n, eos) for p, (_, n) in zip(prepared, requests)]

    group = pipe.group()
    streams = [pipe.stream_chat(m, n, GREEDY, chat_template_kwargs=NO_THINKING, group=group) for m, n in requests[:3]]
    # one that stops early on a string its own reply holds (from the reply alone), one cancelled after 3 tokens
    alone = pipe.generate_prepared(prepared[2], 9, GREEDY)
    stop = alone.text[len(alone.text) // 2 :][:2]
    stopped = pipe.stream_prepared(prepared[2], 9, GREEDY, stop=[stop], group=group)
    cancelled = pipe.stream_chat(requests[3][0], 11, GREEDY, chat_template_kwargs=NO_THINKING, group=group)
    pool = pipe.slot_pool
    steps, rows = pool.steps, pool.rows_stepped
    for _ in range(3):  # every slot taken (the cancelled one waits for one)
        group.step()
    joiner = pipe.stream_chat(requests[3][0], 11, GREEDY, chat_template_kwargs=NO_THINKING, group=group)
    while len(cancelled.result.generation.token_ids) < 3:
        group.step()
    cancelled.close()
    group.run()

    for stream, tokens in zip([*streams, joiner], [*reference[:3], reference[3]]):
        assert stream.result.generation.token_ids == tokens
    assert stopped.result.finish_reason == "stop" and stop not in stopped.result.text
    assert stopped.result.token_ids == alone.token_ids[: len(stopped.result.token_ids)]
    assert len(stopped.result.token_ids) < len(alone.token_ids)
    kept = cancelled.result.generation.token_ids
    assert cancelled.result.finish_reason is None and 3 <= len(kept) < 11 and kept == reference[3][: len(kept)]
    assert pool.busy == 0 and (pool.rows_stepped - rows) / (pool.steps - steps) > 1.5  # rows per step


@pytest.mark.parametrize("run", RUNS)
def test_identical_requests_at_once_give_identical_answers_equal_to_one_alone(slot_export, run):
    pipe = _pipe(slot_export, run)
    messages = _user("Count to ten, please.")
    alone = pipe.chat(messages, 14, GREEDY, chat_template_kwargs=NO_THINKING)
    group = pipe.group()
    streams = [
        pipe.stream_chat(messages, 14, GREEDY, chat_template_kwargs=NO_THINKING, group=group) for _ in range(SLOTS)
    ]
    pieces = list(streams[0])  # iterating one stream runs the group
    group.run()
    assert "".join(d.content for d in pieces) == alone.content
    for stream in streams:
        assert stream.result.generation.token_ids == alone.generation.token_ids
        assert stream.result.finish_reason == alone.finish_reason


@pytest.mark.parametrize("run", RUNS)
def test_an_idle_row_leaves_its_slot_exactly_as_it_was(slot_export, run):
    """A slot whose sequence sits out some steps (idle: an all-zero mask row) keeps its conv, recurrent and KV
    state bit for bit, and then continues as if the steps had not happened."""
    pipe = _pipe(slot_export, run)
    pool = SlotPool(pipe.backend)
    a = Generation(pipe.backend, pipe.prepare(None, "The first sequence"), pool=pool)
    b = Generation(pipe.backend, pipe.prepare(None, "and a second one, longer than the first"), pool=pool)
    ta, tb = int(np.argmax(a.prefill())), int(np.argmax(b.prefill()))
    before = pool.read(b.slot, b.length)
    for _ in range(4):
        (logits,) = pool.step([(a, ta)])
        ta = int(np.argmax(logits))
    after = pool.read(b.slot, b.length)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    # b continues as alone
    solo = Generation(pipe.backend, pipe.prepare(None, "and a second one, longer than the first"), pool=pool)
    ts = int(np.argmax(solo.prefill()))
    assert ts == tb
    for _ in range(3):
        lb, ls = pool.step([(b, tb), (solo, ts)])
        np.testing.assert_array_equal(lb, ls)
        tb = ts = int(np.argmax(ls))
    for g in (a, b, solo):
        g.close()
    assert pool.free == SLOTS and pool.bytes_copied > 0


def test_a_full_pool_refuses_a_sequence_and_a_closed_slot_takes_the_next(slot_export):
    pipe = _pipe(slot_export, "onnxruntime-ort")
    pool = pipe.slot_pool
    prepared = pipe.prepare(None, "hello")
    held = [pipe.generation(prepared) for _ in range(SLOTS)]
    with pytest.raises(NoFreeSlot, match=f"all {SLOTS} decode slots"):
        pipe.generation(prepared)
    for g in held:  # every slot's KV cache written: pages the pool hands back when a slot is freed
        g.prefill()
    held[2].close()  # the slots in use stay first (a dynamic row axis): the last holder moves down
    assert held[3].slot == 2 and pool.rows == SLOTS - 1
    assert pool.bytes_discarded > 0  # the vacated last slot's KV pages went back to the system
    held.append(pipe.generation(prepared))
    assert held[-1].slot == SLOTS - 1 and pool.rows == SLOTS
    for g in held:
        g.close()
    assert pool.free == SLOTS and pool.rows == 1
    with pytest.raises(ContractError, match="decode slots: its generations run in a SlotPool"):
        Generation(pipe.backend, prepared)


def test_the_manifest_and_the_decode_graph_carry_the_slots(slot_export, tmp_path):
    export = slot_export("ort")
    contract = read_manifest(export)
    assert contract.slots == SLOTS and contract.batch == 1
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["derived"]["decode_rows"] == SLOTS
    copy = tmp_path / "copy"
    shutil.copytree(export, copy)
    manifest["slots"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="slots: 4 != 2"):
        Pipeline.from_exported(copy)


def test_bad_slot_counts_and_layouts_are_refused_before_any_graph(checkpoint, tmp_path):
    for bad in (0, -1, MAX_SLOTS + 1, 2.5, True):
        with pytest.raises(ExportError, match=f"--slots: slots {bad!r} must be an integer from 1 to {MAX_SLOTS}"):
            ExportOptions(slots=bad).validate()
    with pytest.raises(ExportError, match="needs a fixed KV cache"):
        ExportOptions(slots=2, kv_mode="dynamic").validate()
    with pytest.raises(ExportError, match="needs prefill chunks"):
        ExportOptions(slots=2, prefill_buckets=(64, 2048)).validate()
    check_slots(MAX_SLOTS, "fixed", (8,))


def test_slot_states_over_the_memory_budget_name_the_bytes(slot_export):
    import dataclasses

    contract = read_manifest(slot_export("portable"))  # (--ops ort commits its KV cache as written: not counted)
    per_slot = contract.slot_state_bytes()
    check_slot_memory(contract, physical=2 * SLOTS * per_slot)
    with pytest.raises(ExportError) as err:
        check_slot_memory(dataclasses.replace(contract, slots=SLOTS), physical=2 * SLOTS * per_slot - 2)
    assert f"{SLOTS * per_slot:,} bytes of decode state ({per_slot:,} bytes a slot" in str(err.value)
    assert f"budget of {SLOTS * per_slot - 1:,} bytes" in str(err.value)
    ort = read_manifest(slot_export("ort"))  # its KV cache is committed as written: the budget counts the rest
    assert ort.slot_state_bytes(kv=False) < ort.slot_state_bytes() / 2
    check_slot_memory(ort, physical=2 * SLOTS * ort.slot_state_bytes(kv=False))


def test_slots_on_a_device_the_host_cannot_address_are_refused(slot_export):
    pipe = _pipe(slot_export, "onnxruntime-ort")
    pipe.backend.device = "cuda"  # as a CUDA session's states would be
    with pytest.raises(ContractError, match="decode slots run on the CPU.*device 'cuda'"):
        SlotPool(pipe.backend)


@pytest.fixture(scope="module")
def int4_exports(trained_checkpoint, tmp_path_factory):
    """The trained demo checkpoint at int4 (``--ops ort``, prefill chunks PREFILL_CHUNKS) with :data:`SLOTS`
    decode slots."""
    from .conftest import build_once, export_to

    options = {"quantize": "int4", "slots": SLOTS, "prefill_chunks": PREFILL_CHUNKS}
    return build_once(
        tmp_path_factory, f"trained-int4-slots-{SLOTS}", lambda out: export_to(trained_checkpoint, out, **options)
    )


INT4_PROMPTS = ["Describe a sunny day.", "What is two plus two?", "x", "Name the colours of the rainbow, please."]
INT4_TOKENS = 24


@pytest.mark.slow
def test_int4_rows_of_a_batched_step_agree_with_one_sequence_alone(int4_exports):
    """MatMulNBits computes the S rows of a step as one product (int8 activations at accuracy level 4): the same
    sequence's logits in a batch and alone (one row: the row axis is dynamic, so the step is the product of a
    batch-1 export) differ by rounding, which the int8 activation quantization can amplify. Teacher-forced on the
    same tokens: every position's logits stay within the bound below (cosine), the greedy choice agrees almost
    everywhere and the two runs' greedy tokens are reported."""
    many = Pipeline.from_exported(int4_exports)
    cosines, agree, total = [], 0, 0
    pool = many.slot_pool
    alone_logits, tokens = [], []
    for prompt in INT4_PROMPTS:
        g = Generation(many.backend, many.prepare(None, prompt), pool=pool)
        seen = [np.array(g.prefill(), dtype=np.float64)]
        ids = [int(np.argmax(seen[-1]))]
        for _ in range(INT4_TOKENS - 1):
            assert pool.rows == 1
            seen.append(np.array(g.step(ids[-1]), dtype=np.float64))
            ids.append(int(np.argmax(seen[-1])))
        g.close()
        alone_logits.append(seen)
        tokens.append(ids)
    gens = [Generation(many.backend, many.prepare(None, p), pool=pool) for p in INT4_PROMPTS]
    batched = [[np.array(g.prefill(), dtype=np.float64)] for g in gens]
    for k in range(INT4_TOKENS - 1):
        for seen, logits in zip(batched, pool.step([(g, tokens[i][k]) for i, g in enumerate(gens)])):
            seen.append(np.array(logits, dtype=np.float64))
    for a_seq, b_seq in zip(alone_logits, batched):
        for a, b in zip(a_seq, b_seq):
            cosines.append(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)))
            agree += int(np.argmax(a) == np.argmax(b))
            total += 1
    for g in gens:
        g.close()
    print(f"int4 batched vs alone: min cosine {min(cosines):.6f}, greedy agreement {agree}/{total}")
    assert min(cosines) > 0.999
    assert agree / total >= 0.95


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


DROP_WAIT = 5
"""Seconds a soak client waits for its dropped stream to be cancelled. A loaded machine's server may finish the
200-token reply before it notices the client left (counted completed: no place held, nothing to wait for), and the
client then waits out the whole limit: 8 drops x 15 s added 2 minutes to a fresh-clone run while the MTP head
trained beside it; the reply itself takes well under this limit."""


@pytest.mark.slow
def test_soak_twelve_clients_on_four_slots(slot_export, photo):
    """12 concurrent openai clients x 6 requests (streamed and not, images, every fifth stream dropped mid-way)
    against ``serve`` on 4 slots with a queue of 8: no wrong answer (each equals its request alone), no 5xx, no
    429; the server's memory after the storm within 50 MB of before, beyond its kept states; /health and
    /metrics agree with what was sent."""
    import base64
    import subprocess
    import sys
    import threading

    import httpx
    from openai import OpenAI

    from qwen35_onnx.bench.streams import free_port

    export = slot_export("ort")
    image = "data:image/jpeg;base64," + base64.b64encode(photo.read_bytes()).decode()
    requests = []
    for i in range(6):
        text = f"Request {i}: say something about " + "cats and dogs " * (i % 3)
        content = [{"type": "text", "text": text}]
        if i % 2:
            content.insert(0, {"type": "image_url", "image_url": {"url": image}})
        requests.append([{"role": "user", "content": content}])
    pipe = Pipeline.from_exported(export)
    alone = []
    for messages in requests:
        reply = pipe.chat(messages, 10, GREEDY)
        alone.append((reply.content, reply.reasoning_content))
    del pipe

    port = free_port()
    cmd = [sys.executable, "-m", "qwen35_onnx.cli", "serve", "--model", str(export), "--port", str(port)]
    env = {**os.environ, "QWEN35_ONNX_THREAD_POOL": "shared"}  # as a user's serve runs: one thread pool
    proc = subprocess.Popen([*cmd, "--max-queue", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        client.chat.completions.create(model="m", messages=requests[1], max_tokens=10, temperature=0)  # warm-up
        before = _rss_bytes(proc.pid)
        wrong, failures, dropped, sent = [], [], [0], [0]
        lock, drop_lock = threading.Lock(), threading.Lock()

        def run(c: int) -> None:
            for k in range(6):
                n = c * 6 + k
                which = (c + k) % len(requests)
                try:
                    with lock:
                        sent[0] += 1
                    if n % 10 == 0:  # every fifth stream: the client leaves after its first chunks
                        # (a reply long enough to be running when the server notices: it is cancelled); one
                        # client at a time, waiting until the server has cancelled it: the server frees the slot
                        # when it notices the closed connection, and a request sent before that would find all
                        # 12 places taken (429), a race of the client, not of the server. Under a loaded machine
                        # the reply (200 tokens) may end before the server notices (then it counts as completed):
                        # after DROP_WAIT seconds it has ended either way. (Cancellation itself:
                        # tests/test_server.py::test_dropped_clients_are_cancelled.)
                        with drop_lock:
                            stream = client.chat.completions.create(
                                model="m", messages=requests[which], max_tokens=200, temperature=0, stream=True
                            )
                            for i, _ in enumerate(stream):
                                if i == 2:
                                    break
                            stream.close()
                            dropped[0] += 1
                            deadline = time.monotonic() + DROP_WAIT
                            while httpx.get(f"{base}/health", timeout=10).json()["cancelled"] < dropped[0]:
                                if time.monotonic() > deadline:
                                    break
                                time.sleep(0.01)
                        continue
                    if n % 2 == 0:
                        stream = client.chat.completions.create(
                            model="m", messages=requests[which], max_tokens=10, temperature=0, stream=True
                        )
                        content, reasoning = "", ""
                        for chunk in stream:
                            if chunk.choices:
                                content += chunk.choices[0].delta.content or ""
                                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                        got = (content, reasoning or None)
                    else:
                        message = (
                            client.chat.completions.create(
                                model="m", messages=requests[which], max_tokens=10, temperature=0
                            )
                            .choices[0]
                            .message
                        )
                        got = (message.content or "", getattr(message, "reasoning_content", None) or None)
                    if got != alone[which]:
                        with lock:
                            wrong.append((which, got, alone[which]))
                except Exception as exc:  # noqa: BLE001 - counted
                    with lock:
                        failures.append(repr(exc))

        threads = [threading.Thread(target=run, args=(c,)) for c in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == [] and wrong == []
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{base}/health").json())["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health["running"] == 0 and health["waiting"] == 0 and health["slots_busy"] == 0
        assert health["rejected"] == 0 and health["failed"] == 0
        assert health["completed"] + health["cancelled"] == sent[0] + 1  # (the warm-up)
        assert health["cancelled"] <= dropped[0]
        metrics = httpx.get(f"{base}/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] != "#"}
        assert values["qwen35_onnx_decode_batch_rows_count"] == health["decode_steps"]
        assert values["qwen35_onnx_decode_batch_rows_sum"] == health["decode_rows"]
        assert health["decode_rows"] / health["decode_steps"] > 1.5  # requests decoded together
        statuses = [key for key in values if key.startswith("qwen35_onnx_requests_total{")]
        assert statuses and not any('status="5' in key or 'status="429' in key for key in statuses)
        kept = (health["state_cache"] or {}).get("bytes", 0)
        growth = _rss_bytes(proc.pid) - before
        print(f"soak: RSS growth {growth / 1e6:.1f} MB, kept states {kept / 1e6:.1f} MB, {dropped[0]} dropped")
        assert growth - kept < 50e6
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_streams_bench_counts_every_token_and_copies_nothing_per_step(slot_export):
    from qwen35_onnx.bench.streams import group_load, report_lines, step_scaling, summarize

    pipe = _pipe(slot_export, "onnxruntime-ort")
    load = group_load(pipe, 3, 6)
    assert load.streams == 3 and load.tokens == 18 and load.decode_tokens_per_s > 0
    assert load.extra["bytes_copied_per_step"] == 0 and load.extra["bytes_copied_per_join"] > 0
    assert load.extra["mean_rows"] > 1 and load.itl_p95_ms >= load.itl_p50_ms > 0
    with pytest.raises(ValueError, match="5 streams need an export with --slots 5 or more"):
        group_load(pipe, 5, 6)
    # two streams, tokens at 0.1 s steps after a start at 0: 4 decoded tokens over 0.3 s
    fixed = summarize(2, 0.0, [[1.0, 1.1, 1.2], [1.1, 1.2, 1.3]])
    assert fixed.tokens == 6 and abs(fixed.decode_tokens_per_s - 4 / 0.3) < 1e-9
    assert abs(fixed.itl_p50_ms - 100) < 1e-6 and abs(fixed.ttft_p50_ms - 1050) < 1e-6
    # both decoding from 1.1 s (the second stream's first token) to 1.2 s (the first's last): 2 tokens in 0.1 s
    assert abs(fixed.extra["all_decoding_tokens_per_s"] - 20) < 1e-6
    scaling = step_scaling(pipe, [1, 2], steps=3)
    assert [r["rows"] for r in scaling] == [1, 2] and scaling[0]["x_1_row"] == 1 and scaling[1]["step_ms"] > 0
    assert abs(scaling[1]["ideal_speedup"] - 2 / scaling[1]["x_1_row"]) < 1e-9
    assert pipe.slot_pool.busy == 0  # every sequence it held is closed
    report = {
        "run": {"cpu": "CPU", "date": "2026-12-05", "version": "0.10.0"},
        "threads": 2,
        "export": "x/ort-int4-slots-4",
        "max_tokens": 6,
        "slots_in_process": [load.to_dict(), fixed.to_dict()],
        "step_scaling": scaling,
        "servers": {"ours": {"tokens_per_s": 10.0, "arrival_ttft_ms": {"p50": 5.0, "p95": 9.0}}},
    }
    lines = report_lines(report)
    assert lines[0].startswith("Streams at once (CPU, 2 threads, 2026-12-05, v0.10.0)")
    assert any(line.startswith("| ours | 10.0 | 5 | 9 |") for line in lines)
    assert any(line.startswith(f"| 2 | {scaling[1]['step_ms']:.1f} |") for line in lines)


def test_a_group_refuses_to_wait_for_slots_held_outside_it(slot_export):
    """Every slot held by streams outside the group: its waiting generation ends with NoFreeSlot at once (it would
    otherwise wait forever, nothing of the group being able to free one)."""
    pipe = _pipe(slot_export, "onnxruntime-ort")
    outside = [pipe.stream(None, "x", max_new_tokens=20, sampling=GREEDY) for _ in range(SLOTS)]
    for stream in outside:
        next(iter(stream))  # each holds a slot now
    with pytest.raises(NoFreeSlot, match=f"all {SLOTS} decode slots are held by generations outside this group"):
        pipe.generate(None, "y", max_new_tokens=3, group=pipe.group())
    for stream in outside:
        stream.close()
    assert pipe.generate(None, "y", max_new_tokens=3, group=pipe.group()).finish_reason == "length"


def test_an_interrupted_decode_step_ends_the_rows_it_left_unread(slot_export):
    """An exception out of a stream's observer in the middle of a round (a Ctrl-C in a notebook): the rows whose
    logits no token loop read end with an error instead of feeding a stale token; the others go on as alone."""
    pipe = _pipe(slot_export, "onnxruntime-ort")
    alone = [pipe.generate(None, p, max_new_tokens=8, sampling=GREEDY).token_ids for p in ("a", "b b", "c c c")]
    group = pipe.group()
    streams = [pipe.stream(None, p, max_new_tokens=8, sampling=GREEDY, group=group) for p in ("a", "b b", "c c c")]
    seen = []

    def interrupt(piece):
        seen.append(piece)
        if len(seen) == 3:
            raise KeyboardInterrupt

    streams[0].observe(interrupt)
    with pytest.raises(KeyboardInterrupt):
        group.run()
    group.run()
    assert streams[0].result.token_ids == alone[0]
    for stream, tokens in zip(streams[1:], alone[1:]):
        kept = stream.result.token_ids
        assert kept == tokens or (stream.result.finish_reason is None and kept == tokens[: len(kept)])
    assert pipe.slot_pool.busy == 0


def test_a_dynamic_kv_export_runs_its_group_one_at_a_time(dynamic_export):
    """No decode slots on a dynamic-KV export: a group (and so ``serve``) runs its generations one after another,
    each as alone."""
    from qwen35_onnx.server.scheduler import Scheduler

    pipe = Pipeline.from_exported(dynamic_export)
    alone = [pipe.generate(None, p, max_new_tokens=5, sampling=GREEDY).token_ids for p in ("one", "two two")]
    group = pipe.group()
    assert group.pool is None and group.slots == 1
    streams = [pipe.stream(None, p, max_new_tokens=5, sampling=GREEDY, group=group) for p in ("one", "two two")]
    group.run()
    assert [s.result.token_ids for s in streams] == alone and group.steps == 8
    assert Scheduler(pipe, 2).state()["slots"] == 1


THREAD_PROBE = """
import json, os, sys, warnings
from qwen35_onnx.runtime.onnxruntime.sessions import shared_thread_pool
if sys.argv[2] == "shared":
    assert shared_thread_pool(2) and shared_thread_pool(2)  # the same size again: the same pool
from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.sampling import SamplingConfig
pipe = Pipeline.from_exported(sys.argv[1], threads=2)
messages = [{"role": "user", "content": "Tell me about rivers and the sea and the stars above them."}]
tokens = pipe.chat(messages, 6, SamplingConfig(), chat_template_kwargs={"enable_thinking": False}).generation.token_ids
sessions = 2 + len(pipe.backend.graphs.loaded_chunks)  # decode, the any-grid vision graph, the chunks run
errors = []
if sys.argv[2] == "shared":  # a pool's size is fixed
    for attempt in (lambda: shared_thread_pool(1), lambda: Pipeline.from_exported(sys.argv[1], threads=1)):
        try:
            attempt()
        except ValueError as exc:
            errors.append(str(exc))
threads = len(os.listdir("/proc/self/task"))
if sys.argv[2] == "own":  # other code makes ONNX Runtime's global pools first: ours run on them, with a warning
    import onnxruntime
    from qwen35_onnx.runtime.backend import RuntimeOptions
    from qwen35_onnx.runtime.select import share_threads
    onnxruntime.set_global_thread_pool_sizes(1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        share_threads(RuntimeOptions(threads=2))
    errors = [str(w.message) for w in caught]
    again = Pipeline.from_exported(sys.argv[1], threads=2)
    assert again.generate(None, "hello", max_new_tokens=2, sampling=SamplingConfig()).token_ids
print(json.dumps({"tokens": tokens, "threads": threads, "sessions": sessions, "errors": errors}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_sessions_of_an_export_share_one_thread_pool(slot_export, monkeypatch):
    """With the process's shared thread pool (what the command line and the server use) every ONNX Runtime
    session of an export runs on one pool of worker threads, no pool per graph whose idle threads spin on the
    cores the next graph needs; without it (a Python program's default) each session has its own; the tokens are
    the same. A pool of another size is refused, naming both; global pools made by other code first are used,
    with a warning."""
    runs = {}
    env = {**os.environ, "QWEN35_ONNX_THREAD_POOL": "shared"}
    for mode in ("shared", "own"):
        out = subprocess.run(
            [sys.executable, "-c", THREAD_PROBE, str(slot_export("ort")), mode],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    shared, own = runs["shared"], runs["own"]
    assert shared["tokens"] == own["tokens"]
    assert shared["sessions"] >= 3, shared  # decode, vision and a chunk graph at least
    # a pool each: one worker thread more per loaded session of 2 threads (the calling thread is the other)
    assert own["threads"] - shared["threads"] >= shared["sessions"] - 1, runs
    (warned,) = own["errors"]
    assert "made ONNX Runtime's global thread pools first: the sessions run on those" in warned
    pool, load = shared["errors"]
    assert "pool has 2 threads; 1 cannot be had in the same process" in pool
    assert "threads 1: this process runs ONNX Runtime on one shared pool of 2 threads" in load
    from qwen35_onnx.runtime.select import share_threads

    monkeypatch.setenv("QWEN35_ONNX_THREAD_POOL", "global")
    with pytest.raises(ValueError, match=r"QWEN35_ONNX_THREAD_POOL 'global' must be 'shared' \(the default\) or"):
        share_threads()


def test_a_newcomer_among_decoding_streams_prefills_within_the_round_budget(slot_export, monkeypatch):
    """While others decode, a newcomer's prefill runs chunks of at most UNDER_LOAD_PREFILL_TOKENS and at most
    that many positions between two decode steps (here 16, on an export with chunks 8 and 32: two 8-token
    chunks a round); alone it takes the larger chunks; its tokens are the same either way."""
    import qwen35_onnx.group as group_module

    monkeypatch.setattr(group_module, "UNDER_LOAD_PREFILL_TOKENS", 16)
    pipe = _pipe(slot_export, "onnxruntime-ort")
    events: list[int | str] = []
    run_chunk, pool_step = pipe.backend.run_chunk, pipe.slot_pool.step

    def chunk(size, feeds, states):
        events.append(size)
        return run_chunk(size, feeds, states)

    def step(rows):
        events.append("step")
        return pool_step(rows)

    monkeypatch.setattr(pipe.backend, "run_chunk", chunk)
    monkeypatch.setattr(pipe.slot_pool, "step", step)
    prompt = "Tell me everything about rivers, the sea, the stars above them and the boats on them. " * 2
    alone = pipe.generate(None, prompt, max_new_tokens=5, sampling=GREEDY, group=pipe.group())
    assert 32 in events, events
    group = pipe.group()
    running = pipe.stream(None, "x", max_new_tokens=40, sampling=GREEDY, group=group)
    next(iter(running))  # decoding now
    events.clear()
    newcomer = pipe.stream(None, prompt, max_new_tokens=5, sampling=GREEDY, group=group)
    while not newcomer.result.token_ids:
        group.step()
    chunks = [e for e in events if e != "step"]
    assert chunks and set(chunks) == {8}, events
    rounds = "".join("s" if e == "step" else "c" for e in events).split("s")
    assert max(len(r) for r in rounds) == 2, events  # two 8-token chunks between two steps, never more
    group.run()
    assert newcomer.result.token_ids == alone.token_ids


def test_a_step_of_fewer_rows_reuses_dropped_logits_and_never_overwrites_held_ones(slot_export):
    """With a dynamic row axis a step of fewer rows than the slots writes its logits into a prefix of the
    decoder's array: a caller's view stays as it was over later steps (they get a new array), and once
    dropped the array is written again two steps later (no new array, no binding made again, per step)."""
    pipe = _pipe(slot_export, "onnxruntime-ort")
    pool = pipe.slot_pool
    g = Generation(pipe.backend, pipe.prepare(None, "Tell me about rivers."), pool=pool)
    token = int(np.argmax(g.prefill()))
    held = g.step(token)
    assert pool.rows == 1 and np.shares_memory(held, pool.decoder.logits[(pool.decoder.steps - 1) % 2])
    kept = held.copy()
    for _ in range(3):  # steps of both parities while `held` is alive
        token = int(np.argmax(got := g.step(token)))
        assert not np.shares_memory(got, held)
    np.testing.assert_array_equal(held, kept)
    del held, kept, got
    bindings = dict(pool.decoder.bindings)
    addresses = []
    for _ in range(4):
        got = g.step(token)
        token = int(np.argmax(got))
        addresses.append(got.ctypes.data)
        del got
    assert addresses[0] == addresses[2] and addresses[1] == addresses[3] and addresses[0] != addresses[1]
    assert all(pool.decoder.bindings[key] is binding for key, binding in bindings.items())
    g.close()


@pytest.mark.slow
def test_identical_greedy_requests_of_the_three_apis_at_once_get_their_reply_alone(slot_export, tmp_path):
    """Two identical greedy requests per API (chat completions, Responses, Messages), six at once against ``serve``
    on the slots export: each gets the text the same request gets alone, and the three APIs' texts are one (one
    conversation core under every route, its slots shared)."""
    import concurrent.futures

    import httpx

    from .test_server import ServerProcess

    ask = [{"role": "user", "content": "Name the colours of a rainbow."}]
    bodies = {
        "/v1/chat/completions": {"messages": ask, "max_tokens": 12, "chat_template_kwargs": NO_THINKING},
        "/v1/responses": {"input": ask[0]["content"], "max_output_tokens": 12, "reasoning": {"effort": "none"}},
        "/v1/messages": {"messages": ask, "max_tokens": 12},  # (thinking absent: off, as in Anthropic's API)
    }

    def text(path: str) -> str:
        response = httpx.post(f"{proc.url}{path}", json={"model": "m", "temperature": 0, **bodies[path]}, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        if path == "/v1/chat/completions":
            return data["choices"][0]["message"]["content"].strip()
        if path == "/v1/responses":
            parts = [p["text"] for item in data["output"] if item["type"] == "message" for p in item["content"]]
            return "".join(parts).strip()
        return "".join(b["text"] for b in data["content"] if b["type"] == "text").strip()

    proc = ServerProcess(["--model", str(slot_export("ort")), "--port", "0", "--max-queue", "8"], tmp_path / "s.log")
    try:
        alone = {path: text(path) for path in bodies}
        assert len(set(alone.values())) == 1, alone
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda path: (path, text(path)), [*bodies, *bodies]))
        for path, got in together:
            assert got == alone[path], path
    finally:
        proc.stop()
