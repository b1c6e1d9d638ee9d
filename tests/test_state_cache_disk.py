"""Kept states on disk (issue 54, item 5): the snapshot file format (any dtype, crash-safe writes, damage found by
its checks), the folder's byte bound and LRU order, a restart (another cache, another Pipeline, another server on
the folder) that continues from the disk with the tokens of a cold run, a new session with the same system prompt
and tools that starts after them, and what must never break a request: damaged, truncated or foreign files, a full
disk, a folder that is a file or cannot be written in."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

from qwen35_onnx.pipeline import Pipeline
from qwen35_onnx.runtime import snapshot_disk, snapshot_files
from qwen35_onnx.runtime.sampling import SamplingConfig
from qwen35_onnx.runtime.snapshot_disk import DiskSnapshotCache, StateCacheFolderError
from qwen35_onnx.runtime.snapshot_files import (
    SnapshotFileError,
    load_snapshot,
    read_snapshot_file,
    snapshot_file_name,
    write_snapshot,
)
from qwen35_onnx.runtime.snapshots import StateSnapshot

GREEDY = SamplingConfig()
NO_THINKING = {"enable_thinking": False}
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
"""One small tool: the test template's tool preamble takes about 200 of the export's 256 tokens."""
SYSTEM = {"role": "system", "content": "Be brief."}
EXPORT = "0123456789abcdef"


def _session(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


# ---- the file format and the folder, on synthetic snapshots ------------------------------------
def _contract(capacity: int = 64) -> SimpleNamespace:
    """What the disk cache reads of a contract: capacity, state shapes and dtypes."""
    c = SimpleNamespace(capacity=capacity, conv_state_shape=(2, 1, 3, 8), recurrent_state_shape=(2, 1, 2, 4, 4))
    c.state_dtype = lambda state: "fp32"
    c.kv_shape = lambda n=None: (2, 1, 2, capacity if n is None else n, 4)
    c.state_shape = lambda state: {"conv_states": c.conv_state_shape, "recurrent_states": c.recurrent_state_shape}[
        state
    ]
    return c


def _snapshot(ids, kv_dtype=np.float32, export=EXPORT, capacity=64) -> StateSnapshot:
    ids = np.asarray(ids, dtype=np.int64)
    rng = np.random.default_rng(len(ids))
    return StateSnapshot(
        export,
        capacity,
        ids,
        ("digest-a",),
        rng.standard_normal((2, 1, 3, 8)).astype(np.float32),
        rng.standard_normal((2, 1, 2, 4, 4)).astype(np.float32),
        rng.standard_normal((2, 1, 2, len(ids), 4)).astype(kv_dtype),
    )


def test_snapshot_files_keep_any_dtype_and_shape_and_load_as_read_only_maps(tmp_path):
    """fp16, int8 and bf16 KV and optional arrays (the MTP head's) come back bit for bit with their dtypes, as
    read-only views of the file (no copy); the plain fields too."""
    import ml_dtypes

    for dtype in (np.float16, np.int8, ml_dtypes.bfloat16):
        snap = _snapshot([5, 6, 7], dtype)
        snap = dataclasses.replace(
            snap, reply=True, mtp_kv=np.ones((2, 1, 2, 1, 4), np.float16), mtp_hidden=np.zeros((2, 8), np.float32)
        )
        path = tmp_path / snapshot_file_name(snap)
        size = write_snapshot(path, snap)
        assert size == path.stat().st_size <= snapshot_files.file_bytes(snap)
        back = load_snapshot(path)
        for name in ("token_ids", "conv_states", "recurrent_states", "kv_cache", "mtp_kv", "mtp_hidden"):
            ours, theirs = getattr(back, name), getattr(snap, name)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert ours.tobytes() == theirs.tobytes() and not ours.flags.writeable
        assert (back.export, back.capacity, back.images, back.reply) == (EXPORT, 64, ("digest-a",), True)
        assert read_snapshot_file(path).length == 3


def test_damaged_files_fail_their_checks_and_a_crash_mid_write_leaves_no_file(tmp_path, monkeypatch):
    snap = _snapshot(range(10))
    path = tmp_path / "a.state"
    size = write_snapshot(path, snap)
    whole = path.read_bytes()
    kv = next(e for e in read_snapshot_file(path).header["arrays"] if e["name"] == "kv_cache")
    damages = {
        "truncated": whole[: size - 7],
        "kv byte flipped": whole[: kv["offset"] + 3] + bytes([whole[kv["offset"] + 3] ^ 1]) + whole[kv["offset"] + 4 :],
        "header byte flipped": whole[:40] + bytes([whole[40] ^ 1]) + whole[41:],
        "other format": b"PK\x03\x04" + whole[4:],
        "empty": b"",
    }
    for what, data in damages.items():
        path.write_bytes(data)
        with pytest.raises(SnapshotFileError):
            load_snapshot(path)
        if what != "kv byte flipped":  # (the index reads the header and token ids only)
            with pytest.raises(SnapshotFileError):
                read_snapshot_file(path)

    def crash(*args):
        raise KeyboardInterrupt  # the process dies between the write and the rename

    monkeypatch.setattr(snapshot_files.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(tmp_path / "b.state", snap)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.state"]  # no b.state, no temporary file


def test_the_folder_keeps_to_its_byte_bound_least_recently_used_out(tmp_path):
    """Four snapshots in a folder bounded to two and a half of them: the oldest files go first, a hit renews
    its file's place, the bound holds; a second cache on the folder (a restart) serves what is there."""
    snaps = [_snapshot(list(range(1, 9)) + [k]) for k in range(4)]
    one = snapshot_files.file_bytes(snaps[0])
    bound = one * 5 // 2
    with DiskSnapshotCache(1 << 20, tmp_path, EXPORT, _contract(), bound) as cache:
        for snap in snaps[:2]:
            cache.put(snap)
            cache.flush()
        assert cache.stats()["disk_snapshots"] == 2
        os.utime(cache.folder / snapshot_file_name(snaps[0]), (1, 1))  # made the oldest ...
    with DiskSnapshotCache(1 << 20, tmp_path, EXPORT, _contract(), bound) as cache:
        prompt = np.array([*range(1, 9), 0, 99])
        assert cache.longest_prefix(EXPORT, prompt, ("digest-a",)).length == 9  # ... and renewed by a hit
        cache.put(snaps[2])
        cache.flush()
        names = {p.name for p in cache.folder.iterdir()}
        assert names == {snapshot_file_name(s) for s in (snaps[0], snaps[2])}  # snaps[1] was the least recent
        cache.put(snaps[3])
        cache.flush()
        stats = cache.stats()
        assert stats["disk_bytes"] <= bound and stats["disk_snapshots"] == 2 and stats["disk_hits"] == 1
    too_small = snapshot_files.file_bytes(_snapshot([1])) // 2
    with pytest.raises(ValueError, match=f"disk limit {too_small} bytes is below one state snapshot file"):
        DiskSnapshotCache(1 << 20, tmp_path, EXPORT, _contract(), too_small)


def test_a_folder_that_is_a_file_or_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch):
    afile = tmp_path / "cache"
    afile.write_text("not a folder")
    for path, message in ((afile, "is a file, not a folder"), (afile / "below", "cannot be used: Not a directory")):
        with pytest.raises(StateCacheFolderError, match=f"state cache folder '{path}' {message}"):
            DiskSnapshotCache(1 << 20, path, EXPORT, _contract())

    def refused(*args, **kwargs):  # (chmod does not stop root: the file system's refusal, as it would come)
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ro" / EXPORT))

    monkeypatch.setattr(snapshot_disk.tempfile, "mkstemp", refused)
    with pytest.raises(StateCacheFolderError, match="'.*ro' cannot be used: Permission denied"):
        DiskSnapshotCache(1 << 20, tmp_path / "ro", EXPORT, _contract())


