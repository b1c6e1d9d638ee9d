"""Tool calls and structured replies without a model: the request checks (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``response_format``), the incremental tool-call parser, the chat templates'
rendering of tools, calls and results (read back by the parser), and the grammar that constrains
decoding (driven by random logits over the demo tokenizer)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.checkpoints import _CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE
from qwen35_onnx.conversation.grammar import GrammarCompiler, reply_grammar
from qwen35_onnx.conversation.messages import ChatInputError, normalize_messages
from qwen35_onnx.conversation.tool_calls import ToolCallParser, parse_call
from qwen35_onnx.conversation.tools import parse_reply_format, schema_types

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "code": {"type": "string"},
                "limit": {"type": "integer"},
                "ratio": {"type": "number"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "maybe": {"type": ["integer", "null"]},
            },
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "seen": {"type": "boolean"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "where"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}


def call_text(name: str, **arguments: str) -> str:
    """A call as the model writes it (values already text)."""
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# ---------------------------------------------------------------------------
# Request checks


@pytest.mark.parametrize(
    "request_fields, param, value",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "get_time",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
            "array",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "required",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "response_format": JSON_SCHEMA_FORMAT,
            },
            "response_format",
            "get_weather",
        ),
        ({"tool_choice": "required"}, "tool_choice", "required"),
        ({"tools": [WEATHER, PING, WEATHER]}, "tools[2].function.name", "get_weather"),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather!"}}]},
            "tools[0].function.name",
            "get weather!",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "yes"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ],
)
def test_bad_request_fields_are_named(request_fields, param, value):
    """Each bad field gives a ChatInputError whose param names the field and whose message names the value."""
    with pytest.raises(ChatInputError) as info:
        parse_reply_format(**request_fields)
    assert info.value.param == param
    assert value in str(info.value)


@pytest.mark.parametrize("function", ["get_weather", None])
def test_named_tool_choice_with_a_bad_function_field(function):
    """tool_choice {'type': 'function', 'function': <not an object>} is a ChatInputError on tool_choice."""
    with pytest.raises(ChatInputError) as info:
        parse_reply_format([WEATHER], {"type": "function", "function": function})
    assert info.value.param == "tool_choice"


def test_accepted_reply_formats():
    """'auto' goes with a response schema; 'none' offers no tools; parallel calls default on; a
    tool without parameters or description gets an empty object schema."""
    reply = parse_reply_format([WEATHER, PING], "auto", None, JSON_SCHEMA_FORMAT)
    assert reply.tool_choice.mode == "auto" and reply.json_schema == ANSWER_SCHEMA
    assert [t.name for t in reply.offered_tools] == ["get_weather", "ping"] and reply.constrained
    assert reply.parallel_tool_calls

    reply = parse_reply_format([WEATHER], "none", False, {"type": "json_object"})
    assert reply.offered_tools == () and not reply.parses_calls and [t.name for t in reply.tools] == ["get_weather"]
    assert reply.json_schema == {"type": "object"} and not reply.parallel_tool_calls

    reply = parse_reply_format([WEATHER, PING], {"type": "function", "function": {"name": "ping"}})
    assert reply.tool_choice.name == "ping" and [t.name for t in reply.called_tools()] == ["ping"]
    ping = reply.tools[1]
    assert ping.parameters == {"type": "object", "properties": {}}
    assert ping.template_form() == {"type": "function", "function": {"name": "ping", "parameters": ping.parameters}}
    assert reply.tools[0].parameter_types() == {"city": {"string"}, "unit": {"string"}, "days": {"integer"}}

    free = parse_reply_format([WEATHER], None, None, {"type": "text"})
    assert free.parses_calls and not free.constrained and reply_grammar(free) is None


@pytest.mark.parametrize(
    "schema, types",
    [
        ({"type": "string"}, {"string"}),
        ({"type": ["integer", "null"]}, {"integer", "null"}),
        ({"enum": ["a", 1, 2.5, None]}, {"string", "integer", "number", "null"}),
        ({"const": True}, {"boolean"}),
        ({"const": {"a": 1}}, {"object"}),
        ({"description": "anything"}, set()),
        ("not a schema", set()),
    ],
)
def test_schema_types(schema, types):
    """The JSON types a schema allows at its top, from type, enum or const."""
    assert schema_types(schema) == types


# ---------------------------------------------------------------------------
# Tool-call parser

SPECS = parse_reply_format([WEATHER, PING, SEARCH]).tools


def parse_whole(text: str, max_calls=None, cuts=()) -> tuple[str, list[tuple[str, dict]]]:
    """Feed ``text`` cut at ``cuts``, then flush; the returned pieces must add up to the parser's record."""
    parser = ToolCallParser(SPECS, max_calls)
    pieces, start = [], 0
    for cut in sorted(cuts) + [len(text)]:
        pieces.append(parser.feed(text[start:cut]))
        start = cut
    pieces.append(parser.flush())
    content = "".join(piece for piece, _ in pieces)
    calls = [call for _, got in pieces for call in got]
    assert content == parser.content and calls == parser.calls
    return content, [(call.name, call.arguments) for call in calls]


