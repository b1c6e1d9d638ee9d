"""The Anthropic Messages API over the conversation core (no HTTP here): ``POST /v1/messages`` (whole or
streamed) and ``POST /v1/messages/count_tokens``.

Request: ``model``, ``max_tokens`` (required, >= 1), ``messages`` (``user`` / ``assistant``, content a string or
blocks; ``system``, a string or text blocks, as Claude Code sends its context), ``system`` (a string or text
blocks), ``tools`` (``name``, ``description``, ``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``; ``disable_parallel_tool_use``),
``thinking`` (``enabled`` with ``budget_tokens``: the reasoning is ended by ``</think>`` at that many tokens;
``adaptive``: on, no budget of its own; ``disabled``; absent means off, as in Anthropic's API), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``metadata``, ``stream``. Fields this server does not read (``service_tier``,
``container``, ``context_management``, ``cache_control`` on blocks, beta fields ...) are accepted and ignored.

Blocks: ``text``; ``image`` (``source`` ``base64`` with its ``media_type``, or ``url``: a ``data:`` URL, or a local
file as the server's image policy allows; nothing is fetched); ``document`` with a ``text`` or ``content`` source
(its text, under its ``title``); ``tool_use`` (assistant: ``id``, ``name``, ``input``) and ``tool_result`` (user:
``tool_use_id`` of a ``tool_use`` earlier in the conversation, ``content`` a string or text blocks,
``is_error``); ``thinking`` (assistant: the turn's reasoning) and ``redacted_thinking`` (dropped). Anthropic's own
tools (types ``bash_...``, ``text_editor_...``, ``web_search_...``, ``computer_...`` ...) are skipped with one
logged warning per type.

Reply: content blocks ``thinking`` (``signature`` empty), ``text`` and ``tool_use`` (``id`` ``toolu_...``) in the
order the model wrote them; ``stop_reason`` ``end_turn``, ``tool_use``, ``max_tokens`` (the reply reached
``max_tokens``, ``--max-tokens`` or the capacity) or ``stop_sequence`` (with ``stop_sequence``); ``usage``
``input_tokens`` (the prompt tokens not taken from a kept state), ``cache_read_input_tokens`` (those taken from
one: the prompt's tokens are their sum, what ``count_tokens`` counts), ``cache_creation_input_tokens`` 0,
``output_tokens``. Streamed: ``message_start`` (its usage counts the whole prompt as input: which part a kept
state holds is known once the prompt is read), ``ping``, per block ``content_block_start``,
``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``), ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence`` and the final usage) and ``message_stop``; a ``ping`` keeps a
long prefill's connection alive; a failure is an ``error`` event. Errors are Anthropic's error objects
(:func:`~.errors.anthropic_body`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..conversation.reasoning import ChatDelta
from ..runtime.sampling import SamplingConfig
from .blocks import CALL, REASONING, Block, BlockEvent, Blocks
from .errors import APIError, anthropic_body, bad_request
from .http import sse
from .request import (
    ChatRequest,
    ParamNames,
    is_int,
    optional,
    parse_sampling,
    parse_stop,
    reply_format,
    require_object,
    warn_once,
)

__all__ = ["Messages", "MessagesRequest", "parse_messages_request"]

ROUTE = "/v1/messages"
COUNT_ROUTE = "/v1/messages/count_tokens"
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING = ("enabled", "adaptive", "disabled")
USER_BLOCKS = ("text", "image", "document", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")


@dataclass
class MessagesRequest:
    """A checked Messages body: the core's request and the stop sequences (to name the one that ended a reply)."""

    chat: ChatRequest
    stop_sequences: tuple[str, ...] = ()
    tool_names: dict = field(default_factory=dict)


