"""Side-by-side speed benchmark (``qwen35-onnx bench``, ``make bench``); not part of the tests.

Protocol of the reference system: prefill = median of 5 runs after 2 warm-ups at each length;
decode = median of 10 steps after 3 warm-ups from the state left by a prefill of that length;
plus end-to-end tokens/s of a 128-token greedy generation. Prompts are random ordinary
tokens (the same ids for every peer). All peers run in one process, one after the other,
on the same checkpoint:

- this project: portable fp32, ort fp32, ort int8, ort int4 (exported here, fixed KV);
- ``transformers`` eager on CPU (the PyTorch reference);
- ``onnxruntime-genai`` (its model builder run on the same checkpoint, fp32 and int4), when
  the package is installed;
- the floor: bytes read per decode token (weights + states) / the machine's read
  bandwidth, measured in the same run (ONNX Runtime ReduceSum over 1 GiB).

Outputs ``bench.md`` (table, ratios against each peer), ``bench.json`` and ``bench.png``.
Times are milliseconds.
"""

from __future__ import annotations

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


@dataclass
class PeerResult:
    """One peer's numbers: per-length prefill ms and decode ms/token, end-to-end tokens/s."""

    name: str
    prefill_ms: dict[int, float] = field(default_factory=dict)
    decode_ms: dict[int, float] = field(default_factory=dict)
    e2e_tokens_per_s: float | None = None
    decode_bytes: int | None = None
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
def bench_pipeline(name: str, export_dir: Path, prompts: dict[int, np.ndarray]) -> PeerResult:
    from .pipeline import Pipeline
    from .runtime.masks import advance_mask, prepare_decode_mask
    from .runtime.positions import decode_position_ids
    from .runtime.state import BoundDecoder

    pipe = Pipeline.from_exported(export_dir)
    contract = pipe.contract
    result = PeerResult(name)
    zeros = np.zeros((contract.n_image_tokens, contract.image_embed_dim), dtype=np.float32)
    for length, ids in prompts.items():
        prepared = pipe.prepare_ids(ids)
        result.prefill_ms[length] = _median_ms(lambda: pipe.run_prefill(prepared, zeros), PREFILL_WARMUP, PREFILL_RUNS)
        logits, states = pipe.run_prefill(prepared, zeros)
        decoder = BoundDecoder(pipe.graphs.decode, contract, states)
        _, prompt_mask, _ = pipe.padded_prompt(prepared)
        mask = prepare_decode_mask(prompt_mask, contract.capacity, contract.capacity)
        token = [int(np.argmax(logits))]

        def step():
            pos = advance_mask(mask)
            out = decoder.step(np.array([token], dtype=np.int64), mask, decode_position_ids(pos, prepared.rope_deltas))
            token[0] = int(np.argmax(out[0, -1]))

        result.decode_ms[length] = _median_ms(step, DECODE_WARMUP, DECODE_RUNS)
        del decoder, states
        pipe.graphs.unload_prefill()  # one bucket's weights in memory at a time (0.8B fp32: 3 GB each)
    prepared = pipe.prepare_ids(prompts[min(prompts)])
    start = time.perf_counter()
    out = pipe.generate_prepared(prepared, max_new_tokens=E2E_TOKENS)
    result.e2e_tokens_per_s = len(out.token_ids) / (time.perf_counter() - start)
    result.decode_bytes = decode_weight_bytes(export_dir / contract.graphs["decode"])
    return result


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads from the ONNX graph at ``path``: every initializer
    (inline or external data) except tables that are only indexed by Gather (the token
    embedding: one row per token)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    uses: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    total = 0
    for tensor in model.graph.initializer:
        if uses.get(tensor.name) == {("Gather", 0)}:
            continue
        external = {e.key: e.value for e in tensor.external_data}
        if "length" in external:
            total += int(external["length"])
        else:
            total += onnx.numpy_helper.to_array(tensor).nbytes
    return total


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


