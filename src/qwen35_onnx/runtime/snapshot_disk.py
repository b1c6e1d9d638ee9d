"""Kept states on disk: a :class:`~.snapshots.SnapshotCache` whose snapshots are also kept as files in a folder,
so that a restarted process, or another one on the same folder, continues from them (numpy only, no torch).

``DIR/<export id>/<digest>.state``: one :mod:`.snapshot_files` file per snapshot, in a folder per export
(:func:`~.snapshots.export_fingerprint`: a re-export, another checkpoint or another capacity is another folder, so
its snapshots are never candidates). The memory tier works as before; a snapshot put there is also written to disk
by a background thread (a reply is never held up by a write), unless the same tokens and images are on disk
already. A lookup takes the longest kept prefix of either tier; a snapshot read from disk is checked (its header,
its size, every array's checksum, its export and capacity, its states' shapes against the contract) before it is
returned, its arrays stay a read-only memory map of the file (no copy but the runtime's own), and it is kept in the
memory tier too.

The folder's ``.state`` files (of every export under ``DIR``) are bounded by ``max_disk_bytes``: before a write,
the least recently used files (by modification time, which a hit renews) are removed until the new one fits. A
file that fails a check is ignored with one warning (and never loaded); a failed write (``ENOSPC``: a full disk)
is warned once and costs nothing else: the snapshot stays in memory, the request is served as before.

Source: llama.cpp's server keeps slot states as files (``--slot-save-path``); vLLM's LMCache and SGLang's HiCache
keep prefix caches on a disk tier below memory.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..contract import ContractError, ShapeContract
from .snapshot_files import (
    SUFFIX,
    SnapshotFile,
    file_bytes,
    load_snapshot,
    read_snapshot_file,
    snapshot_file_name,
    write_snapshot,
)
from .snapshots import SnapshotCache, StateSnapshot, is_prefix, smallest_snapshot_bytes

__all__ = ["DEFAULT_DISK_BYTES", "DiskSnapshotCache", "StateCacheFolderError"]

log = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 16 << 30
"""Default bound of a state cache folder (16 GiB: at 0.8B about forty 16k-token agent prefixes of 0.4 GB, at 4B
about fifteen of 1.1 GB)."""
STALE_TEMP_SECONDS = 3600
"""A temporary file older than this is a crashed writer's and is removed when a cache opens the folder."""
_EXPORT_FOLDER = re.compile(r"^[0-9a-f]{16}$")


class StateCacheFolderError(ValueError):
    """The state cache folder is a file, or cannot be made or written in (the message names it and the reason)."""


