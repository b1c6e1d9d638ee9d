"""Side-by-side speed benchmark (``qwen35-onnx bench``, ``make bench``); not part of the tests.

Protocol of the reference system: prefill = median of 5 runs after 2 warm-ups at each length;
decode = median of 10 steps after 3 warm-ups from the state left by a prefill of that length;
plus end-to-end tokens/s of a 128-token greedy generation. Prompts are random ordinary
tokens (the same ids for every peer). All peers run in one command, one after the other,
on the same checkpoint:

- this project on ONNX Runtime: portable fp32, ort fp32, ort int8, ort int4, portable int4
  (exported here, fixed KV);
- this project on OpenVINO (``runtime="openvino"``): the portable fp32 and portable int4
  exports, each with inference precision f32 and bf16; the same measuring function as the ONNX
  Runtime rows (:func:`bench_pipeline` takes a Pipeline, whatever its runtime);
- ``transformers`` eager on CPU (the PyTorch reference);
- ``onnxruntime-genai`` (its model builder run on the same checkpoint, fp32 and int4), when
  the package is installed;
- OpenVINO's own Qwen3.5 pipeline: optimum-intel's export to OpenVINO IR (int4, symmetric,
  group size 32) run by openvino-genai's ``VLMPipeline``, with the f32 and bf16 precision hints.
  optimum-intel pins an older transformers, so it runs from its own virtual environment
  (``WORK_DIR/../.venv-optimum``, created here with :data:`OPTIMUM_VENV_PINS`), in a subprocess
  that runs this file (:func:`ovgenai_peer`) and prints JSON;
- the floor: bytes read per decode token (weights + states) / the machine's read
  bandwidth, measured in the same run (ONNX Runtime ReduceSum over 1 GiB).

Outputs ``bench.md`` (table, ratios against each peer), ``bench.json`` and ``bench.png``.
Times are milliseconds.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LENGTHS = (32, 512, 1024, 2048)
PREFILL_WARMUP, PREFILL_RUNS = 2, 5
DECODE_WARMUP, DECODE_RUNS = 3, 10
E2E_TOKENS = 128

#: The exports this project's rows run: folder name (spaces as dashes) -> ExportOptions fields.
EXPORTS = {
    "portable fp32": dict(ops="portable"),
    "ort fp32": dict(ops="ort"),
    "ort int8": dict(ops="ort", quantize="int8"),
    "ort int4": dict(ops="ort", quantize="int4"),
    "portable int4": dict(ops="portable", quantize="int4"),
}
#: This project's rows: row name -> (export, runtime, precision).
PIPELINE_ROWS = {
    "portable fp32": ("portable fp32", "onnxruntime", "f32"),
    "ort fp32": ("ort fp32", "onnxruntime", "f32"),
    "ort int8": ("ort int8", "onnxruntime", "f32"),
    "ort int4": ("ort int4", "onnxruntime", "f32"),
    "portable int4": ("portable int4", "onnxruntime", "f32"),
    "openvino fp32 f32": ("portable fp32", "openvino", "f32"),
    "openvino fp32 bf16": ("portable fp32", "openvino", "bf16"),
    "openvino int4 f32": ("portable int4", "openvino", "f32"),
    "openvino int4 bf16": ("portable int4", "openvino", "bf16"),
}
#: OpenVINO's own pipeline: row name -> its inference precision hint.
OVGENAI_ROWS = {"ov-genai int4 f32": "f32", "ov-genai int4 bf16": "bf16"}
ROWS = tuple(PIPELINE_ROWS) + ("transformers eager", "genai fp32", "genai int4") + tuple(OVGENAI_ROWS)
"""Every row, in table order; ``run_bench(rows=...)`` measures a subset."""
TARGETS = (("openvino int4 f32", "ov-genai int4 f32"), ("openvino int4 bf16", "ov-genai int4 bf16"),
           ("openvino int4 f32", "ov-genai int4 bf16"))
"""(ours, peer) decode pairs reported at every length under the tables (issue 10: our OpenVINO int4
decode <= OpenVINO's own pipeline's)."""

#: The peer's virtual environment (pip, in this order; see :func:`ensure_optimum_venv`).
#: optimum-intel 2.2.0 itself installs with ``--no-deps`` after these: it requires torchvision,
#: whose PyPI wheels are CUDA builds that fail to import next to the CPU torch
#: ("operator torchvision::nms does not exist"), and whose newest release pulls torch 2.14 with
#: CUDA; without torchvision, transformers uses its PIL image processors and the export runs.
OPTIMUM_VENV_PINS = (
    "torch==2.13.0",  # the CPU build (a local wheel here); an unpinned torch pulls a multi-GB CUDA build
    "transformers==5.2.*",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "openvino==2026.4.1",  # the project's openvino
    "openvino-tokenizers==2026.4.1.0",
    "openvino-genai==2026.4.1.0",
    "huggingface-hub>=0.23.2,<1.22",
    "requests>=2.33,<3",
    "setuptools",
)
OPTIMUM_INTEL_PIN = "optimum-intel==2.2.0"
#: optimum-cli's weight options: int4, symmetric, group size 32, every eligible layer int4 except
#: NNCF's default backup (the embedding and the last MatMul stay int8).
OPTIMUM_EXPORT_ARGS = ("--task", "image-text-to-text", "--weight-format", "int4", "--sym", "--group-size", "32",
                       "--ratio", "1.0")


@dataclass
class PeerResult:
    """One peer's numbers: per-length prefill ms and decode ms/token, end-to-end tokens/s."""

    name: str
    prefill_ms: dict[int, float] = field(default_factory=dict)
    decode_ms: dict[int, float] = field(default_factory=dict)
    e2e_tokens_per_s: float | None = None
    decode_bytes: int | None = None
    peak_rss_bytes: int | None = None
    """Peak resident memory (bytes) of the process that ran the peer, while it ran."""
    peak_sampled: bool = False
    """``peak_rss_bytes`` is the largest ``Pss`` sampled after each measurement instead of the
    kernel's ``VmHWM``: for sessions that map the shared pre-packed weights, whose pages VmRSS
    counts once per session (see :mod:`.runtime.prepacked`)."""
    note: str = ""


