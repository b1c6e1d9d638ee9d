"""``Pipeline.from_exported(dir)``: the one object users hold (no torch).

image + prompt -> preprocess -> vision -> prefill -> decode loop -> streamed text.

Example::

    from qwen35_onnx.pipeline import Pipeline

    pipe = Pipeline.from_exported("out/")
    stream = pipe.stream("photo.jpg", "Describe this image.", max_new_tokens=64)
    for piece in stream:
        print(piece, end="", flush=True)
    print(stream.result.finish_reason, stream.result.timings.decode_ms_per_token)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from .contract import ContractError, ShapeContract, read_manifest
from .runtime.masks import CapacityExhausted, advance_mask, prepare_decode_mask
from .runtime.positions import decode_position_ids, mrope_position_ids
from .runtime.preprocess import Preprocessor, load_image
from .runtime.sampling import Sampler, SamplingConfig
from .runtime.sessions import GraphSession, load_sessions
from .runtime.state import BoundDecoder, HostDecoder

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Timings:
    """Wall-clock times in milliseconds; ``decode_steps`` counts decode-graph runs."""

    vision_ms: float = 0.0
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
        return (
            f"vision {self.vision_ms:.1f} ms | prefill {self.prefill_ms:.1f} ms | "
            f"decode {self.decode_ms_per_token:.2f} ms/token over {self.decode_steps} steps | "
            f"{self.tokens_per_s:.1f} tokens/s"
        )


@dataclass
class GenerationResult:
    """Outcome of one generation: ``token_ids`` are the new tokens (an end-of-sequence id
    that stopped generation included), ``text`` their decoded text (special tokens skipped),
    ``finish_reason`` 'stop' or 'length', ``prompt_tokens`` the prompt length in tokens."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass
class PreparedPrompt:
    """Host-side inputs of one request: ids ``[1, S]``, pixel values ``[n_patches, patch_dim]``,
    position ids ``[4, 1, S]`` and ``rope_deltas``."""

    input_ids: np.ndarray
    pixel_values: np.ndarray
    position_ids: np.ndarray
    rope_deltas: int


class GenerationStream:
    """Iterate to receive text pieces as tokens are produced; ``result`` is set at the end.

    Nothing is lost: when generation stops early (end of sequence, ``max_new_tokens`` or
    capacity) ``result`` holds every token produced.
    """

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self._pieces


