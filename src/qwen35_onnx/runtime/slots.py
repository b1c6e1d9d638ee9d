"""Decode slots: several sequences decoded together by one run of the decode graph (numpy only, no torch).

An export with ``--slots S`` has a decode graph of ``S`` rows (:class:`~qwen35_onnx.export.graphs.DecodeGraph`):
row ``s`` steps the sequence in slot ``s`` with its own token, mask row, positions and states, and a row
whose mask row is all zeros is idle (its states are left as they are). A :class:`SlotPool` holds those
``S``-row states in one decoder of the backend, which slot each :class:`~.generation.Generation` holds,
and runs the batched step.

Idle rows (a free slot, a sequence that sits a step out) step too, marked inactive (``active_rows``): their
recurrent and conv states are left as they are, and their k, v go to the next free KV slot of their sequence
(slot 0 of a free one), so an idle row reads as many KV slots as its sequence holds (one for a free slot), not
the capacity.

With ``--ops ort`` the decode graph's row axis is dynamic (:attr:`~qwen35_onnx.contract.ShapeContract.dynamic_rows`)
and the pool keeps the slots in use first: a step runs the rows up to the last slot held, not all ``S`` (on a CPU
a row costs compute once the products stop being bound by memory: one stream alone runs at the speed of a
one-slot export). A sequence that leaves from below the last held slot gets that slot's sequence moved into its
place (one copy of one slot's state, when a sequence ends; never per step).

A sequence enters its slot once its prefill is done: the prefill runs in the chunk graphs (batch 1) on
states of its own, as a generation alone does, and :meth:`SlotPool.place` copies the result into the
slot's rows (conv and recurrent state, the KV slots in use: the only copy of a sequence's state the
pool makes). From then on every decode step updates the slot where it is: the KV cache in place
(``--ops ort``) or in the A/B buffers every row shares; nothing is gathered or scattered per step
(:attr:`SlotPool.bytes_copied` counts the bytes ``place`` copied; a step copies none).

KV tiers (an export with several :attr:`~qwen35_onnx.contract.ShapeContract.kv_tiers`): the pool runs the decode
graph at one width for every row, the smallest tier that holds its widest sequence (:attr:`SlotPool.width`). A
step, or a sequence placed into a slot, that needs more moves the pool up first, and a release that leaves it
wider than needed moves it down (:meth:`SlotPool._resize`: a new decoder at the new width, each held slot's conv
and recurrent state and its KV slots in use copied once); a step reads every row at the pool's width.

Source: continuous batching as in Orca (Yu et al. 2022, "Orca: A Distributed Serving System for
Transformer-Based Generative Models": requests join and leave the batch between iterations) and
vLLM; the per-slot recurrent state of hybrid models as in vLLM's mamba state slots and Qualcomm's
efficient-transformers ``batch_index`` (one state row per slot, reset when a new sequence starts).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from ..contract import ContractError, KvMode
from ..host_memory import discard_pages
from .backend import Backend
from .masks import CapacityExhausted
from .positions import decode_position_ids
from .prompt import PreparedPrompt

__all__ = ["NoFreeSlot", "SlotPool", "SlotSequence"]


class SlotSequence(Protocol):
    """What a pool needs of a sequence in one of its slots (:class:`~.generation.Generation` is one)."""

    slot: int | None
    mask: np.ndarray
    prompt: PreparedPrompt

    def claim(self) -> int: ...

    def stepped(self, token: int, logits: np.ndarray, elapsed_ms: float) -> np.ndarray: ...


class NoFreeSlot(RuntimeError):
    """Every decode slot holds a sequence (:attr:`SlotPool.size` of them)."""


class SlotPool:
    """The ``S`` decode slots of one backend (``S`` = the export's :attr:`~qwen35_onnx.contract.ShapeContract.slots`).

    Not thread-safe: one thread runs every graph of a backend.

    Attributes:
        size: the number of slots, ``S``.
        holders: the generation in each slot (None: free).
        steps: decode steps run.
        rows_stepped: rows summed over those steps (``rows_stepped / steps``: the mean batch).
        last_rows: the rows of the latest step.
        bytes_copied: bytes :meth:`place` copied into slots and tier moves copied between widths (a decode step
            copies none).
        bytes_discarded: bytes of KV memory handed back to the system as slots were released.
        width: the KV width (tokens) the decode graph runs at: the capacity, or the smallest KV tier that holds the
            widest held sequence and its next token.
        resizes: moves of the pool to another KV tier.

    Raises (constructor):
        ContractError: a dynamic-KV export, or a backend whose states the host cannot address.
    """

    def __init__(self, backend: Backend):
        contract = backend.contract
        if contract.kv_mode != KvMode.FIXED:
            raise ContractError("decode slots need a fixed-KV export (--kv-cache fixed)")
        self.backend = backend
        self.size = contract.slots
        self.width = contract.kv_tiers[0]
        self.decoder = backend.slot_decoder(self.width)
        self.holders: list[SlotSequence | None] = [None] * self.size
        self.steps = self.rows_stepped = self.last_rows = self.bytes_copied = self.bytes_discarded = 0
        self.resizes = 0
        self._ids = np.zeros((self.size, 1), dtype=np.int64)
        self._masks = np.zeros((self.size, self.width), dtype=np.int64)
        self._mask_ones = [0] * self.size  # the leading ones of each row of _masks (the rest is zeros)
        self._positions = np.zeros((4, self.size, 1), dtype=np.int64)
        self._active = np.zeros(self.size, dtype=np.bool_)
        self.lengths = [0] * self.size
        """Tokens in each slot's KV cache (0: a free slot, or one whose sequence is still prefilling)."""

    @property
    def free(self) -> int:
        """Slots that hold no sequence."""
        return self.holders.count(None)

    @property
    def busy(self) -> int:
        """Slots that hold a sequence."""
        return self.size - self.free

    def acquire(self, generation: SlotSequence) -> int:
        """The lowest free slot, now held by ``generation``.

        Raises:
            NoFreeSlot: every slot is held.
        """
        for slot, holder in enumerate(self.holders):
            if holder is None:
                self.holders[slot] = generation
                return slot
        raise NoFreeSlot(f"all {self.size} decode slots hold a sequence")

    def release(self, slot: int) -> None:
        """Free ``slot``: its KV rows' memory goes back to the system
        (:func:`~qwen35_onnx.host_memory.discard_pages`: the slot reads zeros and costs nothing until the next
        sequence writes it; its conv and recurrent rows keep stale values until then). With a dynamic row axis the
        last held slot's sequence moves into it (its states copied, its ``slot`` changed), so that the held slots
        stay first. With KV tiers the pool moves down to the smallest tier that holds the sequences left."""
        self.holders[slot] = None
        self.lengths[slot] = 0
        if not self.backend.contract.dynamic_rows:
            self._discard(slot)
            self._fit()
            return
        last = self.rows - 1
        if last <= slot:
            self._discard(slot)
            return
        mover = self.holders[last]
        if self.lengths[last]:  # placed: its states move (a prefilling sequence has none here yet)
            rows = self.backend.state_views(self.decoder.states())
            for name, value in rows.items():
                source, target = value[:, last : last + 1], value[:, slot : slot + 1]
                if name == "present_kv_cache":
                    source, target = source[:, :, :, : self.lengths[last]], target[:, :, :, : self.lengths[last]]
                np.copyto(target, source)
                self.bytes_copied += source.nbytes
        self.holders[slot], self.lengths[slot] = mover, self.lengths[last]
        self.holders[last], self.lengths[last] = None, 0
        mover.slot = slot
        self._discard(last)

    def _needed(self) -> int:
        """KV slots a step needs: each held sequence's length and the one its next token (or an idle row's
        write) takes, at most the capacity."""
        held = [self.lengths[s] + 1 for s, holder in enumerate(self.holders) if holder is not None]
        return min(max(held, default=1), self.backend.contract.capacity)

    def _fit(self, slots: int = 0) -> None:
        """Run at the smallest KV tier that holds ``slots`` and every held sequence (:meth:`_needed`), moving
        there (:meth:`_resize`) where that is another width."""
        width = self.backend.contract.tier_for(max(slots, self._needed()))
        if width != self.width:
            self._resize(width)

    def _resize(self, width: int) -> None:
        """Move the pool's states to buffers ``width`` tokens wide: a new decoder at that width, each held slot's
        conv and recurrent state and the KV slots it uses copied once (the rows of free slots stay zero)."""
        old = self.backend.state_views(self.decoder.states())
        decoder = self.backend.slot_decoder(width)
        new = self.backend.state_views(decoder.states())
        for slot, length in enumerate(self.lengths):
            if self.holders[slot] is None or not length:
                continue
            for name, value in old.items():
                source, target = value[:, slot : slot + 1], new[name][:, slot : slot + 1]
                if name == "present_kv_cache":
                    source, target = source[:, :, :, :length], target[:, :, :, :length]
                np.copyto(target, source)
                self.bytes_copied += source.nbytes
        self.decoder, self.width = decoder, width
        kept = min(width, self._masks.shape[1])
        masks = np.zeros((self.size, width), dtype=np.int64)
        masks[:, :kept] = self._masks[:, :kept]
        self._masks = masks
        self._mask_ones = [min(ones, width) for ones in self._mask_ones]
        self.resizes += 1

    def _discard(self, slot: int) -> None:
        """Hand back the memory of ``slot``'s KV rows (those of the buffers the decoder holds now)."""
        kv = self.backend.state_views(self.decoder.states()).get("present_kv_cache")
        if kv is not None:
            self.bytes_discarded += discard_pages(kv[:, slot])

    @property
    def rows(self) -> int:
        """Rows a step runs: all the slots, or with a dynamic row axis those up to the last one held (at least 1)."""
        if not self.backend.contract.dynamic_rows:
            return self.size
        return max((i + 1 for i, holder in enumerate(self.holders) if holder is not None), default=1)

    def place(self, slot: int, states: dict[str, Any], length: int) -> None:
        """Copy a prefilled sequence's ``states`` (one row, the backend's form, as a prefill or chunk run
        returns them: the KV cache in the prompt graphs' dtype) of ``length`` tokens into ``slot``'s rows of the
        decode states (the KV cache converted to the decode graph's, :mod:`.kv_codec`, as it is copied); the KV
        slots from ``length`` on are left as they are (no row reads a KV slot it has not written). The pool moves
        up first where its KV tier does not hold the sequence and its next token."""
        self._fit(length + 1)
        rows = self.backend.state_views(self.decoder.states())
        for name, value in self.backend.states_to_host(states, kv_length=length).items():
            target = rows[name][:, slot : slot + 1]
            if name == "present_kv_cache":
                target = target[:, :, :, :length]
            if name == "present_kv_cache" and self.backend.contract.converts_kv:
                self.backend.kv_codec.to_decode(value, out=target)
            else:
                np.copyto(target, value)
            self.bytes_copied += value.nbytes
        self.lengths[slot] = length

    def read(self, slot: int, length: int) -> dict[str, np.ndarray]:
        """Host copies of ``slot``'s states (one row, ``present_*`` keys in the contract's stacked shapes), the
        KV cache's first ``length`` slots: what a :class:`~.snapshots.StateSnapshot` keeps."""
        rows = self.backend.state_views(self.decoder.states())
        arrays = {}
        for name, value in rows.items():
            view = value[:, slot : slot + 1]
            if name == "present_kv_cache":
                view = view[:, :, :, :length]
            arrays[name] = np.array(view, copy=True)
        return arrays

    def _mask_prefix(self, slot: int, ones: int) -> None:
        """Make ``slot``'s mask row ``ones`` ones (at most the capacity) then zeros, writing only the columns that
        change (a whole row is the capacity wide: 0.5 MB of int64 at 65,536 tokens)."""
        ones = min(ones, self._masks.shape[1])
        now = self._mask_ones[slot]
        if ones > now:
            self._masks[slot, now:ones] = 1
        elif ones < now:
            self._masks[slot, ones:now] = 0
        self._mask_ones[slot] = ones

    def step(self, rows: list[tuple[SlotSequence, int]]) -> list[np.ndarray | Exception]:
        """One decode step of every generation in ``rows`` (each with the token to feed, one row per slot
        held), the other slots idle: each row claims its next KV slot and position
        (:meth:`~.generation.Generation.claim`), one run of the decode graph, and each generation's
        timings and tokens are updated. Returns, per row in order, its logits ``[V]`` fp32 (a view of the
        step's output, valid until the step after next), or the exception that row met instead
        (:class:`~.masks.CapacityExhausted` before the run: nothing was run for it;
        :class:`~qwen35_onnx.contract.ContractError`: logits not finite), so that one row's end does not
        end the others.

        Raises:
            ValueError: a generation that holds no slot of this pool, or two rows for one slot.
        """
        start = time.perf_counter()  # (a move to a wider KV tier counts with the step that needs it)
        self._ids[...] = 0
        self._positions[...] = 0
        self._active[...] = False
        self._fit()  # (every held sequence's next token: its own claim below, or its idle row's write)
        for slot, length in enumerate(self.lengths):  # idle rows: the next free KV slot of their sequence
            self._mask_prefix(slot, length + 1)
        results: list[np.ndarray | Exception | None] = [None] * len(rows)
        live = []
        for i, (generation, token) in enumerate(rows):
            slot = generation.slot
            if slot is None or self.holders[slot] is not generation:
                raise ValueError("a generation stepped by a slot pool must hold one of its slots")
            if self._active[slot]:
                raise ValueError(f"slot {slot} is stepped twice in one decode step")
            try:
                next_pos = generation.claim()
            except CapacityExhausted as exc:
                results[i] = exc
                continue
            self._ids[slot, 0] = token
            self._active[slot] = True
            self._mask_prefix(slot, next_pos + 1)  # (the generation's own mask row: ones up to its new token)
            self.lengths[slot] = next_pos + 1
            self._positions[:, slot : slot + 1] = decode_position_ids(next_pos, generation.prompt.rope_deltas)
            live.append(i)
        if not live:
            return results
        n = self.rows
        logits = self.decoder.step(self._ids[:n], self._masks[:n], self._positions[:, :n], self._active[:n])
        elapsed = 1000 * (time.perf_counter() - start)
        self.steps += 1
        self.rows_stepped += len(live)
        self.last_rows = len(live)
        for i in live:
            generation, token = rows[i]
            try:
                results[i] = generation.stepped(token, logits[generation.slot, -1], elapsed)
            except ContractError as exc:
                results[i] = exc
        return results
