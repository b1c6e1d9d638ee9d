"""Side-by-side speed benchmark (``qwen35-onnx bench``, ``make bench``); not part of the tests.

The protocol of the reference system (:class:`~.protocol.Protocol`). Prompts are random ordinary
tokens (the same ids for every peer). All peers run in one command, one after the other,
on the same checkpoint:

- this project on ONNX Runtime: ``ort int4`` is the export a user gets by default with
  ``--quantize int4`` (prefill chunks, the default capacity, block, accuracy level and int8 KV cache), ``ort int4
  kv32`` the same with an fp32 KV cache; portable
  fp32, ort fp32, ort int8, portable int4 and ``ort int4 buckets`` (the same with prefill buckets
  at the bench's lengths) are bucket exports, ``ort int4 b32`` uses block 32 (as llama.cpp's Q4_0);
- this project on OpenVINO (``runtime="openvino"``): the portable fp32 and portable int4
  exports, each with inference precision f32 and bf16; the same measuring function as the ONNX
  Runtime rows (:func:`bench_pipeline` takes a Pipeline, whatever its runtime);
- ``transformers`` eager on CPU (the PyTorch reference);
- ``onnxruntime-genai`` (its model builder run on the same checkpoint, fp32 and int4), when
  the package is installed;
- OpenVINO's own Qwen3.5 pipeline: optimum-intel's export to OpenVINO IR (int4, symmetric,
  group size 32) run by openvino-genai's ``VLMPipeline``, with the f32 and bf16 precision hints.
  optimum-intel pins an older transformers, so it runs from its own virtual environment
  (``WORK_DIR/../.venv-optimum``, created with :data:`~.peers.OPTIMUM_VENV_PINS`), in a subprocess
  that runs :mod:`.ovgenai_peer` and prints JSON;
- llama.cpp (:mod:`.llamacpp`): built once from the ``llama-cpp-python`` source distribution, the
  checkpoint converted to GGUF (BF16) and quantized to Q4_0 (llama-quantize's default mix and
  ``--pure``) and Q8_0, measured by ``llama-bench`` at the same lengths and threads, and an image
  prompt through ``llama-mtmd-cli``;
- ik_llama.cpp, the CPU-tuned fork (the same module): built once from the ``ik-llama-cpp-python``
  source distribution, run with run-time repacking (``-rtr``) on the llama.cpp Q4_0 pure row's own
  file, and on its own 4-bit type (IQ4_KS, every tensor) as stored and repacked, measured the same
  way;
- the floor: bytes read per decode token (weights + states) / the machine's read
  bandwidth, measured in the same run (ONNX Runtime ReduceSum over 1 GiB);
- constrained decoding (:mod:`.constrained`): the grammar's time per token against the decode
  step, on the first of this project's ONNX Runtime rows measured;
- images (:mod:`.vision`): each of this project's rows' vision time per grid and the time to first
  token of a question about a 640 x 480 photo, next to OpenVINO GenAI's on the same photo;
- prefill (:mod:`.prefill`): time to first token by prompt length for the int4 rows with prefill
  chunks (``ort int4``, the default) and with prefill buckets (``ort int4 buckets``) and
  onnxruntime-genai int4, and turn 4 of a long conversation continued from kept states.

Agent-sized contexts: ``--lengths 1024,8192,32768`` measures every figure at those lengths (time to
first token = the prefill of the whole prompt, decode at that depth, peak memory by length); the
exports are sized to the longest length plus :data:`DECODE_ROOM`, llama-bench sizes its contexts
itself.

Outputs ``bench.md`` (table, ratios against each peer), ``bench.json`` and ``bench.png`` (:mod:`.report`).
Times are milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np

from ..contract import ContractError, read_manifest
from ..export.options import ANY_GRID, ExportOptions
from ..host_memory import release_freed_memory
from ..paths import check_folder
from ..runtime.onnxruntime.sessions import shrink_shared_arena
from ..runtime.sampling import SamplingConfig
from .constrained import constrained_costs, constrained_lines
from .llamacpp import LLAMACPP_ROWS, bench_llamacpp_row, prepare_llamacpp
from .memory import reset_peak, resident
from .peers import bench_genai, bench_ovgenai, bench_transformers, build_genai, build_optimum, ensure_optimum_venv
from .prefill import PREFILL_LENGTHS, conversation_cost, genai_ttft, prefill_lines, ttft_by_length
from .protocol import (
    PeerResult,
    Protocol,
    decode_weight_bytes,
    median_ms,
    merge_rounds,
    read_bandwidths,
    step_state_bytes,
)
from .report import (
    floor_target_lines,
    ik_target_lines,
    llamacpp_target_lines,
    memory_by_length_lines,
    report,
    target_lines,
)
from .results import run_info
from .vision import QUESTION, ImageCost, image_costs, image_lines, photo

LENGTHS = (32, 512, 1024, 2048)
PREFILL_ROWS = ("ort int4", "ort int4 buckets", "genai int4")
"""The rows whose time to first token by prompt length the "Prefill" section measures."""
DECODE_ROOM = 256
"""Tokens of capacity past the longest prompt length (decode is timed at each length)."""
DEFAULT_CAPACITY = ExportOptions().capacity
"""The export's default capacity (``--max-seq-len``): the bench's chunked exports (the default export's rows) have at
least it, so that they are the export a user gets, and the conversation of the "Prefill" section fits; bucket
exports and portable ones (whose prefill writes, or whose decode steps read, the whole width) have the longest
length plus :data:`DECODE_ROOM`."""
#: The exports this project's rows run: folder name (spaces as dashes) -> ExportOptions fields, and
#: whether it prefills with buckets at the bench's lengths (else the default: prefill chunks).
EXPORTS = {
    "portable fp32": (dict(ops="portable", vision_grids="static"), True),  # static grids: OpenVINO runs these
    "ort fp32": (dict(ops="ort"), True),
    "ort int8": (dict(ops="ort", quantize="int8"), True),
    "ort int4": (dict(ops="ort", quantize="int4"), False),  # what `export --quantize int4` gives
    "ort int4 kv32": (dict(ops="ort", quantize="int4", kv_dtype="fp32"), False),  # the same with an fp32 KV cache
    "ort int4 b32": (dict(ops="ort", quantize="int4", quant_block_size=32), True),  # the block of llama.cpp's Q4_0
    "ort int4 buckets": (dict(ops="ort", quantize="int4"), True),
    "portable int4": (dict(ops="portable", quantize="int4", vision_grids="static"), True),
}
#: This project's rows: row name -> (export, runtime, precision).
PIPELINE_ROWS = {
    "portable fp32": ("portable fp32", "onnxruntime", "f32"),
    "ort fp32": ("ort fp32", "onnxruntime", "f32"),
    "ort int8": ("ort int8", "onnxruntime", "f32"),
    "ort int4": ("ort int4", "onnxruntime", "f32"),
    "ort int4 kv32": ("ort int4 kv32", "onnxruntime", "f32"),
    "ort int4 b32": ("ort int4 b32", "onnxruntime", "f32"),
    "ort int4 buckets": ("ort int4 buckets", "onnxruntime", "f32"),
    "portable int4": ("portable int4", "onnxruntime", "f32"),
    "openvino fp32 f32": ("portable fp32", "openvino", "f32"),
    "openvino fp32 bf16": ("portable fp32", "openvino", "bf16"),
    "openvino int4 f32": ("portable int4", "openvino", "f32"),
    "openvino int4 bf16": ("portable int4", "openvino", "bf16"),
}
#: OpenVINO's own pipeline: row name -> its inference precision hint.
OVGENAI_ROWS = {"ov-genai int4 f32": "f32", "ov-genai int4 bf16": "bf16"}
ROWS = (
    tuple(PIPELINE_ROWS)
    + ("transformers eager", "genai fp32", "genai int4")
    + tuple(OVGENAI_ROWS)
    + tuple(LLAMACPP_ROWS)
)
"""Every row, in table order; ``run_bench(rows=...)`` measures a subset."""


# ---- this project -------------------------------------------------------------------------
def bench_pipeline(
    name: str, pipe, prompts: dict[int, np.ndarray], protocol: Protocol, decode_bytes: int | None = None
) -> PeerResult:
    """Measure a loaded :class:`~qwen35_onnx.pipeline.Pipeline` (ONNX Runtime or OpenVINO: only its
    backend interface and :class:`~qwen35_onnx.runtime.generation.Generation` are used) with
    ``protocol``. After each length a backend whose graphs hold their own weights (OpenVINO's
    compiled buckets; :meth:`~qwen35_onnx.runtime.backend.Backend.shared_weight_bytes` empty) drops
    its prefill graphs: one bucket at a time.

    Peak memory by length (``peak_rss_by_length``, bytes): before each length what the previous one
    freed leaves the process (:func:`fresh_peak`), then the peak of that length's prefills and decode
    steps (``VmHWM``; with shared pre-packed weights the largest ``Pss`` sampled, as for
    ``peak_rss_bytes``: ``peak_sampled``). ``peak_rss_bytes``: the peak of the whole call, the pipeline's load
    before it included (``VmHWM`` rows; :func:`bench_export` adds what runs after)."""
    result = PeerResult(name, decode_bytes=decode_bytes)
    result.peak_sampled = "prepacked" in pipe.backend.shared_weight_bytes()
    carried = resident().get("VmHWM") or 0  # the peak so far: the load

    def sample(length: int | None = None):
        if result.peak_sampled:
            pss = resident().get("Pss", 0)
            result.peak_rss_bytes = max(result.peak_rss_bytes or 0, pss)
            if length is not None:
                result.peak_rss_by_length[length] = max(result.peak_rss_by_length.get(length, 0), pss)

    def one_length(prepared, length: int) -> tuple[float, float]:
        """Prefill ms and decode ms/token of ``prepared`` (the generation is released on return)."""
        prefill = median_ms(lambda: pipe.generation(prepared).prefill(), *protocol.prefill_at(length))
        sample(length)
        generation = pipe.generation(prepared)
        token = int(np.argmax(generation.prefill()))

        def step():
            nonlocal token
            token = int(np.argmax(generation.step(token)))

        decode = median_ms(step, protocol.decode_warmup, protocol.decode_runs)
        sample(length)
        return prefill, decode

    for length, ids in prompts.items():
        carried = max(carried, resident().get("VmHWM") or 0)
        fresh_peak()
        result.prefill_ms[length], result.decode_ms[length] = one_length(pipe.prepare_ids(ids), length)
        if not result.peak_sampled and resident().get("VmHWM"):
            result.peak_rss_by_length[length] = resident()["VmHWM"]
        if not pipe.backend.shared_weight_bytes():
            pipe.backend.unload_prefill()
    prepared = pipe.prepare_ids(prompts[min(prompts)])
    pipe.backend.load_prefill(prepared.bucket)  # loaded (compiled) before the clock starts, as for the other lengths
    start = time.perf_counter()
    out = pipe.generate_prepared(prepared, max_new_tokens=protocol.e2e_tokens, sampling=SamplingConfig())  # greedy
    result.e2e_tokens_per_s = len(out.token_ids) / (time.perf_counter() - start)
    sample()
    if not result.peak_sampled:
        result.peak_rss_bytes = max(carried, resident().get("VmHWM") or 0) or None
    return result


def fresh_peak() -> None:
    """What the process freed leaves it (the heap, ONNX Runtime's shared activation arena), then the
    kernel's peak (``VmHWM``) restarts from what remains: the next measurement's own peak."""
    release_freed_memory()
    shrink_shared_arena()  # ONNX Runtime's activation arena (0.8B: 0.43 GB after 512-token prefills)
    reset_peak()


def bench_export(
    name: str,
    export_dir: Path,
    prompts: dict[int, np.ndarray],
    protocol: Protocol,
    runtime: str = "onnxruntime",
    precision: str = "f32",
    extras: bool = True,
) -> PeerResult:
    """:func:`bench_pipeline` on the export at ``export_dir`` loaded with ``runtime`` / ``precision``,
    then (with ``extras``) the image prompt, prompts by length and the conversation; the pipeline is
    released before returning (the next row needs the memory)."""
    from ..pipeline import Pipeline

    pipe = Pipeline.from_exported(export_dir, runtime=runtime, precision=precision)
    try:
        result = bench_pipeline(name, pipe, prompts, protocol, decode_weight_bytes(step_graph(pipe, export_dir)))
        if extras:
            result.image = image_costs(name, pipe, protocol.prefill_runs)
            if result.image.skipped:
                result.skipped.append(f"{name}: {result.image.skipped}")
            if name in PREFILL_ROWS:
                result.ttft_ms = ttft_by_length(pipe, prefill_prompts(pipe.contract), protocol.prefill_runs)
                if pipe.contract.prefill_chunks:
                    try:
                        result.conversation = conversation_cost(name, pipe, protocol.prefill_runs)
                    except ValueError as exc:  # e.g. the conversation does not fit the bench's capacity
                        result.skipped.append(f"{name}: turn 4 of a conversation: {exc}")
        if not result.peak_sampled and result.peak_rss_bytes is not None:  # and the peak of what ran since
            result.peak_rss_bytes = max(result.peak_rss_bytes, resident().get("VmHWM") or 0)
        return result
    finally:
        del pipe
        release_freed_memory()


def step_graph(pipe, export_dir: Path) -> Path:
    """The graph file whose weights ``pipe``'s decode step reads: ONNX Runtime's saved copy of the
    decode graph with its pre-packed weights when the pre-packed weights cache loaded it (the packed
    layout is what the kernels read: :func:`~.protocol.decode_weight_bytes`), else the export's."""
    loaded = getattr(pipe.backend.graphs.decode, "path", None)
    return loaded if loaded is not None else export_dir / pipe.contract.graphs["decode"]


def prefill_prompts(contract, seed: int = 1) -> dict[int, np.ndarray]:
    """The "Prefill" section's prompts: random ordinary tokens of each :data:`PREFILL_LENGTHS` that
    leaves a decode slot below ``contract``'s capacity."""
    rng = np.random.default_rng(seed)
    return {
        n: rng.integers(0, min(contract.vocab_size, 1000), size=(1, n)).astype(np.int64)
        for n in PREFILL_LENGTHS
        if n < contract.capacity
    }


def _constrained(row: str, export_dir: Path, log) -> list[str]:
    """The constrained-decoding section, measured on ``export_dir`` (see :mod:`.constrained`); empty
    with a logged reason when the prompt with tools does not fit the export."""
    from ..pipeline import Pipeline

    log(f"[bench] constrained decoding on {row}")
    pipe = Pipeline.from_exported(export_dir)
    try:
        return constrained_lines(row, constrained_costs(pipe))
    except ValueError as exc:
        log(f"[bench] constrained decoding not measured: {exc}")
        return []
    finally:
        del pipe
        release_freed_memory()


def _export_record(folder: Path) -> Path:
    """Where the bench notes how long the export in ``folder`` took (beside it: the export folder stays the
    exporter's)."""
    return folder.with_name(f"{folder.name}.export.json")


def export_cost(folder: Path, capacity: int) -> dict:
    """What the export in ``folder`` cost: ``export_s`` (seconds of its ``export`` call, where this bench made it:
    an export cached by an earlier run of this version keeps that run's time; None where unknown), ``disk_bytes``
    (its files) and ``capacity``."""
    try:
        seconds = json.loads(_export_record(folder).read_text()).get("export_s")
    except (OSError, ValueError):
        seconds = None
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return {"export_s": seconds, "disk_bytes": size, "capacity": capacity}


def _is_cached(folder: Path, options) -> bool:
    """An export of this version with these options is already in ``folder``."""
    from .. import __version__

    try:
        c = read_manifest(folder)
    except ContractError:
        return False
    return (
        c.exporter_version,
        c.capacity,
        c.prefill_buckets,
        c.prefill_chunks,
        c.ops,
        c.quantize,
        c.quant_block_size,
        c.image_tokens,
        c.static_vision,
        c.slots,
        c.kv_precision,
    ) == (
        __version__,
        options.capacity,
        options.buckets,
        options.chunks,
        options.ops,
        options.quantize,
        options.quant_block_size,
        options.image_tokens,
        options.vision_grids not in (ANY_GRID, ()),
        options.slots,
        options.kv_precision,
    )


def peer_image_processor(checkpoint: Path, model_dir: Path, contract) -> None:
    """Give OpenVINO's pipeline the checkpoint's image processor settings (optimum-intel's export
    leaves ``preprocessor_config.json`` out without torchvision, and openvino-genai then falls back to
    Qwen2-VL's 14-pixel patches), with ``max_pixels`` capped at this project's budget as a user would
    set it (both spellings), so that both sides give the photo the same image tokens."""
    config = json.loads((Path(checkpoint) / "preprocessor_config.json").read_text())
    top = contract.image_max_pixels
    config.update(min_pixels=contract.min_pixels, max_pixels=top)
    config["size"] = {"shortest_edge": contract.min_pixels, "longest_edge": top}
    (Path(model_dir) / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def _image_cost(result: PeerResult) -> ImageCost:
    """A row's image figures (this project's :class:`ImageCost`, or a peer's ``{"ttft_ms", "prompt_tokens"}``)."""
    if isinstance(result.image, ImageCost):
        return result.image
    image = result.image
    return ImageCost(
        result.name,
        ttft_ms=image["ttft_ms"],
        prompt_tokens=image["prompt_tokens"],
        image_tokens=image.get("image_tokens"),
    )


def check_rows(rows) -> tuple[str, ...]:
    """The rows to measure: ``rows`` as a tuple (names from :data:`ROWS`), or every row for None.

    Raises:
        ValueError: no row, or a name that is not a row, naming it and the choices.
    """
    rows = tuple(ROWS if rows is None else rows)
    unknown = [r for r in rows if r not in ROWS]
    if not rows or unknown:
        raise ValueError(
            f"bench rows {list(rows)}: {'unknown ' + repr(unknown) if unknown else 'none given'}; "
            f"choices: {', '.join(ROWS)}"
        )
    return rows


def _max_positions(checkpoint: Path) -> int:
    """The checkpoint's ``text_config.max_position_embeddings`` (no limit when it does not say)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return int(config.get("text_config", config).get("max_position_embeddings") or 2**62)


def measure_in_rounds(rows, rounds: int, measure, before_each_row=lambda: None, log=print) -> list[PeerResult]:
    """Each of ``rows`` measured ``rounds`` times in turn (A B C A B C), merged per row by
    :func:`~.protocol.merge_rounds`, in ``rows``' order. ``measure(row, first)`` returns a
    :class:`~.protocol.PeerResult`, or None for a row that cannot run (it is not tried again in
    later rounds); ``first`` is True in the first round only. A result without a peak gets the
    process's ``VmHWM`` since ``before_each_row()`` (called before every measurement)."""
    measured: dict[str, list[PeerResult]] = {}
    for round_ in range(rounds):
        if rounds > 1:
            log(f"[bench] round {round_ + 1} of {rounds}")
        for row in rows if round_ == 0 else list(measured):
            before_each_row()
            result = measure(row, round_ == 0)
            if result is None:
                continue
            if result.peak_rss_bytes is None:
                result.peak_rss_bytes = resident().get("VmHWM")
            measured.setdefault(row, []).append(result)
    return [merge_rounds(each) for each in measured.values()]


def run_bench(
    checkpoint: Path,
    work_dir: Path,
    lengths=LENGTHS,
    seed: int = 0,
    log=print,
    rows=None,
    prefill_runs: int = Protocol().prefill_runs,
    rounds: int = 1,
    run: dict | None = None,
) -> str:
    """Export the variants (cached in ``work_dir``), measure every peer of ``rows`` (names from
    :data:`ROWS`; None: all), write the report. A peer that cannot run (a package missing, a
    failed export of OpenVINO's own pipeline) is skipped with its reason, logged and written
    under the tables. ``prefill_runs``: timed prefill runs per length, after ``min(2, prefill_runs)``
    warm-ups (the reference protocol: 5 after 2; fewer keep a 4B bench at 2048 tokens in reach:
    onnxruntime-genai's prefill there takes minutes). ``rounds``: the rows are measured that many
    times in turn (A B C A B C), so that a slow spell of the machine lands on every row instead of
    on one; each prefill, decode and end-to-end figure is the median over the rounds
    (:func:`~.protocol.merge_rounds`; every round's figures in ``bench.json``). The image, prompts by
    length, conversation and constrained-decoding figures come from the first round. ``bench.json``
    also holds the run (:func:`~.results.run_info`, the bench's options and ``run``'s entries, e.g.
    the preset) and the whole report (``markdown``): what ``bench --publish`` stores (:mod:`.results`).

    Raises:
        ValueError: ``prefill_runs`` or ``rounds`` below 1, unknown ``rows``, lengths beyond the
            model's positions, or ``work_dir`` inside a file.
    """
    protocol = Protocol.with_prefill_runs(prefill_runs)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    from ..export.exporter import export  # needs torch: the export extra

    rows = check_rows(rows)
    capacity = max(lengths) + DECODE_ROOM
    limit = _max_positions(checkpoint)
    if capacity > limit:
        raise ValueError(
            f"--lengths: the longest, {max(lengths)} tokens, plus {DECODE_ROOM} decode tokens is more than the "
            f"model's max_position_embeddings {limit}"
        )
    needs = capacity  # a bucket export's: the longest length and the decode room (its KV output is that wide)
    capacity = min(max(capacity, DEFAULT_CAPACITY), limit)  # a chunked export's: the default, as a user gets it
    check_folder(work_dir, "--work-dir").mkdir(parents=True, exist_ok=True)
    buckets = tuple(sorted(set(lengths)))  # the capacity itself needs no bucket here
    needed = {PIPELINE_ROWS[r][0] for r in rows if r in PIPELINE_ROWS} or {"portable fp32"}  # + the contract
    exports, export_costs = {}, {}
    for name, (opts, with_buckets) in EXPORTS.items():
        if name not in needed:
            continue
        folder = work_dir / name.replace(" ", "-")
        prefill = {"prefill_buckets": buckets} if with_buckets else {}  # buckets or chunks, not both
        width = needs if with_buckets or opts.get("ops") == "portable" else capacity
        options = ExportOptions(capacity=width, overwrite=True, **prefill, **opts)
        if not _is_cached(folder, options):
            log(f"[bench] exporting {name} ...")
            begin = time.perf_counter()
            export(checkpoint, folder, options)
            _export_record(folder).write_text(json.dumps({"export_s": time.perf_counter() - begin}))
        exports[name] = folder
        export_costs[name] = export_cost(folder, options.capacity)
    contract = read_manifest(next(iter(exports.values())))
    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, min(contract.vocab_size, 1000), size=(1, n)).astype(np.int64) for n in lengths}
    states = {n: step_state_bytes(contract, n) for n in lengths}
    bandwidths = read_bandwidths()
    skipped, constrained = [], []
    optimum = llama = None

    def measure(row: str, first: bool) -> PeerResult | None:
        """``row`` measured once (None where it cannot run: the reason is in ``skipped``); the
        first round adds the image, prompts by length and constrained decoding."""
        nonlocal optimum, llama, constrained
        if row in PIPELINE_ROWS:
            export_name, runtime, precision = PIPELINE_ROWS[row]
            log(f"[bench] {row} ({export_name} export, {runtime}, precision {precision})")
            result = bench_export(row, exports[export_name], prompts, protocol, runtime, precision, extras=first)
            if not constrained and runtime == "onnxruntime":
                constrained = _constrained(row, exports[export_name], log)
            return result
        if row == "transformers eager":
            log("[bench] transformers eager")
            return bench_transformers(checkpoint, prompts, protocol)
        if row.startswith("genai "):
            try:
                import onnxruntime_genai  # noqa: F401
            except ImportError:
                skipped.append(f"{row}: onnxruntime-genai is not installed (pip install onnxruntime-genai)")
                log(f"[bench] {skipped[-1]}")
                return None
            precision = row.split()[1]
            log(f"[bench] onnxruntime-genai {precision}")
            try:
                folder = build_genai(checkpoint, work_dir / f"genai-{precision}", precision)
            except subprocess.CalledProcessError as exc:  # its builder failed: the row is skipped, not the bench
                tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
                skipped.append(
                    f"{row}: onnxruntime-genai's model builder exited with {exc.returncode}: {' / '.join(tail)}"
                )
                log(f"[bench] skipped {skipped[-1]}")
                return None
            result = bench_genai(row, folder, prompts, protocol)
            if first and row in PREFILL_ROWS:
                result.ttft_ms = genai_ttft(folder, prefill_prompts(contract), protocol.prefill_runs)
            return result
        if row in LLAMACPP_ROWS:
            try:
                if llama is None:
                    engines = {LLAMACPP_ROWS[r].engine for r in rows if r in LLAMACPP_ROWS}
                    llama = prepare_llamacpp(checkpoint, work_dir, log, engines)
                    photo().save(work_dir / "photo-640x480.png")
                image = {
                    "path": work_dir / "photo-640x480.png",
                    "question": QUESTION,
                    "max_image_tokens": contract.image_tokens,
                }
                return bench_llamacpp_row(row, llama, lengths, protocol, image if first else None, log)
            except (RuntimeError, OSError, ValueError) as exc:
                skipped.append(f"{row}: {exc}")
                log(f"[bench] skipped {skipped[-1]}")
                return None
        # OpenVINO's own pipeline
        log(f"[bench] {row} (optimum-intel + openvino-genai VLMPipeline)")
        try:
            if optimum is None:
                python = ensure_optimum_venv(work_dir.parent / ".venv-optimum", log)
                optimum = (python, build_optimum(python, checkpoint, work_dir / "optimum-int4", log))
                np.save(work_dir / "photo-640x480.npy", np.asarray(photo()))
                peer_image_processor(checkpoint, optimum[1], contract)
            image = {"path": str(work_dir / "photo-640x480.npy"), "question": QUESTION}
            return bench_ovgenai(row, *optimum, prompts, OVGENAI_ROWS[row], protocol, image)
        except (RuntimeError, OSError, ValueError) as exc:
            skipped.append(f"{row}: {exc}")
            log(f"[bench] skipped {skipped[-1]}")
            return None

    results = measure_in_rounds(rows, rounds, measure, fresh_peak, log)
    for result in results:
        for reason in result.skipped:
            skipped.append(reason)
            log(f"[bench] not measured: {reason}")
    markdown = report(results, bandwidths, work_dir, states, protocol)
    extra = (
        memory_by_length_lines(results, capacity)
        + target_lines(results)
        + llamacpp_target_lines(results)
        + ik_target_lines(results)
        + floor_target_lines(results, max(bandwidths.values()), states)
        + constrained
        + image_lines([_image_cost(r) for r in results if r.image])
    )
    extra += prefill_lines(
        {r.name: r.ttft_ms for r in results if r.ttft_ms}, [r.conversation for r in results if r.conversation]
    )
    extra += ["", "Not measured:", ""] + [f"- {s}" for s in skipped] if skipped else []
    if extra:
        markdown += "\n".join(extra) + "\n"
        (work_dir / "bench.md").write_text(markdown)
    stored = json.loads((work_dir / "bench.json").read_text())
    stored["run"] = {
        **run_info(),
        "checkpoint": Path(checkpoint).name,
        "lengths": list(lengths),
        "rows": list(rows),
        "rounds": rounds,
        "prefill_runs": prefill_runs,
        "capacity": capacity,
        **(run or {}),
    }
    stored["markdown"] = markdown
    stored["exports"] = export_costs
    (work_dir / "bench.json").write_text(json.dumps(stored, indent=2))
    return markdown
