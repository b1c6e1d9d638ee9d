"""Issue acceptance (`qwen35-onnx serve`): a real server process, the official `openai` client and
httpx. The model is a "bigram checkpoint" (tests/bigram.py) with the Qwen3.5-style thinking
template: for the thinking prompt it writes ``hm,ok</think>`` and then ``é日→ `` forever (multi-byte
characters split over byte tokens, no end of sequence), so replies are long, deterministic and
checkable. The server runs with ``--max-queue 1`` and an API key. Everything that needs the export
(conftest's ``bigram_export``, built once per run) or a server process is marked slow."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from .bigram import CAPACITY, CYCLE, CYCLE_TOKENS, LEAD_TOKENS, PROMPT_TOKENS, REASONING

KEY = "sk-test-key"
MAX_BODY = 1024 * 1024
MAX_IMAGE = 100_000
ROOT = Path(__file__).resolve().parents[1]
# A weather tool whose string arguments are bounded (maxLength, enum), so that constrained calls end even
# where the model's own choice is no better than chance (the bigram model outside its chain).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}
# A nested schema (object in object, enum, array, required fields), strict as OpenAI's strict mode wants it.
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "age": {"type": "integer"},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "indoor": {"type": "boolean"}},
            "required": ["city", "indoor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "age", "home"],
    "additionalProperties": False,
}


def expected_content(n_tokens: int) -> str:
    """Content of a thinking reply of ``n_tokens`` tokens that ends on a character boundary."""
    cycles, rest = divmod(n_tokens - LEAD_TOKENS, CYCLE_TOKENS)
    assert rest == 0
    return CYCLE * cycles


# ---- fixtures: server process (the export: conftest's bigram_export, shared with test_export_contract) ------
class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qwen35_onnx.cli", "serve", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 120
        while True:
            text = log_path.read_text()
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", text)
            if found:
                self.url = found.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{text}")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_health(self, check, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()
            if check(state):
                return state
            assert time.monotonic() < deadline, f"/health never matched: {state}"
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory, photo) -> Path:
    folder = tmp_path_factory.mktemp("images")
    (folder / "photo.jpg").write_bytes(photo.read_bytes())
    return folder


MAX_VIDEO_SECONDS = 5.0


@pytest.fixture(scope="module")
def server(bigram_export, image_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "QWEN35_ONNX_API_KEY": KEY}  # the key comes from the environment
    proc = ServerProcess(
        [
            "--model",
            str(bigram_export),
            "--port",
            "0",
            "--model-name",
            "bigram",
            "--max-queue",
            "1",
            "--max-body-bytes",
            str(MAX_BODY),
            "--max-image-bytes",
            str(MAX_IMAGE),
            "--allowed-image-dir",
            str(image_dir),
            "--max-video-seconds",
            str(MAX_VIDEO_SECONDS),
            "--threads",
            "1",
        ],
        log_path,
        env,
    )
    yield proc
    proc.stop()
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert not re.search(r'" 5\d\d', log), log  # no 5xx in the access log


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, body, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        kwargs["json"] = body
    else:
        kwargs["content"] = body
    kwargs.setdefault("timeout", 120)
    return httpx.post(f"{server.url}/v1/chat/completions", headers=headers, **kwargs)


def hi(text: str = "Hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def collect(stream) -> tuple[str, str, list, object]:
    """(reasoning, content, chunks, usage) of an openai chat-completion stream."""
    reasoning, content, chunks, usage = [], [], [], None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content), chunks, usage


def data_url(path: Path) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(path.read_bytes()).decode()


def assert_error(response: httpx.Response, status: int, param: str | None = None, fragment: str = ""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert fragment in error["message"], error
    return error


# ---- acceptance ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["bigram"]
    assert client.models.retrieve("bigram").id == "bigram"
    health = server.health()  # no key needed
    assert health["status"] == "ok" and health["max_queue"] == 1
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="bigram", messages=hi(), max_tokens=4)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert_error(post(server, {"messages": hi()}, key=None), 401)
    assert_error(post(server, {"messages": hi()}, key="sk-test-ke"), 401)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401


@pytest.mark.slow
def test_stream_and_whole_reply_agree_greedy(client):
    n = LEAD_TOKENS + 3 * CYCLE_TOKENS
    whole = client.chat.completions.create(model="any-name", messages=hi(), max_tokens=n)
    assert whole.object == "chat.completion" and whole.model == "bigram"
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert message.reasoning_content == REASONING
    assert message.content == expected_content(n)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        PROMPT_TOKENS,
        n,
        PROMPT_TOKENS + n,
    )

    stream = client.chat.completions.create(
        model="bigram", messages=hi(), max_completion_tokens=n, stream=True, stream_options={"include_usage": True}
    )
    reasoning, content, chunks, usage = collect(stream)
    assert (reasoning, content) == (REASONING, message.content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, n)


@pytest.mark.slow
def test_stream_and_whole_reply_agree_sampled(client):
    def ask(seed, stream):
        args = dict(model="bigram", messages=hi(), max_tokens=40, temperature=4.0, top_p=0.95, seed=seed)
        if not stream:
            reply = client.chat.completions.create(**args).choices[0].message
            return (reply.reasoning_content or "") + "|" + reply.content
        reasoning, content, _, _ = collect(client.chat.completions.create(**args, stream=True))
        return reasoning + "|" + content

    first = ask(7, stream=False)
    assert ask(7, stream=True) == first
    assert ask(7, stream=False) == first
    assert ask(8, stream=False) != first  # really sampled


@pytest.mark.slow
def test_multibyte_stream_has_no_replacement_characters(client):
    n = LEAD_TOKENS + 60 * CYCLE_TOKENS
    stream = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == expected_content(n)


@pytest.mark.slow
def test_image_as_data_url_and_allowed_folder(client, server, photo, image_dir):
    n = LEAD_TOKENS + CYCLE_TOKENS
    text_only = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    content = [{"type": "image_url", "image_url": {"url": data_url(photo)}}, {"type": "text", "text": "Hi"}]
    reply = client.chat.completions.create(
        model="bigram", messages=[{"role": "user", "content": content}], max_tokens=n
    )
    assert reply.choices[0].message.content == expected_content(n)
    # one image: its image tokens (the 256 x 256 photo's own 16 x 16 patch grid: 64) plus vision start / end
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + 64 + 2
    local = [{"type": "image_url", "image_url": {"url": str(image_dir / "photo.jpg")}}, {"type": "text", "text": "Hi"}]
    twice = client.chat.completions.create(
        model="bigram", messages=[{"role": "user", "content": content[:1] + local}], max_tokens=n
    )
    assert twice.usage.prompt_tokens == reply.usage.prompt_tokens + 66


def video_message(url: str, text: str = "Hi") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def video_data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def test_video_as_data_url_streamed_and_whole_with_thinking_on_and_off(
    client, server, clips, tmp_path, photo, image_dir
):
    """The openai client sends the pan clip as a data URL: the streamed reply equals the whole one, thinking on
    and off; the prompt holds the video's tokens (3 frame pairs of 20 tokens, each between vision start and end
    after its timestamp); fps through vLLM's mm_processor_kwargs; over --max-video-seconds: 413."""
    from .clips import pan_frames, write_clip

    n = LEAD_TOKENS + CYCLE_TOKENS
    messages = video_message(video_data_url(clips["pan"]))
    text_only = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    for thinking in (True, False):
        extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
        whole = client.chat.completions.create(model="bigram", messages=messages, max_tokens=n, extra_body=extra)
        stream = client.chat.completions.create(
            model="bigram", messages=messages, max_tokens=n, stream=True, extra_body=extra
        )
        reasoning, content, _, _ = collect(stream)
        message = whole.choices[0].message
        assert (reasoning or None, content) == (message.reasoning_content, message.content)
        assert (message.reasoning_content is not None) == thinking
    on = client.chat.completions.create(model="bigram", messages=messages, max_tokens=n)
    # 3 pairs x (20 pads + start + end + "<t.t seconds>"): the timestamps' text tokens are the rest
    assert on.usage.prompt_tokens > text_only.usage.prompt_tokens + 3 * 22
    slower = client.chat.completions.create(
        model="bigram", messages=messages, max_tokens=n, extra_body={"mm_processor_kwargs": {"fps": 1}}
    )
    assert slower.usage.prompt_tokens < on.usage.prompt_tokens  # 2 frame pairs instead of 3
    # a playlist inside the allowed folder naming a file outside it: read as bytes, FFmpeg cannot follow it
    outside = write_clip(tmp_path / "outside.ts", pan_frames(photo, 8, 64, 64), fps=4)
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2.0,\n{outside}\n#EXT-X-ENDLIST\n"
    (image_dir / "list.m3u8").write_text(playlist)
    assert_error(
        post(server, {"messages": video_message("list.m3u8")}),
        400,
        "messages[0].content[0].video_url.url",
        "cannot read video",
    )
    long = write_clip(tmp_path / "long.mp4", pan_frames(photo, 24, 64, 64), fps=4)  # 6 seconds
    assert_error(
        post(server, {"messages": video_message(video_data_url(long))}),
        413,
        "messages[0].content[0].video_url.url",
        "--max-video-seconds",
    )


