"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling (numpy only).

Sampling follows transformers' logits processors in order (temperature, then top-k, then
top-p; Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020, for
top-p). Temperature 0 means greedy (``argmax``, first index on ties, as ``torch.argmax``).
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..options import option


@dataclass(frozen=True)
class SamplingConfig:
    """temperature >= 0 (0 = greedy); top_k >= 0 (0 = off); 0 < top_p <= 1; seed: int or None."""

    temperature: float = option(0.0, "--temperature", "0 = greedy.")
    top_k: int = option(0, "--top-k", "Keep the k most likely tokens (0 = off).")
    top_p: float = option(1.0, "--top-p", "Nucleus sampling mass in (0, 1].")
    seed: int | None = option(None, "--seed", "Sampling seed (same seed, same text).")

    def validate(self) -> None:
        """Raises ValueError naming the parameter and its allowed range."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0
        ):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks the next token id from logits ``[V]`` (any float dtype)."""

    def __init__(self, config: SamplingConfig):
        config.validate()
        self.config = config
        self.rng = np.random.default_rng(None if config.seed is None else int(config.seed))

    def __call__(self, logits: np.ndarray) -> int:
        if self.config.greedy:  # no copy on the hot path
            return int(np.argmax(logits))
        return self.draw(self.probabilities(logits))

    def draw(self, probs: np.ndarray) -> int:
        """A token id drawn from the distribution ``probs [V]`` (float64, summing to 1) with this sampler's
        random generator."""
        return int(self.rng.choice(probs.size, p=probs))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution this sampler draws from for ``logits [V]``: softmax at the temperature, then top-k and
        top-p, renormalized (float64 ``[V]``); greedy: all mass on the argmax."""
        if self.config.greedy:
            probs = np.zeros(np.asarray(logits).size, dtype=np.float64)
            probs[int(np.argmax(logits))] = 1.0
            return probs
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        # shift before dividing, so that a tiny temperature cannot overflow to inf - inf
        with np.errstate(over="ignore"):
            scores = (logits - logits.max()) / self.config.temperature
        if self.config.top_k and self.config.top_k < scores.size:
            kth = np.partition(scores, -self.config.top_k)[-self.config.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores)
        probs /= probs.sum()
        if self.config.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = cumulative - probs[order] < self.config.top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return probs


class StopStrings:
    """Stop-string criterion over streamed text.

    Text pieces go in; what comes out is safe to show: text that cannot be the start of a
    stop string is released, the rest is held back until it either completes a stop string
    (then generation stops and the stop string and anything after it are dropped) or
    diverges. Matching follows transformers' ``StopStringCriteria`` semantics on decoded text.
    """

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (the earliest in it)

    def feed(self, piece: str) -> str:
        """Add ``piece``; returns the text now safe to emit. Sets :attr:`stopped` (and :attr:`matched`, the stop
        string) on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        hits = [(i, s) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            self.stopped = True
            out, self.pending = self.pending[:at], ""
            return out
        keep = 0  # longest suffix of pending that is a proper prefix of some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(stop[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """Release whatever is held back (generation ended without a match)."""
        out, self.pending = self.pending, ""
        return out


def sampling_defaults(export_dir: str | os.PathLike) -> SamplingConfig:
    """Default sampling of an export, from its ``generation_config.json`` by transformers'
    ``GenerationConfig`` rule: ``do_sample`` false or absent (or no file) -> greedy; otherwise its
    ``temperature`` (1.0 when absent), ``top_p`` (1.0) and ``top_k`` (off). Requests override each
    value. (vLLM takes the values whatever ``do_sample`` says; transformers is the reference here.)

    Raises:
        ValueError: the file is not JSON or holds values out of range.
    """
    path = Path(export_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingConfig()
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not config.get("do_sample"):
        return SamplingConfig()

    def value(name, default):
        got = config.get(name)
        return default if got is None else got

    sampling = SamplingConfig(temperature=value("temperature", 1.0), top_p=value("top_p", 1.0), top_k=value("top_k", 0))
    try:
        sampling.validate()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return sampling