def _median_ms(fn, warmup: int, runs: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def read_bandwidth_gbps(size_bytes: int = 2**30, repeats: int = 5) -> float:
    """Measured memory read bandwidth in GB/s: best of ``repeats`` runs of ONNX Runtime's
    ReduceSum over a ``size_bytes`` fp32 buffer on all cores (a pure read, by the runtime the
    peers use; a NumPy copy also writes and gives about 15 % less)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = size_bytes // 4
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(np.ones(n, dtype=np.float32)))
    binding.bind_output("y")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        best = min(best, time.perf_counter() - start)
    return 4 * n / best / 1e9


# ---- this project -------------------------------------------------------------------------
def bench_pipeline(name: str, pipe, prompts: dict[int, np.ndarray], decode_bytes: int | None = None) -> PeerResult:
    """Measure a loaded :class:`~qwen35_onnx.pipeline.Pipeline` (ONNX Runtime or OpenVINO: only its
    backend interface is used) with the protocol of the module docstring."""
    from .runtime.masks import advance_mask, prepare_decode_mask
    from .runtime.positions import decode_position_ids

    from .bench_memory import resident

    contract = pipe.contract
    result = PeerResult(name, decode_bytes=decode_bytes)
    result.peak_sampled = getattr(pipe.graphs, "prepacked", None) is not None

    def sample():
        if result.peak_sampled:
            result.peak_rss_bytes = max(result.peak_rss_bytes or 0, resident().get("Pss", 0))

    zeros = np.zeros((contract.n_image_rows, contract.image_embed_dim), dtype=np.float32)
    for length, ids in prompts.items():
        prepared = pipe.prepare_ids(ids)
        result.prefill_ms[length] = _median_ms(lambda: pipe.run_prefill(prepared, zeros), PREFILL_WARMUP, PREFILL_RUNS)
        sample()
        logits, states = pipe.run_prefill(prepared, zeros)
        decoder = pipe.decoder(states)
        _, prompt_mask, _ = pipe.padded_prompt(prepared)
        mask = prepare_decode_mask(prompt_mask, contract.capacity, contract.capacity)
        token = [int(np.argmax(logits))]

        def step():
            pos = advance_mask(mask)
            out = decoder.step(np.array([token], dtype=np.int64), mask, decode_position_ids(pos, prepared.rope_deltas))
            token[0] = int(np.argmax(out[0, -1]))

        result.decode_ms[length] = _median_ms(step, DECODE_WARMUP, DECODE_RUNS)
        sample()
        del decoder, states
        if pipe.runtime == "openvino":  # its compiled buckets do not share weights: one at a time
            pipe.graphs.unload_prefill()
    prepared = pipe.prepare_ids(prompts[min(prompts)])
    pipe.graphs.prefill(prepared.bucket)  # loaded (compiled) before the clock starts, as for the other lengths
    start = time.perf_counter()
    out = pipe.generate_prepared(prepared, max_new_tokens=E2E_TOKENS)
    result.e2e_tokens_per_s = len(out.token_ids) / (time.perf_counter() - start)
    sample()
    return result


def bench_export(name: str, export_dir: Path, prompts: dict[int, np.ndarray], runtime: str = "onnxruntime",
                 precision: str = "f32") -> PeerResult:
    """:func:`bench_pipeline` on the export at ``export_dir`` loaded with ``runtime`` / ``precision``;
    the pipeline is released before returning (the next row needs the memory)."""
    from .pipeline import Pipeline

    pipe = Pipeline.from_exported(export_dir, runtime=runtime, precision=precision)
    try:
        return bench_pipeline(name, pipe, prompts, decode_weight_bytes(export_dir / pipe.contract.graphs["decode"]))
    finally:
        del pipe
        gc.collect()


#: (operator, input) pairs that index a table by token: one row is read per decode step.
GATHERED = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2)}


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads from the ONNX graph at ``path``: every initializer
    (inline or external data) except tables that are only indexed by Gather or
    GatherBlockQuantized (the token embedding: one row per token), each stored tensor counted
    once (a tied model's quantized embedding and lm_head are one tensor under two names)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    uses: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    stored: dict[tuple, int] = {}
    for tensor in model.graph.initializer:
        if tensor.name in uses and uses[tensor.name] <= GATHERED:
            continue
        external = {e.key: e.value for e in tensor.external_data}
        if "length" in external:
            stored[(external.get("location"), external.get("offset", "0"))] = int(external["length"])
        else:
            stored[("inline", tensor.name)] = onnx.numpy_helper.to_array(tensor).nbytes
    return sum(stored.values())


# ---- transformers -------------------------------------------------------------------------
def bench_transformers(checkpoint: Path, prompts: dict[int, np.ndarray]) -> PeerResult:
    import torch
    from transformers import DynamicCache

    from .verify import load_reference

    model = load_reference(checkpoint)
    text = model.model.language_model
    result = PeerResult("transformers eager")

    def forward(ids, cache):
        hidden = text(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
        return model.lm_head(hidden[:, -1:])

    with torch.no_grad():
        for length, ids in prompts.items():
            t_ids = torch.from_numpy(ids)
            result.prefill_ms[length] = _median_ms(
                lambda: forward(t_ids, DynamicCache(config=model.config.text_config)), PREFILL_WARMUP, PREFILL_RUNS
            )
            cache = DynamicCache(config=model.config.text_config)
            token = [forward(t_ids, cache).argmax(-1)]

            def step():
                token[0] = forward(token[0].view(1, 1), cache).argmax(-1)

            result.decode_ms[length] = _median_ms(step, DECODE_WARMUP, DECODE_RUNS)
        ids = torch.from_numpy(prompts[min(prompts)])
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=E2E_TOKENS,
                             min_new_tokens=E2E_TOKENS, do_sample=False, pad_token_id=0)
        result.e2e_tokens_per_s = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
    # text weights (the token embedding only when lm_head reads it, i.e. tied) + lm_head
    embed = text.embed_tokens.weight
    params = {id(p): p for p in text.parameters() if p is not embed}
    params.update({id(p): p for p in model.lm_head.parameters()})
    result.decode_bytes = sum(p.numel() * p.element_size() for p in params.values())
    return result


# ---- onnxruntime-genai --------------------------------------------------------------------
def build_genai(checkpoint: Path, out: Path, precision: str) -> Path:
    """Run onnxruntime-genai's model builder on the checkpoint (once; cached in ``out``)."""
    if not (out / "genai_config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
             "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai-cache")],
            check=True, capture_output=True,
        )
    return out


