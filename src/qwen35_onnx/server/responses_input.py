"""A Responses API body (``POST /v1/responses``, ``/v1/responses/input_tokens``) translated into the core's
:class:`~.request.ChatRequest` (no HTTP): the input items into chat messages, the tools into function tools,
``text.format`` into the answer's JSON schema, ``reasoning.effort`` into the thinking switch.

Input (``input``: a string, or a list of items):

- messages ``{"type": "message"?, "role": "user" | "assistant" | "system" | "developer", "content"}``, content a
  string or parts: ``input_text`` / ``output_text`` (``text``), ``refusal``, ``input_image`` (``image_url``: a
  ``data:`` URL, or a local file as the server's image policy allows; ``detail``), ``input_file`` (``file_data``:
  a data URL of an image or of text, e.g. ``text/plain``, ``application/json``; ``filename`` written above a
  text file);
- ``function_call`` (``call_id``, ``name``, ``arguments``; ``namespace`` as this server wrote it) and
  ``custom_tool_call`` (``call_id``, ``name``, ``input``): the model's calls sent back; consecutive calls, reasoning
  and assistant text make one assistant turn;
- ``function_call_output`` / ``custom_tool_call_output`` (``call_id``, ``output``: a string or text parts): the
  result of a call the conversation holds (an unknown ``call_id`` is a 400);
- ``reasoning`` (``content`` ``reasoning_text`` parts; ``summary`` and ``encrypted_content`` are not read): the
  reasoning of the assistant turn it precedes.

``instructions`` is the first system message (the core joins the system and developer messages before the first
other message into one and makes later ones user messages: chat templates take one system message, first). With
``previous_response_id`` the stored response's conversation comes before ``input`` (its instructions do not:
OpenAI's rule).

Tools: ``function`` tools (``name``, ``description``, ``parameters``), the functions a ``namespace`` tool carries
(called by their own names; the call comes back with its ``namespace``), and ``custom`` tools (free-text input:
a function of one string parameter ``input``; the call comes back as a ``custom_tool_call``). Other tool types
(``web_search``, ``file_search``, ``computer_use_preview``, ``code_interpreter``, ``image_generation``, ``mcp``,
``local_shell`` ...) run on OpenAI's side and are skipped with one logged warning per type, never refused.
Sampling: ``temperature``, ``top_p``, and as extensions (chat completions' fields, as vLLM takes them) ``top_k``,
``seed``, ``stop`` and ``chat_template_kwargs``.

``tool_choice``: ``auto``, ``none``, ``required``, ``{"type": "function", "name"}``, ``{"type": "custom",
"name"}``, ``{"type": "allowed_tools", "mode", "tools"}`` (the tools listed, mode ``auto`` or ``required``); a
hosted tool's choice is ``auto``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field

from ..conversation.tools import ReplyFormat
from ..runtime.sampling import SamplingConfig
from .errors import bad_request
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

__all__ = ["ResponsesRequest", "ToolNames", "parse_responses_request", "translate_input"]

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
TEXT_FILE_TYPES = re.compile(r"^(text/[\w.+-]+|application/(json|xml|javascript|x-[\w.+-]+|[\w.+-]+\+(json|xml)))$")
EFFORT_OFF = ("none", "minimal")
CUSTOM_INPUT = "input"
"""The one parameter of a custom tool's function."""


@dataclass
class ToolNames:
    """How the tools of a request are named to the model and back: the name the model calls -> ``(kind,
    namespace, name)`` with kind ``function`` or ``custom``."""

    exposed: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)

    def call_item(self, called: str) -> tuple[str, str | None, str]:
        """``(kind, namespace, name)`` of a call of ``called`` (a name no tool has: a function of that name)."""
        return self.exposed.get(called, ("function", None, called))


