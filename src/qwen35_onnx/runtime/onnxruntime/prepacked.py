"""A disk cache of ONNX Runtime's pre-packed weights: one copy of them in memory for every CPU
session of an export (quantized, fp16 and bf16 exports).

Why. When ONNX Runtime loads a graph it *pre-packs* the constant weights of MatMulNBits, MatMul,
Gemm and Conv into the layout its CPU kernels read (MLAS); the packed copy lives on the session's
heap, so decode and every prefill bucket of an export each hold one. The C API can share packed
weights between sessions (a prepacked-weights container); the Python API cannot, and
MatMulNBits cannot run unpacked (it then dequantizes at every call). Sizes: ``docs/design.md``.

How. ONNX Runtime (>= 1.21) can save the optimized graph of a session with its pre-packed
weights in the external-data file (session config
``session.save_external_prepacked_constant_initializers``, each packed blob listed in the
initializer's ``external_data`` as ``prepacked_N = key|offset;length;checksum...``), and a session
made from that saved graph memory-maps the packed blobs instead of packing again. Every saved
graph has its own data file (original and packed weights), but the blobs are the same across
graphs (the prefill buckets' files are byte-identical, decode's nearly), so this
cache merges them **by content** (SHA-256) into one file, ``packed.data``, and rewrites each
saved graph to read it (:func:`qwen35_onnx.onnxfile.edit.write_model`). All sessions then map the pages of one
file: one copy in physical memory. Note that ``VmRSS`` counts a file page once per mapping of it
and ONNX Runtime maps each tensor per session, so VmRSS overstates this memory; ``Pss`` (smaps)
divides shared pages among their mappings and is the figure to read.

The saved graphs are specific to the machine (MLAS packs for the CPU's instruction set) and the
ONNX Runtime version, so they are made on first use, where they run, and keyed by both.

Layout: ``<default_directory()>/<export folder name>-<hash of the key>/`` holds ``index.json``
(the key, each blob's digest and offset, the saved graphs), ``packed.data``, one ``<graph>.onnx``
per graph, ``use.lock`` and ``build.lock`` (see :class:`PrepackedCache`). The key: the export's
path and its files' sizes and times, the machine, the ONNX Runtime version and the session
config; another key is another folder, and a folder no process uses is removed once its export
changed or was deleted.

Disk. A cache holds what ONNX Runtime saves: the original weights (it reads them when it loads
the saved graph, and a pre-packed blob must sit in the file of its initializer, so they cannot
stay in the export's file) and the packed ones, about twice the export's data (Qwen3.5-4B int4:
7.25 GB for 3.58 GB; 0.8B: 1.62 GB for 0.81 GB). Bounded: the caches of one folder keep at most
:func:`max_cache_bytes` together, and a graph is saved only with room for it
(:data:`SPACE_FACTOR`); either way the caches no process uses go first, least recently used
first (checked when a cache opens and after each graph it saves; a cache in use is never
removed, so one export larger than the bound still gets its own).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import platform
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

from ...contract import ContractError
from ...host_memory import c_library
from ...onnxfile.edit import read_model, write_model
from ...paths import cache_root

PACKED = "packed.data"
"""The cache's one data file, shared by every saved graph."""
ALIGN = 4096
"""Blobs appended to ``packed.data`` start at multiples of this many bytes (ONNX Runtime
memory-maps page-aligned data; the first graph's file keeps ONNX Runtime's own alignment)."""
FORMAT = 1
SPACE_FACTOR = {"int": 3, "float16": 6}
"""A graph is saved only with this many times its source data size free on the cache's disk: the
saved copy holds the original weights and the packed ones (4B int4: 2.4x); for fp16 / bf16
exports ONNX Runtime's CPU provider also casts the weights to fp32 when it loads them and saves
those, packed (tiny demo fp16: 3.8x)."""


class PrepackedCacheError(RuntimeError):
    """The cache cannot be used (disk space, permissions, a saved graph it cannot rewrite); the
    caller loads the graph the usual way instead."""