def test_text_before_a_call_stays_content():
    """Text before a call is content; the call comes back typed, in OpenAI's form with a fresh id."""
    text = "Let me check.\n\n" + call_text("get_weather", city="Paris", days="3")
    parser = ToolCallParser(SPECS)
    content, calls = parser.feed(text)
    assert parser.flush() == ("", [])
    assert content == "Let me check.\n\n"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    openai = calls[0].to_openai()
    assert openai["type"] == "function" and openai["function"]["name"] == "get_weather"
    assert json.loads(openai["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert openai["id"].startswith("call_") and len(openai["id"]) == len("call_") + 24


def test_two_calls():
    """Two calls in a row, with text after them: both calls, distinct ids, the rest is content."""
    text = call_text("get_weather", city="Oslo", days="1") + "\n" + call_text("ping") + "\nDone."
    parser = ToolCallParser(SPECS)
    content, calls = parser.feed(text)
    assert (content, parser.flush()) == ("\n\nDone.", ("", []))
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo", "days": 1}), ("ping", {})]
    assert calls[0].id != calls[1].id and not parser.done


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("code", "42", "42"),
        ("code", "true", "true"),
        ("query", "line one\n  line two", "line one\n  line two"),
        ("query", "", ""),
        ("limit", "42", 42),
        ("limit", " 7 ", 7),
        ("ratio", "0.25", 0.25),
        ("exact", "true", True),
        ("exact", "False", False),
        ("filters", '{"lang": "en", "years": [2020, 2021]}', {"lang": "en", "years": [2020, 2021]}),
        ("tags", '["a", "b"]', ["a", "b"]),
        ("maybe", "null", None),
        ("maybe", "3", 3),
        ("limit", "many", "many"),
        ("filters", "{not json", "{not json"),
        ("undeclared", "3", "3"),
    ],
)
def test_arguments_are_typed_by_schema(name, text, value):
    """A string parameter keeps its text, other types are read as JSON (the text when it is not JSON),
    a parameter the schema lacks keeps its text."""
    call = parse_call(f"\n<function=search>\n<parameter={name}>\n{text}\n</parameter>\n</function>\n", SPECS)
    assert call.name == "search" and call.arguments == {name: value}
    assert type(call.arguments[name]) is type(value)


STREAMED = (
    "I will look <tool it up: a < b.\n\n"
    + call_text("get_weather", city="São Paulo", unit="celsius", days="2")
    + "\n"
    + call_text("search", query="<b>bold</b>", limit="5", filters='{"a": [1, 2]}', exact="true")
    + "\nThat is <tool_c"
)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([None, 1, 2]))
def test_any_split_gives_the_whole_parse(data, max_calls):
    """The reply fed in pieces cut anywhere gives the same content and calls as fed whole."""
    cuts = data.draw(st.lists(st.integers(0, len(STREAMED)), max_size=10, unique=True))
    assert parse_whole(STREAMED, max_calls, cuts) == parse_whole(STREAMED, max_calls)


def test_whole_parse_of_the_streamed_reply():
    """The reply of the split test parses into its text and its two typed calls."""
    content, calls = parse_whole(STREAMED)
    assert content == "I will look <tool it up: a < b.\n\n\n\nThat is <tool_c"
    assert calls == [
        ("get_weather", {"city": "São Paulo", "unit": "celsius", "days": 2}),
        ("search", {"query": "<b>bold</b>", "limit": 5, "filters": {"a": [1, 2]}, "exact": True}),
    ]


