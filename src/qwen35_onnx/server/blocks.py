"""A reply's deltas as a sequence of blocks, the unit both the Responses API (output items) and Anthropic's
Messages API (content blocks) are made of: reasoning, text, and one block per tool call, in the order the model
wrote them. :class:`Blocks` turns the core's :class:`~qwen35_onnx.conversation.reasoning.ChatDelta` s into
block events (open, text, close); the same object builds a whole reply (events dropped) and a streamed one, so
streamed and whole replies agree by construction.

Text that is only whitespace is held back until text follows (then it is the block's start) or the reply ends
(then it is a text block of its own unless the reply made calls: the newlines a model writes between its
reasoning or its text and a call are no block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..conversation.reasoning import ChatDelta
from ..conversation.tool_calls import ToolCall

__all__ = ["Block", "BlockEvent", "Blocks"]

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass
class Block:
    """One block: ``kind`` ``reasoning`` / ``text`` / ``call``, its ``index`` among the reply's blocks, its
    ``text`` so far, the ``call`` (a call block), and ``id`` (set by the API that writes it)."""

    kind: str
    index: int
    text: str = ""
    call: ToolCall | None = None
    id: str = ""


@dataclass
class BlockEvent:
    """``what`` ``open`` (a new block), ``text`` (``text`` added to the block) or ``close``."""

    what: str
    block: Block
    text: str = ""


@dataclass
class Blocks:
    """The blocks of one reply, fed its deltas (see the module docstring)."""

    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _held: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [b.call for b in self.blocks if b.kind == CALL]

    def _switch(self, kind: str, events: list[BlockEvent], call: ToolCall | None = None) -> Block:
        if self._open is not None and self._open.kind == kind and kind != CALL:
            return self._open
        self._close(events)
        block = Block(kind, len(self.blocks), call=call)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("open", block))
        return block

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", self._open))
            self._open = None

    def _text(self, kind: str, text: str, events: list[BlockEvent]) -> None:
        block = self._switch(kind, events)
        block.text += text
        events.append(BlockEvent("text", block, text))

    def feed(self, delta: ChatDelta) -> list[BlockEvent]:
        """The block events of one delta (its reasoning, then its text, then its calls)."""
        events: list[BlockEvent] = []
        if delta.reasoning_content:
            self._text(REASONING, delta.reasoning_content, events)
        if delta.content:
            text = self._held + delta.content
            if text.strip() or (self._open is not None and self._open.kind == TEXT):
                self._held = ""
                self._text(TEXT, text, events)
            else:
                self._held = text
        for call in delta.tool_calls:  # a call is a block of its own, opened and closed at once
            self._held = ""
            self._switch(CALL, events, call)
            self._close(events)
        return events

    def finish(self) -> list[BlockEvent]:
        """The events that end the reply (held whitespace as its own text block when no call came; the open block
        closed)."""
        events: list[BlockEvent] = []
        if self._held and not self.calls:
            self._text(TEXT, self._held, events)
        self._held = ""
        self._close(events)
        return events
