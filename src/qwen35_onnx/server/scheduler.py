"""Scheduling generations (no HTTP): one generation slot with a FIFO queue, and one worker thread
that makes every pipeline call.

The graphs of a :class:`~qwen35_onnx.pipeline.Pipeline` are not thread-safe, so every generation
call (start, each step, close) runs in ONE worker thread, in arrival order; request preparation
(images, chat template, tokens) runs in a second thread beside it (``Pipeline.prepare_chat`` runs
no graph and shares the tokenizer under the preprocessor's lock), so decoding a large image does
not stall a stream. A request asks for the one generation slot: free -> it runs; busy -> it waits
in a FIFO queue of at most ``max_queue`` requests; queue full -> 429. A generation advances in
steps, each one job of the worker thread, so other requests' work runs between two tokens; it
holds the slot until its stream has ended and been closed in the worker thread. A cancelled
generation (its client gone) is closed between two tokens and the slot passes on.
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
from .protocol import APIError

log = logging.getLogger(__name__)

__all__ = ["ScheduledGeneration", "Scheduler", "Slots"]


class Slots:
    """One generation slot and a FIFO queue of at most ``max_queue`` waiters (event-loop only)."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.busy = False
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        """A new request would find the slot taken and no room in the queue."""
        return self.busy and len(self._waiters) >= self.max_queue

    def busy_error(self) -> APIError:
        return APIError(
            429,
            f"the server is busy: one generation is running and {len(self._waiters)} requests "
            f"are waiting (the limit, --max-queue {self.max_queue}); retry later",
            code="queue_full",
        )

    def enter(self) -> asyncio.Future | None:
        """Take the slot (None) or a place in the queue (a future set when the slot is handed
        over). Raises APIError 429 when the queue is full."""
        if not self.busy and not self._waiters:
            self.busy = True
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
        """The running generation is over: hand the slot to the first waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy = False


class ScheduledGeneration:
    """One admitted generation. Its :class:`~qwen35_onnx.pipeline.ChatStream` is touched only by the
    worker thread (``_pull``, ``_end``); the event loop asks for steps and for cancellation.

    Attributes:
        arrived: ``time.monotonic()`` when its request arrived (when the generation started, if
            not given).
        first_text_at: ``time.monotonic()`` when its first non-empty delta came (None before).
        ended_at: ``time.monotonic()`` when it ended (None before).
    """

    def __init__(self, scheduler: Scheduler, stream: ChatStream, arrived: float | None = None):
        self.scheduler = scheduler
        self.stream = stream
        self._deltas = iter(stream)
        self.outcome: str | None = None  # completed | cancelled | failed (worker thread writes)
        self._cancel_sent = False
        self.arrived = time.monotonic() if arrived is None else arrived
        self.first_text_at: float | None = None
        self.ended_at: float | None = None

    async def step(self, seconds: float) -> tuple[list[ChatDelta], bool]:
        """The next delta(s) (at least one unless the stream ends) and whether it has ended."""
        return await self.scheduler.call(self._pull, seconds)

    def _pull(self, seconds: float) -> tuple[list[ChatDelta], bool]:  # worker thread
        if self.outcome is not None:
            return [], True
        deltas: list[ChatDelta] = []
        deadline = time.monotonic() + seconds
        try:
            for delta in self._deltas:
                deltas.append(delta)
                if self.first_text_at is None and delta:
                    self.first_text_at = time.monotonic()
                if time.monotonic() >= deadline:
                    return deltas, False
        except BaseException:
            self._end("failed")
            raise
        self._end("completed")
        return deltas, True

    def _end(self, outcome: str) -> None:  # worker thread; the first outcome counts
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.ended_at = time.monotonic()
        try:
            self.stream.close()
        except Exception:  # noqa: BLE001 - closing must not keep the slot
            log.exception("closing a generation failed")
        finally:
            try:
                self.scheduler.loop.call_soon_threadsafe(self.scheduler.finished, self)
            except RuntimeError:  # the event loop has closed: the server is gone
                pass

    def cancel(self) -> None:
        """Stop the generation between two tokens and free its slot (idempotent, returns at once)."""
        if not self._cancel_sent:
            self._cancel_sent = True
            self.stream.cancel()  # thread-safe: ends a step that is running now, before its next token
            try:
                self.scheduler.executor.submit(self._end, "cancelled")
            except RuntimeError:  # the worker has shut down (server exit): nothing left to free
                pass


class Scheduler:
    """The worker thread, the preparation thread, the slot and its queue, and the counters
    (``completed`` / ``cancelled`` / ``failed`` / ``rejected`` / ``left_queue``) of one pipeline.
    Event-loop methods are called from the server's loop (:attr:`loop`, set when it starts).

    Args:
        pipeline: the pipeline every generation runs on.
        max_queue: most requests waiting for the slot.
        on_finished: called on the event loop with each generation that ended (e.g. metrics).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        max_queue: int,
        on_finished: Callable[[ScheduledGeneration], None] | None = None,
    ):
        self.on_finished = on_finished
        self.pipeline = pipeline
        self.slots = Slots(max_queue)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-pipeline")
        self.prepare_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-prepare")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "left_queue": 0}
        self.last: dict | None = None

    async def call(self, fn, *args):
        """Run ``fn(*args)`` in the pipeline's worker thread (the only thread that touches it)."""
        return await self.loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def prepare(self, fn, *args):
        """Run ``fn(*args)`` (request preparation, no graph) in the preparation thread."""
        return await self.loop.run_in_executor(self.prepare_executor, functools.partial(fn, *args))

    def refuse_if_full(self) -> None:
        """Raise the 429 before any costly work when the slot is taken and the queue full."""
        if self.slots.full:
            self.counters["rejected"] += 1
            raise self.slots.busy_error()

    async def admit(self, gone: asyncio.Future) -> bool:
        """Take the generation slot, waiting in the queue while it is busy; False when the client
        left (``gone`` done) before its turn.

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

    async def start(self, start, *args, arrived: float | None = None) -> ScheduledGeneration:
        """Start a generation in the worker thread (``start(*args)`` returns its ChatStream) in the
        slot :meth:`admit` took; the slot is released if starting fails. ``arrived``: the
        request's arrival (``time.monotonic()``)."""
        try:
            stream = await self.call(start, *args)
        except BaseException:
            self.slots.release()
            raise
        return ScheduledGeneration(self, stream, arrived)

    def finished(self, generation: ScheduledGeneration) -> None:  # event loop
        self.counters[generation.outcome] += 1
        result = generation.stream.result
        self.last = {
            "outcome": generation.outcome,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        }
        self.slots.release()
        if self.on_finished is not None:
            try:
                self.on_finished(generation)
            except Exception:  # noqa: BLE001 - an observer must not break the server
                log.exception("recording a finished generation failed")

    def state(self) -> dict:
        """``running``, ``waiting``, ``max_queue``, the counters and the last generation's outcome."""
        return {
            "running": int(self.slots.busy),
            "waiting": self.slots.waiting,
            "max_queue": self.slots.max_queue,
            **self.counters,
            "last": self.last,
        }

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.prepare_executor.shutdown(wait=False, cancel_futures=True)
