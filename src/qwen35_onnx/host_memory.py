"""The host process's memory housekeeping, shared by every backend (no torch, no runtime import):
the C library, handing freed heap back to the system, the system's available memory, and state buffers whose
memory is committed as they are written."""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import sys
import weakref

import numpy as np

__all__ = [
    "available_memory",
    "c_library",
    "discard_pages",
    "release_freed_memory",
    "reserve_zeros",
    "trim_heap",
]


@functools.lru_cache(maxsize=1)
def c_library():
    """The C library (ctypes), or None where it cannot be loaded."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the C heap's freed memory back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). ONNX Runtime's pre-packed weights and what loading a graph allocates are many
    blocks below glibc's mmap threshold, so freed, they otherwise stay resident (sizes in
    ``docs/design.md``)."""
    libc = c_library()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def release_freed_memory() -> None:
    """Collect garbage, then :func:`trim_heap`: what a dropped session or generation held leaves
    the process (ONNX Runtime's shared activation arena stays:
    :func:`qwen35_onnx.runtime.onnxruntime.sessions.shrink_shared_arena`)."""
    gc.collect()
    trim_heap()


def available_memory() -> int:
    """The system's available memory in bytes (``MemAvailable`` of ``/proc/meminfo``: free memory
    plus what the kernel can reclaim, such as the page cache); very large where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
"""``madvise``'s advice to drop a private mapping's pages (Linux: 4)."""
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
"""``mmap``'s MAP_NORESERVE (Linux: 0x4000; Python's ``mmap`` module does not name it before 3.13): no swap is
reserved for the mapping, so the kernel's overcommit heuristic does not refuse a reservation larger than the
machine's memory (4 slots of a 262,144-token 4B KV cache are 68 GB of address space)."""

_RESERVED: dict[int, int] = {}
"""Start address -> end address of each live mapping of :func:`reserve_zeros` (removed when its array is freed)."""


def reserve_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous zero array of ``shape`` and ``dtype`` whose memory is committed only where it is written:
    an anonymous private mapping (``mmap``, MAP_NORESERVE), which the kernel backs with a page (4 KiB, or a 2 MiB
    transparent huge page) on the first write to it and with the shared zero page on a read. A KV cache reserved
    this way at the whole capacity costs resident memory for the tokens written, not for the capacity (the CPU
    form of reserving virtual memory and committing it on demand: Prabhu et al. 2024, "vAttention: Dynamic Memory
    Management for Serving LLMs without PagedAttention"). :func:`discard_pages` hands written pages back.

    Raises:
        MemoryError: the address space cannot be reserved.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError as exc:
        raise MemoryError(f"cannot reserve {nbytes} bytes of address space for a {list(shape)} array: {exc}") from exc
    flat = np.frombuffer(mapping, dtype=dtype)
    start = flat.ctypes.data
    _RESERVED[start] = start + nbytes
    weakref.finalize(flat, _RESERVED.pop, start, None)
    return flat.reshape(shape)


def discard_pages(view: np.ndarray) -> int:
    """Hand the whole pages inside ``view`` back to the system (``madvise(MADV_DONTNEED)``): they read as zeros
    afterwards and cost no resident memory until written again. ``view`` (any array over the same memory, e.g.
    ONNX Runtime's ``OrtValue.numpy()`` of a bound buffer) must lie in an array of :func:`reserve_zeros` (anything
    else is left alone), C-contiguous or a stack of C-contiguous blocks along its first axes; a partial page at
    either end of a block is kept (its bytes are not zeroed). Returns the bytes handed back."""
    libc = c_library()
    if view.size == 0 or libc is None or not hasattr(libc, "madvise"):
        return 0
    if not view.flags.c_contiguous:
        return sum(discard_pages(block) for block in view)
    start = view.ctypes.data
    end = start + view.nbytes
    if not any(first <= start and end <= last for first, last in _RESERVED.items()):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) != 0:
        return 0
    return last - first