def bench_genai(name: str, model_dir: Path, prompts: dict[int, np.ndarray]) -> PeerResult:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    result = PeerResult(name)

    def generator(total: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, do_sample=False)
        return og.Generator(model, params)

    for length, ids in prompts.items():
        ids32 = ids[0].astype(np.int32)
        result.prefill_ms[length] = _median_ms(
            lambda: generator(length + 1).append_tokens(ids32), PREFILL_WARMUP, PREFILL_RUNS
        )
        gen = generator(length + DECODE_WARMUP + DECODE_RUNS + 2)
        gen.append_tokens(ids32)
        result.decode_ms[length] = _median_ms(gen.generate_next_token, DECODE_WARMUP, DECODE_RUNS)
    ids32 = prompts[min(prompts)][0].astype(np.int32)
    gen = generator(len(ids32) + E2E_TOKENS)
    start = time.perf_counter()
    gen.append_tokens(ids32)
    produced = 0
    while not gen.is_done():
        gen.generate_next_token()
        produced += 1
    result.e2e_tokens_per_s = produced / (time.perf_counter() - start)
    result.decode_bytes = decode_weight_bytes(model_dir / "model.onnx")
    return result


# ---- OpenVINO's own pipeline (optimum-intel + openvino-genai, in its own venv) -------------
def _run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd``; a RuntimeError naming ``what`` with the end of its output when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")
    return done