@pytest.mark.slow
def test_stop_strings(client):
    reply = client.chat.completions.create(model="bigram", messages=hi(), stop=["→", "zz"], max_tokens=100)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "é日"
    _, content, chunks, _ = collect(
        client.chat.completions.create(model="bigram", messages=hi(), stop="→ é", stream=True)
    )
    assert content == "é日"
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_thinking_switch(client):
    n = LEAD_TOKENS + 2 * CYCLE_TOKENS
    on = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == (REASONING, CYCLE * 2)
    off_args = dict(
        model="bigram", messages=hi(), max_tokens=n, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    off = client.chat.completions.create(**off_args)
    # the template closed the block: the same tokens are all content, "</think>" included
    assert off.choices[0].message.reasoning_content is None
    assert off.choices[0].message.content == REASONING + "</think>" + CYCLE * 2
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 4  # "\n</think>\n\n"
    reasoning, content, chunks, _ = collect(client.chat.completions.create(**off_args, stream=True))
    assert (reasoning, content) == ("", off.choices[0].message.content)
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    reasoning, content, _, _ = collect(
        client.chat.completions.create(
            model="bigram", messages=hi(), max_tokens=n, stream=True, extra_body={"chat_template_kwargs": {}}
        )
    )
    assert (reasoning, content) == (REASONING, CYCLE * 2)


class Streamer(threading.Thread):
    """A streaming request read on a thread with httpx: ``started`` is set at the first content."""

    def __init__(self, server, body: dict, stop_after: int | None = None):
        super().__init__(daemon=True)
        self.server, self.body, self.stop_after = server, {**body, "stream": True}, stop_after
        self.started = threading.Event()
        self.events: list[dict] = []
        self.error: BaseException | None = None

    def run(self):
        try:
            with httpx.stream(
                "POST",
                f"{self.server.url}/v1/chat/completions",
                json=self.body,
                timeout=120,
                headers={"Authorization": f"Bearer {KEY}"},
            ) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self.events.append(json.loads(line[6:]))
                    if self.events[-1]["choices"] and self.events[-1]["choices"][0]["delta"].get("content"):
                        self.started.set()
                    if self.stop_after is not None and len(self.events) >= self.stop_after:
                        return  # leaves the with-block: the connection is closed mid-stream
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self.started.set()

    def text(self) -> tuple[str, str]:
        deltas = [e["choices"][0]["delta"] for e in self.events if e["choices"]]
        return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas))