class DiskSnapshotCache(SnapshotCache):
    """A :class:`~.snapshots.SnapshotCache` of ``max_bytes`` in memory over a folder of ``max_disk_bytes`` (see the
    module docstring); the disk tier serves the export ``export`` of ``contract``.

    Args:
        max_bytes: the memory tier's byte limit (snapshots waiting to be written count within it).
        directory: the cache folder (made if missing); its subfolder ``export`` holds this export's files.
        export: :func:`~.snapshots.export_fingerprint` of the export (``Backend.export_id``).
        contract: the export's contract (capacity and state shapes a file must have).
        max_disk_bytes: the bound of the ``.state`` files under ``directory``, in bytes.

    Attributes (besides :class:`~.snapshots.SnapshotCache`'s):
        disk_hits: lookups served by a snapshot read from disk; disk_misses: lookups the disk did not serve.
        disk_read_bytes, disk_written_bytes: bytes of snapshot files read (served) and written.
        disk_write_errors: writes that failed (e.g. a full disk); disk_rejected: files ignored (damaged, foreign).

    Raises:
        StateCacheFolderError: ``directory`` is a file, or cannot be made or written in (naming it and the reason).
        ValueError: ``max_disk_bytes`` is below one snapshot file of the export (naming both).

    Call :meth:`flush` to wait for the pending writes and :meth:`close` at the end (a process that exits without
    it still finishes them: the writer is a ``concurrent.futures`` thread, which Python joins at exit).
    """

    def __init__(
        self,
        max_bytes: int,
        directory: str | os.PathLike,
        export: str,
        contract: ShapeContract,
        max_disk_bytes: int = DEFAULT_DISK_BYTES,
    ):
        super().__init__(max_bytes)
        if isinstance(max_disk_bytes, bool) or not isinstance(max_disk_bytes, int) or max_disk_bytes < 1:
            raise ValueError(f"state cache disk limit must be a positive number of bytes, got {max_disk_bytes!r}")
        smallest = smallest_snapshot_bytes(contract) + 1024  # and its header and alignment
        if max_disk_bytes < smallest:
            raise ValueError(
                f"state cache disk limit {max_disk_bytes} bytes is below one state snapshot file of this export "
                f"(about {smallest} bytes)"
            )
        self.directory, self.export, self.contract = Path(directory), export, contract
        self.max_disk_bytes = max_disk_bytes
        self.folder = self.directory / export
        self._open_folder()
        self.disk_hits = self.disk_misses = self.disk_read_bytes = self.disk_written_bytes = 0
        self.disk_write_errors = self.disk_rejected = 0
        self._disk_lock = threading.Lock()
        self._files: dict[str, tuple[int, SnapshotFile]] = {}  # name -> (inode, what the file says)
        self._ignored: dict[str, int] = {}  # name -> inode of a file that failed a check (warned once)
        self._pending: dict[str, int] = {}  # name -> bytes of a snapshot waiting to be written
        self._failing = False  # a write or listing failed, warned: later failures are not warned again
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="state-cache-writer")
        self._remove_stale_temps()
        with self._disk_lock:
            self._rescan()

    # ---- the folder ----------------------------------------------------------------------
    def _open_folder(self) -> None:
        """Make the export's folder and check that a file can be made in it.

        Raises:
            StateCacheFolderError: naming the folder and what stops it.
        """
        where = f"state cache folder {str(self.directory)!r}"
        if self.directory.exists() and not self.directory.is_dir():
            raise StateCacheFolderError(f"{where} is a file, not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", suffix=".tmp", dir=self.folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StateCacheFolderError(
                f"{where} cannot be used: {exc.strerror or exc} ({exc.filename or self.folder})"
            ) from None

    def _remove_stale_temps(self) -> None:
        cutoff = time.time() - STALE_TEMP_SECONDS
        try:
            for entry in os.scandir(self.folder):
                if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
        except OSError:
            pass

    def _rescan(self) -> None:
        """Index the export folder's files (under the disk lock): new ones read (header and token ids) and
        checked, removed ones dropped; files of other processes included."""
        try:
            listing = {
                e.name: e.inode()
                for e in os.scandir(self.folder)
                if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file(follow_symlinks=False)
            }
        except OSError as exc:
            self._warn(exc, "cannot list")
            return
        for name in set(self._files) - set(listing):
            del self._files[name]
        for name, inode in listing.items():
            if self._files.get(name, (None,))[0] == inode or self._ignored.get(name) == inode:
                continue
            path = self.folder / name
            try:
                info = read_snapshot_file(path)
                if info.export != self.export or info.capacity != self.contract.capacity:
                    raise ValueError(
                        f"{path}: a snapshot of another export (id {info.export}, capacity {info.capacity}); this "
                        f"folder holds export {self.export}'s (capacity {self.contract.capacity})"
                    )
            except FileNotFoundError:
                continue
            except (ValueError, OSError) as exc:  # SnapshotFileError is a ValueError
                self._ignore(name, inode, exc)
                continue
            self._files[name] = (inode, info)

    def _ignore(self, name: str, inode: int, reason: Exception) -> None:
        """Warn once about a file that failed a check; it is never loaded (and is removed as the least recently
        used when room is needed)."""
        self._files.pop(name, None)
        if self._ignored.get(name) != inode:
            self._ignored[name] = inode
            self.disk_rejected += 1
            log.warning("ignoring a kept state on disk (it is not loaded; requests prefill instead): %s", reason)

    def _touch(self, name: str) -> None:
        """Mark a file most recently used (its modification time is the LRU order)."""
        try:
            os.utime(self.folder / name)
        except OSError:
            pass

    def disk_usage(self) -> tuple[int, int]:
        """``(files, bytes)`` of the ``.state`` files under :attr:`directory` (every export's)."""
        files = self._all_files()
        return len(files), sum(size for _, size, _ in files)

    def _all_files(self) -> list[tuple[int, int, str]]:
        """``(mtime_ns, bytes, path)`` of every ``.state`` file in the export folders under :attr:`directory`."""
        out = []
        try:
            folders = [e for e in os.scandir(self.directory) if _EXPORT_FOLDER.match(e.name) and e.is_dir()]
            for folder in folders:
                for e in os.scandir(folder.path):
                    if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out.append((st.st_mtime_ns, st.st_size, e.path))
        except OSError:
            pass
        return out

    def _evict(self, room: int) -> None:
        """Remove the least recently used files until ``room`` more bytes fit within :attr:`max_disk_bytes`."""
        files = sorted(self._all_files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total + room <= self.max_disk_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            if Path(path).parent == self.folder:
                name = Path(path).name
                self._files.pop(name, None)
                self._ignored.pop(name, None)

    # ---- writes --------------------------------------------------------------------------
    def put(self, snapshot: StateSnapshot) -> bool:
        """:meth:`SnapshotCache.put <.snapshots.SnapshotCache.put>`, and a write to disk queued (a snapshot of this
        export whose tokens and images are not on disk yet, and that fits the disk bound); returns whether either
        tier keeps it."""
        kept = super().put(snapshot)
        return self._queue_write(snapshot) or kept

    def _queue_write(self, snapshot: StateSnapshot) -> bool:
        if snapshot.export != self.export:
            return False
        name = snapshot_file_name(snapshot)
        size = file_bytes(snapshot)
        with self._disk_lock:
            if name in self._files:
                self._touch(name)
                return True
            if name in self._pending:
                return True
            if size > self.max_disk_bytes:
                return False
            waiting = sum(self._pending.values())
            if waiting and waiting + size > self.max_bytes:
                log.debug("state cache: %d bytes wait to be written; the state of %d tokens is not", waiting, size)
                return False
            self._pending[name] = size
        try:
            self._writer.submit(self._write, snapshot, name, size)
        except RuntimeError:  # closed: memory only
            with self._disk_lock:
                self._pending.pop(name, None)
            return False
        return True

    def _write(self, snapshot: StateSnapshot, name: str, size: int) -> None:
        """The writer thread: room made, the file written crash-safe, then indexed."""
        path = self.folder / name
        try:
            with self._disk_lock:
                self._evict(size)
            written = write_snapshot(path, snapshot)
            info = read_snapshot_file(path)
            inode = os.stat(path).st_ino
        except Exception as exc:  # noqa: BLE001 - OSError (a full disk) above all; nothing is lost, so warn only
            with self._disk_lock:
                self._pending.pop(name, None)
                self.disk_write_errors += 1
                self._warn(exc, f"could not keep the state of {snapshot.length} tokens in")
            return
        with self._disk_lock:
            self._pending.pop(name, None)
            self._files[name] = (inode, info)
            self.disk_written_bytes += written
            self._failing = False

    def _warn(self, exc: Exception, what: str) -> None:
        """One warning per run of failures of the folder (under the disk lock)."""
        if self._failing:
            log.debug("state cache: %s %s: %s", what, self.folder, exc)
            return
        self._failing = True
        reason = "no space left on device" if getattr(exc, "errno", None) == errno.ENOSPC else str(exc)
        log.warning(
            "state cache: %s %s (%s); requests are served as before (from memory or prefilled), later failures of "
            "this kind are not repeated until a write succeeds",
            what,
            self.folder,
            reason,
        )

    def flush(self) -> None:
        """Wait until every write queued so far is done (or has failed)."""
        try:
            self._writer.submit(lambda: None).result()
        except RuntimeError:  # closed
            pass

    def close(self) -> None:
        """Finish the pending writes and stop the writer (the memory tier keeps working; later snapshots stay in
        memory only). Idempotent."""
        self._writer.shutdown(wait=True)

    # ---- lookups -------------------------------------------------------------------------
    def longest_prefix(self, export: str, token_ids: np.ndarray, images) -> StateSnapshot | None:
        """:meth:`SnapshotCache.longest_prefix <.snapshots.SnapshotCache.longest_prefix>` over both tiers: a longer
        prefix on disk than in memory is read, checked and kept in memory too; counts a hit or a miss, and a disk
        hit or miss."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        with self._lock:
            found = self._find(export, ids, images)
        if export == self.export:
            loaded = self._from_disk(ids, images, found[1].length if found else 0)
            with self._lock:
                if loaded is None:
                    self.disk_misses += 1
                else:
                    self.disk_hits += 1
            if loaded is not None:
                SnapshotCache.put(self, loaded)  # (on disk already: no write)
                found = (self._key(loaded), loaded)
            elif found is not None:
                self._touch(snapshot_file_name(found[1]))  # a memory hit keeps its file recent too
        with self._lock:
            return self._record(found)

    def _from_disk(self, ids: np.ndarray, images, longer_than: int) -> StateSnapshot | None:
        """The longest snapshot on disk that is a strict prefix of ``ids`` / ``images`` with more than
        ``longer_than`` tokens, read and checked; None if none (a file failing a check is ignored, the next
        longest tried)."""
        with self._disk_lock:
            self._rescan()
            candidates = sorted(
                (
                    (info.length, name, inode, info)
                    for name, (inode, info) in self._files.items()
                    if info.length > longer_than and is_prefix(info.token_ids, info.images, ids, images)
                ),
                reverse=True,
            )
        for _, name, inode, info in candidates:
            try:
                snapshot = load_snapshot(info.path)
                snapshot.check_export(self.export, self.contract.capacity)
                self._check_states(snapshot)
                if not snapshot.is_prefix_of(ids, images):
                    raise ValueError(f"{info.path}: its tokens are not those it was listed with")
            except FileNotFoundError:
                with self._disk_lock:
                    self._files.pop(name, None)
                continue
            except (ValueError, OSError, ContractError) as exc:
                with self._disk_lock:
                    self._ignore(name, inode, exc)
                continue
            self._touch(name)
            with self._disk_lock:
                self.disk_read_bytes += info.nbytes
            return snapshot
        return None

    def _check_states(self, snapshot: StateSnapshot) -> None:
        """Raises ValueError when the states' shapes are not the contract's (the KV cache ``length`` slots wide)."""
        c = self.contract
        expected = {
            "conv_states": c.state_shape("conv_states"),
            "recurrent_states": c.state_shape("recurrent_states"),
            "kv_cache": c.kv_shape(snapshot.length),
        }
        for name, shape in expected.items():
            got = tuple(getattr(snapshot, name).shape)
            if got != tuple(shape):
                raise ValueError(f"a snapshot whose {name} is {got}, where this export's is {tuple(shape)}")

    def stats(self) -> dict[str, int]:
        """:meth:`SnapshotCache.stats <.snapshots.SnapshotCache.stats>` plus ``disk_snapshots`` (this export's
        files), ``disk_bytes`` (every ``.state`` file under the folder, what ``disk_max_bytes`` bounds),
        ``disk_max_bytes``, ``disk_hits``, ``disk_misses``, ``disk_read_bytes``, ``disk_written_bytes``,
        ``disk_write_errors`` and ``disk_rejected``."""
        out = super().stats()
        _, used = self.disk_usage()
        with self._lock, self._disk_lock:
            out.update(
                disk_snapshots=len(self._files),
                disk_bytes=used,
                disk_max_bytes=self.max_disk_bytes,
                disk_hits=self.disk_hits,
                disk_misses=self.disk_misses,
                disk_read_bytes=self.disk_read_bytes,
                disk_written_bytes=self.disk_written_bytes,
                disk_write_errors=self.disk_write_errors,
                disk_rejected=self.disk_rejected,
            )
        return out
