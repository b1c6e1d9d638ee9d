"""Speculative decoding with the checkpoint's own multi-token-prediction (MTP) head (numpy only, no torch).

A round (:meth:`Speculation.round`) drafts ``k`` tokens with the export's MTP graphs, checks the last sampled token
and the drafts in ONE run of the target's verify graph (:meth:`~.generation.Generation.verify`), and decides how
many drafts to keep: greedy keeps the drafts equal to the target's argmax and adds the target's own next token,
so the tokens are exactly plain greedy decoding's; with sampling, standard speculative (rejection) sampling keeps
draft ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` and otherwise draws from ``max(p_i - q_i, 0)``
renormalized, so the tokens follow the target's distribution ``p`` (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"). The caller feeds the round's tokens to its token loop and :meth:`Speculation.commit`
keeps the states after the ones it used (the verify graph returns the states after each position).

The MTP head's input at position ``i`` is the target's hidden state there and the token at ``i + 1`` (vLLM's
MTP proposer): the chunked prefill hands each chunk's hidden states to :meth:`Speculation.observe_chunk`, which
runs the head over the prompt (its own KV cache), and each verify run's hidden states of the kept positions are
run through it at the start of the next round. Draft step ``i > 1`` feeds the head its own output hidden state
with the token it drafted last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..contract import MAX_DRAFT_TOKENS, ContractError
from .positions import decode_position_ids
from .sampling import Sampler

__all__ = ["Drafts", "Speculation", "accept_greedy", "accept_sampled", "check_draft_tokens"]

JUDGED_AFTER_ROUNDS = 8
"""Rounds after which a speculation compares its own rate with plain decoding's and stops where it is slower
(:meth:`Speculation.worth_it`)."""
PLAIN_STEPS = 2
"""Plain decode steps a speculation runs first, the last of them timed (:meth:`Speculation.plain_step`)."""
WARM_ROUNDS = 2
"""First rounds left out of the judgement (they touch the verify buffers' fresh pages)."""


def check_draft_tokens(draft_tokens, export_draft_tokens: int) -> int:
    """``draft_tokens`` (``--draft-tokens``: 0 = off) as an int, checked against what the export verifies.

    Raises:
        ValueError: not an integer from 0 to :data:`~qwen35_onnx.contract.MAX_DRAFT_TOKENS`.
        ContractError: more than the export's verify graphs check (``export --draft-tokens``), naming both; an
            export without MTP graphs.
    """
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer)):
        raise ValueError(f"draft tokens must be an integer from 0 (off) to {MAX_DRAFT_TOKENS}, got {draft_tokens!r}")
    if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens {draft_tokens} must be from 0 (off) to {MAX_DRAFT_TOKENS}")
    if draft_tokens and not export_draft_tokens:
        raise ContractError(
            f"draft tokens {draft_tokens}: this export has no MTP graph to draft with (exported from a checkpoint "
            "without mtp.* tensors, or with --draft-tokens 0); run with --draft-tokens 0"
        )
    if draft_tokens > export_draft_tokens:
        raise ContractError(
            f"draft tokens {draft_tokens} is more than this export verifies ({export_draft_tokens}, its "
            f"--draft-tokens); give at most {export_draft_tokens}"
        )
    return int(draft_tokens)


def accept_greedy(drafts: list[int], logits: np.ndarray) -> list[int]:
    """Greedy acceptance: the drafts equal to the target's argmax after the token before each (``logits [k+1, V]``
    of the verify run), then the target's own token after the last kept one. Returns 1 to ``k + 1`` tokens,
    exactly what plain greedy decoding would emit next."""
    out = []
    for i, draft in enumerate(drafts):
        best = int(np.argmax(logits[i]))
        out.append(best)
        if best != draft:
            return out
    out.append(int(np.argmax(logits[len(drafts)])))
    return out