@dataclass
class ResponsesRequest:
    """A checked Responses body: the core's request and what the reply echoes or needs.

    Attributes:
        chat: the core's request.
        conversation: the chat messages of the conversation without the instructions (stored with the reply).
        instructions, previous_response_id, store, metadata, max_output_tokens: as sent.
        effort: ``reasoning.effort`` as sent (None: absent).
        tools, tool_choice, text_format: as sent (echoed in the response object).
        tool_names: how calls are written back (:class:`ToolNames`).
        response_id: the id the reply takes (None: the server draws one).
    """

    chat: ChatRequest
    conversation: list
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict | None = None
    max_output_tokens: int | None = None
    effort: str | None = None
    tools: list = field(default_factory=list)
    tool_choice: object = "auto"
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    tool_names: ToolNames = field(default_factory=ToolNames)
    response_id: str | None = None


# ---- tools -------------------------------------------------------------------------------------------------------
def _function_tool(tool: dict, where: str, names: ParamNames, chat_index: int) -> dict:
    name = tool.get("name")
    if not isinstance(name, str):
        raise bad_request(f"{where}.name must be a string, got {json.dumps(name)[:80]}", f"{where}.name")
    function = {"name": name, "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    names.add(f"tools[{chat_index}].function", where)
    names.add(f"tools[{chat_index}]", where)
    return {"type": "function", "function": function}


def _custom_tool(tool: dict, where: str, names: ParamNames, chat_index: int) -> dict:
    name = tool.get("name")
    if not isinstance(name, str):
        raise bad_request(f"{where}.name must be a string, got {json.dumps(name)[:80]}", f"{where}.name")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description = f"{description or ''}\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n" + str(
            fmt["definition"]
        )
    names.add(f"tools[{chat_index}].function", where)
    names.add(f"tools[{chat_index}]", where)
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "the tool's input, as free text"}},
        "required": [CUSTOM_INPUT],
    }
    function = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description.strip()
    return {"type": "function", "function": function}


def parse_tools(tools, names: ParamNames) -> tuple[list, ToolNames]:
    """Chat-form function tools of a Responses ``tools`` list and how their calls are named (see the module
    docstring; hosted tools skipped with a warning).

    Raises:
        APIError: 400 naming the field: not a list, a tool that is not an object, a function or custom tool
            without a string name, a namespace without a list of tools.
    """
    if tools is None:
        return [], ToolNames()
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    out, exposed = [], ToolNames()

    def add(chat_tool: dict, kind: str, namespace: str | None, where: str) -> None:
        name = chat_tool["function"]["name"]
        if name in exposed.exposed:
            warn_once(f"duplicate:{name}", "tool %r is given twice (%s); the first one is offered", name, where)
            return
        exposed.exposed[name] = (kind, namespace, name)
        out.append(chat_tool)

    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be a tool object, got {type(tool).__name__}", where)
        kind = tool.get("type")
        if kind == "function":
            add(_function_tool(tool, where, names, len(out)), "function", None, where)
        elif kind == "custom":
            add(_custom_tool(tool, where, names, len(out)), "custom", None, where)
        elif kind == "namespace":
            inner = tool.get("tools")
            namespace = tool.get("name")
            if not isinstance(inner, list) or not isinstance(namespace, str):
                raise bad_request(f"{where} (a namespace) must have a string name and a list of tools", where)
            for j, member in enumerate(inner):
                here = f"{where}.tools[{j}]"
                member_kind = member.get("type", "function") if isinstance(member, dict) else None
                if member_kind == "function":
                    add(_function_tool(member, here, names, len(out)), "function", namespace, here)
                elif member_kind == "custom":
                    add(_custom_tool(member, here, names, len(out)), "custom", namespace, here)
                else:
                    warn_once(f"tool:{member_kind}", "skipping a tool of type %r in a namespace", member_kind)
        else:
            warn_once(
                f"tool:{kind}",
                "skipping tools of type %r: this server runs function, custom and namespace tools only",
                kind,
            )
    return out, exposed