@pytest.mark.slow
def test_concurrent_clients_queue_and_429(server, client):
    long_tokens = LEAD_TOKENS + 225 * CYCLE_TOKENS  # 2030 tokens: nearly the capacity
    t0 = time.monotonic()
    first = Streamer(server, {"messages": hi(), "max_tokens": long_tokens})
    first.start()
    assert first.started.wait(30) and first.error is None
    sampled = dict(model="bigram", messages=hi("Hello there"), max_tokens=60, temperature=4.0, seed=3)
    second: dict = {}
    waiter = threading.Thread(target=lambda: second.setdefault("reply", client.chat.completions.create(**sampled)))
    waiter.start()
    state = server.wait_health(lambda h: h["running"] == 1 and h["waiting"] == 1)
    rejected = state["rejected"]
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="bigram", messages=hi(), max_tokens=4)
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
    assert "--max-queue 1" in info.value.body["message"]
    # field checks come first: a bad field fails with 400, not 429, while the queue is full; the
    # messages (images, template) are prepared only when there is room, so those get 429 now
    assert_error(post(server, {"messages": hi(), "top_p": 2}), 400, "top_p")
    assert_error(post(server, {"messages": [{"role": "robot", "content": "x"}]}), 429, None)
    assert server.health()["running"] == 1, "the first generation ended before the checks: make it longer"
    print(f"checks done {time.monotonic() - t0:.2f} s after the first request started")
    first.join(60)
    waiter.join(60)
    print(f"first request done after {time.monotonic() - t0:.2f} s")
    assert first.error is None
    assert first.text() == (REASONING, expected_content(long_tokens))
    assert first.events[-1]["choices"][0]["finish_reason"] == "length"
    # both answers equal those of requests run one at a time
    alone = client.chat.completions.create(**sampled)
    assert second["reply"].choices[0].message == alone.choices[0].message
    state = server.health()
    assert state["rejected"] == rejected + 2 and state["running"] == 0 and state["waiting"] == 0


@pytest.mark.slow
def test_dropped_clients_are_cancelled(server, client):
    before = server.health()
    # a stream dropped mid-way: cancelled between two tokens, long before its 2000 tokens
    dropped = Streamer(server, {"messages": hi()}, stop_after=20)
    dropped.start()
    dropped.join(30)
    state = server.wait_health(lambda h: h["cancelled"] == before["cancelled"] + 1, timeout=5)
    assert state["running"] == 0 and state["last"]["outcome"] == "cancelled"
    assert state["last"]["completion_tokens"] < 1000, state
    # a whole (non-streamed) reply whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        post(server, {"messages": hi()}, timeout=0.3)
    state = server.wait_health(lambda h: h["cancelled"] == before["cancelled"] + 2, timeout=5)
    assert state["last"]["completion_tokens"] < CAPACITY - PROMPT_TOKENS, state
    # a waiting client that gives up leaves the queue; the running one is not disturbed
    runner = Streamer(server, {"messages": hi(), "max_tokens": LEAD_TOKENS + 120 * CYCLE_TOKENS})
    runner.start()
    assert runner.started.wait(30)
    with pytest.raises(httpx.ReadTimeout):
        post(server, {"messages": hi()}, timeout=0.3)
    server.wait_health(lambda h: h["left_queue"] == before["left_queue"] + 1 and h["waiting"] == 0)
    runner.join(60)
    assert runner.text() == (REASONING, expected_content(LEAD_TOKENS + 120 * CYCLE_TOKENS))
    # and the next request is served correctly
    n = LEAD_TOKENS + 2 * CYCLE_TOKENS
    reply = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    assert reply.choices[0].message.content == expected_content(n)
    state = server.health()
    assert state["running"] == 0 and state["failed"] == 0


def tiny_png(size=(8, 8)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]


