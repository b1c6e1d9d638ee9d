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
import numbers
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
from .runtime.preprocess import Preprocessor, load_image, to_rgb
from .runtime.sampling import Sampler, SamplingConfig, StopStrings
from .runtime.sessions import GraphSet
from .runtime.state import BoundDecoder, HostDecoder

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


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


@dataclass
class GenerationResult:
    """Outcome of one generation: ``token_ids`` are the new tokens (an end-of-sequence id
    that stopped generation included), ``text`` their decoded text (special tokens skipped),
    ``finish_reason`` 'stop' or 'length' (None while unfinished), ``prompt_tokens`` the
    prompt length in tokens."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass
class PreparedPrompt:
    """Host-side inputs of one request, checked against the contract: ids ``[1, S]`` int64,
    pixel values ``[n_patches, patch_dim]`` fp32 (None for a text-only prompt), position ids
    ``[4, 1, S]`` int64, ``rope_deltas``, and the prefill ``bucket`` (tokens) it will run in."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None
    position_ids: np.ndarray
    rope_deltas: int
    bucket: int

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


class GenerationStream:
    """Iterate to receive text pieces as tokens are produced.

    ``result`` is kept up to date after every token, so nothing is lost: when generation
    ends (end of sequence, stop string, ``max_new_tokens`` or capacity) it holds every token
    with its ``finish_reason``; when the caller stops iterating early it holds the tokens
    produced so far with ``finish_reason`` None (call :meth:`close` to release the states).
    """

    def __init__(self):
        self._pieces: Iterator[str] = iter(())
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        """Stop the generation (its states are released); ``result`` keeps what was produced."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


class Pipeline:
    """Exported graphs + preprocessing + decode loop.

    Args:
        root: the export folder (``manifest.json``, ``vision/``, ``text/`` and
            the tokenizer/processor files).
        contract: the manifest's contract.
        graphs: the loaded, cross-checked graphs.
        preprocessor: tokenizer, chat template and image processor.
        device: 'cpu' or 'cuda'.
        host_state_roundtrip: copy the states to host between decode steps instead of
            keeping them in bound OrtValues (slower; for comparison).
    """

    def __init__(self, root: Path, contract: ShapeContract, graphs: GraphSet, preprocessor: Preprocessor,
                 device: str = "cpu", host_state_roundtrip: bool = False):
        self.root = root
        self.contract = contract
        self.graphs = graphs
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
        graphs = GraphSet(root, contract, device=device, threads=threads)
        preprocessor = Preprocessor.from_pretrained(root, contract.image_size, contract.image_token_id)
        return cls(root, contract, graphs, preprocessor, device, host_state_roundtrip)

    # ---- host-side preparation -----------------------------------------------------------
    def prepare(self, image: str | os.PathLike | Image.Image | None, prompt: str) -> PreparedPrompt:
        """Chat-template and preprocess one request (``image`` None: text only).

        Raises:
            FileNotFoundError / ValueError: missing or unreadable image.
            ValueError: the prompt does not fit the largest prefill bucket / the capacity.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt is not valid Unicode text: {exc}") from None
        pixel_values = None
        if image is not None:
            if isinstance(image, Image.Image):
                picture = to_rgb(image)
            elif isinstance(image, (str, os.PathLike)):
                picture = load_image(image)
            else:
                raise TypeError(f"image must be a file path, a PIL image or None, got {type(image).__name__}")
            pixel_values, _ = self.preprocessor.pixel_values(picture)
        n_image_tokens = self.contract.n_image_tokens if image is not None else 0
        return self.prepare_ids(self.preprocessor.encode(prompt, n_image_tokens), pixel_values)

    def prepare_ids(self, input_ids: np.ndarray, pixel_values: np.ndarray | None = None) -> PreparedPrompt:
        """Check already tokenized input against the contract and compute its positions.

        Args:
            input_ids: int ``[1, S]``; holds ``n_image_tokens`` image tokens iff ``pixel_values``.
            pixel_values: fp32 ``[n_patches, patch_dim]`` or None.

        Raises:
            ValueError: bad shape, token ids outside the vocabulary, image tokens without
                pixels (or the reverse), or a prompt longer than the largest bucket / capacity.
        """
        c = self.contract
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers of shape [1, S] with S >= 1, got {ids.dtype} {ids.shape}")
        low, high = int(ids.min()), int(ids.max())  # Python ints: no wrap-around for uint64
        if low < 0 or high >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size}), got min {low} max {high}")
        ids = ids.astype(np.int64)
        bucket = c.select_bucket(int(ids.shape[1]))
        if pixel_values is not None:
            pixel_values = np.asarray(pixel_values)
            expected = (c.n_patches, c.patch_dim)
            if tuple(pixel_values.shape) != expected or pixel_values.dtype.kind not in "fiu":
                raise ValueError(
                    f"pixel_values must be numbers of shape {expected} (the exported grid), "
                    f"got {pixel_values.dtype} {tuple(pixel_values.shape)}"
                )
            if not np.isfinite(pixel_values).all():
                raise ValueError("pixel_values hold NaN or infinite values")
            pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        grid = c.grid_thw if pixel_values is not None else None
        positions, rope_deltas = mrope_position_ids(ids, c.image_token_id, grid, c.spatial_merge_size)
        return PreparedPrompt(ids, pixel_values, positions, int(rope_deltas), bucket)

    def padded_prompt(self, prepared: PreparedPrompt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad ids, mask and position ids to the prefill bucket; padded positions are
        masked out exactly inside the graph."""
        pad = prepared.bucket - prepared.prompt_len
        pad_id = self.contract.pad_token_id or 0
        ids = np.pad(prepared.input_ids, ((0, 0), (0, pad)), constant_values=pad_id)
        mask = np.zeros((1, prepared.bucket), dtype=np.int64)
        mask[0, : prepared.prompt_len] = 1
        positions = np.pad(prepared.position_ids, ((0, 0), (0, 0), (0, pad)))
        return ids, mask, positions

    # ---- graph runs ----------------------------------------------------------------------
    def run_vision(self, prepared: PreparedPrompt) -> np.ndarray:
        """Vision graph (zeros for a text-only prompt); checks that the number of image
        embeddings equals the number of image tokens in the prompt."""
        c = self.contract
        n_tokens = int((prepared.input_ids == c.image_token_id).sum())
        if prepared.pixel_values is None:
            if n_tokens:
                raise ValueError(f"the prompt has {n_tokens} image tokens but no image was given")
            return np.zeros((c.n_image_tokens, c.image_embed_dim), dtype=np.float32)
        (embeds,) = self.graphs.vision.session.run(None, {"pixel_values": prepared.pixel_values})
        if embeds.shape[0] != n_tokens:
            raise ValueError(
                f"vision graph returned {embeds.shape[0]} image embeddings but the prompt has {n_tokens} image tokens"
            )
        return embeds

    def run_prefill(self, prepared: PreparedPrompt, image_embeds: np.ndarray) -> tuple[np.ndarray, dict]:
        """Prefill graph of the prompt's bucket; returns the last real token's logits ``[V]``
        (host) and the three states as OrtValues (numpy arrays in host-roundtrip mode)."""
        return self._prefill(prepared, self.padded_prompt(prepared), image_embeds)

    def _prefill(self, prepared: PreparedPrompt, padded, image_embeds: np.ndarray) -> tuple[np.ndarray, dict]:
        session = self.graphs.prefill(prepared.bucket if self.contract.prefill_buckets else None).session
        ids, mask, positions = padded
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "image_embeds": image_embeds}
        names = [o.name for o in session.get_outputs()]
        if self.host_state_roundtrip:
            outputs = dict(zip(names, session.run(None, feeds)))
            logits = outputs.pop("logits")
        else:
            binding = session.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name in names:
                binding.bind_output(name, self.device)
            session.run_with_iobinding(binding)
            outputs = dict(zip(names, binding.get_outputs()))
            logits = outputs.pop("logits").numpy()
        row = 0 if logits.shape[1] == 1 else prepared.prompt_len - 1
        return logits[0, row], outputs

    # ---- generation ----------------------------------------------------------------------
    def stream(self, image, prompt: str, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
               stop: tuple[str, ...] | list[str] = ()) -> GenerationStream:
        """Start a generation for ``image`` (path, PIL image or None) and ``prompt``; iterate the
        returned stream for text pieces. All input checks run here, before any graph.

        Raises:
            ValueError / FileNotFoundError: bad ``max_new_tokens``, sampling options or stop
                strings, prompt over the largest bucket or capacity, unreadable image.
        """
        return self.stream_prepared(self.prepare(image, prompt), max_new_tokens, sampling, stop)

    def generate(self, image, prompt: str, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
                 stop: tuple[str, ...] | list[str] = ()) -> GenerationResult:
        """Run a whole generation and return its result (see :meth:`stream`)."""
        return _drain(self.stream(image, prompt, max_new_tokens, sampling, stop))

    def generate_prepared(self, prepared: PreparedPrompt, max_new_tokens: int = 128,
                          sampling: SamplingConfig | None = None, stop=()) -> GenerationResult:
        """:meth:`generate` for input from :meth:`prepare_ids`."""
        return _drain(self.stream_prepared(prepared, max_new_tokens, sampling, stop))

    def stream_prepared(self, prepared: PreparedPrompt, max_new_tokens: int = 128,
                        sampling: SamplingConfig | None = None, stop=()) -> GenerationStream:
        """:meth:`stream` for input from :meth:`prepare` or :meth:`prepare_ids`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}")
        sampler = Sampler(sampling or SamplingConfig())
        stops = StopStrings((stop,) if isinstance(stop, str) else tuple(stop))
        room = self.contract.capacity - prepared.prompt_len + 1  # the last token needs no KV slot
        if max_new_tokens > room:
            log.warning(
                "prompt (%d tokens) + max_new_tokens (%d) exceeds the capacity %d: at most %d new tokens "
                "will be generated (finish reason 'length')",
                prepared.prompt_len, max_new_tokens, self.contract.capacity, room,
            )
        stream = GenerationStream()
        stream.result = GenerationResult("", [], None, prepared.prompt_len)
        stream._pieces = self._generate(prepared, max_new_tokens, sampler, stops, stream)
        return stream

    def _generate(self, prepared: PreparedPrompt, max_new_tokens: int, sampler: Sampler, stops: StopStrings,
                  stream: GenerationStream) -> Iterator[str]:
        contract = self.contract
        timings = Timings()
        tokens: list[int] = []
        emitted: list[str] = []
        finish = None
        streamer = self.preprocessor.text_streamer()
        stream.result = GenerationResult("", tokens, None, prepared.prompt_len, timings)
        rest = ""
        try:
            self.graphs.prefill(prepared.bucket if contract.prefill_buckets else None)  # load + check first
            t0 = time.perf_counter()
            image_embeds = self.run_vision(prepared)
            t1 = time.perf_counter()
            padded = self.padded_prompt(prepared)
            logits, states = self._prefill(prepared, padded, image_embeds)
            t2 = time.perf_counter()
            timings.vision_ms = 1000 * (t1 - t0) if prepared.pixel_values is not None else None
            timings.prefill_ms = 1000 * (t2 - t1)

            prompt_mask = padded[1]
            if contract.kv_mode == "fixed":
                decode_mask = prepare_decode_mask(prompt_mask, contract.capacity, _shape(states["present_kv_cache"])[3])
            else:
                decode_mask = prepare_decode_mask(prompt_mask, prompt_mask.shape[1], prompt_mask.shape[1])
            decoder = (
                HostDecoder(self.graphs.decode, contract, states)
                if self.host_state_roundtrip
                else BoundDecoder(self.graphs.decode, contract, states, self.device)
            )
            token = sampler(_finite(logits, "prefill"))
            while True:
                tokens.append(token)
                piece = stops.feed(streamer.put(token))
                if piece:
                    emitted.append(piece)
                    stream.result.text = "".join(emitted)
                    yield piece
                if stops.stopped or token in contract.eos_token_ids:
                    finish = FINISH_STOP
                    break
                if len(tokens) >= max_new_tokens:
                    finish = FINISH_LENGTH
                    break
                try:
                    decode_mask, next_pos = self._advance(decode_mask)
                except CapacityExhausted:
                    finish = FINISH_LENGTH
                    break
                t3 = time.perf_counter()
                step_logits = decoder.step(
                    np.array([[token]], dtype=np.int64), decode_mask, decode_position_ids(next_pos, prepared.rope_deltas)
                )
                timings.decode_ms += 1000 * (time.perf_counter() - t3)
                timings.decode_steps += 1
                token = sampler(_finite(step_logits[0, -1], f"decode step {timings.decode_steps}"))
            if not stops.stopped:
                rest = stops.feed(streamer.end()) + stops.flush()
                if rest:
                    emitted.append(rest)
        finally:
            stream.result = GenerationResult("".join(emitted), tokens, finish, prepared.prompt_len, timings)
        if rest:  # the held-back tail, yielded once the result is final
            yield rest

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


def _drain(stream: GenerationStream) -> GenerationResult:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


def _finite(logits: np.ndarray, where: str) -> np.ndarray:
    """``logits`` unchanged; a ContractError if any is NaN or infinite (corrupt weights)."""
    if not np.isfinite(logits).all():
        raise ContractError(
            f"the {where} logits are not finite (NaN or inf): the export's weights are probably corrupt "
            "(re-export the model); the tokens generated so far are in the result"
        )
    return logits


def _shape(value) -> list[int]:
    return list(value.shape()) if isinstance(value, ort.OrtValue) else list(value.shape)


__all__ = ["Pipeline", "GenerationResult", "GenerationStream", "PreparedPrompt", "Timings", "SamplingConfig"]