@pytest.mark.parametrize("cut", [1, 12, 30, None])
def test_unfinished_call_is_content(cut):
    """A call without </function> at the end of the reply comes back as the text the model wrote."""
    text = "Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert parse_whole(text, cuts=() if cut is None else (cut,)) == (text, [])


@pytest.mark.parametrize("tail", ["", "\n", "\n</tool_"])
def test_call_cut_after_function_end_counts(tail):
    """A call cut after </function> (before </tool_call>) still counts when the reply ends."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>" + tail
    parser = ToolCallParser(SPECS)
    assert parser.feed(text) == ("", [])
    content, calls = parser.flush()
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_max_calls_drops_later_calls():
    """max_calls=1: the first call comes back, the parser is done and the rest is dropped."""
    text = "Hi " + call_text("ping") + "\n" + call_text("get_weather", city="Lima", days="1") + " bye"
    parser = ToolCallParser(SPECS, max_calls=1)
    content, calls = parser.feed(text[:40])
    more_content, more_calls = parser.feed(text[40:])
    assert content + more_content == "Hi "
    assert [c.name for c in calls + more_calls] == ["ping"] and parser.done
    assert parser.feed("more text") == ("", []) and parser.flush() == ("", [])
    assert [c.name for c in parser.calls] == ["ping"]


# ---------------------------------------------------------------------------
# Chat templates


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and search for 42?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {
                    "name": "search",
                    "arguments": {"query": "42", "limit": 5, "filters": {"a": [1, "x"]}, "exact": True, "ratio": 0.5},
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "hits"}],
    },
]


@pytest.mark.parametrize("template", [THINKING_CHAT_TEMPLATE, _CHAT_TEMPLATE], ids=["thinking", "plain"])
def test_rendered_calls_parse_back(tokenizer, template):
    """An assistant turn's calls, rendered by the template, parse back into the same names and
    arguments; the tools are listed in one system turn with the conversation's system message."""
    messages, _ = normalize_messages(CONVERSATION)
    tools = [WEATHER, SEARCH]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and text.count("<|im_start|>system") == 1
    assert "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris" in text
    for tool in tools:
        assert json.dumps(tool["function"], ensure_ascii=False) in text

    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = ToolCallParser(parse_reply_format(tools).tools)
    content, calls = parser.feed(turn)
    assert parser.flush() == ("", [])
    assert content == "Checking.\n\n\n"  # the blank before the first call and between the calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"}),
        ("search", {"query": "42", "limit": 5, "filters": {"a": [1, "x"]}, "exact": True, "ratio": 0.5}),
    ]


def test_tool_results_render_in_one_user_turn(tokenizer):
    """Consecutive tool messages go back in one user turn, each inside <tool_response>."""
    messages, _ = normalize_messages(CONVERSATION)
    text = tokenizer.apply_chat_template(
        messages, chat_template=THINKING_CHAT_TEMPLATE, tools=[WEATHER, SEARCH], tokenize=False
    )
    assert text.endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response>\n"
        "<tool_response>\nno hits\n</tool_response><|im_end|>\n"
    )
    assert "<|im_start|>tool" not in text and text.count("<|im_start|>user") == 2


PLAIN_MESSAGES = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
    {"role": "assistant", "content": "<think>x</think>\n\nyo"},
    {"role": "user", "content": "again"},
]
PLAIN_TURNS = (
    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    "<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (THINKING_CHAT_TEMPLATE, PLAIN_TURNS.format(reply="yo") + "<think>\n"),
        (_CHAT_TEMPLATE, PLAIN_TURNS.format(reply="<think>x</think>\n\nyo")),
    ],
    ids=["thinking", "plain"],
)
@pytest.mark.parametrize("tools", [{}, {"tools": None}, {"tools": []}], ids=["absent", "None", "empty"])
def test_rendering_without_tools_is_unchanged(tokenizer, template, expected, tools):
    """Without tools (not passed, None or empty) the templates render as before tools existed."""
    text = tokenizer.apply_chat_template(
        PLAIN_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True, **tools
    )
    assert text == expected


