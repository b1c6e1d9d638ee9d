"""One :class:`~.snapshots.StateSnapshot` as one file: written crash-safe, read back verified (numpy only).

Layout (little-endian; format version :data:`FORMAT_VERSION`)::

    offset 0   magic b"Q35STATE", u32 format version, u32 header bytes H, u32 CRC-32 of the header, u32 0
    offset 24  the header: H bytes of UTF-8 JSON (below)
    then       every array's raw bytes (C order), each starting at a multiple of 64 bytes

The header holds the snapshot's plain fields (``export``, ``capacity``, ``images``, ``reply``: whatever fields of
:class:`~.snapshots.StateSnapshot` are not arrays), the whole file's size in bytes (``file_bytes``), and for each
array field that is set (``token_ids``, ``conv_states``, ``recurrent_states``, ``kv_cache`` and the optional
ones) its ``name``, ``dtype`` (numpy's ``dtype.str``, e.g. ``<f4``, ``<f2``, ``|i1``, or the name of an
``ml_dtypes`` type such as ``bfloat16``), ``shape``, ``offset``, ``nbytes`` and the CRC-32 of its bytes. Nothing
assumes fp32 states: a snapshot of fp16, bf16 or int8 states with scale arrays is written and read the same way.

Writes go to a temporary file in the same folder, are flushed and ``fsync``'d, then renamed over the final name
(``os.replace``, atomic on POSIX) and the folder ``fsync``'d: a crash leaves either no file or the whole file,
and a reader never sees a file being written (the temporary names do not end in :data:`SUFFIX`). A file is read
as a memory map: the arrays are read-only views of the page cache, checked against their CRC-32 before use, so
a snapshot read from disk costs no second copy in memory (the runtime copies it into its state buffers).

CRC-32: ``zlib.crc32`` (ISO 3309 / ITU-T V.42), about 4 GB/s here: a check against accidental damage
(truncation, flipped bits), not against tampering.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .snapshots import StateSnapshot

__all__ = [
    "FORMAT_VERSION",
    "SUFFIX",
    "SnapshotFile",
    "SnapshotFileError",
    "file_bytes",
    "load_snapshot",
    "read_snapshot_file",
    "snapshot_file_name",
    "write_snapshot",
]

MAGIC = b"Q35STATE"
FORMAT_VERSION = 1
"""Version of the layout above; a file of another version is not read."""
SUFFIX = ".state"
"""The name ending of snapshot files (temporary files end otherwise)."""
ALIGN = 64
_PREFIX = struct.Struct("<8sIIII")
_MAX_HEADER = 64 << 20  # token ids are arrays, not header text: a header is a few KB


class SnapshotFileError(ValueError):
    """A file that is not a whole, intact snapshot file of this format (the message names the file and what is
    wrong)."""


@dataclass(frozen=True)
class SnapshotFile:
    """What a snapshot file says about itself (its header and token ids, checked), before its states are read.

    Attributes:
        path: the file.
        export, capacity: the export it was taken on (:func:`~.snapshots.export_fingerprint`) and its capacity.
        token_ids: ``[length]`` int64 (a read-only view of the file's map).
        images: the image digests among those tokens.
        nbytes: the file's size in bytes.
        header: the parsed header (see the module docstring).
    """

    path: Path
    export: str
    capacity: int
    token_ids: np.ndarray
    images: tuple[str, ...]
    nbytes: int
    header: dict

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])


def snapshot_file_name(snapshot: StateSnapshot) -> str:
    """The file name of ``snapshot``: a digest of its export, token ids and images, plus :data:`SUFFIX` (the same
    tokens and images of one export get the same name, so a second write replaces the first)."""
    digest = hashlib.sha256(snapshot.export.encode())
    digest.update(np.ascontiguousarray(snapshot.token_ids, dtype=np.int64).tobytes())
    digest.update(json.dumps(list(snapshot.images)).encode())
    return digest.hexdigest()[:32] + SUFFIX


def _arrays(snapshot: StateSnapshot) -> list[tuple[str, np.ndarray]]:
    """The snapshot's array fields that are set, C-contiguous, in field order."""
    out = []
    for f in dataclasses.fields(snapshot):
        value = getattr(snapshot, f.name)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise ValueError(f"snapshot array {f.name} holds Python objects ({value.dtype}): not storable")
            out.append((f.name, np.ascontiguousarray(value)))
    return out


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of the C-contiguous ``a`` without a copy (as bytes: extension dtypes such as ml_dtypes' bfloat16
    have no buffer-protocol format)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _dtype_code(dtype: np.dtype) -> str:
    """``dtype.str`` for numpy's own types; the type's name for extension types (``ml_dtypes``' bfloat16 has
    ``dtype.str`` ``<V2``, which names no type)."""
    return dtype.name if dtype.kind == "V" else dtype.str


def _dtype(code: str) -> np.dtype:
    try:
        return np.dtype(code)
    except TypeError:
        try:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, code))
        except (ImportError, AttributeError, TypeError):
            raise TypeError(f"unknown array dtype {code!r}") from None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(snapshot: StateSnapshot, checksums: bool = True) -> tuple[bytes, list[tuple[int, np.ndarray]], int]:
    """The prefix and header bytes, each array with its offset, and the file's size; without ``checksums`` every
    checksum is written as the largest one (the size is then an upper bound, for no pass over the bytes)."""
    arrays = _arrays(snapshot)
    plain = {}
    for f in dataclasses.fields(snapshot):
        value = getattr(snapshot, f.name)
        if value is None or isinstance(value, np.ndarray):
            continue
        plain[f.name] = list(value) if isinstance(value, tuple) else value
    entries = [
        {"name": name, "dtype": _dtype_code(a.dtype), "shape": list(a.shape), "nbytes": int(a.nbytes)}
        for name, a in arrays
    ]
    for entry, (_, a) in zip(entries, arrays):
        entry["crc32"] = (zlib.crc32(_raw(a)) if a.nbytes else 0) if checksums else 0xFFFFFFFF
    # the header's length fixes the arrays' offsets, which the header holds: lay it out until it stops growing
    header, size = b"", 0
    while True:
        offset = _align(_PREFIX.size + len(header))
        for entry in entries:
            entry["offset"] = offset
            offset = _align(offset + entry["nbytes"])
        size = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else _PREFIX.size + len(header)
        text = json.dumps({"format": FORMAT_VERSION, **plain, "file_bytes": size, "arrays": entries}).encode()
        done = len(text) == len(header)  # the offsets above were laid out for a header of this length
        header = text
        if done:
            break
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header), 0)
    return prefix + header, [(e["offset"], a) for e, (_, a) in zip(entries, arrays)], size


