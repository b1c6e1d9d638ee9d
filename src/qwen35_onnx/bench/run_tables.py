"""The tables rendered from the other benches' stored results (``bench --render``): concurrent streams
(``benchmarks/streams/``), speculative decoding (``benchmarks/speculative/``), the Ray Serve cluster
(``benchmarks/cluster/``), video (``benchmarks/video/``), the grammar's cost (``benchmarks/grammar_vocab.json``), kept
states on disk (``benchmarks/state_cache/``) and KV tiers (``benchmarks/kv_tiers/``).

Each function takes the repository's root and the page the block goes into, and returns the block's Markdown:
the caption naming its runs (:func:`~.stored.caption`), the table, and what its columns measure. Nothing here is
typed by hand: every figure is read from, or computed from, the stored files.
"""

from __future__ import annotations

from pathlib import Path

from .stored import StoredRun, by_machine, caption, load_run, load_runs, short_run, size_label

__all__ = [
    "capacity_memory",
    "cluster",
    "grammar",
    "kv_tiers",
    "speculative_costs",
    "speculative_llamacpp",
    "speculative_rates",
    "speculative_readme",
    "speculative_summary",
    "kv_precision",
    "kv_token_bytes",
    "state_cache",
    "streams_decode",
    "streams_servers",
    "streams_steps",
    "video_decoders",
    "video_openvino_grids",
    "video_ttft",
]


