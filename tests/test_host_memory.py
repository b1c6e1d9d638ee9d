"""State buffers committed as they are written (host_memory.py): a capacity-wide KV cache costs resident
memory for the slots written, pages handed back read as zeros, and the ONNX Runtime backend's states use them."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_onnx.host_memory import discard_pages, reserve_zeros

MIB = 1 << 20


def resident_bytes(array: np.ndarray) -> int:
    """Resident bytes of the mapping that holds ``array``'s first byte (``Rss`` of its ``/proc/self/smaps`` entry)."""
    address = array.ctypes.data
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_reserved_memory_is_committed_where_written():
    kv = reserve_zeros((4, 2, 2, 8192, 256), np.float32)  # 128 MiB of address space
    assert kv.flags.c_contiguous and kv.dtype == np.float32 and not kv.any()
    assert resident_bytes(kv) < 4 * MIB  # reading zeros maps the shared zero page
    kv[:, :, :, :512] = 1.0  # 512 of 8192 slots of every (entry, row, head)
    committed = resident_bytes(kv)
    written = kv[:, :, :, :512].nbytes
    assert written <= committed < written + 16 * 2 * MIB  # at most a (huge) page more per strip written
    assert committed < kv.nbytes / 4


def test_discarded_pages_read_zeros_and_leave_the_rest():
    kv = reserve_zeros((3, 4, 1024, 64), np.float32)
    kv[...] = 2.0
    freed = discard_pages(kv[:, 1])  # one row of every entry: three separate blocks
    assert freed == 3 * kv[0, 1].nbytes
    assert not kv[:, 1].any() and (kv[:, 0] == 2.0).all() and (kv[:, 2:] == 2.0).all()


def test_discard_keeps_partial_pages_and_ignores_foreign_memory():
    kv = reserve_zeros((3, 1000), np.float32)  # rows of 4000 bytes: none starts on a page boundary but the first
    kv[...] = 1.0
    assert discard_pages(kv[1]) == 0  # row 1 spans bytes 4000-8000: no whole page inside
    assert (kv == 1.0).all()
    heap = np.ones((4, 4096), np.float32)
    assert discard_pages(heap) == 0 and (heap == 1.0).all()  # not a reservation: left alone
    assert discard_pages(kv[:0]) == 0


def test_reserving_more_than_the_machine_holds():
    """Address space, not memory: 4 slots of a 262,144-token 4B KV cache (68 GB) can be reserved."""
    huge = reserve_zeros((16, 4, 4, 262_144, 256), np.float32)
    assert huge.nbytes == 68_719_476_736
    huge[0, 0, 0, 0] = 1.0
    assert resident_bytes(huge) < 8 * MIB


@pytest.mark.parametrize("width", [0, 5])
def test_ort_states_from_host_commit_only_the_slots_given(width):
    onnxruntime = pytest.importorskip("onnxruntime")
    from qwen35_onnx.runtime.onnxruntime.backend import OrtBackend

    class Contract:  # the part of a ShapeContract that states_from_host reads
        @staticmethod
        def state_shape(state, width=None):
            return {"kv_cache": (2, 1, 2, width or 65_536, 128), "conv_states": (1, 1, 3, 8)}[state]

    backend = OrtBackend.__new__(OrtBackend)
    backend.contract, backend.device, backend.host_state_roundtrip = Contract(), "cpu", False
    kv = np.full((2, 1, 2, width, 128), 3.0, np.float32)
    states = backend.states_from_host({"present_kv_cache": kv, "present_conv_states": np.ones((1, 1, 3, 8))})
    value = states["present_kv_cache"]
    assert isinstance(value, onnxruntime.OrtValue) and value.shape() == [2, 1, 2, 65_536, 128]
    array = value.numpy()
    assert (array[:, :, :, :width] == 3.0).all() and not array[:, :, :, width : width + 64].any()
    assert resident_bytes(array) < 8 * 2 * MIB  # 128 MiB wide, a page or two per strip written