def file_bytes(snapshot: StateSnapshot) -> int:
    """The size in bytes of ``snapshot``'s file at most (without writing it or reading its arrays: the real size
    may be a few bytes less, by the checksums' digits in the header)."""
    return _layout(snapshot, checksums=False)[2]


def write_snapshot(path: str | os.PathLike, snapshot: StateSnapshot) -> int:
    """Write ``snapshot`` to ``path`` crash-safe (see the module docstring); returns the file's bytes.

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``, a full disk): no file at ``path`` was made or changed and
            the temporary file is removed.
        ValueError: an array of Python objects.
    """
    path = Path(path)
    head, arrays, size = _layout(snapshot)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp, "xb") as f:
            f.write(head)
            for offset, a in arrays:
                f.write(b"\0" * (offset - f.tell()))
                f.write(_raw(a))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return size


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _map(path: Path) -> tuple[mmap.mmap, int]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise SnapshotFileError(f"{path}: an empty file (truncated)")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size


def _view(buffer: mmap.mmap, entry: dict) -> np.ndarray:
    dtype = _dtype(entry["dtype"])
    count = int(np.prod(entry["shape"], dtype=np.int64))
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=entry["offset"]).reshape(entry["shape"])


def _check_crc(path: Path, data, entry: dict) -> None:
    if (zlib.crc32(data) if entry["nbytes"] else 0) != entry["crc32"] or len(data) != entry["nbytes"]:
        raise SnapshotFileError(f"{path}: the bytes of {entry['name']} do not match their checksum (damaged)")


def _header_length(path: Path, prefix: bytes, size: int) -> tuple[int, int]:
    """The header's length and checksum from the file's first bytes ``prefix``, checked."""
    if len(prefix) < _PREFIX.size:
        raise SnapshotFileError(f"{path}: {size} bytes, shorter than the {_PREFIX.size}-byte prefix (truncated)")
    magic, version, length, crc, _ = _PREFIX.unpack(prefix[: _PREFIX.size])
    if magic != MAGIC:
        raise SnapshotFileError(f"{path}: not a state snapshot file (its first bytes are {magic!r})")
    if version != FORMAT_VERSION:
        raise SnapshotFileError(
            f"{path}: snapshot file format version {version}; this qwen35-onnx reads version {FORMAT_VERSION}"
        )
    if length > min(_MAX_HEADER, size - _PREFIX.size):
        raise SnapshotFileError(f"{path}: a header of {length} bytes in a file of {size} bytes (truncated)")
    return length, crc


