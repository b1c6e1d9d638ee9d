"""``bench --speculative``: what speculative decoding with the MTP head costs and gains on this machine, side by
side in one run (not a test).

The preset's checkpoint gets an MTP head (:func:`~qwen35_onnx.export.mtp.link_mtp_checkpoint`: random weights,
as the bench checkpoints' others; published checkpoints ship trained heads) and is exported at int4 with its MTP
and verify graphs (cached in the work folder). Measured, medians over repeated runs:

- the cost of each part against a plain decode step: a verify run of ``k + 1`` tokens, the MTP head's draft step
  (one position) and its run over the ``k + 1`` positions a round kept;
- decode tokens/s of plain greedy decoding and of speculative greedy decoding at each draft length ``k`` and
  each fixed acceptance rate (every part runs as in a real round, and the round keeps each draft with that
  probability whatever the target says: :class:`~qwen35_onnx.runtime.speculative.Speculation`'s
  ``forced_acceptance``; random weights give their head no real acceptance, and int4 products over several rows
  round differently from one row's, so the random model's near-ties would break forced drafts of the plain
  tokens), and at the MTP head's own drafts (random: acceptance about 0, the cost of a round that gains
  nothing, whose tokens equal plain decoding's where no near-tie flips).

Beside them, llama.cpp's own MTP drafting on the same checkpoint (:func:`llamacpp_mtp`): the checkpoint with its
head converted to GGUF (MTP tensors kept) and quantized as the bench's ``llama.cpp Q4_0 pure`` row, then
``llama-server`` greedy on the same prompt without drafting and with ``--spec-type draft-mtp --spec-draft-n-max k``
(its decode tokens/s and acceptance, from its ``timings``); it drafts with the same random head, so its
acceptance is about 0 too (no forced rates: llama.cpp has no such knob).

A round of ``k`` drafts at per-token acceptance ``a`` emits ``1 + a + a^2 + ... + a^k`` tokens on average (the
drafts up to the first rejected one, plus the target's own) for one verify run, ``k`` draft steps and one run of
the head over the kept positions; speculation gains where that beats as many plain steps.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

RATES = (0.5, 0.7, 0.9)
"""Fixed per-token acceptance rates the bench forces (issue 39)."""
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def expected_tokens(k: int, rate: float) -> float:
    """Tokens a round of ``k`` drafts emits on average at per-token acceptance ``rate``: ``sum(rate^i, i=0..k)``."""
    return sum(rate**i for i in range(k + 1))


def component_costs(pipe, repeats: int = 16) -> dict:
    """Milliseconds (medians) of a plain decode step, a verify run of ``k + 1`` tokens for each ``k`` the export
    verifies, an MTP draft step (one position) and the MTP head's run over ``k + 1`` positions, each after a short
    prompt, measured in turns (one of each per turn, after 2 turns to warm up: every part sees the same machine);
    ``{"step_ms", "verify_ms": {k: ms}, "draft_step_ms", "mtp_kept_ms": {k: ms}}``."""
    from ..runtime.generation import Generation
    from ..runtime.speculative import Speculation

    prepared = pipe.prepare(None, PROMPT)
    backend, contract = pipe.backend, pipe.contract
    plain = Generation(backend, prepared)
    plain.prefill()
    generation = Generation(backend, prepared)
    speculation = Speculation(generation, contract.draft_tokens)
    generation.prefill()
    hidden = np.zeros((contract.draft_tokens + 1, contract.hidden_size), dtype=np.float32)
    position = generation.length
    parts = {"step": lambda: plain.step(5)}
    for k in range(1, contract.draft_tokens + 1):

        def verify(k=k):
            generation.verify([5] * (k + 1))
            generation.commit(1)

        parts[f"verify {k}"] = verify
    for k in range(0, contract.draft_tokens + 1):
        size = next(s for s in contract.mtp_sizes if s >= k + 1)
        feeds = speculation._mtp_feeds(position, hidden[: k + 1], [5] * (k + 1), size)
        parts[f"mtp {k}"] = lambda feeds=feeds, size=size: backend.run_mtp(size, feeds, speculation.cache)
    times: dict[str, list[float]] = {name: [] for name in parts}
    for turn in range(repeats + 2):
        for name, run in parts.items():
            begin = time.perf_counter()
            run()
            if turn >= 2:
                times[name].append(1000 * (time.perf_counter() - begin))
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {
        "step_ms": ms["step"],
        "verify_ms": {k: ms[f"verify {k}"] for k in range(1, contract.draft_tokens + 1)},
        "draft_step_ms": ms["mtp 0"],
        "mtp_kept_ms": {k: ms[f"mtp {k}"] for k in range(1, contract.draft_tokens + 1)},
    }


def speculative_rate(pipe, prepared, n: int, k: int, rate: float | None) -> dict:
    """Greedy decoding of ``n`` tokens of ``prepared`` with ``k`` drafts a round: at the MTP head's own drafts
    (``rate`` None), or at forced acceptance ``rate``. Returns ``{"tokens_per_s", "acceptance", "verify_runs",
    "tokens"}``."""
    from ..runtime.generation import Generation
    from ..runtime.sampling import Sampler, SamplingConfig
    from ..runtime.speculative import Speculation

    generation = Generation(pipe.backend, prepared)
    speculation = Speculation(generation, k, forced_acceptance=rate)
    sampler = Sampler(SamplingConfig())
    emitted = [sampler(generation.prefill())]
    while len(emitted) < n:
        if speculation.drafts_for():
            tokens = speculation.round(emitted[-1], sampler)[: n - len(emitted)]
            emitted.extend(tokens)
            speculation.commit(len(tokens))
        else:
            emitted.append(sampler(generation.step(emitted[-1])))
            speculation.stop()
    t = generation.timings
    return {"tokens_per_s": t.tokens_per_s, "acceptance": t.acceptance, "verify_runs": t.verify_runs, "tokens": emitted}


def run_speculative(checkpoint: Path, work_dir: Path, n_tokens: int = 128, log=print) -> dict:
    """The whole ``bench --speculative`` run (see the module docstring) on the preset ``checkpoint``: its MTP
    checkpoint and int4 export in ``work_dir`` (cached), the component costs, then tokens/s. Writes
    ``work_dir/speculative.json`` and ``speculative.md``; returns the report."""
    import json

    from ..contract import Quantization
    from ..export.exporter import export
    from ..export.mtp import link_mtp_checkpoint
    from ..export.options import ExportOptions
    from ..paths import has_mtp_weights
    from ..pipeline import Pipeline
    from ..runtime.backend import RuntimeOptions, usable_cpus
    from ..runtime.sampling import SamplingConfig
    from ..runtime.select import share_threads
    from .results import run_info
    from .speed import _is_cached

    work_dir = Path(work_dir)
    source = Path(checkpoint)
    if not has_mtp_weights(source):
        source = work_dir / "checkpoint-mtp"
        if not (source.is_dir() and has_mtp_weights(source)):
            log(f"[bench] adding a random MTP head to {checkpoint} (linked) in {source} ...")
            link_mtp_checkpoint(checkpoint, source)
    folder = work_dir / "ort-int4-mtp"
    options = ExportOptions(quantize=Quantization.INT4, overwrite=True)
    if not _is_cached(folder, options):
        log(f"[bench] exporting {source} at int4 with its MTP and verify graphs into {folder} ...")
        export(source, folder, options)
    runtime = RuntimeOptions(threads=usable_cpus())
    share_threads(runtime)
    pipe = Pipeline.from_exported(folder, runtime)
    log("[bench] component costs ...")
    costs = component_costs(pipe)
    prepared = pipe.prepare(None, PROMPT)
    greedy = SamplingConfig()
    truth = pipe.generate_prepared(prepared, n_tokens, greedy, draft_tokens=0).token_ids
    rows, plains = [], []
    for k in range(1, pipe.contract.draft_tokens + 1):
        # plain decoding again beside each draft length's rows: the machine's speed drifts over a run
        plain = pipe.generate_prepared(prepared, n_tokens, greedy, draft_tokens=0).timings.tokens_per_s
        plains.append(plain)
        for rate in (None, *RATES):
            log(f"[bench] k={k} acceptance {'MTP head' if rate is None else rate} ...")
            result = speculative_rate(pipe, prepared, n_tokens, k, rate)
            same = result.pop("tokens") == truth if rate is None else None
            rows.append(
                {
                    "k": k,
                    "rate": rate,
                    **result,
                    "same": same,
                    "plain": plain,
                    "x_plain": result["tokens_per_s"] / plain,
                }
            )
    plain = statistics.median(plains)
    llama = llamacpp_mtp(source, work_dir, n_tokens, runtime.intra_op_threads, pipe.contract.draft_tokens, log)
    report = {
        "run": run_info(),
        "export": str(folder),
        "n_tokens": n_tokens,
        "plain_tokens_per_s": plain,
        "costs": costs,
        "rows": rows,
        "llama.cpp": llama,
    }
    (work_dir / "speculative.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (work_dir / "speculative.md").write_text("\n".join(report_lines(report)) + "\n")
    return report


LLAMACPP_RUNS = 3
"""Requests per llama-server configuration (the median's tokens/s is reported)."""


def llamacpp_mtp(checkpoint: Path, work_dir: Path, n_tokens: int, threads: int, max_k: int, log=print) -> dict:
    """llama.cpp's MTP drafting on ``checkpoint`` (with its ``mtp.*`` head): converted with the head into
    ``work_dir/llama.cpp-mtp`` and quantized as the ``llama.cpp Q4_0 pure`` row (once), then ``llama-server`` (one
    slot, ``threads`` threads) answering :data:`PROMPT` greedily with ``n_tokens`` tokens (end of sequence
    ignored) :data:`LLAMACPP_RUNS` times, without drafting and with ``--spec-type draft-mtp --spec-draft-n-max k``
    for ``k`` 1..``max_k``. Returns ``{"gguf", "plain_tokens_per_s", "rows": [{"k", "tokens_per_s", "x_plain",
    "acceptance"}]}`` (decode tokens/s: llama-server's ``timings.predicted_per_second``, median), or
    ``{"error": ...}`` where a step failed (the bench goes on without the row).

    Raises nothing for llama.cpp's failures (they are reported in the result)."""
    import httpx

    from .llamacpp import check_tokenizer, convert, ensure_converter_venv, ensure_llamacpp, gguf_for
    from .streams import _server, free_port

    work_dir = Path(work_dir)
    try:
        llama = ensure_llamacpp(work_dir.parent / ".llama.cpp", log)
        python = ensure_converter_venv(work_dir.parent / ".venv-llamacpp", llama, log)
        bf16, _ = convert(python, llama, checkpoint, work_dir / "llama.cpp-mtp", log)
        check_tokenizer(llama, bf16, checkpoint)
        model = gguf_for("llama.cpp Q4_0 pure", llama, bf16, log)
    except (RuntimeError, OSError) as exc:
        log(f"[bench] llama.cpp MTP: {exc}")
        return {"error": str(exc)}

    def measure(k: int) -> dict:
        port = free_port()
        cmd = [llama.tool("llama-server"), "-m", str(model), "--port", str(port), "--parallel", "1", "-c", "2048"]
        cmd += ["-t", str(threads), "-tb", str(threads), "--no-webui", "--jinja"]
        if k:
            cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
        rates, drafted, accepted = [], 0, 0
        with _server(cmd, port, "llama-server") as url:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": n_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            }
            for _ in range(LLAMACPP_RUNS + 1):  # the first warms up
                timings = httpx.post(f"{url}/chat/completions", json=body, timeout=600).json()["timings"]
                rates.append(timings["predicted_per_second"])
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
        return {"tokens_per_s": statistics.median(rates[1:]), "acceptance": accepted / drafted if drafted else None}

    try:
        log(f"[bench] llama-server ({model.name}) without drafting ...")
        plain = measure(0)["tokens_per_s"]
        rows = []
        for k in range(1, max_k + 1):
            log(f"[bench] llama-server --spec-type draft-mtp --spec-draft-n-max {k} ...")
            row = measure(k)
            rows.append({"k": k, **row, "x_plain": row["tokens_per_s"] / plain})
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        log(f"[bench] llama.cpp MTP: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"gguf": str(model), "plain_tokens_per_s": plain, "rows": rows}


def report_lines(report: dict) -> list[str]:
    """The report as Markdown: the component costs against a decode step, then tokens/s by draft length and
    acceptance."""
    c = report["costs"]
    step = c["step_ms"]
    lines = [
        f"plain decode step {step:.1f} ms; MTP draft step {c['draft_step_ms']:.1f} ms ({c['draft_step_ms'] / step:.2f}"
        " x step)",
        "",
        "| k | verify run of k+1 tokens ms | x step | MTP over k+1 kept positions ms | x step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, ms in c["verify_ms"].items():
        kept = c["mtp_kept_ms"][k]
        lines.append(f"| {k} | {ms:.1f} | {ms / step:.2f} | {kept:.1f} | {kept / step:.2f} |")
    lines += [
        "",
        f"plain greedy decode: {report['plain_tokens_per_s']:.1f} tokens/s ({report['n_tokens']} tokens; median of "
        "the runs beside each draft length, which x plain divides by)",
        "",
        "| k | acceptance forced | acceptance measured | tokens/s | x plain | tokens = plain's |",
        "|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in report["rows"]:
        forced = "MTP head" if row["rate"] is None else f"{row['rate']:.1f}"
        measured = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        lines.append(
            f"| {row['k']} | {forced} | {measured} | {row['tokens_per_s']:.1f} | {row['x_plain']:.2f} | "
            f"{'-' if row['same'] is None else ('yes' if row['same'] else 'no')} |"
        )
    llama = report.get("llama.cpp")
    if llama and "error" in llama:
        lines += ["", f"llama.cpp MTP drafting: not measured ({llama['error']})"]
    elif llama:
        lines += [
            "",
            f"llama.cpp (`llama-server`, {Path(llama['gguf']).name}, the same head): plain "
            f"{llama['plain_tokens_per_s']:.1f} tokens/s",
            "",
            "| k | llama.cpp --spec-type draft-mtp tokens/s | x its plain | acceptance measured |",
            "|---:|---:|---:|---:|",
        ]
        for row in llama["rows"]:
            measured = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            lines.append(f"| {row['k']} | {row['tokens_per_s']:.1f} | {row['x_plain']:.2f} | {measured} |")
    return lines