def _text_blocks(content, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks, got {type(content).__name__}", where)
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{k}] must be a text block {{'type': 'text', 'text': ...}}", f"{where}[{k}]")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _image_part(block: dict, where: str, names: ParamNames, chat_where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{where}.source must be an object", f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad_request(f"{where}.source needs media_type and data (strings)", f"{where}.source")
        url, param = f"data:{media};base64,{data}", f"{where}.source.data"
    elif kind == "url":
        url, param = source.get("url"), f"{where}.source.url"
        if not isinstance(url, str):
            raise bad_request(f"{param} must be a string", param)
    else:
        raise bad_request(
            f"{where}.source.type {kind!r:.80} must be 'base64' or 'url' (files are not supported)",
            f"{where}.source.type",
        )
    names.add(f"{chat_where}.image_url.url", param)
    return {"type": "image_url", "image_url": {"url": url}}


def _document_text(block: dict, where: str) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content":
        text = _text_blocks(source.get("content"), f"{where}.source.content")
    else:
        raise bad_request(
            f"{where}.source.type {kind!r:.80}: documents are read as text ('text' or 'content' sources); PDF, URL and "
            "file sources are not supported",
            f"{where}.source",
        )
    title = block.get("title")
    return f"{title}:\n{text}" if isinstance(title, str) and title else text


def _tool_result(block: dict, where: str, calls: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    if call_id not in calls:
        raise bad_request(
            f"{where}.tool_use_id {call_id!r:.80} answers no tool_use block of an earlier assistant message",
            f"{where}.tool_use_id",
        )
    content = block.get("content", "")
    text = _text_blocks(content, f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user(message: dict, where: str, chat_index: int, names: ParamNames, calls: set[str]) -> list[dict]:
    """A user message as chat messages: its tool results (one ``tool`` message each) first, then its other
    blocks."""
    content = message.get("content")
    if isinstance(content, str):
        names.add(f"messages[{chat_index}]", where)
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of content blocks, got {type(content).__name__}",
            f"{where}.content",
        )
    results, parts, origins = [], [], []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in USER_BLOCKS:
            raise bad_request(
                f"{here}.type {kind!r:.80} must be one of {', '.join(USER_BLOCKS)} in a user message", f"{here}.type"
            )
        if kind == "tool_result":
            names.add(f"messages[{chat_index + len(results)}]", here)
            results.append(_tool_result(block, here, calls))
            continue
        origins.append(here)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{here}.text must be a string", f"{here}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(block, here)})
        else:
            chat_where = f"messages[{chat_index + len(results)}].content[{len(parts)}]"
            parts.append(_image_part(block, here, names, chat_where))
    out = list(results)
    if parts:
        index = chat_index + len(results)
        names.add(f"messages[{index}]", where)
        for k, origin in enumerate(origins):
            names.add(f"messages[{index}].content[{k}]", origin)
        out.append({"role": "user", "content": parts})
    return out


def _assistant(message: dict, where: str, chat_index: int, names: ParamNames, calls: set[str]) -> dict:
    content = message.get("content")
    names.add(f"messages[{chat_index}]", where)
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of content blocks, got {type(content).__name__}",
            f"{where}.content",
        )
    text, reasoning, tool_calls = [], [], []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in ASSISTANT_BLOCKS:
            raise bad_request(
                f"{here}.type {kind!r:.80} must be one of {', '.join(ASSISTANT_BLOCKS)} in an assistant message",
                f"{here}.type",
            )
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{here}.text must be a string", f"{here}.text")
            text.append(block["text"])
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{here}.thinking must be a string", f"{here}.thinking")
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            for key, value in (("id", call_id), ("name", name)):
                if not isinstance(value, str) or not value:
                    raise bad_request(f"{here}.{key} must be a non-empty string", f"{here}.{key}")
            if not isinstance(arguments, dict):
                raise bad_request(f"{here}.input must be an object", f"{here}.input")
            names.add(f"messages[{chat_index}].tool_calls[{len(tool_calls)}]", here)
            names.add(f"messages[{chat_index}].tool_calls[{len(tool_calls)}].function.arguments", f"{here}.input")
            tool_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            calls.add(call_id)
    out = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def translate_messages(messages, names: ParamNames, offset: int) -> list[dict]:
    """Chat messages of Anthropic ``messages`` (see the module docstring), numbered from ``offset``.

    Raises:
        APIError: 400 naming the field: a role other than user or assistant, an unknown block, a tool_result
            answering no earlier tool_use.
    """
    if not isinstance(messages, list):
        raise bad_request(f"messages must be a list of message objects, got {type(messages).__name__}", "messages")
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    out: list[dict] = []
    calls: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object, got {type(message).__name__}", where)
        role = message.get("role")
        if role == "user":
            out += _user(message, where, offset + len(out), names, calls)
        elif role == "assistant":
            out.append(_assistant(message, where, offset + len(out), names, calls))
        elif role == "system":  # Claude Code sends its context so, after the user's first message
            names.add(f"messages[{offset + len(out)}]", where)
            out.append({"role": "system", "content": _text_blocks(message.get("content"), f"{where}.content")})
        else:
            raise bad_request(f"{where}.role {role!r:.80} must be 'user', 'assistant' or 'system'", f"{where}.role")
    return out


