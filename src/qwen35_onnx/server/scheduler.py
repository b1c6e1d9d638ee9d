"""Scheduling generations (no HTTP): continuous batching in the export's decode slots, a FIFO queue beyond
them, and one worker thread that makes every pipeline call.

The graphs of a :class:`~qwen35_onnx.pipeline.Pipeline` are not thread-safe, so every generation call runs in
ONE worker thread; request preparation (images, chat template, tokens) runs in a second thread beside it
(``Pipeline.prepare_chat`` runs no graph and shares the tokenizer under the preprocessor's lock), so decoding a
large image does not stall a stream.

A request asks for one of the ``S`` generation slots (the export's decode slots, ``--slots`` at export): a
free one -> it runs; all taken -> it waits in a FIFO queue of at most ``max_queue`` requests; queue full -> 429.
Running generations are the members of one :class:`~qwen35_onnx.group.GenerationGroup`, whose rounds the
worker thread runs one after another while any is running, each round one job of the thread (so a new
request's start runs between two rounds): in a round the oldest generation still prefilling runs its next
prefill graph (its images, or chunks of at most :data:`~qwen35_onnx.group.UNDER_LOAD_PREFILL_TOKENS` positions
while others decode), then one decode step advances every decoding generation by a token (see
:mod:`qwen35_onnx.group`). A running stream therefore waits at most one decode step and that much prefill
between two tokens, however many requests arrive. A generation leaves between two rounds when it ends
(stop, length, a tool call), is cancelled (its client gone) or fails; its slot goes to the first waiter.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..conversation.reasoning import ChatDelta
from ..pipeline import ChatStream, Pipeline
from .errors import APIError

log = logging.getLogger(__name__)

__all__ = ["ScheduledGeneration", "Scheduler", "Slots"]


class Slots:
    """``size`` generation slots and a FIFO queue of at most ``max_queue`` waiters (event-loop only)."""

    def __init__(self, max_queue: int, size: int = 1):
        self.max_queue, self.size = max_queue, size
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        """Every slot is taken."""
        return self.running >= self.size

    @property
    def full(self) -> bool:
        """A new request would find every slot taken and no room in the queue."""
        return self.busy and len(self._waiters) >= self.max_queue

    def busy_error(self) -> APIError:
        return APIError(
            429,
            f"the server is busy: {self.running} generations are running (its {self.size} slots) and "
            f"{len(self._waiters)} requests are waiting (the limit, --max-queue {self.max_queue}); retry later",
            code="queue_full",
            retry_after=1,
        )

    def enter(self) -> asyncio.Future | None:
        """Take a slot (None) or a place in the queue (a future set when a slot is handed over). Raises
        APIError 429 when the queue is full."""
        if not self.busy and not self._waiters:
            self.running += 1
            return None
        if self.full:
            raise self.busy_error()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def leave_queue(self, waiter: asyncio.Future) -> None:
        """A waiter gives up; a slot already handed to it passes on."""
        if waiter.done() and not waiter.cancelled():
            self.release()
            return
        waiter.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def release(self) -> None:
        """A running generation is over: hand its slot to the first waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1


