"""The documentation: every table and chart of measured figures is rendered from the stored results and
matches them (a figure edited by hand fails), no figure is typed by hand outside a rendered block, the CLI
reference and every option the pages name agree with the option declarations (defaults included), the
messages the troubleshooting page quotes are the program's, the README stays a README. (The site itself is
built in strict mode by `make docs`.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from qwen35_onnx.bench import headline, render
from qwen35_onnx.bench import results as stored

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""The pages a reader sees (the site includes CONTRIBUTING.md and CHANGELOG.md)."""
GENERATED = {ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "reference" / "cli.md"}
"""Pages written by code (``bench --render``, ``make docs``), checked against their sources instead."""
HISTORY = {ROOT / "CHANGELOG.md"}
"""Release notes: what was measured at each release, each figure naming its run (not rendered again)."""
UNIT = (
    r"(?:ms|milliseconds?|µs|us|ns|s|seconds?|min|minutes?|h|hours?|TB|GB|GiB|MB|MiB|KB|KiB|GB/s|"
    r"tok/s|tokens/s|tokens per second|t/s|it/s)"
)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:\s?(?:-|–|to)\s?{NUMBER})?(?:\s?{UNIT}\b|\s?[x×X]\b| times\b)")
TABLE_FIGURE = re.compile(r"\|\s*\d+\.\d+\s*[*x%]?\s*(?=\|)")
"""A table cell holding a decimal number: a measured value in a table typed by hand."""
SOURCE = re.compile(r"(benchmarks/(?:[\w.-]+/){0,2}[\w.-]+\.json)|\(run: [^)]*\d{4}-\d{2}-\d{2},\s+v\d[^)]*\)")
RENDERED = re.compile(r"^<!-- begin rendered: ([\w-]+) -->\n.*?^<!-- end rendered: \1 -->$", re.S | re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code and rendered blocks."""
    text = RENDERED.sub("", text)
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def _prose_blocks(text: str) -> list[str]:
    """:func:`_prose` as blocks between blank lines; a table joins the block before it (its caption)."""
    blocks: list[str] = []
    for block in re.split(r"\n\s*\n", _prose(text)):
        if block.lstrip().startswith("|") and blocks:
            blocks[-1] += "\n" + block
        else:
            blocks.append(block)
    return blocks


def hand_typed_figures(text: str) -> list[str]:
    """Measured-looking figures outside fenced code, inline code and rendered blocks: a number or range with a
    time, size or rate unit, a ratio such as ``1.2x``, or a decimal number in a table cell."""
    found = []
    for block in _prose_blocks(text):
        plain = re.sub(r"`[^`]*`", "", block)
        figures = [m.group(0) for m in FIGURE.finditer(plain)] + [m.group(0) for m in TABLE_FIGURE.finditer(plain)]
        if figures:
            found.append(f"{figures} in: {block.strip()[:160]!r}")
    return found


def _names_a_source(block: str) -> bool:
    """``block`` names a stored result file that exists, or a run ``(run: MACHINE, YYYY-MM-DD, vX.Y.Z)``."""
    return any(not m.group(1) or (ROOT / m.group(1)).is_file() for m in SOURCE.finditer(block))


def unsourced_figures(text: str) -> list[str]:
    """For release notes: :func:`hand_typed_figures` in blocks that name no stored result file and no run
    ``(run: MACHINE, DATE, VERSION)``."""
    return [found for block in _prose_blocks(text) for found in hand_typed_figures(block) if not _names_a_source(block)]


def test_the_figure_rules_flag_hand_typed_measurements():
    assert hand_typed_figures("Decode takes 21.7 ms per token.\n")
    assert hand_typed_figures("It is 1.48x faster.\n")
    assert hand_typed_figures("Caption\n\n| a | b |\n|---|---|\n| 3.2 GB | 4 |\n")
    assert hand_typed_figures("Caption\n\n| streams | tokens/s |\n|---|---:|\n| 1 | 55.1 |\n")  # no unit
    assert hand_typed_figures("Decode is 15-17 ms per token, 1.5-2x the floor.\n")
    assert hand_typed_figures("It reads 48 tokens per second, 1.5 times as fast, 1.5× or 850 µs.\n")
    assert hand_typed_figures("Decode takes 21.7 ms (run: AMD EPYC 2 cores, 2026-12-04, v0.9.2).\n")  # hand-typed
    assert not hand_typed_figures("```\nqwen35-onnx bench  # 12 ms\n```\nPatches of 16 pixels, 2 cores.\n")
    assert not hand_typed_figures("~~~\n12 ms\n~~~\n| grid | tokens |\n|---|---|\n| 16x16 | 64 |\n")
    rendered = f"{render.begin('headline')}\n21.7 ms\n| x | 1.5 |\n{render.end('headline')}\n"
    assert not hand_typed_figures(rendered) and hand_typed_figures(rendered.replace("headline -->", "x -->", 1))
    assert unsourced_figures("Decode takes 21.7 ms (run: my laptop, 2026-12-04).\n")  # no version
    assert unsourced_figures("Decode takes 21.7 ms (benchmarks/results/no/such.json).\n")  # no such file
    assert not unsourced_figures("Decode takes 21.7 ms (run: AMD EPYC 2 cores, 2026-12-04, v0.9.2).\n")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_figure_is_typed_by_hand(page: Path):
    if page in GENERATED:
        pytest.skip("rendered from stored results / the declarations")
    if page in HISTORY:
        assert unsourced_figures(page.read_text()) == [], f"{page.name}: a figure without its run"
        return
    assert hand_typed_figures(page.read_text()) == [], (
        f"{page.relative_to(ROOT)}: a measured figure typed by hand; render it from its stored result "
        "(a block of bench/render.py's BLOCKS between <!-- begin rendered: NAME --> markers, `qwen35-onnx bench "
        "--render`) or leave it out"
    )


# ---- the rendered blocks, pages and charts ----------------------------------------------------------------
def test_everything_rendered_from_the_stored_results_is_current():
    assert render.stale_files(ROOT) == [], "run `qwen35-onnx bench --render` (the figures come from benchmarks/)"
    assert stored.load_results(ROOT / "benchmarks" / "results"), "no stored bench result"
    readme = (ROOT / "README.md").read_text()
    for name in ("headline", "speculative-readme"):
        assert render.begin(name) in readme, f"the README's {name} block is missing"
    used = {
        name for page in PAGES for name in re.findall(r"^<!-- begin rendered: ([\w-]+) -->$", page.read_text(), re.M)
    }
    assert used == set(render.BLOCKS), f"blocks rendered nowhere: {set(render.BLOCKS) - used}"


def test_each_rendered_block_names_its_runs_and_shows_their_figures():
    """Every block renders from the repository's stored results: its figures, and the machine, date, version and
    file of the runs they come from (a block that renders nothing, or loses its caption, fails)."""
    for name, renderer in render.BLOCKS.items():
        text = renderer(ROOT, Path("docs/page.md"))
        if name == "export-cost" and text.startswith("Not measured"):
            continue  # no stored result records its exports yet (the next bench --publish does)
        if name in render.COMPUTED_BLOCKS:  # from the code's data: figures, and says they are not measured
            assert "not measured" in text and len(re.findall(r"\d+\.\d+", text)) >= 3, name
            continue
        assert "benchmarks/" in text and "AMD EPYC" in text, f"{name}: no run named: {text[:200]!r}"
        assert re.search(r"\d{4}-\d{2}-\d{2}, (qwen35-onnx |v)\d+\.\d+", text), f"{name}: no date and version"
        assert len(re.findall(r"\d+\.\d+", text)) >= 3, f"{name}: no figures: {text[:200]!r}"


def _copy_repository(root: Path) -> None:
    """The files the renderer reads and writes, copied into ``root``."""
    for name in ("README.md", "CONTRIBUTING.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "benchmarks", root / "benchmarks", ignore=shutil.ignore_patterns("out", "*.py"))


def test_a_rendered_figure_edited_by_hand_fails_and_render_puts_it_back(tmp_path: Path):
    _copy_repository(tmp_path)
    assert render.stale_files(tmp_path) == []
    runtime = tmp_path / "docs" / "runtime.md"
    before = runtime.read_text()
    block = re.search(RENDERED, before)
    edited = re.sub(r"\| (\d+)\.(\d) \|", lambda m: f"| {int(m[1]) + 1}.{m[2]} |", block.group(0), count=1)
    assert edited != block.group(0)
    runtime.write_text(before.replace(block.group(0), edited))
    chart = tmp_path / headline.HEADLINE_CHART
    svg = chart.read_text()
    label = re.search(r">(\d+)\.(\d)<", svg)  # a figure the chart prints (a bar's value)
    assert label, "the headline chart prints no figure"
    chart.write_text(svg.replace(label.group(0), f">{int(label[1]) + 1}.{label[2]}<", 1))
    assert render.stale_files(tmp_path) == [Path("docs/runtime.md"), headline.HEADLINE_CHART]
    assert set(render.render_all(tmp_path)) == {Path("docs/runtime.md"), headline.HEADLINE_CHART}
    assert runtime.read_text() == before and render.stale_files(tmp_path) == []


def test_a_rendered_block_must_be_known_and_closed(tmp_path: Path):
    _copy_repository(tmp_path)
    page = tmp_path / "docs" / "images.md"
    page.write_text(page.read_text() + f"\n{render.begin('no-such-table')}\n{render.end('no-such-table')}\n")
    with pytest.raises(ValueError, match="docs/images.md: unknown rendered block.*no-such-table"):
        render.rendered_pages(tmp_path)
    page.write_text(page.read_text().replace(render.end("no-such-table"), "").replace("no-such-table", "grammar"))
    with pytest.raises(ValueError, match="'grammar' has no <!-- end rendered: grammar -->"):
        render.rendered_pages(tmp_path)
    page.write_text(page.read_text().replace(render.begin("grammar"), f"A quoted `{render.begin('grammar')}`."))
    assert Path("docs/images.md") not in render.rendered_pages(tmp_path)  # a marker inside a line is text


def _fake_result(
    root: Path, cpu: str, date: str, decode: float, flags=("avx2",), version="9.9.9", preset="qwen3.5-0.8b"
):
    peers = [
        {
            "name": "ort int4",
            "prefill_ms": {"32": 40.0, "512": 600.0},
            "decode_ms": {"32": decode, "512": decode + 1},
            "e2e_tokens_per_s": 30.0,
            "peak_rss_bytes": 1.5e9,
            "peak_sampled": True,
            "image": {"ttft_ms": 900.0},
        },
        {
            "name": "llama.cpp Q4_0 pure",
            "prefill_ms": {"32": 50.0, "512": 900.0},
            "decode_ms": {"32": 2 * decode, "512": 2 * decode + 2},
            "e2e_tokens_per_s": 15.0,
            "peak_rss_bytes": 1.25e9,
            "image": None,
        },
    ]
    run = {
        "cpu": cpu,
        "cores": 2,
        "memory_gib": 23.4,
        "cpu_flags": list(flags),
        "date": date,
        "version": version,
        "command": "qwen35-onnx bench",
        "preset": preset,
    }
    bench = root / "bench"
    bench.mkdir(exist_ok=True)
    data = {"run": run, "peers": peers, "markdown": "## Table\n| x |\n"}
    data["exports"] = {"ort int4": {"export_s": 61.4, "disk_bytes": 812_000_000, "capacity": 2048}}
    (bench / "bench.json").write_text(json.dumps(data))
    render.publish(bench, root)


def _repository(root: Path) -> None:
    """The files the pages are rendered from and into, in an empty folder ``root``."""
    (root / "benchmarks").mkdir()
    (root / "docs").mkdir()
    (root / "benchmarks" / "protocol.md").write_text("The protocol.\n")
    (root / "README.md").write_text(f"# Title\n\n{render.begin('headline')}\n{render.end('headline')}\n\nMore.\n")


def _readme_table(root: Path) -> str:
    return (root / "README.md").read_text().split(render.begin("headline"))[1].split(render.end("headline"))[0]


def test_publish_stores_the_latest_run_per_machine_and_renders_every_page(tmp_path: Path):
    _repository(tmp_path)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-01T10:00Z", 20.0)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-02T10:00Z", 10.0)  # the same machine: replaces it
    _fake_result(tmp_path, "Intel(R) Xeon(R) Platinum 8480C", "2026-12-03T10:00Z", 8.0, ("avx2", "amx_tile"))
    _fake_result(tmp_path, "AMD EPYC", "2026-12-04T10:00Z", 40.0, preset="qwen3.5-4b")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "benchmarks" / "results").rglob("*.json"))
    assert files == [
        "benchmarks/results/amd-epyc-2c/qwen3.5-0.8b.json",
        "benchmarks/results/amd-epyc-2c/qwen3.5-4b.json",
        "benchmarks/results/intel-xeon-platinum-8480c-amx-2c/qwen3.5-0.8b.json",
    ]
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# Title") and readme.endswith("More.\n")
    table = _readme_table(tmp_path)
    # one table per machine, its sizes side by side; each run's date and version
    assert table.count("| row |") == 2 and "0.8B 2026-12-02, v9.9.9" in table and "4B 2026-12-04, v9.9.9" in table
    assert "| this project (int4) | 600 | 10.0 | 1.50* | 600 | 40.0 | 1.50* |" in table  # AMD: 0.8B, then 4B
    assert "| llama.cpp Q4_0 pure | 900 | 20.0 | 1.25 | 900 | 80.0 | 1.25 |" in table
    assert "Intel(R) Xeon(R) Platinum 8480C" in table and "| this project (int4) | 600 | 8.0 | 1.50* |" in table
    assert "0.8B decode 2.00x, prefill 1.50x" in table and "peak RSS" in table and "Pss" in table
    assert "older than this version" not in table
    page = (tmp_path / "benchmarks" / "README.md").read_text()
    assert page.count("## qwen3.5-0.8b on") == 2 and "### Table" in page and "The protocol." in page
    assert "2026-12-01" not in page  # the older run of the same machine is git's history
    charts = sorted(p.name for p in (tmp_path / headline.CHARTS_DIR).iterdir())
    assert charts == [
        "amd-epyc-2c-qwen3.5-0.8b.svg",
        "amd-epyc-2c-qwen3.5-4b.svg",
        "headline.svg",
        "intel-xeon-platinum-8480c-amx-2c-qwen3.5-0.8b.svg",
    ]
    assert render.render_all(tmp_path) == []  # rendering again changes nothing
    cost = headline.export_cost(tmp_path, Path("docs/quickstart.md"))
    assert cost.count("| Qwen3.5-0.8B | ") == 2 and cost.count("| Qwen3.5-4B | ") == 1
    assert "| 61 | 0.81 | `benchmarks/results/amd-epyc-2c/qwen3.5-0.8b.json` |" in cost
    (tmp_path / "benchmarks" / "results" / "amd-epyc-2c" / "qwen3.5-4b.json").unlink()
    assert Path("docs/assets/bench/amd-epyc-2c-qwen3.5-4b.svg") in render.render_all(tmp_path)  # its chart goes
    assert not (tmp_path / "docs" / "assets" / "bench" / "amd-epyc-2c-qwen3.5-4b.svg").exists()


def test_a_result_older_than_the_package_minor_version_is_flagged(tmp_path: Path):
    from qwen35_onnx import __version__

    major, minor, *_ = __version__.split(".")
    _repository(tmp_path)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-01T10:00Z", 20.0, version=f"{major}.{minor}.0")
    assert "older than this version" not in _readme_table(tmp_path)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-02T10:00Z", 20.0, version=f"{major}.{int(minor) - 1}.9")
    table = _readme_table(tmp_path)
    assert f"v{major}.{int(minor) - 1}.9 (**older than this version, {__version__}**)" in table
    assert not stored.older_than_package(__version__) and stored.older_than_package("0.0.1")


def test_the_charts_bars_start_at_zero():
    from qwen35_onnx.bench.svg import Bar, Panel, bar_chart, nice_step

    text = bar_chart([("run", [Panel("decode, ms", [Bar("a", 15.8, True), Bar("b", 21.7), Bar("c", None)])])], "t")
    lefts = {float(x) for x in re.findall(r'<rect x="([\d.]+)" y', text)}
    assert len(lefts) == 1 and re.search(r">0</text>", text)  # every bar from the axis, whose first tick is 0
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="([\d.]+)"', text)]
    assert widths[0] / widths[1] == pytest.approx(15.8 / 21.7, rel=0.01)  # lengths compare as the values
    assert ">-</text>" in text and ">15.8</text>" in text and ">21.7</text>" in text
    assert [nice_step(t) for t in (21.7, 7398, 0.9)] == [10, 2000, 0.25]
    with pytest.raises(ValueError, match="below zero"):
        bar_chart([("run", [Panel("x", [Bar("a", -1.0)])])], "t")


def test_the_plot_is_drawn_from_a_stored_result(tmp_path: Path):
    """The bench's own plot (bench.png in its work folder) from what ``bench.json`` stores (string lengths, a peer
    without one panel's data)."""
    pytest.importorskip("matplotlib")
    from qwen35_onnx.bench.report import plot

    (result, *_) = headline.headline_results(ROOT)
    peers = result.data["peers"] + [{"name": "decode only", "prefill_ms": {}, "decode_ms": {"32": 20.0}}]
    plot(peers, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_stored_results_that_are_not_results_are_named(tmp_path: Path):
    bad = tmp_path / "benchmarks" / "results" / "m-2c"
    bad.mkdir(parents=True)
    (bad / "x.json").write_text("{}")
    with pytest.raises(ValueError, match=r"x.json: not a bench result: no run, peers, markdown"):
        stored.load_results(tmp_path / "benchmarks" / "results")
    (bad / "x.json").write_text("{")
    with pytest.raises(ValueError, match="x.json: not a bench result"):
        stored.load_results(tmp_path / "benchmarks" / "results")
    with pytest.raises(ValueError, match="protocol.md is missing"):
        render.rendered_pages(tmp_path)
    (bad / "x.json").unlink()
    (tmp_path / "benchmarks" / "protocol.md").write_text("p\n")
    (tmp_path / "benchmarks" / "streams").mkdir()
    (tmp_path / "benchmarks" / "streams" / "amd-epyc-2c-qwen3.5-0.8b.json").write_text('{"run": {"cpu": "AMD"}}')
    (tmp_path / "README.md").write_text(f"{render.begin('streams-decode')}\n{render.end('streams-decode')}\n")
    with pytest.raises(ValueError, match=r"streams/amd-epyc-2c-qwen3.5-0.8b.json: not a stored result: run.date"):
        render.rendered_pages(tmp_path)
    with pytest.raises(ValueError, match="no bench result with its run"):
        render.publish(tmp_path / "nowhere", tmp_path)


def test_publish_refuses_a_bad_run_before_writing_anything(tmp_path: Path):
    _repository(tmp_path)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-01T10:00Z", 20.0)
    (stored_file,) = (tmp_path / "benchmarks" / "results").rglob("*.json")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    good = json.loads((tmp_path / "bench" / "bench.json").read_text())
    bad_runs = {
        "run.preset '../../../x' is not a preset name": {**good, "run": {**good["run"], "preset": "../../../x"}},
        "peers is not a list of objects": {**good, "peers": "x"},
        "no peers, markdown": {"run": good["run"]},
        "ort int4: decode_ms is not lengths -> positive milliseconds": {
            **good,
            "peers": [{**good["peers"][0], "decode_ms": {"32": 0}}],
        },
        "run.cores '2' is not a positive integer": {**good, "run": {**good["run"], "cores": "2"}},
        "ort int4: peak_rss_by_length is not lengths -> positive bytes": {
            **good,
            "peers": [{**good["peers"][0], "peak_rss_by_length": {"32": -1}}],
        },
    }
    for message, data in bad_runs.items():
        (tmp_path / "bench" / "bench.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(message)):
            render.publish(tmp_path / "bench", tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "bench/" not in p.as_posix()} == {
        p: b for p, b in before.items() if "bench/" not in p.as_posix()
    }, "a refused run changed a stored file or page"
    assert stored_file.is_file() and not list(tmp_path.rglob(".*.publishing"))


def test_machine_names_are_folder_names():
    assert stored.machine_slug({"cpu": "AMD EPYC", "cores": 2}) == "amd-epyc-2c"
    assert (
        stored.machine_slug({"cpu": "Intel(R) Xeon(R) CPU @ 2.10GHz", "cores": 4, "cpu_flags": ["amx_tile"]})
        == "intel-xeon-amx-4c"
    )
    assert stored.machine_slug({"cpu": "", "cores": 2}) == "unknown-cpu-2c"
    assert stored.machine_slug({"cpu": "../../etc", "cores": "../x"}) == "etc-0c"
    assert len(stored.machine_slug({"cpu": "x" * 300, "cores": 2})) <= 64
    info = stored.run_info(["bench", "--preset", "tiny"])
    assert info["command"] == "qwen35-onnx bench --preset tiny" and info["cores"] >= 1
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}Z", info["date"])


# ---- the CLI reference and command lines in the docs ------------------------------------------------
def _commands() -> dict[str, list]:
    import typer

    from qwen35_onnx import cli

    group = typer.main.get_command(cli.app)
    return {name: command.params for name, command in group.commands.items()}


def test_the_cli_reference_is_generated_from_the_declarations_and_lists_every_option_with_its_default():
    """docs/reference/cli.md is what `make docs` generates (typer's own docs generator on the CLI), and
    that lists every option of every command with the default the code declares."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "typer", "qwen35_onnx.cli", "utils", "docs", "--name", "qwen35-onnx"]
    text = subprocess.run([*command, "--title", "CLI reference"], capture_output=True, text=True, check=True).stdout
    text = text.rstrip("\n") + "\n"  # printed with one more newline than --output writes
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert committed == text, "docs/reference/cli.md is stale: run `make docs` (it regenerates it) and commit it"
    sections = dict(re.findall(r"## `qwen35-onnx (\w+)`\n(.*?)(?=\n## |\Z)", text, flags=re.S))
    assert set(sections) == set(_commands())
    for name, params in _commands().items():
        for param in params:
            flag = param.opts[0]
            assert f"`{flag}" in sections[name], f"{name} {flag} missing from the CLI reference"
            shown = param.show_default if isinstance(param.show_default, str) else param.default
            if param.show_default and shown not in (None, False, [], (), "") and not param.is_flag:
                assert f"[default: {shown}]" in sections[name], f"{name} {flag}: default {shown}"


_COMMAND_LINE = re.compile(r"qwen35-onnx (export|generate|chat|serve|verify|bench|demo)\b([^\n`|]*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_in_the_docs_use_declared_options(page: Path):
    if page in GENERATED:
        pytest.skip("generated from the declarations")
    declared = {name: {o for p in params for o in (*p.opts, *p.secondary_opts)} for name, params in _commands().items()}
    text = page.read_text().replace("\\\n", " ")  # a command continued on the next line
    wrong = [
        f"{command} {flag}"
        for command, rest in _COMMAND_LINE.findall(text)
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
        if flag not in declared[command] | {"--help"}
    ]
    assert wrong == [], f"{page.relative_to(ROOT)}: options the commands do not declare: {wrong}"


# ---- options the pages name: they exist, their values are accepted, their stated defaults are declared ---------
_SPAN = re.compile(r"`([^`\n]+)`")
_FOREIGN = re.compile(
    r"^(?:llama-server|llama-bench|llama-cli|pip|python|pytest|ray|serve (?:run|deploy)|hf|huggingface-cli|make|curl"
    r"|\.venv/bin/python|benchmarks/\S+\.py)(?=\s|$)"
)
"""Inline code that is another program's command line, a benchmark script's included (its options are not
ours)."""
_STATED_DEFAULT = re.compile(r"\s*(?:\(|,)\s*(?:(the default)\b|default:?\s+(?:`([^`]+)`|([^\s,;)]+)))")
_PLACEHOLDER = re.compile(r"[A-Z][A-Za-z_]*|.*(?:\.\.\.|[<>{}]).*")


def _prose_spans(page: Path) -> list[tuple[str, str]]:
    """Inline code spans of ``page`` outside fenced code, each with the text after it (up to 60 characters)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    return [(m.group(1), text[m.end() : m.end() + 60]) for m in _SPAN.finditer(text)]


def _declared_options() -> dict[str, list]:
    """Flag -> the declarations (:func:`qwen35_onnx.options.declared`) of the option groups that have it."""
    from qwen35_onnx.cluster.options import ClusterOptions
    from qwen35_onnx.export.options import ExportOptions
    from qwen35_onnx.options import declared
    from qwen35_onnx.runtime.backend import RuntimeOptions
    from qwen35_onnx.runtime.sampling import SamplingConfig
    from qwen35_onnx.server.options import ServerOptions

    found: dict[str, list] = {}
    for group in (ExportOptions, RuntimeOptions, SamplingConfig, ServerOptions, ClusterOptions):
        for o in declared(group):
            for flag in o.flag.split("/"):
                found.setdefault(flag, []).append((group, o))
    return found


def _cli_defaults() -> dict[str, set[str]]:
    """Flag -> the defaults the commands that take it show in ``--help`` (the declared ones)."""
    out: dict[str, set[str]] = {}
    for params in _commands().values():
        for p in params:
            if p.show_default is True and p.default is not None and not p.is_flag:
                shown = str(p.default)
            else:
                found = re.search(r"\[default: ([^\]]+)\]", p.help or "")
                shown = found.group(1) if found else None
            for flag in p.opts:
                out.setdefault(flag, set()).add(shown)
    return out


def _accepts(group, o, value: str) -> bool:
    """Whether the declaration ``o`` of ``group`` takes the command-line text ``value``."""
    import enum
    import typing

    kinds = [t for t in typing.get_args(o.type) or (o.type,) if t is not type(None)]
    try:
        if o.parse is not None:
            parsed = o.parse(value)
        elif any(isinstance(k, type) and issubclass(k, enum.Enum) for k in kinds):
            (kind,) = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
            parsed = kind(value)
        elif int in kinds:
            parsed = int(value)
        elif float in kinds:
            parsed = float(value)
        else:
            return True  # a path or free text
        group(**{o.name: parsed})
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(ROOT)))
def test_options_the_pages_name_exist_and_take_the_values_given(page: Path):
    """Every ``--option`` in inline code (not another program's) is declared by a command; where it comes with a
    value (``--vision-grids static``), an option group that declares it reads that value (its parser, its enum, a
    number)."""
    flags = {o for params in _commands().values() for p in params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    groups = _declared_options()
    wrong = []
    for span, _ in _prose_spans(page):
        if _FOREIGN.match(span):
            continue
        for flag, value in re.findall(r"(?<![\w-])(--[a-z][\w-]*)(?:[ =]([^\s`]+))?", span):
            if flag not in flags:
                wrong.append(f"{flag}: no command declares it ({span!r})")
            elif value and not value.startswith("-") and flag in groups and not _PLACEHOLDER.fullmatch(value):
                alternatives = re.split(r"[|/]", value)  # `--dtype fp16|bf16`, `--quantize int4/int8`
                if not all(any(_accepts(g, o, v) for g, o in groups[flag]) for v in alternatives):
                    wrong.append(f"{flag} {value}: not a value it takes ({span!r})")
    assert wrong == [], f"{page.name}: {wrong}"


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED | HISTORY], ids=lambda p: p.name)
def test_defaults_the_pages_state_are_the_declared_ones(page: Path):
    """``--kv-cache fixed` (the default)``, ``--slots S` (default 1)``, ``--lengths` (default `32,512`)``: the
    value stated is the default a command that takes the option declares (release notes, of their time, aside)."""
    defaults = _cli_defaults()
    wrong = []
    for span, after in _prose_spans(page):
        found = re.fullmatch(r"(--[a-z][\w-]*)(?: (\S+))?", span)
        stated = _STATED_DEFAULT.match(after)
        if not (found and stated) or found.group(1) not in defaults:
            continue
        value = found.group(2) if stated.group(1) else stated.group(2) or stated.group(3)
        if value is None or _PLACEHOLDER.fullmatch(value) or "|" in value:
            continue
        if value not in defaults[found.group(1)]:
            wrong.append(f"{span}: the page says the default is {value!r}, the code {defaults[found.group(1)]}")
    assert wrong == [], f"{page.name}: {wrong}"