def _parse_header(path: Path, text: bytes, crc: int, size: int) -> dict:
    """The header ``text`` (its checksum ``crc``) of a file of ``size`` bytes, checked: every array inside the
    file, the file's size as declared, token ids of 1-D int64."""
    if zlib.crc32(text) != crc:
        raise SnapshotFileError(f"{path}: the header does not match its checksum (damaged)")
    try:
        header = json.loads(text)
        entries = {e["name"]: e for e in header["arrays"]}
        if not isinstance(header["export"], str) or int(header["capacity"]) < 1:
            raise ValueError(f"export {header['export']!r}, capacity {header['capacity']!r}")
        declared = int(header["file_bytes"])
        ids = entries["token_ids"]
        for e in entries.values():
            count = int(np.prod(e["shape"], dtype=np.int64))
            if count * _dtype(e["dtype"]).itemsize != e["nbytes"] or e["offset"] < _PREFIX.size + len(text):
                raise ValueError(f"array {e['name']}: {e['shape']} {e['dtype']} in {e['nbytes']} bytes")
            if e["offset"] + e["nbytes"] > declared:
                raise ValueError(f"array {e['name']} ends after the file's {declared} bytes")
            int(e["crc32"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotFileError(f"{path}: a malformed header ({exc})") from None
    if size != declared:
        raise SnapshotFileError(f"{path}: {size} bytes where its header says {declared} (truncated or extended)")
    if _dtype(ids["dtype"]) != np.int64 or len(ids["shape"]) != 1:
        raise SnapshotFileError(f"{path}: token ids of {ids['dtype']} {ids['shape']}, expected 1-D int64")
    return header


def _token_entry(header: dict) -> dict:
    return next(e for e in header["arrays"] if e["name"] == "token_ids")


def read_snapshot_file(path: str | os.PathLike) -> SnapshotFile:
    """The header and token ids of the snapshot file at ``path``, checked: magic, format version, header checksum,
    the file's size against the header's, every array inside the file, and the token ids' checksum (the states'
    own checksums are checked by :func:`load_snapshot`). Reads the header and the token ids only.

    Raises:
        SnapshotFileError: any check failed (a truncated, damaged or foreign file), naming the file and the check.
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length, crc = _header_length(path, f.read(_PREFIX.size), size)
        header = _parse_header(path, f.read(length), crc, size)
        ids = _token_entry(header)
        f.seek(ids["offset"])
        data = f.read(ids["nbytes"])
    _check_crc(path, data, ids)
    token_ids = np.frombuffer(data, dtype=np.int64).copy()
    images = tuple(str(d) for d in header.get("images", ()))
    return SnapshotFile(path, str(header["export"]), int(header["capacity"]), token_ids, images, size, header)


def load_snapshot(path: str | os.PathLike) -> StateSnapshot:
    """The snapshot in the file at ``path``, every check of :func:`read_snapshot_file` and every array's checksum
    passed; its arrays are read-only views of a memory map of the file (no copy: the pages are the page cache's).

    Raises:
        SnapshotFileError: a check failed, or a header whose fields are not :class:`~.snapshots.StateSnapshot`'s.
        OSError: the file cannot be opened or mapped (e.g. removed since it was listed).
    """
    path = Path(path)
    buffer, size = _map(path)
    length, crc = _header_length(path, buffer[: _PREFIX.size], size)
    header = _parse_header(path, buffer[_PREFIX.size : _PREFIX.size + length], crc, size)
    whole = memoryview(buffer)
    fields: dict = {}
    try:
        for entry in header["arrays"]:
            _check_crc(path, whole[entry["offset"] : entry["offset"] + entry["nbytes"]], entry)
            fields[entry["name"]] = _view(buffer, entry)
    finally:
        whole.release()
    known = {f.name for f in dataclasses.fields(StateSnapshot)}
    for key, value in header.items():
        if key in known and key not in fields:
            fields[key] = tuple(value) if isinstance(value, list) else value
    try:
        return StateSnapshot(**fields)
    except TypeError as exc:  # a field missing or unknown (another layout of the snapshot)
        raise SnapshotFileError(f"{path}: not a snapshot of this version ({exc})") from None
