"""What a generation gives back as it runs: text pieces (:class:`GenerationStream`) or chat deltas
(:class:`ChatStream`), their results, and :class:`TokenLoop`, the one token loop every generation runs
(no torch): pick a token from the logits, detokenize, check the stop criteria. Whoever runs the graphs
drives it: :class:`~qwen35_onnx.pipeline.Pipeline` one generation at a time, a
:class:`~qwen35_onnx.group.GenerationGroup` several in the decode slots of one export.

Source: the stop criteria and finish reasons of transformers' ``GenerationMixin`` (end-of-sequence ids,
``max_new_tokens``, ``StopStringCriteria``) and OpenAI's chat completions ('stop', 'length', 'tool_calls').
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .conversation.grammar import TokenConstraint
from .conversation.reasoning import ChatDelta, ReasoningParser
from .conversation.tool_calls import ToolCall, ToolCallParser
from .runtime.generation import Generation, Timings
from .runtime.sampling import Sampler, StopStrings

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_TOOL_CALLS",
    "ChatResult",
    "ChatStream",
    "GenerationResult",
    "GenerationStream",
    "TokenLoop",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class GenerationResult:
    """Outcome of one generation: ``token_ids`` are the new tokens (an end-of-sequence id
    that stopped generation included), ``text`` their decoded text (special tokens skipped),
    ``finish_reason`` 'stop' or 'length' (None while unfinished), ``prompt_tokens`` the
    prompt length in tokens, ``cached_tokens`` those of them taken from a kept state instead of
    prefilled (see ``state_cache``), ``stop_string`` the stop string that ended it (None: none did)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    cached_tokens: int = 0
    stop_string: str | None = None


class GenerationStream:
    """Iterate to receive text pieces as tokens are produced.

    ``result`` is kept up to date after every token, so nothing is lost: when generation
    ends (end of sequence, stop string, ``max_new_tokens`` or capacity) it holds every token
    with its ``finish_reason``; when the caller stops iterating early it holds the tokens
    produced so far with ``finish_reason`` None (call :meth:`close` to release the states).
    """

    def __init__(self):
        self._pieces: Iterator[str] = iter(())
        self.result: GenerationResult | None = None
        self._cancel = threading.Event()
        # driven by a group (see drive_by): what a round of the group produced for this stream, whether it has
        # ended (and with which error), who takes each piece as it is produced, and the group's round
        self._queue: deque[str] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self._observers: list[Callable[[str | None], None]] = []
        self._drive: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def drive_by(self, drive: Callable[[], None]) -> None:
        """Make this a stream another object produces: ``drive()`` runs one round of that producer (a
        :class:`~qwen35_onnx.group.GenerationGroup` step), which hands each piece to :meth:`put` and ends the
        stream with :meth:`end`; iterating runs rounds until a piece is there or the stream has ended."""
        self._drive = drive
        self._pieces = self._pull()

    def _pull(self) -> Iterator[str]:
        while True:
            while self._queue:
                yield self._queue.popleft()
            if self._ended:
                if self._error is not None:
                    raise self._error
                return
            self._drive()

    @property
    def ended(self) -> bool:
        """A driven stream has produced everything (see :meth:`drive_by`)."""
        return self._ended

    def observe(self, observer: Callable[[str | None], None]) -> None:
        """Have ``observer`` called with every piece as it is produced, and with None when the stream ends
        (a driven stream: see :meth:`drive_by`), instead of queueing the pieces for iteration."""
        self._observers.append(observer)

    def put(self, piece: str) -> None:
        """(The producer) a new piece of text."""
        if not piece:
            return
        if self._observers:
            for observer in self._observers:
                observer(piece)
        else:
            self._queue.append(piece)

    def end(self, error: BaseException | None = None) -> None:
        """(The producer) the stream is over; ``error``: raised to the consumer once the pieces before it are read."""
        if self._ended:
            return
        self._ended, self._error = True, error
        for observer in self._observers:
            observer(None)

    def cancel(self) -> None:
        """Ask the generation to stop before its next token; safe to call from any thread, also
        while another thread is inside the iteration (a generator cannot be closed from there).
        The iteration then ends (tokens that produced no text yet included), ``result`` keeps
        every token with ``finish_reason`` None, and the states are released."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop the generation (its states are released); ``result`` keeps what was produced."""
        if self._drive is not None:  # a group's: it ends the generation at its next round
            self.cancel()
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


