"""Several generations decoded together: :class:`GenerationGroup` (no torch).

Each generation of a group holds one decode slot of the export (``--slots S``,
:class:`~qwen35_onnx.runtime.slots.SlotPool`) from its prefill to its end, and every decode step of the
group runs one row per generation that is decoding: on a memory-bound CPU step the weights are read once
for all of them. Generations beyond ``S`` wait, in the order they came, for a slot to free up.

Scheduling, one :meth:`GenerationGroup.step` (a round):

1. generations whose streams were cancelled or closed end (their slots are freed);
2. waiting generations take the free slots, oldest first;
3. the oldest generation still prefilling runs its prefill's next graph
   (:meth:`~qwen35_onnx.runtime.generation.Generation.prefill_runs`: its vision graphs, or a chunk), and while
   others decode its further chunks as long as the round's chunks stay within
   :data:`UNDER_LOAD_PREFILL_TOKENS` positions; when that was its last, its first token is picked and it
   decodes from the next step on. A generation that starts its prefill while others decode plans chunks of
   at most :data:`UNDER_LOAD_PREFILL_TOKENS` tokens (the export's smallest where none is that small), else
   the export's largest that pay;
4. one decode step of every decoding generation (:meth:`~qwen35_onnx.runtime.slots.SlotPool.step`), each
   picking its next token in its own :class:`~qwen35_onnx.streams.TokenLoop`; or, on an export of one decode
   slot with the pipeline's draft tokens (speculative decoding, :mod:`~qwen35_onnx.runtime.speculative`), the
   decoding generation's speculative round (its tokens go to its loop at once) while one can run (a
   constrained reply decodes one token a step).

So a running stream waits at most :data:`UNDER_LOAD_PREFILL_TOKENS` positions of prefill chunks (or one
request's images) between two of its tokens, whatever arrives, and a short prompt arriving under load is
prefilled in one round; a generation ends in the round its stop
criterion is met (or at the next round's start when cancelled), and its slot takes a newcomer at the next
round.

Example (an export with ``--slots 4``)::

    pipe = Pipeline.from_exported("out/")
    group = pipe.group()
    streams = [pipe.stream_chat([{"role": "user", "content": q}], max_new_tokens=64, group=group)
               for q in ("Hello!", "What is 2 + 2?", "Name three colours.")]
    group.run()                       # or iterate any stream: that runs the group until it has more
    for s in streams:
        print(s.result.content)

Source: iteration-level scheduling as in Orca (Yu et al. 2022) and vLLM; a prefill chunk between decode steps
as in Sarathi (Agrawal et al. 2023).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from .contract import KvMode, ShapeContract
from .runtime.generation import Generation
from .runtime.masks import CapacityExhausted
from .runtime.prompt import PreparedPrompt
from .runtime.slots import NoFreeSlot, SlotPool
from .runtime.snapshots import SnapshotCache
from .runtime.speculative import Speculation
from .streams import TokenLoop


class Generations(Protocol):
    """What a group needs of the :class:`~qwen35_onnx.pipeline.Pipeline` that made it (the pipeline imports
    this module, not the other way round)."""

    slot_pool: SlotPool
    contract: ShapeContract
    draft_tokens: int

    def generation(
        self, prepared: PreparedPrompt, state_cache: SnapshotCache | None = None, pooled: bool = False
    ) -> Generation: ...

    def keep_states(
        self, generation: Generation, state_cache: SnapshotCache | None, speculation: Speculation | None = None
    ) -> None: ...


__all__ = ["UNDER_LOAD_PREFILL_TOKENS", "GenerationGroup", "Generations", "Member"]


UNDER_LOAD_PREFILL_TOKENS = 128
"""While others decode: the prefill positions (chunk sizes summed) a round runs between two decode steps,
and the largest chunk of a generation that starts its prefill then (tokens). A 512-token chunk took 1.8 s at
0.8B int4 on 2 cores (AMD EPYC, ``benchmarks/results/``), a running stream's pause; 128 tokens cost about a
quarter of it, at about the same cost per token (32-token chunks: about 15 % more per token)."""


class Member:
    """One generation of a group: its prompt, its token loop (and stream), and once admitted its
    :class:`~qwen35_onnx.runtime.generation.Generation` and prefill runs."""

    def __init__(self, prepared: PreparedPrompt, loop: TokenLoop, state_cache: SnapshotCache | None):
        self.prepared, self.loop, self.state_cache = prepared, loop, state_cache
        self.generation: Generation | None = None
        self.speculation: Speculation | None = None
        self.runs: Iterator[int] | None = None
        self.started = False  # its first prefill run has been asked for
        self.decoding = False
        self.ended = False

    @property
    def stream(self):
        return self.loop.stream


class GenerationGroup:
    """Generations of one pipeline decoded together in its decode slots (see the module docstring for the
    rounds). Start them with the pipeline's stream methods and ``group=`` this group; run rounds with
    :meth:`step` or :meth:`run`, or by iterating any of the streams. Not thread-safe: one thread runs every
    round (and no other generation of the pipeline may run meanwhile).

    Attributes:
        pipeline: the pipeline whose export and slots the group uses.
        pool: the pipeline's :class:`~qwen35_onnx.runtime.slots.SlotPool`.
        members: generations not yet ended, in the order they came.

    Raises (constructor):
        ContractError: see :attr:`~qwen35_onnx.pipeline.Pipeline.slot_pool`.
    """

    def __init__(self, pipeline: Generations):
        self.pipeline = pipeline
        # a dynamic-KV export, or one slot with speculative decoding (no pool): its generations run one at a time,
        # each with its own decoder or speculation
        contract = pipeline.contract
        drafts = getattr(pipeline, "draft_tokens", 0) and contract.slots == 1
        self.pool = pipeline.slot_pool if contract.kv_mode == KvMode.FIXED and not drafts else None
        self.draft_tokens = int(getattr(pipeline, "draft_tokens", 0)) if self.pool is None else 0
        self.members: list[Member] = []
        self.steps = self.rows_stepped = self.last_rows = 0
        """Decode steps this group ran, their rows summed, and the rows of the latest."""

    @property
    def slots(self) -> int:
        """The export's decode slots."""
        return self.pool.size if self.pool is not None else 1

    @property
    def slots_busy(self) -> int:
        """Slots holding a sequence (of this group or another user of the pipeline)."""
        return self.pool.busy if self.pool is not None else self.running

    def _free(self) -> bool:
        return self.pool.free > 0 if self.pool is not None else self.running == 0

    def add(self, prepared: PreparedPrompt, loop: TokenLoop, state_cache: SnapshotCache | None = None) -> Member:
        """(The pipeline's stream methods) a new generation, waiting for a slot; its stream is driven by this
        group from now on."""
        member = Member(prepared, loop, state_cache)
        loop.stream.drive_by(self.step)
        self.members.append(member)
        return member

    @property
    def waiting(self) -> int:
        """Generations without a slot yet."""
        return sum(m.generation is None for m in self.members)

    @property
    def running(self) -> int:
        """Generations holding a slot (prefilling or decoding)."""
        return sum(m.generation is not None for m in self.members)

    def run(self) -> None:
        """Run rounds until every generation has ended."""
        while self.step():
            pass

    def step(self) -> bool:
        """One round (see the module docstring); returns whether generations remain."""
        for member in list(self.members):
            if member.stream.cancelled:
                self._end(member)
        for member in list(self.members):
            if member.generation is None and self._free():
                self._admit(member)
        if self.waiting and not self.running:  # every slot is held outside this group: none will free up here
            held = NoFreeSlot(
                f"all {self.slots} decode slots are held by generations outside this group (close them, or run "
                "those streams to their end, first)"
            )
            for member in [m for m in self.members if m.generation is None]:
                self._end(member, held)
        prefilling = next((m for m in self.members if m.runs is not None and not m.decoding), None)
        if prefilling is not None:
            self._prefill(prefilling)
        rows = [m for m in self.members if m.decoding and not m.ended and not m.stream.cancelled]
        if rows:
            self._decode(rows)
        return bool(self.members)

    def _admit(self, member: Member) -> None:
        try:
            member.generation = self.pipeline.generation(
                member.prepared, member.state_cache, pooled=self.pool is not None
            )
            if self.draft_tokens and member.loop.constraint is None and member.generation.chunked:
                member.speculation = Speculation(member.generation, self.draft_tokens)
            member.runs = member.generation.prefill_runs()
        except Exception as exc:  # noqa: BLE001 - the member's stream raises it
            self._end(member, exc)

    def _prefill(self, member: Member) -> None:
        generation, loop = member.generation, member.loop
        loaded = any(m.decoding for m in self.members)
        if not member.started:  # its chunk plan is made at its first run: bounded while others decode
            member.started = True
            if loaded:
                generation.max_chunk_tokens = UNDER_LOAD_PREFILL_TOKENS
        spent = 0
        try:
            while True:
                ran = next(member.runs)
                spent += ran
                coming = generation.next_run_tokens or 0
                if not (loaded and ran and coming and spent + coming <= UNDER_LOAD_PREFILL_TOKENS):
                    return
        except StopIteration as done:
            logits = done.value
        except Exception as exc:  # noqa: BLE001
            self._end(member, exc)
            return
        try:
            piece = loop.accept(logits)
        except Exception as exc:  # noqa: BLE001
            self._end(member, exc)
            return
        member.stream.result.timings, member.stream.result.cached_tokens = generation.timings, generation.cached_tokens
        member.decoding = True
        member.stream.put(piece)
        if loop.done:
            self._end(member)

    def _decode(self, rows: list[Member]) -> None:
        for member in [m for m in rows if m.speculation is not None and m.speculation.measuring]:
            rows.remove(member)
            self._plain_step(member)
        for member in [m for m in rows if m.speculation is not None and m.speculation.drafts_for()]:
            if member.speculation.worth_it():
                rows.remove(member)
                self._speculate(member)
        if not rows:
            return
        try:
            results = self._step(rows)
        except Exception as exc:  # noqa: BLE001 - the step failed for every row
            for member in rows:
                self._end(member, exc)
            return
        handled = 0
        try:
            for member, result in zip(rows, results):
                self._take(member, result)
                handled += 1
        except BaseException as exc:  # e.g. KeyboardInterrupt in an observer: the rows not handled yet ran a step
            for member in rows[handled + 1 :]:  # whose logits no token loop took: they cannot go on
                self._end(member, RuntimeError(f"the decode step was interrupted ({exc!r}) before this row was read"))
            raise

    def _step(self, rows: list[Member]) -> list:
        """One decode step of ``rows``: the pool's batched step, or (no pool) each generation's own."""
        if self.pool is not None:
            steps = self.pool.steps
            results = self.pool.step([(m.generation, m.loop.token) for m in rows])
            ran = self.pool.steps != steps
        else:
            results = []
            for member in rows:
                try:
                    results.append(member.generation.step(member.loop.token))
                except Exception as exc:  # noqa: BLE001 - that row's own outcome
                    results.append(exc)
                if member.speculation is not None:
                    member.speculation.stop()  # its decoder holds the states now
            ran = True
        if ran:
            self.steps += 1
            self.last_rows = sum(not isinstance(r, Exception) for r in results)
            self.rows_stepped += self.last_rows
        return results

    def _plain_step(self, member: Member) -> None:
        """A timed plain step of ``member`` before its speculative rounds (:meth:`Speculation.plain_step`)."""
        try:
            result = member.speculation.plain_step(member.loop.token)
        except Exception as exc:  # noqa: BLE001 - CapacityExhausted or a failure: that row's own outcome
            result = exc
        self.steps += 1
        self.last_rows = 1
        self.rows_stepped += 1
        self._take(member, result)

    def _speculate(self, member: Member) -> None:
        """A speculative round of ``member`` (alone: an export of one slot): its tokens go to its loop until it is
        done, the states after those it took are kept."""
        loop = member.loop
        try:
            piece = loop.speculate(member.speculation)
        except Exception as exc:  # noqa: BLE001 - the member's stream raises it
            self._end(member, exc)
            return
        self.steps += 1
        self.last_rows = 1
        self.rows_stepped += 1
        member.stream.put(piece)
        if loop.done:
            self._end(member)

    def _take(self, member: Member, result) -> None:
        """A row's result of a decode step: its next token (and text), or how it ended."""
        if isinstance(result, CapacityExhausted):
            member.loop.out_of_room()
            self._end(member)
            return
        if isinstance(result, Exception):
            self._end(member, result)
            return
        try:
            piece = member.loop.accept(result)
        except Exception as exc:  # noqa: BLE001
            self._end(member, exc)
            return
        member.stream.put(piece)
        if member.loop.done:
            self._end(member)

    def _end(self, member: Member, error: BaseException | None = None) -> None:
        """End ``member``: the held-back text and the kept states (when it ended normally or was cancelled), the
        final result, its slot freed, its stream ended (with ``error``)."""
        if member.ended:
            return
        member.ended = True
        self.members.remove(member)
        generation, loop, rest = member.generation, member.loop, ""
        try:
            if error is None:
                rest = loop.flush()
                if generation is not None and member.decoding:
                    self.pipeline.keep_states(generation, member.state_cache, member.speculation)
        except Exception as exc:  # noqa: BLE001
            error = exc
        finally:
            loop.finalize(generation)
        if rest:
            member.stream.put(rest)
        member.stream.end(error)
