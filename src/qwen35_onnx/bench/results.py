"""Stored bench results (``qwen35-onnx bench --publish``): what a run says about itself, and where it is kept.

A bench run writes ``bench.json`` (:func:`~.report.report`) with the run's :func:`run_info` (machine,
date, version, command) and its whole report. ``--publish`` stores it (:func:`store`) as the latest result of its
machine and preset, ``benchmarks/results/MACHINE/PRESET.json``; git keeps the earlier ones. The pages made from
the stored results are rendered by :mod:`.render`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RESULTS_DIR",
    "StoredResult",
    "check_result",
    "describe_run",
    "load_results",
    "machine_slug",
    "older_than_package",
    "plain_text",
    "run_info",
    "store",
]

RESULTS_DIR = Path("benchmarks/results")
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where the file is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def run_info(command: list[str] | None = None, program: str = "qwen35-onnx") -> dict:
    """What a stored result says about its run: ``cpu`` (model name), ``cores`` (logical CPUs),
    ``memory_gib`` (MemTotal, GiB), ``cpu_flags`` (those of :data:`_CPU_FLAGS` present), ``date`` (UTC,
    ISO 8601 to the minute), ``version`` (this package's), ``python`` and ``command`` (``command`` or
    the process's arguments, after ``program``: ``qwen35-onnx``, or a script's path such as
    ``benchmarks/kv_tiers.py``)."""
    from .. import __version__

    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) * 1024 / 2**30, 1)
    except OSError:
        pass
    args = list(sys.argv[1:] if command is None else command)
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "cpu_flags": [f for f in _CPU_FLAGS if f in flags],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "version": __version__,
        "python": platform.python_version(),
        "command": shlex.join([program, *args]),
    }


def machine_slug(run: dict) -> str:
    """A folder name for ``run``'s machine: the CPU's model name in lower-case words (without
    ``(R)``, ``(TM)``, "CPU", "Processor", core counts), ``amx`` where it has AMX, and ``Nc`` for its
    cores, e.g. ``amd-epyc-2c``, ``intel-xeon-platinum-8480c-amx-2c``."""
    name = re.sub(r"\((r|tm)\)|\s@.*", " ", str(run.get("cpu") or "").lower())  # no trademarks, no clock
    words = [w for w in re.split(r"[^a-z0-9]+", name) if w and w not in {"cpu", "processor", "core"}]
    words = "-".join(words)[:60].strip("-").split("-") if words else ["unknown-cpu"]
    flags = run.get("cpu_flags")
    if isinstance(flags, list) and "amx_tile" in flags:
        words.append("amx")
    cores = run.get("cores")
    return "-".join(words + [f"{cores if isinstance(cores, int) and not isinstance(cores, bool) else 0}c"])


@dataclass
class StoredResult:
    """One stored bench result (``benchmarks/results/MACHINE/PRESET.json``)."""

    path: Path
    machine: str
    """The folder name (:func:`machine_slug`)."""
    preset: str
    data: dict
    """The bench's ``bench.json``: ``run`` (:func:`run_info` and the bench's options), ``peers``,
    ``bandwidth_gbps``, ``markdown`` (the whole report)."""

    @property
    def run(self) -> dict:
        return self.data["run"]

    def describe(self) -> str:
        """:func:`describe_run` of its run."""
        return describe_run(self.run)


def describe_run(run: dict) -> str:
    """``CPU (N cores, M GiB, flags), DATE, qwen35-onnx VERSION``: the words that name a run (:func:`run_info`'s
    fields; the memory and flags where the run has them)."""
    flags = run.get("cpu_flags")
    details = [f"{run['cores']} cores"]
    if run.get("memory_gib") is not None:
        details.append(f"{run['memory_gib']} GiB")
    if flags is not None:
        details.append(", ".join(map(str, flags)) or "no AVX2")
    return plain_text(f"{run['cpu']} ({', '.join(details)}), {str(run['date'])[:10]}, qwen35-onnx {run['version']}")


def _minor(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version text such as ``0.9.3`` (missing or non-numeric parts read as 0)."""
    parts = (str(version).split(".") + ["0", "0"])[:2]
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


def older_than_package(version: str) -> bool:
    """Whether a result measured with qwen35-onnx ``version`` is older than this package's minor version (0.9.3
    against 0.14.0: yes; 0.14.0 against 0.14.2: no): its exports or code may have changed since."""
    from .. import __version__

    return _minor(version) < _minor(__version__)


def plain_text(value) -> str:
    """Stored text as it goes into a page: no HTML comment markers (the pages' rendered blocks are delimited by
    them), no table or code delimiters."""
    return re.sub(r"<!--|-->|[|`]", " ", str(value))


