"""How a prompt is cut into prefill chunks (numpy only, no torch).

An export with ``--prefill-chunks`` has one static chunk graph per size; a prompt of ``n``
tokens, continuing from a state of ``start`` tokens, runs as chunks of those sizes (the last one
right-padded: its padding is masked inside the graph) and, for a few trailing text tokens, decode
steps. :func:`plan_chunks` picks the cheapest such cover by dynamic programming over the tokens
left, with the cost of a chunk of ``C`` tokens taken as ``C + CHUNK_OVERHEAD`` token-equivalents
(the fixed cost of one graph run) and a decode step as :data:`DECODE_STEP_COST`; a chunk must
end at each requested boundary (where a snapshot is taken), and a padded chunk must fit below the
capacity (its padding is written to the free KV slots after the prompt).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..contract import PromptTooLongError

__all__ = ["CHUNK_OVERHEAD", "DECODE_STEP_COST", "Piece", "plan_chunks"]

CHUNK_OVERHEAD = 6
"""Fixed cost of one chunk-graph run, in tokens of prefill work: every run reads every weight once
(measured 0.8B int4, ``--ops ort``, 2 cores: a chunk of C tokens takes about 46 ms + 7.1 ms x C)."""
DECODE_STEP_COST = 6
"""Cost of one decode step in tokens of prefill work (the same measurement: about 40 ms a step)."""


@dataclass(frozen=True)
class Piece:
    """One graph run of a prefill: ``real`` prompt tokens from position ``start`` through the chunk
    graph of ``size`` tokens (``size - real`` of them padding), or with ``size`` 1 one decode step."""

    start: int
    real: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.real


def plan_chunks(
    input_ids: np.ndarray,
    start: int,
    sizes: Sequence[int],
    capacity: int,
    image_token_id: int,
    boundaries: Iterable[int] = (),
    decode_step_cost: float = DECODE_STEP_COST,
) -> list[Piece]:
    """The cheapest runs that prefill ``input_ids[start:]`` (see the module docstring).

    Args:
        input_ids: ``[n]`` the whole prompt's token ids.
        start: tokens already in the state (0 for an empty one), ``< n``.
        sizes: the export's chunk sizes (tokens).
        capacity: KV slots; a chunk from position ``p`` of ``C`` tokens needs ``p + C <= capacity``.
        image_token_id: image tokens cannot go through a decode step (it has no image input).
        boundaries: positions in ``(start, n)`` where a chunk must end (skipped where no chunk can end
            there below the capacity).
        decode_step_cost: the cost of a trailing decode step (default :data:`DECODE_STEP_COST`).

    Returns:
        Pieces in prompt order covering ``[start, n)``; decode steps only at the very end.

    Raises:
        ValueError: ``start`` outside ``[0, n)``.
        PromptTooLongError: the prompt's last tokens fit no chunk below the capacity (they hold an
            image token, so decode steps cannot take them), naming the position and the capacity.
    """
    ids = np.asarray(input_ids).reshape(-1)
    n = int(ids.shape[0])
    if not 0 <= start < n:
        raise ValueError(f"chunked prefill starts at token {start}, outside the prompt's [0, {n})")
    cuts = sorted({int(b) for b in boundaries if start < int(b) < n} | {n})
    pieces: list[Piece] = []
    begin = start
    for end in cuts:
        try:
            pieces += _plan_segment(
                ids, begin, end, sorted(sizes), capacity, image_token_id, decode_step_cost if end == n else None
            )
        except PromptTooLongError:
            if end == n:
                raise
            continue  # no chunk ends exactly here below the capacity: no boundary (no snapshot) here
        begin = end
    return pieces


def _plan_segment(
    ids: np.ndarray,
    begin: int,
    end: int,
    sizes: list[int],
    capacity: int,
    image_token_id: int,
    step_cost: float | None,
) -> list[Piece]:
    """Dynamic programme over the tokens left, ``r``, of the segment ``[begin, end)``: whole chunks
    first, then at most one padded chunk or (``step_cost`` not None, the prompt's end) decode steps of
    that cost each for trailing text."""
    length = end - begin
    # last image token of the segment: decode steps may take only the tokens after it
    images = np.flatnonzero(ids[begin:end] == image_token_id)
    text_tail = length - (int(images[-1]) + 1) if images.size else length
    inf = float("inf")
    best = [0.0] + [inf] * length
    choice: list[tuple[int, int] | None] = [None] * (length + 1)  # (size, real) of the first piece
    for r in range(1, length + 1):
        at = end - r
        for size in sizes:
            if size <= r:
                cost = size + CHUNK_OVERHEAD + best[r - size]
                real = size
            elif at + size <= capacity:
                cost, real = size + CHUNK_OVERHEAD, r
            else:
                continue
            if cost < best[r]:
                best[r], choice[r] = cost, (size, real)
        if step_cost is not None and r <= text_tail and r * step_cost < best[r]:
            best[r], choice[r] = r * step_cost, (1, r)
    if best[length] == inf:
        raise PromptTooLongError(
            f"the prompt's tokens from position {begin} to {end} fit no prefill chunk ({sizes}) below the capacity "
            f"{capacity}, and decode steps cannot take them (an image token among them); export with a larger "
            "--max-seq-len or a smaller chunk size"
        )
    pieces, r = [], length
    while r:
        size, real = choice[r]
        at = end - r
        if size == 1:
            pieces += [Piece(at + i, 1, 1) for i in range(real)]
        else:
            pieces.append(Piece(at, real, size))
        r -= real
    return pieces