def test_normalize_messages_tool_calls():
    """Arguments as JSON text or as a dict give the same template message; bad arguments and
    tool_call_id are named."""

    def assistant(arguments):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
        }

    as_text, _ = normalize_messages([{"role": "user", "content": "q"}, assistant('{"n": 1}')])
    as_dict, _ = normalize_messages([{"role": "user", "content": "q"}, assistant({"n": 1})])
    assert as_text == as_dict
    assert as_text[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"n": 1}}}],
    }
    assert normalize_messages([assistant("")])[0][0]["tool_calls"][0]["function"]["arguments"] == {}
    for arguments in ("{n: 1}", "[1, 2]"):
        with pytest.raises(ChatInputError) as info:
            normalize_messages([{"role": "user", "content": "q"}, assistant(arguments)])
        assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(ChatInputError) as info:
        normalize_messages([{"role": "tool", "tool_call_id": 7, "content": "r"}])
    assert info.value.param == "messages[0].tool_call_id"
    assert normalize_messages([{"role": "tool", "tool_call_id": "c", "content": "r"}])[0] == [
        {"role": "tool", "content": "r"}
    ]


# ---------------------------------------------------------------------------
# Grammar


@pytest.fixture(scope="module")
def stop_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def compiler(tokenizer, stop_id) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, (stop_id,))


def sample(constraint, rng, size: int) -> int:
    """A token from the softmax of random logits, masked by ``constraint``."""
    logits = constraint.mask(rng.normal(scale=2.0, size=size).astype(np.float32))
    probs = np.exp(logits - logits.max())
    return int(rng.choice(size, p=probs / probs.sum()))


def drive(constraint, tokenizer, stop_id: int, seed: int, steps: int = 600) -> tuple[str, bool]:
    """Random generation under ``constraint``: the text and whether a stop token ended it."""
    rng, ids = np.random.default_rng(seed), []
    for _ in range(steps):
        token = constraint.forced()
        if token is None:
            token = sample(constraint, rng, len(tokenizer))
        constraint.accept(token)
        if token == stop_id:
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


def accepts(compiler, reply, tokenizer, stop_id, text: str) -> bool:
    """The reply's grammar takes ``text`` (as the tokenizer splits it) and then the stop token."""
    constraint = compiler.constraint(reply)
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            constraint.accept(token)
        return bool(np.isfinite(constraint.mask(np.zeros(len(tokenizer), np.float32))[stop_id]))
    except RuntimeError:
        return False


def check_calls(text: str, reply) -> list:
    """``text`` is calls only (blanks around them), each of a callable tool, valid against its schema."""
    parser = ToolCallParser(reply.offered_tools)
    content, calls = parser.feed(text)
    more, late = parser.flush()
    assert (content + more).strip() == "" and late == [] and calls, text
    schemas = {tool.name: tool.parameters for tool in reply.called_tools()}
    for call in calls:
        jsonschema.validate(call.arguments, schemas[call.name])
    return calls


