"""``qwen35-onnx bench --render`` (and ``--publish``): every figure of the README and the documentation written from
the stored results, never typed by hand.

A page holds a rendered block between two markers, each on a line of its own, ``<!-- begin rendered: NAME -->``
and ``<!-- end rendered: NAME -->``; :data:`BLOCKS` says what each NAME is rendered from. The renderer also writes
the whole benchmarks page (``benchmarks/README.md`` and ``docs/benchmarks.md``) and the charts
(``docs/assets/bench/*.svg``). ``tests/test_docs.py`` renders everything again and fails on any difference, so a
figure edited by hand, a stored result changed without rendering, or a version bump that makes a result older
than the package, shows there.

Written into the Markdown files (not by a mkdocs hook at site build) because the README and the pages are read
on GitHub too, where no hook runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from . import run_tables
from .headline import CHARTS_DIR, benchmarks_page, charts, export_cost, headline
from .results import RESULTS_DIR, load_results, plain_text, store
from .stored import describe_runs, load_run, load_runs

__all__ = ["BLOCKS", "PAGES", "begin", "end", "publish", "render_all", "rendered_pages", "stale_files"]

BLOCKS: dict[str, Callable[[Path, Path], str]] = {
    "headline": headline,
    "export-cost": export_cost,
    "streams-decode": run_tables.streams_decode,
    "streams-steps": run_tables.streams_steps,
    "streams-servers": run_tables.streams_servers,
    "speculative-costs": run_tables.speculative_costs,
    "speculative-rates": run_tables.speculative_rates,
    "speculative-llamacpp": run_tables.speculative_llamacpp,
    "speculative-summary": run_tables.speculative_summary,
    "speculative-readme": run_tables.speculative_readme,
    "cluster": run_tables.cluster,
    "video-ttft": run_tables.video_ttft,
    "video-openvino-grids": run_tables.video_openvino_grids,
    "video-decoders": run_tables.video_decoders,
    "grammar": run_tables.grammar,
    "state-cache": run_tables.state_cache,
    "kv-token-bytes": run_tables.kv_token_bytes,
    "kv-tiers": run_tables.kv_tiers,
    "capacity-memory": run_tables.capacity_memory,
    "kv-precision": run_tables.kv_precision,
}
"""Block name -> its renderer: ``(repository root, page from the root) -> Markdown``."""
COMPUTED_BLOCKS = ("kv-token-bytes",)
"""Blocks computed from the code's own data (the published configurations), not from a stored run."""

PAGES = ("README.md", "CONTRIBUTING.md", "docs")
"""Where rendered blocks may be: these files and every Markdown file under these folders."""
WHOLE_PAGES = (Path("benchmarks/README.md"), Path("docs/benchmarks.md"))
"""Pages rendered whole (the benchmarks page, twice: in the repository and on the site)."""
SHOWN_IN = {
    "benchmarks/streams": "docs/runtime.md#decode-slots",
    "benchmarks/speculative": "docs/runtime.md#speculative-decoding",
    "benchmarks/cluster": "docs/cluster.md#measured",
    "benchmarks/video": "docs/video.md#measured",
    "benchmarks/grammar_vocab.json": "docs/server.md#structured-output-json-schema",
    "benchmarks/state_cache": "docs/runtime.md#prefill-at-run-time-and-kept-states",
    "benchmarks/kv_tiers": "docs/export.md#kv-tiers",
    "benchmarks/capacity": "docs/export.md#capacity-and-the-kv-cache",
    "benchmarks/kv_precision": "docs/export.md#kv-cache-precision",
}
"""Stored results outside ``benchmarks/results/`` -> the page section that renders them (for the benchmarks
page's index)."""

_BLOCK = re.compile(r"^<!-- begin rendered: ([\w-]+) -->\n.*?^<!-- end rendered: \1 -->$", re.S | re.M)
"""A rendered block: the markers each on a line of their own (a marker quoted inside a line is text)."""
_BEGIN = re.compile(r"^<!-- begin rendered: ([\w-]*) -->$", re.M)


def begin(name: str) -> str:
    """The marker a rendered block starts with."""
    return f"<!-- begin rendered: {name} -->"


def end(name: str) -> str:
    """The marker a rendered block ends with."""
    return f"<!-- end rendered: {name} -->"


def _fill(text: str, page: Path, root: Path) -> str:
    """``text`` (the page ``page``) with each rendered block written again from its stored results.

    Raises:
        ValueError: a block name :data:`BLOCKS` does not know, or a begin marker without its end, naming the page.
    """
    names = _BEGIN.findall(text)
    unknown = sorted(set(names) - set(BLOCKS))
    if unknown:
        raise ValueError(f"{page}: unknown rendered block(s) {unknown} (known: {', '.join(BLOCKS)})")
    blocks = _BLOCK.findall(text)
    if len(blocks) != len(names):
        missing = [n for n in names if names.count(n) != blocks.count(n)]
        raise ValueError(f"{page}: the rendered block {missing[0]!r} has no {end(missing[0])} after its begin marker")
    return _BLOCK.sub(lambda m: f"{begin(m[1])}\n{BLOCKS[m[1]](root, page).strip()}\n{end(m[1])}", text)


