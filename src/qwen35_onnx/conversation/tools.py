"""What a chat reply may be: tools the model may call, how it must choose among them, and a JSON
schema its answer must follow (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``response_format``), checked into one :class:`ReplyFormat`.

Request forms (the OpenAI Chat Completions API, as vLLM and llama.cpp's server take them)::

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "...",
              "parameters": {"type": "object", "properties": {...}, "required": [...]}}}]
    tool_choice = "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    response_format = {"type": "text"} | {"type": "json_object"}
                    | {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}

Parameter schemas and response schemas are checked as JSON Schema (Draft 2020-12, with the
``jsonschema`` library) before anything runs.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

from .messages import ChatInputError

__all__ = ["ReplyFormat", "ToolChoice", "ToolSpec", "parse_reply_format"]

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI: letters, digits, _ and -, at most 64 (vLLM adds . and :)
TOOL_CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: ``name``, ``description`` and ``parameters`` (a JSON
    Schema of type object; ``{"type": "object", "properties": {}}`` when the request gave none)."""

    name: str
    description: str | None
    parameters: dict

    def template_form(self) -> dict:
        """The tool as chat templates receive it (OpenAI's ``{"type": "function", "function": {...}}``)."""
        described = {} if self.description is None else {"description": self.description}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}

    @property
    def definitions(self) -> dict:
        """The schemas the parameters may point to (``$defs`` and ``definitions``, as Pydantic writes them)."""
        return {
            key: self.parameters[key] for key in ("$defs", "definitions") if isinstance(self.parameters.get(key), dict)
        }

    def parameter_types(self) -> dict[str, set[str]]:
        """JSON types each parameter may take, by name (empty set: the schema does not say)."""
        properties = self.parameters.get("properties") or {}
        return {name: schema_types(schema, self.definitions) for name, schema in properties.items()}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` 'auto' (the model decides), 'none' (no call: tools are not shown to the model),
    'required' (at least one call) or 'function' (exactly a call of ``name``)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ReplyFormat:
    """How a chat reply must look.

    Attributes:
        tools: the functions the model may call (empty: none).
        tool_choice: see :class:`ToolChoice`.
        parallel_tool_calls: False: at most one call per reply.
        json_schema: the schema of the answer (``response_format``; ``{"type": "object"}`` for
            ``json_object``), None for free text.
    """

    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    json_schema: dict | None = None

    @property
    def offered_tools(self) -> tuple[ToolSpec, ...]:
        """The tools shown to the model (none when ``tool_choice`` is 'none')."""
        return () if self.tool_choice.mode == "none" else self.tools

    @property
    def parses_calls(self) -> bool:
        """Replies are scanned for tool calls."""
        return bool(self.offered_tools)

    @property
    def constrained(self) -> bool:
        """The reply is enforced by a grammar (a required or named call, or a response schema)."""
        return bool(self.constrained_fields)

    @property
    def constrained_fields(self) -> tuple[str, ...]:
        """The request fields the reply's grammar enforces: ``"tools"`` when calls are in it (a
        required or named call, or tools beside a response schema), ``"response_format"`` when the
        answer's schema is; empty for free text."""
        answer = self.json_schema is not None
        calls = self.tool_choice.mode in ("required", "function") or (answer and bool(self.offered_tools))
        return tuple(name for name, used in (("tools", calls), ("response_format", answer)) if used)

    def called_tools(self) -> tuple[ToolSpec, ...]:
        """The tools a constrained call may name."""
        if self.tool_choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.tool_choice.name)
        return self.offered_tools


def schema_types(schema, definitions: dict | None = None, depth: int = 0) -> set[str]:
    """The JSON types a schema allows at its top (``type``, a list of them, what its ``enum`` /
    ``const`` values are, the union over ``anyOf`` / ``oneOf``, a local ``$ref`` into
    ``definitions`` followed); empty when it does not say."""
    if not isinstance(schema, dict) or depth > 16:
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        section, _, name = ref[2:].partition("/")
        return schema_types((definitions or {}).get(section, {}).get(name), definitions, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return set().union(*(schema_types(s, definitions, depth + 1) for s in schema[key]))
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    return {_json_type(v) for v in values}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def check_schema(schema, param: str) -> None:
    """Raise :class:`ChatInputError` naming ``param`` when ``schema`` is not a valid JSON Schema
    (Draft 2020-12 meta-schema, via ``jsonschema``)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise ChatInputError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        Draft202012Validator.check_schema(schema)
    except RecursionError:
        raise ChatInputError(f"{param} is nested too deeply to check", param) from None
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ChatInputError(
            f"{param} is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else ""), param
        ) from None


def parse_tools(tools) -> tuple[ToolSpec, ...]:
    """Check OpenAI ``tools`` into :class:`ToolSpec` s.

    Raises:
        ChatInputError: naming the field: not a list, more than 128, not a function tool, a bad or
            repeated name, a description that is not a string, parameters that are not a valid JSON
            Schema of type object.
    """
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise ChatInputError(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ChatInputError(f"tools holds {len(tools)} tools, more than {MAX_TOOLS}", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ChatInputError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ChatInputError(
                f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {name!r:.80}",
                f"{where}.function.name",
            )
        if any(s.name == name for s in specs):
            raise ChatInputError(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ChatInputError(f"{where}.function.description must be a string", f"{where}.function.description")
        param = f"{where}.function.parameters"
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        check_schema(parameters, param)
        if parameters.get("type", "object") != "object":
            raise ChatInputError(
                f"{param} must be a schema of type 'object' (the call's arguments are named), got type "
                f"{parameters.get('type')!r}",
                param,
            )
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict):
            raise ChatInputError(f"{param}.properties must be an object", f"{param}.properties")
        for key in properties:
            if not isinstance(key, str) or not _NAME.fullmatch(key):
                raise ChatInputError(
                    f"{param}.properties: parameter name {key!r:.80} must be 1 to 64 letters, digits, '_', '-', "
                    "'.' or ':' (it is written inside <parameter=NAME>)",
                    f"{param}.properties",
                )
        specs.append(ToolSpec(name, description, copy.deepcopy(parameters)))
    return tuple(specs)


def parse_tool_choice(choice, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """Check OpenAI ``tool_choice`` against the ``tools`` given (default 'auto').

    Raises:
        ChatInputError (param ``tool_choice``): an unknown mode, a named function not in
            ``tools``, 'required' or a named function without tools.
    """
    if choice is None:
        return ToolChoice()
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ChatInputError(
                f"tool_choice {choice!r:.80} must be one of {', '.join(TOOL_CHOICES)} or "
                "{'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        if choice == "required" and not tools:
            raise ChatInputError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ChatInputError(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    known = [t.name for t in tools]
    if name not in known:
        raise ChatInputError(
            f"tool_choice names the function {name!r:.80}, which is not in tools "
            f"({', '.join(map(repr, known)) or 'no tools were given'})",
            "tool_choice.function.name",
        )
    return ToolChoice("function", name)


def parse_response_format(value) -> dict | None:
    """Check OpenAI ``response_format``: the JSON schema the answer must follow, or None (text).

    Raises:
        ChatInputError (param ``response_format``...): an unknown type, a json_schema without a
            schema, a schema that is not valid JSON Schema.
    """
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ChatInputError(
                "response_format.json_schema must be an object {'name': ..., 'schema': {...}}",
                "response_format.json_schema",
            )
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
            raise ChatInputError(
                "response_format.json_schema.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', got "
                f"{name!r:.80}",
                "response_format.json_schema.name",
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ChatInputError(
                "response_format.json_schema.strict must be true or false", "response_format.json_schema.strict"
            )
        schema = spec.get("schema")
        if schema is None:
            raise ChatInputError("response_format.json_schema.schema is required", "response_format.json_schema")
        check_schema(schema, "response_format.json_schema.schema")
        return copy.deepcopy(schema)
    raise ChatInputError(
        f"response_format.type {kind!r:.80} must be 'text', 'json_object' or 'json_schema'", "response_format"
    )


def parse_reply_format(tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None) -> ReplyFormat:
    """Check the four request fields together into a :class:`ReplyFormat`.

    A required or named ``tool_choice`` together with a ``response_format`` schema is refused: the
    reply would have to be a call and a JSON answer at once. With ``tool_choice`` 'auto' and a
    schema the reply is either calls or the JSON answer.

    Raises:
        ChatInputError: see :func:`parse_tools`, :func:`parse_tool_choice`,
            :func:`parse_response_format`; ``parallel_tool_calls`` not a boolean; the conflict above.
    """
    specs = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, specs)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ChatInputError(
            f"parallel_tool_calls must be true or false, got {json.dumps(parallel_tool_calls)[:80]}",
            "parallel_tool_calls",
        )
    schema = parse_response_format(response_format)
    if schema is not None and choice.mode in ("required", "function"):
        raise ChatInputError(
            f"response_format {response_format.get('type')!r} cannot be combined with tool_choice "
            f"{choice.mode if choice.mode == 'required' else choice.name!r}: the reply would have to be a tool "
            "call and a JSON answer at once (send tool_choice 'auto' to let the model pick one, or one of the two)",
            "response_format",
        )
    return ReplyFormat(specs, choice, parallel_tool_calls is not False, schema)