CONSTRAINED = {
    "required": ([WEATHER, PING], "required", None, None),
    "required-single": ([WEATHER, PING], "required", False, None),
    "named": ([PING, WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None),
    "json_schema": (None, None, None, JSON_SCHEMA_FORMAT),
    "auto+json_schema": ([WEATHER], "auto", None, JSON_SCHEMA_FORMAT),
}


@pytest.mark.parametrize("kind", list(CONSTRAINED))
def test_random_generation_follows_the_grammar(compiler, tokenizer, stop_id, kind):
    """Random logits under the constraint end with the stop token within 600 steps, and the text
    is calls valid against their tool's schema or JSON valid against the response schema."""
    reply = parse_reply_format(*CONSTRAINED[kind])
    names = []
    for seed in range(12):
        text, ended = drive(compiler.constraint(reply), tokenizer, stop_id, seed)
        assert ended, text
        if reply.json_schema is not None and text.lstrip(" \n").startswith("{"):
            jsonschema.validate(json.loads(text), reply.json_schema)
            names.append(None)
            continue
        calls = check_calls(text, reply)
        names.append([call.name for call in calls])
        if not reply.parallel_tool_calls or kind == "named":
            assert len(calls) == 1
        if kind == "named":
            assert calls[0].name == "get_weather"
    if kind == "auto+json_schema":
        assert None in names and any(names), "neither a call nor an answer in 12 replies"


def test_json_object_starts_with_a_brace(compiler, tokenizer, stop_id):
    """json_object: the first allowed tokens are blanks or start an object, the stop token is not
    allowed before it, and every prefix of random generation is blanks then '{'."""
    reply = parse_reply_format(response_format={"type": "json_object"})
    constraint = compiler.constraint(reply)
    allowed = np.flatnonzero(np.isfinite(constraint.mask(np.zeros(len(tokenizer), np.float32))))
    assert stop_id not in allowed and len(allowed) > 0
    for token in allowed:
        text = tokenizer.decode([int(token)]).lstrip(" \n")
        assert text == "" or text.startswith("{"), text
    for seed in range(4):
        constraint, rng, ids = compiler.constraint(reply), np.random.default_rng(seed), []
        for _ in range(40):
            token = sample(constraint, rng, len(tokenizer))
            constraint.accept(token)
            if token == stop_id:
                break
            ids.append(token)
            text = tokenizer.decode(ids).lstrip(" \n")
            assert text == "" or text.startswith("{"), text


GOOD_CALL = call_text("get_weather", city="A" * 20, days="3")


@pytest.mark.parametrize(
    "text, ok",
    [
        (GOOD_CALL, True),
        ("\n" + GOOD_CALL + "\n" + call_text("ping"), True),
        (call_text("get_weather", city="A" * 20, unit="celsius", days="14"), True),
        (call_text("get_weather", city="A" * 21, days="3"), False),
        (call_text("get_weather", city="A" * 20, unit="kelvin", days="3"), False),
        (call_text("get_weather", city="A" * 20, days="3.5"), False),
        (call_text("get_weather", city="A" * 20), False),
        (call_text("get_weather", days="3", city="A" * 20), False),
        (call_text("get_time"), False),
        ("Sure. " + GOOD_CALL, False),
        ("", False),
        (call_text("get_weather", city="Paris", days="3"), True),
    ],
)
def test_call_grammar_takes_what_the_schema_allows(compiler, tokenizer, stop_id, text, ok):
    """tool_choice 'required': the grammar takes calls whose values fit the schema (declared order,
    required parameters present), and nothing else."""
    reply = parse_reply_format([WEATHER, PING], "required")
    assert accepts(compiler, reply, tokenizer, stop_id, text) is ok


def test_unbounded_string_parameter_can_end(compiler, tokenizer, stop_id):
    """A string parameter without maxLength closes after any text (here 'x')."""
    reply = parse_reply_format([SEARCH], "required")
    assert accepts(compiler, reply, tokenizer, stop_id, call_text("search", query="x"))


def test_reasoning_budget_forces_think_end(compiler, tokenizer, stop_id):
    """During reasoning only the stop tokens are masked; after 5 reasoning tokens </think> is forced;
    then the grammar applies and the call completes."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.encode("</think>", add_special_tokens=False) == [think_end]
    reply = parse_reply_format([WEATHER], "required")
    constraint = compiler.constraint(reply, think_end=think_end, reasoning_budget=5)
    rng = np.random.default_rng(0)
    for _ in range(5):
        assert constraint.forced() is None
        logits = rng.normal(size=len(tokenizer)).astype(np.float32)
        masked = constraint.mask(logits)
        assert masked[stop_id] == -np.inf and np.isfinite(logits[stop_id])
        assert np.array_equal(np.delete(masked, stop_id), np.delete(logits, stop_id))
        masked[think_end] = -np.inf
        constraint.accept(int(np.argmax(masked)))
    assert constraint.forced() == think_end
    constraint.accept(think_end)
    assert constraint.forced() is None
    allowed = np.isfinite(constraint.mask(np.zeros(len(tokenizer), np.float32)))
    assert not allowed[stop_id] and allowed.sum() < len(tokenizer) // 10
    text, ended = drive(constraint, tokenizer, stop_id, seed=1)
    assert ended and {c.name for c in check_calls(text, reply)} == {"get_weather"}  # parallel calls allowed


def test_early_think_end_starts_the_grammar(compiler, tokenizer, stop_id):
    """A </think> sampled before the budget ends the reasoning: the next mask is the grammar's."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    reply = parse_reply_format(response_format=JSON_SCHEMA_FORMAT)
    constraint = compiler.constraint(reply, think_end=think_end, reasoning_budget=100)
    constraint.accept(think_end)
    assert constraint.forced() is None
    allowed = np.isfinite(constraint.mask(np.zeros(len(tokenizer), np.float32)))
    assert not allowed[stop_id] and not allowed[think_end] and 0 < allowed.sum() < len(tokenizer) // 10


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_uncompilable_schema_is_a_chat_input_error(compiler, where):
    """A schema llguidance cannot compile (a look-around pattern) is a ChatInputError naming the field."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}, "required": ["s"]}
    if where == "tools":
        parameters = {"type": "object", "properties": {"options": schema}}  # a JSON-valued parameter
        reply = parse_reply_format(
            [{"type": "function", "function": {"name": "f", "parameters": parameters}}], "required"
        )
    else:
        reply = parse_reply_format(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(reply_grammar(reply), compiler.llg_tokenizer)
    if not error:
        pytest.skip("this llguidance compiles look-around patterns")
    with pytest.raises(ChatInputError) as info:
        compiler.check(reply)
    assert info.value.param == where and "(?=a)b" in str(info.value)
    with pytest.raises(ChatInputError):
        compiler.constraint(reply)


def test_reply_grammar_shape():
    """Free text has no grammar; a named tool's grammar holds only that tool, once; parallel calls
    repeat the call rule."""
    assert reply_grammar(parse_reply_format([WEATHER])) is None
    named = reply_grammar(parse_reply_format([PING, WEATHER], {"type": "function", "function": {"name": "ping"}}))
    assert "<function=ping>" in named and "get_weather" not in named and 'call ("\\n" call)*' not in named
    required = reply_grammar(parse_reply_format([PING, WEATHER], "required"))
    assert "<function=ping>" in required and "<function=get_weather>" in required
    assert 'call ("\\n" call)*' in required
    assert 'call ("\\n" call)*' not in reply_grammar(parse_reply_format([PING, WEATHER], "required", False))


def test_hostile_inputs_are_refused_or_kept_as_text():
    """A schema nested past the checker's recursion, a name ending in a newline, non-string property
    keys and call arguments are ChatInputErrors; NaN in a number argument stays text (strict JSON
    clients refuse NaN); a call with an empty function name is no call."""
    deep = {"type": "string"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}}
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": deep}}), "too deeply"),
        (dict(tools=[{"type": "function", "function": {"name": "get_weather\n"}}]), "64 letters"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {1: {}}}}}]),
            "parameter name 1",
        ),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ChatInputError, match=fragment):
            parse_reply_format(**kwargs)
    with pytest.raises(ChatInputError, match="string keys"):
        normalize_messages(
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {1: "x"}}}]}]
        )
    number = parse_reply_format(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "number"}}}}}]
    ).tools
    assert parse_call("<function=f>\n<parameter=n>\nNaN\n</parameter>\n</function>", number).arguments == {"n": "NaN"}
    assert parse_call("<function= >\n</function>", number) is None


def test_pydantic_style_parameters_are_typed_and_enforced(compiler):
    """Parameters written as ``anyOf`` (Optional) and ``$ref`` into the tool's ``$defs``, as Pydantic
    writes them, are typed by what they point to, and their grammar compiles with the definitions;
    a tool's uncompilable schema is blamed on ``tools`` even when a response_format is present."""
    params = {
        "type": "object",
        "$defs": {"Pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "properties": {
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "p": {"$ref": "#/$defs/Pt"},
            "ps": {"type": "array", "items": {"$ref": "#/$defs/Pt"}},
        },
        "required": ["p", "ps"],
    }
    reply = parse_reply_format([{"type": "function", "function": {"name": "f", "parameters": params}}], "required")
    assert reply.tools[0].parameter_types() == {"n": {"integer", "null"}, "p": {"object"}, "ps": {"array"}}
    compiler.check(reply)
    block = '<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=p>\n{"x": 1}\n</parameter>\n</function>'
    assert parse_call(block, reply.tools).arguments == {"n": 3, "p": {"x": 1}}
    bad = {"type": "object", "properties": {"s": {"type": "object", "properties": {"t": {"pattern": "(?<=a)b"}}}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(ChatInputError) as info:
        compiler.check(parse_reply_format([tool], None, None, {"type": "json_object"}))
    assert info.value.param == "tools"


def test_a_call_block_without_a_function_stays_content():
    parser = ToolCallParser(())
    assert parser.feed("a<tool_call>\nhello\n</tool_call>b") == ("a<tool_call>\nhello\n</tool_call>b", [])


# ---------------------------------------------------------------------------
# Added tokens: the published layout (markers as non-special added tokens) and a tokenizer without them


@pytest.fixture(scope="module")
def minimal_tokenizer():
    """The demo tokenizer without the tool-call, FIM and audio added tokens (its markers are spelled
    in ordinary tokens)."""
    from qwen35_onnx.checkpoints import demo_tokenizer
    from qwen35_onnx.presets import MINIMAL_ADDED_TOKENS

    return demo_tokenizer(MINIMAL_ADDED_TOKENS)


@pytest.fixture(scope="module", params=["published", "minimal"])
def layout(request, tokenizer, minimal_tokenizer, compiler, stop_id):
    """``(tokenizer, compiler, stop_id)`` of the published added-token layout and of the minimal one."""
    if request.param == "published":
        assert tokenizer.encode("<tool_call></tool_call>", add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids("<tool_call>"),
            tokenizer.convert_tokens_to_ids("</tool_call>"),
        ]
        return tokenizer, compiler, stop_id
    assert "<tool_call>" not in minimal_tokenizer.get_vocab()
    stop = minimal_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return minimal_tokenizer, GrammarCompiler(minimal_tokenizer, (stop,)), stop


def refused_by_the_matcher(constraint, size: int) -> list[int]:
    """The tokens the mask allows at this point that a copy of the matcher refuses (the path that
    failed with llguidance's own reading of added tokens). The converse is allowed: where the grammar
    forces text, the mask offers only its canonical tokenization, a subset of what the matcher takes."""
    allowed = np.flatnonzero(np.isfinite(constraint.mask(np.zeros(size, np.float32))))
    assert len(allowed) > 0
    return [int(t) for t in allowed if not constraint.matcher.deep_copy().consume_token(int(t))]


AGREEMENT = {
    "required": ([WEATHER, PING], "required", None, None),
    "named": ([PING, WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None),
    "json_schema": (None, None, None, JSON_SCHEMA_FORMAT),
}


@pytest.mark.parametrize("kind", list(AGREEMENT))
def test_mask_and_matcher_agree_on_every_token(layout, kind):
    """Along random constrained replies, at every step, the matcher takes every token the mask allows
    (with the published layout, llguidance's own reading of the tokenizer made every added token
    special: the mask offered ``<tool_call>`` and the matcher refused it)."""
    tokenizer, compiler, stop_id = layout
    reply = parse_reply_format(*AGREEMENT[kind])
    size = len(tokenizer)
    for seed in range(2):
        constraint, rng = compiler.constraint(reply), np.random.default_rng(seed)
        for step in range(30):
            assert refused_by_the_matcher(constraint, size) == [], (seed, step)
            token = sample(constraint, rng, size)
            constraint.accept(token)
            if token == stop_id:
                break


def spelled(tokenizer, text: str, markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")) -> list[int]:
    """``text`` in ordinary tokens only: each marker written as ``<`` and the rest of its spelling."""
    pieces = [text]
    for marker in markers:
        pieces = [part for piece in pieces for part in _split_keep(piece, marker)]
    ids = []
    for piece in pieces:
        if piece in markers:
            ids += tokenizer.encode("<", add_special_tokens=False) + tokenizer.encode(
                piece[1:], add_special_tokens=False
            )
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _split_keep(text: str, marker: str) -> list[str]:
    parts = text.split(marker)
    return [x for i, part in enumerate(parts) for x in ((marker, part) if i else (part,))]


def test_markers_as_added_tokens_or_spelled(tokenizer, compiler, stop_id):
    """With the published layout a call is taken whether its markers come as the added tokens or
    spelled in ordinary tokens; the grammar's first forced token is the added ``<tool_call>``."""
    reply = parse_reply_format([WEATHER, PING], "required")
    text = "\n" + GOOD_CALL + "\n" + call_text("ping")
    added, plain = tokenizer.encode(text, add_special_tokens=False), spelled(tokenizer, text)
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert call_id in added and call_id not in plain and tokenizer.decode(plain) == text
    for ids in (added, plain):
        constraint = compiler.constraint(reply)
        for token in ids:
            constraint.accept(token)
        assert np.isfinite(constraint.mask(np.zeros(len(tokenizer), np.float32))[stop_id])
    allowed = np.isfinite(compiler.constraint(reply).mask(np.zeros(len(tokenizer), np.float32)))
    assert allowed[call_id]


def test_published_layout_tool_choices_give_valid_calls(tokenizer, compiler, stop_id):
    """tool_choice required / named (and a response schema with tools in auto), parallel calls on and
    off, thinking on and off: 20 random replies each end with the stop token and are calls valid
    against their tool's schema (or JSON valid against the response schema), one call at most when
    parallel calls are off or a function is named."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, fmt in (("required", None), (named, None), ("auto", JSON_SCHEMA_FORMAT)):
        for parallel in (True, False):
            reply = parse_reply_format([WEATHER, PING], choice, parallel, fmt)
            for thinking in (True, False):
                for seed in range(20):
                    where = (choice, parallel, thinking, seed)
                    constraint = compiler.constraint(reply, think_end if thinking else None, 8)
                    text, ended = drive(constraint, tokenizer, stop_id, seed)
                    assert ended, (where, text)
                    if thinking:
                        assert "</think>" in text, (where, text)
                        text = text.split("</think>", 1)[1]
                    if fmt is not None and text.lstrip(" \n").startswith("{"):
                        jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
                        continue
                    calls = check_calls(text, reply)
                    if not parallel or choice == named:
                        assert len(calls) == 1, (where, text)
                    if choice == named:
                        assert calls[0].name == "get_weather", (where, text)


class _BrokenMatcher:
    """An llguidance matcher stand-in that fails as a grammar engine could: it refuses a token its
    mask allowed (reporting its whole state), or raises."""

    def __init__(self, matcher, refuse: bool):
        self._matcher, self._refuse = matcher, refuse

    def __getattr__(self, name):
        return getattr(self._matcher, name)

    def consume_token(self, token):
        if self._refuse:
            return False
        raise ValueError("<state>" + "x" * 5000 + "</state>")

    def get_error(self):
        return "Parser Error: ... <state>" + "y" * 5000 + "</state><grammar>...</grammar>"


@pytest.mark.parametrize("refuse", [True, False], ids=["refused", "raised"])
def test_grammar_engine_failure_is_a_short_grammar_error(compiler, tokenizer, refuse):
    """A matcher that refuses the masked token, or raises, ends the reply with a GrammarError whose
    message is one short line naming the token; the engine's report is kept in ``details``."""
    from qwen35_onnx.conversation.grammar import GrammarError

    constraint = compiler.constraint(parse_reply_format([WEATHER], "required"))
    logits = constraint.mask(np.zeros(len(tokenizer), np.float32))
    token = int(np.argmax(logits))
    constraint.matcher = _BrokenMatcher(constraint.matcher, refuse)
    with pytest.raises(GrammarError) as info:
        constraint.accept(token)
    message = str(info.value)
    assert len(message) < 120 and "<state>" not in message and str(token) in message
    assert "<state>" in info.value.details
    if refuse:
        assert "its own mask allowed" in message


# a tool whose one parameter must be the Angstrom sign (NFC makes it U+00C5)
ANGSTROM = {
    "type": "function",
    "function": {"name": "f", "parameters": {"properties": {"a": {"enum": ["\u212b"]}}, "required": ["a"]}},
}


@pytest.mark.parametrize(
    "reply",
    [
        parse_reply_format(response_format={"type": "json_schema", "json_schema": {"schema": {"const": "Cafe\u0301"}}}),
        parse_reply_format([ANGSTROM], "required", False),
    ],
    ids=["decomposed-const", "compatibility-enum"],
)
def test_forced_text_that_nfc_would_change_is_kept_byte_for_byte(layout, reply):
    """A schema's ``const`` / ``enum`` text that is not in NFC (a decomposed accent, the Angstrom sign)
    is forced as its own bytes: the tokenizer's NFC normalizer would have offered the precomposed
    character, which the matcher refuses."""
    tokenizer, compiler, stop_id = layout
    constraint, ids = compiler.constraint(reply), []
    for _ in range(60):
        token = int(np.argmax(constraint.mask(np.zeros(len(tokenizer), np.float32))))
        constraint.accept(token)
        if token == stop_id:
            break
        ids.append(token)
    text = tokenizer.decode(ids)
    assert token == stop_id and ("Cafe\u0301" in text or "\u212b" in text), text
