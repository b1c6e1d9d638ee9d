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
    report = {
        "run": run_info(),
        "export": str(folder),
        "n_tokens": n_tokens,
        "plain_tokens_per_s": plain,
        "costs": costs,
        "rows": rows,
    }
    (work_dir / "speculative.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (work_dir / "speculative.md").write_text("\n".join(report_lines(report)) + "\n")
    return report


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
    return lines