def test_the_option_checks_catch_a_stale_page(tmp_path: Path):
    page = tmp_path / "stale.md"
    page.write_text(
        "Export with `--vision-grids sometimes`, `--ops onnx` or `--no-such-option`; `--kv-cache dynamic` (the "
        "default); `--slots S` (default 4); `llama-server --parallel 4` is llama.cpp's.\n"
    )
    with pytest.raises(AssertionError) as failed:
        test_options_the_pages_name_exist_and_take_the_values_given(page)
    for found in ("--vision-grids sometimes", "--ops onnx", "--no-such-option"):
        assert found in str(failed.value)
    assert "--parallel" not in str(failed.value)
    with pytest.raises(AssertionError, match=r"--kv-cache dynamic.*'dynamic'.*--slots S.*'4'"):
        test_defaults_the_pages_state_are_the_declared_ones(page)


# ---- the troubleshooting page quotes the program's own messages ---------------------------------------------
_PREFIXES = ("error: ", "WARNING: ", "RuntimeWarning: ")
"""How the command line prints a message: ``cli._fail``, logging's format in ``cli.main``, a Python warning."""


def _message_templates() -> list[tuple[str, list[str]]]:
    """Every string the package's code writes, as a pattern (each f-string field and ``%`` placeholder matching
    any text) with its literal pieces; strings with fewer than 12 literal characters are left out (they would
    match anything)."""
    import ast

    src = ROOT / "src" / "qwen35_onnx"
    templates = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces = re.split(r"(%[-0-9.]*[sdrf])", node.value)
                pieces = [None if re.fullmatch(r"%[-0-9.]*[sdrf]", x) else x for x in pieces]
            else:
                continue
            literals = [x for x in pieces if x]
            if sum(map(len, literals)) < 12:
                continue
            pattern = "".join(".+?" if x is None else re.escape(x) for x in pieces)
            templates.append((pattern, literals))
    return templates