def accept_sampled(drafts: list[int], draft_probs: list[np.ndarray], logits: np.ndarray, sampler: Sampler) -> list[int]:
    """Speculative (rejection) sampling: draft ``d_i``, drawn from ``q_i`` (``draft_probs[i]``, the sampler's
    distribution of the MTP head's logits), is kept with probability ``min(1, p_i(d_i) / q_i(d_i))`` where ``p_i``
    is the sampler's distribution of the verify run's ``logits[i]``; the first rejected one is replaced by a draw
    from ``max(p_i - q_i, 0)`` renormalized and the round ends; when every draft is kept, one more token is drawn
    from ``p_k``. The tokens follow ``p`` exactly (Leviathan et al. 2023, Theorem 1). Returns 1 to ``k + 1``
    tokens."""
    out = []
    for i, draft in enumerate(drafts):
        p = sampler.probabilities(logits[i])
        q = draft_probs[i]
        if q[draft] > 0 and sampler.rng.random() * q[draft] < p[draft]:
            out.append(draft)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        out.append(sampler.draw(residual / total) if total > 0 else sampler.draw(p))
        return out
    out.append(sampler.draw(sampler.probabilities(logits[len(drafts)])))
    return out


@dataclass
class Drafts:
    """One round's drafts: the tokens, the sampler's distribution of each (for :func:`accept_sampled`; None when
    greedy), and the time the MTP head took (ms)."""

    tokens: list[int]
    probs: list[np.ndarray] | None
    ms: float


@dataclass
class _Backlog:
    """Positions whose target hidden state the MTP head has not read yet: the first position, the hidden rows
    ``[n, hidden]``, and the tokens after each but the last (whose next token the next round brings)."""

    start: int
    hidden: np.ndarray
    next_tokens: list[int] = field(default_factory=list)


