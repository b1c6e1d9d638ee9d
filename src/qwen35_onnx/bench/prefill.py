"""What a prompt costs before its first token (``qwen35-onnx bench``, section "Prefill"): time to
first token against the prompt's length for prefill buckets, prefill chunks and
onnxruntime-genai, and the fourth turn of a long conversation with and without kept states.

- Time to first token of a text prompt of ``n`` random ordinary tokens (``PREFILL_LENGTHS``):
  the prefill and the first token's choice (greedy), median of ``runs`` after one warm-up. The
  target: every length within 1.3x ``n`` times the best per-token rate measured (any row, any
  length).
- A conversation: a system prompt and three turns of about 550 tokens each (over 1,000 tokens of
  history; each reply fed as the model's output, see :func:`conversation_cost`), then a fourth
  question. Its time to first token continuing from the states the first three turns kept
  (:meth:`~qwen35_onnx.pipeline.Pipeline.state_cache`, a fresh copy of them for each timed run)
  against the same question alone in a fresh conversation. The target: 1.2x.

Times are milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..runtime.snapshots import SnapshotCache
from .protocol import median_ms

__all__ = [
    "PREFILL_LENGTHS",
    "ConversationCost",
    "conversation_cost",
    "genai_ttft",
    "prefill_lines",
    "ttft_by_length",
]

PREFILL_LENGTHS = (36, 100, 300, 700, 1500)
"""Prompt lengths (tokens) of the time-to-first-token curve (36: a one-image prompt's text with
Qwen3.5's template)."""
TTFT_TARGET = 1.3
TURN_TARGET = 1.2
QUESTION = "Which of these points matters most, and why?"


def ttft_by_length(pipe, prompts: dict[int, np.ndarray], runs: int = 3) -> dict[int, float]:
    """Time to first token (ms) of each prompt ``{n: ids [1, n]}`` on ``pipe``."""

    def first_token(prepared):
        return int(np.argmax(pipe.generation(prepared).prefill()))

    times = {}
    for n, ids in prompts.items():
        try:
            prepared = pipe.prepare_ids(ids)
        except ValueError:  # over the export's largest bucket
            continue
        times[n] = median_ms(lambda p=prepared: first_token(p), 1, runs)
        if not pipe.backend.shared_weight_bytes():
            pipe.backend.unload_prefill()
    return times


def genai_ttft(model_dir, prompts: dict[int, np.ndarray], runs: int = 3) -> dict[int, float]:
    """onnxruntime-genai's time to first token (ms): ``append_tokens`` of each prompt and the first
    ``generate_next_token`` (greedy), median of ``runs`` after one warm-up."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))

    def first_token(ids32):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids32) + 2, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids32)
        generator.generate_next_token()

    return {
        n: median_ms(lambda ids32=ids[0].astype(np.int32): first_token(ids32), 1, runs) for n, ids in prompts.items()
    }


@dataclass
class ConversationCost:
    """Turn 4 of a conversation: its prompt's tokens, those continued from kept states, its time to
    first token (ms) with them, and the same question's in a fresh conversation."""

    row: str
    history_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn_ms: float = 0.0
    fresh_ms: float = 0.0
    fresh_tokens: int = 0
    notes: list[str] = field(default_factory=list)


def _history(pipe, rng: np.random.Generator, words: int = 260) -> list[dict]:
    """A system prompt and three user / assistant turns of random words from the tokenizer's vocabulary."""
    tokenizer = pipe.preprocessor.tokenizer
    vocab = [w for w, i in tokenizer.get_vocab().items() if w.isalpha() and w.isascii() and 3 <= len(w) <= 8]
    vocab.sort()

    def text(n: int) -> str:
        return " ".join(rng.choice(vocab, size=n))

    messages = [{"role": "system", "content": "You are a careful assistant. " + text(20)}]
    for _ in range(3):
        messages.append({"role": "user", "content": text(words // 2)})
        messages.append({"role": "assistant", "content": text(words // 2)})
    return messages


def conversation_cost(row: str, pipe, runs: int = 3, seed: int = 0) -> ConversationCost:
    """:class:`ConversationCost` on ``pipe`` (an export with prefill chunks). Turns 1-3 run through one
    state cache as :meth:`~qwen35_onnx.pipeline.Pipeline.chat` runs them, each reply being the
    history's own assistant text fed as the model's output (teacher forcing: the state a model that
    wrote that reply keeps; the bench's random weights would write text that does not survive the
    round trip through the tokenizer); then turn 4, the client resending the whole conversation, is
    timed from a fresh copy of that cache each run, against the same question alone.

    Raises:
        ValueError: the conversation (about 1,750 tokens) does not fit the export's capacity."""
    kwargs = {"enable_thinking": False}
    history = _history(pipe, np.random.default_rng(seed))
    tokenizer = pipe.preprocessor.tokenizer
    cost = ConversationCost(row)
    cache = pipe.state_cache()
    for end in (2, 4, 6):  # turns 1-3 as a client sends them: each user message with the history before it
        generation = pipe.generation(pipe.prepare_chat(history[:end], kwargs), cache)
        generation.prefill()
        for token in tokenizer(history[end]["content"], add_special_tokens=False)["input_ids"]:
            generation.step(token)  # the reply; its end-of-turn token is the one sampled last, never fed
        for snapshot in [*generation.snapshots, generation.snapshot()]:
            cache.put(snapshot)
    kept = list(cache._items.values())
    turn = history + [{"role": "user", "content": QUESTION}]
    fresh = [{"role": "user", "content": QUESTION}]
    prepared = pipe.prepare_chat(turn, kwargs)
    cost.prompt_tokens = prepared.prompt_len
    cost.history_tokens = max(prepared.snapshot_points or (0,))
    cost.fresh_tokens = pipe.prepare_chat(fresh, kwargs).prompt_len

    def first_token(messages, states=None):
        """What a request costs up to its first token: the template, the tokens, the kept state and the
        prefill (the snapshots kept after the first token are not in it)."""
        generation = pipe.generation(pipe.prepare_chat(messages, kwargs), states)
        int(np.argmax(generation.prefill()))
        cost.cached_tokens = generation.cached_tokens

    def turn_four():
        copy = SnapshotCache(cache.max_bytes)
        for snapshot in kept:
            copy.put(snapshot)
        first_token(turn, copy)

    cost.fresh_ms = median_ms(lambda: first_token(fresh), 1, runs)
    cost.turn_ms = median_ms(turn_four, 1, runs)
    return cost


def prefill_lines(curves: dict[str, dict[int, float]], conversations: list[ConversationCost]) -> list[str]:
    """The section's markdown: the time-to-first-token table with each cell's ratio to ``n`` tokens at
    the best per-token rate measured, the targets read off it, and the conversation rows."""
    if not curves:
        return []
    lengths = sorted({n for curve in curves.values() for n in curve})
    best = min(ms / n for curve in curves.values() for n, ms in curve.items())
    lines = [
        "",
        "## Prefill: time to first token by prompt length",
        "",
        f"Text prompts of n random tokens; each cell: ms (its ratio to n x {best:.2f} ms, the best per-token rate "
        f"measured). Target: every length <= {TTFT_TARGET}x.",
        "",
        "| row | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for row, curve in curves.items():
        cells = [f"{curve[n]:.0f} ({curve[n] / (n * best):.2f}x)" if n in curve else "-" for n in lengths]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    for row, curve in curves.items():
        worst = max(curve, key=lambda n: curve[n] / (n * best))
        ratio = curve[worst] / (worst * best)
        verdict = "met" if ratio <= TTFT_TARGET else "missed"
        lines.append(f"- {row}: worst at {worst} tokens, {ratio:.2f}x: target {verdict}")
    if conversations:
        lines += [
            "",
            "## Prefill: turn 4 of a conversation",
            "",
            f"History over 1,000 tokens resent by the client; target: turn 4 <= {TURN_TARGET}x the same question "
            "in a fresh conversation.",
            "",
            "| row | history tokens | turn-4 prompt | from kept states | turn 4 ms | fresh ms (tokens) | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in conversations:
            ratio = c.turn_ms / c.fresh_ms
            lines.append(
                f"| {c.row} | {c.history_tokens} | {c.prompt_tokens} | {c.cached_tokens} | {c.turn_ms:.0f} | "
                f"{c.fresh_ms:.0f} ({c.fresh_tokens}) | {ratio:.2f}x ({'met' if ratio <= TURN_TARGET else 'missed'}) |"
            )
    return lines
