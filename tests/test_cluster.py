"""``serve --replicas N``: the Ray Serve application (``qwen35_onnx.cluster``).

Fast tests: conversation keys and the router's table (property-based), the options and their
errors, the ASGI bridge a replica answers through, the merged metrics and health. The slow test runs
a local Ray cluster of 2 replicas x 1 thread over conftest's chunked export: 6 OpenAI clients each
holding a 4-turn conversation (every later turn comes home: cached tokens, answers equal to one
pipeline's), streamed == whole, a client that leaves mid-stream, stored Responses API responses found again (their
continuations and GETs go to the replica that stores them), Anthropic Messages, then one replica's process killed
under load (no wrong answer; only its in-flight requests fail, with a retryable error; Ray restarts
it; later requests succeed), ``/health`` and ``/metrics`` per replica and aggregated.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request  # module level: the routes' annotations are resolved here
from fastapi.responses import StreamingResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.cluster.conversations import ConversationTable, conversation_keys
from qwen35_onnx.cluster.options import ClusterOptions, replica_threads
from qwen35_onnx.runtime.backend import RuntimeOptions
from qwen35_onnx.runtime.sampling import SamplingConfig
from qwen35_onnx.server.options import ServerOptions

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingConfig(temperature=0.0)
NO_THINKING = {"enable_thinking": False}
MAX_BODY = 256 * 1024

messages_strategy = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=6)}),
    min_size=1,
    max_size=6,
)


# ---- conversation keys and the table --------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(a=messages_strategy, b=messages_strategy)
def test_keys_agree_exactly_on_the_common_leading_messages(a, b):
    """Key i of two requests is equal iff their first i+1 messages are (and the tools): a table that
    recorded request ``a`` matches ``b`` on the longest run of leading messages ``a`` had whole."""
    ka, kb = conversation_keys({"messages": a}), conversation_keys({"messages": b})
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert [x == y for x, y in zip(ka, kb)] == [i < common for i in range(min(len(a), len(b)))]
    table = ConversationTable()
    table.record("r1", ka)
    found = table.matches(kb, ["r1", "r2"])
    assert found["r2"] == 0
    assert found["r1"] == (len(a) if common >= len(a) else 0)  # only a's last key is recorded


def test_keys_depend_on_tools_and_template_switches_and_skip_bodies_without_messages():
    messages = [{"role": "user", "content": "hi"}]
    plain = conversation_keys({"messages": messages})
    assert plain != conversation_keys({"messages": messages, "tools": [{"type": "function"}]})
    assert plain != conversation_keys({"messages": messages, "chat_template_kwargs": NO_THINKING})
    assert plain == conversation_keys({"messages": messages, "temperature": 0.5, "max_tokens": 3})
    for body in (None, [], "x", {}, {"messages": "hi"}):
        assert conversation_keys(body) == ()


def test_keys_of_the_responses_and_messages_apis_and_of_stored_responses():
    """A Responses request's keys run over its input items (a string is one), a Messages request's over its
    messages, each after its own prompt fields; a continuation of a stored response starts with the response's
    key, which the table records for the replica that stores it."""
    from qwen35_onnx.cluster.conversations import response_key

    items = [{"role": "user", "content": "q1"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]
    responses = conversation_keys({"input": items, "instructions": "Be brief."}, "/v1/responses")
    assert (
        len(responses) == 2
        and responses[0] == conversation_keys({"input": items[:1], "instructions": "Be brief."}, "/v1/responses")[0]
    )
    assert responses != conversation_keys({"input": items}, "/v1/responses")  # the instructions are in every key
    assert len(conversation_keys({"input": "q1"}, "/v1/responses")) == 1
    anthropic = conversation_keys({"messages": items[:1], "system": "S"}, "/v1/messages")
    assert anthropic != conversation_keys({"messages": items[:1]}, "/v1/messages")
    assert conversation_keys({"messages": items[:1]}, "/v1/messages/count_tokens") == ()
    follow = conversation_keys({"previous_response_id": "resp_1", "input": "q2"}, "/v1/responses")
    assert follow[0] == response_key("resp_1") and len(follow) == 2
    table = ConversationTable()
    table.record("a", responses, also=(response_key("resp_1"),))
    assert table.matches(follow, ["a", "b"]) == {"a": 1, "b": 0}  # the continuation goes where the response is
    assert table.matches((response_key("resp_1"),), ["a", "b"])["a"] == 1  # so does GET /v1/responses/resp_1


def test_table_follows_a_conversation_and_stays_bounded():
    table = ConversationTable(max_keys=2)
    chat = [{"role": "user", "content": "q1"}]
    table.record("a", conversation_keys({"messages": chat}))
    chat += [{"role": "assistant", "content": "r1"}, {"role": "user", "content": "q2"}]
    assert table.matches(conversation_keys({"messages": chat}), ["a", "b"]) == {"a": 1, "b": 0}
    table.record("b", conversation_keys({"messages": chat}))  # sent away (load): b now holds more
    chat += [{"role": "assistant", "content": "r2"}, {"role": "user", "content": "q3"}]
    assert table.matches(conversation_keys({"messages": chat}), ["a", "b"]) == {"a": 1, "b": 3}
    for i in range(3):
        table.record("a", conversation_keys({"messages": [{"role": "user", "content": f"other {i}"}]}))
    assert table.matches(conversation_keys({"messages": chat}), ["a"]) == {"a": 0}  # dropped, oldest first
    assert len(table) == 3  # 2 kept for a, 1 for b
    table.keep_only(["a"])
    assert table.matches(conversation_keys({"messages": chat}), ["b"]) == {"b": 0}
    with pytest.raises(ValueError, match="max_keys"):
        ConversationTable(0)


# ---- options ---------------------------------------------------------------------------------------
def test_cluster_options_and_thread_shares_are_checked(monkeypatch):
    monkeypatch.delenv("QWEN35_ONNX_THREADS", raising=False)
    assert replica_threads(2, RuntimeOptions(), cpus=2) == 1
    assert replica_threads(3, RuntimeOptions(), cpus=8) == 2
    assert replica_threads(2, RuntimeOptions(threads=3), cpus=8) == 3
    with pytest.raises(ValueError, match=r"--replicas 3 x --threads 1 = 3 threads, more than the 2 CPUs"):
        replica_threads(3, RuntimeOptions(), cpus=2)
    with pytest.raises(ValueError, match=r"--replicas 2 x --threads 2 = 4 threads, more than the 2 CPUs"):
        replica_threads(2, RuntimeOptions(threads=2), cpus=2)
    with pytest.raises(ValueError, match="--replicas must be >= 1, got 0"):
        replica_threads(0, RuntimeOptions(), cpus=2)
    monkeypatch.setenv("QWEN35_ONNX_THREADS", "1")  # as for a single server: the threads when --threads is 0
    assert replica_threads(2, RuntimeOptions(), cpus=8) == 1
    with pytest.raises(ValueError, match="3 x --threads 1 = 3 threads"):
        replica_threads(3, RuntimeOptions(), cpus=2)
    for bad, fragment in [
        (ClusterOptions(replicas=-1), "--replicas must be an integer >= 1"),
        (ClusterOptions(replicas=True), "--replicas must be an integer"),
        (ClusterOptions(replicas=2, routing="random"), "--routing must be one of conversation, round-robin"),
        (ClusterOptions(replicas=2, route_imbalance=-1), "--route-imbalance must be >= 0"),
        (ClusterOptions(routing="round-robin"), "--routing only apply with --replicas N"),
        (ClusterOptions(route_imbalance=2, address="auto"), "--route-imbalance, --ray-address only apply"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            bad.validate()


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = (
        f"{prelude}\nimport sys\nfrom qwen35_onnx.cli import main\nsys.argv = ['qwen35-onnx', *{list(args)!r}]\nmain()"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_serve_replicas_errors_are_one_line(tmp_path):
    """Bad --replicas / --threads, an export that is not one, and no Ray installed: one ``error:``
    line naming the value, before Ray starts."""
    cpus = len(os.sched_getaffinity(0))
    cases = [
        (["--replicas", "-2"], "--replicas must be an integer >= 1 (0: no Ray), got -2"),
        (["--replicas", str(cpus + 1), "--threads", "1"], f"more than the {cpus} CPUs"),
        (["--replicas", "2", "--routing", "nearest"], "--routing must be one of conversation, round-robin"),
        (["--replicas", "1"], "manifest"),
    ]
    for extra, fragment in cases:
        result = run_cli("serve", "--model", str(tmp_path), *extra)
        assert result.returncode != 0
        assert fragment in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    no_ray = run_cli(
        "serve", "--model", str(tmp_path), "--replicas", "2", prelude="import sys; sys.modules['ray'] = None"
    )
    assert no_ray.returncode != 0
    assert "pip install 'qwen35-onnx[cluster]'" in no_ray.stderr, no_ray.stderr


def test_build_app_arguments_are_checked():
    from qwen35_onnx.cluster.app import _typed, build_app
    from qwen35_onnx.options import declared

    with pytest.raises(ValueError, match="build_app needs model=<export folder>"):
        build_app({})
    with pytest.raises(ValueError, match=r"unknown argument 'replica'; known: model, .*replicas"):
        build_app({"model": "/x", "replica": "2"})
    with pytest.raises(ValueError, match=r"unknown argument 'address'"):  # the command line's; Ray's tools choose
        build_app({"model": "/x", "address": "auto"})
    options = {o.name: o for group in (ClusterOptions, RuntimeOptions, ServerOptions) for o in declared(group)}
    assert _typed(options["replicas"], "3") == 3 and _typed(options["replicas"], 3) == 3
    assert _typed(options["host_state_roundtrip"], "true") is True
    assert _typed(options["allowed_image_dir"], "/tmp") == Path("/tmp")
    for option, value, fragment in [
        ("replicas", "two", "replicas must be an integer, got 'two'"),
        ("max_queue", True, "max_queue must be an integer, got True"),
        ("max_queue", 2.5, "max_queue must be an integer, got 2.5"),
        ("host_state_roundtrip", "maybe", "host_state_roundtrip must be true or false, got 'maybe'"),
        ("host_state_roundtrip", 1, "host_state_roundtrip must be true or false, got 1"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            _typed(options[option], value)


def test_build_app_reads_the_api_key_from_the_environment(bigram_export, monkeypatch):
    """As the command line does: an application built by ``serve run`` without ``api_key`` takes
    ``$QWEN35_ONNX_API_KEY`` (a deployment must not come up open by mistake)."""
    from qwen35_onnx.cluster.app import build_app

    monkeypatch.setenv("QWEN35_ONNX_API_KEY", "from-env")
    app = build_app({"model": str(bigram_export), "replicas": "1", "threads": "1"})
    ingress_args = app._bound_deployment.init_args
    assert ingress_args[2].api_key == "from-env"  # (replicas, board, options, expected)
    explicit = build_app({"model": str(bigram_export), "replicas": "1", "threads": "1", "api_key": "given"})
    assert explicit._bound_deployment.init_args[2].api_key == "given"


# ---- the ASGI bridge, metrics and health -------------------------------------------------------------
def test_a_forwarded_request_runs_through_the_application_and_its_client_can_leave():
    """The replica's bridge: a whole reply (start + body), a streamed one part by part, and a stream
    whose reader stops: the application sees ``http.disconnect``."""
    from qwen35_onnx.cluster.replica import ForwardedRequest, asgi_messages

    app = FastAPI()
    seen = {}

    @app.post("/echo")
    async def echo(request: Request):
        return {"got": (await request.body()).decode(), "auth": request.headers.get("authorization")}

    @app.get("/stream")
    async def stream(request: Request):
        async def parts():
            try:
                for i in range(1000):
                    yield f"part {i}\n"
                    await asyncio.sleep(0.005)
            finally:
                seen["gone"] = await request.is_disconnected()

        return StreamingResponse(parts(), media_type="text/event-stream")

    async def run():
        echo_req = ForwardedRequest("POST", "/echo", b"", ((b"authorization", b"Bearer k"),), b"hello")
        messages = [m async for m in asgi_messages(app, echo_req)]
        assert messages[0]["status"] == 200 and b'"got":"hello"' in messages[1]["body"]
        assert b'"auth":"Bearer k"' in messages[1]["body"]
        reader = asgi_messages(app, ForwardedRequest("GET", "/stream", b"", (), b""))
        got = []
        async for message in reader:
            got.append(message)
            if len(got) == 4:
                break
        await reader.aclose()
        await asyncio.sleep(0.05)
        return got

    got = asyncio.run(run())
    assert got[0]["type"] == "http.response.start" and [m["body"] for m in got[1:3]] == [b"part 0\n", b"part 1\n"]
    assert seen["gone"] is True


def test_metrics_carry_a_replica_label_and_health_adds_up():
    from prometheus_client.parser import text_string_to_metric_families

    from qwen35_onnx.cluster.metrics import STALE_SECONDS, ClusterMetrics, aggregate_health
    from qwen35_onnx.server.metrics import ServerMetrics

    reports = {}
    for name, (running, hits) in {"r1": (1, 2), "r2": (0, 3), "old": (5, 7)}.items():
        metrics = ServerMetrics(lambda: {"running": 0, "waiting": 0, "slots": 1, "slots_busy": 0})
        metrics.requests.labels("/v1/chat/completions", "200").inc(hits)
        health = {"status": "ok", "running": running, "state_cache": {"hits": hits, "cached_tokens": 10 * hits}}
        age = STALE_SECONDS + 1 if name == "old" else 0.5
        reports[name] = {"metrics": metrics.render()[0].decode(), "health": health, "pid": 1, "age_s": age}
    cluster = ClusterMetrics(lambda: reports, lambda: {"home": 4, "new": 2})
    cluster.retries.inc()
    families = {f.name: f for f in text_string_to_metric_families(cluster.render().decode())}
    requests = {
        s.labels["replica"]: s.value for s in families["qwen35_onnx_requests"].samples if s.name.endswith("_total")
    }
    assert requests == {"r1": 2.0, "r2": 3.0}  # a replica that stopped reporting is left out
    up = {s.labels["replica"]: s.value for s in families["qwen35_onnx_replica_up"].samples}
    assert up == {"old": 0.0, "r1": 1.0, "r2": 1.0}
    routes = {s.labels["decision"]: s.value for s in families["qwen35_onnx_cluster_routes"].samples}
    assert routes == {"home": 4.0, "new": 2.0}
    assert families["qwen35_onnx_cluster_retries"].samples[0].value == 1.0
    health = aggregate_health(reports, expected=3)
    assert health["status"] == "degraded" and health["replicas_up"] == 2 and health["running"] == 1
    assert health["state_cache_hits"] == 5 and health["state_cache_cached_tokens"] == 50
    assert [r["up"] for r in health["replicas"]] == [False, True, True]
    assert [r["status"] for r in health["replicas"]] == ["silent", "ok", "ok"]
    assert aggregate_health({}, expected=2)["status"] == "down"


# ---- a local Ray cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_export(image_exports) -> Path:
    """Conftest's chunked ``--ops ort`` export (capacity 256, chunks 8 and 32): kept states work."""
    return image_exports("any-ort")