# ---- report -------------------------------------------------------------------------------
def report(results: list[PeerResult], bandwidth_gbps: float, out_dir: Path, state_bytes: dict[int, int]) -> str:
    """Write bench.md / bench.json / bench.png; returns the Markdown."""
    lengths = sorted({n for r in results for n in r.decode_ms})
    lines = [f"Read bandwidth: {bandwidth_gbps:.1f} GB/s (measured in this run)", ""]
    first, last = lengths[0], lengths[-1]
    lines += [
        "Times in ms (prefill: whole prompt; decode: per token). `decode {last}/{first}`: flatness in "
        "context length. floor: bytes of weights and states one decode step reads / read bandwidth; "
        "`x floor`: decode at {first} over it.".format(first=first, last=last),
        "",
    ]
    head = "| peer | " + " | ".join(f"prefill {n}" for n in lengths) + " | " + " | ".join(
        f"decode {n}" for n in lengths) + f" | decode {last}/{first} | e2e tok/s | floor ms/tok @{first} | x floor |"
    lines += [head, "|" + "---|" * (1 + 2 * len(lengths) + 4)]
    for r in results:
        floor = (r.decode_bytes + state_bytes.get(first, 0)) / (bandwidth_gbps * 1e9) * 1000 if r.decode_bytes else None
        row = [r.name] + [f"{r.prefill_ms.get(n, float('nan')):.1f}" for n in lengths]
        row += [f"{r.decode_ms.get(n, float('nan')):.2f}" for n in lengths]
        row += [f"{r.decode_ms[last] / r.decode_ms[first]:.2f}"]
        row += [f"{r.e2e_tokens_per_s:.1f}" if r.e2e_tokens_per_s else "-", f"{floor:.3f}" if floor else "-"]
        row += [f"{r.decode_ms[first] / floor:.1f}" if floor else "-"]
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


def run_bench(checkpoint: Path, work_dir: Path, lengths=LENGTHS, seed: int = 0, log=print) -> str:
    """Export the variants (cached in ``work_dir``), measure every peer, write the report."""
    from .contract import read_manifest
    from .export.exporter import ExportOptions, export

    work_dir.mkdir(parents=True, exist_ok=True)
    capacity = max(lengths) + 256
    variants = {
        "portable fp32": dict(ops="portable"),
        "ort fp32": dict(ops="ort"),
        "ort int8": dict(ops="ort", quantize="int8"),
        "ort int4": dict(ops="ort", quantize="int4"),
    }
    buckets = tuple(sorted(set(lengths)))  # the capacity itself needs no bucket here
    exports = {}
    for name, opts in variants.items():
        folder = work_dir / name.replace(" ", "-")
        options = ExportOptions(capacity=capacity, prefill_buckets=buckets, overwrite=True, **opts)
        if not _is_cached(folder, options):
            log(f"[bench] exporting {name} ...")
            export(checkpoint, folder, options)
        exports[name] = folder
    contract = read_manifest(exports["portable fp32"])
    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, min(contract.vocab_size, 1000), size=(1, n)).astype(np.int64) for n in lengths}
    state_bytes = {
        n: 4 * (int(np.prod(contract.conv_state_shape)) + int(np.prod(contract.recurrent_state_shape))
                + int(np.prod(contract.kv_shape(n))))
        for n in lengths
    }
    bandwidth = read_bandwidth_gbps()
    results = []
    for name, folder in exports.items():
        log(f"[bench] {name}")
        results.append(bench_pipeline(name, folder, prompts))
    log("[bench] transformers eager")
    results.append(bench_transformers(checkpoint, prompts))
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        log("[bench] onnxruntime-genai is not installed: skipped (pip install onnxruntime-genai)")
    else:
        for precision in ("fp32", "int4"):
            log(f"[bench] onnxruntime-genai {precision}")
            folder = build_genai(checkpoint, work_dir / f"genai-{precision}", precision)
            results.append(bench_genai(f"genai {precision}", folder, prompts))
    return report(results, bandwidth, work_dir, state_bytes)