def ensure_optimum_venv(venv: Path, log=print) -> Path:
    """Create (once) the peer's virtual environment at ``venv`` with :data:`OPTIMUM_VENV_PINS`, then
    :data:`OPTIMUM_INTEL_PIN` without its dependencies; returns its python. A stamp file holding the
    pins marks a finished environment (another pin list rebuilds it)."""
    python = venv / "bin" / "python"
    stamp = venv / "qwen35-bench-pins.txt"
    wanted = "\n".join(OPTIMUM_VENV_PINS + (OPTIMUM_INTEL_PIN,)) + "\n"
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    log(f"[bench] creating the optimum-intel environment {venv} (once) ...")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], "python -m venv")
    _run([str(python), "-m", "pip", "install", "--quiet", *OPTIMUM_VENV_PINS], "pip install (optimum-intel environment)")
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", OPTIMUM_INTEL_PIN], f"pip install {OPTIMUM_INTEL_PIN}")
    stamp.write_text(wanted)
    return python


def build_optimum(python: Path, checkpoint: Path, out: Path, log=print) -> Path:
    """optimum-intel's OpenVINO export of the checkpoint (:data:`OPTIMUM_EXPORT_ARGS`), once; cached
    in ``out`` (a stamp file holding the arguments marks a finished export)."""
    stamp = out / "qwen35-bench-export.txt"
    args = " ".join(OPTIMUM_EXPORT_ARGS) + "\n"
    if stamp.is_file() and stamp.read_text() == args:
        return out
    log(f"[bench] optimum-cli export openvino {' '.join(OPTIMUM_EXPORT_ARGS)} ...")
    done = _run([str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(checkpoint),
                 *OPTIMUM_EXPORT_ARGS, str(out)], "optimum-cli export openvino")
    (out / "export.log").write_text(done.stdout + done.stderr)
    stamp.write_text(args)
    return out