BAD_REQUESTS = [
    # (body, status, param, fragment of the message)
    (b'{"messages": [', 400, None, "not valid JSON"),
    (b"\xff\xfe\x00", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"model": "bigram"}, 400, "messages", "required"),
    ({"messages": "Hi"}, 400, "messages", "list"),
    ({"messages": []}, 400, "messages", "at least one"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "not one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages[0].content[0].type", "audio"),
    ({"messages": hi(), "model": 3}, 400, "model", "string"),
    ({"messages": hi(), "temperature": "hot"}, 400, "temperature", "number"),
    ({"messages": hi(), "temperature": -1}, 400, "temperature", ">= 0"),
    ({"messages": hi(), "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"messages": hi(), "top_k": 1.5}, 400, "top_k", "integer"),
    ({"messages": hi(), "seed": -3}, 400, "seed", ">= 0"),
    ({"messages": hi(), "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ({"messages": hi(), "max_completion_tokens": "9"}, 400, "max_completion_tokens", "integer"),
    ({"messages": hi(), "stream": "yes"}, 400, "stream", "true or false"),
    ({"messages": hi(), "stop": [1]}, 400, "stop", "strings"),
    ({"messages": hi(), "stop": [""]}, 400, "stop", "non-empty"),
    ({"messages": hi(), "stop": 5}, 400, "stop", "got int"),
    ({"messages": hi(), "stop": ["x"] * 17}, 400, "stop", "holds 17 strings, more than 16"),
    (
        {"messages": [{"role": "user", "content": ["hi"]}]},
        400,
        "messages[0].content[0]",
        "must be a content part object",
    ),
    ({"messages": hi(), "n": 2}, 400, "n", "must be 1"),
    ({"messages": hi(), "tools": [{"type": "function"}]}, 400, "tools[0]", "'type': 'function'"),
    (
        {"messages": hi(), "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "tool_choice.function.name",
        "'nope', which is not in tools ('get_weather')",
    ),
    (
        {
            "messages": hi(),
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
        },
        400,
        "response_format.json_schema.schema",
        "not a valid JSON Schema",
    ),
    (
        {"messages": hi(), "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        400,
        "tools[0].function.parameters",
        "type 'object'",
    ),
    (
        {"messages": hi(), "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "cannot be combined with tool_choice 'required'",
    ),
    ({"messages": hi(), "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"messages": hi(), "response_format": {"type": "yaml"}}, 400, "response_format", "'yaml'"),
    ({"messages": hi(), "tools": [WEATHER], "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls", "true or false"),
    (
        {
            "messages": [
                *hi(),
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                },
            ]
        },
        400,
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
    (
        {"messages": hi(), "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        400,
        "chat_template_kwargs",
        "chat_template",
    ),
    ({"messages": hi(), "chat_template_kwargs": [1]}, 400, "chat_template_kwargs", "object"),
    ({"messages": hi("word " * 2100)}, 400, "messages", "2048"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages", "Unicode"),
    (
        {"messages": image_message("data:image/png;base64,aGVsbG8=")},
        400,
        "messages[0].content[0].image_url.url",
        "not a readable image",
    ),
    ({"messages": image_message("data:image/png;base64,@@@")}, 400, "messages[0].content[0].image_url.url", "base64"),
    (
        {"messages": image_message("https://example.com/cat.png")},
        400,
        "messages[0].content[0].image_url.url",
        "not fetched",
    ),
    ({"messages": image_message("/etc/hostname")}, 400, "messages[0].content[0].image_url.url", "outside"),
    ({"messages": image_message(tiny_png(), tiny_png(), tiny_png())}, 400, "messages", "3 images"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": tiny_png(), "detail": "x"}}]}
            ]
        },
        400,
        "messages[0].content[0].image_url.detail",
        "must be one of auto, low, high",
    ),
    (
        {"messages": image_message("data:image/png;base64," + "A" * 140_000)},
        413,
        "messages[0].content[0].image_url.url",
        "limit",
    ),
    (
        {"messages": video_message("data:video/mp4;base64,aGVsbG8=")},
        400,
        "messages[0].content[0].video_url.url",
        "cannot read video",
    ),
    (
        {"messages": video_message("https://example.com/a.mp4")},
        400,
        "messages[0].content[0].video_url.url",
        "not fetched",
    ),
    ({"messages": video_message("/etc/hostname")}, 400, "messages[0].content[0].video_url.url", "outside"),
    ({"messages": hi(), "fps": 0}, 400, "fps", "a number in (0, 1000]"),
    ({"messages": hi(), "fps": 2**1100}, 400, "fps", "a number in (0, 1000]"),
    ({"messages": hi(), "mm_processor_kwargs": {"num_frames": 4}}, 400, "mm_processor_kwargs", "fps only"),
    ({"messages": hi(), "max_video_tokens": 0}, 400, "max_video_tokens", "an integer >= 1"),
]


@pytest.mark.slow
def test_bad_requests_get_openai_errors(server, client):
    before = server.health()
    for body, status, param, fragment in BAD_REQUESTS:
        assert_error(post(server, body), status, param, fragment)
    # bodies over --max-body-bytes: announced, and streamed without a length
    assert_error(post(server, b"{" + b" " * MAX_BODY + b"}"), 413, None, "--max-body-bytes")
    chunks = (b" " * 65536 for _ in range(MAX_BODY // 65536 + 2))
    assert_error(post(server, chunks), 413, None, "--max-body-bytes")
    error = assert_error(httpx.get(f"{server.url}/v1/nope", timeout=10), 404)
    assert error["code"] == "not_found"
    assert_error(httpx.get(f"{server.url}/v1/chat/completions", timeout=10), 405)
    assert_error(
        httpx.get(f"{server.url}/v1/models/other", headers={"Authorization": f"Bearer {KEY}"}, timeout=10), 404, "model"
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="bigram", messages=hi(), n=3)
    assert info.value.body["param"] == "n"
    # the server keeps serving
    n = LEAD_TOKENS + CYCLE_TOKENS
    reply = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    assert reply.choices[0].message.content == expected_content(n)
    after = server.health()
    assert after["completed"] == before["completed"] + 1 and after["failed"] == 0 and after["running"] == 0


def scrape(server, key: str | None = KEY) -> dict:
    """``GET /metrics`` parsed with prometheus_client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain"), response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


@pytest.mark.slow
def test_metrics_count_requests_tokens_and_times(server, client):
    assert_error(httpx.get(f"{server.url}/metrics", timeout=10), 401, None, "API key")
    assert_error(httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10), 401)
    before = scrape(server)
    n = LEAD_TOKENS + CYCLE_TOKENS
    client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n)
    stream = client.chat.completions.create(model="bigram", messages=hi(), max_tokens=n, stream=True)
    collect(stream)
    assert_error(post(server, {"messages": hi(), "top_p": 0}), 400, "top_p")
    assert_error(post(server, {"messages": hi()}, key="nope"), 401)
    server.wait_health(lambda state: state["running"] == 0)
    after = scrape(server)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    requests, route = "qwen35_onnx_requests_total", ("route", "/v1/chat/completions")
    assert grew(requests, (route, ("status", "200"))) == 2
    assert grew(requests, (route, ("status", "400"))) == 1 and grew(requests, (route, ("status", "401"))) == 1
    assert grew("qwen35_onnx_generations_total", (("outcome", "completed"), route)) == 2
    assert grew("qwen35_onnx_prompt_tokens_total") == 2 * PROMPT_TOKENS
    assert grew("qwen35_onnx_generation_tokens_total") == 2 * n
    for histogram in ("time_to_first_token_seconds", "decode_tokens_per_second", "request_duration_seconds"):
        assert grew(f"qwen35_onnx_{histogram}_count") == 2, histogram
    first, whole = grew("qwen35_onnx_time_to_first_token_seconds_sum"), grew("qwen35_onnx_request_duration_seconds_sum")
    assert 0 < first < whole
    assert grew("qwen35_onnx_decode_tokens_per_second_sum") > 0
    assert after[("qwen35_onnx_requests_running", ())] == 0 and after[("qwen35_onnx_requests_waiting", ())] == 0


@pytest.mark.slow
def test_serve_on_openvino_answers_as_on_onnxruntime(fixed_export, photo, tmp_path):
    pytest.importorskip("openvino")

    # both runtimes serve the portable fixed-KV export (on OpenVINO its vision graph compiled at the photo's grid)
    export = fixed_export
    image = "data:image/jpeg;base64," + base64.b64encode(photo.read_bytes()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe it."}],
        }
    ]
    replies = {}
    for runtime in ("onnxruntime", "openvino"):
        log_path = tmp_path / f"{runtime}.log"
        server = ServerProcess(["--model", str(export), "--port", "0", "--runtime", runtime], log_path)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
            replies[runtime] = (reply.choices[0].message.content, reply.usage.completion_tokens)
        finally:
            server.stop()
        assert f"({runtime} " in log_path.read_text()
    assert replies["openvino"] == replies["onnxruntime"] and replies["onnxruntime"][1] > 0


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's headless Chromium driven by selenium (``.ci/run`` installs chromium and chromium-driver)."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tmp_path_factory.mktemp("chromium-profile")
    # this machine has no network: Chromium's own background connections are turned off
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1100,800",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    yield browser
    browser.quit()


@pytest.mark.slow
def test_chat_page_in_a_real_browser(server, browser, bigram_export, photo, tmp_path, clips):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from qwen35_onnx.contract import read_manifest
    from qwen35_onnx.conversation.processor import ImageSizing

    shots = Path(os.environ.get("QWEN35_ONNX_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"(src|href)=[\"']?(https?:)?//|@import|url\(", page.text)  # nothing from elsewhere

    wait = WebDriverWait(browser, 60, poll_frequency=0.02)

    def text_of(element, css):
        return element.find_element(By.CSS_SELECTOR, css).get_attribute("textContent")

    def last_reply():
        return browser.find_elements(By.CSS_SELECTOR, ".assistant")[-1]

    def send(text):
        box = browser.find_element(By.ID, "prompt")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    browser.get(f"{server.url}/")
    wait.until(lambda d: d.find_element(By.ID, "model").text == "enter the API key")
    key = browser.find_element(By.ID, "key")
    key.send_keys(KEY, Keys.TAB)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "bigram")

    # a text message, streamed: reasoning apart from the content
    n = LEAD_TOKENS + 2 * CYCLE_TOKENS
    browser.find_element(By.ID, "max-tokens").send_keys(str(n))
    send("Hi")
    wait.until(lambda d: "finish: length" in text_of(last_reply(), ".meta"))
    left = CAPACITY - PROMPT_TOKENS - n
    assert f"{PROMPT_TOKENS} prompt + {n} tokens · {left} of {CAPACITY} tokens left" in text_of(last_reply(), ".meta")
    assert text_of(last_reply(), ".content") == expected_content(n)
    assert text_of(last_reply(), ".reasoning-text") == REASONING
    first_prompt = server.health()["last"]["prompt_tokens"]
    browser.save_screenshot(str(shots / "chat-page-1-text.png"))

    # two images: one from the file picker, one dropped on the composer
    picker = browser.find_element(By.ID, "file")
    browser.execute_script("arguments[0].hidden = false", picker)
    picker.send_keys(str(photo))
    browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const canvas = document.createElement("canvas");
        canvas.width = 48; canvas.height = 32;
        const g = canvas.getContext("2d"); g.fillStyle = "#2a7"; g.fillRect(0, 0, 48, 32);
        canvas.toBlob((blob) => {
          const data = new DataTransfer();
          data.items.add(new File([blob], "dropped.png", { type: "image/png" }));
          document.getElementById("drop").dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true }));
          done();
        }, "image/png");
        """
    )
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments img")) == 2)
    browser.save_screenshot(str(shots / "chat-page-2-attached.png"))
    send("What is in these?")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 2)
    wait.until(lambda d: "finish: length" in text_of(last_reply(), ".meta"))
    assert len(browser.find_elements(By.CSS_SELECTOR, ".user")[-1].find_elements(By.TAG_NAME, "img")) == 2
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")
    # each image has its own grid (the processor's, within the export's budget): the photo's 16 x 16
    # patches, the dropped 48 x 32 picture's upscaled to min_pixels
    sizing = ImageSizing.of(read_manifest(bigram_export))
    image_tokens = sum(h * w // 4 for h, w in (sizing.grid(256, 256)[0], sizing.grid(32, 48)[0]))
    assert image_tokens == 64 + 70
    assert server.health()["last"]["prompt_tokens"] > first_prompt + n + image_tokens  # history + both images
    browser.save_screenshot(str(shots / "chat-page-3-images.png"))

    # a video from the file picker: shown as a video, sent as a video_url part (3 frame pairs of 20 tokens)
    with_images = server.health()["last"]["prompt_tokens"]
    picker.send_keys(str(clips["pan"]))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments video")) == 1)
    send("And this?")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 3)
    wait.until(lambda d: "finish: length" in text_of(last_reply(), ".meta"))
    assert len(browser.find_elements(By.CSS_SELECTOR, ".user")[-1].find_elements(By.TAG_NAME, "video")) == 1
    assert server.health()["last"]["prompt_tokens"] > with_images + n + 3 * 22
    browser.save_screenshot(str(shots / "chat-page-3-video.png"))

    # stop: a generation to the capacity (about 2000 tokens), stopped right after it is sent
    before = server.health()
    browser.find_element(By.ID, "reset").click()
    browser.find_element(By.ID, "max-tokens").clear()
    send("Hi")
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: text_of(last_reply(), ".meta").startswith("stopped"))
    after = server.wait_health(lambda state: state["running"] == 0 and state["waiting"] == 0)
    assert after["completed"] == before["completed"], "the generation ran to its end: the stop came too late"
    assert after["cancelled"] + after["left_queue"] == before["cancelled"] + before["left_queue"] + 1
    stopped = text_of(last_reply(), ".content")
    time.sleep(0.3)
    assert text_of(last_reply(), ".content") == stopped
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    browser.save_screenshot(str(shots / "chat-page-4-stopped.png"))

    # "New chat" in the middle of a generation: nothing of that turn reaches the next request
    send("Hi")
    browser.find_element(By.ID, "reset").click()
    server.wait_health(lambda state: state["running"] == 0 and state["waiting"] == 0)
    browser.find_element(By.ID, "max-tokens").send_keys(str(n))
    send("Hi")
    wait.until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant .meta") and "finish" in text_of(last_reply(), ".meta")
    )
    assert server.health()["last"]["prompt_tokens"] == PROMPT_TOKENS
    assert len(browser.find_elements(By.CSS_SELECTOR, ".user")) == 1


@pytest.mark.slow
def test_serve_command_errors(tmp_path):
    def serve(*args, prelude=""):
        code = (
            f"import sys; {prelude}from qwen35_onnx.cli import main; "
            f"sys.argv = ['qwen35-onnx', 'serve', *{list(args)!r}]; main()"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)

    proc = serve("--model", str(tmp_path))
    assert proc.returncode == 2 and "error:" in proc.stderr and "manifest.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = serve("--model", str(tmp_path), prelude="sys.modules['fastapi'] = None; ")
    assert proc.returncode == 2 and "'serve' extra" in proc.stderr and "Traceback" not in proc.stderr


# ---- the pieces without a server -----------------------------------------------------------------
def test_sampling_defaults_follow_generation_config(tmp_path):
    from qwen35_onnx.runtime.sampling import SamplingConfig, sampling_defaults
    from qwen35_onnx.server.chat_completions import parse_chat_request

    assert sampling_defaults(tmp_path) == SamplingConfig()  # no file: greedy
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert sampling_defaults(tmp_path) == SamplingConfig()
    config.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    defaults = sampling_defaults(tmp_path)
    assert defaults == SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)
    # request values override one by one; top_k -1 is "off" as in vLLM
    request = parse_chat_request({"messages": [], "temperature": 0, "seed": 5}, defaults).chat
    assert request.sampling == SamplingConfig(temperature=0.0, top_p=0.95, top_k=20, seed=5)
    request = parse_chat_request(
        {"messages": [], "top_k": -1, "max_tokens": 3, "max_completion_tokens": 7}, defaults
    ).chat
    assert (request.sampling.top_k, request.max_tokens) == (0, 7)
    config.write_text(json.dumps({"do_sample": True, "top_p": 3}))
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(tmp_path)


def test_server_options_are_checked(tmp_path):
    from qwen35_onnx.server.options import ServerOptions

    ServerOptions("m", allowed_image_dir=tmp_path).validate()
    for bad, fragment in (
        (dict(max_queue=-1), "--max-queue"),
        (dict(max_body_bytes=10), "--max-body-bytes"),
        (dict(max_image_bytes=0), "--max-image-bytes"),
        (dict(api_key=""), "--api-key"),
        (dict(allowed_image_dir=tmp_path / "nope"), "--allowed-image-dir"),
    ):
        with pytest.raises(ValueError, match=fragment):
            ServerOptions("m", **bad).validate()


@contextlib.contextmanager
def in_process_server(pipe, **options):
    """Serve ``pipe`` in this process (uvicorn on a thread, port 0, ``--max-queue 1``, then ``options`` of
    ServerOptions) for fault injection; yields the base URL and stops the server on exit (its lifespan's end
    run)."""
    import uvicorn

    from qwen35_onnx.server.app import create_app
    from qwen35_onnx.server.options import ServerOptions

    app = create_app(pipe, ServerOptions(**{"model_name": "bigram", "max_queue": 1, **options}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.slow
def test_failed_generation_ends_the_response_cleanly(bigram_export):
    """Fault injection on a real pipeline served in-process: the decode step raises (as an ONNX
    Runtime failure would). The whole reply is a 500 ``server_error`` body, the stream ends with
    an error event and [DONE], the slot is freed and the next request is served."""
    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(bigram_export, threads=1)
    with in_process_server(pipe) as url:
        pool = pipe.slot_pool  # the decode slots every generation of the server steps in
        real = pool.decoder

        class Failing:  # a decoder whose step fails, as an ONNX Runtime failure would
            def step(self, *args):
                raise RuntimeError("injected decode failure")

            def states(self):
                return real.states()

        pool.decoder = Failing()
        body = {"messages": hi(), "max_tokens": 20}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "injected decode failure" in error["message"]
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "injected decode failure" in json.loads(events[-2])["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert (health["failed"], health["running"], health["waiting"]) == (2, 0, 0)
        pool.decoder = real
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["message"]["reasoning_content"] == REASONING


# ---- tool calls and structured output ---------------------------------------------------------------
def thinking(on: bool) -> dict:
    return {"chat_template_kwargs": {"enable_thinking": on}}


def stream_calls(stream) -> tuple[list[tuple], str | None, str]:
    """((index, id, name, arguments) per streamed call, finish_reason, content) of a stream."""
    calls, finish, content = [], None, []
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                calls.append((call.index, call.id, call.function.name, call.function.arguments))
            finish = choice.finish_reason or finish
    return calls, finish, "".join(content)


@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False], ids=["thinking", "no-thinking"])
def test_weather_tool_round_trip(client, on):
    """A required call, then the tool's result in the history and a final answer; the named choice
    and streaming give valid calls too (the model is a bigram table: only the grammar makes them)."""
    import jsonschema

    schema = WEATHER["function"]["parameters"]
    question = hi("What is the weather in Paris?")
    ask = dict(model="bigram", tools=[WEATHER], max_tokens=1200, temperature=1.0, extra_body=thinking(on))
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}]):
        reply = client.chat.completions.create(messages=question, tool_choice=choice, seed=seed, **ask)
        (choice_,) = reply.choices
        assert choice_.finish_reason == "tool_calls", choice_
        calls = choice_.message.tool_calls
        assert calls and all(c.function.name == "get_weather" and c.id.startswith("call_") for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert (choice_.message.reasoning_content is not None) == on  # reasoning stays apart
        streamed, finish, _ = stream_calls(
            client.chat.completions.create(messages=question, tool_choice=choice, seed=seed, stream=True, **ask)
        )
        assert finish == "tool_calls"
        assert [(i, name, args) for i, _, name, args in streamed] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
        ]
    call = calls[0]
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    final = client.chat.completions.create(
        model="bigram",
        messages=history,
        tools=[WEATHER],
        max_tokens=LEAD_TOKENS + CYCLE_TOKENS,
        extra_body=thinking(on),
    )
    (choice_,) = final.choices
    assert choice_.finish_reason == "length" and choice_.message.tool_calls is None
    assert final.usage.prompt_tokens > len(call.function.arguments)  # the call and its result are in the prompt
    if on:
        assert choice_.message.reasoning_content == REASONING and choice_.message.content == CYCLE


@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False], ids=["thinking", "no-thinking"])
def test_json_schema_replies_validate(client, on):
    """20 sampled replies under a strict nested json_schema each parse and validate, although only the
    grammar makes them JSON (json_object on a model that ends its replies: tests/test_structured_output.py)."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    for seed in range(20):
        reply = client.chat.completions.create(
            model="bigram",
            messages=hi("Describe a pet."),
            response_format=fmt,
            max_tokens=1000,
            temperature=1.0,
            seed=seed,
            extra_body=thinking(on),
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PET)
        assert (choice.message.reasoning_content == REASONING) == on


@pytest.mark.slow
def test_python_api_returns_typed_tool_calls_and_renders_them_back(bigram_export):
    """Pipeline.chat(tools=..., tool_choice=...) on random weights: a required or named call comes back
    as ToolCall objects with arguments typed by the schema (finish_reason 'tool_calls', the call text
    not in content); the call and a tool result go back into the next prompt."""
    import jsonschema

    from qwen35_onnx.conversation.tool_calls import ToolCall
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pipe = Pipeline.from_exported(bigram_export)

    question = [{"role": "user", "content": "Weather in Paris?"}]
    schema = WEATHER["function"]["parameters"]
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}]):
        reply = pipe.chat(
            question,
            max_new_tokens=1000,
            chat_template_kwargs={"enable_thinking": False},
            sampling=SamplingConfig(temperature=1.0, seed=seed),
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        assert reply.finish_reason == "tool_calls", reply.generation.text
        (call,) = reply.tool_calls
        assert isinstance(call, ToolCall) and call.name == "get_weather"
        assert call.arguments["unit"] in ("celsius", "fahrenheit")
        assert isinstance(call.arguments.get("days", 0), int)
        jsonschema.validate(call.arguments, schema)
        assert "<tool_call>" not in reply.content and "<tool_call>" in reply.generation.text
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
    ]
    prepared = pipe.prepare_chat(history, reply=pipe.reply_format(tools=[WEATHER]))
    text = pipe.preprocessor.tokenizer.decode(prepared.input_ids[0])
    assert f"<function=get_weather>\n<parameter=city>\n{call.arguments['city']}\n</parameter>" in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    # tool_choice 'none': the tools are not shown and nothing is parsed
    none = pipe.prepare_chat(question, reply=pipe.reply_format(tools=[WEATHER], tool_choice="none"))
    assert none.prompt_len == pipe.prepare_chat(question).prompt_len


class _FailingMatcher:
    """An llguidance matcher stand-in that fails after ``after`` tokens as a grammar engine could: it
    refuses the token its own mask allowed and reports its whole state."""

    def __init__(self, matcher, after: int):
        self._matcher, self._left = matcher, after

    def __getattr__(self, name):
        return getattr(self._matcher, name)

    def consume_token(self, token):
        self._left -= 1
        return self._left >= 0 and self._matcher.consume_token(token)

    def get_error(self):
        return "Parser Error: token refused <state>" + "x" * 4000 + "</state><grammar>start: ...</grammar>"


@pytest.mark.slow
def test_grammar_failure_mid_reply_is_a_short_client_error(bigram_export, caplog):
    """The grammar engine fails in the middle of a constrained reply: the whole reply is a 422
    ``reply_format_failed`` naming ``tools`` (or ``response_format``) in one short message with none of
    the engine's state, a stream ends with that error and [DONE], the engine's report is in the server
    log, and the next request is answered."""
    import logging

    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported(bigram_export, threads=1)
    original = pipe.grammars.constraint

    def sabotaged(*args, **kwargs):
        constraint = original(*args, **kwargs)
        constraint.matcher = _FailingMatcher(constraint.matcher, after=3)
        return constraint

    ask = {"max_tokens": 300, "chat_template_kwargs": {"enable_thinking": False}, "temperature": 1.0, "seed": 1}
    tools = {"messages": hi("Weather in Paris?"), "tools": [WEATHER], "tool_choice": "required", **ask}
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    answer = {"messages": hi("A pet?"), "response_format": schema, **ask}
    pipe.grammars.constraint = sabotaged
    with caplog.at_level(logging.ERROR), in_process_server(pipe) as url:
        for body, param in ((tools, "tools"), (answer, "response_format")):
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (
                param,
                "reply_format_failed",
                "invalid_request_error",
            )
            assert len(error["message"]) < 300 and "<state>" not in response.text and "grammar>" not in response.text
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
            ) as streamed:
                assert streamed.status_code == 200
                events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2]) == response.json()
        assert caplog.text.count("<state>") == 4  # the engine's report, once per failed generation, in the log
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert (health["failed"], health["running"], health["waiting"]) == (4, 0, 0)
        pipe.grammars.constraint = original
        reply = httpx.post(f"{url}/v1/chat/completions", json=tools, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.slow
def test_tool_choices_give_valid_calls_with_published_added_tokens(client):
    """With the published added tokens (``<tool_call>`` / ``</tool_call>`` non-special added tokens in
    the demo tokenizer): tool_choice required and named, parallel calls on and off, thinking on and
    off, 20 sampled replies each are calls valid against the tool's schema (one call when parallel
    calls are off or a function is named), 2 of them streamed give the same calls; ``auto`` answers
    (the bigram model writes no call of its own) with text and no calls."""
    import jsonschema

    schema = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    question = hi("What is the weather in Paris?")
    for choice in ("required", named):
        for parallel in (True, False):
            for on in (True, False):
                ask = dict(
                    model="bigram",
                    messages=question,
                    tools=[WEATHER],
                    tool_choice=choice,
                    parallel_tool_calls=parallel,
                    max_tokens=1200,
                    temperature=1.0,
                    extra_body=thinking(on),
                )
                for seed in range(20):
                    where = (choice, parallel, on, seed)
                    (reply,) = client.chat.completions.create(seed=seed, **ask).choices
                    assert reply.finish_reason == "tool_calls", where
                    calls = reply.message.tool_calls
                    assert calls and all(c.function.name == "get_weather" for c in calls), where
                    if not parallel or choice == named:
                        assert len(calls) == 1, where
                    for call in calls:
                        jsonschema.validate(json.loads(call.function.arguments), schema)
                    if seed < 2:
                        streamed, finish, _ = stream_calls(
                            client.chat.completions.create(seed=seed, stream=True, **ask)
                        )
                        assert finish == "tool_calls" and [(name, args) for _, _, name, args in streamed] == [
                            (c.function.name, c.function.arguments) for c in calls
                        ], where
    for on in (True, False):
        (reply,) = client.chat.completions.create(
            model="bigram", messages=question, tools=[WEATHER], max_tokens=30, extra_body=thinking(on)
        ).choices
        assert reply.finish_reason == "length" and reply.message.tool_calls is None and CYCLE in reply.message.content


# ---- agent frameworks: the code of docs/agents.md, run as written -------------------------------------------
AGENTS_PAGE = ROOT / "docs" / "agents.md"


def page_code(page: Path) -> dict[str, str]:
    """The Python code blocks of ``page`` by the ``## `` heading they are under (several joined in order)."""
    sections = re.split(r"^## (.+)$", page.read_text(), flags=re.M)
    code = {}
    for heading, body in zip(sections[1::2], sections[2::2]):
        blocks = re.findall(r"^```python\n(.*?)^```", body, flags=re.S | re.M)
        if blocks:
            code[heading.strip()] = "\n".join(blocks)
    return code


def run_page_section(server, section: str) -> dict:
    """The page's setup block, its connection values replaced by the test server's, then ``section``'s code, as a
    script would run them (one namespace); returns the namespace."""
    code = page_code(AGENTS_PAGE)
    namespace: dict = {"__name__": "agents_page"}
    exec(compile(code["Setup"], f"{AGENTS_PAGE}: Setup", "exec", dont_inherit=True), namespace)
    assert {"BASE_URL", "API_KEY", "MODEL"} <= set(namespace), "the page's setup names the server"
    namespace.update(BASE_URL=f"{server.url}/v1", API_KEY=KEY, MODEL="bigram")
    exec(compile(code[section], f"{AGENTS_PAGE}: {section}", "exec", dont_inherit=True), namespace)
    return namespace


def test_the_agent_page_has_a_block_per_framework():
    assert set(page_code(AGENTS_PAGE)) == {"Setup", "LangChain", "OpenAI Agents SDK", "Pydantic AI"}


@pytest.mark.slow
def test_agent_page_langchain_round_trip(server):
    """langchain-openai, unmodified, as docs/agents.md has it: bind_tools, the model's forced call with valid
    arguments, the tool's answer back, a final reply without calls."""
    ns = run_page_section(server, "LangChain")
    (call,) = ns["call"].tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert len(call["args"]["city"]) <= 24 and call["args"]["unit"] in ("celsius", "fahrenheit")
    assert ns["result"] == f"18 degrees {call['args']['unit']} in {call['args']['city']}"
    assert ns["answer"].tool_calls == [] and CYCLE in ns["answer"].content


@pytest.mark.slow
def test_agent_page_openai_agents_sdk_round_trip(server):
    """The OpenAI Agents SDK, unmodified, on the chat completions API, as docs/agents.md has it: the agent's forced
    tool call runs the tool with valid arguments, the tool's result goes back, and the run ends with the model's
    final text (tool_choice reset to auto)."""
    ns = run_page_section(server, "OpenAI Agents SDK")
    result = ns["result"]
    calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert len(args["city"]) <= 24 and args["unit"] in ("celsius", "fahrenheit")
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == [f"18 degrees {args['unit']} in {args['city']}"]
    assert CYCLE in result.final_output


@pytest.mark.slow
def test_agent_page_pydantic_ai_structured_output(server):
    """pydantic-ai, unmodified, as docs/agents.md has it: an agent with an output type gets a valid call of its
    output tool (required, enforced by the grammar) and returns the typed object."""
    ns = run_page_section(server, "Pydantic AI")
    weather = ns["report"].output
    assert isinstance(weather, ns["Weather"])
    assert len(weather.city) <= 24 and weather.sky in ("sunny", "cloudy", "rain", "snow")
