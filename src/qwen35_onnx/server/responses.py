"""The OpenAI Responses API over the conversation core (no HTTP here): ``POST /v1/responses`` (whole or
streamed), ``GET`` / ``DELETE /v1/responses/{id}`` (stored responses) and ``POST /v1/responses/input_tokens``.
The body's translation is :mod:`.responses_input`; the store is :mod:`.response_store`.

The reply's output items, in the order the model wrote them: ``reasoning`` (its text as a ``reasoning_text``
content part; ``summary`` empty, no ``encrypted_content``), ``message`` (one ``output_text`` part),
``function_call`` (``call_id``, ``name``, ``arguments``; ``namespace`` for a namespace's function) and
``custom_tool_call`` (``input``). ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the reply reached its token limit (``max_output_tokens``, ``--max-tokens`` or the
capacity); ``usage`` carries ``input_tokens_details.cached_tokens`` (prompt tokens taken from a kept state) and
``output_tokens_details.reasoning_tokens``.

Streamed, as the API orders its events, each with its ``sequence_number`` (from 0) and an ``event:`` line:
``response.created``, ``response.in_progress``; per item ``response.output_item.added``, then for reasoning and
messages ``response.content_part.added``, ``response.reasoning_text.delta`` / ``response.output_text.delta`` ...,
``response.reasoning_text.done`` / ``response.output_text.done``, ``response.content_part.done``; for calls
``response.function_call_arguments.delta`` and ``.done`` (``response.custom_tool_call_input.delta`` and ``.done``);
``response.output_item.done``; last ``response.completed``, ``response.incomplete`` or, when the generation fails,
``response.failed`` (its ``error`` holds the code and message). An SSE comment keeps a long prefill's connection
alive.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from ..conversation.reasoning import ChatDelta
from ..runtime.sampling import SamplingConfig
from .blocks import CALL, REASONING, Block, BlockEvent, Blocks
from .errors import APIError
from .http import sse
from .response_store import ResponseStore
from .responses_input import CUSTOM_INPUT, ResponsesRequest, parse_responses_request

__all__ = ["RESPONSE_ID_SCOPE", "Responses"]

ROUTE = "/v1/responses"
RESPONSE_ID_SCOPE = "qwen35_onnx.response_id"
"""The ASGI scope key under which an in-process caller (the cluster's replica) passes the id a response takes
(so the router can send its continuations to the replica that stores it)."""


def _hex() -> str:
    return uuid.uuid4().hex


class _Output:
    """The output items of one response, built from block events, and the stream events that tell them."""

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.items: list[dict] = []
        self.blocks = Blocks()
        self.incomplete = False

    def _call_item(self, block: Block, status: str) -> dict:
        call = block.call
        kind, namespace, name = self.req.tool_names.call_item(call.name)
        if kind == "custom":
            text = call.arguments.get(CUSTOM_INPUT)
            text = text if isinstance(text, str) else json.dumps(call.arguments, ensure_ascii=False)
            item = {"id": block.id, "type": "custom_tool_call", "call_id": call.id, "name": name, "input": text}
        else:
            arguments = call.to_openai()["function"]["arguments"]
            item = {"id": block.id, "type": "function_call", "call_id": call.id, "name": name, "arguments": arguments}
            if namespace is not None:
                item["namespace"] = namespace
        item["status"] = status
        return item

    def _item(self, block: Block, status: str) -> dict:
        if block.kind == CALL:
            return self._call_item(block, status)
        if block.kind == REASONING:
            part = {"type": "reasoning_text", "text": block.text}
            return {
                "id": block.id,
                "type": "reasoning",
                "summary": [],
                "content": [part] if status != "in_progress" else [],
                "encrypted_content": None,
                "status": status,
            }
        part = {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}
        return {
            "id": block.id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if status != "in_progress" else [],
        }

    def _part(self, block: Block) -> dict:
        if block.kind == REASONING:
            return {"type": "reasoning_text", "text": block.text}
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}

    def events(self, event: BlockEvent, last: bool = False) -> list[tuple[str, dict]]:
        """The stream events ``(type, fields)`` of one block event (``last``: it closes the reply's last block)."""
        block = event.block
        at = {"output_index": block.index}
        if event.what == "open":
            block.id = {"reasoning": "rs_", "text": "msg_", "call": "fc_"}[block.kind] + _hex()
            self.items.append(self._item(block, "in_progress"))
            out = [("response.output_item.added", {**at, "item": self._item(block, "in_progress")})]
            if block.kind != CALL:
                empty = {**self._part(block), "text": ""}
                out.append(
                    ("response.content_part.added", {"item_id": block.id, **at, "content_index": 0, "part": empty})
                )
            return out
        if event.what == "text":
            kind = "response.reasoning_text.delta" if block.kind == REASONING else "response.output_text.delta"
            fields = {"item_id": block.id, **at, "content_index": 0, "delta": event.text}
            if block.kind != REASONING:
                fields["logprobs"] = []
            return [(kind, fields)]
        status = "incomplete" if (last and self.incomplete) else "completed"
        item = self._item(block, status)
        self.items[block.index] = item
        if block.kind == CALL:
            if item["type"] == "custom_tool_call":
                done = [
                    ("response.custom_tool_call_input.delta", {"item_id": block.id, **at, "delta": item["input"]}),
                    ("response.custom_tool_call_input.done", {"item_id": block.id, **at, "input": item["input"]}),
                ]
            else:
                arguments = item["arguments"]
                done = [
                    ("response.function_call_arguments.delta", {"item_id": block.id, **at, "delta": arguments}),
                    (
                        "response.function_call_arguments.done",
                        {"item_id": block.id, **at, "name": item["name"], "arguments": arguments},
                    ),
                ]
            return [*done, ("response.output_item.done", {**at, "item": item})]
        part = self._part(block)
        if block.kind == REASONING:
            text_done = (
                "response.reasoning_text.done",
                {"item_id": block.id, **at, "content_index": 0, "text": block.text},
            )
        else:
            fields = {"item_id": block.id, **at, "content_index": 0, "text": block.text, "logprobs": []}
            text_done = ("response.output_text.done", fields)
        return [
            text_done,
            ("response.content_part.done", {"item_id": block.id, **at, "content_index": 0, "part": part}),
            ("response.output_item.done", {**at, "item": item}),
        ]

    def feed(self, delta: ChatDelta) -> list[tuple[str, dict]]:
        return [e for event in self.blocks.feed(delta) for e in self.events(event)]

    def finish(self, incomplete: bool) -> list[tuple[str, dict]]:
        self.incomplete = incomplete
        closing = self.blocks.finish()
        return [e for i, event in enumerate(closing) for e in self.events(event, last=i == len(closing) - 1)]

    def assistant_message(self) -> dict:
        """The reply as a chat message (the stored conversation's last)."""
        blocks = self.blocks.blocks
        message = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
        reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.blocks.calls:
            message["tool_calls"] = [call.to_openai() for call in self.blocks.calls]
        return message


class Responses:
    """The Responses API of a server (see the module docstring).

    Args:
        model: the served model's id (echoed).
        defaults: the export's sampling defaults.
        store: where stored responses are kept.
        reasoning_tokens: the reasoning tokens of a finished reply (a :class:`~qwen35_onnx.streams.ChatResult`).
        reserved_kwargs: template variables requests may not set.
    """

    route = ROUTE

    def __init__(
        self, model: str, defaults: SamplingConfig, store: ResponseStore, reasoning_tokens, reserved_kwargs=()
    ):
        self.model, self.defaults, self.store = model, defaults, store
        self.reasoning_tokens = reasoning_tokens
        self.reserved_kwargs = frozenset(reserved_kwargs)

    # ---- requests ------------------------------------------------------------------------------------------------
    def parse(self, body, request=None) -> ResponsesRequest:
        """The checked request; the stored conversation of ``previous_response_id`` looked up.

        Raises:
            APIError: 400 naming the field; 404 ``previous_response_not_found``.
        """
        stored = None
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if isinstance(previous, str):
            found = self.store.get(previous)
            if found is None:
                raise APIError(
                    404,
                    f"previous response with id {previous[:100]!r} not found (not stored, dropped from the store, or "
                    "stored by another server)",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            stored = found.conversation
        req = parse_responses_request(body, self.defaults, stored, self.reserved_kwargs)
        if request is not None:
            req.response_id = request.scope.get(RESPONSE_ID_SCOPE)
        return req

    def stored(self, response_id: str) -> dict:
        """``GET /v1/responses/{id}``'s body. Raises APIError 404 ``response_not_found``."""
        found = self.store.get(response_id)
        if found is None:
            raise self._not_found(response_id)
        return found.body

    def delete(self, response_id: str) -> dict:
        """``DELETE /v1/responses/{id}``'s body. Raises APIError 404 ``response_not_found``."""
        if not self.store.delete(response_id):
            raise self._not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @staticmethod
    def _not_found(response_id: str) -> APIError:
        return APIError(
            404, f"no stored response has the id {response_id[:100]!r}", "response_id", "response_not_found"
        )

    @staticmethod
    def input_tokens_body(count: int) -> dict:
        """``POST /v1/responses/input_tokens``'s body."""
        return {"object": "response.input_tokens", "input_tokens": count}

    # ---- replies -------------------------------------------------------------------------------------------------
    def _object(self, turn, req: ResponsesRequest, status: str, output: list, usage, error=None) -> dict:
        sampling = req.chat.sampling
        return {
            "id": req.response_id or f"resp_{turn.id}",
            "object": "response",
            "created_at": turn.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.chat.reply.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.effort, "summary": None},
            "store": req.store,
            "temperature": sampling.temperature,
            "text": {"format": req.text_format},
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "top_p": sampling.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": req.metadata or {},
        }

    def _usage(self, turn) -> dict:
        result = turn.result
        return {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.generation.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(result)},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }

    def _finished(self, turn, req: ResponsesRequest, output: _Output) -> dict:
        """The final response object (stored when the request asked for it)."""
        status = "incomplete" if output.incomplete else "completed"
        body = self._object(turn, req, status, output.items, self._usage(turn))
        if req.store:
            self.store.put(body["id"], [*req.conversation, output.assistant_message()], body)
        return body

    async def events(self, turn, req: ResponsesRequest) -> AsyncIterator[str]:
        """The reply's events (see the module docstring)."""
        sequence = 0

        def event(kind: str, fields: dict) -> str:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return sse(payload, kind)

        output = _Output(req)
        yield event("response.created", {"response": self._object(turn, req, "in_progress", [], None)})
        yield event("response.in_progress", {"response": self._object(turn, req, "in_progress", [], None)})
        try:
            async for delta in turn.deltas():
                if delta is None:
                    yield ": keep-alive\n\n"
                    continue
                for kind, fields in output.feed(delta):
                    yield event(kind, fields)
        except APIError as error:
            failed = {"code": error.code or error.type, "message": error.message}
            yield event("response.failed", {"response": self._object(turn, req, "failed", output.items, None, failed)})
            return
        for kind, fields in output.finish(turn.result.finish_reason == "length"):
            yield event(kind, fields)
        body = self._finished(turn, req, output)
        yield event(f"response.{body['status']}", {"response": body})

    def body(self, turn, deltas: list[ChatDelta], req: ResponsesRequest) -> dict:
        """The whole response object."""
        output = _Output(req)
        for delta in deltas:
            output.feed(delta)
        output.finish(turn.result.finish_reason == "length")
        return self._finished(turn, req, output)