def bench_ovgenai(name: str, python: Path, model_dir: Path, prompts: dict[int, np.ndarray], precision: str) -> PeerResult:
    """Run :func:`ovgenai_peer` in the peer's environment (this file as a script; ``-P``: its folder,
    which holds modules named like other packages', stays off ``sys.path``) and read its JSON."""
    spec = {"model_dir": str(model_dir), "precision": precision, "prefill": [PREFILL_WARMUP, PREFILL_RUNS],
            "prompts": {str(n): ids[0].tolist() for n, ids in prompts.items()}}
    done = _run([str(python), "-P", str(Path(__file__).resolve()), "--ovgenai-peer"], f"openvino-genai peer {name}",
                input=json.dumps(spec))
    out = json.loads(done.stdout.strip().splitlines()[-1])
    result = PeerResult(name, {int(n): v for n, v in out["prefill_ms"].items()},
                        {int(n): v for n, v in out["decode_ms"].items()}, out["e2e_tokens_per_s"])
    # weights one decode step reads: the language model IR (the token embedding is its own model,
    # one row read per token)
    result.decode_bytes = (model_dir / "openvino_language_model.bin").stat().st_size
    result.note = json.dumps({k: out[k] for k in ("input_tokens", "tpot_ms", "versions")})
    result.peak_rss_bytes = out.get("peak_rss_bytes")  # the peer's own process
    return result


def ovgenai_peer(spec: dict) -> dict:
    """Measure openvino-genai's ``VLMPipeline`` (runs inside the peer's environment: stdlib, numpy
    and openvino_genai only). Per length: a text-only prompt of exactly that many tokens (the
    random ids of the other peers decoded by the pipeline's tokenizer and re-encoded, one id
    trimmed or added per try until the count matches, else one token repeated; no chat template;
    each run a different rotation of the ids, so that the pipeline's prefix cache cannot serve it); prefill = median time to first token
    (``perf_metrics.get_ttft()``) of 5 one-token generations after 2 warm-ups; decode = one
    generation of 1 + 3 + 10 tokens (``ignore_eos``), median of the 10 token times after the first
    token and 3 warm-up steps (``raw_metrics.m_durations``: the times between consecutive tokens, in
    microseconds; ``get_tpot()``, their mean with the warm-ups, is reported too); end-to-end = 128 generated tokens / wall time of ``generate`` from
    the shortest prompt."""
    import openvino_genai as og

    pipe = og.VLMPipeline(spec["model_dir"], "CPU", INFERENCE_PRECISION_HINT=spec["precision"])
    tokenizer = pipe.get_tokenizer()

    def count(text: str) -> int:
        return int(tokenizer.encode(text).input_ids.get_shape()[1])

    def prompt_of(ids: list[int], length: int) -> str:
        base, ids = list(ids), list(ids)
        for i in range(4 * length):  # one id more or less per try, until the count matches
            n = count(tokenizer.decode(ids))
            if n == length:
                return tokenizer.decode(ids)
            ids = ids[:-1] if n > length else ids + [base[i % len(base)]]
        for token in base:  # fallback: one token repeated, when it does not merge with itself
            text = tokenizer.decode([token]) * length
            if count(text) == length:
                return text
        raise RuntimeError(f"no prompt of exactly {length} tokens found")

    def generate(text: str, new_tokens: int):
        config = og.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos, config.do_sample, config.apply_chat_template = True, False, False
        return pipe.generate(text, images=[], generation_config=config)

    out = {"prefill_ms": {}, "decode_ms": {}, "tpot_ms": {}, "input_tokens": {},
           "versions": {"openvino_genai": og.__version__}}
    warmup, runs = spec.get("prefill", [PREFILL_WARMUP, PREFILL_RUNS])
    for length, ids in spec["prompts"].items():
        # each run its own rotation of the ids: a repeated prompt would come from the pipeline's
        # prefix cache (on by default), its time to first token then that of one token
        texts = [prompt_of(ids[i:] + ids[:i], int(length)) for i in range(warmup + runs + 1)]
        ttft = []
        for i in range(warmup + runs):
            metrics = generate(texts[i], 1).perf_metrics
            if i >= warmup:
                ttft.append(metrics.get_ttft().mean)
        metrics = generate(texts[-1], 1 + DECODE_WARMUP + DECODE_RUNS).perf_metrics
        # m_durations: microseconds between consecutive tokens (the first token's time is the TTFT)
        steps = list(metrics.raw_metrics.m_durations)[DECODE_WARMUP:]
        if len(steps) != DECODE_RUNS:
            raise RuntimeError(f"expected {DECODE_RUNS} decode times after the warm-ups, got {len(steps)}")
        out["prefill_ms"][length] = statistics.median(ttft)
        out["decode_ms"][length] = statistics.median(steps) / 1000  # microseconds
        out["tpot_ms"][length] = metrics.get_tpot().mean
        out["input_tokens"][length] = metrics.get_num_input_tokens()
    first = min(spec["prompts"], key=int)
    text = prompt_of(spec["prompts"][first], int(first))
    start = time.perf_counter()
    metrics = generate(text, E2E_TOKENS).perf_metrics
    out["e2e_tokens_per_s"] = metrics.get_num_generated_tokens() / (time.perf_counter() - start)
    with open("/proc/self/status") as status:  # VmHWM: this process's peak resident memory (kB)
        out["peak_rss_bytes"] = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")), None)
    return out