def _tool_choice(choice, chat_tools: list) -> tuple[object, list]:
    """The chat-form ``tool_choice`` (and the tools it leaves) of a Responses ``tool_choice``."""
    if choice is None or isinstance(choice, str):
        return choice, chat_tools
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must be a string", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, chat_tools
    if kind == "allowed_tools":
        listed = choice.get("tools")
        mode = choice.get("mode", "auto")
        if not isinstance(listed, list) or mode not in ("auto", "required"):
            raise bad_request(
                "tool_choice (allowed_tools) needs tools (a list) and mode 'auto' or 'required'", "tool_choice"
            )
        allowed = {t.get("name") for t in listed if isinstance(t, dict)}
        return mode, [t for t in chat_tools if t["function"]["name"] in allowed]
    warn_once(f"tool_choice:{kind}", "tool_choice of type %r (a hosted tool) is taken as 'auto'", kind)
    return "auto", chat_tools


# ---- input items -------------------------------------------------------------------------------------------------
def _text_file(data: bytes, where: str, filename) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"{where}.file_data is not UTF-8 text", f"{where}.file_data") from None
    return f"{filename}:\n{text}" if isinstance(filename, str) and filename else text


def _file_part(part: dict, where: str) -> dict:
    """An ``input_file`` part as a chat part: an image, or the text of a text file."""
    data = part.get("file_data")
    if not isinstance(data, str):
        source = "file_id" if part.get("file_id") is not None else "file_url" if part.get("file_url") else None
        raise bad_request(
            f"{where}: only files sent inline as file_data (a data: URL) are read here"
            + (f"; {source} is not supported (no files API, nothing fetched)" if source else ""),
            f"{where}.{source or 'file_data'}",
        )
    match = re.match(r"^data:([\w.+-]+/[\w.+-]+)(;[^,]*)?,", data)
    media = match.group(1).lower() if match else None
    if media and media.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": data}}
    if media is None or not TEXT_FILE_TYPES.match(media):
        raise bad_request(
            f"{where}.file_data must be a data: URL of an image or of text (text/*, application/json ...), got "
            f"{(media or 'no media type')!r}",
            f"{where}.file_data",
        )
    payload = data[match.end() :]
    if ";base64" in (match.group(2) or ""):
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}.file_data is not valid base64", f"{where}.file_data") from None
    else:
        from urllib.parse import unquote_to_bytes

        raw = unquote_to_bytes(payload)
    return {"type": "text", "text": _text_file(raw, where, part.get("filename"))}


def _content(content, where: str, chat_where: str, names: ParamNames) -> str | list:
    """A message's content as chat content (a string, or text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of content parts, got {type(content).__name__}",
            f"{where}.content",
        )
    parts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict):
            raise bad_request(f"{here} must be a content part object, got {type(part).__name__}", here)
        names.add(f"{chat_where}.content[{len(parts)}]", here)
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{here}.text must be a string, got {type(text).__name__}", f"{here}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise bad_request(f"{here}.refusal must be a string", f"{here}.refusal")
            parts.append({"type": "text", "text": refusal})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                param = f"{here}.file_id" if part.get("file_id") is not None else f"{here}.image_url"
                raise bad_request(f"{param}: send the image as image_url (a data: URL); files are not supported", param)
            image = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            names.add(f"{chat_where}.content[{len(parts)}].image_url.url", f"{here}.image_url")
            names.add(f"{chat_where}.content[{len(parts)}].image_url.detail", f"{here}.detail")
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_file":
            parts.append(_file_part(part, here))
            names.add(f"{chat_where}.content[{len(parts) - 1}].image_url.url", f"{here}.file_data")
        else:
            raise bad_request(
                f"{here}.type {kind!r:.80} must be one of input_text, output_text, refusal, input_image, input_file",
                f"{here}.type",
            )
    return parts


def _text_of(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _output_text(output, where: str) -> str:
    """A call output: a string, or parts whose text is joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for k, part in enumerate(output):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise bad_request(
                    f"{where}.output[{k}]: a call's output may hold text parts only (input_text), got {kind!r:.80}",
                    f"{where}.output[{k}]",
                )
        return "".join(texts)
    raise bad_request(
        f"{where}.output must be a string or a list of text parts, got {type(output).__name__}", f"{where}.output"
    )


