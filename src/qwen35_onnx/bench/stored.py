"""The stored result files of every bench (``benchmarks/**/*.json``) as the rendered pages read them: each file's
run (machine, date, version, command), the caption that names it, and the labels of checkpoint sizes.

The side-by-side bench's results (``benchmarks/results/MACHINE/PRESET.json``) are :mod:`.results`'s; the others
are written by their own benches and stored as ``benchmarks/KIND/MACHINE-NAME.json`` (``bench --streams``,
``bench --speculative``, ``benchmarks/video_bench.py``, ``benchmarks/cluster_load.py`` ...), or as one file
(``benchmarks/grammar_vocab.json``, whose run is under ``machine``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .results import describe_run, machine_slug, older_than_package, plain_text

__all__ = [
    "StoredRun",
    "by_machine",
    "caption",
    "describe_runs",
    "short_run",
    "load_run",
    "load_runs",
    "model_name",
    "size_label",
    "stale_note",
]


@dataclass
class StoredRun:
    """One stored result file."""

    path: Path
    """From the repository's root (as the pages name it)."""
    data: dict
    run: dict
    """``cpu``, ``cores``, ``date``, ``version``, ``command`` (and ``memory_gib``, ``cpu_flags`` where stored)."""

    @property
    def machine(self) -> str:
        """:func:`~.results.machine_slug` of its run."""
        return machine_slug(self.run)

    @property
    def name(self) -> str:
        """What the file name says after the machine: ``amd-epyc-2c-qwen3.5-4b.json`` -> ``qwen3.5-4b``.

        Raises:
            ValueError: a file name that does not start with its run's machine.
        """
        prefix = f"{self.machine}-"
        if not self.path.stem.startswith(prefix):
            raise ValueError(f"{self.path}: its name must start with its run's machine, {prefix!r}")
        return self.path.stem[len(prefix) :]


def _run_of(data, path: Path) -> dict:
    """The run of a stored file: its ``run``, or the ``machine`` block of ``benchmarks/grammar_vocab.json``."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a stored result (a JSON {type(data).__name__}, not an object)")
    if "run" in data:
        run = data["run"]
    elif isinstance(data.get("machine"), dict):
        machine = data["machine"]
        run = {
            "cpu": machine.get("cpu"),
            "cores": machine.get("cores"),
            "date": machine.get("date"),
            "version": (machine.get("versions") or {}).get("qwen35-onnx"),
            "command": f"benchmarks/{path.stem}.py",
        }
    else:
        raise ValueError(f"{path}: not a stored result: no run (machine, date, version)")
    for key in ("cpu", "date", "version", "command"):
        if not isinstance(run.get(key), str) or not run[key]:
            raise ValueError(f"{path}: not a stored result: run.{key} is not a text")
    if isinstance(run.get("cores"), bool) or not isinstance(run.get("cores"), int) or run["cores"] < 1:
        raise ValueError(f"{path}: not a stored result: run.cores {run.get('cores')!r} is not a positive integer")
    return run


def load_run(root: Path, path: Path) -> StoredRun:
    """The stored result ``path`` (relative to ``root``, the repository's root).

    Raises:
        ValueError: a file that cannot be read as JSON, or without its run, naming it.
    """
    try:
        data = json.loads((Path(root) / path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a stored result ({exc})") from None
    return StoredRun(Path(path), data, _run_of(data, Path(path)))


def load_runs(root: Path, folder: str) -> list[StoredRun]:
    """Every stored result ``benchmarks/FOLDER/*.json`` under ``root``, sorted by file name.

    Raises:
        ValueError: as :func:`load_run`.
    """
    base = Path(root) / "benchmarks" / folder
    return [load_run(root, p.relative_to(root)) for p in sorted(base.glob("*.json"))]


def by_machine(runs: list[StoredRun]) -> dict[str, dict[str, StoredRun]]:
    """``runs`` grouped by machine, each group's files by :attr:`StoredRun.name`, checkpoint sizes ascending."""
    groups: dict[str, dict[str, StoredRun]] = {}
    for run in runs:
        groups.setdefault(run.machine, {})[run.name] = run
    return {m: dict(sorted(g.items(), key=lambda item: _size(item[0]))) for m, g in sorted(groups.items())}


def _size(preset: str) -> tuple[float, str]:
    found = re.search(r"(\d+(?:\.\d+)?)b$", preset)
    return (float(found.group(1)) if found else 0.0, preset)


def size_label(preset: str) -> str:
    """``qwen3.5-0.8b`` -> ``0.8B``; other names as they are."""
    found = re.fullmatch(r"qwen3\.5-(\d+(?:\.\d+)?)b", preset)
    return f"{found.group(1)}B" if found else preset


def model_name(preset: str) -> str:
    """``qwen3.5-0.8b`` -> ``Qwen3.5-0.8B`` (the published model's name); other names as they are."""
    label = size_label(preset)
    return f"Qwen3.5-{label}" if label != preset else preset


def stale_note(version: str) -> str:
    """`` (older than this version, X.Y.Z)`` where ``version`` is older than this package's minor version, else
    nothing: the figures may not hold for the current code."""
    from .. import __version__

    return f" (**older than this version, {__version__}**)" if older_than_package(version) else ""


def describe_runs(runs: list[StoredRun], labels: list[str] | None = None) -> str:
    """Each run's machine, date and version (:func:`stale_note` where it is older than this package); runs that share
    them are named once, others each after its label (``labels``; default: the file names)."""
    described = [describe_run(r.run) + stale_note(r.run["version"]) for r in runs]
    if len(set(described)) == 1:
        return described[0]
    names = labels or [r.path.name for r in runs]
    return "; ".join(f"{n}: {d}" for n, d in zip(names, described))


def short_run(run: dict) -> str:
    """``CPU N cores, DATE, vVERSION`` (:func:`stale_note`'s mark where it is older than this package): a run named
    in a sentence."""
    return plain_text(f"{run['cpu']} {run['cores']} cores, {str(run['date'])[:10]}, v{run['version']}") + stale_note(
        run["version"]
    )


def caption(runs: list[StoredRun], labels: list[str] | None = None) -> str:
    """The line that names the runs of a table: :func:`describe_runs`, the files and the commands."""
    several = len({describe_run(r.run) for r in runs}) > 1
    files = ", ".join(f"`{r.path.as_posix()}`" for r in runs)
    commands = list(dict.fromkeys(plain_text(r.run["command"]) for r in runs))
    return " ".join(
        [
            f"Run{'s' if several else ''}: {describe_runs(runs, labels)}.",
            f"File{'s' if len(runs) > 1 else ''}: {files}.",
            f"Command{'s' if len(commands) > 1 else ''}: " + "; ".join(f"`{c}`" for c in commands) + ".",
        ]
    )
