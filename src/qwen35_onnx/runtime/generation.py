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

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import ContractError, KvMode, ShapeContract
from .backend import Backend, Decoder
from .masks import CapacityExhausted, advance_mask, prepare_decode_mask
from .positions import decode_position_ids
from .prompt import PreparedPrompt

__all__ = ["Generation", "Timings"]


@dataclass
class Timings:
    """Wall-clock times in milliseconds (``vision_ms`` is None for a text-only prompt);
    ``decode_steps`` counts decode-graph runs."""

    vision_ms: float | None = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: decode steps per second of decode time."""
        return 1000.0 * self.decode_steps / self.decode_ms if self.decode_ms else 0.0

    def summary(self) -> str:
        vision = "no image" if self.vision_ms is None else f"{self.vision_ms:.1f} ms"
        return (
            f"vision {vision} | prefill {self.prefill_ms:.1f} ms | "
            f"decode {self.decode_ms_per_token:.2f} ms/token over {self.decode_steps} steps | "
            f"{self.tokens_per_s:.1f} tokens/s"
        )


class Generation:
    """One generation of ``prompt`` on ``backend``: prefill once, then one decode step per token.

    Construction checks the prompt's attention mask (batch 1, 0/1 values, a contiguous prefix;
    before any graph reads it: static compilers do not bound-check the indices a graph derives
    from it) and loads and cross-checks the prefill graph of the prompt's bucket. With ``states``
    (prefill outputs in ``backend``'s form, e.g. of another generation of the same prompt) the
    prefill is taken as done and :meth:`step` continues from them.

    Attributes:
        mask: the decode attention mask, int64 ``[1, capacity]`` in fixed mode (one column per
            token in dynamic mode); its ones are the KV slots written so far.
        states: the prefill states until the first :meth:`step` hands them to the decoder.
        decoder: the backend's decoder (None before the first step).
        timings: vision, prefill and decode times of this generation.

    Raises (constructor):
        ValueError: a mask that breaks the checks above (see :func:`~.masks.prepare_decode_mask`),
            or ``states`` whose KV width is not the capacity.
        ContractError: the prefill graph is missing or disagrees with the manifest.
    """

    def __init__(self, backend: Backend, prompt: PreparedPrompt, states: dict[str, Any] | None = None):
        self.backend, self.prompt = backend, prompt
        contract = self.contract
        self.bucket = prompt.bucket if contract.prefill_buckets else None
        if states is None:
            backend.load_prefill(self.bucket)
        self._inputs = prompt.padded(contract.pad_token_id)
        width = contract.capacity if contract.kv_mode == KvMode.FIXED else prompt.bucket
        self.mask = prepare_decode_mask(self._inputs[1], width, width)
        self.states: dict[str, Any] | None = None
        self.decoder: Decoder | None = None
        self.timings = Timings()
        if states is not None:
            self._take(states)

    @property
    def contract(self) -> ShapeContract:
        return self.backend.contract

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step's write: ``sum(mask)`` (the prompt's length
        before the first step)."""
        return int(self.mask.sum())

    def run_vision(self) -> np.ndarray:
        """The vision graph of each image's grid once per image of the prompt; returns the embeddings
        stacked in prompt order and zero-padded to the prefill's ``[n_image_rows, image_embed_dim]`` fp32 (all zeros
        for a text-only prompt).

        Raises:
            ValueError: the number of image embeddings differs from the image tokens of the prompt.
        """
        c, prompt = self.contract, self.prompt
        n_tokens = int((prompt.input_ids == c.image_token_id).sum())
        rows = np.zeros((c.n_image_rows, c.image_embed_dim), dtype=np.float32)
        if prompt.pixel_values is None:
            if n_tokens:
                raise ValueError(f"the prompt has {n_tokens} image tokens but no image was given")
            return rows
        filled = start = 0
        for _, h, w in prompt.image_grids:
            embeds = self.backend.run_vision((h, w), prompt.pixel_values[start : start + h * w])
            rows[filled : filled + embeds.shape[0]] = embeds
            filled += embeds.shape[0]
            start += h * w
        if filled != n_tokens:
            raise ValueError(
                f"vision graph returned {filled} image embeddings but the prompt has {n_tokens} image tokens"
            )
        return rows

    def prefill(self, image_embeds: np.ndarray | None = None) -> np.ndarray:
        """Run the vision graph (unless ``image_embeds`` ``[n_image_rows, image_embed_dim]`` are
        given) and the prefill graph of the prompt's bucket; keeps the states and returns the last
        real token's logits ``[V]`` fp32.

        Raises:
            RuntimeError: this generation has prefilled already.
            ContractError: the logits are not finite (corrupt weights).
            ValueError: see :meth:`run_vision`; the prefill's KV width is not the capacity.
        """
        if self.states is not None or self.decoder is not None:
            raise RuntimeError("this generation has prefilled already; start a new Generation")
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
        row = 0 if logits.shape[1] == 1 else self.prompt.prompt_len - 1
        return _finite(logits[0, row], "prefill")

    def _take(self, states: dict[str, Any]) -> None:
        """Keep prefill ``states``, after checking that their KV width is the capacity (fixed mode)."""
        contract = self.contract
        if contract.kv_mode == KvMode.FIXED:
            kv_width = self.backend.state_shape(states["present_kv_cache"])[3]
            self.mask = prepare_decode_mask(self._inputs[1], contract.capacity, kv_width)
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
        if self.decoder is None:
            if self.states is None:
                raise RuntimeError("prefill before the first decode step")
            self.decoder, self.states = self.backend.decoder(self.states), None
        next_pos = self._advance()
        start = time.perf_counter()
        logits = self.decoder.step(
            np.array([[token]], dtype=np.int64), self.mask, decode_position_ids(next_pos, self.prompt.rope_deltas)
        )
        self.timings.decode_ms += 1000 * (time.perf_counter() - start)
        self.timings.decode_steps += 1
        return _finite(logits[0, -1], f"decode step {self.timings.decode_steps}")

    def _advance(self) -> int:
        """Claim the slot of the token being fed; returns ``next_pos = sum(mask)`` before the
        update, the token's text position. Fixed mode sets the next mask slot; dynamic mode appends
        a column. Both raise CapacityExhausted at capacity."""
        if self.contract.kv_mode == KvMode.FIXED:
            return advance_mask(self.mask)
        next_pos = self.length
        if next_pos >= self.contract.capacity:
            raise CapacityExhausted(next_pos, self.contract.capacity)
        self.mask = np.concatenate([self.mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        return next_pos


def _finite(logits: np.ndarray, where: str) -> np.ndarray:
    """``logits`` unchanged; a ContractError if any is NaN or infinite (corrupt weights)."""
    if not np.isfinite(logits).all():
        raise ContractError(
            f"the {where} logits are not finite (NaN or inf): the export's weights are probably corrupt "
            "(re-export the model); the tokens generated so far are in the result"
        )
    return logits