class _Turns:
    """The chat messages of input items: consecutive assistant pieces (text, reasoning, calls) make one assistant
    message, a call's output a ``tool`` message after it."""

    def __init__(self, names: ParamNames, offset: int, known_calls: set[str], tools: ToolNames):
        self.messages: list[dict] = []
        self.names, self.offset, self.calls, self.tools = names, offset, known_calls, tools
        self._assistant: dict | None = None

    def _where(self) -> str:
        return f"messages[{self.offset + len(self.messages)}]"

    def _flush(self) -> None:
        if self._assistant is not None:
            self.messages.append(self._assistant)
            self._assistant = None

    def _open_assistant(self, where: str) -> dict:
        if self._assistant is None:
            self.names.add(self._where(), where)
            self._assistant = {"role": "assistant", "content": ""}
        return self._assistant

    def message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role {role!r:.80} is not one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
        if role == "assistant":
            assistant = self._assistant
            if assistant is not None and assistant.get("tool_calls"):
                self._flush()  # text after calls: a turn of its own
            chat_where = self._where()
            assistant = self._open_assistant(where)
            assistant["content"] += _text_of(_content(item.get("content"), where, chat_where, self.names))
            return
        self._flush()
        chat_where = self._where()
        self.names.add(chat_where, where)
        content = _content(item.get("content"), where, chat_where, self.names)
        if role in ("system", "developer") and isinstance(content, list) and all(p["type"] == "text" for p in content):
            content = _text_of(content)  # one string: templates write a system message's string
        self.messages.append({"role": role, "content": content})

    def reasoning(self, item: dict, where: str) -> None:
        texts = []
        for k, part in enumerate(item.get("content") or []):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{k}] must be a reasoning_text part", f"{where}.content[{k}]")
            texts.append(part["text"])
        if self._assistant is not None and (self._assistant.get("tool_calls") or self._assistant["content"]):
            self._flush()
        assistant = self._open_assistant(where)
        assistant["reasoning_content"] = assistant.get("reasoning_content", "") + "".join(texts)

    def call(self, item: dict, where: str, custom: bool) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        for key, value in (("call_id", call_id), ("name", name)):
            if not isinstance(value, str) or not value:
                raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
        if custom:
            text = item.get("input")
            if not isinstance(text, str):
                raise bad_request(f"{where}.input must be a string", f"{where}.input")
            arguments = json.dumps({CUSTOM_INPUT: text})
        else:
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise bad_request(f"{where}.arguments must be a string (JSON text)", f"{where}.arguments")
        assistant = self._open_assistant(where)
        calls = assistant.setdefault("tool_calls", [])
        chat_where = f"{self._where()}.tool_calls[{len(calls)}]"
        self.names.add(chat_where, where)
        self.names.add(f"{chat_where}.function.arguments", f"{where}.{'input' if custom else 'arguments'}")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self.calls.add(call_id)

    def output(self, item: dict, where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
        self._flush()
        if call_id not in self.calls:
            raise bad_request(
                f"{where}.call_id {call_id!r:.80} answers no call of the conversation (no function_call or "
                "custom_tool_call item with that call_id comes before it)",
                f"{where}.call_id",
            )
        self.names.add(self._where(), where)
        self.messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), where)}
        )

    def finish(self) -> list[dict]:
        self._flush()
        return self.messages