# ---- report -------------------------------------------------------------------------------
def report(results: list[PeerResult], bandwidth_gbps: float, out_dir: Path, state_bytes: dict[int, int]) -> str:
    """Write bench.md / bench.json / bench.png; returns the Markdown."""
    lengths = sorted({n for r in results for n in r.decode_ms})
    lines = [f"Read bandwidth: {bandwidth_gbps:.1f} GB/s (measured in this run)", ""]
    if (PREFILL_WARMUP, PREFILL_RUNS) != (2, 5):
        lines += [f"Prefill: median of {PREFILL_RUNS} runs after {PREFILL_WARMUP} warm-up(s) "
                  "(`--prefill-runs`; the reference protocol is 5 after 2).", ""]
    first, last = lengths[0], lengths[-1]
    lines += [
        "Times in ms (prefill: whole prompt; decode: per token). `decode {last}/{first}`: flatness in "
        "context length. floor: bytes of weights and states one decode step reads / read bandwidth; "
        "`x floor`: decode at {first} over it. peak RSS: the most resident memory of the process that "
        "ran the peer while it ran (its load, every length, the end-to-end run; GB = 1e9 bytes); marked *: "
        "the largest Pss sampled after each length's prefill and decode and the end-to-end run (this "
        "project's ONNX Runtime rows with shared pre-packed weights, whose pages VmRSS counts once per "
        "session; transient activations between samples are not in it).".format(first=first, last=last),
        "",
    ]
    head = "| peer | " + " | ".join(f"prefill {n}" for n in lengths) + " | " + " | ".join(
        f"decode {n}" for n in lengths) + f" | decode {last}/{first} | e2e tok/s | floor ms/tok @{first} | x floor | peak RSS GB |"
    lines += [head, "|" + "---|" * (1 + 2 * len(lengths) + 5)]
    for r in results:
        floor = (r.decode_bytes + state_bytes.get(first, 0)) / (bandwidth_gbps * 1e9) * 1000 if r.decode_bytes else None
        row = [r.name] + [f"{r.prefill_ms.get(n, float('nan')):.1f}" for n in lengths]
        row += [f"{r.decode_ms.get(n, float('nan')):.2f}" for n in lengths]
        row += [f"{r.decode_ms[last] / r.decode_ms[first]:.2f}"]
        row += [f"{r.e2e_tokens_per_s:.1f}" if r.e2e_tokens_per_s else "-", f"{floor:.3f}" if floor else "-"]
        row += [f"{r.decode_ms[first] / floor:.1f}" if floor else "-"]
        row += [f"{r.peak_rss_bytes / 1e9:.2f}{'*' if r.peak_sampled else ''}" if r.peak_rss_bytes else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Decode ms/token at {first} tokens, ratio row/column (> 1: the column peer is faster):", ""]
    lines.append("| | " + " | ".join(r.name for r in results) + " |")
    lines.append("|" + "---|" * (len(results) + 1))
    for a in results:
        cells = [f"{a.decode_ms[first] / b.decode_ms[first]:.2f}" for b in results]
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    (out_dir / "bench.json").write_text(json.dumps(
        {"bandwidth_gbps": bandwidth_gbps, "state_bytes": state_bytes, "peers": [asdict(r) for r in results]}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in results:
            ax1.plot(lengths, [r.prefill_ms[n] for n in lengths], marker="o", label=r.name)
            ax2.plot(lengths, [r.decode_ms[n] for n in lengths], marker="o", label=r.name)
        ax1.set(xlabel="tokens", ylabel="prefill ms", xscale="log", yscale="log", title="prefill")
        ax2.set(xlabel="context tokens", ylabel="decode ms/token", xscale="log", title="decode")
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "bench.png", dpi=120)
    except ImportError:
        markdown += "\n(matplotlib not installed: no bench.png)\n"
    (out_dir / "bench.md").write_text(markdown)
    return markdown


def _is_cached(folder: Path, options) -> bool:
    """An export of this version with these options is already in ``folder``."""
    from . import __version__
    from .contract import ContractError, read_manifest

    try:
        c = read_manifest(folder)
    except ContractError:
        return False
    return (c.exporter_version, c.capacity, c.prefill_buckets, c.ops, c.quantize) == (
        __version__, options.capacity, tuple(options.prefill_buckets), options.ops, options.quantize)


def check_rows(rows) -> tuple[str, ...]:
    """The rows to measure: ``rows`` as a tuple (names from :data:`ROWS`), or every row for None.

    Raises:
        ValueError: no row, or a name that is not a row, naming it and the choices.
    """
    rows = tuple(ROWS if rows is None else rows)
    unknown = [r for r in rows if r not in ROWS]
    if not rows or unknown:
        raise ValueError(f"bench rows {list(rows)}: {'unknown ' + repr(unknown) if unknown else 'none given'}; "
                         f"choices: {', '.join(ROWS)}")
    return rows


def target_lines(results: list[PeerResult]) -> list[str]:
    """Markdown lines comparing the decode of each :data:`TARGETS` pair at every length."""
    by_name = {r.name: r for r in results}
    lines = []
    for ours, peer in TARGETS:
        if ours in by_name and peer in by_name:
            a, b = by_name[ours], by_name[peer]
            cells = [f"{n}: {a.decode_ms[n]:.2f} vs {b.decode_ms[n]:.2f} ms ({b.decode_ms[n] / a.decode_ms[n]:.2f}x)"
                     for n in sorted(a.decode_ms) if n in b.decode_ms]
            lines.append(f"- {ours} vs {peer} (decode, peer / ours): " + "; ".join(cells))
    if lines:
        lines = ["", "Target (issue 10): our OpenVINO int4 decode <= OpenVINO's own pipeline's, side by side:", ""] + lines
    return lines


def run_bench(checkpoint: Path, work_dir: Path, lengths=LENGTHS, seed: int = 0, log=print, rows=None,
              prefill_runs: int = PREFILL_RUNS) -> str:
    """Export the variants (cached in ``work_dir``), measure every peer of ``rows`` (names from
    :data:`ROWS`; None: all), write the report. A peer that cannot run (a package missing, a
    failed export of OpenVINO's own pipeline) is skipped with its reason, logged and written
    under the tables. ``prefill_runs``: timed prefill runs per length, after ``min(2, prefill_runs)``
    warm-ups (the reference protocol: 5 after 2; fewer keep a 4B bench at 2048 tokens in reach:
    onnxruntime-genai's prefill there takes minutes).

    Raises:
        ValueError: ``prefill_runs`` below 1.
    """
    global PREFILL_WARMUP, PREFILL_RUNS
    if isinstance(prefill_runs, bool) or not isinstance(prefill_runs, int) or prefill_runs < 1:
        raise ValueError(f"prefill_runs must be an integer >= 1, got {prefill_runs!r}")
    saved = PREFILL_WARMUP, PREFILL_RUNS
    PREFILL_WARMUP, PREFILL_RUNS = min(2, prefill_runs), prefill_runs
    try:
        return _run_bench(checkpoint, work_dir, lengths, seed, log, rows)
    finally:
        PREFILL_WARMUP, PREFILL_RUNS = saved


def _run_bench(checkpoint: Path, work_dir: Path, lengths, seed: int, log, rows) -> str:
    from .bench_memory import reset_peak, resident
    from .contract import read_manifest
    from .runtime.sessions import release_freed_memory
    from .export.exporter import ExportOptions, export

    rows = check_rows(rows)
    work_dir.mkdir(parents=True, exist_ok=True)
    capacity = max(lengths) + 256
    buckets = tuple(sorted(set(lengths)))  # the capacity itself needs no bucket here
    needed = {PIPELINE_ROWS[r][0] for r in rows if r in PIPELINE_ROWS} or {"portable fp32"}  # + the contract
    exports = {}
    for name, opts in EXPORTS.items():
        if name not in needed:
            continue
        folder = work_dir / name.replace(" ", "-")
        options = ExportOptions(capacity=capacity, prefill_buckets=buckets, overwrite=True, **opts)
        if not _is_cached(folder, options):
            log(f"[bench] exporting {name} ...")
            export(checkpoint, folder, options)
        exports[name] = folder
    contract = read_manifest(next(iter(exports.values())))
    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, min(contract.vocab_size, 1000), size=(1, n)).astype(np.int64) for n in lengths}
    state_bytes = {
        n: 4 * (int(np.prod(contract.conv_state_shape)) + int(np.prod(contract.recurrent_state_shape))
                + int(np.prod(contract.kv_shape(n))))
        for n in lengths
    }
    bandwidth = read_bandwidth_gbps()
    results, skipped = [], []
    optimum = None
    for row in rows:
        release_freed_memory()  # what the previous row freed leaves the process (and the next row's peak)
        reset_peak()
        done = len(results)
        if row in PIPELINE_ROWS:
            export_name, runtime, precision = PIPELINE_ROWS[row]
            log(f"[bench] {row} ({export_name} export, {runtime}, precision {precision})")
            results.append(bench_export(row, exports[export_name], prompts, runtime, precision))
        elif row == "transformers eager":
            log("[bench] transformers eager")
            results.append(bench_transformers(checkpoint, prompts))
        elif row.startswith("genai "):
            try:
                import onnxruntime_genai  # noqa: F401
            except ImportError:
                skipped.append(f"{row}: onnxruntime-genai is not installed (pip install onnxruntime-genai)")
                log(f"[bench] {skipped[-1]}")
                continue
            precision = row.split()[1]
            log(f"[bench] onnxruntime-genai {precision}")
            try:
                folder = build_genai(checkpoint, work_dir / f"genai-{precision}", precision)
            except subprocess.CalledProcessError as exc:  # its builder failed: the row is skipped, not the bench
                tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
                skipped.append(f"{row}: onnxruntime-genai's model builder exited with {exc.returncode}: {' / '.join(tail)}")
                log(f"[bench] skipped {skipped[-1]}")
                continue
            results.append(bench_genai(row, folder, prompts))
        else:  # OpenVINO's own pipeline
            log(f"[bench] {row} (optimum-intel + openvino-genai VLMPipeline)")
            try:
                if optimum is None:
                    python = ensure_optimum_venv(work_dir.parent / ".venv-optimum", log)
                    optimum = (python, build_optimum(python, checkpoint, work_dir / "optimum-int4", log))
                results.append(bench_ovgenai(row, *optimum, prompts, OVGENAI_ROWS[row]))
            except (RuntimeError, OSError, ValueError) as exc:
                skipped.append(f"{row}: {exc}")
                log(f"[bench] skipped {skipped[-1]}")
        if len(results) > done and results[-1].peak_rss_bytes is None:
            results[-1].peak_rss_bytes = resident().get("VmHWM")
    markdown = report(results, bandwidth, work_dir, state_bytes)
    extra = target_lines(results) + (["", "Not measured:", ""] + [f"- {s}" for s in skipped] if skipped else [])
    if extra:
        markdown += "\n".join(extra) + "\n"
        (work_dir / "bench.md").write_text(markdown)
    return markdown


if __name__ == "__main__" and sys.argv[1:] == ["--ovgenai-peer"]:
    # inside the peer's environment (see bench_ovgenai): JSON spec on stdin, JSON result on the last line
    print(json.dumps(ovgenai_peer(json.loads(sys.stdin.read()))))
