"""ONNX Runtime's pre-packed weights, saved once and shared by every session of an export
(issue 9 item 4, quantized and fp16 exports; :mod:`qwen35_onnx.runtime.onnxruntime.prepacked`).

- Memory: with an int4 export whose packed weights dominate the noise, loading and running more
  prefill buckets adds far less than one packed weight set (``Pss``, fresh process), while a
  session that packs its own adds most of one.
- The cache: made on first load, reused after (nothing packed again), the saved graphs' blobs
  stored once by content, rebuilt when the export changes, removed when its export is gone, and
  not used (a warning; sessions pack their own) when the disk lacks the space.
- Results: tokens equal those of sessions that pack their own weights.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime.onnxruntime import prepacked
from qwen35_onnx.runtime.onnxruntime.backend import OrtBackend
from qwen35_onnx.runtime.onnxruntime.sessions import GraphSession

from .conftest import CAPACITY, MAX_NEW_TOKENS, PROMPT
from .test_shared_weights import MEASURE


@pytest.fixture(scope="module")
def int4_export(trained_export) -> Path:
    """The trained demo checkpoint's ``--ops ort --quantize int4`` export (one bucket, 128;
    shared with the quantization tests)."""
    return trained_export("ort", quantize="int4")


def saves(monkeypatch) -> list[str]:
    """Record the graphs ONNX Runtime saves with pre-packed weights from now on."""
    saved, load = [], GraphSession.load.__func__

    def counting(cls, name, path, *args, save_to=None, **kwargs):
        if save_to is not None:
            saved.append(name)
        return load(cls, name, path, *args, save_to=save_to, **kwargs)

    monkeypatch.setattr(GraphSession, "load", classmethod(counting))
    return saved


def open_pipe(root: Path, **backend) -> Pipeline:
    """The export with vision and decode loaded by ``OrtBackend(**backend)``."""
    from qwen35_onnx.contract import read_manifest
    from qwen35_onnx.conversation.processor import ImageSizing, Preprocessor

    contract = read_manifest(root)
    return Pipeline(
        root,
        contract,
        OrtBackend(root, contract, **backend),
        Preprocessor.from_pretrained(root, ImageSizing.of(contract), contract.image_token_id),
    )


def load_all(root: Path, **backend) -> Pipeline:
    """The export with every graph loaded."""
    pipe = open_pipe(root, **backend)
    for bucket in pipe.contract.prefill_buckets:
        pipe.backend.graphs.prefill(bucket)
    return pipe


def packed_bytes(cache, name: str) -> int:
    """Bytes of the pre-packed blobs the saved graph ``name`` reads."""
    from qwen35_onnx.onnxfile.edit import read_model

    model = read_model((cache.path / f"{name}.onnx").read_bytes())
    assert {t.location for t in model.initializers.values() if t.location} == {"packed.data"}
    return sum(
        int(blob.split(";")[1])
        for t in model.initializers.values()
        for key, value in t.external
        if key.startswith("prepacked")
        for blob in value.split("|")[1:]
    )


def index_of(cache) -> dict:
    return json.loads((cache.path / "index.json").read_text())


def test_made_once_then_reused_with_the_same_tokens(int4_export, photo, tmp_path, monkeypatch):
    """First load: every graph is saved once; the buckets add almost nothing to ``packed.data``
    (their packed blobs are decode's); the pages loading read are released. Second load:
    nothing is saved. Tokens equal those of sessions that pack their own weights."""
    saved = saves(monkeypatch)
    directory = tmp_path / "cache"
    first = open_pipe(int4_export, prepacked_cache=directory)
    cache = first.backend.graphs.prepacked
    assert sorted(saved) == ["decode", "vision"] and cache.released > 0
    assert not first.backend.graphs.packs_per_session and first.backend.graphs.weights is None
    decode_packed, end = packed_bytes(cache, "decode"), index_of(cache)["end"]
    assert decode_packed > 0
    for bucket in first.contract.prefill_buckets:
        first.backend.graphs.prefill(bucket)
    index = index_of(cache)
    assert sorted(saved) == sorted(index["graphs"]) == ["decode", f"prefill_{CAPACITY}", "vision"]
    assert index["end"] - end < 0.1 * decode_packed, (index["end"] - end, decode_packed)
    assert index["end"] == (cache.path / "packed.data").stat().st_size
    assert sorted(p.name for p in cache.path.iterdir()) == sorted(
        ["index.json", "build.lock", "use.lock", "packed.data", *(f"{name}.onnx" for name in saved)]
    )

    saved.clear()
    second = load_all(int4_export, prepacked_cache=directory)
    assert saved == [] and second.backend.graphs.prepacked.path == cache.path
    own = load_all(int4_export, prepacked_cache=False)
    assert own.backend.graphs.prepacked is None and own.backend.graphs.packs_per_session
    a = second.generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS).token_ids
    b = own.generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS).token_ids
    assert a == b and len(a) >= 4
    assert open_pipe(int4_export).backend.graphs.prepacked.directory == Path(os.environ["QWEN35_ONNX_PREPACKED_CACHE"])


def test_interrupted_and_damaged_caches_are_repaired(int4_export, tmp_path, monkeypatch, photo):
    """Bytes an interrupted merge appended are cut off; a graph file the index does not list is
    made again; a damaged saved graph falls back to the usual load (a warning) and is made again
    on the next load."""
    saved = saves(monkeypatch)
    directory = tmp_path / "cache"
    cache = open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked
    with open(cache.path / "packed.data", "ab") as data:
        data.write(b"interrupted" * 1000)
    (cache.path / f"prefill_{CAPACITY}.onnx").write_bytes(b"left by a build that did not finish")
    saved.clear()
    pipe = load_all(int4_export, prepacked_cache=directory)
    assert saved == [f"prefill_{CAPACITY}"]
    assert index_of(cache)["end"] == (cache.path / "packed.data").stat().st_size
    expected = pipe.generate(photo, PROMPT, max_new_tokens=8).token_ids

    (cache.path / "decode.onnx").write_bytes(b"damaged")
    with pytest.warns(RuntimeWarning, match="pre-packed weights cache not used: decode graph .* cannot be loaded"):
        fallback = open_pipe(int4_export, prepacked_cache=directory)
    assert fallback.backend.graphs.prepacked is None and "decode" not in index_of(cache)["graphs"]
    assert fallback.generate(photo, PROMPT, max_new_tokens=8).token_ids == expected
    saved.clear()
    open_pipe(int4_export, prepacked_cache=directory)
    assert saved == ["decode"]


def test_a_changed_export_gets_a_new_cache_and_stale_ones_go(int4_export, tmp_path, monkeypatch):
    saved = saves(monkeypatch)
    directory = tmp_path / "cache"
    copy = tmp_path / "copy"
    shutil.copytree(int4_export, copy)
    first = open_pipe(copy, prepacked_cache=directory)
    old = first.backend.graphs.prepacked.path
    # while a process uses a cache, it stays (use.lock is held shared)
    decode = copy / "text" / "decode.onnx"
    os.utime(decode, ns=(decode.stat().st_atime_ns, decode.stat().st_mtime_ns + 10**9))  # as a re-export does
    saved.clear()
    second = open_pipe(copy, prepacked_cache=directory)
    new = second.backend.graphs.prepacked.path
    assert sorted(saved) == ["decode", "vision"] and new != old and old.exists()
    # once unused, the stale cache of this export goes when the next cache opens
    del first
    gc.collect()
    open_pipe(copy, prepacked_cache=directory)
    assert not old.exists() and new.exists()
    # a damaged index is a new start in the same folder, not an error
    (new / "index.json").write_text("[1, 2]")
    saved.clear()
    open_pipe(copy, prepacked_cache=directory)
    assert sorted(saved) == ["decode", "vision"]
    # the export is deleted: once unused, its cache goes when another one opens
    del second
    gc.collect()
    shutil.rmtree(copy)
    other = open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked
    assert not new.exists() and other.path.exists()


def test_not_enough_disk_space_loads_without_the_cache(int4_export, tmp_path, monkeypatch, photo):
    monkeypatch.setitem(prepacked.SPACE_FACTOR, "int", 10**9)
    with pytest.warns(
        RuntimeWarning,
        match=r"pre-packed weights cache not used: .* GB free on the disk of .* "
        r"saving the pre-packed vision graph needs about .* GB",
    ):
        pipe = load_all(int4_export, prepacked_cache=tmp_path / "cache")
    assert pipe.backend.graphs.prepacked is None and pipe.backend.graphs.packs_per_session
    assert len(pipe.generate(photo, PROMPT, max_new_tokens=4).token_ids) == 4


def test_cache_folder_that_cannot_be_made_warns(int4_export, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = load_all(int4_export, prepacked_cache=blocker / "cache")
    assert pipe.backend.graphs.prepacked is None
    assert any("cannot create the pre-packed weights cache" in str(w.message) for w in caught)


def test_turned_off(int4_export, monkeypatch):
    monkeypatch.setenv("QWEN35_ONNX_PREPACKED_CACHE", "off")
    graphs = open_pipe(int4_export).backend.graphs
    assert graphs.prepacked is None and graphs.packs_per_session
    with pytest.raises(ValueError, match="prepacked_cache must be True, False or a folder, got 3"):
        open_pipe(int4_export, prepacked_cache=3)


def test_prepacked_entry_rewrite():
    moved = prepacked._replace_blobs("MatMulNBits+123|4096;100;0|8192;50;0", lambda offset, length: offset * 2)
    assert moved == "MatMulNBits+123|8192;100;0|16384;50;0"
    with pytest.raises(prepacked.PrepackedCacheError, match="unexpected pre-packed entry"):
        prepacked._replace_blobs("MatMulNBits+123|4096;100", lambda offset, length: offset)


@pytest.mark.slow
def test_more_buckets_add_far_less_than_a_packed_weight_set(wide_int4_export):
    """int4 export of the wide checkpoint (43 MB of packed text weights per session): buckets 64
    and 128 loaded and run after bucket 32 add less than half a packed weight set each (what
    they add is their own activations and kernels); a session of the same graph that packs its
    own weights (the control) adds at least 0.7 of one more than a shared bucket does."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(wide_int4_export)], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    pss, packed = found["pss"], found["packed"]
    assert packed > 30e6, packed
    steps = np.diff(pss)
    report = (
        f"Pss after each bucket, then the control: {[round(p / 1e6) for p in pss]} MB; packed {packed / 1e6:.0f} MB"
    )
    assert all(step < 0.5 * packed for step in steps[:-1]), report
    assert steps[-1] - max(steps[:-1]) > 0.7 * packed, report


def _fake_cache(directory: Path, name: str, nbytes: int, used_ns: int) -> Path:
    """A cache folder of another export: ``nbytes`` of data, last used at ``used_ns``."""
    folder = directory / name
    folder.mkdir(parents=True)
    (folder / "packed.data").write_bytes(b"\0" * nbytes)
    (folder / "index.json").write_text(json.dumps({"key": {"export": str(directory / name), "machine": "x"}}))
    (folder / "use.lock").touch()
    os.utime(folder / "use.lock", ns=(used_ns, used_ns))
    return folder


def test_the_folder_keeps_at_most_its_bound_least_recently_used_go_first(int4_export, tmp_path, monkeypatch):
    """With ``QWEN35_ONNX_PREPACKED_CACHE_MAX_GB`` set, the caches of other exports go, least
    recently used first, until the folder is within the bound (when a cache opens, and after it
    saves a graph); one a process holds stays; the cache opened stays even when it alone is over
    the bound; a bad bound is a warning."""
    import fcntl

    own = open_pipe(int4_export, prepacked_cache=tmp_path / "probe").backend.graphs.prepacked.disk_bytes()
    directory = tmp_path / "cache"
    old, newer, held = (_fake_cache(directory, n, 4_000_000, t * 10**18) for n, t in (("a", 1), ("b", 2), ("c", 0)))
    # what an interrupted save left in its build folder counts; a symlink to a cache is not a cache
    (old / "packed.data").write_bytes(b"\0" * 1_000_000)
    (old / "build").mkdir()
    (old / "build" / "decode.building.data").write_bytes(b"\0" * 3_000_000)
    (directory / "alias").symlink_to(newer)
    with open(held / "use.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # another process uses it
        # room for this export's cache, two of 4 MB and 1.5 MB: "a" (1 MB, 4 MB with its build
        # folder) is the least recently used one no process holds: it goes
        monkeypatch.setenv(prepacked.MAX_ENV, str((own + 2 * 4_000_000 + 1_500_000) / 1e9))
        cache = open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked
        assert not old.exists() and newer.exists() and held.exists() and cache.disk_bytes() == own
        assert (directory / "alias").is_symlink()
        # a bound of 0: every cache no process uses goes; this one and the held one stay
        monkeypatch.setenv(prepacked.MAX_ENV, "0")
        saved = saves(monkeypatch)
        again = open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked
        assert again.path == cache.path and not saved
        assert not newer.exists() and held.exists() and again.path.exists()
    for bad in ("-1", "lots", "inf", "1e300"):
        monkeypatch.setenv(prepacked.MAX_ENV, bad)
        with pytest.warns(
            RuntimeWarning, match=rf"QWEN35_ONNX_PREPACKED_CACHE_MAX_GB='{bad}' is not a finite number of GB >= 0"
        ):
            assert open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked is None


def test_a_build_without_room_first_removes_unused_caches(int4_export, tmp_path, monkeypatch):
    """A disk without room for the next graph: the caches no process uses go (least recently used
    first) before the cache gives up."""
    directory = tmp_path / "cache"
    old = _fake_cache(directory, "a", 1000, 10**18)
    real = shutil.disk_usage

    def usage(path):
        total, used, free = real(path)
        return type(real(path))(total, used, free if not old.exists() else 0)

    monkeypatch.setattr(prepacked.shutil, "disk_usage", usage)
    cache = open_pipe(int4_export, prepacked_cache=directory).backend.graphs.prepacked
    assert cache is not None and not old.exists()


def test_a_folder_removed_while_it_opens_is_made_again(tmp_path, monkeypatch):
    """Another process may remove a cache folder (stale, or over the bound) in the moment between
    its creation and the shared lock, when it is unused: the cache takes its lock again on a new
    folder and is held, not lost."""
    import fcntl

    export = tmp_path / "export"
    (export / "text").mkdir(parents=True)
    (export / "text" / "decode.onnx").write_bytes(b"x")
    first = prepacked.PrepackedCache(export, {}, tmp_path / "cache")
    folder = first.path
    del first
    gc.collect()
    real, removed = fcntl.flock, []

    def flock(fd, operation):
        if operation == fcntl.LOCK_SH and not removed:
            removed.append(folder)
            shutil.rmtree(folder)  # as an evicting process does once it holds the lock
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    cache = prepacked.PrepackedCache(export, {}, tmp_path / "cache")
    assert removed and cache.path == folder and (folder / "use.lock").exists()
    monkeypatch.setattr(fcntl, "flock", real)
    with open(folder / "use.lock") as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held shared by ``cache``