class ScheduledGeneration:
    """One admitted generation, a member of the scheduler's group. Its
    :class:`~qwen35_onnx.pipeline.ChatStream` produces deltas in the worker thread (the group's rounds); the event
    loop reads them with :meth:`step` and asks for cancellation.

    Attributes:
        arrived: ``time.monotonic()`` when its request arrived (when the generation started, if not given).
        first_text_at: ``time.monotonic()`` when its first non-empty delta came (None before).
        ended_at: ``time.monotonic()`` when it ended (None before).
        outcome: completed, cancelled or failed once it has ended (None before).
        route: the route its request came through (the metrics' label).
    """

    def __init__(
        self, scheduler: Scheduler, stream: ChatStream, arrived: float | None = None, route: str | None = None
    ):
        self.scheduler = scheduler
        self.stream = stream
        self.route = route
        self.outcome: str | None = None
        self._cancel_sent = False
        self.released = False  # its admission slot was handed on (when cancelled: before it has ended)
        self._news = asyncio.Event()
        self.arrived = time.monotonic() if arrived is None else arrived
        self.first_text_at: float | None = None
        self.ended_at: float | None = None

    async def step(self, seconds: float = 0.0) -> tuple[list[ChatDelta], bool]:
        """The deltas produced since the last call and whether the generation has ended: waits until there is at
        least one delta or the end, or with ``seconds`` > 0 at most that long (then possibly nothing).

        Raises:
            Exception: what the generation failed with, once its deltas before the failure are read.
        """
        deadline = None if seconds <= 0 else asyncio.get_running_loop().time() + seconds
        while True:
            self._news.clear()
            deltas = self._drain()
            if deltas:
                return deltas, False
            if self.outcome is not None:
                error = self.stream.generation_stream._error
                if self.outcome == "failed" and error is not None:
                    raise error
                return [], True
            try:
                timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                await asyncio.wait_for(self._news.wait(), timeout)
            except TimeoutError:
                return [], False

    def _drain(self) -> list[ChatDelta]:
        queue, deltas = self.stream._queue, []
        while queue:
            deltas.append(queue.popleft())
        if self.first_text_at is None and any(deltas):
            self.first_text_at = time.monotonic()
        return deltas

    def _notify(self) -> None:  # event loop: the worker thread produced deltas or ended the generation
        stream = self.stream.generation_stream
        if self.outcome is None and stream.ended:
            # a reply that ends itself (one tool call read) is completed; a stop asked for by the server, cancelled
            self.outcome = "failed" if stream._error is not None else "cancelled" if self._cancel_sent else "completed"
            self.ended_at = time.monotonic()
            self.scheduler.finished(self)
        self._news.set()

    def cancel(self) -> None:
        """Stop the generation before its next token and free its slot (idempotent, returns at once). The slot
        is handed on at once: the next request starts and takes the decode slot when the group has ended this
        generation, at its next round (a client that drops a stream and sends its next request right away is
        not refused for the slot its dropped stream still holds)."""
        if not self._cancel_sent and self.outcome is None:
            self._cancel_sent = True
            self.stream.cancel()  # thread-safe: the group ends it at its next round
            self.scheduler.wake()
            self.scheduler.hand_on(self)