def _tools(tools, names: ParamNames) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be a tool object, got {type(tool).__name__}", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            warn_once(
                f"anthropic-tool:{kind}",
                "skipping Anthropic tools of type %r: client tools with an input_schema only",
                kind,
            )
            continue
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        names.add(f"tools[{len(out)}].function.parameters", f"{where}.input_schema")
        names.add(f"tools[{len(out)}].function", where)
        names.add(f"tools[{len(out)}]", where)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> tuple[object, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*TOOL_CHOICES, "tool"):
        raise bad_request("tool_choice.type must be one of auto, any, tool, none", "tool_choice.type")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
    parallel = None if disable is None else not disable
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must be a string", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    return TOOL_CHOICES[kind], parallel


def _thinking(value) -> tuple[bool, int | None]:
    """``(thinking on, reasoning budget)`` of ``thinking`` (absent: off)."""
    if value is None:
        return False, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in THINKING:
        raise bad_request(
            f"thinking.type must be one of {', '.join(THINKING)}, got {json.dumps(kind)[:40]}", "thinking.type"
        )
    if kind != "enabled":
        return kind == "adaptive", None
    budget = optional(
        value, "budget_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1", "thinking.budget_tokens"
    )
    return True, budget


def parse_messages_request(body, defaults: SamplingConfig, count: bool = False) -> MessagesRequest:
    """Check an Anthropic Messages body and translate it (see the module docstring); ``count``: a count_tokens
    body (no ``max_tokens``).

    Raises:
        APIError: 400 naming the field.
    """
    body = require_object(body)
    optional(body, "model", lambda v: isinstance(v, str), "a string")
    max_tokens = None
    if not count:
        if "max_tokens" not in body:
            raise bad_request("max_tokens is required", "max_tokens")
        max_tokens = optional(body, "max_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1")
        if max_tokens is None:
            raise bad_request("max_tokens must be an integer >= 1, got null", "max_tokens")
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    stream = bool(optional(body, "stream", lambda v: isinstance(v, bool), "true or false"))
    optional(body, "metadata", lambda v: isinstance(v, dict), "an object")
    sampling = parse_sampling(body, defaults, seed_field=None)
    stop = parse_stop(body.get("stop_sequences"), "stop_sequences")
    thinking, budget = _thinking(body.get("thinking"))

    names = ParamNames({"messages": "messages"})
    tools = _tools(body.get("tools"), names)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    names.add("tool_choice.function", "tool_choice")
    reply = reply_format(tools or None, choice, parallel, None, names)

    system = body.get("system")
    messages = []
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
            names.add("messages[0]", "system")
    messages += translate_messages(body["messages"], names, len(messages))
    chat = ChatRequest(
        messages=messages,
        stream=stream,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        chat_template_kwargs={"enable_thinking": thinking},
        reply=reply,
        reasoning_budget=budget,
        params=names,
    )
    return MessagesRequest(chat, stop)