def _f(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _groups(root: Path, folder: str) -> list[tuple[list[StoredRun], dict[str, StoredRun]]]:
    """Per machine: its runs and its runs by checkpoint size (see :func:`~.stored.by_machine`)."""
    return [(list(g.values()), g) for g in by_machine(load_runs(root, folder)).values()]


def _caption(runs: list[StoredRun]) -> str:
    return caption(runs, [size_label(r.name) for r in runs])


def _table(header: list[str], rows: list[list[str]], align: str = "---:") -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---", *[align] * (len(header) - 1)]) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _section(runs: list[StoredRun], table: list[str], *notes: str) -> list[str]:
    """A table's lines on a page: the caption naming ``runs``, the table, then ``notes`` (what the columns measure),
    each a paragraph."""
    return [
        caption(runs, [size_label(r.name) for r in runs]),
        "",
        *table,
        *(line for n in notes for line in ("", n)),
        "",
    ]


def _each(runs: list[StoredRun], section, what: str) -> str:
    """The lines ``section(run)`` makes for each of ``runs`` (None: a run of another kind), joined; a line saying
    that no ``what`` result is stored where none made any."""
    return "\n".join(line for run in runs for line in section(run) or []).strip() or _missing(what)


def _missing(what: str) -> str:
    return f"No {what} result is stored yet."


# ---- concurrent streams (bench --streams) --------------------------------------------------------------------
def _stream_rate(row: dict) -> float:
    return row.get("extra", {}).get("all_decoding_tokens_per_s", row["decode_tokens_per_s"])


def _keyed_table(sizes: dict[str, StoredRun], field: str, key: str, columns: list[str], cells) -> list[str]:
    """A table of the runs' ``field`` lists, a row per value of their entries' ``key``, the sizes side by side:
    per size the ``columns`` (the first prefixed with the size), filled by ``cells(entry, entries by key)`` ('-'
    where that size has no entry for the row)."""
    keys = sorted({entry[key] for s in sizes.values() for entry in s.data[field]})
    header = [key] + [f"{size_label(name)} {c}" if i == 0 else c for name in sizes for i, c in enumerate(columns)]
    rows = []
    for k in keys:
        row = [str(k)]
        for s in sizes.values():
            by_key = {entry[key]: entry for entry in s.data[field]}
            row += cells(by_key[k], by_key) if k in by_key else ["-"] * len(columns)
        rows.append(row)
    return _table(header, rows)


def streams_decode(root: Path, page: Path) -> str:
    """Decode tokens/s and inter-token latency by stream count, per machine, the sizes side by side."""

    def cells(row: dict, by_n: dict) -> list[str]:
        one = by_n.get(1)
        ratio = _stream_rate(row) / _stream_rate(one) if one else None
        return [_f(_stream_rate(row)), _f(ratio, ".2f"), f"{row['itl_p50_ms']:.1f} / {row['itl_p95_ms']:.1f}"]

    out = []
    for runs, sizes in _groups(root, "streams"):
        columns = ["decode tokens/s", "x 1 stream", "inter-token p50 / p95 ms"]
        settings = {(s.data["slots"], s.data["max_tokens"], s.data["threads"]) for s in sizes.values()}
        setting = "; ".join(
            f"int4, an export of {slots} decode slots, {tokens} greedy tokens a stream, {threads} threads"
            for slots, tokens, threads in sorted(settings)
        )
        out += _section(
            runs,
            _keyed_table(sizes, "slots_in_process", "streams", columns, cells),
            f"{setting}. Decode tokens/s: every stream's tokens over the time all of them were decoding (no prefill "
            "in that window); x 1 stream: against one stream on the same export; inter-token: over every gap of every "
            "stream, the newcomers' prefill rounds included.",
        )
    return "\n".join(out).strip() or _missing("concurrent-streams")


def streams_steps(root: Path, page: Path) -> str:
    """One decode step's time by the rows it runs, and the most that many streams can gain over one."""

    def cells(row: dict, by_rows: dict) -> list[str]:
        return [_f(row["step_ms"]), _f(row["x_1_row"], ".2f"), f"{row['ideal_speedup']:.2f}x"]

    out = []
    for runs, sizes in _groups(root, "streams"):
        columns = ["step ms", "x 1 row", "most gain over 1 stream"]
        out += _section(
            runs,
            _keyed_table(sizes, "step_scaling", "rows", columns, cells),
            "Step ms: one decode step of that many rows (median); x 1 row: against a step of one row; most gain over "
            "1 stream: rows / x 1 row, the tokens/s that many streams can reach over one stream when the step is all "
            "that runs.",
        )
    return "\n".join(out).strip() or _missing("concurrent-streams")


def streams_servers(root: Path, page: Path) -> str:
    """``qwen35-onnx serve`` against ``llama-server`` under the same client load, per machine."""
    out = []
    for runs, sizes in _groups(root, "streams"):
        names = list(dict.fromkeys(n for s in sizes.values() for n in s.data.get("servers", {})))
        if not names:
            continue
        first = next(iter(sizes.values())).data
        load = first["servers"][names[0]]
        header = [f"{load['tokens'] // first['max_tokens']} requests at once, {first['max_tokens']} tokens each"]
        for name in sizes:
            header += [f"{size_label(name)} tokens/s", "time to first token of an arrival, p50 / p95 ms"]
        rows = []
        for name in names:
            label = f"`{name}`" + (f" ({first['slots']} slots)" if name.startswith("qwen35-onnx") else "")
            cells = [label]
            for s in sizes.values():
                server = s.data.get("servers", {}).get(name)
                if server is None:
                    cells += ["-", "-"]
                    continue
                ttft = server.get("arrival_ttft_ms") or {}
                cells += [_f(server["tokens_per_s"]), f"{_f(ttft.get('p50'), '.0f')} / {_f(ttft.get('p95'), '.0f')}"]
            rows.append(cells)
        out += _section(
            runs,
            _table(header, rows),
            "Tokens/s: every request's tokens over the whole run (first request sent to last reply); time to first "
            "token of an arrival: requests sent one after another while the others' streams run.",
        )
    return "\n".join(out).strip() or _missing("server-load")


# ---- speculative decoding (bench --speculative) --------------------------------------------------------------
def speculative_costs(root: Path, page: Path) -> str:
    """The parts of a speculative round against a plain decode step, per machine, the sizes side by side."""
    out = []
    for runs, sizes in _groups(root, "speculative"):
        costs = {name: s.data["costs"] for name, s in sizes.items()}
        header = [""]
        for name in sizes:
            header += [f"{size_label(name)} ms", "x step"]
        ks = sorted({int(k) for c in costs.values() for k in c["verify_ms"]})

        def row(label: str, pick, costs=costs) -> list[str]:
            cells = [label]
            for c in costs.values():
                ms = pick(c)
                cells += [_f(ms), _f(None if ms is None else ms / c["step_ms"], ".2f")]
            return cells

        rows = [row("plain decode step", lambda c: c["step_ms"])]
        rows += [row(f"verify run of {k + 1} tokens (k = {k})", lambda c, k=k: c["verify_ms"].get(str(k))) for k in ks]
        rows.append(row("MTP draft step (one position)", lambda c: c["draft_step_ms"]))
        rows += [
            row(f"MTP run over {k + 1} kept positions (k = {k})", lambda c, k=k: c["mtp_kept_ms"].get(str(k)))
            for k in ks
        ]
        out += _section(
            runs,
            _table(header, rows),
            "Medians of the parts timed in turns (one of each per turn); x step: against the plain decode step.",
        )
    return "\n".join(out).strip() or _missing("speculative-decoding")


def _plains(data: dict) -> dict[int, float]:
    """Plain decoding's tokens/s measured beside each draft length ``k``."""
    return {row["k"]: row["plain"] for row in data["rows"]}


def speculative_rates(root: Path, page: Path) -> str:
    """Decode tokens/s at each draft length and acceptance, against plain decoding measured beside it and against
    the median of the plain runs, and whether the head's own drafts left the greedy tokens unchanged."""
    out = []
    for runs, sizes in _groups(root, "speculative"):
        header = ["k", "drafts kept"]
        for name in sizes:
            header += [f"{size_label(name)} tokens/s", "x plain beside", "x median plain"]
        header.append("tokens = plain's (" + " / ".join(size_label(n) for n in sizes) + ")")
        keys = list(dict.fromkeys((r["k"], r["rate"]) for s in sizes.values() for r in s.data["rows"]))
        rows = []
        for k in sorted({k for k, _ in keys}):
            cells = [str(k), "none: plain decoding beside"]
            for s in sizes.values():
                plain = _plains(s.data).get(k)
                median = s.data["plain_tokens_per_s"]
                cells += [_f(plain), _f(None if plain is None else 1.0, ".2f"), _f(plain and plain / median, ".2f")]
            rows.append([*cells, " / ".join("-" for _ in sizes)])
            for _, rate in [(kk, r) for kk, r in keys if kk == k]:
                found = [
                    next((r for r in s.data["rows"] if (r["k"], r["rate"]) == (k, rate)), None) for s in sizes.values()
                ]
                measured = " / ".join(_f(r and r["acceptance"], ".2f") for r in found)
                cells = [str(k), f"the head's own (measured {measured})" if rate is None else f"forced {rate:.1f}"]
                for r, s in zip(found, sizes.values()):
                    median = s.data["plain_tokens_per_s"]
                    rate_s = r and r["tokens_per_s"]
                    cells += [_f(rate_s), _f(r and r["x_plain"], ".2f"), _f(rate_s and rate_s / median, ".2f")]
                same = " / ".join(
                    "-" if r is None or r["same"] is None else ("yes" if r["same"] else "no") for r in found
                )
                rows.append([*cells, same])
        medians = ", ".join(f"{size_label(n)} {s.data['plain_tokens_per_s']:.1f}" for n, s in sizes.items())
        out += _section(
            runs,
            _table(header, rows),
            f"Greedy decoding of {next(iter(sizes.values())).data['n_tokens']} tokens, int4, random weights with a "
            "random MTP head. Drafts kept: the head's own drafts (random: about none kept), or rounds forced to keep "
            "each draft with that probability whatever the model says (the runs are real, the acceptance is set). "
            "x plain beside: against plain decoding measured just before that k's rows; x median plain: against the "
            f"median of those plain runs (tokens/s: {medians}). Tokens = plain's: whether the head's own drafts gave "
            "exactly plain decoding's greedy tokens (forced rows keep drafts the model did not choose, so they are "
            "not compared).",
        )
    return "\n".join(out).strip() or _missing("speculative-decoding")


def speculative_llamacpp(root: Path, page: Path) -> str:
    """llama.cpp's own MTP drafting on the same checkpoints, against its plain decoding."""
    out = []
    for runs, sizes in _groups(root, "speculative"):
        llama = {n: s.data.get("llama.cpp") or {} for n, s in sizes.items()}
        if not any("rows" in v for v in llama.values()):
            continue
        header = ["k"]
        for name in sizes:
            header += [f"llama.cpp {size_label(name)} tokens/s", "x its plain", "acceptance"]
        ks = sorted({r["k"] for v in llama.values() for r in v.get("rows", [])})
        rows = [["plain", *[c for v in llama.values() for c in (_f(v.get("plain_tokens_per_s")), "1.00", "-")]]]
        for k in ks:
            cells = [str(k)]
            for v in llama.values():
                r = next((r for r in v.get("rows", []) if r["k"] == k), None)
                cells += [_f(r and r["tokens_per_s"]), _f(r and r["x_plain"], ".2f"), _f(r and r["acceptance"], ".2f")]
            rows.append(cells)
        out += _section(
            runs,
            _table(header, rows),
            "`llama-server --spec-type draft-mtp --spec-draft-n-max k` on the same checkpoint and head (GGUF with the "
            "MTP tensors, every tensor Q4_0), decode tokens/s from its own timings (median), against its plain "
            "decoding; acceptance: its drafts kept.",
        )
    return "\n".join(out).strip() or _missing("llama.cpp MTP")


def _row_name(row: dict) -> str:
    """``k = 2 at 0.9`` (a forced acceptance) or ``k = 2 at the head's own drafts``."""
    rate = "the head's own drafts" if row["rate"] is None else row["rate"]
    return f"k = {row['k']} at {rate}"


def _ahead(data: dict) -> list[str]:
    """The rows at or above plain decoding's speed by either measure, as ``k = K at RATE (X beside, Y median)``."""
    median = data["plain_tokens_per_s"]
    return [
        f"{_row_name(r)} ({r['x_plain']:.2f}x beside, {r['tokens_per_s'] / median:.2f}x the median)"
        for r in data["rows"]
        if r["x_plain"] >= 1 or r["tokens_per_s"] >= median
    ]


def speculative_summary(root: Path, page: Path) -> str:
    """Per size: how much the plain runs drifted over the run, and the rows ahead of plain decoding."""
    out = []
    for runs, sizes in _groups(root, "speculative"):
        out += [_caption(runs), ""]
        for name, s in sizes.items():
            plains = list(_plains(s.data).values())
            ahead = _ahead(s.data)
            best = max(s.data["rows"], key=lambda r: r["x_plain"])
            out.append(
                f"- **{size_label(name)}:** plain decoding measured {min(plains):.1f}-{max(plains):.1f} tokens/s "
                f"beside the draft lengths ({max(plains) / min(plains):.2f}x between its slowest and fastest run). "
                + (
                    f"At or above plain decoding by either measure: {'; '.join(ahead)}."
                    if ahead
                    else f"No row reached plain decoding; the closest: {_row_name(best)} ({best['x_plain']:.2f}x)."
                )
            )
        out.append("")
    return "\n".join(out).strip() or _missing("speculative-decoding")


def speculative_readme(root: Path, page: Path) -> str:
    """One sentence for the README: the head's own drafts and the best forced row, with the plain runs' spread."""
    runs = load_runs(root, "speculative")
    if not runs:
        return _missing("speculative-decoding")
    head = [r["x_plain"] for s in runs for r in s.data["rows"] if r["rate"] is None]
    top_rate = max(r["rate"] for s in runs for r in s.data["rows"] if r["rate"] is not None)
    best_run, best = max(
        ((s, r) for s in runs for r in s.data["rows"] if r["rate"] == top_rate), key=lambda item: item[1]["x_plain"]
    )
    plains = list(_plains(best_run.data).values())
    where = sorted({short_run(s.run) for s in runs})
    return (
        f"Measured ({'; '.join(where)}; `benchmarks/speculative/`), random weights: the random head's own drafts "
        f"ran at {min(head):.2f}-{max(head):.2f}x plain decoding's speed; drafts forced to be kept at {top_rate} at "
        f"best {best['x_plain']:.2f}x ({size_label(best_run.name)}, k = {best['k']}), where the plain runs "
        f"themselves varied by up to {max(plains) / min(plains):.2f}x."
    )


# ---- the Ray Serve cluster (benchmarks/cluster_load.py) -------------------------------------------------------
def _setup(args: list[str]) -> str:
    """``["--replicas", "2", "--threads", "1", "--routing", "conversation"]`` -> ``2 replicas x 1 thread,
    conversation routing``."""
    opts = dict(zip(args[::2], args[1::2]))
    threads = opts.get("--threads", "?")
    plural = "" if threads == "1" else "s"
    if "--replicas" not in opts:
        return f"one `serve`, {threads} thread{plural}"
    return f"{opts['--replicas']} replicas x {threads} thread{plural}, {opts.get('--routing', 'conversation')} routing"


def cluster(root: Path, page: Path) -> str:
    """One ``serve`` against ``serve --replicas`` under the same chat load, and what the routing did."""

    def section(stored: StoredRun) -> list[str] | None:
        data, results = stored.data, stored.data["results"]
        single = results.get("single")
        load, export = data["load"], data["export"]
        slots = export["slots"] or 1
        turns = load["turns"]
        replies = [r["completion_tokens"] for res in results.values() for r in res.get("records", [])]
        rows = []
        for res in results.values():
            routes = res.get("routes") or {}
            sent = routes.get("home", 0) + routes.get("away", 0)
            rows.append(
                [
                    _setup(res["args"]),
                    _f(res["throughput_tok_s"]),
                    _f(res["throughput_x_single"], ".2f"),
                    f"{res['ttft_median_s']:.2f} / {res['ttft_p95_s']:.2f}",
                    _f(res["ttft_p95_x_single"], ".2f"),
                    f"{routes.get('home', 0):.0f} of {sent:.0f}" if sent else "-",
                    str(res["prefilled_tokens_later_turns"]),
                ]
            )
        header = [
            "",
            "tokens/s (all clients)",
            "x one serve",
            "time to first token, median / p95 s",
            "p95 x one serve",
            "sent home",
            f"tokens prefilled, turns 2-{turns}",
        ]
        notes = []
        for res in results.values():
            routes = res.get("routes") or {}
            away, sent = routes.get("away", 0), routes.get("home", 0) + routes.get("away", 0)
            if not sent or single is None:
                continue
            prefilled = res["prefilled_tokens_later_turns"] / single["prefilled_tokens_later_turns"]
            if away:
                notes.append(
                    f"{_setup(res['args'])} sent {away:.0f} of {sent:.0f} resent turns away from the replica "
                    f"holding their conversation, where only an older state of it was kept: {res['hit_rate']:.0%} of "
                    f"its turns 2-{turns} still found some state, and {res['cached_share']:.0%} of those turns' prompt "
                    f"tokens were cached against {single['cached_share']:.0%} with one serve, so it prefilled "
                    f"{prefilled:.2f}x the tokens and its p95 time to first token was "
                    f"{res['ttft_p95_x_single']:.2f}x one serve's."
                )
            else:
                notes.append(
                    f"{_setup(res['args'])} sent every resent turn home and prefilled {prefilled:.2f}x the tokens one "
                    "serve did."
                )
        return _section(
            [stored],
            _table(header, rows),
            f"{load['clients']} OpenAI clients at once, each a {turns}-turn conversation of its own, streamed, "
            f"greedy, {min(replies)} to {max(replies)} tokens a reply, on {load['cpus']} CPUs; the export: "
            f"{export['quantize']}, --ops {export['ops']}, capacity {export['capacity']}, prefill chunks "
            f"{','.join(map(str, export['prefill_chunks']))}, {slots} decode slot{'' if slots == 1 else 's'}. Sent "
            "home: resent turns the router sent to the replica holding the longest prefix of their messages.",
            *notes,
        )

    return _each(load_runs(root, "cluster"), section, "cluster")


# ---- video (benchmarks/video_bench.py, benchmarks/video_decoders.py) ------------------------------------------
def _clip(clip: dict) -> str:
    codec = f" {clip['codec']}" if clip.get("codec") else ""
    return f"a {clip['seconds']:g}-second {clip['size']}{codec} clip at {clip['fps']} frames per second"


def video_ttft(root: Path, page: Path) -> str:
    """A video question's time to first token on ONNX Runtime, OpenVINO and OpenVINO GenAI's pipeline."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        if "question" not in data:
            return None
        header = [
            "",
            "read ms",
            "pixels ms",
            "vision ms (a frame pair)",
            "time to first token, ms",
            "frame pairs",
            "video tokens",
            "prompt tokens",
        ]
        rows = []
        for label, r in data["rows"].items():
            vision = "-" if r.get("vision_ms") is None else f"{r['vision_ms']:.0f} ({r['vision_ms_per_pair']:.0f})"
            rows.append(
                [
                    label,
                    _f(r.get("read_ms"), ".0f"),
                    _f(r.get("pixels_ms"), ".0f"),
                    vision,
                    _f(r.get("ttft_ms"), ".0f"),
                    _f(r.get("frame_pairs"), "d"),
                    _f(r.get("video_tokens"), "d"),
                    _f(r.get("prompt_tokens"), "d"),
                ]
            )
        return _section(
            [stored],
            _table(header, rows),
            f"The question {data['question']!r} about {_clip(data['clip'])}, sampled at {data['clip']['sampled_fps']} "
            "frames per second, Qwen3.5-0.8B dimensions (random weights), int4; read: decoding the sampled frames; "
            "pixels: resizing and normalizing them; vision: every frame pair through the vision graph; time to first "
            "token: from the file to the first generated token, all of these included. Prompt tokens are each "
            "pipeline's own (its processor's frame sampling and size).",
        )

    return _each(load_runs(root, "video"), section, "video")


def video_openvino_grids(root: Path, page: Path) -> str:
    """OpenVINO's vision graph at several frame-pair grids: one dynamic compile against per-grid static compiles."""

    def section(stored: StoredRun) -> list[str] | None:
        configs = stored.data.get("openvino_grids")
        if not configs:
            return None

        def name(c: dict) -> str:
            n = c["vision_grid_cache"]
            return "one dynamic compile (default)" if not n else f"`--vision-grid-cache {n}`"

        header = ["grid (h x w patches)", "--max-video-tokens"]
        for c in configs:
            header += [f"{name(c)}: compile / first run / next run ms", "RSS after, GB"]
        rows = [
            [
                "loaded, before any grid",
                "-",
                *[c for cfg in configs for c in ("-", f"{cfg['rss_loaded_bytes'] / 1e9:.2f}")],
            ]
        ]
        for i, grid in enumerate(configs[0]["grids"]):
            cells = [f"{grid['grid'][0]} x {grid['grid'][1]}", str(grid["max_video_tokens"])]
            for cfg in configs:
                g = cfg["grids"][i]
                cells += [
                    f"{_f(g['compile_ms'], '.0f')} / {g['first_run_ms']:.0f} / {g['run_ms']:.0f}",
                    f"{g['rss_bytes'] / 1e9:.2f}",
                ]
            rows.append(cells)
        rows.append(["peak", "-", *[c for cfg in configs for c in ("-", f"{cfg['peak_rss_bytes'] / 1e9:.2f}")]])
        return _section(
            [stored],
            _table(header, rows),
            "The 0.8B int4 any-grid export's vision graph on OpenVINO's CPU plugin, one frame pair at each grid in "
            "turn. Compile: OpenVINO's compile of that grid (- where one dynamic compile serves every grid); first "
            "run includes it. RSS: the process's resident memory (VmRSS) after the grid's runs, peak its VmHWM "
            "(GB = 1e9 bytes).",
        )

    return _each(load_runs(root, "video"), section, "OpenVINO video-grid")


def video_decoders(root: Path, page: Path) -> str:
    """Video decoders compared on the same clips."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        if "question" in data or "rows" not in data:
            return None
        header = ["codec", "decoder", "version", "decode ms", "frames", "max abs difference vs PyAV", "installed MB"]
        rows = [
            [
                r["codec"],
                r["decoder"],
                r["version"],
                _f(r["decode_ms"], ".0f"),
                str(r["frames"]),
                str(r["max_abs_diff_vs_pyav"]),
                _f(r["installed_mb"]),
            ]
            for r in data["rows"]
        ]
        return _section(
            [stored],
            _table(header, rows, ":--"),
            f"{_clip(data['clip'])[0].upper()}{_clip(data['clip'])[1:]} ({data['clip']['source']}), decoded to RGB "
            "frames: every frame, or those sampled at 2 frames per second (`2 fps converted`). Max abs difference: "
            "the largest pixel difference from PyAV's frames; installed: the size of the decoder's packages.",
        )

    return _each(load_runs(root, "video"), section, "video-decoder")


# ---- the grammar (benchmarks/grammar_vocab.py) -----------------------------------------------------------------
def grammar(root: Path, page: Path) -> str:
    """Constrained decoding's cost per token on a vocabulary of the published shape, against a decode step."""
    path = Path("benchmarks/grammar_vocab.json")
    if not (Path(root) / path).is_file():
        return _missing("grammar")
    stored = load_run(root, path)
    data = stored.data
    decode = data["decode_ms_per_step"]
    rows = []
    for key, value in data.items():
        if key.endswith(" (project)") and isinstance(value, dict) and "ms_per_token_median" in value:
            median = value["ms_per_token_median"]
            rows.append(
                [
                    key.removesuffix(" (project)"),
                    f"{median:.2f} / {value['ms_per_token_max']:.2f}",
                    _f(decode),
                    f"{100 * median / decode:.1f} %",
                ]
            )
    export = data["export"]
    return "\n".join(
        [
            caption([stored]),
            "",
            *_table(["reply", "grammar ms per token, median / max", "decode step ms", "grammar / decode step"], rows),
            "",
            f"The grammar's mask and matcher per token over {data['replies']} replies, on the published tokenizer's "
            f"shape ({data['tokenizer_entries']} entries); the decode step: the Qwen3.5-0.8B dimensions, "
            f"{export['quantize']}, --ops {export['ops']}, {export['threads']} threads, in the same run. Reading the "
            f"tokenizer for the grammar took {data['llg_tokenizer_s (project)']:.2f} s, once per process.",
        ]
    )


# ---- kept states on disk (benchmarks/state_cache_restart.py) ---------------------------------------------------
def state_cache(root: Path, page: Path) -> str:
    """An agent prefix served cold, then after a restart from the states kept on disk."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        if "from_disk" not in data:
            return None
        cold, warm = data["cold"], data["from_disk"]
        export = data.get("export", {})
        rows = [
            [
                label,
                f"{r['ttft_s']:.1f}",
                str(r["prompt_tokens"]),
                str(r["cached_tokens"]),
            ]
            for label, r in (("cold (first server)", cold), ("after a restart, a new session", warm))
        ]
        return _section(
            [stored],
            _table(["", "time to first token, s", "prompt tokens", "tokens from kept states"], rows),
            f"A {data['prefix_tokens']:,}-token agent prefix (a system prompt and {data['tools']} tool schemas) with a "
            f"question, on `serve --state-cache-dir` of the {size_label(stored.name)} {export.get('quantize', '')} "
            f"export (capacity {export.get('capacity', '-'):,}, {data.get('threads', '-')} threads); then the server "
            "restarted and a new session with the same prefix and another question. From disk: "
            f"{100 * data['ttft_ratio']:.1f} % of the cold time to first token ({data['kept_files']} files, "
            f"{data['kept_bytes'] / 2**20:,.0f} MiB kept).",
        )

    return _each(load_runs(root, "state_cache"), section, "kept-states-on-disk")


# ---- what a token of KV cache takes (computed from the published configurations, not measured) ----------------
def kv_token_bytes(root: Path, page: Path) -> str:
    """The KV cache's bytes per token of one sequence for each published size and KV precision, and per 1,000
    tokens, from :mod:`qwen35_onnx.presets` (``2 x full-attention layers x KV heads x head_dim x bytes``)."""
    from ..contract import DTYPE_BYTES
    from ..presets import PRESETS, preset_config

    rows = []
    for name in (n for n in PRESETS if n != "tiny"):
        text = preset_config(name).text_config
        full = sum(kind == "full_attention" for kind in text.layer_types)
        values = 2 * full * text.num_key_value_heads * text.head_dim
        cells = [
            f"{values * DTYPE_BYTES[d] / 1024:g} KiB / {values * DTYPE_BYTES[d] * 1000 / 2**20:.1f} MiB"
            for d in (
                "fp32",
                "fp16",
                "int8",
            )
        ]
        rows.append(
            [f"Qwen{name.removeprefix('qwen')[:-1]}B", f"{full} x {text.num_key_value_heads} x {text.head_dim}", *cells]
        )
    table = _table(
        ["model", "full-attention layers x KV heads x head_dim", "fp32", "fp16 / bf16", "int8"], rows, "---:"
    )
    note = (
        "Per token / per 1,000 tokens of one sequence, computed from the published configurations "
        "(`src/qwen35_onnx/presets.py`), not measured."
    )
    return "\n".join([*table, "", note])


# ---- KV tiers (benchmarks/kv_tiers.py) ----------------------------------------------------------------------
def kv_tiers(root: Path, page: Path) -> str:
    """Decode ms/token at a few depths with the default KV tiers against one width (the capacity)."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        exports = data.get("exports", {})
        if len(exports) != 2:
            return None
        (tiered_label, tiered), (one_label, one) = exports.items()
        header = ["depth, tokens", "tiers: width", "tiers: ms/token", "one width: ms/token", "one width / tiers"]
        header += ["tiers: Pss, GiB", "one width: Pss, GiB"]
        rows = [
            [
                f"{a['depth']:,}",
                f"{a['width']:,}",
                f"{a['median_ms']:.1f}",
                f"{b['median_ms']:.1f}",
                f"{b['median_ms'] / a['median_ms']:.1f}x",
                f"{a['pss_bytes'] / 2**30:.2f}",
                f"{b['pss_bytes'] / 2**30:.2f}",
            ]
            for a, b in zip(tiered["depths"], one["depths"])
        ]
        tiers = ", ".join(f"{w:,}" for w in tiered["kv_tiers"])
        return _section(
            [stored],
            _table(header, rows),
            f"The {size_label(data['preset'])} {tiered['quantize']} `--ops portable` export (capacity "
            f"{tiered['capacity']:,}, KV cache {tiered['kv_dtype']}) on OpenVINO, {data['threads']} threads: "
            f"{tiered_label} (KV tiers {tiers}) against {one_label} (`--kv-tiers none`: every step at the capacity). "
            f"A generation holding that many tokens steps {data['steps']} times after {data['warmup']} (the first "
            "one moves it up where its tier is full: the width is the one the timed steps ran at); ms/token: the "
            f"median step, the median of {data['rounds']} rounds; Pss: the process after the steps (weights, "
            "states and activations; one process per export and round, the depths in this order).",
        )

    return _each(load_runs(root, "kv_tiers"), section, "KV tiers")


# ---- what a capacity costs in memory (benchmarks/capacity_memory.py) -------------------------------------------
def capacity_memory(root: Path, page: Path) -> str:
    """Pss of the default capacity against a 2,048-token export, after an 8k-token prompt, with 4 slots, and
    llama.cpp's server at the same context."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        measures = data.get("measures", {})
        if "64k load" not in measures:
            return None
        gb = lambda value: f"{value / 1e9:.2f}"  # noqa: E731
        exports = data["exports"]

        def name(key: str) -> str:
            e = exports[key]
            kv = e.get("kv_dtype") or "fp32"
            slots = f", {e['slots']} slots" if e.get("slots", 1) > 1 else ""
            return f"capacity {e['capacity']:,}, KV {kv}{slots}"

        rows = [
            [name(key), "after a 32-token reply", gb(measures[f"{key} load"]["after_short_reply"]), "-"]
            for key in ("2k-fp32kv", "2k", "64k")
            if f"{key} load" in measures
        ]
        long = measures.get("64k 8k", {})
        if "after_8k_prompt" in long:
            rows.append([name("64k"), "after an 8,192-token prompt and 32 tokens", gb(long["after_8k_prompt"]), "-"])
        if "64k-4slots slots" in measures:
            four = measures["64k-4slots slots"]["after_four_streams"]
            rows.append([name("64k-4slots"), "after four short replies decoded together", gb(four), "-"])
        peer = data.get("llama.cpp")
        if peer:
            server = f"llama.cpp `llama-server -c {peer['context']:,}` (f16 KV)"
            rows.append([server, "an 8,192-token prompt", "-", gb(peer["peak_rss"])])
        return _section(
            [stored],
            _table(["", "when", "this project: Pss, GB", "peak RSS, GB"], rows),
            f"The {size_label(data['preset'])} `export --quantize int4` (`--ops ort`) at each capacity, one process "
            "per line. Pss (`/proc/self/smaps_rollup`): the process's share of its resident memory (the pre-packed "
            "weights are a shared file mapping); peak RSS: llama.cpp's server process's `VmHWM`. GB = 1e9 bytes.",
        )

    return _each(load_runs(root, "capacity"), section, "capacity-memory")


# ---- KV cache precision (benchmarks/kv_precision.py) -----------------------------------------------------------
def kv_precision(root: Path, page: Path) -> str:
    """Agreement with an fp32 KV cache and speed at depth, per ``--kv-dtype``."""

    def section(stored: StoredRun) -> list[str] | None:
        data = stored.data
        precisions = data.get("precisions")
        if not precisions:
            return None
        lengths = sorted({int(n) for p in precisions.values() for n in p["speed"]})
        header = ["--kv-dtype", "top-1 agreement with fp32"]
        header += [f"time to first token at {n:,}, s" for n in lengths]
        header += [f"decode at {n:,}, ms/token" for n in lengths]
        rows = []
        for dtype, p in precisions.items():
            cells = [f"`{dtype}`", f"{100 * p['agreement']:.1f} %"]
            speed = [p["speed"].get(str(n)) for n in lengths]
            cells += [_f(r and r["ttft_ms"] / 1000) for r in speed]
            cells += [_f(r and r["decode_ms"], ".2f") for r in speed]
            rows.append(cells)
        checkpoint = data["checkpoint"]
        what = f"{size_label(checkpoint)} (random weights)"
        if checkpoint == "trained":
            what = "The trained demo checkpoint"
        return _section(
            [stored],
            _table(header, rows),
            f"{what}, `export --quantize int4` with each KV precision. Agreement: a prompt of real text, then the "
            "fp32 cache's greedy tokens fed to each export (teacher forcing); the share of positions where its "
            "greedy choice is fp32's. Speed: a prompt of random tokens of each length, its first token, then decode "
            "steps at that depth (median of 10 after 3).",
        )

    return _each(load_runs(root, "kv_precision"), section, "KV-precision")