def _is_program_message(line: str, templates) -> bool:
    """``line`` is one message of the code, or two written one after the other (a message and its hint)."""
    for prefix in _PREFIXES:
        line = line.removeprefix(prefix)
    candidates = [t for t in templates if all(piece in line for piece in t[1])]
    if any(re.fullmatch(t, line, re.S) for t, _ in candidates):
        return True
    return any(re.fullmatch(a + b, line, re.S) for a, _ in candidates for b, _ in candidates)


def _quoted_messages(page: Path) -> list[str]:
    """The lines of a page's ``text`` blocks and the ``error.message`` of its ``json`` blocks."""
    text = page.read_text()
    lines = [line for block in re.findall(r"^```text\n(.*?)^```", text, re.S | re.M) for line in block.splitlines()]
    bodies = re.findall(r"^```json\n(.*?)^```", text, re.S | re.M)
    return [line for line in lines if line.strip()] + [json.loads(b)["error"]["message"] for b in bodies]


def test_the_troubleshooting_page_quotes_the_programs_messages():
    page = ROOT / "docs" / "troubleshooting.md"
    templates = _message_templates()
    quoted = _quoted_messages(page)
    assert len(quoted) >= 6
    assert [m for m in quoted if not _is_program_message(m, templates)] == [], "messages the code does not write"
    assert not _is_program_message("error: the server exploded while reading the weights", templates)
    assert not _is_program_message("error: prompt is 12 tokens, less than the capacity 2048", templates)