class Pipeline:
    """Exported graphs + preprocessing + decode loop.

    Args:
        root: the export folder (``manifest.json``, ``vision/``, ``prefill/``, ``decode/`` and
            the tokenizer/processor files).
        contract: the manifest's contract.
        sessions: loaded and cross-checked graphs.
        device: 'cpu' or 'cuda'.
        host_state_roundtrip: copy the states to host between decode steps instead of
            keeping them in bound OrtValues (slower; for comparison).
    """

    def __init__(self, root: Path, contract: ShapeContract, sessions: dict[str, GraphSession],
                 preprocessor: Preprocessor, device: str = "cpu", host_state_roundtrip: bool = False):
        self.root = root
        self.contract = contract
        self.sessions = sessions
        self.preprocessor = preprocessor
        self.device = device
        self.host_state_roundtrip = host_state_roundtrip

    @classmethod
    def from_exported(cls, path: str | os.PathLike, device: str = "cpu", host_state_roundtrip: bool = False,
                      threads: int = 0) -> "Pipeline":
        """Load an export folder and cross-check manifest, graph metadata and graph shapes.

        Raises:
            ContractError: incomplete export, or graphs that disagree with the manifest or
                with each other (e.g. different capacities).
            ValueError: unknown device.
        """
        root = Path(path)
        contract = read_manifest(root)
        sessions = load_sessions(root, contract, device=device, threads=threads)
        preprocessor = Preprocessor.from_pretrained(root, contract.image_size, contract.image_token_id)
        return cls(root, contract, sessions, preprocessor, device, host_state_roundtrip)

    # ---- host-side preparation -----------------------------------------------------------
    def prepare(self, image: str | os.PathLike | Image.Image, prompt: str) -> PreparedPrompt:
        """Preprocess one request and check it against the contract before any graph runs.

        Raises:
            FileNotFoundError / ValueError: missing or unreadable image.
            ValueError: the prompt is longer than the capacity.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        picture = image if isinstance(image, Image.Image) else load_image(image)
        pixel_values, grid = self.preprocessor.pixel_values(picture.convert("RGB"))
        input_ids = self.preprocessor.encode(prompt, self.contract.n_image_tokens)
        prompt_len = input_ids.shape[1]
        if prompt_len > self.contract.capacity:
            raise ValueError(
                f"prompt is {prompt_len} tokens (image tokens included), more than the capacity "
                f"{self.contract.capacity} (--max-seq-len of the export)"
            )
        position_ids, rope_deltas = mrope_position_ids(
            input_ids, self.contract.image_token_id, grid, self.contract.spatial_merge_size
        )
        return PreparedPrompt(input_ids, pixel_values, position_ids, int(rope_deltas))

    def padded_prompt(self, prepared: PreparedPrompt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad ids, mask and position ids to a whole number of chunks (prefill lengths
        are multiples of ``chunk_size``; padded positions are masked out exactly)."""
        length = prepared.input_ids.shape[1]
        chunk = self.contract.chunk_size
        padded = -(-length // chunk) * chunk
        pad = padded - length
        pad_id = self.contract.pad_token_id or 0
        ids = np.pad(prepared.input_ids, ((0, 0), (0, pad)), constant_values=pad_id)
        mask = np.zeros((1, padded), dtype=np.int64)
        mask[0, :length] = 1
        positions = np.pad(prepared.position_ids, ((0, 0), (0, 0), (0, pad)))
        return ids, mask, positions

    # ---- graph runs ----------------------------------------------------------------------
    def run_vision(self, pixel_values: np.ndarray, n_image_tokens: int) -> np.ndarray:
        """Vision graph; checks that the embeddings match the prompt's image tokens."""
        (embeds,) = self.sessions["vision"].session.run(None, {"pixel_values": pixel_values})
        if embeds.shape[0] != n_image_tokens:
            raise ValueError(
                f"vision graph returned {embeds.shape[0]} image embeddings but the prompt has "
                f"{n_image_tokens} image tokens"
            )
        return embeds

    def run_prefill(self, ids, mask, positions, image_embeds) -> tuple[np.ndarray, dict]:
        """Prefill graph; returns logits ``[1, S, V]`` (host) and the three states as OrtValues
        (or numpy arrays in host-roundtrip mode)."""
        session = self.sessions["prefill"].session
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "image_embeds": image_embeds}
        names = [o.name for o in session.get_outputs()]
        if self.host_state_roundtrip:
            outputs = dict(zip(names, session.run(None, feeds)))
            return outputs.pop("logits"), outputs
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in names:
            binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        outputs = dict(zip(names, binding.get_outputs()))
        return outputs.pop("logits").numpy(), outputs

    # ---- generation ----------------------------------------------------------------------
    def stream(self, image, prompt: str, max_new_tokens: int = 128,
               sampling: SamplingConfig | None = None) -> GenerationStream:
        """Start a generation; iterate the returned stream for text pieces.

        All input checks (image, prompt length, options) run here, before any graph.

        Raises:
            ValueError: bad ``max_new_tokens`` or sampling options, prompt over capacity,
                unreadable image.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampler = Sampler(sampling or SamplingConfig())
        prepared = self.prepare(image, prompt)
        prompt_len = prepared.input_ids.shape[1]
        room = self.contract.capacity - prompt_len + 1  # the last token needs no KV slot
        if max_new_tokens > room:
            log.warning(
                "prompt (%d tokens) + max_new_tokens (%d) exceeds capacity %d: at most %d new tokens "
                "will be generated (finish reason 'length')", prompt_len, max_new_tokens, self.contract.capacity, room,
            )
        stream = GenerationStream(iter(()))
        stream._pieces = self._generate(prepared, max_new_tokens, sampler, stream)
        return stream

    def generate(self, image, prompt: str, max_new_tokens: int = 128,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        """Run a whole generation and return its result (see :meth:`stream`)."""
        stream = self.stream(image, prompt, max_new_tokens, sampling)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def _generate(self, prepared: PreparedPrompt, max_new_tokens: int, sampler: Sampler,
                  stream: GenerationStream) -> Iterator[str]:
        contract = self.contract
        timings = Timings()
        prompt_len = prepared.input_ids.shape[1]
        tokens: list[int] = []
        finish = FINISH_LENGTH
        streamer = self.preprocessor.text_streamer()
        try:
            t0 = time.perf_counter()
            image_embeds = self.run_vision(prepared.pixel_values, int((prepared.input_ids == contract.image_token_id).sum()))
            t1 = time.perf_counter()
            ids, mask, positions = self.padded_prompt(prepared)
            logits, states = self.run_prefill(ids, mask, positions, image_embeds)
            t2 = time.perf_counter()
            timings.vision_ms, timings.prefill_ms = 1000 * (t1 - t0), 1000 * (t2 - t1)

            if contract.kv_mode == "fixed":
                kv_width = _shape(states["present_kv_cache"])[3]
                decode_mask = prepare_decode_mask(mask, contract.capacity, kv_width)
            else:
                decode_mask = prepare_decode_mask(mask, mask.shape[1], mask.shape[1])
            decoder = (
                HostDecoder(self.sessions["decode"], contract, states)
                if self.host_state_roundtrip
                else BoundDecoder(self.sessions["decode"], contract, states, self.device)
            )
            token = sampler(logits[0, prompt_len - 1])
            while True:
                tokens.append(token)
                piece = streamer.put(token)
                if piece:
                    yield piece
                if token in contract.eos_token_ids:
                    finish = FINISH_STOP
                    break
                if len(tokens) >= max_new_tokens:
                    break
                try:
                    decode_mask, next_pos = self._advance(decode_mask)
                except CapacityExhausted:
                    break
                t3 = time.perf_counter()
                step_logits = decoder.step(
                    np.array([[token]], dtype=np.int64),
                    decode_mask,
                    decode_position_ids(next_pos, prepared.rope_deltas),
                )
                timings.decode_ms += 1000 * (time.perf_counter() - t3)
                timings.decode_steps += 1
                token = sampler(step_logits[0, -1])
            rest = streamer.end()
            if rest:
                yield rest
        finally:
            text = self.preprocessor.tokenizer.decode(tokens, skip_special_tokens=True)
            stream.result = GenerationResult(text, tokens, finish, prompt_len, timings)

    def _advance(self, decode_mask: np.ndarray) -> tuple[np.ndarray, int]:
        """Claim the slot of the token being fed; returns the mask and ``next_pos = sum(mask)``
        before the update, the token's text position. Fixed mode sets the next mask slot;
        dynamic mode appends a column. Both raise CapacityExhausted at capacity."""
        if self.contract.kv_mode == "fixed":
            return decode_mask, advance_mask(decode_mask)
        next_pos = int(decode_mask.sum())
        if next_pos >= self.contract.capacity:
            raise CapacityExhausted(next_pos, self.contract.capacity)
        return np.concatenate([decode_mask, np.ones((1, 1), dtype=np.int64)], axis=1), next_pos


def _shape(value) -> list[int]:
    return list(value.shape()) if isinstance(value, ort.OrtValue) else list(value.shape)


__all__ = ["Pipeline", "GenerationResult", "GenerationStream", "Timings", "SamplingConfig", "ContractError"]