# ---- on an export ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def export(image_exports):
    """The chunked ``--ops ort`` image export of conftest (capacity 256, chunks 8 and 32), shared with
    tests/test_chunked_prefill.py and tests/test_vision_grids.py."""
    return image_exports("any-ort")


@pytest.fixture(scope="module")
def pipe(export):
    return Pipeline.from_exported(export, threads=1)


def _chat(pipe, messages, cache=None, n=4):
    return pipe.chat(messages, n, GREEDY, chat_template_kwargs=NO_THINKING, tools=TOOLS, state_cache=cache)


def test_the_stable_prefix_is_a_snapshot_point_even_where_the_template_refuses_system_messages_alone(pipe):
    """The end of the system prompt and tools is among the points a prompt keeps: with a system message, with
    tools alone, and with a template that refuses a conversation without a user message (as Qwen3.5's does)."""
    tokenizer = pipe.preprocessor.tokenizer
    original = tokenizer.chat_template
    strict = (
        "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 -%}"
        "{{ raise_exception('No user query found in messages.') }}{%- endif -%}" + original
    )
    try:
        for template in (original, strict):
            tokenizer.chat_template = template
            for tools, messages in ((TOOLS, _session), (None, _session), (TOOLS, lambda q: _session(q)[1:])):
                reply = pipe.reply_format(tools)
                one, other = (pipe.prepare_chat(messages(q), NO_THINKING, reply=reply) for q in ("Hi.", "Why?"))
                a, b = one.input_ids[0], other.input_ids[0]
                common = int(np.argmax(a[: len(b)] != b[: len(a)]))
                assert common in one.snapshot_points and common in other.snapshot_points, (tools, messages)
            no_system = pipe.prepare_chat([{"role": "user", "content": "Hi."}], NO_THINKING)
            assert len(no_system.snapshot_points) == 1  # the history's end alone
    finally:
        tokenizer.chat_template = original