def _stop_reason(result) -> tuple[str, str | None]:
    reason = result.finish_reason
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = result.generation.stop_string
    return ("stop_sequence", matched) if matched else ("end_turn", None)


class _Content:
    """The content blocks of one reply, built from block events, and the stream events that tell them."""

    def __init__(self):
        self.blocks = Blocks()

    @staticmethod
    def block(block: Block, whole: bool) -> dict:
        if block.kind == CALL:
            call = block.call
            return {"type": "tool_use", "id": block.id, "name": call.name, "input": call.arguments if whole else {}}
        if block.kind == REASONING:
            return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
        return {"type": "text", "text": block.text if whole else ""}

    def events(self, event: BlockEvent) -> list[tuple[str, dict]]:
        block = event.block
        if event.what == "open":
            if block.kind == CALL:
                block.id = "toolu_" + block.call.id.removeprefix("call_")
            out = [("content_block_start", {"index": block.index, "content_block": self.block(block, False)})]
            if block.kind == CALL:
                delta = {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(block.call.arguments, ensure_ascii=False),
                }
                out.append(("content_block_delta", {"index": block.index, "delta": delta}))
            return out
        if event.what == "text":
            delta = (
                {"type": "thinking_delta", "thinking": event.text}
                if block.kind == REASONING
                else {"type": "text_delta", "text": event.text}
            )
            return [("content_block_delta", {"index": block.index, "delta": delta})]
        return [("content_block_stop", {"index": block.index})]

    def feed(self, delta: ChatDelta) -> list[tuple[str, dict]]:
        return [e for event in self.blocks.feed(delta) for e in self.events(event)]

    def finish(self) -> list[tuple[str, dict]]:
        return [e for event in self.blocks.finish() for e in self.events(event)]

    def content(self) -> list[dict]:
        return [self.block(b, True) for b in self.blocks.blocks]


class Messages:
    """The Anthropic Messages API of a server (see the module docstring): ``model`` the served model's id,
    ``defaults`` the export's sampling."""

    route = ROUTE
    count_route = COUNT_ROUTE

    def __init__(self, model: str, defaults: SamplingConfig):
        self.model, self.defaults = model, defaults

    def parse(self, body, request=None) -> MessagesRequest:
        return parse_messages_request(body, self.defaults)

    def parse_count(self, body) -> MessagesRequest:
        return parse_messages_request(body, self.defaults, count=True)

    @staticmethod
    def count_body(count: int) -> dict:
        return {"input_tokens": count}

    @staticmethod
    def _usage(result) -> dict:
        cached = result.generation.cached_tokens
        return {
            "input_tokens": result.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": result.completion_tokens,
        }

    def _message(self, turn, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
        return {
            "id": f"msg_{turn.id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    async def events(self, turn, req: MessagesRequest) -> AsyncIterator[str]:
        """The reply's events (see the module docstring)."""

        def event(kind: str, fields: dict | None = None) -> str:
            return sse({"type": kind, **(fields or {})}, kind)

        start_usage = {
            "input_tokens": turn.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        yield event("message_start", {"message": self._message(turn, [], None, None, start_usage)})
        yield event("ping")
        content = _Content()
        try:
            async for delta in turn.deltas():
                if delta is None:
                    yield event("ping")
                    continue
                for kind, fields in content.feed(delta):
                    yield event(kind, fields)
        except APIError as error:
            yield event("error", {"error": anthropic_body(error)["error"]})
            return
        for kind, fields in content.finish():
            yield event(kind, fields)
        result = turn.result
        stop_reason, stop_sequence = _stop_reason(result)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield event("message_delta", {"delta": delta, "usage": self._usage(result)})
        yield event("message_stop")

    def body(self, turn, deltas: list[ChatDelta], req: MessagesRequest) -> dict:
        """The whole message."""
        content = _Content()
        for delta in deltas:
            content.feed(delta)
        content.finish()
        result = turn.result
        stop_reason, stop_sequence = _stop_reason(result)
        return self._message(turn, content.content(), stop_reason, stop_sequence, self._usage(result))
