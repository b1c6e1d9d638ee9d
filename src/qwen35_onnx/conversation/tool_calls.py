"""Tool calls in a reply's text, in the form Qwen3.5 (and Qwen3-Coder) models write them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

:class:`ToolCallParser` is incremental: content text goes in piece by piece; text outside calls
comes out as content as soon as it cannot be the start of ``<tool_call>``, and each call comes out
whole once its ``</tool_call>`` (or, at the end of the reply, its ``</function>``) is read.
Argument values are typed by the tool's parameter schema: a string parameter keeps its text, other
types are read as JSON (``3`` -> 3, ``true`` -> True, ``{"a": 1}`` -> a dict), falling back to the
text when it is not JSON. Source of the format and the typing rule: vLLM's ``qwen3_coder`` tool
parser and the Qwen3.5 chat template (calls rendered back into the prompt the same way).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .reasoning import partial_suffix
from .tools import ToolSpec

__all__ = ["CALL_END", "CALL_START", "ToolCall", "ToolCallParser", "parse_call"]

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION_END = "</function>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>", re.S)  # as the template writes it
_LOOSE_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)  # newlines left out


@dataclass
class ToolCall:
    """A call of ``name`` with ``arguments`` (a dict, values typed by the tool's schema); ``id`` is
    ``call_`` + 24 hex digits, unique per call."""

    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        """OpenAI's form: ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def _typed(text: str, types: set[str]):
    """A parameter's text as its schema's type (see the module docstring)."""
    if not types or "string" in types:
        return text
    stripped = text.strip()
    if "null" in types and stripped.lower() in ("null", "none"):
        return None
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    try:
        return json.loads(stripped, parse_constant=_no_constant)
    except ValueError:
        return text


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: kept as text (strict clients refuse them)


def parse_call(block: str, tools: tuple[ToolSpec, ...]) -> ToolCall | None:
    """The call in ``block`` (the text between ``<tool_call>`` and ``</tool_call>``), or None
    when it names no function. A parameter the tool does not declare keeps its text."""
    match = _FUNCTION.search(block)
    if match is None:
        return None
    name = match.group(1).strip()
    if not name:
        return None
    body = block[match.end() :]
    end = body.find(FUNCTION_END)
    if end >= 0:
        body = body[:end]
    spec = next((t for t in tools if t.name == name), None)
    types = spec.parameter_types() if spec else {}
    found = _PARAMETER.findall(body) or _LOOSE_PARAMETER.findall(body)
    arguments = {key.strip(): _typed(value, types.get(key.strip(), set())) for key, value in found}
    return ToolCall(name, arguments)


class ToolCallParser:
    """Feed reply content pieces, get ``(content, calls)`` back.

    Args:
        tools: the offered tools (their schemas type the arguments).
        max_calls: stop parsing after this many calls (1 when parallel calls are off); later text
            is dropped.

    Attributes:
        calls: every call parsed so far; ``content``: all content text returned so far.
    """

    def __init__(self, tools: tuple[ToolSpec, ...], max_calls: int | None = None):
        self.tools = tools
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.content = ""
        self._held = ""  # text that may begin a call, or the call being read (from <tool_call>)
        self._in_call = False

    @property
    def done(self) -> bool:
        """``max_calls`` calls were read: the rest of the reply is not wanted."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        """Add content text; return the content now certain and the calls now complete."""
        text, self._held = self._held + piece, ""
        out, calls = "", []
        while text and not self.done:
            if not self._in_call:
                at = text.find(CALL_START)
                if at < 0:
                    keep = partial_suffix(text, CALL_START)
                    out += text[: len(text) - keep]
                    self._held = text[len(text) - keep :]
                    break
                out += text[:at]
                text, self._in_call = text[at + len(CALL_START) :], True
            end = text.find(CALL_END)
            if end < 0:
                self._held = text
                break
            call = parse_call(text[:end], self.tools)
            if call is not None:
                calls.append(call)
                self.calls.append(call)
            else:  # no function named: the block stays text, as written
                out += CALL_START + text[: end + len(CALL_END)]
            text, self._in_call = text[end + len(CALL_END) :], False
        self.content += out
        return out, calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """End of the reply: a call cut short after its ``</function>`` still counts; any other
        unfinished call stays content text, as the model wrote it."""
        text, self._held = self._held, ""
        if self.done or not text:
            return "", []
        if self._in_call:
            call = parse_call(text, self.tools) if FUNCTION_END in text else None
            self._in_call = False
            if call is not None:
                self.calls.append(call)
                return "", [call]
            text = CALL_START + text
        self.content += text
        return text, []
