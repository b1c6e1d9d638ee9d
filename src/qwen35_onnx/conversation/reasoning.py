"""Split generated text into reasoning and content at the ``<think>`` / ``</think>`` markers.

Qwen3.5-style chat templates open ``<think>\\n`` inside the generation prompt when thinking is
on (their default): the reply starts inside the reasoning block and only ``</think>`` appears in
the generated text. With ``enable_thinking`` false the template writes an empty, closed block
and the reply is all content. Models whose template does not open the block may still write
``<think>`` themselves at the start of the reply. Source of the behaviour: vLLM's Qwen3 /
DeepSeek-R1 reasoning parsers (``reasoning_content`` and ``content`` fields).

:class:`ReasoningParser` is incremental and the same object serves streaming and whole
replies, so the concatenated deltas always equal the whole-reply split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "ChatDelta",
    "ReasoningBudget",
    "ReasoningParser",
    "THINK_START",
    "THINK_END",
    "partial_suffix",
    "prompt_opens_reasoning",
]

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ChatDelta:
    """One streamed piece of a chat reply: new ``reasoning_content`` and/or new ``content`` text, and
    the tool calls completed with it (:class:`~qwen35_onnx.conversation.tool_calls.ToolCall`)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block (its last ``<think>``
    comes after its last ``</think>``), so the reply starts as reasoning."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ReasoningParser:
    """Feed generated text pieces, get :class:`ChatDelta` s.

    States: *reasoning* (inside the block) until ``</think>``, then *content*. Starting outside
    the block, a reply whose first non-blank text is ``<think>`` enters it. The markers are not
    returned; newlines right after a marker are dropped (templates write ``<think>\\n`` and
    ``</think>\\n\\n``). Text that may be the beginning of a marker is held back until the next
    piece or :meth:`flush` decides.

    Args:
        in_reasoning: the prompt opened the block (:func:`prompt_opens_reasoning`).
        enabled: False: every piece is content, unchanged (a tokenizer without think markers).
    """

    def __init__(self, in_reasoning: bool, enabled: bool = True):
        self.enabled = enabled
        self.in_reasoning = in_reasoning and enabled
        self.entered_reasoning = self.in_reasoning  # the reply had a reasoning block
        self._may_open = enabled and not in_reasoning  # content has not started: <think> may still open
        self._strip_newlines = in_reasoning  # right after a marker
        self._held = ""
        self.reasoning_content = ""
        self.content = ""

    def feed(self, piece: str) -> ChatDelta:
        """Add generated text; return what is now certain."""
        if not self.enabled:
            self.content += piece
            return ChatDelta(content=piece)
        text = self._held + piece
        self._held = ""
        delta = ChatDelta()
        while text:
            if self._strip_newlines:
                text = text.lstrip("\n")
                if not text:
                    break
                self._strip_newlines = False
            if self._may_open:
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    text = stripped[len(THINK_START) :]
                    self.in_reasoning, self._may_open, self._strip_newlines = True, False, True
                    self.entered_reasoning = True
                    continue
                if THINK_START.startswith(stripped):  # blank or a prefix of <think>: wait
                    self._held = text
                    break
                self._may_open = False
            if self.in_reasoning:
                at = text.find(THINK_END)
                if at >= 0:
                    self._emit(delta, text[:at])
                    text = text[at + len(THINK_END) :]
                    self.in_reasoning, self._strip_newlines = False, True
                    continue
                keep = partial_suffix(text, THINK_END)
                self._emit(delta, text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            self._emit(delta, text)
            break
        return delta

    def flush(self) -> ChatDelta:
        """End of the reply: whatever was held back, as it stands."""
        text, self._held = self._held, ""
        delta = ChatDelta()
        if self._may_open:
            text = text.lstrip() if not text.strip() else text
        self._emit(delta, text)
        return delta

    def _emit(self, delta: ChatDelta, text: str) -> None:
        if not text:
            return
        if self.in_reasoning:
            delta.reasoning_content += text
            self.reasoning_content += text
        else:
            delta.content += text
            self.content += text


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningBudget:
    """A limit on a free-text reply's reasoning: after ``budget`` reasoning tokens ``</think>`` (``think_end``, a
    token id) is forced, so the answer comes (Anthropic's ``thinking.budget_tokens``). It offers the token loop what
    a grammar constraint offers (``forced``, ``mask``, ``accept``) and constrains nothing else; use it for a reply
    whose prompt opens the reasoning block.

    Args:
        think_end: the token id of ``</think>``.
        budget: most reasoning tokens (>= 1).
    """

    def __init__(self, think_end: int, budget: int):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"reasoning budget must be an integer >= 1 token, got {budget!r}")
        self.think_end, self.budget = int(think_end), budget
        self.reasoning_tokens = 0
        self.in_reasoning = True

    def forced(self) -> int | None:
        """``</think>`` once the budget is spent (during the reasoning), else None."""
        return self.think_end if self.in_reasoning and self.reasoning_tokens >= self.budget else None

    def mask(self, logits):
        """The logits unchanged: the budget forbids no token."""
        return logits

    def accept(self, token: int) -> None:
        """Count a reasoning token (``</think>`` ends the reasoning)."""
        if self.in_reasoning:
            if int(token) == self.think_end:
                self.in_reasoning = False
            else:
                self.reasoning_tokens += 1