@dataclass
class ChatResult:
    """Outcome of one chat turn: the reply split at the ``<think>`` markers into ``content`` and
    ``reasoning_content`` (None when the reply had no reasoning block), the ``tool_calls`` it made
    (:class:`~qwen35_onnx.conversation.tool_calls.ToolCall`, arguments typed by the tools' schemas;
    their text is not in ``content``), and the underlying :class:`GenerationResult`
    (``generation.text`` is the raw reply, markers and calls included)."""

    content: str
    reasoning_content: str | None
    generation: GenerationResult
    tool_calls: list[ToolCall] = field(default_factory=list)
    ended_after_calls: bool = False  # stopped once the one call allowed (parallel calls off) was read

    @property
    def finish_reason(self) -> str | None:
        """'tool_calls' when the reply made calls (and was not cut by the length limit), else the
        generation's: 'stop', 'length', or None (stopped early)."""
        reason = self.generation.finish_reason
        if self.tool_calls and (reason == FINISH_STOP or self.ended_after_calls):
            return FINISH_TOOL_CALLS
        return reason

    @property
    def prompt_tokens(self) -> int:
        return self.generation.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """New tokens (an end-of-sequence id that stopped generation included)."""
        return len(self.generation.token_ids)


class ChatStream:
    """Iterate to receive :class:`~qwen35_onnx.conversation.reasoning.ChatDelta` s (``content`` and
    ``reasoning_content`` text, and tool calls each once complete) as tokens are produced.
    ``result`` is kept up to date as in :class:`GenerationStream`; :meth:`close` stops the
    generation and releases its states. With a ``calls`` parser limited to one call, the
    generation stops once that call is read."""

    def __init__(self, stream: GenerationStream, parser: ReasoningParser, calls: ToolCallParser | None = None):
        self.generation_stream = stream
        self._parser = parser
        self._calls = calls
        self._ended_after_calls = False
        if stream._drive is None:
            self._deltas = self._iterate()
            return
        # a driven stream: every piece is parsed as it is produced, so that a call that ends the reply stops the
        # generation at the same token as alone
        self._queue: deque[ChatDelta] = deque()
        stream.observe(self._observe)
        self._deltas = self._pull()

    def _observe(self, piece: str | None) -> None:
        self._queue.extend(self._feed(piece) if piece is not None else self._flush())

    def _pull(self) -> Iterator[ChatDelta]:
        stream = self.generation_stream
        while True:
            while self._queue:
                yield self._queue.popleft()
            if stream.ended:
                if stream._error is not None:
                    raise stream._error
                return
            stream._drive()

    def _feed(self, piece: str) -> list[ChatDelta]:
        """The deltas of one text piece (the reasoning split, then the tool calls); a call that ends the reply
        (one call allowed) cancels the generation."""
        delta = self._split_calls(self._parser.feed(piece))
        if self._calls is not None and self._calls.done and not self._ended_after_calls:
            self._ended_after_calls = True
            self.generation_stream.cancel()
        return [delta] if delta else []

    def _flush(self) -> list[ChatDelta]:
        tail = self._split_calls(self._parser.flush(), end=True)
        return [tail] if tail else []

    def _split_calls(self, delta: ChatDelta, end: bool = False) -> ChatDelta:
        if self._calls is None:
            return delta
        content, calls = self._calls.feed(delta.content)
        if end:
            tail, more = self._calls.flush()
            content, calls = content + tail, calls + more
        return ChatDelta(content, delta.reasoning_content, calls)

    def _iterate(self) -> Iterator[ChatDelta]:
        for piece in self.generation_stream:
            yield from self._feed(piece)
        yield from self._flush()

    def __iter__(self) -> Iterator[ChatDelta]:
        return self._deltas

    @property
    def result(self) -> ChatResult:
        parser, calls = self._parser, self._calls
        reasoning = parser.reasoning_content if (parser.reasoning_content or parser.entered_reasoning) else None
        if calls is None:
            return ChatResult(parser.content, reasoning, self.generation_stream.result)
        return ChatResult(
            calls.content, reasoning, self.generation_stream.result, list(calls.calls), self._ended_after_calls
        )

    def close(self) -> None:
        """Stop the generation (its states are released); ``result`` keeps what was produced."""
        self._deltas.close()
        self.generation_stream.close()

    def cancel(self) -> None:
        """Thread-safe request to stop before the next token (see :meth:`GenerationStream.cancel`)."""
        self.generation_stream.cancel()