def test_the_readme_is_a_readme():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 13_000, f"README.md is {len(readme.encode())} bytes: details go to docs/"
    assert "make demo" in readme and "make test" in readme
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
    assert f"]({headline.HEADLINE_CHART.as_posix()})" in readme, "the README shows the headline chart"
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    index = readme.split("## Documentation")[1]
    missing = [p for p in nav if p not in ("contributing.md", "changelog.md") and f"(docs/{p})" not in index]
    assert missing == [], f"pages of the site the README's index does not list: {missing}"


def test_the_extras_and_layers_the_docs_list_are_the_declared_ones():
    """The README's extras table lists pyproject's extras, `make setup` (CONTRIBUTING) the Makefile's, and
    CONTRIBUTING's layer table the layers tests/test_layout.py checks."""
    import tomllib

    from .test_layout import LAYERS

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"^\| `(\w+)` \|", readme, re.M)) == extras
    installed = re.search(r'pip install .*-e "\.\[([\w,]+)\]"', (ROOT / "Makefile").read_text()).group(1).split(",")
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    setup = re.search(r"^make setup .*every extra the tests use: (.*)$", contributing, re.M).group(1)
    assert sorted(re.split(r",\s*", setup)) == sorted(installed)
    table = re.findall(r"^\| [a-z -]+ \| (`.*) \|$", contributing.split("## Where things go")[1], re.M)
    # the top-level modules of each row (`runtime/onnxruntime/` is a folder inside one)
    listed = [{n.rstrip("/") for n in re.findall(r"`([\w/]+)`", row) if "/" not in n.rstrip("/")} for row in table]
    assert listed == [set(layer) for layer in LAYERS]
