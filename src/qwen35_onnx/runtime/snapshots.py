"""State snapshots at token positions, and a bounded cache of them (numpy only, no torch).

The Gated DeltaNet state cannot be rewound: after ``n`` tokens it holds all of them. To continue a
prompt that repeats an earlier one's first ``p`` tokens, the runtime keeps the state as it was
after exactly those ``p`` tokens (:class:`StateSnapshot`: conv and recurrent states, and the
first ``p`` KV slots) and prefills only the rest with the chunk graphs. A snapshot is keyed by the
token ids it holds and the images among them (their pixels' digest: image tokens are all the same
id), and by the export it came from.

:class:`SnapshotCache` keeps snapshots up to a byte limit, least recently used dropped first, and
finds the longest kept prefix of a prompt by comparing token ids (never a hash of them alone).

Source: the prefix caching of vLLM (automatic prefix caching) and llama.cpp (``cache_prompt``),
with whole-state snapshots at chosen positions as hybrid models need (vLLM's "mamba prefix
caching" keeps the recurrent state at block boundaries for the same reason).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..contract import DTYPE_BYTES, TEXT_WEIGHTS, ContractError, ShapeContract

__all__ = [
    "SnapshotCache",
    "StateSnapshot",
    "export_fingerprint",
    "image_digests",
    "is_prefix",
    "smallest_snapshot_bytes",
]


def export_fingerprint(root: Path, contract: ShapeContract) -> str:
    """A short id of one export: its contract and the size and modification time of its text
    weights file (a re-export or another checkpoint with the same options gets another id)."""
    digest = hashlib.sha256(contract.to_json().encode())
    for rel in sorted({str(Path(p).parent) for k, p in contract.graphs.items() if not k.startswith("vision")}):
        path = Path(root) / rel / TEXT_WEIGHTS
        if path.is_file():
            stat = path.stat()
            digest.update(f"{rel}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def image_digests(pixel_values: np.ndarray | None, image_grids: Sequence[tuple[int, int, int]]) -> tuple[str, ...]:
    """One digest per image of a prompt: its grid and the bytes of its patches ``[t*h*w, patch_dim]``."""
    digests, row = [], 0
    for grid in image_grids:
        rows = int(np.prod(grid))
        patches = np.ascontiguousarray(pixel_values[row : row + rows])
        digests.append(hashlib.sha256(repr(tuple(grid)).encode() + patches.tobytes()).hexdigest())
        row += rows
    return tuple(digests)


def is_prefix(held_ids: np.ndarray, held_images: Sequence[str], token_ids: np.ndarray, images: Sequence[str]) -> bool:
    """Whether the prompt ``token_ids`` ``[n]`` with the image digests ``images`` starts with exactly the tokens
    ``held_ids`` ``[m]`` and images ``held_images`` of a kept state, and goes on after them (``n > m``)."""
    n = held_ids.shape[0]
    return (
        token_ids.shape[0] > n
        and tuple(images[: len(held_images)]) == tuple(held_images)
        and np.array_equal(token_ids[:n], held_ids)
    )


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """The state of a generation after its first :attr:`length` tokens.

    Attributes:
        export: :func:`export_fingerprint` of the export it came from.
        capacity: that export's capacity (tokens).
        token_ids: ``[length]`` int64, the tokens the state holds.
        images: digests (:func:`image_digests`) of the images whose tokens lie among them.
        conv_states: ``[n_linear, 1, K-1, conv_dim]``; recurrent_states: ``[n_linear, 1, Hv, Dk,
            Dv]`` fp32; kv_cache: ``[2 * n_full, 1, Hkv, length, D]`` (the used slots only).
        reply: taken after generated tokens (a reply), not inside a prompt.
        mtp_kv: speculative decoding's MTP head at that point (where the head followed the generation): its KV
            cache's used slots ``[2, 1, Hkv, b, D]``, one per position ``0 .. b-1`` whose next token it read;
            mtp_hidden: the hidden states ``[length - b, hidden]`` fp32 of the positions after those (the
            target's; the head's own output for a position a plain decode step fed), which the head reads once
            their next tokens are known (the next prompt's). None: no head state (a
            continued speculation starts its head empty there; the tokens are the same, fewer drafts are kept).
    """

    export: str
    capacity: int
    token_ids: np.ndarray
    images: tuple[str, ...]
    conv_states: np.ndarray
    recurrent_states: np.ndarray
    kv_cache: np.ndarray
    reply: bool = False
    mtp_kv: np.ndarray | None = None
    mtp_hidden: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Host bytes the snapshot holds."""
        arrays = (self.token_ids, self.conv_states, self.recurrent_states, self.kv_cache, self.mtp_kv, self.mtp_hidden)
        return sum(a.nbytes for a in arrays if a is not None)

    def with_head_state(self, mtp_kv: np.ndarray, mtp_hidden: np.ndarray) -> StateSnapshot:
        """This snapshot with the MTP head's state (see :attr:`mtp_kv`, :attr:`mtp_hidden`).

        Raises:
            ValueError: shapes that do not add up to this snapshot's length.
        """
        if mtp_kv.ndim != 5 or mtp_hidden.ndim != 2 or mtp_kv.shape[3] + mtp_hidden.shape[0] != self.length:
            raise ValueError(
                f"an MTP head state of {mtp_kv.shape} KV and {mtp_hidden.shape} hidden rows does not cover the "
                f"snapshot's {self.length} tokens"
            )
        return dataclasses.replace(self, mtp_kv=mtp_kv, mtp_hidden=mtp_hidden)

    def check_export(self, export: str, capacity: int) -> None:
        """Raises ContractError when this snapshot is not of the export ``export`` of ``capacity``,
        naming both."""
        if self.capacity != capacity:
            raise ContractError(
                f"the state snapshot was taken on an export of capacity {self.capacity} tokens; this export's "
                f"capacity is {capacity}"
            )
        if self.export != export:
            raise ContractError(
                f"the state snapshot was taken on another export (id {self.export}; this one is {export}): states "
                "continue only on the export that made them"
            )

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The three states as :meth:`~.backend.Backend.states_from_host` takes them (the KV cache's
        used slots; the backend fills the rest with zeros)."""
        return {
            "present_conv_states": self.conv_states,
            "present_recurrent_states": self.recurrent_states,
            "present_kv_cache": self.kv_cache,
        }

    def is_prefix_of(self, token_ids: np.ndarray, images: Sequence[str]) -> bool:
        """Whether the prompt ``token_ids`` ``[n]`` (with the image digests ``images`` in prompt
        order) starts with exactly this snapshot's tokens and images, and goes on after them."""
        return is_prefix(self.token_ids, self.images, token_ids, images)

    @classmethod
    def take(
        cls,
        export: str,
        contract: ShapeContract,
        arrays: dict[str, np.ndarray],
        token_ids: np.ndarray,
        images: Sequence[str],
        image_starts: Sequence[int],
        reply: bool = False,
    ) -> StateSnapshot:
        """A snapshot of host ``arrays`` (``present_*``, as :meth:`~.backend.Backend.states_to_host`
        gives them) after ``token_ids`` ``[length]``; ``images`` the digests of the prompt's images
        and ``image_starts`` the position of each one's first token: the images started among the
        tokens are kept (two images' token runs may touch)."""
        ids = np.array(token_ids, dtype=np.int64).reshape(-1)
        length = ids.shape[0]
        started = sum(1 for start in image_starts if start < length)
        return cls(
            export=export,
            capacity=contract.capacity,
            token_ids=ids,
            images=tuple(images[:started]),
            conv_states=arrays["present_conv_states"],
            recurrent_states=arrays["present_recurrent_states"],
            kv_cache=np.ascontiguousarray(arrays["present_kv_cache"][:, :, :, :length]),
            reply=reply,
        )