ENV = "QWEN35_ONNX_PREPACKED_CACHE"
"""Environment variable: the caches' folder, or ``off`` to load without the cache."""
MAX_ENV = "QWEN35_ONNX_PREPACKED_CACHE_MAX_GB"
"""Environment variable: the most bytes (GB, 10^9) the caches of one folder keep on disk together,
:data:`DEFAULT_MAX_GB` when unset."""
DEFAULT_MAX_GB = 20.0
"""The default bound of a cache folder (GB): two Qwen3.5-4B int4 exports' caches (7.3 GB each:
the saved graphs keep the original weights next to the packed ones) or a dozen of the 0.8B's."""


def max_cache_bytes() -> int:
    """``$QWEN35_ONNX_PREPACKED_CACHE_MAX_GB`` (default :data:`DEFAULT_MAX_GB`) in bytes.

    Raises:
        PrepackedCacheError: the variable is not a number of GB >= 0 (the cache is then not used).
    """
    text = os.environ.get(MAX_ENV, "").strip()
    try:
        gb = float(text) if text else DEFAULT_MAX_GB
    except ValueError:
        gb = -1.0
    if not (gb >= 0 and math.isfinite(gb * 1e9)):
        raise PrepackedCacheError(f"{MAX_ENV}={text!r} is not a finite number of GB >= 0")
    return int(gb * 1e9)


def default_directory() -> Path | None:
    """``$QWEN35_ONNX_PREPACKED_CACHE`` if set and non-empty (None if it is ``off``), else
    ``<cache_root()>/ort-prepacked`` (``cache_root()``: ``$QWEN35_ONNX_CACHE`` or
    ``~/.cache/qwen35-onnx``)."""
    folder = os.environ.get(ENV)
    if folder and folder.strip().lower() == "off":
        return None
    return Path(folder).expanduser().absolute() if folder else cache_root() / "ort-prepacked"


def machine_key() -> str:
    """What the packed layout depends on besides ONNX Runtime: the CPU's model and instruction
    set flags (``/proc/cpuinfo``; elsewhere ``platform.processor()``), as a short digest."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags", "Features"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file_stamps(root: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of every file of the export's graph folders."""
    stamps = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.parent != root:  # the graphs and their data, not the tokenizer files
            stat = path.stat()
            stamps[str(path.relative_to(root))] = [stat.st_size, stat.st_mtime_ns]
    return stamps