def _pages(root: Path) -> list[Path]:
    """The pages that may hold rendered blocks (from the root), without the ones rendered whole."""
    found = []
    for entry in PAGES:
        path = Path(root) / entry
        found += [path] if path.is_file() else sorted(path.rglob("*.md"))
    return [p.relative_to(root) for p in found if p.relative_to(root) not in WHOLE_PAGES]


def _index(root: Path, page: Path) -> list[str]:
    """The benchmarks page's list of every stored result file: its run, its command, and the page showing it."""
    lines = []
    for result in load_results(Path(root) / RESULTS_DIR):
        stored = load_run(root, result.path.relative_to(root))
        lines.append(_index_line(stored, page, None))  # shown on this page
    for source, shown in SHOWN_IN.items():
        if source.endswith(".json"):
            files = [load_run(root, Path(source))] if (Path(root) / source).is_file() else []
        else:
            files = load_runs(root, source.removeprefix("benchmarks/"))
        lines += [_index_line(stored, page, shown) for stored in files]
    return lines


def _index_line(stored, page: Path, shown: str | None) -> str:
    where = ""
    if shown:
        target, _, anchor = shown.partition("#")
        link = Path(os.path.relpath(target, page.parent)).as_posix() + (f"#{anchor}" if anchor else "")
        where = f"; shown in [{target.removeprefix('docs/')}]({link})"
    return (
        f"- `{stored.path.as_posix()}`: {describe_runs([stored])}; command `{plain_text(stored.run['command'])}`"
        f"{where}."
    )


def rendered_pages(root: Path = Path(".")) -> dict[Path, str]:
    """Everything the renderer writes under ``root`` (a checkout of the repository): path (from the root) -> text.
    Every page with rendered blocks (:data:`PAGES`), the benchmarks pages (:data:`WHOLE_PAGES`) and the charts.

    Raises:
        ValueError: a stored result that cannot be read, a page with an unknown or unterminated block, or ``root``
            without ``benchmarks/protocol.md`` (not the repository's root).
    """
    root = Path(root)
    if not (root / "benchmarks" / "protocol.md").is_file():
        raise ValueError(f"{root / 'benchmarks' / 'protocol.md'} is missing: run from the repository's root")
    out: dict[Path, str] = {}
    for page in _pages(root):
        try:
            text = (root / page).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{page}: cannot be read ({exc})") from None
        if _BEGIN.search(text):
            out[page] = _fill(text, page, root)
    for page in WHOLE_PAGES:
        out[page] = benchmarks_page(root, page, _index(root, page))
    out.update(charts(root))
    return out


def _strays(root: Path, rendered: dict[Path, str]) -> list[Path]:
    """Charts under :data:`~.headline.CHARTS_DIR` that nothing renders any more (a removed result's)."""
    folder = Path(root) / CHARTS_DIR
    return [
        p.relative_to(root) for p in sorted(folder.glob("*")) if p.is_file() and p.relative_to(root) not in rendered
    ]


def stale_files(root: Path = Path(".")) -> list[Path]:
    """The files under ``root`` that differ from what :func:`rendered_pages` renders, or that it no longer renders
    (charts of removed results): what ``bench --render`` would change.

    Raises:
        ValueError: as :func:`rendered_pages`.
    """
    return _stale(root, rendered_pages(root))


def _stale(root: Path, rendered: dict[Path, str]) -> list[Path]:
    stale = []
    for path, text in rendered.items():
        target = Path(root) / path
        try:
            if target.read_text(encoding="utf-8") == text:
                continue
        except (OSError, UnicodeDecodeError):
            pass
        stale.append(path)
    return stale + _strays(root, rendered)


def render_all(root: Path = Path(".")) -> list[Path]:
    """Write :func:`rendered_pages` under ``root`` (everything is rendered before anything is written; each file
    goes to a temporary sibling renamed into place) and remove the charts nothing renders; returns what changed.

    Raises:
        ValueError: as :func:`rendered_pages`, or a file that cannot be written (naming it).
    """
    rendered = rendered_pages(root)
    changed = []
    for path in _stale(root, rendered):
        target = Path(root) / path
        try:
            if path not in rendered:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.with_name(f".{target.name}.rendering")
                staging.write_text(rendered[path], encoding="utf-8")
                os.replace(staging, target)
        except OSError as exc:
            raise ValueError(f"{target}: cannot write the rendered file ({exc})") from None
        changed.append(path)
    return changed


def publish(bench_dir: Path, root: Path = Path(".")) -> Path:
    """Store the run in ``bench_dir`` (:func:`~.results.store`) and :func:`render_all`; returns the stored file.

    Raises:
        ValueError: as :func:`~.results.store` (nothing is written then) or :func:`render_all`.
    """
    target = store(bench_dir, root)
    render_all(root)
    return target