@pytest.mark.slow
def test_a_restart_continues_from_disk_with_the_tokens_of_a_cold_run(pipe, export, tmp_path):
    """Session 1 through a cache on a folder; then another Pipeline on another cache on the folder (a restarted
    process): a new session with the same system prompt and tools and another question starts after them, read
    from disk, and session 1's next turn after its history; each gives the tokens of a cold run, with the disk's
    tokens in ``cached_tokens``."""
    first = _session("List the files.")
    with pipe.state_cache(1 << 26, tmp_path) as cache:
        one = _chat(pipe, first, cache)
        assert one.generation.cached_tokens == 0
    written = cache.stats()
    assert written["disk_snapshots"] >= 2 and written["disk_written_bytes"] == written["disk_bytes"] > 0
    stable, history = pipe.prepare_chat(first, NO_THINKING, reply=pipe.reply_format(TOOLS)).snapshot_points
    again = Pipeline.from_exported(export, threads=1)
    assert again.backend.export_id == pipe.backend.export_id
    second = _session("What does read_file do?")
    turn = [*first, {"role": "assistant", "content": one.content}, {"role": "user", "content": "And then?"}]
    with again.state_cache(1 << 26, tmp_path) as cache:
        new_session = _chat(again, second, cache)
        next_turn = _chat(again, turn, cache)
        stats = cache.stats()
    assert new_session.generation.cached_tokens == stable > 0
    assert new_session.generation.token_ids == _chat(pipe, second).generation.token_ids
    assert next_turn.generation.cached_tokens >= history  # the history (or the reply), from disk
    assert next_turn.generation.token_ids == _chat(pipe, turn).generation.token_ids
    assert stats["disk_hits"] == 2 and stats["cached_tokens"] == stable + next_turn.generation.cached_tokens


