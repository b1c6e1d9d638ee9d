"""The APIs coding agents speak, beside chat completions, over one conversation core: the OpenAI Responses API
and Anthropic's Messages API on ``qwen35-onnx serve``, driven by the official ``openai`` and ``anthropic``
clients and the OpenAI Agents SDK's default (Responses) model. The main server serves conftest's bigram export
(tests/bigram.py: deterministic replies, see tests/test_server.py); a second one serves conftest's chunked
``--ops ort`` export (kept states) with ``--max-tokens``, for kept states, the caps and the fuzzing. The pieces
without a server (translation, blocks, keys) are tested without one."""

from __future__ import annotations

import base64
import io
import json
import os
import re
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from PIL import Image

from .bigram import CAPACITY, CYCLE, CYCLE_TOKENS, LEAD_TOKENS, PROMPT_TOKENS, REASONING
from .test_server import KEY, WEATHER, ServerProcess

MAX_BODY = 1024 * 1024
MAX_IMAGE = 100_000
CAP = 24
"""``--max-tokens`` of the capped server (it bounds the fuzzed requests' replies)."""
MAX_TOKENS = 1200
"""``--max-tokens`` of the main server: above every reply its tests ask for."""
N = LEAD_TOKENS + 2 * CYCLE_TOKENS
"""A reply of the bigram model that ends on a character boundary: ``hm,ok</think>`` and two cycles."""
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
ANTHROPIC_WEATHER = {
    "name": WEATHER["function"]["name"],
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


def _serve(export: Path, log: Path, *args: str) -> ServerProcess:
    env = {**os.environ, "QWEN35_ONNX_API_KEY": KEY}
    base = ["--model", str(export), "--port", "0", "--model-name", "bigram", "--threads", "1"]
    return ServerProcess([*base, *args], log, env)


def _stopped(proc: ServerProcess) -> None:
    proc.stop()
    log = proc.log_path.read_text()
    assert "Traceback" not in log, log
    assert not re.search(r'" 5\d\d', log), log  # no 5xx in the access log


@pytest.fixture(scope="module")
def server(bigram_export, tmp_path_factory):
    proc = _serve(
        bigram_export,
        tmp_path_factory.mktemp("api-server") / "server.log",
        "--max-queue",
        "1",
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-image-bytes",
        str(MAX_IMAGE),
        "--max-tokens",
        str(MAX_TOKENS),
    )
    yield proc
    _stopped(proc)


@pytest.fixture(scope="module")
def capped(image_exports, tmp_path_factory):
    """The chunked ``--ops ort`` export (capacity IMAGE_CAPACITY, kept states) with ``--max-tokens`` CAP."""
    proc = _serve(
        image_exports("any-ort"), tmp_path_factory.mktemp("api-capped") / "server.log", "--max-tokens", str(CAP)
    )
    yield proc
    _stopped(proc)


def post(server, path: str, body, key: str | None = KEY, header: str = "authorization", **kwargs) -> httpx.Response:
    headers = {} if key is None else {header: f"Bearer {key}" if header == "authorization" else key}
    kwargs["json" if isinstance(body, (dict, list)) else "content"] = body
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=120, **kwargs)


def events(server, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """The ``(event, data)`` pairs of a streamed reply (data ``[DONE]`` as ``{}``)."""
    out, name = [], None
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, {} if line == "data: [DONE]" else json.loads(line[6:])))
                name = None
    return out