def smallest_snapshot_bytes(contract: ShapeContract) -> int:
    """Bytes of the smallest snapshot of ``contract``'s export: its conv and recurrent states, one token of KV
    and that token's id."""
    return (
        int(np.prod(contract.conv_state_shape)) * DTYPE_BYTES[contract.state_dtype("conv_states")]
        + int(np.prod(contract.recurrent_state_shape)) * 4
        + int(np.prod(contract.kv_shape(1))) * DTYPE_BYTES[contract.state_dtype("kv_cache")]
        + 8  # its token id
    )


@dataclass
class SnapshotCache:
    """Snapshots kept up to ``max_bytes`` host bytes, least recently used dropped first; thread-safe.

    Attributes:
        max_bytes: the byte limit (>= one snapshot of the export: :meth:`check_room`).
        hits, misses: lookups that found a kept prefix / found none.
        cached_tokens: tokens not prefilled again thanks to the hits.
    """

    max_bytes: int
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    _items: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"state cache limit must be a positive number of bytes, got {self.max_bytes!r}")

    @property
    def nbytes(self) -> int:
        """Host bytes of the snapshots kept now (at most :attr:`max_bytes`)."""
        return sum(s.nbytes for s in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def check_room(self, contract: ShapeContract) -> None:
        """Raises ValueError when the limit is below the smallest snapshot of ``contract`` (its conv
        and recurrent states and one token of KV), naming both numbers."""
        smallest = smallest_snapshot_bytes(contract)
        if self.max_bytes < smallest:
            raise ValueError(
                f"state cache limit {self.max_bytes} bytes is below one state snapshot of this export "
                f"({smallest} bytes: conv and recurrent states and one token of KV)"
            )

    @staticmethod
    def _key(snapshot: StateSnapshot) -> tuple:
        return (snapshot.export, hashlib.sha256(snapshot.token_ids.tobytes()).digest(), snapshot.images)

    def put(self, snapshot: StateSnapshot) -> bool:
        """Keep ``snapshot`` (replacing one of the same tokens and images), then drop the least
        recently used until the total fits; returns False (nothing kept) when it alone is over the
        limit."""
        if snapshot.nbytes > self.max_bytes:
            return False
        key = self._key(snapshot)
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = snapshot
            total = self.nbytes
            while total > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                total -= dropped.nbytes
        return True

    def longest_prefix(self, export: str, token_ids: np.ndarray, images: Sequence[str]) -> StateSnapshot | None:
        """The kept snapshot of ``export`` with the most tokens that is a strict prefix of the prompt
        ``token_ids`` ``[n]`` with images ``images`` (see :meth:`StateSnapshot.is_prefix_of`); counts
        a hit or a miss."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        with self._lock:
            found = self._find(export, ids, images)
            return self._record(found)

    def _find(self, export: str, ids: np.ndarray, images: Sequence[str]) -> tuple | None:
        """``(key, snapshot)`` of :meth:`longest_prefix` (under the lock; nothing counted)."""
        found = None
        for key, snapshot in self._items.items():
            if key[0] == export and (found is None or snapshot.length > found[1].length):
                if snapshot.is_prefix_of(ids, images):
                    found = (key, snapshot)
        return found

    def _record(self, found: tuple | None) -> StateSnapshot | None:
        """Count the lookup that found ``found`` (:meth:`_find`), mark it most recently used; returns its snapshot
        (under the lock)."""
        if found is None:
            self.misses += 1
            return None
        if found[0] in self._items:
            self._items.move_to_end(found[0])
        self.hits += 1
        self.cached_tokens += found[1].length
        return found[1]

    def flush(self) -> None:
        """Nothing to wait for (a cache in memory; see :class:`~.snapshot_disk.DiskSnapshotCache`)."""

    def close(self) -> None:
        """Nothing to finish (a cache in memory; see :class:`~.snapshot_disk.DiskSnapshotCache`)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """``{'snapshots', 'bytes', 'max_bytes', 'hits', 'misses', 'cached_tokens'}``."""
        with self._lock:
            return {
                "snapshots": len(self._items),
                "bytes": self.nbytes,
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "cached_tokens": self.cached_tokens,
            }
