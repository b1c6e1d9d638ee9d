"""The host process's memory housekeeping, shared by every backend (no torch, no runtime import):
the C library, handing freed heap back to the system, and the system's available memory."""

from __future__ import annotations

import functools
import gc

__all__ = ["available_memory", "c_library", "release_freed_memory", "trim_heap"]


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