def hi(text: str = "Hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- one conversation, three APIs ------------------------------------------------------------------------------
def chat_reply(server, body: dict, stream: bool) -> dict:
    """``{reasoning, text, calls, finish, usage}`` of a chat completion."""
    if not stream:
        reply = post(server, "/v1/chat/completions", body).json()
        message = reply["choices"][0]["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()
        ]
        return {
            "reasoning": message.get("reasoning_content") or "",
            "text": (message["content"] or "").strip(),
            "calls": calls,
            "finish": reply["choices"][0]["finish_reason"],
            "tokens": (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]),
        }
    found = events(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert found[-1] == (None, {})  # [DONE]
    chunks = [data for _, data in found[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for d in deltas for c in d.get("tool_calls", ())
    ]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = chunks[-1]["usage"]
    return {
        "reasoning": "".join(d.get("reasoning_content", "") for d in deltas),
        "text": "".join(d.get("content", "") or "" for d in deltas).strip(),
        "calls": calls,
        "finish": finish[-1],
        "tokens": (usage["prompt_tokens"], usage["completion_tokens"]),
    }


RESPONSES_ORDER = {
    "reasoning": ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"],
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta"],
}


def _responses_summary(response: dict) -> dict:
    calls, reasoning, text = [], "", ""
    for item in response["output"]:
        if item["type"] == "reasoning":
            reasoning += "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls.append((item["name"], json.loads(item["arguments"])))
    finish = {"completed": "stop", "incomplete": "length"}[response["status"]]
    if calls and response["status"] == "completed":
        finish = "tool_calls"
    usage = response["usage"]
    return {
        "reasoning": reasoning,
        "text": text.strip(),
        "calls": calls,
        "finish": finish,
        "tokens": (usage["input_tokens"], usage["output_tokens"]),
    }


def responses_reply(server, body: dict, stream: bool) -> dict:
    if not stream:
        response = post(server, "/v1/responses", body)
        assert response.status_code == 200, response.text
        return _responses_summary(response.json())
    found = events(server, "/v1/responses", body)
    kinds = [name for name, _ in found]
    assert all(name == data["type"] for name, data in found)
    assert [data["sequence_number"] for _, data in found] == list(range(len(found)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = found[-1][1]["response"]
    # each item: added, its deltas, done; the streamed text equals the final items'
    for index, item in enumerate(final["output"]):
        mine = [(n, d) for n, d in found if d.get("output_index") == index]
        assert mine[0][0] == "response.output_item.added" and mine[-1][0] == "response.output_item.done"
        assert mine[-1][1]["item"] == item
        if item["type"] in RESPONSES_ORDER:
            assert [n for n, _ in mine[:3]] == RESPONSES_ORDER[item["type"]]
            text = "".join(d["delta"] for n, d in mine if n.endswith("text.delta"))
            assert text == item["content"][0]["text"]
        else:
            assert [n for n, _ in mine] == [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
    return _responses_summary(final)


def _messages_summary(message: dict) -> dict:
    reasoning = "".join(b["thinking"] for b in message["content"] if b["type"] == "thinking")
    text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"]
    finish = {"end_turn": "stop", "max_tokens": "length", "tool_use": "tool_calls"}[message["stop_reason"]]
    usage = message["usage"]
    return {
        "reasoning": reasoning,
        "text": text.strip(),
        "calls": calls,
        "finish": finish,
        "tokens": (usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"]),
    }


def messages_reply(server, body: dict, stream: bool) -> dict:
    if not stream:
        response = post(server, "/v1/messages", body)
        assert response.status_code == 200, response.text
        return _messages_summary(response.json())
    found = events(server, "/v1/messages", body)
    kinds = [name for name, _ in found]
    assert all(name == data["type"] for name, data in found)
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    message = found[0][1]["message"]
    blocks: dict[int, dict] = {}
    for name, data in found[2:-2]:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks[data["index"]] = {**data["content_block"], "json": ""}
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "json"}[delta["type"]]
            block[key] += delta["text" if key == "text" else "partial_json" if key == "json" else "thinking"]
        else:
            assert name in ("content_block_stop", "ping")
    for block in blocks.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["json"])
        block.pop("json")
    delta = found[-2][1]
    message = {**message, "content": list(blocks.values()), **delta["delta"], "usage": delta["usage"]}
    return _messages_summary(message)


def three_ways(on: bool, tools: bool) -> list[tuple]:
    """The same conversation as the three APIs' bodies (thinking ``on`` or off; a required call of the weather
    tool with parallel calls off, or free text)."""
    chat = {"messages": hi("What is the weather in Paris?" if tools else "Hi"), "temperature": 0}
    responses = {"input": chat["messages"][0]["content"], "temperature": 0}
    messages = {"messages": chat["messages"], "temperature": 0}
    chat["chat_template_kwargs"] = {"enable_thinking": on}
    responses["reasoning"] = {"effort": "medium" if on else "none"}
    messages["thinking"] = {"type": "adaptive" if on else "disabled"}
    if tools:
        chat.update(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=1200)
        responses.update(tools=[RESPONSES_WEATHER], tool_choice="required", parallel_tool_calls=False)
        responses["max_output_tokens"] = 1200
        messages.update(tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
        messages["max_tokens"] = 1200
    else:
        chat["max_tokens"], responses["max_output_tokens"], messages["max_tokens"] = N, N, N
    return [(chat_reply, chat), (responses_reply, responses), (messages_reply, messages)]


@pytest.mark.slow
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
@pytest.mark.parametrize("on", [True, False], ids=["thinking", "no-thinking"])
def test_three_apis_give_the_same_reply_streamed_and_whole(server, on, tools):
    """Greedy, the same conversation through chat completions, Responses and Messages: the same reasoning, text,
    calls (arguments parsed to the same JSON), finish reason and token counts; each API's stream (its events in
    the API's order) gives what its whole reply gives."""
    replies = []
    for reply, body in three_ways(on, tools):
        whole = reply(server, body, stream=False)
        assert reply(server, body, stream=True) == whole, reply.__name__
        replies.append(whole)
    assert replies[0] == replies[1] == replies[2]
    first = replies[0]
    if tools:
        assert first["finish"] == "tool_calls" and [name for name, _ in first["calls"]] == ["get_weather"]
        assert (first["reasoning"] == REASONING) == on
    else:
        assert first["finish"] == "length" and first["tokens"] == (PROMPT_TOKENS + (0 if on else 4), N)
        assert first["text"] == (CYCLE * 2 if on else REASONING + "</think>" + CYCLE * 2).strip()


# ---- the official clients -----------------------------------------------------------------------------------------
@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_openai_client_responses(server, client):
    """responses.create and .stream, a function call and its output sent back, a stored response retrieved,
    counted, continued and deleted; store false keeps nothing; unknown ids are 404s in OpenAI's shape."""
    reply = client.responses.create(model="bigram", input="Hi", max_output_tokens=N)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == REASONING and reply.output_text == CYCLE * 2
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (PROMPT_TOKENS, N)
    assert reply.usage.output_tokens_details.reasoning_tokens == LEAD_TOKENS - 1
    count = client.responses.input_tokens.count(model="bigram", input="Hi")
    assert count.input_tokens == reply.usage.input_tokens

    with client.responses.stream(model="bigram", input="Hi", max_output_tokens=N) as stream:
        seen = list(stream)
    assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == CYCLE * 2
    assert [e.sequence_number for e in seen] == list(range(len(seen)))

    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    follow = client.responses.create(
        model="bigram", input="And now?", previous_response_id=reply.id, max_output_tokens=N
    )
    assert follow.previous_response_id == reply.id
    assert follow.usage.input_tokens > PROMPT_TOKENS + N // 2  # the stored conversation is in the prompt
    client.responses.delete(reply.id)
    for call in (lambda: client.responses.retrieve(reply.id), lambda: client.responses.delete(reply.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="bigram", input="x", previous_response_id=reply.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="bigram", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    # a function call round trip
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model="bigram", tools=[RESPONSES_WEATHER], tool_choice="required", parallel_tool_calls=False)
    called = client.responses.create(
        input=question, max_output_tokens=1200, temperature=1.0, extra_body={"seed": 3}, **ask
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) >= {"city", "unit"}
    answer = client.responses.create(
        model="bigram",
        tools=[RESPONSES_WEATHER],
        input=[
            *question,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
        ],
        max_output_tokens=N,
    )
    assert answer.output_text == CYCLE * 2 and answer.usage.input_tokens > called.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="bigram",
            input=[*question, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
            max_output_tokens=4,
        )
    assert info.value.body["param"] == "input[1].call_id"


@pytest.mark.slow
def test_openai_agents_sdk_responses_model(server):
    """The OpenAI Agents SDK's default model (the Responses API), unmodified: the agent's forced tool call runs
    the tool with valid arguments, the output goes back as a function_call_output, and the run ends with the
    model's text (the bigram model never ends a reply itself: a stop string, an extension this server takes,
    ends the last one; the arguments' enums keep it out of the call)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no traces sent anywhere
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather now in a city."""
        seen.append((city, unit))
        return f"18 degrees {unit} in {city}"

    model = OpenAIResponsesModel(
        model="bigram", openai_client=openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    )
    settings = ModelSettings(
        tool_choice="get_weather", max_tokens=300, temperature=1.0, extra_body={"seed": 5, "stop": ["→"]}
    )
    agent = Agent(name="weather", instructions="Be brief.", tools=[get_weather], model=model, model_settings=settings)
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0][0] in ("Paris", "Rome") and seen[0][1] in ("celsius", "fahrenheit")
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == [f"18 degrees {seen[0][1]} in {seen[0][0]}"]
    assert result.final_output == "é日"  # the reply after the tool, up to the stop string


@pytest.mark.slow
def test_anthropic_client(server):
    """messages.create and .stream with thinking, stop sequences, a tool round trip by tool_use id, count_tokens
    equal to the reply's input tokens, x-api-key, errors in Anthropic's shape."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    ask = dict(model="bigram", max_tokens=N, messages=hi(), thinking={"type": "enabled", "budget_tokens": 2048})
    reply = client.messages.create(**ask)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert (reply.content[0].thinking, reply.content[1].text) == (REASONING, CYCLE * 2)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == N
    count = client.messages.count_tokens(
        model="bigram", messages=hi(), thinking={"type": "enabled", "budget_tokens": 2048}
    )
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens == PROMPT_TOKENS
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    assert final.usage.input_tokens == reply.usage.input_tokens and final.stop_reason == "max_tokens"

    # a thinking budget ends the reasoning; a stop sequence ends the reply and is named
    short = client.messages.create(**{**ask, "thinking": {"type": "enabled", "budget_tokens": 2}})
    assert short.content[0].thinking == "hm" and short.content[1].text.startswith(CYCLE)  # </think> forced
    stopped = client.messages.create(**{**ask, "stop_sequences": ["日"]})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "日"
    assert stopped.content[1].text == "é"
    off = client.messages.create(model="bigram", max_tokens=N, messages=hi())  # thinking absent: off
    assert [b.type for b in off.content] == ["text"] and off.content[0].text.startswith(REASONING + "</think>")

    # a tool round trip: the tool_use id comes back in the tool_result
    question = hi("What is the weather in Paris?")
    tools = dict(tools=[ANTHROPIC_WEATHER], model="bigram")
    called = client.messages.create(
        **tools, messages=question, max_tokens=1200, tool_choice={"type": "tool", "name": "get_weather"}
    )
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.id.startswith("toolu_") and set(use.input) >= {"city", "unit"}
    history = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"}]},
    ]
    answer = client.messages.create(**tools, messages=history, max_tokens=N, thinking={"type": "adaptive"})
    assert answer.content[-1].text == CYCLE * 2 and answer.usage.input_tokens > called.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            **tools,
            max_tokens=4,
            messages=[*question, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[1].content[0].tool_use_id" in info.value.body["error"]["message"]

    # the key by x-api-key (the client's header) and by Authorization; a wrong one is Anthropic's 401
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="bigram", max_tokens=4, messages=hi())
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": info.value.body["error"]["message"]},
    }
    assert post(server, "/v1/messages", {"model": "x", "max_tokens": 4, "messages": hi()}).status_code == 200


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_of_either_api_is_cancelled(server):
    """A client that drops a long Responses or Messages stream: its generation is cancelled between two tokens
    and its slot passes on (the core's stream, whichever API writes it)."""
    headers = {"authorization": f"Bearer {KEY}"}
    for path, body in (
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2000}),
        ("/v1/messages", {"messages": hi(), "max_tokens": 2000}),
    ):
        before = server.health()["cancelled"]
        with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=headers) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 12:
                    break
        state = server.wait_health(lambda h, n=before + 1: h["cancelled"] == n and h["running"] == 0, timeout=15)
        assert state["last"]["completion_tokens"] < 2000, path


# ---- bad input, in each API's shape ------------------------------------------------------------------------------
def tiny_png(size=(8, 8)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


UNENFORCEABLE = {
    "type": "object",
    "properties": {"x": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}},
    "required": ["x"],
}
"""A valid JSON Schema the grammar engine cannot enforce (llguidance lacks ``dependentSchemas``)."""
BIG_IMAGE = "A" * 140_000
"""Base64 of more bytes than the server's --max-image-bytes."""
M = {"model": "bigram", "max_tokens": 4}
R = {"model": "bigram", "max_output_tokens": 4}

BAD_RESPONSES = [
    # (body, status, param)
    ({**R}, 400, "input"),
    ({**R, "input": 5}, 400, "input"),
    ({**R, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({**R, "input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "input[0].content[0].type"),
    ({**R, "input": [{"type": "computer_call"}]}, 400, "input[0].type"),
    ({**R, "input": [{"role": "user", "content": 3}]}, 400, "input[0].content"),
    ({**R, "input": [{"type": "function_call_output", "call_id": "call_x", "output": "y"}]}, 400, "input[0].call_id"),
    (
        {**R, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        400,
        "input[0].arguments",
    ),
    (
        {
            **R,
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64," + BIG_IMAGE}],
                }
            ],
        },
        413,
        "input[0].content[0].image_url",
    ),
    (
        {
            **R,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}],
        },
        400,
        "input[0].content[0].image_url",
    ),
    ({**R, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({**R, "input": "x", "max_output_tokens": -5}, 400, "max_output_tokens"),
    ({**R, "input": "x", "temperature": "hot"}, 400, "temperature"),
    ({**R, "input": "x", "store": "yes"}, 400, "store"),
    ({**R, "input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    (
        {**R, "input": "x", "tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        400,
        "tool_choice.name",
    ),
    (
        {**R, "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
        400,
        "tools[0].parameters",
    ),
    (
        {**R, "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": UNENFORCEABLE}}},
        400,
        "text.format",
    ),
    ({**R, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({**R, "input": "word " * 2100}, 400, "input"),
]

BAD_MESSAGES = [
    ({"model": "bigram", "messages": hi()}, 400, "max_tokens"),
    ({**M, "max_tokens": 0, "messages": hi()}, 400, "max_tokens"),
    ({**M, "max_tokens": -1, "messages": hi()}, 400, "max_tokens"),
    ({**M, "max_tokens": "9", "messages": hi()}, 400, "max_tokens"),
    ({**M}, 400, "messages"),
    ({**M, "messages": []}, 400, "messages"),
    ({**M, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "messages[0].content[0].type"),
    (
        {**M, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        {**M, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages[0].content[0].text",
    ),
    (
        {
            **M,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "y"}]}
            ],
        },
        400,
        "messages[0].content[0].tool_use_id",
    ),
    (
        {
            **M,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": BIG_IMAGE}}
                    ],
                }
            ],
        },
        413,
        "messages[0].content[0].source.data",
    ),
    (
        {
            **M,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}
                    ],
                }
            ],
        },
        400,
        "messages[0].content[0].source.data",
    ),
    ({**M, "messages": hi(), "system": 5}, 400, "system"),
    ({**M, "messages": hi(), "thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({**M, "messages": hi(), "thinking": {"type": "enabled", "budget_tokens": 0}}, 400, "thinking.budget_tokens"),
    ({**M, "messages": hi(), "stop_sequences": [""]}, 400, "stop_sequences"),
    ({**M, "messages": hi(), "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    (
        {**M, "messages": hi(), "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        400,
        "tool_choice.name",
    ),
    (
        {
            **M,
            "messages": hi(),
            "tools": [{"name": "f", "input_schema": UNENFORCEABLE}],
            "tool_choice": {"type": "any"},
        },
        400,
        "tools",
    ),
    ({**M, "messages": hi("word " * 2100)}, 400, "messages"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def assert_anthropic_error(response: httpx.Response, status: int, field: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}
    assert body["error"]["type"] == kind[status], body
    if field is not None:
        assert field in body["error"]["message"], body
    return body["error"]


@pytest.mark.slow
def test_bad_requests_get_each_apis_errors_naming_the_field(server):
    before = server.health()
    for body, status, param in BAD_RESPONSES:
        assert_openai_error(post(server, "/v1/responses", body), status, param)
        if "word " not in str(body.get("input")):  # (a prompt over the capacity is counted: below)
            assert_openai_error(post(server, "/v1/responses/input_tokens", body), status, param)
    for body, status, field in BAD_MESSAGES:
        assert_anthropic_error(post(server, "/v1/messages", body), status, field)
        if field != "max_tokens" and "word " not in str(body.get("messages")):
            assert_anthropic_error(post(server, "/v1/messages/count_tokens", body), status, field)
    over = {**M, "messages": hi("word " * 2100)}
    message = assert_anthropic_error(post(server, "/v1/messages", over), 400, "messages")["message"]
    assert "more than the largest prefill bucket 2048" in message and re.search(r"prompt is \d{4} tokens", message)
    counted = post(server, "/v1/messages/count_tokens", {k: v for k, v in over.items() if k != "max_tokens"})
    assert counted.json()["input_tokens"] == int(re.search(r"prompt is (\d+) tokens", message).group(1))
    for path, check in (("/v1/responses", assert_openai_error), ("/v1/messages", assert_anthropic_error)):
        check(post(server, path, b"{" + b" " * MAX_BODY + b"}"), 413, None)
        check(post(server, path, b'{"input": ['), 400, None)
        check(post(server, path, {**M, "input": "x", "messages": hi()}, key="nope"), 401, None)
        check(post(server, path, b"[1]"), 400, None)
    assert_openai_error(
        httpx.get(f"{server.url}/v1/responses/nope", headers={"authorization": f"Bearer {KEY}"}), 404, "response_id"
    )
    # unknown fields and tools of other types are accepted: a web_search tool and beta fields are skipped
    body = {**R, "input": "Hi", "tools": [{"type": "web_search"}, RESPONSES_WEATHER], "include": ["x"], "new_field": 1}
    assert post(server, "/v1/responses", body).status_code == 200
    body = {**M, "messages": hi(), "tools": [{"type": "web_search_20250305", "name": "web_search"}], "betas": ["x"]}
    assert post(server, "/v1/messages?beta=true", body, header="x-api-key").status_code == 200
    after = server.health()
    assert after["failed"] == before["failed"] == 0 and after["running"] == 0


# ---- kept states, the caps ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kept_states_and_metrics_by_route(capped):
    """On an export with kept states: a stored response's continuation starts from the state it left
    (cached_tokens > 0), as a Messages conversation resent does (cache_read_input_tokens, with count_tokens
    equal to the prompt it reports); replies within --max-tokens; the metrics count requests by route."""
    import anthropic

    client = openai.OpenAI(base_url=f"{capped.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    first = client.responses.create(model="m", input="Tell me about the sea.", max_output_tokens=8, temperature=0)
    follow = client.responses.create(
        model="m", input="And the sky?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert 0 < follow.usage.input_tokens_details.cached_tokens < follow.usage.input_tokens

    claude = anthropic.Anthropic(base_url=capped.url, api_key=KEY, max_retries=0, timeout=120)
    conversation = hi("Tell me about the sea.")
    ask = dict(model="m", max_tokens=32000, messages=conversation)  # (the export samples greedily)
    one = claude.messages.create(**ask)
    assert one.usage.output_tokens <= CAP  # within the server's --max-tokens
    count = claude.messages.count_tokens(model="m", messages=conversation).input_tokens
    assert count == one.usage.input_tokens + one.usage.cache_read_input_tokens
    again = [*conversation, {"role": "assistant", "content": one.content[0].text}, *hi("More.")]
    two = claude.messages.create(**{**ask, "messages": again})
    assert two.usage.cache_read_input_tokens > 0  # the first turn's prompt, continued from its kept state
    counted = claude.messages.count_tokens(model="m", messages=again).input_tokens
    assert counted == two.usage.input_tokens + two.usage.cache_read_input_tokens

    from .test_server import scrape

    values = scrape(capped)
    for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert values.get(("qwen35_onnx_requests_total", (("route", route), ("status", "200")))), route
    generations = ("qwen35_onnx_generations_total", (("outcome", "completed"), ("route", "/v1/messages")))
    assert values[generations] >= 2


@pytest.mark.slow
def test_replies_are_served_up_to_max_tokens_and_the_capacity(server):
    """``serve --max-tokens`` bounds every route's reply, and a request asking for more than the capacity leaves
    is served up to the capacity (every token), each API saying so its way; a prompt over the capacity is a 400
    naming both numbers."""
    assert server.health()["max_tokens"] == MAX_TOKENS
    card = httpx.get(f"{server.url}/v1/models/bigram", headers={"authorization": f"Bearer {KEY}"}).json()
    assert (card["max_tokens"], card["max_model_len"]) == (MAX_TOKENS, CAPACITY)

    def count(text: str) -> int:
        return post(server, "/v1/responses/input_tokens", {"input": text}).json()["input_tokens"]

    per_word = (count("word " * 200) - count("word " * 100)) / 100
    words = 100 + int((CAPACITY - 8 - count("word " * 100)) / per_word)  # a prompt that leaves a few tokens
    for text, limit in (("Hi", MAX_TOKENS), ("word " * words, None)):  # the cap; then the capacity
        prompt = count(text)
        expected = limit or CAPACITY - prompt + 1
        assert expected <= MAX_TOKENS, prompt
        chat = post(server, "/v1/chat/completions", {"messages": hi(text), "max_tokens": 32000}).json()
        assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("length", expected)
        response = post(server, "/v1/responses", {"input": text, "max_output_tokens": 32000}).json()
        assert (response["status"], response["incomplete_details"]["reason"]) == ("incomplete", "max_output_tokens")
        assert response["usage"]["output_tokens"] == expected
        body = {"messages": hi(text), "max_tokens": 32000, "thinking": {"type": "adaptive"}}  # the same prompt
        message = post(server, "/v1/messages", body).json()
        assert (message["stop_reason"], message["usage"]["output_tokens"]) == ("max_tokens", expected)
    over = "word " * CAPACITY
    for path, body in (
        ("/v1/chat/completions", {"messages": hi(over)}),
        ("/v1/responses", {"input": over}),
        ("/v1/messages", {"messages": hi(over), "max_tokens": 4}),
    ):
        text = post(server, path, body).text
        assert re.search(rf"prompt is \d+ tokens, more than the largest prefill bucket {CAPACITY}", text), text


# ---- fuzzed bodies -------------------------------------------------------------------------------------------------
def _fuzz_strategies(fuzzy: bool):
    """Hypothesis strategies of the three APIs' bodies, built from the fields each API reads: with ``fuzzy``, every
    value is either of its own shape or any JSON value and choices include wrong ones (most bodies are wrong
    somewhere); without, every value has its field's shape (many bodies are answered)."""
    from hypothesis import strategies as st

    anything = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-3, 2**40)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6,
    )

    def maybe(strategy):
        return st.one_of(strategy, strategy, anything) if fuzzy else strategy

    def pick(valid: list, wrong: list = ()):
        return maybe(st.sampled_from(valid + list(wrong) if fuzzy else valid))

    text = st.text(max_size=24)
    image = "data:image/png;base64," + tiny_png()
    urls = pick([image], ["https://example.com/a.png", "data:image/png;base64,@@", "/etc/hostname", ""])
    small = maybe(st.integers(-2, 12) if fuzzy else st.integers(1, 12))
    schema = pick([WEATHER["function"]["parameters"], {"type": "object"}], [UNENFORCEABLE, {"type": 3}])
    effort = pick(["none", "minimal", "high"], ["x"])

    part = st.fixed_dictionaries(
        {"type": pick(["input_text", "output_text", "input_image"], ["input_file", "refusal", "x"])},
        optional={"text": maybe(text), "image_url": urls, "file_data": urls, "detail": pick(["low", "high"], ["x"])},
    )
    call_ids = pick(["call_1"], ["call_2", ""])
    item = st.one_of(
        st.fixed_dictionaries(
            {
                "role": pick(["user", "developer"], ["assistant", "system", "robot"]),
                "content": maybe(st.one_of(text, st.lists(part, max_size=3))),
            },
            optional={"type": st.just("message")},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function_call", "custom_tool_call"]), "call_id": call_ids},
            optional={"name": pick(["get_weather"]), "arguments": pick(['{"city": "x"}'], ["{"]), "input": text},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]), "call_id": call_ids},
            optional={"output": maybe(text)},
        ),
        st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"content": maybe(st.lists(part, max_size=2))}),
        *([anything] if fuzzy else []),
    )
    responses_tool = st.one_of(
        st.just(RESPONSES_WEATHER),
        st.fixed_dictionaries(
            {"type": pick(["function", "custom", "web_search"], ["namespace", "x"]), "name": pick(["f", "g"], [""])},
            optional={"parameters": schema, "tools": maybe(st.lists(st.just(RESPONSES_WEATHER), max_size=2))},
        ),
    )
    formats = st.fixed_dictionaries(
        {"type": pick(["text", "json_object"], ["json_schema", "yaml"])},
        optional={"schema": schema, "name": maybe(st.just("x"))},
    )
    responses = st.fixed_dictionaries(
        {"input": maybe(st.one_of(text, st.lists(item, min_size=1, max_size=4)))},
        optional={
            "model": maybe(text),
            "instructions": maybe(text),
            "tools": maybe(st.lists(responses_tool, max_size=2)),
            "tool_choice": pick(["auto", "none"], ["required", {"type": "function", "name": "get_weather"}]),
            "parallel_tool_calls": maybe(st.booleans()),
            "max_output_tokens": small,
            "temperature": maybe(st.floats(-1, 3) if fuzzy else st.floats(0, 2)),
            "top_p": maybe(st.floats(-1, 2) if fuzzy else st.floats(0.1, 1)),
            "stream": maybe(st.booleans()),
            "store": maybe(st.booleans()),
            "previous_response_id": pick(["resp_nope"], [""]),
            "reasoning": maybe(st.fixed_dictionaries({}, optional={"effort": effort})),
            "text": maybe(st.fixed_dictionaries({}, optional={"format": maybe(formats)})),
            "metadata": maybe(st.dictionaries(text, text, max_size=2)),
        },
    )
    source = st.fixed_dictionaries(
        {"type": pick(["base64"], ["url", "text", "file"])},
        optional={
            "media_type": pick(["image/png"], ["text/plain"]),
            "data": pick([tiny_png()], ["@@", "hello"]),
            "url": urls,
        },
    )
    text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
    block = st.fixed_dictionaries(
        {"type": pick(["text", "image"], ["document", "tool_use", "tool_result", "thinking", "video"])},
        optional={
            "text": maybe(text),
            "source": maybe(source),
            "id": pick(["toolu_1"], ["toolu_2"]),
            "tool_use_id": pick(["toolu_1"], ["toolu_2"]),
            "name": pick(["get_weather"]),
            "input": maybe(st.dictionaries(text, text, max_size=2)),
            "content": maybe(st.one_of(text, st.lists(text_block, max_size=2))),
            "thinking": maybe(text),
        },
    )
    message = st.fixed_dictionaries(
        {
            "role": pick(["user"], ["assistant", "system", "robot"]),
            "content": maybe(st.one_of(text, st.lists(block, min_size=1, max_size=3))),
        }
    )
    anthropic_tool = st.one_of(
        st.just(ANTHROPIC_WEATHER),
        st.fixed_dictionaries(
            {"name": pick(["f", "g"], [""])},
            optional={"type": pick(["custom", "bash_20250124"], ["x"]), "input_schema": schema},
        ),
    )
    choice = st.fixed_dictionaries(
        {"type": pick(["auto", "none"], ["any", "tool", "x"])},
        optional={"name": maybe(text), "disable_parallel_tool_use": maybe(st.booleans())},
    )
    thinking = st.fixed_dictionaries(
        {"type": pick(["enabled", "adaptive", "disabled"], ["x"])}, optional={"budget_tokens": small}
    )
    messages = st.fixed_dictionaries(
        {"max_tokens": small, "messages": maybe(st.lists(message, min_size=1, max_size=4))},
        optional={
            "model": maybe(text),
            "system": maybe(st.one_of(text, st.lists(text_block, max_size=2))),
            "tools": maybe(st.lists(anthropic_tool, max_size=2)),
            "tool_choice": maybe(choice),
            "thinking": maybe(thinking),
            "stop_sequences": maybe(st.lists(text.filter(bool), max_size=2)),
            "temperature": maybe(st.floats(-1, 3) if fuzzy else st.floats(0, 1)),
            "top_k": small,
            "stream": maybe(st.booleans()),
            "metadata": maybe(st.dictionaries(text, text, max_size=2)),
        },
    )
    chat_message = st.fixed_dictionaries({"role": pick(["user"], ["assistant", "tool", "x"]), "content": maybe(text)})
    chat = st.fixed_dictionaries(
        {"messages": maybe(st.lists(chat_message, min_size=1, max_size=3))},
        optional={
            "max_tokens": small,
            "tools": maybe(st.lists(st.just(WEATHER), max_size=1)),
            "stream": maybe(st.booleans()),
            "response_format": maybe(st.fixed_dictionaries({"type": pick(["json_object"], ["json_schema", "x"])})),
        },
    )
    return st.one_of(
        st.tuples(st.just("/v1/responses"), responses),
        st.tuples(st.just("/v1/responses/input_tokens"), responses),
        st.tuples(st.just("/v1/messages"), messages),
        st.tuples(st.just("/v1/messages/count_tokens"), messages),
        st.tuples(st.just("/v1/chat/completions"), chat),
    )


@pytest.mark.slow
def test_fuzzed_bodies_get_answers_or_their_apis_errors_never_a_server_error(capped):
    """Bodies of the three APIs drawn from their fields (each value of its own shape or any JSON value), whole and
    streamed: never a 5xx, never a traceback in a body, a 4xx in the route's own shape; then the server answers a
    plain request."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    headers = {"authorization": f"Bearer {KEY}"}
    seen: dict[int, int] = {}

    @settings(max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.one_of(_fuzz_strategies(fuzzy=False), _fuzz_strategies(fuzzy=True)))
    def check(case):
        path, body = case
        with httpx.stream("POST", f"{capped.url}{path}", json=body, headers=headers, timeout=60) as response:
            text = response.read().decode()
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500 and "Traceback" not in text, (path, body, text)
        if response.status_code >= 400:
            error = json.loads(text)
            if path.startswith("/v1/messages"):
                assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, text
            else:
                assert set(error["error"]) == {"message", "type", "param", "code"}, text
        elif response.headers["content-type"].startswith("text/event-stream"):
            last = [line for line in text.splitlines() if line.startswith("data: ")][-1]
            ends = ('"message_stop"', '"response.completed"', '"response.incomplete"', "[DONE]")
            assert any(end in last for end in ends), text[-400:]

    check()
    assert seen.get(200, 0) >= 10 and sum(n for status, n in seen.items() if 400 <= status < 500) >= 20, seen
    reply = post(capped, "/v1/messages", {**M, "messages": hi()})
    assert reply.status_code == 200 and 1 <= reply.json()["usage"]["output_tokens"] <= 4
    assert capped.health()["failed"] == 0


# ---- the pieces without a server ----------------------------------------------------------------------------------
def test_param_names_rename_the_translated_fields():
    from qwen35_onnx.server.request import ParamNames

    names = ParamNames(
        {"messages": "input", "messages[1]": "input[3]", "messages[1].content[0]": "input[3].content[2]"}
    )
    assert names.rename("messages[1].content[0].image_url.url", "messages[1].content[0].image_url.url: bad") == (
        "input[3].content[2].image_url.url",
        "input[3].content[2].image_url.url: bad",
    )
    assert names.rename("messages[10]", "x")[0] == "input[10]"  # messages[1] is no prefix of messages[10]
    assert names.rename("tools[0]", "y") == ("tools[0]", "y") and names.rename(None, "z") == (None, "z")


def test_blocks_follow_the_models_order_and_hold_blank_text():
    from qwen35_onnx.conversation.reasoning import ChatDelta
    from qwen35_onnx.conversation.tool_calls import ToolCall
    from qwen35_onnx.server.blocks import Blocks

    blocks = Blocks()
    kinds = []
    for delta in (
        ChatDelta(reasoning_content="think"),
        ChatDelta(content="\n"),  # blank: held
        ChatDelta(tool_calls=[ToolCall("f", {"a": 1})]),  # a call: the blank text is no block
        ChatDelta(content="\n"),
        ChatDelta(content="done"),
        ChatDelta(content=" \n"),
    ):
        kinds += [(e.what, e.block.kind, e.text) for e in blocks.feed(delta)]
    kinds += [(e.what, e.block.kind, e.text) for e in blocks.finish()]
    assert [b.kind for b in blocks.blocks] == ["reasoning", "call", "text"]
    assert blocks.blocks[2].text == "\ndone \n"
    assert kinds[:4] == [
        ("open", "reasoning", ""),
        ("text", "reasoning", "think"),
        ("close", "reasoning", ""),
        ("open", "call", ""),
    ]
    alone = Blocks()
    alone.feed(ChatDelta(content="\n\n"))
    alone.finish()
    assert [(b.kind, b.text) for b in alone.blocks] == [("text", "\n\n")]  # no call came: the blank text is the reply


def test_responses_input_becomes_chat_messages():
    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.server.errors import APIError
    from qwen35_onnx.server.responses_input import parse_responses_request

    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_image", "image_url": "data:x"}],
            },
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}], "encrypted_content": "x"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** patch"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        ],
        "tools": [
            RESPONSES_WEATHER,
            {"type": "custom", "name": "apply_patch", "description": "Patch files."},
            {"type": "namespace", "name": "crm", "description": "CRM", "tools": [{"type": "function", "name": "find"}]},
            {"type": "web_search"},
        ],
        "reasoning": {"effort": "minimal"},
        "text": {"format": {"type": "json_object"}},
    }
    req = parse_responses_request(body, SamplingConfig())
    messages = req.chat.messages
    assert messages[:2] == [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Rules."}]
    messages = messages[1:]  # (the core joins the leading system messages: tests/test_tools.py)
    assert messages[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:x"}}
    assert messages[2]["reasoning_content"] == "hmm" and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert json.loads(messages[2]["tool_calls"][1]["function"]["arguments"]) == {"input": "*** patch"}
    assert [m["role"] for m in messages[3:]] == ["tool", "tool", "assistant"] and messages[3]["content"] == "sunny"
    assert [t.name for t in req.chat.reply.tools] == ["get_weather", "apply_patch", "find"]
    assert req.tool_names.call_item("find") == ("function", "crm", "find")
    assert req.tool_names.call_item("apply_patch") == ("custom", None, "apply_patch")
    assert req.chat.chat_template_kwargs == {"enable_thinking": False} and req.chat.reply.json_schema == {
        "type": "object"
    }
    assert req.chat.params.rename("messages[2].content[1].image_url.url")[0] == "input[1].content[1].image_url"
    assert req.chat.params.rename("messages[3].tool_calls[0].function.arguments")[0] == "input[3].arguments"
    assert req.conversation == messages  # without the instructions
    with pytest.raises(APIError) as info:
        parse_responses_request(
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, SamplingConfig()
        )
    assert info.value.param == "input[0].call_id"
    # a continuation: the stored conversation's calls are known
    stored = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    follow = parse_responses_request(
        {"input": [{"type": "function_call_output", "call_id": "c9", "output": "y"}]}, SamplingConfig(), stored
    )
    assert [m["role"] for m in follow.chat.messages] == ["user", "assistant", "tool"]


def test_messages_body_becomes_chat_messages():
    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.server.messages import parse_messages_request

    body = {
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
                        "title": "a.txt",
                    },
                ],
            },
        ],
        "tools": [ANTHROPIC_WEATHER, {"type": "bash_20250124", "name": "bash"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "stop_sequences": ["END"],
    }
    req = parse_messages_request(body, SamplingConfig())
    chat = req.chat
    assert chat.messages[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}
    assert chat.messages[2]["reasoning_content"] == "hmm" and chat.messages[2]["content"] == "Let me look."
    assert chat.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}  # results first
    assert chat.messages[4]["content"] == [{"type": "text", "text": "Here:"}, {"type": "text", "text": "a.txt:\nnotes"}]
    assert [t.name for t in chat.reply.tools] == ["get_weather"]  # Anthropic's own tools are skipped
    assert (chat.reply.tool_choice.mode, chat.reply.parallel_tool_calls) == ("required", False)
    assert (chat.chat_template_kwargs, chat.reasoning_budget, chat.stop, chat.max_tokens) == (
        {"enable_thinking": True},
        100,
        ("END",),
        9,
    )
    assert chat.params.rename("messages[4].content[1]")[0] == "messages[2].content[2]"


def test_reasoning_budget_forces_the_end_of_thinking_and_stop_strings_are_named():
    from qwen35_onnx.conversation.reasoning import ReasoningBudget
    from qwen35_onnx.runtime.sampling import StopStrings

    budget = ReasoningBudget(think_end=7, budget=2)
    seen = []
    for token in (1, 2, 3):
        forced = budget.forced()
        seen.append(token if forced is None else forced)
        budget.accept(seen[-1])
    assert seen == [1, 2, 7] and budget.forced() is None  # the reasoning ended: nothing forced after it
    with pytest.raises(ValueError, match="budget"):
        ReasoningBudget(7, 0)
    stops = StopStrings(("END", "ST"))
    assert stops.feed("abc ST") == "abc " and stops.matched == "ST"


def test_templates_get_one_system_message_first():
    """Leading system / developer messages are joined; a later one is a user message where it stands (Codex sends
    several developer messages first, Claude Code a system message after the user's; Qwen3.5's template refuses a
    system message anywhere but first)."""
    from qwen35_onnx.conversation.messages import normalize_messages

    rendered, _ = normalize_messages(
        [
            {"role": "system", "content": "A."},
            {"role": "developer", "content": [{"type": "text", "text": "B."}]},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Context."},
            {"role": "assistant", "content": "Hello."},
        ]
    )
    assert [(m["role"], m["content"]) for m in rendered] == [
        ("system", "A.\n\nB."),
        ("user", "Hi"),
        ("user", "Context."),
        ("assistant", "Hello."),
    ]
    alone, _ = normalize_messages([{"role": "system", "content": [{"type": "text", "text": "S"}]}, *hi()])
    assert alone[0] == {"role": "system", "content": [{"type": "text", "text": "S"}]}  # one: as it was