class Speculation:
    """Speculative decoding of one :class:`~.generation.Generation` with the export's MTP head, ``draft_tokens``
    (1 to the export's :attr:`~qwen35_onnx.contract.ShapeContract.draft_tokens`) drafts a round. Make it before
    the generation's prefill (it watches the prefill's chunks); then each round is :meth:`round` and
    :meth:`commit`. ``drafter``: replaces the MTP head (called with the last sampled token and the number of
    drafts, it returns the draft tokens; the tests force drafts of a chosen acceptance with it);
    ``forced_acceptance``: for timing only (the bench's fixed acceptance rates on random weights, whose head
    accepts nothing): a round keeps each draft with this probability whatever the target says (up to the first
    dropped one, then the target's own token), so its runs are those of a round at that acceptance while its
    tokens are not the target's.

    Raises (constructor):
        ValueError, ContractError: see :func:`check_draft_tokens`; a generation in a slot pool (speculative
            decoding runs one sequence at a time) or one that has prefilled already.
    """

    def __init__(
        self,
        generation,
        draft_tokens: int,
        drafter: Callable[[int, int], list[int]] | None = None,
        forced_acceptance: float | None = None,
    ):
        contract = generation.contract
        self.draft_tokens = check_draft_tokens(draft_tokens, contract.draft_tokens)
        if not self.draft_tokens:
            raise ValueError("a Speculation drafts at least 1 token a round (0 is off: make none)")
        if generation.pool is not None:
            raise ContractError(
                "speculative decoding runs one sequence at a time, not in a slot pool (the export has "
                f"{contract.slots} decode slots); run with --draft-tokens 0"
            )
        if generation.states is not None or generation.decoder is not None or not generation.chunked:
            raise ValueError("make the Speculation before the generation's prefill (it reads the prompt's chunks)")
        self.generation, self.drafter = generation, drafter
        self.forced_acceptance = forced_acceptance
        self._forced_rng = np.random.default_rng(0)
        backend = generation.backend
        backend.check_speculation()
        self.cache = backend.mtp_cache(generation.width) if drafter is None else None
        backend.graphs.verify(self.draft_tokens + 1)  # load and cross-check every graph a round may run, now
        for size in contract.mtp_sizes if drafter is None else ():
            backend.graphs.mtp(size)
        self.usable = True
        """False once the MTP head lacks a position's hidden state (a prompt token fed by a decode step) or a
        decode step took over the states: the generation goes on with plain decode steps."""
        self._backlog: _Backlog | None = None
        self._round_tokens: list[int] = []
        self.plain_step_ms: float | None = None
        """A plain decode step's time (ms) on this generation, measured by :meth:`plain_step`; None: not
        measured (then no round is judged)."""
        self.plain_steps = 0
        self.rounds = 0
        self.spent_ms = 0.0  # the rounds' time: drafting, verify runs and acceptance
        self.emitted = 0  # the tokens the rounds emitted (the loop took)
        self.stopped_slower: bool = False
        """The speculation stopped itself: its rounds emitted fewer tokens per ms than plain decoding."""
        self._judge = True  # (not with seeded sampling: a seed's tokens must not depend on measured times)
        self._round_ms = 0.0
        self._points: dict[int, _Backlog] = {}  # the head's backlog at the prefill's snapshot points
        self.restored = 0
        """Positions of the MTP head's state taken from the snapshot the generation continues (0: none)."""
        start = generation.start
        self._head_whole = start is None  # the head has read every position from 0 (what a snapshot may keep)
        if self.cache is not None and start is not None and start.mtp_kv is not None:
            b = start.mtp_kv.shape[3]
            self._fit_cache(b)
            self.cache.kv[:, :, :, :b] = start.mtp_kv
            self._backlog = _Backlog(b, start.mtp_hidden.copy())
            self.restored, self._head_whole = start.length, True
        generation.chunk_observer = self.observe_chunk

    # ---- the MTP head ----------------------------------------------------------------------------------
    def observe_chunk(self, start: int, real: int, hidden: np.ndarray | None) -> None:
        """The chunked prefill ran positions ``start .. start + real - 1`` (``hidden [real, hidden]``, None for a
        token fed by a decode step): run the MTP head over every position whose next token is now known."""
        if hidden is None:
            self.usable = False
            return
        if start == 0:  # (a prefill from the first token: the generation dropped the snapshot it was to continue)
            self._backlog, self.restored, self._head_whole = None, 0, True
        if not self.usable or self.cache is None:
            self._backlog = _Backlog(start + real - 1, hidden[-1:].copy())
            return
        ids = self.generation.prompt.input_ids[0]
        if self._backlog is not None and self._backlog.start + len(self._backlog.hidden) == start:
            rows = np.concatenate([self._backlog.hidden, hidden])
            first = self._backlog.start
        else:
            rows, first = hidden, start
        n = len(rows) - 1  # the last row's next token is not known yet
        if n:
            self._run_mtp(first, rows[:n], ids[first + 1 : first + 1 + n])
        self._backlog = _Backlog(first + n, rows[n:].copy())
        if start + real in self.generation.snapshot_at:
            self._points[start + real] = self._backlog

    def with_head_state(self, snapshot):
        """``snapshot`` (a :class:`~.snapshots.StateSnapshot` of this generation) with the MTP head's state at its
        length, where the head followed the generation to there (:meth:`~.snapshots.StateSnapshot.
        with_head_state`: its KV cache's slots of the positions it read, the target's hidden states of the rest),
        else unchanged. A speculation continuing from that snapshot starts its head there instead of empty."""
        if self.cache is None or not self._head_whole:
            return snapshot
        backlog = self._backlog
        if not (self.usable and backlog is not None and backlog.start + len(backlog.hidden) == snapshot.length):
            backlog = self._points.get(snapshot.length)  # a snapshot point of the prefill (those slots stay)
        if backlog is None or backlog.start + len(backlog.hidden) != snapshot.length:
            return snapshot
        kv = np.array(self.cache.kv[:, :, :, : backlog.start])
        return snapshot.with_head_state(kv, np.array(backlog.hidden, dtype=np.float32))

    def _mtp_feeds(self, first: int, hidden: np.ndarray, tokens, size: int) -> dict[str, np.ndarray]:
        """Feeds of the MTP graph of ``size`` positions for positions ``first ..`` (``hidden [n, hidden]``, the
        tokens after each)."""
        generation = self.generation
        c, prompt = generation.contract, generation.prompt
        n = len(hidden)
        ids = np.zeros((1, size), dtype=np.int64)
        ids[0, :n] = tokens
        rows = np.zeros((1, size, c.hidden_size), dtype=np.float32)
        rows[0, :n] = hidden
        chunk_mask = np.zeros((1, size), dtype=np.int64)
        chunk_mask[0, :n] = 1
        self._fit_cache(first + size)
        mask = np.zeros((1, self.cache.width if self.cache is not None else c.capacity), dtype=np.int64)
        mask[0, : first + n] = 1
        positions = np.zeros((4, 1, size), dtype=np.int64)
        for t in range(n):
            p = first + t
            positions[:, :, t] = (
                prompt.position_ids[:, :, p]
                if p < prompt.prompt_len
                else decode_position_ids(p, prompt.rope_deltas)[:, :, 0]
            )
        embeds = np.zeros((size, c.image_embed_dim), dtype=np.float32)
        image_rows = getattr(generation, "image_rows", None)
        if image_rows is not None and prompt.pixel_values is not None:
            # the image tokens among the positions' next tokens: rows by their rank among the prompt's image tokens
            image_pos = np.flatnonzero(prompt.input_ids[0] == c.image_token_id)
            nexts = np.arange(first + 1, first + 1 + n)
            ranks = np.searchsorted(image_pos, nexts)
            hits = (ranks < image_pos.size) & (image_pos[np.minimum(ranks, image_pos.size - 1)] == nexts)
            embeds[: int(hits.sum())] = image_rows[ranks[hits]]
        return {
            "input_ids": ids,
            "hidden_states": rows,
            "chunk_mask": chunk_mask,
            "attention_mask": mask,
            "position_ids": positions,
            "image_embeds": embeds,
        }

    def _fit_cache(self, slots: int) -> None:
        """The MTP head's KV cache follows the generation's KV tier: widened (:meth:`~.draft_buffers.MtpCache.
        widen`) to the generation's tier, or to the smallest one that holds the ``slots`` a run writes."""
        if self.cache is None:
            return
        c = self.generation.contract
        width = c.tier_for(min(max(slots, self.generation.width), c.capacity))
        if width > self.cache.width:
            self.cache.widen(width)

    def _run_mtp(self, first: int, hidden: np.ndarray, tokens) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over positions ``first .. first + n - 1``, in as few runs as its graph sizes allow (each run
        ending within the capacity: size 1 always does); returns the last position's draft logits ``[V]`` and
        output hidden state ``[1, hidden]``."""
        c, backend = self.generation.contract, self.generation.backend
        done, logits, out = 0, None, None
        while done < len(hidden):
            left = len(hidden) - done
            # a run writes its graph's every slot (padding too): the size must end within the capacity
            sizes = [s for s in c.mtp_sizes if first + done + s <= c.capacity]
            size = next((s for s in sizes if s >= left), sizes[-1])
            n = min(left, size)
            feeds = self._mtp_feeds(first + done, hidden[done : done + n], tokens[done : done + n], size)
            logits, out, self.cache = backend.run_mtp(size, feeds, self.cache)
            done += n
        return logits[0, -1], out[0]

    def _draft(self, token: int, k: int, sampler: Sampler) -> Drafts:
        """``k`` drafts after ``token`` (the last sampled one) with the MTP head: its first run reads the backlog
        (the positions the last verify run kept, the last one followed by ``token``), each further one its own
        output hidden state and the token it drafted last."""
        begin = time.perf_counter()
        if self.drafter is not None:
            return Drafts([int(t) for t in self.drafter(token, k)], None, 1000 * (time.perf_counter() - begin))
        backlog = self._backlog
        tokens, probs = [], [] if not sampler.config.greedy else None
        logits, hidden = self._run_mtp(backlog.start, backlog.hidden, [*backlog.next_tokens, token])
        position = backlog.start + len(backlog.hidden)
        for i in range(k):
            if not (np.isfinite(logits.max()) and np.isfinite(logits.min())):
                # a broken head: this round's drafts are rejected like any wrong ones, and no round follows
                logits = np.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
                self.usable = False
            if probs is None:
                draft = int(np.argmax(logits))
            else:
                q = sampler.probabilities(logits)
                draft = sampler.draw(q)
                probs.append(q)
            tokens.append(draft)
            if i + 1 < k:
                feeds = self._mtp_feeds(position, hidden, [draft], 1)
                out_logits, out_hidden, self.cache = self.generation.backend.run_mtp(1, feeds, self.cache)
                logits, hidden, position = out_logits[0, -1], out_hidden[0], position + 1
        return Drafts(tokens, probs, 1000 * (time.perf_counter() - begin))

    # ---- rounds ------------------------------------------------------------------------------------------
    @property
    def measuring(self) -> bool:
        """The next token goes through a plain decode step that times one (:meth:`plain_step`): the first
        :data:`PLAIN_STEPS` tokens after the prefill, where the capacity leaves room for rounds after them."""
        if not self.usable or self.plain_steps >= PLAIN_STEPS:
            return False
        generation = self.generation
        room = generation.contract.capacity - generation.length - 1
        return room > PLAIN_STEPS - self.plain_steps

    def plain_step(self, token: int) -> np.ndarray:
        """Feed ``token`` through a plain decode step and return its logits ``[V]`` (a copy); the last of
        :data:`PLAIN_STEPS` sets :attr:`plain_step_ms` (the first builds the decoder) and takes the states back
        for the rounds. The MTP head reads each position fed this way with the model's hidden state where it has
        it, else with its own output there (the decode graph returns no hidden state), as a draft step does."""
        generation = self.generation
        began = time.perf_counter()
        logits = np.array(generation.step(token))
        self.plain_steps += 1
        if self.plain_steps == PLAIN_STEPS:
            self.plain_step_ms = 1000 * (time.perf_counter() - began)  # as a round is timed: the whole call
            generation.take_back_states()
        backlog = self._backlog
        if backlog is not None and self.cache is not None:
            _, out = self._run_mtp(backlog.start, backlog.hidden, [*backlog.next_tokens, token])
            self._backlog = _Backlog(generation.length - 1, out.astype(np.float32))
        elif backlog is not None:
            self._backlog = _Backlog(generation.length - 1, backlog.hidden[-1:])
        return logits

    def worth_it(self) -> bool:
        """Whether rounds should go on: after :data:`WARM_ROUNDS` + :data:`JUDGED_AFTER_ROUNDS` rounds, the judged
        rounds' tokens per ms (each :meth:`round` call: drafting, the verify run and acceptance) against one token
        per :attr:`plain_step_ms` (a whole plain step call); a slower speculation stops for the rest of the
        generation (:attr:`stopped_slower`). Never with seeded sampling (its tokens must not depend on measured
        times); with greedy decoding on an int4 export, where a verify run rounds differently from a decode step,
        the tokens after the point where it stops may differ between runs. The rule follows ``bench --speculative``:
        a round of k drafts at acceptance a emits ``1 + a + ... + a^k`` tokens for one verify run of k + 1 tokens
        and the head's runs, which on a CPU where several rows cost nearly as many single rows never pays."""
        judged = WARM_ROUNDS + JUDGED_AFTER_ROUNDS
        if self.plain_step_ms is None or self.rounds < judged or self.stopped_slower or not self._judge:
            return not self.stopped_slower
        if self.emitted / self.spent_ms < 1.0 / self.plain_step_ms:
            self.stopped_slower = True
            self.usable = False
        return not self.stopped_slower

    def drafts_for(self) -> int:
        """The drafts the next round verifies: :attr:`draft_tokens`; 0 where no round can run (the generation goes
        on with decode steps), which includes the last tokens before the capacity, where the KV cache has no room
        for the token and all its drafts (a verify run writes the slots of them all; one verify graph, of
        ``draft_tokens + 1`` tokens, is all a speculation loads: on OpenVINO each compiled graph holds its own
        weights)."""
        generation = self.generation
        if not self.usable or generation.states is None:
            return 0
        room = generation.contract.capacity - generation.length - 1
        return self.draft_tokens if room >= self.draft_tokens else 0

    def round(self, token: int, sampler: Sampler) -> list[int]:
        """One round after ``token`` (the last sampled token, not yet fed): draft, verify, accept. Returns the
        tokens the target emits next (1 to k + 1: the kept drafts and the target's own token after them); feed
        them to the token loop, then :meth:`commit` how many of them it used.

        Raises:
            RuntimeError: no round can run (:meth:`drafts_for` is 0) or the last round is not committed.
        """
        k = self.drafts_for()
        if k < 1:
            raise RuntimeError("no speculative round can run now (see drafts_for): feed the token with a decode step")
        began = time.perf_counter()
        drafts = self._draft(token, k, sampler)
        fed = [int(token), *drafts.tokens]
        logits, hidden = self.generation.verify(fed, drafts.ms)
        self._round_tokens, self._round_hidden = fed, hidden
        self._judge = not (sampler.config.seed is not None and not sampler.config.greedy)
        try:
            return self._accept(drafts, logits, sampler)
        finally:
            self._round_ms = 1000 * (time.perf_counter() - began)

    def _accept(self, drafts: Drafts, logits: np.ndarray, sampler: Sampler) -> list[int]:
        """The tokens a round emits from its drafts and the verify run's ``logits [k+1, V]``."""
        if self.forced_acceptance is not None:
            kept = 0
            while kept < len(drafts.tokens) and self._forced_rng.random() < self.forced_acceptance:
                kept += 1
            return [*drafts.tokens[:kept], int(np.argmax(logits[kept]))]
        if drafts.probs is None:
            return (
                accept_greedy(drafts.tokens, logits)
                if sampler.config.greedy
                else self._sample_forced(drafts, logits, sampler)
            )
        return accept_sampled(drafts.tokens, drafts.probs, logits, sampler)

    @staticmethod
    def _sample_forced(drafts: Drafts, logits: np.ndarray, sampler: Sampler) -> list[int]:
        """Sampling with drafts of a drafter that gives no distribution (deterministic drafts: ``q`` is all mass on
        the draft)."""
        probs = []
        for draft in drafts.tokens:
            q = np.zeros(logits.shape[-1], dtype=np.float64)
            q[draft] = 1.0
            probs.append(q)
        return accept_sampled(drafts.tokens, probs, logits, sampler)

    def commit(self, used: int) -> None:
        """Keep the states after the first ``used`` fed tokens of the round (``used`` = the emitted tokens the token
        loop took: the last sampled token and the kept drafts before the one it took last), and queue their hidden
        states for the MTP head's next run."""
        self.generation.commit(used)
        self.rounds += 1
        if self.rounds > WARM_ROUNDS:  # (the first rounds touch the verify buffers' fresh pages)
            self.spent_ms += self._round_ms
            self.emitted += used
        fed = self._round_tokens
        start = self.generation.length - used
        self._backlog = _Backlog(start, self._round_hidden[:used].copy(), fed[1:used])

    def stop(self) -> None:
        """No more rounds (the generation goes on with decode steps)."""
        self.usable = False