def translate_input(value, names: ParamNames, offset: int, known_calls: set[str], tools: ToolNames) -> list[dict]:
    """Chat messages of a Responses ``input`` (a string or items, see the module docstring), numbered from
    ``offset`` in ``names``; ``known_calls``: call ids earlier in the conversation (updated).

    Raises:
        APIError: 400 naming the item's field.
    """
    if isinstance(value, str):
        names.add(f"messages[{offset}]", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"input must be a string or a list of items, got {type(value).__name__}", "input")
    turns = _Turns(names, offset, known_calls, tools)
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an item object, got {type(item).__name__}", where)
        kind = item.get("type", "message")
        if kind == "message":
            turns.message(item, where)
        elif kind == "reasoning":
            turns.reasoning(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            turns.call(item, where, kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turns.output(item, where)
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference is not supported; send the item itself", f"{where}.type")
        else:
            raise bad_request(
                f"{where}.type {kind!r:.80} must be one of message, reasoning, function_call, function_call_output, "
                "custom_tool_call, custom_tool_call_output",
                f"{where}.type",
            )
    return turns.finish()


def calls_of(messages: list[dict]) -> set[str]:
    """The call ids of the assistant messages of a chat conversation."""
    return {c.get("id") for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or ()}


def parse_responses_request(
    body,
    defaults: SamplingConfig,
    stored: list | None = None,
    reserved_kwargs=frozenset(),
) -> ResponsesRequest:
    """Check a Responses body and translate it (see the module docstring); ``stored``: the conversation of
    ``previous_response_id`` (the caller looked it up), None without one.

    Raises:
        APIError: 400 naming the field.
    """
    body = require_object(body)
    optional(body, "model", lambda v: isinstance(v, str), "a string")
    stream = bool(optional(body, "stream", lambda v: isinstance(v, bool), "true or false"))
    store = optional(body, "store", lambda v: isinstance(v, bool), "true or false")
    instructions = optional(body, "instructions", lambda v: isinstance(v, str), "a string")
    metadata = optional(body, "metadata", lambda v: isinstance(v, dict), "an object")
    previous = optional(body, "previous_response_id", lambda v: isinstance(v, str), "a string")
    max_output = optional(body, "max_output_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1")
    for unsupported in ("conversation", "prompt"):
        if body.get(unsupported) is not None:
            raise bad_request(
                f"{unsupported} is not supported by this server (send the conversation as input, or "
                "previous_response_id)",
                unsupported,
            )
    sampling = parse_sampling(body, defaults)
    reasoning = optional(body, "reasoning", lambda v: isinstance(v, dict), "an object")
    effort = None
    if reasoning:
        effort = optional(reasoning, "effort", lambda v: isinstance(v, str), "a string", "reasoning.effort")
    kwargs = {}
    if effort is not None:
        kwargs["enable_thinking"] = effort not in EFFORT_OFF
    template_kwargs = optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object") or {}
    reserved = sorted(set(reserved_kwargs) & set(template_kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    kwargs = {**template_kwargs, **kwargs}

    names = ParamNames({"response_format": "text.format", "messages": "input", "tool_choice.function": "tool_choice"})
    chat_tools, tool_names = parse_tools(body.get("tools"), names)
    choice, offered = _tool_choice(body.get("tool_choice"), chat_tools)
    text = optional(body, "text", lambda v: isinstance(v, dict), "an object") or {}
    fmt = optional(text, "format", lambda v: isinstance(v, dict), "an object", "text.format")
    response_format = None
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            spec.pop("description", None)
            response_format = {"type": "json_schema", "json_schema": spec}
            names.add("response_format.json_schema", "text.format")
        else:
            response_format = {"type": kind}
    reply: ReplyFormat = reply_format(offered or None, choice, body.get("parallel_tool_calls"), response_format, names)

    conversation = list(stored or [])
    if "input" not in body and stored is None:
        raise bad_request("input is required", "input")
    offset = 1 if instructions is not None else 0
    known = calls_of(conversation)
    if conversation:
        names.add(f"messages[{offset}]", "previous_response_id")
    new = (
        []
        if body.get("input") is None
        else translate_input(body["input"], names, offset + len(conversation), known, tool_names)
    )
    conversation += new
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else []) + conversation
    if instructions is not None:
        names.add("messages[0]", "instructions")
    chat = ChatRequest(
        messages=messages,
        stream=stream,
        max_tokens=max_output,
        sampling=sampling,
        stop=parse_stop(body.get("stop"), "stop"),
        chat_template_kwargs=kwargs or None,
        reply=reply,
        params=names,
    )
    return ResponsesRequest(
        chat=chat,
        conversation=conversation,
        instructions=instructions,
        previous_response_id=previous,
        store=store is not False,
        metadata=metadata,
        max_output_tokens=max_output,
        effort=effort,
        tools=body.get("tools") or [],
        tool_choice=body.get("tool_choice") or "auto",
        text_format=fmt or {"type": "text"},
        tool_names=tool_names,
    )