@pytest.mark.slow
def test_damaged_foreign_files_and_a_full_disk_are_warned_and_served_from_scratch(pipe, tmp_path, caplog, monkeypatch):
    """Each kept file of the system prompt's state damaged in turn (truncated, a byte flipped, another export's
    and another capacity's state under this export's name): one warning, never loaded, the request prefilled
    with the tokens of a cold run; a full disk: one warning, the state kept in memory, nothing on disk."""
    question = _session("Show the first file.")
    cold = _chat(pipe, question).generation.token_ids
    with pipe.state_cache(1 << 26, tmp_path / "good") as cache:
        _chat(pipe, _session("List the files."), cache)
    stable = min(pipe.prepare_chat(question, NO_THINKING, reply=pipe.reply_format(TOOLS)).snapshot_points)
    kept = {info.length: path for path in cache.folder.iterdir() for info in [read_snapshot_file(path)]}
    original = load_snapshot(kept[stable])
    other_export = dataclasses.replace(original, export="fedcba9876543210")
    other_capacity = dataclasses.replace(original, capacity=512)
    damages = {
        "truncated": lambda path: path.write_bytes(path.read_bytes()[:-100]),
        "flipped": lambda path: _flip(path, -100),
        "other export": lambda path: write_snapshot(path, other_export),
        "other capacity": lambda path: write_snapshot(path, other_capacity),
    }
    for what, damage in damages.items():
        folder = tmp_path / what.replace(" ", "-") / pipe.backend.export_id
        folder.mkdir(parents=True)
        target = folder / kept[stable].name
        target.write_bytes(kept[stable].read_bytes())
        damage(target)
        caplog.clear()
        with caplog.at_level(logging.WARNING), pipe.state_cache(1 << 26, folder.parent) as cache:
            for _ in range(2):  # warned once, not at every lookup
                result = _chat(pipe, question, cache)
                assert result.generation.token_ids == cold, what
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "kept state" in r.getMessage()]
        assert len(warnings) == 1 and str(target) in warnings[0].getMessage(), (what, caplog.text)
        assert cache.stats()["disk_rejected"] == 1 and cache.stats()["disk_hits"] == 0, what

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_files.os, "fsync", full)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pipe.state_cache(1 << 26, tmp_path / "full") as cache:
        first = _chat(pipe, _session("List the files."), cache)
        cache.flush()
        second = _chat(pipe, question, cache)  # the system prompt's state, from memory
    assert second.generation.token_ids == cold and second.generation.cached_tokens == stable
    assert first.generation.cached_tokens == 0
    stats = cache.stats()
    assert stats["disk_write_errors"] >= 2 and stats["disk_snapshots"] == 0 and stats["disk_bytes"] == 0
    assert not list(cache.folder.iterdir())  # no file, no temporary file
    full_warnings = [r for r in caplog.records if "no space left on device" in r.getMessage()]
    assert len(full_warnings) == 1, caplog.text


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_restarted_server_serves_a_seen_system_prompt_from_disk(pipe, tmp_path):
    """Two servers one after the other on one --state-cache-dir: the second answers a new session with the first's
    system prompt and tools from disk (``cached_tokens``, /metrics' disk hits) with a cold run's reply; bad folders
    are one error at startup naming the option and the path."""
    import httpx

    from qwen35_onnx.server.app import create_app
    from qwen35_onnx.server.options import ServerOptions

    from .test_server import in_process_server

    def ask(url: str, messages: list[dict]) -> dict:
        body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, "tools": TOOLS}
        body["chat_template_kwargs"] = NO_THINKING
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    options = {"state_cache_dir": tmp_path / "states", "state_cache_bytes": 1 << 26}
    with in_process_server(pipe, **options) as url:
        assert ask(url, _session("List the files."))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = _session("Show the first file.")
    with in_process_server(pipe, **options) as url:
        reply = ask(url, second)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    stable = min(pipe.prepare_chat(second, NO_THINKING, reply=pipe.reply_format(TOOLS)).snapshot_points)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == stable
    assert reply["choices"][0]["message"]["content"] == _chat(pipe, second).content
    assert "qwen35_onnx_state_cache_disk_hits_total 1.0" in metrics
    assert 'qwen35_onnx_state_cache_bytes{tier="disk"}' in metrics
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValueError, match=f"--state-cache-dir: state cache folder '{afile}' is a file, not a folder"):
        create_app(pipe, ServerOptions("m", state_cache_dir=afile))
    with pytest.raises(ValueError, match="--state-cache-disk-bytes: state cache disk limit 10 bytes is below one"):
        create_app(pipe, ServerOptions("m", state_cache_dir=tmp_path / "x", state_cache_disk_bytes=10))
    with pytest.raises(ValueError, match="--state-cache-dir needs kept states in memory too"):
        create_app(pipe, ServerOptions("m", state_cache_dir=tmp_path / "x", state_cache_bytes=0))