def conversation_turns(url: str, client_id: int, turns: int = 4, stream: bool = False) -> list[tuple[list, object]]:
    """One client's conversation: (messages sent, reply) per turn."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": f"Conversation {client_id} begins with a question about boats?"}]
    record = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": f"And question {turn} of conversation {client_id}?"})
        reply = client.chat.completions.create(
            model="m",
            messages=list(messages),
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        record.append((list(messages), reply))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return record


@pytest.mark.slow
def test_two_replicas_route_conversations_home_and_survive_a_killed_replica(cluster_export, tmp_path):
    import openai

    from qwen35_onnx.pipeline import Pipeline

    from .test_server import ServerProcess

    proc = ServerProcess(
        [
            *("--model", str(cluster_export), "--port", "0", "--replicas", "2", "--threads", "1"),
            *("--max-queue", "16", "--max-body-bytes", str(MAX_BODY)),
            # every resent turn goes home whatever the load (6 clients: at most 6 requests apart); with the default
            # 4 a loaded machine's slow replicas sent a turn elsewhere, as the policy says; this test is about
            # where the state is kept, not the load side of the policy (benchmarks/cluster_load.py measures that)
            *("--route-imbalance", "6"),
        ],
        tmp_path / "cluster.log",
    )
    pipe = Pipeline.from_exported(cluster_export)
    try:
        url = proc.url
        health = proc.health()
        assert health["status"] == "ok" and health["replicas_up"] == 2, health
        pids = {r["pid"] for r in health["replicas"]}
        assert len(pids) == 2 and os.getpid() not in pids

        # 6 clients, a 4-turn conversation each, at once
        records: dict[int, list] = {}
        threads = [
            threading.Thread(target=lambda i=i: records.update({i: conversation_turns(url, i)})) for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(records) == list(range(6))
        for i, record in records.items():
            for turn, (messages, reply) in enumerate(record):
                fresh = pipe.chat(messages, 6, GREEDY, chat_template_kwargs=NO_THINKING)
                assert reply.choices[0].message.content == fresh.content, f"conversation {i} turn {turn + 1}"
                cached = reply.usage.prompt_tokens_details.cached_tokens
                if turn >= 1:
                    assert cached > 0, f"conversation {i} turn {turn + 1} was not sent home: {cached} cached tokens"
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'qwen35_onnx_cluster_routes_total{decision="home"} 18.0' in metrics, metrics
        assert 'qwen35_onnx_cluster_routes_total{decision="new"} 6.0' in metrics

        # streamed == whole, through the ingress
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        body = dict(model="m", messages=[{"role": "user", "content": "Stream it?"}], max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**body).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True) if c.choices
        )
        assert streamed == whole

        # a client that leaves mid-stream: its generation is cancelled on its replica
        before = proc.health()["cancelled"]
        long = {**body, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 6:
                    break
        proc.wait_health(lambda h: h["cancelled"] == before + 1, timeout=15)

        # errors answered as the single server does (by a replica) or by the ingress (body limit)
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        huge = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (MAX_BODY + 1), timeout=60)
        assert huge.status_code == 413 and "--max-body-bytes" in huge.json()["error"]["message"]

        # the Responses API: a stored response lives on one replica; its continuations and GET go there
        for n in range(3):
            ask = dict(model="m", max_output_tokens=6, temperature=0, reasoning={"effort": "none"})
            first = client.responses.create(input=f"Responses conversation {n} is about kites?", **ask)
            follow = client.responses.create(input="And then?", previous_response_id=first.id, **ask)
            assert follow.usage.input_tokens_details.cached_tokens > 0, n
            assert [client.responses.retrieve(first.id).id for _ in range(3)] == [first.id] * 3
        # Anthropic's Messages API through the ingress, its errors in its own shape (from a replica, and the ingress)
        hi = [{"role": "user", "content": "Hi"}]
        message = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 6, "messages": hi}, timeout=60)
        assert message.status_code == 200 and message.json()["type"] == "message", message.text
        bad = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 0, "messages": hi}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
        huge = httpx.post(f"{url}/v1/messages", content=b"x" * (MAX_BODY + 1), timeout=60)
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large", huge.text

        # kill one replica's process under load
        victim = proc.health()["replicas"][0]["pid"]
        answers, failures = [], []
        deadline = time.monotonic() + 4

        def load(i: int) -> None:
            n = 0
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            while time.monotonic() < deadline:
                messages = [{"role": "user", "content": f"Load request {(i + n) % 3}?"}]  # 3 answers to check
                n += 1
                try:
                    if i % 2:
                        text = c.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
                        text = text.choices[0].message.content
                    else:
                        chunks = c.chat.completions.create(
                            model="m", messages=messages, max_tokens=24, temperature=0, stream=True
                        )
                        text = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
                    answers.append((messages, text))
                except openai.APIError as exc:
                    failures.append(exc)

        workers = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for w in workers:
            w.start()
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        for w in workers:
            w.join()
        back = proc.wait_health(
            lambda h: h["replicas_up"] == 2 and victim not in [r["pid"] for r in h["replicas"] if r["up"]], timeout=90
        )
        assert back["status"] == "ok"
        assert answers, "no request succeeded under load"
        expected = {}
        for messages, text in answers:
            key = messages[0]["content"]
            expected.setdefault(key, pipe.chat(messages, 24, GREEDY).content)
            assert text == expected[key], messages
        for exc in failures:  # only the killed replica's streams that had begun
            assert "failed mid-stream" in str(exc) and "retry the request" in str(exc), exc
        assert len(failures) <= 6, failures
        after = conversation_turns(url, 99, turns=2)
        assert after[1][1].usage.prompt_tokens_details.cached_tokens > 0
        print(f"under load: {len(answers)} answers, {len(failures)} failed mid-stream; {metrics.count('replica=')}")
    finally:
        proc.stop()
    log = (tmp_path / "cluster.log").read_text()
    assert "unexpected error in " not in log and "Traceback" not in log, log
