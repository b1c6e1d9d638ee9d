"""One generation on a backend: the only decode loop (numpy only, no torch).

A :class:`Generation` owns what one generation needs between graph runs: its prompt, the decode
attention mask (capacity wide in fixed mode), the mRoPE offset, the device-resident states and
the decoder stepping them, and the wall-clock timings. It is the one place that claims KV slots
(:func:`~.masks.advance_mask`) and computes decode positions
(:func:`~.positions.decode_position_ids`); the pipeline, the bench and the tests feed it tokens::

    generation = Generation(backend, prompt)   # checks the mask, loads the prefill graph
    logits = generation.prefill()              # vision (if images) + prefill: [V] fp32
    while ...:
        logits = generation.step(token)        # one decode step: [V] fp32

Source: the fixed-capacity decode flow of the reference system (write slot ``sum(mask) - 1``
and causal mask computed in the graph), and transformers' ``GenerationMixin`` for what the
mask and the position ids become after each token.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import ContractError, KvMode, PromptTooLongError, ShapeContract
from .backend import Backend, Decoder
from .chunks import DECODE_STEP_COST, plan_chunks
from .masks import CapacityExhausted, advance_mask, prepare_decode_mask
from .positions import decode_position_ids
from .prompt import PreparedPrompt
from .slots import SlotPool
from .snapshots import StateSnapshot, image_digests

__all__ = ["Generation", "Timings"]

POOLED_DECODE_STEP_COST = 1_000_000
"""Cost (tokens of prefill work) given to a trailing decode step of a prompt in a slot pool, where it is a
step of every slot: the chunk plan takes one only where no chunk fits below the capacity."""


@dataclass
class Timings:
    """Wall-clock times in milliseconds (``vision_ms`` is None for a text-only prompt);
    ``decode_steps`` counts the tokens fed after the prefill: one per decode-graph run, or with speculative
    decoding the tokens each verify run kept (``verify_runs`` of them; ``drafted`` draft tokens proposed,
    ``accepted`` of them kept; ``draft_ms`` the MTP head's share of ``decode_ms``)."""

    vision_ms: float | None = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0
    verify_runs: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens fed per second of decode time."""
        return 1000.0 * self.decode_steps / self.decode_ms if self.decode_ms else 0.0

    @property
    def acceptance(self) -> float | None:
        """Share of the draft tokens kept (None: nothing drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    def summary(self) -> str:
        vision = "no image" if self.vision_ms is None else f"{self.vision_ms:.1f} ms"
        text = (
            f"vision {vision} | prefill {self.prefill_ms:.1f} ms | "
            f"decode {self.decode_ms_per_token:.2f} ms/token over {self.decode_steps} steps | "
            f"{self.tokens_per_s:.1f} tokens/s"
        )
        if self.drafted:
            text += f" | {self.accepted}/{self.drafted} drafts accepted in {self.verify_runs} verify runs"
        return text


class Generation:
    """One generation of ``prompt`` on ``backend``: prefill once, then one decode step per token.

    Construction checks the prompt's attention mask (batch 1, 0/1 values, a contiguous prefix;
    before any graph reads it: static compilers do not bound-check the indices a graph derives
    from it) and loads and cross-checks the prefill graph of the prompt's bucket (on an export with
    prefill chunks the chunk graphs load on first use: see :meth:`prefill`). With ``states``
    (prefill outputs in ``backend``'s form, e.g. of another generation of the same prompt) the
    prefill is taken as done and :meth:`step` continues from them. With ``start`` (a
    :class:`~.snapshots.StateSnapshot` of this export whose tokens and images begin the prompt) the
    chunked prefill continues from it and prefills only the rest; ``snapshot_at``: prompt positions
    where the chunked prefill keeps a snapshot (:attr:`snapshots`); ``image_digests``: the prompt's
    :func:`~.snapshots.image_digests`, when the caller has them already. With ``pool`` (a
    :class:`~.slots.SlotPool`; required on an export of several decode slots) the generation holds
    one of its slots from construction to :meth:`close`: the prefill runs on states of its own, which
    then go into the slot, and each decode step is a step of the pool (alone: :meth:`step`; with the
    pool's other sequences: :meth:`~.slots.SlotPool.step`).

    KV tiers (an export with several :attr:`~qwen35_onnx.contract.ShapeContract.kv_tiers`): the mask, the states
    and the decoder are held at the smallest tier that holds what the generation needs (:attr:`width`): the prefill
    at the tier that holds the prompt (a chunked prefill plans its chunks within it), and before a decode step, a
    verify run or a draft would pass it the generation moves up (:meth:`_move_to`: the states copied once into
    buffers of the wider tier, the decoder rebuilt from them). In a slot pool the pool holds the states at the
    width of its widest sequence (:class:`~.slots.SlotPool`).

    Attributes:
        mask: the decode attention mask, int64 ``[1, width]`` in fixed mode (one column per
            token in dynamic mode); its ones are the KV slots written so far.
        states: the prefill states until the first :meth:`step` hands them to the decoder.
        decoder: the backend's decoder (None before the first step).
        timings: vision, prefill and decode times of this generation.
        token_ids: the prompt's tokens and every token fed by :meth:`step` since.
        snapshots: the snapshots the chunked prefill kept at ``snapshot_at``.

    Raises (constructor):
        ValueError: a mask that breaks the checks above (see :func:`~.masks.prepare_decode_mask`),
            ``states`` whose KV width is not the capacity (with KV tiers: one of them), both ``states`` and
            ``start``, or a
            ``start`` that is not a prefix of the prompt.
        ContractError: the prefill graph is missing or disagrees with the manifest; a ``start``
            of another export or capacity, or on an export without prefill chunks; no ``pool`` on an
            export of several decode slots.
        NoFreeSlot: every slot of ``pool`` is held.
    """

    def __init__(
        self,
        backend: Backend,
        prompt: PreparedPrompt,
        states: dict[str, Any] | None = None,
        start: StateSnapshot | None = None,
        snapshot_at: tuple[int, ...] = (),
        image_digests: tuple[str, ...] | None = None,
        pool: SlotPool | None = None,
    ):
        self.backend, self.prompt = backend, prompt
        if pool is None and backend.contract.slots > 1:
            raise ContractError(
                f"the export has {backend.contract.slots} decode slots: its generations run in a SlotPool "
                "(Pipeline.generation makes one)"
            )
        if pool is not None and states is not None:
            raise ValueError("a generation in a slot pool prefills itself: give it no prefill states")
        self.pool, self.slot = pool, None
        self._prefilling = False
        self._prefilled = states is not None
        if image_digests is not None:  # computed by the caller already
            self.__dict__["image_digests"] = tuple(image_digests)
        contract = self.contract
        self.chunked = bool(contract.prefill_chunks) and states is None
        if start is not None and states is not None:
            raise ValueError("give a generation prefill states or a state snapshot to start from, not both")
        if start is not None and not self.chunked:
            raise ContractError(
                "continuing from a state snapshot needs an export with prefill chunks (--prefill-chunks)"
            )
        self.start, self.snapshot_at = start, tuple(int(p) for p in snapshot_at)
        self.snapshots: list[StateSnapshot] = []
        self.max_chunk_tokens: int | None = None
        """The largest chunk the chunked prefill may run (None: any of the export's; the smallest where none
        is that small); read when the prefill's first run starts (a scheduler bounds what others wait)."""
        self.next_run_tokens: int | None = None
        """Between two runs of :meth:`prefill_runs`: the positions the next one prefills through a chunk graph
        (0: none; None: not planned yet)."""
        self.chunk_observer: Callable[[int, int, np.ndarray | None], None] | None = None
        """Set before the prefill (speculative decoding's MTP head): called after each prefill chunk with its first
        position, its real tokens and their hidden states ``[real, hidden]`` fp32, and with None for a prompt token
        fed through a decode step (whose hidden state no graph returns); the chunk plan then avoids decode steps
        where a chunk fits."""
        self._verified: tuple | None = None  # the last verify run, until commit
        self._verify_buffers: list = []
        self._verify_parity = 0  # the buffers the next verify run writes (not the ones the states point into)
        self.bucket = prompt.bucket if contract.prefill_buckets and not self.chunked else None
        if states is None and not self.chunked:
            backend.load_prefill(self.bucket)
        self._inputs = prompt.padded(contract.pad_token_id)
        # fixed KV: the smallest KV tier that holds the prompt (its bucket), the capacity with one tier
        width = contract.prefill_kv_width(prompt.bucket) if contract.kv_mode == KvMode.FIXED else prompt.bucket
        self.mask = prepare_decode_mask(self._inputs[1], width, width)
        self.tier_moves = 0
        """Moves of this generation's KV cache to a wider tier (:meth:`_move_to`)."""
        if start is not None:
            start.check_export(backend.export_id, contract.capacity)
            if not start.is_prefix_of(prompt.input_ids[0], self.image_digests):
                raise ValueError(
                    f"the state snapshot of {start.length} tokens is not a prefix of this prompt of "
                    f"{prompt.prompt_len} tokens (other tokens or images)"
                )
        self.token_ids: list[int] = [int(t) for t in prompt.input_ids[0]]
        self.states: dict[str, Any] | None = None
        self.prompt_form = True
        """:attr:`states` are the prompt graphs' (a prefill's or the chunks': the KV cache in the contract's
        ``prompt_kv_dtype``) rather than the decode graphs' (its ``kv_precision``): see :meth:`_decode_form`."""
        self.decoder: Decoder | None = None
        self.timings = Timings()
        if states is not None:
            self._take(states)
        if pool is not None:
            self.slot = pool.acquire(self)

    def close(self) -> None:
        """Release the generation's decode slot (a generation in a slot pool; idempotent). Its states are
        gone after this: take a :meth:`snapshot` first to keep them."""
        if self.pool is not None and self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None

    @functools.cached_property
    def image_digests(self) -> tuple[str, ...]:
        """:func:`~.snapshots.image_digests` of the prompt's images."""
        return image_digests(self.prompt.pixel_values, self.prompt.image_grids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the state snapshot this generation started from (0 without one)."""
        return self.start.length if self.start is not None else 0

    @property
    def contract(self) -> ShapeContract:
        return self.backend.contract

    @property
    def width(self) -> int:
        """The KV width (tokens) of the mask and the states: in fixed mode the capacity or the KV tier the
        generation is at."""
        return int(self.mask.shape[1])

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step's write: ``sum(mask)`` (the prompt's length
        before the first step)."""
        return int(self.mask.sum())

    def run_vision(self, from_token: int = 0) -> np.ndarray:
        """The vision graph of each image's grid once per image of the prompt; returns the embeddings
        stacked in prompt order and zero-padded to the prefill's ``[n_image_rows, image_embed_dim]`` fp32 (all zeros
        for a text-only prompt). Images whose tokens all lie before ``from_token`` (already in the state a
        chunked prefill starts from) are not run: their rows stay zero.

        Raises:
            ValueError: the number of image embeddings differs from the image tokens of the prompt.
        """
        c, prompt = self.contract, self.prompt
        image_pos = np.flatnonzero(prompt.input_ids[0] == c.image_token_id)
        n_tokens = int(image_pos.size)
        rows = np.zeros((max(c.n_image_rows, n_tokens), c.image_embed_dim), dtype=np.float32)
        if prompt.pixel_values is None:
            if n_tokens:
                raise ValueError(f"the prompt has {n_tokens} image tokens but no image was given")
            return rows
        filled = start = 0
        merge = c.spatial_merge_size**2
        for _, h, w in prompt.image_grids:
            count = h * w // merge
            if filled + count > n_tokens or image_pos[filled + count - 1] >= from_token:
                embeds = self.backend.run_vision((h, w), prompt.pixel_values[start : start + h * w])
                rows[filled : filled + embeds.shape[0]] = embeds
                count = embeds.shape[0]
            filled += count
            start += h * w
        if filled != n_tokens:
            raise ValueError(
                f"vision graph returned {filled} image embeddings but the prompt has {n_tokens} image tokens"
            )
        return rows

    def prefill(self, image_embeds: np.ndarray | None = None) -> np.ndarray:
        """Run the vision graph (unless ``image_embeds`` ``[n_image_rows, image_embed_dim]`` are
        given) and the prefill graph of the prompt's bucket, or the chunk graphs (see
        :meth:`_chunk_runs`); keeps the states and returns the last
        real token's logits ``[V]`` fp32.

        Raises:
            RuntimeError: this generation has prefilled already.
            ContractError: the logits are not finite (corrupt weights).
            ValueError: see :meth:`run_vision`; the prefill's KV width is not the capacity (or one of the KV
                tiers).
        """
        runs = self.prefill_runs(image_embeds)
        while True:
            try:
                next(runs)
            except StopIteration as done:
                return done.value

    def prefill_runs(self, image_embeds: np.ndarray | None = None) -> Iterator[int]:
        """:meth:`prefill` one graph run at a time: a generator that yields after the vision graphs (0) and after
        each prefill chunk (its size in positions), so that a caller can run other work between them (e.g. the
        decode steps of a slot pool's other sequences), and returns the last real token's logits ``[V]`` fp32
        (``StopIteration.value``). Between two runs :attr:`next_run_tokens` is the next chunk's size (0: the
        last run is next but holds no chunk).

        Raises:
            See :meth:`prefill`.
        """
        if self._prefilled:
            raise RuntimeError("this generation has prefilled already; start a new Generation")
        self._prefilled = True
        if self.chunked:
            return (yield from self._chunk_runs(image_embeds))
        start = time.perf_counter()
        if image_embeds is None:
            image_embeds = self.run_vision()
        vision_done = time.perf_counter()
        ids, mask, positions = self._inputs
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "image_embeds": image_embeds}
        logits, states = self.backend.run_prefill(self.bucket, feeds)
        done = time.perf_counter()
        self.timings.vision_ms = 1000 * (vision_done - start) if self.prompt.pixel_values is not None else None
        self.timings.prefill_ms = 1000 * (done - vision_done)
        self._take(states)
        self._enter_slot()
        row = 0 if logits.shape[1] == 1 else self.prompt.prompt_len - 1
        return _finite(logits[0, row], "prefill")

    def _enter_slot(self) -> None:
        """In a slot pool: move the prefilled states into the generation's slot."""
        if self.pool is None:
            return
        if self.slot is None:
            raise RuntimeError("this generation has closed its decode slot")
        self.pool.place(self.slot, self.states, self.length)
        self.states = None

    def _chunk_runs(self, image_embeds: np.ndarray | None) -> Iterator[int]:
        """Chunked prefill (:mod:`.chunks`): from the snapshot :attr:`start` or an empty state, the
        prompt's remaining tokens through the chunk graphs (a snapshot taken at each position of
        :attr:`snapshot_at`) and trailing text tokens through decode steps; yields after the vision
        graphs and after each chunk, returns the logits."""
        c, prompt, backend = self.contract, self.prompt, self.backend
        ids = prompt.input_ids[0]
        begin = time.perf_counter()
        sizes = c.prefill_chunks
        if self.max_chunk_tokens is not None:
            sizes = tuple(n for n in sizes if n <= self.max_chunk_tokens) or (min(sizes),)
        # in a slot pool a trailing decode step of the prompt is a step of every slot: only where no chunk fits
        pooled = self.pool is not None or self.chunk_observer is not None
        step_cost = POOLED_DECODE_STEP_COST if pooled else DECODE_STEP_COST
        pieces, width = self._plan(ids, sizes, step_cost)
        done = self.cached_tokens
        # the states at the KV tier the whole prefill reaches (a snapshot restored into it: it holds the snapshot)
        if self.start is not None:
            states = backend.prompt_states_from_host(self.start.state_arrays(), width=width)
        else:
            states = backend.zero_states(width)
        rows = self.run_vision(done) if image_embeds is None else image_embeds
        self.image_rows = rows  # (the MTP head reads the image embeddings of the prompt's image tokens too)
        vision_done = time.perf_counter()
        chunks = [p.size for p in pieces if p.size > 1]
        if self.prompt.pixel_values is not None:
            self.next_run_tokens = chunks[0] if chunks else 0
            yield 0
        image_pos = np.flatnonzero(ids == c.image_token_id)
        logits = None
        for piece in pieces:
            if piece.size == 1:
                break
            a, real, size = piece.start, piece.real, piece.size
            chunk_ids = np.full((1, size), c.pad_token_id or 0, dtype=np.int64)
            chunk_ids[0, :real] = ids[a : a + real]
            chunk_mask = np.zeros((1, size), dtype=np.int64)
            chunk_mask[0, :real] = 1
            mask = np.zeros((1, width), dtype=np.int64)
            mask[0, : a + real] = 1
            positions = np.zeros((4, 1, size), dtype=np.int64)
            positions[:, :, :real] = prompt.position_ids[:, :, a : a + real]
            embeds = np.zeros((size, c.image_embed_dim), dtype=np.float32)
            k0, k1 = np.searchsorted(image_pos, [a, a + real])
            embeds[: k1 - k0] = rows[k0:k1]
            feeds = {
                "input_ids": chunk_ids,
                "chunk_mask": chunk_mask,
                "attention_mask": mask,
                "position_ids": positions,
                "image_embeds": embeds,
            }
            out, states, hidden = backend.run_chunk(size, feeds, states)
            logits = out[0, 0 if out.shape[1] == 1 else real - 1]
            if self.chunk_observer is not None:
                self.chunk_observer(a, real, None if hidden is None else hidden[0, :real])
            done = piece.end
            if done in self.snapshot_at:
                arrays = backend.states_to_host(states, kv_length=done)
                self.snapshots.append(self._snapshot(arrays, done, prompt_form=True))
            if piece is not pieces[-1]:
                later = [p.size for p in pieces[pieces.index(piece) + 1 :]]
                self.next_run_tokens = later[0] if later[0] > 1 else 0
                yield size
        self.next_run_tokens = None
        self.states = states
        self.mask = np.zeros((1, width), dtype=np.int64)
        self.mask[0, :done] = 1
        self._enter_slot()
        self._prefilling = True
        try:
            for piece in pieces[len(pieces) - sum(p.size == 1 for p in pieces) :]:  # trailing decode steps
                logits = self._step(int(ids[piece.start]))
                if self.chunk_observer is not None:
                    self.chunk_observer(piece.start, 1, None)
        finally:
            self._prefilling = False
            self.chunk_observer = None  # (its owner refers to this generation: no cycle kept past the prefill)
        end = time.perf_counter()
        self.timings = Timings(
            vision_ms=1000 * (vision_done - begin) if prompt.pixel_values is not None else None,
            prefill_ms=1000 * (end - vision_done),
        )
        return _finite(logits, "prefill")

    def _plan(self, ids: np.ndarray, sizes: tuple[int, ...], step_cost: float) -> tuple[list, int]:
        """The chunk plan of the prompt ``ids`` (:func:`~.chunks.plan_chunks`) and the KV tier it runs at: the
        smallest tier that holds the prompt and every chunk's padding, from the snapshot :attr:`start`; where the
        tokens after the snapshot end in an image too close to the capacity for any chunk from there, from the
        prompt's start instead (:attr:`start` dropped).

        Raises:
            PromptTooLongError: no plan fits below the capacity.
        """
        c = self.contract
        tiers = [w for w in c.kv_tiers if w >= self.width]
        while True:
            for width in tiers:
                try:
                    plan = (sizes, width, c.image_token_id, self.snapshot_at)
                    return plan_chunks(ids, self.cached_tokens, *plan, decode_step_cost=step_cost), width
                except PromptTooLongError:
                    if width == c.capacity and self.start is None:
                        raise
            self.start = None

    def _snapshot(self, arrays: dict[str, np.ndarray], length: int, prompt_form: bool = False) -> StateSnapshot:
        """A snapshot of the host state ``arrays`` (``present_*``, the KV cache ``length`` slots wide; ``prompt_form``:
        the prompt graphs' KV dtype, kept in the decode graphs' as every snapshot)."""
        if prompt_form and self.contract.converts_kv:
            arrays = {**arrays, "present_kv_cache": self.backend.kv_codec.to_decode(arrays["present_kv_cache"])}
        return StateSnapshot.take(
            self.backend.export_id,
            self.contract,
            arrays,
            self.token_ids[:length],
            self.image_digests,
            self.image_starts,
            reply=length > self.prompt.prompt_len,
        )

    @functools.cached_property
    def image_starts(self) -> list[int]:
        """The position of each image's first token in the prompt."""
        merge = self.contract.spatial_merge_size**2
        image_pos = np.flatnonzero(self.prompt.input_ids[0] == self.contract.image_token_id)
        starts, count = [], 0
        for t, h, w in self.prompt.image_grids:
            if count < image_pos.size:
                starts.append(int(image_pos[count]))
            count += t * h * w // merge
        return starts

    def snapshot(self) -> StateSnapshot:
        """The state now (after the prefill and every step so far): its :attr:`length` tokens, the
        prompt's and the fed generated ones, as a host :class:`~.snapshots.StateSnapshot`.

        Raises:
            RuntimeError: no prefill yet.
        """
        prompt_form = False
        if self.states is not None:
            arrays = self.backend.states_to_host(self.states, kv_length=self.length)
            prompt_form = self.prompt_form
        elif self.pool is not None and self.slot is not None and self.pool.holders[self.slot] is self:
            arrays = self.pool.read(self.slot, self.length)
        elif self.decoder is not None:
            arrays = self.backend.states_to_host(self.decoder.states(), kv_length=self.length)
        else:
            raise RuntimeError("prefill before taking a snapshot")
        return self._snapshot(arrays, self.length, prompt_form)

    def _take(self, states: dict[str, Any]) -> None:
        """Keep prefill ``states``, after checking that their KV width is the capacity or one of the KV tiers
        (fixed mode); the mask becomes that wide."""
        contract = self.contract
        if contract.kv_mode == KvMode.FIXED:
            kv_width = self.backend.state_shape(states["present_kv_cache"])[3]
            if contract.tiered and kv_width not in contract.kv_tiers:
                raise ValueError(
                    f"prefill KV width {kv_width} is not one of the export's KV tiers "
                    f"{','.join(map(str, contract.kv_tiers))}"
                )
            width = kv_width if contract.tiered else contract.capacity
            self.mask = prepare_decode_mask(self._inputs[1], width, kv_width)
        self.states = states

    def step(self, token: int) -> np.ndarray:
        """Feed ``token`` (the one sampled last) through one decode step: claim its KV slot
        (``next_pos = sum(mask)``, also its text position; mRoPE rows ``next_pos + rope_deltas``)
        and run the decoder; returns the next logits ``[V]`` fp32. The first step builds the
        decoder from the prefill states.

        Raises:
            RuntimeError: no prefill yet.
            CapacityExhausted: the KV cache has no free slot (nothing is run).
            ContractError: the logits are not finite.
        """
        if self.pool is not None:
            return self._step(token)  # (the pool's step records the token)
        logits = self._step(token)
        self.token_ids.append(int(token))
        return logits

    def _step(self, token: int) -> np.ndarray:
        if self.pool is not None:  # a step of the pool with this row alone
            if self.states is not None:
                raise RuntimeError("prefill before the first decode step")
            (result,) = self.pool.step([(self, token)])
            if isinstance(result, Exception):
                raise result
            return result
        if self.decoder is None:
            if self.states is None:
                raise RuntimeError("prefill before the first decode step")
            self._decode_form()
            self.decoder, self.states = self.backend.decoder(self.states), None
        start = time.perf_counter()  # (a move to a wider KV tier counts with the step that needs it)
        next_pos = self._advance()
        logits = self.decoder.step(
            np.array([[token]], dtype=np.int64), self.mask, decode_position_ids(next_pos, self.prompt.rope_deltas)
        )
        self.timings.decode_ms += 1000 * (time.perf_counter() - start)
        self.timings.decode_steps += 1
        return _finite(logits[0, -1], f"decode step {self.timings.decode_steps}")

    def _decode_form(self) -> None:
        """Give :attr:`states` the decode graphs' form (the KV cache converted once from the prompt graphs' dtype to
        the contract's KV precision, :meth:`~.backend.Backend.decode_states`), if they are not in it yet."""
        if self.states is not None and self.prompt_form:
            self.states = self.backend.decode_states(self.states, self.length)
            self.prompt_form = False

    def take_back_states(self) -> None:
        """After decode steps, hold the states again (the decoder's buffers, which it no longer steps): for a
        :meth:`verify` run after them. Nothing happens before the first step.

        Raises:
            RuntimeError: a generation in a slot pool (its states are the pool's).
        """
        if self.pool is not None:
            raise RuntimeError("a generation in a slot pool keeps its states in its slot")
        if self.decoder is not None:
            self.states, self.decoder = self.decoder.states(), None
            self.prompt_form = False

    def verify(self, tokens: list[int], draft_ms: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Speculative decoding's check: feed ``tokens`` (the one sampled last, then the drafts; 2 to
        :attr:`ShapeContract.draft_tokens` + 1 of them) through one run of the verify graph of that size, from the
        states after the prefill or the last :meth:`commit`; returns the logits ``[C, V]`` after each token and the
        hidden states ``[C, hidden]`` (fp32, host). Nothing is kept until :meth:`commit` says how many of the tokens
        to keep (the KV slots of the others are written but not claimed). ``draft_ms``: the time spent drafting
        them, counted with the decode time.

        Raises:
            RuntimeError: no prefill yet, a decode step ran already (its decoder holds the states), or the last
                verify run is not committed.
            CapacityExhausted: fewer than ``len(tokens)`` free KV slots (nothing is run).
            ContractError: the export has no verify graph of that size; the logits are not finite.
        """
        if self.states is None:
            raise RuntimeError(
                "verify continues from the prefill's or the last commit's states: prefill first, and do not mix "
                "decode steps in before it"
            )
        if self._verified is not None:
            raise RuntimeError("commit the last verify run before the next one")
        size, start = len(tokens), self.length
        vocab = self.contract.vocab_size
        if any(isinstance(t, bool) or not 0 <= int(t) < vocab for t in tokens):
            raise ValueError(f"verify tokens {list(tokens)} must be token ids from 0 to {vocab - 1}")
        if start + size > self.contract.capacity:
            raise CapacityExhausted(start + size - 1, self.contract.capacity)
        self._decode_form()
        begin = time.perf_counter()
        self._make_room(start + size)
        moved_ms = 1000 * (time.perf_counter() - begin)  # (a move to a wider KV tier counts with the run)
        mask = self.mask.copy()
        mask[0, start : start + size] = 1
        positions = np.concatenate(
            [decode_position_ids(start + t, self.prompt.rope_deltas) for t in range(size)], axis=2
        )
        if not self._verify_buffers:
            self._verify_buffers = [self.backend.verify_buffers(self.width) for _ in (0, 1)]
        buffers = self._verify_buffers[self._verify_parity]
        feeds = {"input_ids": np.array([tokens], dtype=np.int64), "attention_mask": mask, "position_ids": positions}
        begin = time.perf_counter()
        logits, hidden, result = self.backend.run_verify(size, feeds, self.states, buffers)
        self._verify_parity = 1 - self._verify_parity  # (after the run: the states may point into the other set)
        self.timings.decode_ms += 1000 * (time.perf_counter() - begin) + draft_ms + moved_ms
        self.timings.draft_ms += draft_ms
        self.timings.verify_runs += 1
        self._verified = (result, list(tokens))
        return _finite(logits[0], f"verify run {self.timings.verify_runs}"), hidden[0]

    def commit(self, kept: int) -> None:
        """Keep the first ``kept`` tokens of the last :meth:`verify` run (1 to its size): the states after the
        last of them become the generation's (views of the run's buffers, no copy), their KV slots are claimed
        and they join :attr:`token_ids`; the rest are dropped (their KV slots are written over later).

        Raises:
            RuntimeError: no verify run to commit.
            ValueError: ``kept`` outside 1 .. the run's size.
        """
        if self._verified is None:
            raise RuntimeError("no verify run to commit")
        result, tokens = self._verified
        if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= len(tokens):
            raise ValueError(f"kept {kept!r} must be an integer from 1 to the verify run's {len(tokens)} tokens")
        self._verified = None
        start = self.length
        self.states = self.backend.states_after(result, kept - 1)
        self.prompt_form = False
        self.mask[0, start : start + kept] = 1
        self.token_ids.extend(int(t) for t in tokens[:kept])
        self.timings.decode_steps += kept
        self.timings.drafted += len(tokens) - 1
        self.timings.accepted += kept - 1

    def claim(self) -> int:
        """Claim the KV slot of the token about to be fed (for a batched step: :meth:`~.slots.SlotPool.step`);
        returns its position ``next_pos``.

        Raises:
            CapacityExhausted: no free KV slot (the mask is unchanged).
        """
        return self._advance()

    def stepped(self, token: int, logits: np.ndarray, elapsed_ms: float) -> np.ndarray:
        """Record a batched decode step that fed ``token`` (after :meth:`claim`): its time, and the token
        among :attr:`token_ids` (unless it was one of the prompt's own, fed by the prefill); returns
        ``logits`` ``[V]``.

        Raises:
            ContractError: the logits are not finite.
        """
        self.timings.decode_ms += elapsed_ms
        self.timings.decode_steps += 1
        if not self._prefilling:
            self.token_ids.append(int(token))
        return _finite(logits, f"decode step {self.timings.decode_steps}")

    def _advance(self) -> int:
        """Claim the slot of the token being fed; returns ``next_pos = sum(mask)`` before the
        update, the token's text position. Fixed mode sets the next mask slot (after a move to a wider KV tier
        where the generation's is full); dynamic mode appends a column. Both raise CapacityExhausted at
        capacity."""
        if self.contract.kv_mode == KvMode.FIXED:
            self._make_room(self.length + 1)
            return advance_mask(self.mask)
        next_pos = self.length
        if next_pos >= self.contract.capacity:
            raise CapacityExhausted(next_pos, self.contract.capacity)
        self.mask = np.concatenate([self.mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        return next_pos

    def _make_room(self, slots: int) -> None:
        """Before a run that writes KV slots up to ``slots`` (fixed mode): move to the smallest KV tier that holds
        them where the generation's does not (nothing at the capacity: the caller raises CapacityExhausted)."""
        if self.width < slots <= self.contract.capacity:
            self._move_to(self.contract.tier_for(slots))

    def _move_to(self, width: int) -> None:
        """Hold the generation at the KV tier ``width``: the mask widened, and the states (the decoder's, or those
        held for a verify run) copied once into buffers of that width (:meth:`~.backend.Backend.widen_states`),
        the decoder rebuilt from them; in a slot pool the mask only (the pool holds the states,
        :meth:`~.slots.SlotPool.step` widens them)."""
        length = self.length
        mask = np.zeros((1, width), dtype=np.int64)
        mask[0, :length] = 1
        if self.pool is None and self.decoder is not None:
            self.decoder = self.backend.decoder(self.backend.widen_states(self.decoder.states(), width, length))
        elif self.pool is None and self.states is not None:
            kv_dtype = self.contract.prompt_kv_dtype if self.prompt_form else None  # (their KV cache's dtype)
            self.states = self.backend.widen_states(self.states, width, length, kv_dtype)
            self._verify_buffers, self._verify_parity = [], 0  # (the states point into none of them now)
        self.mask = mask
        self.tier_moves += 1


def _finite(logits: np.ndarray, where: str) -> np.ndarray:
    """``logits`` unchanged; a ContractError if any is NaN or infinite (corrupt weights). Checked
    on the largest and the smallest value (a NaN anywhere makes both NaN): two reductions without a
    temporary, 0.1 ms less per 0.8B step than ``np.isfinite(logits).all()``."""
    if not (np.isfinite(logits.max()) and np.isfinite(logits.min())):
        raise ContractError(
            f"the {where} logits are not finite (NaN or inf): the export's weights are probably corrupt "
            "(re-export the model); the tokens generated so far are in the result"
        )
    return logits