def load_results(results_dir: Path = RESULTS_DIR) -> list[StoredResult]:
    """Every stored result under ``results_dir``, sorted by machine then preset.

    Raises:
        ValueError: a file that is not a bench result (not JSON, or without ``run``, ``peers`` or
            ``markdown``), naming it.
    """
    results = []
    for path in sorted(Path(results_dir).glob("*/*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a bench result ({exc})") from None
        check_result(data, path)
        if data["run"].get("preset", path.stem) != path.stem:
            raise ValueError(f"{path}: holds a run of preset {data['run']['preset']!r}, not {path.stem!r}")
        results.append(StoredResult(path, path.parent.name, path.stem, data))
    return results


_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,80}")
"""What a machine folder or a preset may be called (no path separators, no ``..``)."""


def check_result(data, where) -> None:
    """Check that ``data`` is a bench result as ``bench.json`` stores it: a dict with ``run`` (a dict:
    ``cpu``, ``date``, ``version``, ``command`` strings, ``cores`` a positive integer, ``cpu_flags`` a
    list), ``peers`` (a list of dicts with a ``name`` string and ``prefill_ms`` / ``decode_ms`` dicts of
    length (integer text) -> milliseconds, and where present ``peak_rss_by_length``: length -> bytes),
    ``markdown`` (a string).

    Raises:
        ValueError: the first thing that is not so, naming ``where`` and the field.
    """

    def fail(what: str):
        raise ValueError(f"{where}: not a bench result: {what} (write it with bench --publish)")

    if not isinstance(data, dict):
        fail(f"a JSON {type(data).__name__}, not an object")
    missing = [k for k in ("run", "peers", "markdown") if k not in data]
    if missing:
        fail(f"no {', '.join(missing)}")
    run, peers = data["run"], data["peers"]
    if not isinstance(run, dict):
        fail("run is not an object")
    for key in ("cpu", "date", "version", "command"):
        if not isinstance(run.get(key), str) or not run[key]:
            fail(f"run.{key} is not a text")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}Z", run["date"]):
        fail(f"run.date {run['date']!r} is not YYYY-MM-DDTHH:MMZ")
    if isinstance(run.get("cores"), bool) or not isinstance(run.get("cores"), int) or run["cores"] < 1:
        fail(f"run.cores {run.get('cores')!r} is not a positive integer")
    if not isinstance(run.get("cpu_flags", []), list):
        fail("run.cpu_flags is not a list")
    if "preset" in run and not (isinstance(run["preset"], str) and _NAME.fullmatch(run["preset"])):
        fail(f"run.preset {run['preset']!r} is not a preset name")
    if not isinstance(data["markdown"], str):
        fail("markdown is not a text")
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        fail("peers is not a list of objects")
    for p in peers:
        if not isinstance(p.get("name"), str):
            fail("a peer without a name")
        for field in ("prefill_ms", "decode_ms"):
            times = p.get(field)
            if not isinstance(times, dict) or not all(
                str(n).isdigit() and isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0
                for n, ms in times.items()
            ):
                fail(f"{p['name']}: {field} is not lengths -> positive milliseconds")
        by_length = p.get("peak_rss_by_length", {})
        if not isinstance(by_length, dict) or not all(
            str(n).isdigit() and isinstance(b, int) and not isinstance(b, bool) and b > 0 for n, b in by_length.items()
        ):
            fail(f"{p['name']}: peak_rss_by_length is not lengths -> positive bytes")
        for field in ("e2e_tokens_per_s", "peak_rss_bytes"):
            if not isinstance(p.get(field), (int, float, type(None))) or isinstance(p.get(field), bool):
                fail(f"{p['name']}: {field} is not a number")
        if not isinstance(p.get("image"), (dict, type(None))):
            fail(f"{p['name']}: image is not an object")


def store(bench_dir: Path, root: Path = Path(".")) -> Path:
    """Store the run in ``bench_dir`` (its ``bench.json``) as the latest result of its machine and preset under
    ``root`` (a checkout of the repository), written to a temporary sibling renamed into place. Returns the
    stored file (``benchmarks/results/MACHINE/PRESET.json``).

    Raises:
        ValueError: ``bench_dir`` has no ``bench.json`` with the run's information, it is not a bench result
            (:func:`check_result`; nothing is written then), or ``root`` is not the repository's root.
    """
    source = Path(bench_dir) / "bench.json"
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
        preset = data["run"]["preset"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{source}: no bench result with its run to publish ({exc!r})") from None
    check_result(data, source)  # before anything is written: a bad run never replaces a stored one
    if not (Path(root) / "benchmarks" / "protocol.md").is_file():
        raise ValueError(f"--publish writes benchmarks/results/ of the repository: run it from the root ({root})")
    data.pop("plot", None)  # the pages' charts are drawn from the figures by bench --render
    target = Path(root) / RESULTS_DIR / machine_slug(data["run"]) / f"{preset}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.publishing")
    try:
        staging.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target
