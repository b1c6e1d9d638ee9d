"""Issue acceptance (structured output): ``json_object`` and ``json_schema`` replies sampled from a
model that writes JSON, thinking on and off. Random weights never close a JSON string on their own
(the demo vocabulary has one token holding a quote), so a model that can end a reply is needed to
show that every reply parses: the suite's trained checkpoint after 150 more steps on chat turns with
JSON replies (``tests/training.py`` ``json_chats``; 0 of 400 sampled replies failed, the longest 213
of the 300 tokens allowed, where 60 steps failed 25). The grammar itself, on random weights and random logits, is
tested in ``tests/test_tools.py`` and ``tests/test_server.py``."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from .conftest import build_once, export_to

STEPS = 150
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "tree": {"type": "integer"},
        "sky": {"enum": ["blue", "red", "green"]},
        "book": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "house": {
            "type": "object",
            "properties": {"car": {"type": "boolean"}, "river": {"type": "string"}},
            "required": ["car"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "tree", "sky", "house"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def json_pipe(trained_checkpoint, tmp_path_factory):
    """The JSON-trained checkpoint (thinking template), exported with capacity 512 (a prompt and a
    reply of up to 300 tokens) and one prefill bucket of 64 tokens (the prompt is about 20)."""
    from qwen35_onnx.checkpoints import THINKING_CHAT_TEMPLATE, set_chat_template
    from qwen35_onnx.pipeline import Pipeline

    from .training import json_chats, train_checkpoint

    def build(out: Path) -> None:
        trained = train_checkpoint(
            trained_checkpoint, out.parent / f"{out.name}-checkpoint", steps=STEPS, texts=json_chats()
        )
        set_chat_template(trained, THINKING_CHAT_TEMPLATE)
        export_to(trained, out, capacity=512, prefill_buckets=(64,))

    return Pipeline.from_exported(build_once(tmp_path_factory, "export-json-trained", build))


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize(
    "response_format, schema",
    [
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}, SCHEMA),
    ],
    ids=["json_object", "json_schema"],
)
def test_twenty_sampled_replies_parse_and_validate(json_pipe, thinking, response_format, schema):
    """20 replies sampled at temperature 1 each end, parse and validate (jsonschema); with thinking
    on, the reasoning comes apart and the JSON is the content."""
    from qwen35_onnx.runtime.sampling import SamplingConfig

    for seed in range(20):
        reply = json_pipe.chat(
            [{"role": "user", "content": "Red car in the city?"}],
            max_new_tokens=300,
            sampling=SamplingConfig(temperature=1.0, seed=seed),
            chat_template_kwargs={"enable_thinking": thinking},
            response_format=response_format,
        )
        assert reply.finish_reason == "stop", (seed, reply.generation.text)
        jsonschema.validate(json.loads(reply.content), schema)
        assert (reply.reasoning_content is not None) == thinking