class PrepackedCache:
    """The pre-packed-weights cache of the export at ``export_root`` (see the module docstring).

    One folder per key (export path, its files' sizes and times, machine, ONNX Runtime version,
    session config), never rewritten in place: a changed key is a new folder. Two lock files:
    ``use.lock``, held shared for this object's life (a folder in use is never removed), and
    ``build.lock``, held exclusively while a graph is added (processes take turns; readers of
    graphs already added do not wait: ``packed.data`` only grows past what they read).

    Args:
        export_root: the export folder.
        settings: what else decides the packed bytes (ONNX Runtime version and session config:
            :class:`~.sessions.OrtGraphSet` passes them), part of the key.
        directory: where caches live.
        space: which entry of :data:`SPACE_FACTOR` applies ('int' for quantized exports,
            'float16' for fp16 / bf16 ones).

    Raises:
        PrepackedCacheError: the cache folder cannot be created or locked (no ``fcntl``: not a
            POSIX system).
    """

    def __init__(self, export_root: Path, settings: dict, directory: Path, space: str = "int"):
        self.export_root = Path(export_root).resolve()
        self.space_factor = SPACE_FACTOR[space]
        self.directory = Path(directory).expanduser().resolve()
        try:
            stamps = _file_stamps(self.export_root)
        except OSError as exc:
            raise PrepackedCacheError(f"cannot read the export {str(self.export_root)!r}: {exc}") from exc
        self.key = {
            "format": FORMAT,
            "export": str(self.export_root),
            "machine": machine_key(),
            **settings,
            "files": stamps,
        }
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.directory / f"{self.export_root.name[:40]}-{digest}"
        self.max_bytes = max_cache_bytes()
        self.released = 0
        """Bytes of mappings released after loads (:func:`release_new_pages`)."""
        try:
            import fcntl
        except ImportError as exc:
            raise PrepackedCacheError(f"no file locking on this system ({exc})") from None
        self._fcntl = fcntl
        try:
            self._use = self._hold()
        except OSError as exc:
            raise PrepackedCacheError(f"cannot create the pre-packed weights cache {str(self.path)!r}: {exc}") from exc
        try:
            self._remove_stale()
            self._evict(0)
        except OSError:  # another process changing the folder meanwhile: tidying is best effort
            pass

    def _hold(self, attempts: int = 5):
        """Create the folder if needed and hold its ``use.lock`` shared; returns the open lock file.
        Another process may remove the folder (as stale or over the bound) between its creation
        and the lock, since it was unused then: the lock is taken again until the held file is
        the folder's ``use.lock``."""
        for attempt in range(attempts):
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                lock = open(self.path / "use.lock", "a+")
            except (FileNotFoundError, FileExistsError):  # the folder went while mkdir looked at it
                if attempt + 1 == attempts:
                    raise
                continue
            self._fcntl.flock(lock, self._fcntl.LOCK_SH)
            try:
                if os.path.samestat(os.fstat(lock.fileno()), os.stat(self.path / "use.lock")):
                    os.utime(self.path / "use.lock")  # the last use, for eviction
                    return lock
            except FileNotFoundError:
                pass
            lock.close()
        raise OSError(f"the folder was removed by another process {attempts} times while it was being opened")

    # ---- the index --------------------------------------------------------------------------
    def _read_index(self) -> dict:
        """The index, or a fresh one (``end`` 0, no graphs) when it is missing, damaged, of
        another key, or describes more data than ``packed.data`` holds."""
        try:
            index = json.loads((self.path / "index.json").read_text())
            ok = (
                isinstance(index, dict)
                and index.get("key") == self.key
                and isinstance(index.get("end"), int)
                and isinstance(index.get("blobs"), dict)
                and isinstance(index.get("graphs"), dict)
                and (self.path / PACKED).stat().st_size >= index["end"]
            )
        except (OSError, ValueError):
            ok = False
        return index if ok else {"key": self.key, "end": 0, "blobs": {}, "graphs": {}, "fresh": True}

    def _write_index(self, index: dict) -> None:
        index.pop("fresh", None)
        _write_durably(self.path / "index.json", json.dumps(index).encode())

    def graph(self, name: str, source: Path, save: Callable[[Path, str], None]) -> Path:
        """The saved graph of ``name`` (source graph file ``source``), made now if missing:
        ``save(target, data_name)`` must create an ONNX Runtime session of ``source`` that saves
        its optimized graph to ``target`` with pre-packed weights in ``data_name`` (next to it).

        Returns:
            Path: a graph file whose external data is the cache's ``packed.data``.

        Raises:
            PrepackedCacheError: not enough disk space, an unwritable cache, or a saved graph this
                cache cannot read or rewrite (the caller loads ``source`` instead).
            Exception: whatever ``save`` raises (a graph ONNX Runtime cannot load).
        """
        fcntl = self._fcntl
        try:
            with open(self.path / "build.lock", "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                index = self._read_index()
                saved = index["graphs"].get(name)
                if saved and (self.path / saved).is_file():
                    return self.path / saved
                if index.get("fresh"):  # nothing valid here yet: start empty
                    for old in self.path.iterdir():
                        if not old.name.endswith(".lock"):
                            shutil.rmtree(old) if old.is_dir() else old.unlink()
                needed = self.space_factor * sum(
                    f.stat().st_size for f in source.parent.iterdir() if f.is_file() and f.suffix != ".onnx"
                )
                free = self._evict(needed)
                if free < needed:
                    raise PrepackedCacheError(
                        f"{free / 1e9:.1f} GB free on the disk of {str(self.path)!r}, but saving the pre-packed "
                        f"{name} graph needs about {needed / 1e9:.1f} GB"
                    )
                build = self.path / "build"
                shutil.rmtree(build, ignore_errors=True)
                build.mkdir()
                try:
                    data_name = f"{name}.building.data"
                    save(build / f"{name}.onnx", data_name)
                    graph = self._merge(index, build / f"{name}.onnx", build / data_name)
                    _write_durably(self.path / f"{name}.onnx", graph)
                    index["graphs"][name] = f"{name}.onnx"
                    self._write_index(index)
                finally:
                    shutil.rmtree(build, ignore_errors=True)
                self._evict(0)
                return self.path / f"{name}.onnx"
        except OSError as exc:
            raise PrepackedCacheError(f"the pre-packed weights cache {str(self.path)!r} failed: {exc}") from exc
        except ContractError:  # from ``save``: ONNX Runtime's own error, as it is
            raise
        except ValueError as exc:  # a saved graph or pre-packed entry this cache cannot read
            raise PrepackedCacheError(f"{name}: cannot rewrite the graph ONNX Runtime saved: {exc}") from exc

    def forget(self, name: str) -> None:
        """Drop ``name`` from the index (its saved graph failed to load); it is saved again on
        its next use. Best effort: a cache that cannot be written is left as it is."""
        try:
            with open(self.path / "build.lock", "a+") as lock:
                self._fcntl.flock(lock, self._fcntl.LOCK_EX)
                index = self._read_index()
                if not index.get("fresh") and index["graphs"].pop(name, None):
                    self._write_index(index)
        except OSError:
            pass

    def _merge(self, index: dict, graph: Path, data: Path) -> bytes:
        """Move the blobs of the saved ``graph`` (data file ``data``) into ``packed.data``, each
        distinct content once, and return the graph rewritten to read them there. The first graph
        of a cache adopts its data file as ``packed.data`` (blobs at ORT's own offsets); later
        ones append what is new at multiples of :data:`ALIGN`."""
        model = read_model(graph.read_bytes())
        packed = self.path / PACKED
        adopt = bool(index.get("fresh")) and data.is_file()
        if adopt:
            os.replace(data, packed)
        source = packed if adopt else data
        packed.touch()
        with open(packed, "r+b") as store:
            if not adopt:
                store.truncate(index["end"])  # drop what an interrupted merge may have appended
            view: bytes | mmap.mmap = b""
            if source.is_file() and source.stat().st_size:
                with open(source, "rb") as handle:
                    view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            try:

                def place(offset: int, length: int) -> int:
                    blob = view[offset : offset + length]
                    if len(blob) != length:
                        raise PrepackedCacheError(f"{graph.name}: external data {offset}+{length} past the end")
                    digest = hashlib.sha256(blob).hexdigest() + f":{length}"
                    if digest not in index["blobs"]:
                        if adopt:
                            index["blobs"][digest] = offset
                        else:
                            start = -(-index["end"] // ALIGN) * ALIGN
                            store.seek(start)
                            store.write(blob)
                            index["blobs"][digest] = start
                            index["end"] = start + length
                    return index["blobs"][digest]

                external = {}
                for tensor in model.initializers.values():
                    if tensor.location is None:
                        continue
                    if tensor.location != data.name:
                        raise PrepackedCacheError(
                            f"{graph.name}: initializer {tensor.name!r} reads "
                            f"{tensor.location!r}, not the saved data file"
                        )
                    entries = [
                        ("location", PACKED),
                        ("offset", str(place(tensor.offset, tensor.length))),
                        ("length", str(tensor.length)),
                    ]
                    for key, value in tensor.external:
                        if key.startswith("prepacked"):
                            entries.append((key, _replace_blobs(value, place)))
                        elif key not in ("location", "offset", "length"):
                            entries.append((key, value))
                    external[tensor.name] = entries
                if adopt:
                    index["end"] = packed.stat().st_size
            finally:
                if isinstance(view, mmap.mmap):
                    view.close()
            store.flush()
            os.fsync(store.fileno())
        index.pop("fresh", None)
        rewritten = write_model(model, external=external)
        if data.name.encode() in rewritten:  # e.g. initializers of a subgraph, which are not rewritten
            raise PrepackedCacheError(f"{graph.name}: external data outside the main graph")
        return rewritten

    def disk_bytes(self) -> int:
        """Bytes of the cache's files on disk."""
        return _folder_bytes(self.path)

    def _evict(self, free_needed: int) -> int:
        """Remove other caches of the folder that no process uses, least recently used first
        (``use.lock``'s time), while the disk has less than ``free_needed`` bytes free or the
        folder's caches together hold more than :attr:`max_bytes`; returns the free bytes then."""
        free = shutil.disk_usage(self.path).free
        others = []
        for other in self._others():
            try:
                others.append(((other / "use.lock").stat().st_mtime_ns, _folder_bytes(other), other))
            except OSError:
                continue
        total = self.disk_bytes() + sum(size for _, size, _ in others)
        for _, size, other in sorted(others):
            if free >= free_needed and total <= self.max_bytes:
                break
            if self._remove_unused(other):
                free, total = shutil.disk_usage(self.path).free, total - (size - _folder_bytes(other))
        return free

    def _others(self):
        """The other cache folders of :attr:`directory` (symlinks are not caches)."""
        for other in self.directory.iterdir():
            if other != self.path and other.is_dir() and not other.is_symlink():
                yield other

    def _remove_unused(self, other: Path) -> bool:
        """Remove the cache folder ``other`` if no process holds its ``use.lock``; True if it was
        removed (its lock is held exclusively meanwhile, so no process can start using it)."""
        try:
            with open(other / "use.lock") as lock:
                self._fcntl.flock(lock, self._fcntl.LOCK_EX | self._fcntl.LOCK_NB)
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            return False
        return True

    def _remove_stale(self) -> None:
        """Remove the caches (siblings of this one) that no process uses (``use.lock`` free) and
        that this machine made either for this export with another key (it changed, or another
        ONNX Runtime version made them) or for an export that no longer exists."""
        for other in self._others():
            try:
                key = json.loads((other / "index.json").read_text())["key"]
                export, machine = str(key["export"]), key["machine"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if machine == self.key["machine"] and (export == self.key["export"] or not Path(export).exists()):
                self._remove_unused(other)


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files in and below ``folder`` (the ``build`` folder of an interrupted save
    included), not following symlinks; files that vanish meanwhile count 0; 0 for a folder that
    is gone."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file, flushed to disk before it replaces ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _replace_blobs(value: str, place: Callable[[int, int], int]) -> str:
    """An ONNX Runtime ``prepacked_N`` value ``key|offset;length;checksum[|...]`` with each blob's
    offset replaced by ``place(offset, length)``."""
    key, *blobs = value.split("|")
    out = [key]
    for blob in blobs:
        fields = blob.split(";")
        if len(fields) != 3:
            raise PrepackedCacheError(f"unexpected pre-packed entry {value!r}")
        offset, length = int(fields[0]), int(fields[1])
        out.append(f"{place(offset, length)};{length};{fields[2]}")
    return "|".join(out)


def _mappings(path: Path) -> list[tuple[int, int, int]]:
    """This process's mappings of the file ``path``: ``(start, end, written kB)`` from
    ``/proc/self/smaps`` (written: its private pages, resident or swapped; empty where there is
    no smaps)."""
    target, found, current = str(Path(path).resolve()), [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(None, 5)
                if "-" in head[0] and not head[0].endswith(":"):
                    current = None
                    if len(head) == 6 and head[5].rstrip("\n") == target:
                        start, end = (int(x, 16) for x in head[0].split("-"))
                        current = [start, end, 0]
                        found.append(current)
                elif current is not None and head[0] in ("Anonymous:", "Swap:"):
                    current[2] += int(head[1])
    except OSError:
        return []
    return [tuple(m) for m in found]


def mapped_starts(path: Path) -> set[int]:
    """Start addresses of this process's mappings of ``path`` (see :func:`release_new_pages`)."""
    return {start for start, _, _ in _mappings(path)}


def release_new_pages(path: Path, before: set[int]) -> int:
    """Drop this process's pages of the mappings of ``path`` made since ``before`` (a
    :func:`mapped_starts` result), i.e. by the session just loaded; returns bytes of mappings
    released.

    Loading reads more of the cache than running does: at 4B int4 the MatMulNBits scales (0.53 GB)
    are read while the session is made and never again (the packed blobs hold them). ONNX Runtime
    maps the file private and never writes to constant weights, so these pages are clean copies
    of the file: ``madvise(MADV_DONTNEED)`` unmaps every page of the new mappings, and the pages
    that running reads are mapped again from the page cache on the first run (minor faults);
    what only loading read stays out. Mappings with written pages (resident or swapped) are left
    alone. Linux only; elsewhere nothing is released."""
    import ctypes

    libc = c_library()
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end, written in _mappings(path):
        if start not in before and written == 0 and madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
            released += end - start
    return released


def warn_unavailable(exc: Exception) -> None:
    """Say once per cause that the cache is not used (the graphs then load with their own packed
    weights, as ONNX Runtime does by default)."""
    warnings.warn(
        f"pre-packed weights cache not used: {exc}; each session packs its own weights", RuntimeWarning, stacklevel=3
    )
