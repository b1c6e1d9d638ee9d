"""The documentation: pages rendered from stored bench results match them, measured figures name
their source, the CLI reference and every command line in the docs agree with the option
declarations, the README stays a README. (The site itself is built in strict mode by `make docs`.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qwen35_onnx.bench import results as stored

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""The pages a reader sees (the site includes CONTRIBUTING.md and CHANGELOG.md)."""
GENERATED = {ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "reference" / "cli.md"}
"""Pages written by code (``bench --render``, ``make docs``), checked against their sources instead."""
UNIT = (
    r"(?:ms|milliseconds?|µs|us|ns|s|seconds?|min|minutes?|h|hours?|TB|GB|GiB|MB|MiB|KB|KiB|GB/s|"
    r"tok/s|tokens/s|tokens per second|t/s|it/s)"
)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:\s?(?:-|–|to)\s?{NUMBER})?(?:\s?{UNIT}\b|\s?[x×X]\b| times\b)")
SOURCE = re.compile(r"(benchmarks/(?:[\w.-]+/){0,2}[\w.-]+\.json)|\(run: [^)]*\d{4}-\d{2}-\d{2},\s+v\d[^)]*\)")


def _prose_blocks(text: str, generated_block: bool = False) -> list[str]:
    """``text`` without fenced code (and, with ``generated_block``, the README's generated results
    block), as blocks between blank lines; a table joins the block before it (its caption)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    if generated_block:
        text = re.sub(re.escape(stored.BEGIN) + ".*?" + re.escape(stored.END), "", text, flags=re.S)
    blocks: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|") and blocks:
            blocks[-1] += "\n" + block
        else:
            blocks.append(block)
    return blocks


def _names_a_source(block: str) -> bool:
    """``block`` names a stored result file that exists, or a run ``(run: MACHINE, YYYY-MM-DD, vX.Y.Z)``."""
    return any(not m.group(1) or (ROOT / m.group(1)).is_file() for m in SOURCE.finditer(block))


def unsourced_figures(text: str, generated_block: bool = False) -> list[str]:
    """Measured-looking figures (a number or range with a time, size or rate unit, or a ratio such as
    ``1.2x``) in blocks of ``text`` that name no stored result file and no run
    ``(run: MACHINE, DATE, VERSION)`` (inline code, e.g. a command line, is not read)."""
    found = []
    for block in _prose_blocks(text, generated_block):
        figures = [m.group(0) for m in FIGURE.finditer(re.sub(r"`[^`]*`", "", block))]
        if figures and not _names_a_source(block):
            found.append(f"{figures} in: {block.strip()[:160]!r}")
    return found


def test_the_figure_rule_flags_unsourced_measurements_and_passes_sourced_ones():
    assert unsourced_figures("Decode takes 21.7 ms per token.\n")
    assert unsourced_figures("It is 1.48x faster.\n")
    assert unsourced_figures("Caption\n\n| a | b |\n|---|---|\n| 3.2 GB | 4 |\n")
    assert unsourced_figures("Decode is 15-17 ms per token, 1.5-2x the floor.\n")
    assert unsourced_figures("It reads 48 tokens per second, 1.5 times as fast, 1.5× or 850 µs.\n")
    assert unsourced_figures("Decode takes 21.7 ms (run: my laptop, 2026-12-04).\n")  # no version
    assert unsourced_figures("Decode takes 21.7 ms (benchmarks/results/no/such.json).\n")  # no such file
    assert not unsourced_figures("Decode takes 21.7 ms (run: AMD EPYC 2 cores, 2026-12-04, v0.9.2).\n")
    assert not unsourced_figures("From `benchmarks/grammar_vocab.json`\n\n| a |\n|---|\n| 0.36 ms |\n")
    assert not unsourced_figures("```\nqwen35-onnx bench  # 12 ms\n```\nPatches of 16 pixels, 2 cores.\n")
    assert not unsourced_figures("~~~\n12 ms\n~~~\n")
    hand_typed = f"{stored.BEGIN}\n21.7 ms\n{stored.END}\n"
    assert unsourced_figures(hand_typed) and not unsourced_figures(hand_typed, generated_block=True)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_measured_figures_name_their_stored_result_or_run(page: Path):
    if page in GENERATED:
        pytest.skip("rendered from stored results / the declarations")
    assert unsourced_figures(page.read_text(), generated_block=page.name == "README.md") == [], (
        f"{page.relative_to(ROOT)}: a figure without its source; name the stored result "
        "(benchmarks/results/...json) or the run, '(run: MACHINE, YYYY-MM-DD, vX.Y.Z)'"
    )


def test_pages_rendered_from_the_stored_results_are_up_to_date():
    pages = stored.rendered_pages(ROOT)
    stale = [str(path) for path, text in pages.items() if (ROOT / path).read_text() != text]
    assert stale == [], f"{stale}: run `qwen35-onnx bench --render` (the pages come from benchmarks/results/)"
    assert stored.load_results(ROOT / "benchmarks" / "results"), "no stored bench result"


def _fake_result(root: Path, cpu: str, date: str, decode: float, flags=("avx2",)) -> None:
    peers = [
        {
            "name": "ort int4",
            "prefill_ms": {"32": 40.0, "512": 600.0},
            "decode_ms": {"32": decode, "512": decode + 1},
            "e2e_tokens_per_s": 30.0,
            "peak_rss_bytes": 1.5e9,
            "image": {"ttft_ms": 900.0},
        },
        {
            "name": "llama.cpp Q4_0 pure",
            "prefill_ms": {"32": 50.0, "512": 900.0},
            "decode_ms": {"32": 2 * decode, "512": 2 * decode + 2},
            "e2e_tokens_per_s": 15.0,
            "peak_rss_bytes": None,
            "image": None,
        },
    ]
    run = {
        "cpu": cpu,
        "cores": 2,
        "memory_gib": 23.4,
        "cpu_flags": list(flags),
        "date": date,
        "version": "9.9.9",
        "command": "qwen35-onnx bench",
        "preset": "qwen3.5-0.8b",
    }
    bench = root / "bench"
    bench.mkdir(exist_ok=True)
    (bench / "bench.json").write_text(json.dumps({"run": run, "peers": peers, "markdown": "## Table\n| x |\n"}))
    stored.publish(bench, root)


def _repository(root: Path) -> None:
    """The files the pages are rendered from and into, in an empty folder ``root``."""
    (root / "benchmarks").mkdir()
    (root / "docs").mkdir()
    (root / "benchmarks" / "protocol.md").write_text("The protocol.\n")
    (root / "README.md").write_text(f"# Title\n\n{stored.BEGIN}\n{stored.END}\n\nMore.\n")


def test_publish_stores_the_latest_run_per_machine_and_renders_every_page(tmp_path: Path):
    _repository(tmp_path)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-01T10:00Z", 20.0)
    _fake_result(tmp_path, "AMD EPYC", "2026-12-02T10:00Z", 10.0)  # the same machine: replaces it
    _fake_result(tmp_path, "Intel(R) Xeon(R) Platinum 8480C", "2026-12-03T10:00Z", 8.0, ("avx2", "amx_tile"))
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "benchmarks" / "results").rglob("*.json"))
    assert files == [
        "benchmarks/results/amd-epyc-2c/qwen3.5-0.8b.json",
        "benchmarks/results/intel-xeon-platinum-8480c-amx-2c/qwen3.5-0.8b.json",
    ]
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# Title") and readme.endswith("More.\n")
    table = readme.split(stored.BEGIN)[1].split(stored.END)[0]
    assert "Intel(R) Xeon(R) Platinum 8480C" in table and "2026-12-03" in table and "9.9.9" in table  # the newest
    assert "| 8.0 | 9.0 |" in table and "decode 2.00x" in table and "prefill 1.50x" in table
    page = (tmp_path / "benchmarks" / "README.md").read_text()
    assert page.count("## qwen3.5-0.8b on") == 2 and "### Table" in page and "The protocol." in page
    assert "2026-12-01" not in page  # the older run of the same machine is git's history
    assert stored.render_all(tmp_path) == []  # rendering again changes nothing


def test_the_plot_is_drawn_from_a_stored_result(tmp_path: Path):
    """The bench's plot from what ``bench.json`` stores (string lengths, a peer without one panel's data)."""
    from qwen35_onnx.bench.report import plot

    (result,) = [r for r in stored.load_results(ROOT / "benchmarks" / "results") if r.preset == stored.HEADLINE_PRESET]
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
        stored.rendered_pages(tmp_path)
    (tmp_path / "benchmarks" / "protocol.md").write_text("p\n")
    (tmp_path / "README.md").write_text("no markers\n")
    (bad / "x.json").unlink()
    with pytest.raises(ValueError, match="results:begin"):
        stored.rendered_pages(tmp_path)
    with pytest.raises(ValueError, match="no bench result with its run"):
        stored.publish(tmp_path / "nowhere", tmp_path)


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
            stored.publish(tmp_path / "bench", tmp_path)
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


def test_the_readme_is_a_readme():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 13_000, f"README.md is {len(readme.encode())} bytes: details go to docs/"
    assert "make demo" in readme and "make test" in readme
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
