"""What constrained decoding costs per token (``qwen35-onnx bench``, section "Constrained decoding").

One greedy chat reply per case (a strict JSON schema answer, a required tool call) on a loaded
:class:`~qwen35_onnx.pipeline.Pipeline`: the grammar's time per token (llguidance's mask, applying
it to the logits, advancing the matcher) is timed inside the same generation as the decode steps,
so the ratio is measured side by side. Times are milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..conversation.grammar import TokenConstraint
from ..runtime.sampling import SamplingConfig

__all__ = ["CASES", "ConstrainedCost", "constrained_costs", "constrained_lines"]

_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "indoor": {"type": "boolean"}},
            "required": ["city", "indoor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "home"],
    "additionalProperties": False,
}
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
#: case name -> the reply format arguments of ``Pipeline.reply_format``.
CASES = {
    "json_schema (strict, nested)": dict(response_format={"type": "json_schema", "json_schema": {"schema": _SCHEMA}}),
    "tool call (required)": dict(tools=[_TOOL], tool_choice="required"),
}


@dataclass
class ConstrainedCost:
    """One case: ``tokens`` generated, the grammar's ``grammar_ms`` per token and the ``decode_ms``
    per decode step of the same generation."""

    case: str
    tokens: int
    grammar_ms: float
    decode_ms: float


class _TimedConstraint(TokenConstraint):
    """A :class:`TokenConstraint` that adds the seconds of :meth:`mask` and :meth:`accept` up."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds, self.calls = 0.0, 0

    def mask(self, logits):
        start = time.perf_counter()
        try:
            return super().mask(logits)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def accept(self, token):
        start = time.perf_counter()
        try:
            super().accept(token)
        finally:
            self.seconds += time.perf_counter() - start


def constrained_costs(pipe, max_new_tokens: int = 96) -> list[ConstrainedCost]:
    """Measure every case of :data:`CASES` on ``pipe`` (greedy, thinking off, one user question).

    Raises:
        ValueError: the prompt with the tools does not fit the export's buckets / capacity.
    """
    question = [{"role": "user", "content": "Describe a pet, or ask for the weather in Paris."}]
    out = []
    for case, kwargs in CASES.items():
        reply = pipe.reply_format(**kwargs)
        prepared = pipe.prepare_chat(question, {"enable_thinking": False}, reply=reply)
        plain = pipe.grammars.constraint(reply)
        timed = _TimedConstraint(plain.matcher, plain.vocab_size, stop_token_ids=tuple(plain.stop_token_ids))
        result = pipe.generate_prepared(prepared, max_new_tokens, SamplingConfig(), (), timed)
        out.append(
            ConstrainedCost(
                case,
                len(result.token_ids),
                1000 * timed.seconds / max(timed.calls, 1),
                result.timings.decode_ms_per_token,
            )
        )
    return out


def constrained_lines(row: str, costs: list[ConstrainedCost]) -> list[str]:
    """The markdown section for ``costs`` measured on the row ``row``."""
    lines = [
        "",
        f"Constrained decoding ({row}, greedy, llguidance): the grammar's time per token against the decode step",
        "",
        "| case | tokens | grammar ms/token | decode ms/token | overhead |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in costs:
        overhead = 100 * c.grammar_ms / c.decode_ms
        lines.append(f"| {c.case} | {c.tokens} | {c.grammar_ms:.3f} | {c.decode_ms:.2f} | {overhead:.1f} % |")
    return lines
