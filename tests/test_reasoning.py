"""The reasoning / content split (vLLM's Qwen3 reasoning parser behaviour), streamed or whole,
and the thinking switch of a Qwen3.5-style chat template end to end."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_onnx.conversation.reasoning import ReasoningParser, prompt_opens_reasoning


def split(text: str, in_reasoning: bool, cuts=()) -> tuple[str, str, list]:
    parser = ReasoningParser(in_reasoning)
    deltas, start = [], 0
    for cut in sorted(cuts) + [len(text)]:
        deltas.append(parser.feed(text[start:cut]))
        start = cut
    deltas.append(parser.flush())
    reasoning = "".join(d.reasoning_content for d in deltas)
    content = "".join(d.content for d in deltas)
    assert (reasoning, content) == (parser.reasoning_content, parser.content)
    return reasoning, content, deltas


@pytest.mark.parametrize(
    "text, in_reasoning, reasoning, content",
    [
        ("Let me see.\n</think>\n\nIt is a cat.", True, "Let me see.\n", "It is a cat."),
        ("\nhmm</think>answer", True, "hmm", "answer"),
        ("still thinking", True, "still thinking", ""),
        ("It is a cat.", False, "", "It is a cat."),
        ("<think>\nplan\n</think>\n\nanswer", False, "plan\n", "answer"),
        ("  <think>x</think>y", False, "x", "y"),
        ("a <think> b", False, "", "a <think> b"),
        ("", True, "", ""),
        ("\n\n", False, "", ""),
        ("<thi", False, "", "<thi"),
        ("x</thin", True, "x</thin", ""),
    ],
)
def test_known_splits(text, in_reasoning, reasoning, content):
    assert split(text, in_reasoning)[:2] == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["a", "b ", "\n", "<think>", "</think>", "<", "</", "think", ">", "é", "世"]), max_size=12
    ),
    st.booleans(),
    st.data(),
)
def test_any_chunking_gives_the_whole_split(tokens, in_reasoning, data):
    text = "".join(tokens)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6, unique=True))
    assert split(text, in_reasoning, cuts)[:2] == split(text, in_reasoning)[:2]


def test_disabled_parser_keeps_everything_as_content():
    parser = ReasoningParser(True, enabled=False)
    assert parser.feed("a</think>b").content == "a</think>b"
    assert parser.reasoning_content == ""


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<think>old</think> answer <|im_start|>assistant\n")


@pytest.fixture(scope="module")
def thinking_pipe(fixed_export, tmp_path_factory):
    from qwen35_onnx.checkpoints import THINKING_CHAT_TEMPLATE, set_chat_template
    from qwen35_onnx.pipeline import Pipeline

    folder = shutil.copytree(fixed_export, tmp_path_factory.mktemp("thinking") / "export")
    set_chat_template(folder, THINKING_CHAT_TEMPLATE)
    return Pipeline.from_exported(folder)


def test_thinking_switch_of_a_qwen35_style_template(thinking_pipe):
    """Thinking on (the template's default): the prompt opens <think>, the whole reply up to
    </think> is reasoning. Off: the template closes an empty block, the reply is all content."""
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    on = thinking_pipe.prepare_chat(messages)
    off = thinking_pipe.prepare_chat(messages, {"enable_thinking": False})
    assert on.opens_reasoning and not off.opens_reasoning
    tokenizer = thinking_pipe.preprocessor.tokenizer
    assert tokenizer.decode(on.input_ids[0]).endswith("assistant\n<think>\n")
    assert tokenizer.decode(off.input_ids[0]).endswith("<think>\n\n</think>\n\n")

    thinking = thinking_pipe.chat(messages, max_new_tokens=24)
    raw = thinking.generation.text
    if "</think>" in raw:
        assert thinking.reasoning_content == raw.split("</think>")[0].lstrip("\n")
    else:
        assert thinking.reasoning_content == raw.lstrip("\n") and thinking.content == ""
    plain = thinking_pipe.chat(messages, max_new_tokens=24, chat_template_kwargs={"enable_thinking": False})
    assert plain.reasoning_content is None and plain.content == plain.generation.text

    # streamed deltas add up to the whole result
    stream = thinking_pipe.stream_chat(messages, max_new_tokens=24)
    deltas = list(stream)
    assert "".join(d.reasoning_content for d in deltas) == thinking.reasoning_content
    assert "".join(d.content for d in deltas) == thinking.content
    assert stream.result.generation.token_ids == thinking.generation.token_ids


def test_reserved_template_kwargs_are_refused(thinking_pipe):
    with pytest.raises(ValueError, match=r"may not set \['add_generation_prompt'\]"):
        thinking_pipe.prepare_chat([{"role": "user", "content": "x"}], {"add_generation_prompt": False})


@pytest.mark.parametrize("special", [False, True], ids=["plain-markers", "special-markers"])
def test_a_forced_think_end_splits_the_reply_whatever_the_markers_special_flag(fixed_export, tmp_path, special):
    """A constrained reply after an open reasoning block gets ``</think>`` forced (by its id) at half its tokens;
    the reply splits there into reasoning and content whether the tokenizer marks the markers special (decoding
    with skip_special_tokens drops them) or not."""
    import json

    from qwen35_onnx.checkpoints import THINKING_CHAT_TEMPLATE, set_chat_template
    from qwen35_onnx.pipeline import Pipeline

    folder = shutil.copytree(fixed_export, tmp_path / "export")
    set_chat_template(folder, THINKING_CHAT_TEMPLATE)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = special
    path.write_text(json.dumps(data))
    pipe = Pipeline.from_exported(folder)
    tokenizer = pipe.preprocessor.tokenizer
    assert tokenizer.decode([pipe.think_end_id], skip_special_tokens=True) == ("" if special else "</think>")

    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    reply = pipe.chat(messages, max_new_tokens=24, response_format={"type": "json_object"})
    tokens = reply.generation.token_ids
    assert pipe.think_end_id in tokens[:13]  # forced after half the reply at the latest
    assert reply.reasoning_content is not None and "</think>" not in reply.reasoning_content
    assert reply.content.lstrip().startswith("{") and "</think>" not in reply.content
    assert "</think>" in reply.generation.text  # the raw reply keeps its markers
    deltas = list(pipe.stream_chat(messages, max_new_tokens=24, response_format={"type": "json_object"}))
    assert "".join(d.content for d in deltas) == reply.content
    assert "".join(d.reasoning_content for d in deltas) == reply.reasoning_content