class Scheduler:
    """The worker thread and its group of running generations, the preparation thread, the slots and their
    queue, and the counters (``completed`` / ``cancelled`` / ``failed`` / ``rejected`` / ``left_queue``) of one
    pipeline. Event-loop methods are called from the server's loop (:attr:`loop`, set when it starts).

    Args:
        pipeline: the pipeline every generation runs on; its export's decode slots are the slots here.
        max_queue: most requests waiting for a slot.
        on_finished: called on the event loop with each generation that ended (e.g. metrics).
        on_step: called in the worker thread with the rows of each decode step (e.g. metrics).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        max_queue: int,
        on_finished: Callable[[ScheduledGeneration], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ):
        self.on_finished, self.on_step = on_finished, on_step
        self.pipeline = pipeline
        self.group = pipeline.group()
        self.slots = Slots(max_queue, self.group.slots)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-pipeline")
        self.prepare_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-prepare")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "left_queue": 0}
        self.last: dict | None = None
        self._scheduled: list[ScheduledGeneration] = []  # worker thread
        self._pumping = False  # worker thread: a round job is queued

    async def call(self, fn, *args):
        """Run ``fn(*args)`` in the pipeline's worker thread (the only thread that touches it)."""
        return await self.loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def prepare(self, fn, *args):
        """Run ``fn(*args)`` (request preparation, no graph) in the preparation thread."""
        return await self.loop.run_in_executor(self.prepare_executor, functools.partial(fn, *args))

    def refuse_if_full(self) -> None:
        """Raise the 429 before any costly work when every slot is taken and the queue full."""
        if self.slots.full:
            self.counters["rejected"] += 1
            raise self.slots.busy_error()

    async def admit(self, gone: asyncio.Future) -> bool:
        """Take a generation slot, waiting in the queue while all are taken; False when the client left
        (``gone`` done) before its turn.

        Raises:
            APIError: 429 when the queue is full.
        """
        try:
            waiter = self.slots.enter()
        except APIError:
            self.counters["rejected"] += 1
            raise
        if waiter is None:
            return True
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.slots.leave_queue(waiter)
            raise
        if not waiter.done():
            self.slots.leave_queue(waiter)
            self.counters["left_queue"] += 1
            return False
        return True

    async def start(self, start, *args, arrived: float | None = None, route: str | None = None) -> ScheduledGeneration:
        """Start a generation in the worker thread (``start(*args, group=...)`` returns its ChatStream, a member of
        the group) in the slot :meth:`admit` took; the slot is released if starting fails. ``arrived``: the
        request's arrival (``time.monotonic()``); ``route``: its route (see :class:`ScheduledGeneration`)."""
        try:
            return await self.call(self._start, start, args, arrived, route)
        except BaseException:
            self.slots.release()
            raise

    def _start(self, start, args, arrived: float | None, route: str | None) -> ScheduledGeneration:  # worker thread
        stream = start(*args, group=self.group)
        generation = ScheduledGeneration(self, stream, arrived, route)
        self._scheduled.append(generation)
        self._pump()
        return generation

    def wake(self) -> None:
        """Have the worker thread run a round (e.g. to end a cancelled generation)."""
        try:
            self.executor.submit(self._pump)
        except RuntimeError:  # the worker has shut down (server exit)
            pass

    def _pump(self) -> None:  # worker thread: queue a round unless one is queued
        if not self._pumping and self._scheduled:
            self._pumping = True
            self.executor.submit(self._round)

    def _round(self) -> None:  # worker thread: one round of the group, then tell the event loop what changed
        self._pumping = False
        group, steps = self.group, self.group.steps
        try:
            group.step()
        except Exception:  # noqa: BLE001 - the group ends its members itself; this is a bug: log it, go on
            log.exception("a round of the generation group failed")
        if self.on_step is not None and group.steps != steps:
            try:
                self.on_step(group.last_rows)
            except Exception:  # noqa: BLE001 - an observer must not stop the rounds
                log.exception("recording a decode step failed")
        for generation in list(self._scheduled):
            stream = generation.stream
            if stream._queue or stream.generation_stream.ended:
                if stream.generation_stream.ended:
                    self._scheduled.remove(generation)
                self._tell(generation._notify)
        self._pump()

    def _tell(self, fn) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass

    def hand_on(self, generation: ScheduledGeneration) -> None:  # event loop
        """Release ``generation``'s admission slot (once)."""
        if not generation.released:
            generation.released = True
            self.slots.release()

    def finished(self, generation: ScheduledGeneration) -> None:  # event loop
        self.counters[generation.outcome] += 1
        result = generation.stream.result
        self.last = {
            "outcome": generation.outcome,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        }
        self.hand_on(generation)
        if self.on_finished is not None:
            try:
                self.on_finished(generation)
            except Exception:  # noqa: BLE001 - an observer must not break the server
                log.exception("recording a finished generation failed")

    def state(self) -> dict:
        """``running``, ``waiting``, ``max_queue``, ``slots`` (the export's decode slots), ``slots_busy`` (those
        holding a sequence now), ``decode_steps`` and ``decode_rows`` (rows summed over the steps), the counters and
        the last generation's outcome."""
        group = self.group
        return {
            "running": self.slots.running,
            "waiting": self.slots.waiting,
            "max_queue": self.slots.max_queue,
            "slots": group.slots,
            "slots_busy": group.slots_busy,
            "decode_steps": group.steps,
            "decode_rows": group.rows_stepped,
            **self.counters,
            "last": self.last,
        }

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.prepare_executor.shutdown(wait=False, cancel_futures=True)