class TokenLoop:
    """The token loop of one generation, whoever runs its graphs: from each logits row pick the next token
    (the grammar's forced token or mask first, when the reply is constrained), detokenize it, hold back text
    that may begin a stop string, and decide whether the generation is over: an end-of-sequence id, a stop
    string, ``max_new_tokens``, or (:meth:`out_of_room`) the capacity. :attr:`token` is the token to feed
    next; ``stream.result`` is kept up to date after every token.

    Args:
        prompt_len: the prompt's tokens.
        max_new_tokens: most new tokens (>= 1).
        sampler: picks a token from logits ``[V]`` fp32.
        stops: the stop strings (a fresh :class:`~qwen35_onnx.runtime.sampling.StopStrings`).
        eos: token ids that end the generation (kept among the tokens).
        streamer: incremental detokenizer (``put(token) -> str``, ``end() -> str``).
        stream: the stream whose ``result`` this loop keeps.
        constraint: the grammar every token keeps to (one per generation), a
            :class:`~qwen35_onnx.conversation.reasoning.ReasoningBudget` (``forced``, ``mask`` and ``accept`` as a
            grammar's), or None.
    """

    def __init__(
        self,
        prompt_len: int,
        max_new_tokens: int,
        sampler: Sampler,
        stops: StopStrings,
        eos: tuple[int, ...],
        streamer,
        stream: GenerationStream,
        constraint: TokenConstraint | None = None,
    ):
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.sampler, self.stops, self.eos, self.streamer = sampler, stops, eos, streamer
        self.stream, self.constraint = stream, constraint
        self.tokens: list[int] = []
        self.emitted: list[str] = []
        self.finish: str | None = None
        self.token: int | None = None
        stream.result = GenerationResult("", self.tokens, None, prompt_len)

    def _pick(self, logits: np.ndarray) -> int:
        if self.constraint is None:
            return self.sampler(logits)
        token = self.constraint.forced()
        if token is None:
            token = self.sampler(self.constraint.mask(logits))
        self.constraint.accept(token)
        return token

    def accept(self, logits: np.ndarray) -> str:
        """Pick the next token from ``logits`` ``[V]`` fp32 (the prefill's or a decode step's) and record it;
        returns the text it makes safe to show ('' if none). Sets :attr:`finish` when the token ends the
        generation."""
        return self.accept_token(self._pick(logits))

    def accept_token(self, token: int) -> str:
        """Record ``token`` (picked elsewhere: a speculative round's) as :meth:`accept` records its pick."""
        token = self.token = int(token)
        self.tokens.append(token)
        piece = self.stops.feed(self.streamer.put(token))
        if piece:
            self.emitted.append(piece)
            self.stream.result.text = "".join(self.emitted)
        if self.stops.stopped or token in self.eos:
            self.finish = FINISH_STOP
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish = FINISH_LENGTH
        return piece

    def speculate(self, speculation) -> str:
        """One speculative round of ``speculation`` (:class:`~qwen35_onnx.runtime.speculative.Speculation`) after
        :attr:`token`: its tokens recorded one by one as :meth:`accept_token` records them, until the generation
        is done, and the states after those taken kept (``commit``) before any text is shown; returns the text."""
        pieces = []
        for token in speculation.round(self.token, self.sampler):
            pieces.append(self.accept_token(token))
            if self.done:
                break
        speculation.commit(len(pieces))
        return "".join(pieces)

    @property
    def done(self) -> bool:
        """The generation is over (:attr:`finish` set)."""
        return self.finish is not None

    def out_of_room(self) -> None:
        """The KV cache has no slot for :attr:`token`: the generation ends with 'length'."""
        self.finish = FINISH_LENGTH

    def flush(self) -> str:
        """At the end: the text held back (incomplete characters, a possible stop string's start) that is now
        safe to show ('' after a stop string)."""
        if self.stops.stopped:
            return ""
        rest = self.stops.feed(self.streamer.end()) + self.stops.flush()
        if rest:
            self.emitted.append(rest)
        return rest

    def finalize(self, generation: Generation | None) -> GenerationResult:
        """The final result (``finish_reason`` None when the generation stopped early: cancelled or failed), with
        ``generation``'s timings and cached tokens; the generation (None: it never started) is closed (its decode
        slot freed)."""
        timings, cached = (Timings(), 0) if generation is None else (generation.timings, generation.cached_tokens)
        self.stream.result = GenerationResult(
            "".join(self.emitted), self.tokens, self.finish, self.prompt_len, timings, cached, self.stops.matched
        )
        if generation is not None:
            generation.close()
        return self.stream.result
