"""The fixed-width attention mask of the decode loop (numpy only, no torch).

The decode graph has one constant mask width, the *capacity* (== the token axis of
the fixed KV cache). The host keeps the mask as an int64 array ``[1, capacity]``
whose ones form a contiguous prefix: slot ``i`` is 1 once token ``i`` has been
written to the KV cache. Inside the decode graph the write slot of the new token is
``sum(mask) - 1``, so the host must set exactly one new slot per step, right after
the prefix. This module does the two host-side halves of that contract:

* :func:`prepare_decode_mask` validates the prompt mask once, after prefill, and
  zero-pads it to capacity;
* :func:`advance_mask` claims the next slot before every decode step.

Source: the fixed-capacity decode flow of the reference system
(``/work/shared/reference/reference-system.md``, "Inference side"); the padded
mask plays the role of the growing ``attention_mask`` that transformers'
``GenerationMixin._update_model_kwargs_for_generation`` (transformers/generation/
utils.py) extends by one column per generated token.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CapacityExhausted", "advance_mask", "prepare_decode_mask"]


class CapacityExhausted(ValueError):
    """The fixed KV cache has no free slot left for another token.

    Attributes:
        next_pos: the slot the next token would have needed (== ``sum(mask)``).
        capacity: the mask / KV cache width.
    """

    def __init__(self, next_pos: int, capacity: int) -> None:
        self.next_pos = next_pos
        self.capacity = capacity
        super().__init__(
            f"KV cache capacity exhausted: the next token needs slot {next_pos} but capacity is "
            f"{capacity} (slots 0..{capacity - 1}); export with a larger --max-seq-len or generate "
            f"fewer tokens"
        )


def prepare_decode_mask(prompt_mask: np.ndarray, capacity: int, prefill_kv_width: int) -> np.ndarray:
    """Validate the prompt's attention mask and zero-pad it to the decode capacity.

    Checks run in this order; each failure raises ``ValueError`` naming the offending
    value and the limit:

    1. the mask is 2-D ``[batch, S]`` with batch == 1;
    2. the prompt length ``S`` is <= ``capacity``;
    3. ``prefill_kv_width`` (token axis of the prefill graph's ``present_kv_cache``)
       equals ``capacity`` (token axis of the decode graph's mask / KV cache) --
       different values mean the two graphs were exported with different
       ``--max-seq-len``;
    4. values are only 0 and 1 (bool, integer or float dtype);
    5. the ones form a contiguous prefix: at least one 1, and no 1 after a 0.

    Args:
        prompt_mask: ``[1, S]`` attention mask of the prefill call (any bool / integer /
            float dtype); trailing zeros (padding of a prefill bucket) are allowed.
        capacity: decode capacity in tokens (> 0).
        prefill_kv_width: KV token-axis width produced by prefill, in tokens.

    Returns:
        A new int64 array ``[1, capacity]``: ``prompt_mask`` followed by zeros.
        ``prompt_mask`` itself is not modified.

    Raises:
        ValueError: any of the checks above fails, or ``capacity`` is not a positive int.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    mask = np.asarray(prompt_mask)
    if mask.ndim != 2:
        raise ValueError(f"attention mask must be 2-D [batch, seq], got {mask.ndim}-D with shape {mask.shape}")
    if mask.shape[0] != 1:
        raise ValueError(f"attention mask batch is {mask.shape[0]}, but only batch 1 is supported")
    length = mask.shape[1]
    if length > capacity:
        raise ValueError(f"prompt length {length} exceeds the decode capacity {capacity}")
    if prefill_kv_width != capacity:
        raise ValueError(
            f"prefill KV width {prefill_kv_width} != decode capacity {capacity}: the prefill and "
            f"decode graphs were exported with different --max-seq-len"
        )
    if mask.dtype.kind not in "biuf":
        raise ValueError(f"attention mask must hold 0/1 numbers, got dtype {mask.dtype}")

    row = mask[0]
    bad = np.flatnonzero((row != 0) & (row != 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"attention mask values must be 0 or 1, got {row[i]!r} at position {i}")
    ones = row == 1
    n_ones = int(ones.sum())
    if n_ones == 0:
        raise ValueError(f"attention mask has no 1 among its {length} positions; need at least 1")
    if not ones[:n_ones].all():
        first_zero = int(np.argmin(ones))
        late_one = first_zero + int(np.argmax(ones[first_zero:]))
        raise ValueError(
            f"attention mask must be a contiguous prefix of ones, but position {late_one} is 1 "
            f"after a 0 at position {first_zero}"
        )

    padded = np.zeros((1, capacity), dtype=np.int64)
    padded[0, :length] = ones
    return padded


def advance_mask(mask: np.ndarray) -> int:
    """Claim the next slot of the fixed-width mask for the token about to be decoded.

    ``next_pos = int(mask.sum())`` is both the KV slot the decode graph will write
    (the graph computes ``sum(mask) - 1`` after this update) and the new token's text
    position (row 0 of its position ids, see ``positions.decode_position_ids``).

    Args:
        mask: int64 ``[1, capacity]`` from :func:`prepare_decode_mask` (or a previous
            :func:`advance_mask`); modified in place.

    Returns:
        ``next_pos`` (Python int), the slot just set to 1.

    Raises:
        ValueError: ``mask`` is not 2-D with batch 1.
        CapacityExhausted: ``next_pos >= capacity``; the mask is left unchanged.
    """
    if mask.ndim != 2 or mask.shape[0] != 1:
        raise ValueError(f"attention mask must have shape [1, capacity], got {mask.shape}")
    capacity = mask.shape[1]
    next_pos = int(mask.sum())
    if next_pos >= capacity:
        raise CapacityExhausted(next_pos, capacity)
    mask[0, next_pos] = 1
    return next_pos
