"""The qwen35-onnx command: export, generate, verify, bench, demo and serve.

Errors the user can fix (bad options, bad input, mismatched exports) are printed as one
``error: ...`` line with exit status 2, never as a traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from .contract import ContractError

# rich_markup_mode=None: option help ends in "[default: ...]", which rich would take for a style tag
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0], rich_markup_mode=None)
USER_ERRORS = (ValueError, OSError, ContractError, TypeError)
"""Errors a user can fix (bad values, files, exports): reported as one line. OSError covers
missing, unreadable and unwritable files and folders."""


def _fail(exc: BaseException) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2)


def _parse_buckets(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--prefill-buckets {text!r} must be comma-separated integers, e.g. 32,512,1024,2048") from None


@app.command()
def export(
    model_id: Path = typer.Option(..., "--model-id", help="Local Hugging Face checkpoint folder."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Folder to write (vision/, text/ with the prefill and decode graphs and their shared weights, manifest.json)."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Capacity in tokens: KV cache and mask width. [default: 2048]"),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="fixed (constant-width KV, static graphs) or dynamic (growing). [default: fixed]"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, fp16 or bf16: weights, activations, conv state and KV cache (the recurrent state and the host-facing pixel_values, image_embeds and logits stay fp32; bf16 runs on OpenVINO). [default: fp32]"),
    vision_image_size: Optional[int] = typer.Option(None, "--vision-image-size", help="Image side in pixels (multiple of patch x merge). [default: 128]"),
    dummy_seq_len: Optional[int] = typer.Option(None, "--dummy-seq-len", help="Trace length in tokens. [default: 8, at most capacity - 1]"),
    component: str = typer.Option("all", "--component", help="all, vision, prefill or decode (one graph of an existing export, keeping its settings)."),
    prefill_buckets: Optional[str] = typer.Option(
        None, "--prefill-buckets",
        help="Comma-separated static prefill lengths, e.g. 32,512,1024,2048 (fixed mode). [default: those below capacity, plus capacity]",
    ),
    prefill_logits: Optional[str] = typer.Option(None, "--prefill-logits", help="last (the last real token) or all (every position, for verification). [default: last]"),
    ops: Optional[str] = typer.Option(None, "--ops", help="ort (ONNX Runtime fused operators, KV cache updated in place) or portable (standard ONNX operators only, for other runtimes and compilers). [default: ort]"),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="none, int4 or int8: weight-only quantization of the text graphs (MatMulNBits with --ops ort, standard blocked DequantizeLinear with --ops portable). [default: none]"),
    quant_block_size: Optional[int] = typer.Option(None, "--quant-block-size", help="Weights per quantization scale (power of two from 16 to 256). [default: 32]"),
    quant_accuracy_level: Optional[int] = typer.Option(
        None, "--quant-accuracy-level",
        help="ONNX Runtime's MatMulNBits accuracy level of a quantized export: 0 unset, 1 fp32, 2 fp16, 3 bf16, "
             "4 int8 activations (fastest on CPU). Written into --ops ort graphs, read from the manifest for "
             "--ops portable. [default: 4]",
    ),
    quantize_embedding: Optional[bool] = typer.Option(
        None, "--quantize-embedding/--no-quantize-embedding",
        help="Quantize the token-embedding table with the text weights (GatherBlockQuantized with the export's "
             "bits for --ops ort, sharing a tied lm_head's bytes; int8 Gather + DequantizeLinear for --ops portable). "
             "[default: on when --quantize is int4 or int8]",
    ),
    max_images: Optional[int] = typer.Option(None, "--max-images", help="Images per prompt the prefill graphs take (each adds its image tokens to the prompt). [default: 1]"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous export in --output-dir."),
) -> None:
    """Export a Qwen3.5 checkpoint to fixed-shape ONNX graphs."""
    try:
        from .export.exporter import ExportOptions, export as run_export
        from .export.weight_source import peak_rss_bytes
    except ImportError as exc:  # torch / onnx missing
        _fail(ValueError(f"export needs the 'export' extra (torch, onnx, onnxscript): {exc}"))
    given = {
        "capacity": max_seq_len,
        "kv_mode": kv_cache,
        "dtype": dtype,
        "image_size": vision_image_size,
        "dummy_seq_len": dummy_seq_len,
        "prefill_logits": prefill_logits,
        "ops": ops,
        "quantize": quantize,
        "quant_block_size": quant_block_size,
        "quant_accuracy_level": quant_accuracy_level,
        "quantize_embedding": quantize_embedding,
        "max_images": max_images,
    }
    try:
        given["prefill_buckets"] = _parse_buckets(prefill_buckets)
    except ValueError as exc:
        _fail(exc)
    given = {name: value for name, value in given.items() if value is not None}
    options = ExportOptions(component=component, overwrite=overwrite, **given)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so an interrupted export cleans up
    try:
        contract = run_export(model_id, output_dir, options, show_progress=True, explicit=set(given))
    except USER_ERRORS as exc:
        _fail(exc)
    typer.echo(
        f"exported {options.component} to {output_dir} (capacity {contract.capacity}, kv {contract.kv_mode}, "
        f"{contract.n_image_tokens} image tokens); peak resident memory {peak_rss_bytes() / 2**30:.2f} GiB",
        err=True,
    )


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


@app.command()
def generate(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    image: Optional[list[Path]] = typer.Option(None, "--image", help="Image file (any size and mode; repeatable, up to the export's --max-images); omit for a text-only prompt."),
    prompt: str = typer.Option(..., "--prompt", help="User prompt."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (same seed, same text)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); not included in the output."),
    runtime: str = typer.Option("onnxruntime", "--runtime", help="onnxruntime or openvino (static graphs of a fixed-KV --ops portable export)."),
    device: str = typer.Option("cpu", "--device", help="onnxruntime: cpu or cuda; openvino: an OpenVINO device (cpu, gpu, npu, ... as present)."),
    precision: str = typer.Option("f32", "--precision", help="f32 (parity with transformers); openvino also bf16 or f16 (its inference precision hint)."),
    host_state_roundtrip: bool = typer.Option(False, "--host-state-roundtrip", help="Copy states to host every step (for comparison)."),
) -> None:
    """Stream text for an image and a prompt; timings go to stderr."""
    from .pipeline import Pipeline
    from .runtime.sampling import SamplingConfig

    try:
        pipe = Pipeline.from_exported(model, device=device, host_state_roundtrip=host_state_roundtrip, runtime=runtime,
                                      precision=precision)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stream = pipe.stream(image or None, prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)
    except USER_ERRORS as exc:
        _fail(exc)
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `| head`: the reader left; stop quietly
        sys.stderr.close()
        raise typer.Exit(code=1)
    except USER_ERRORS as exc:
        _fail(exc)
    result = stream.result
    typer.echo(f"[{result.finish_reason}] {len(result.token_ids)} tokens | {result.timings.summary()}", err=True)


@app.command()
def verify(
    model: Path = typer.Option(..., "--model", help="Export folder."),
    model_id: Path = typer.Option(..., "--model-id", help="The checkpoint folder it was exported from."),
    image: Optional[Path] = typer.Option(None, "--image", help="Image file; omit for a text-only prompt."),
    prompt: str = typer.Option("Describe this image.", "--prompt"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
) -> None:
    """Greedy token parity of the exported graphs against transformers; exit 1 on mismatch."""
    from .pipeline import Pipeline
    from .verify import token_parity

    try:
        pipe = Pipeline.from_exported(model)
        parity = token_parity(pipe, model_id, image, prompt, max_new_tokens)
    except USER_ERRORS as exc:
        _fail(exc)
    typer.echo(parity.line())
    if not parity.ok:
        raise typer.Exit(code=1)


@app.command()
def bench(
    lengths: str = typer.Option("32,512,1024,2048", "--lengths", help="Comma-separated prompt/context lengths in tokens."),
    work_dir: Path = typer.Option(Path("benchmarks/out"), "--work-dir", help="Exports and reports (bench.md, bench.json, bench.png)."),
    preset: str = typer.Option(
        "qwen3.5-0.8b", "--preset",
        help="Checkpoint sizes: qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b or qwen3.5-9b (published Qwen3.5 "
             "dimensions, random weights, bf16: 1.7 / 4.4 / 9.1 / 18.8 GB) or tiny (the demo checkpoint, a quick run).",
    ),
    rows: str = typer.Option(
        "all", "--rows",
        help="Comma-separated rows to measure (names as in the table, e.g. 'ort int4,openvino int4 f32'), or all.",
    ),
    prefill_runs: int = typer.Option(
        5, "--prefill-runs",
        help="Timed prefill runs per length, after min(2, N) warm-ups (reference protocol: 5 after 2).",
    ),
    memory: Optional[Path] = typer.Option(
        None, "--memory",
        help="Instead: resident memory of a Pipeline with every graph of this export loaded, against "
             "1.2 x weights + states + 0.5 GB, and decode ms/token with shared vs per-session weights.",
    ),
) -> None:
    """Speed side by side: this project's variants, transformers, onnxruntime-genai, the floor."""
    from .bench import check_rows, run_bench
    from .checkpoints import PRESETS, build_demo_checkpoint, demo_checkpoint_dir

    if memory is not None:
        from .bench_memory import measure_memory

        try:
            report = measure_memory(memory, log=lambda m: typer.echo(m, err=True))
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo("\n".join(report.lines()))
        return

    if preset not in PRESETS:
        _fail(ValueError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}"))
    try:
        parsed = tuple(int(n) for n in lengths.split(","))
    except ValueError:
        _fail(ValueError(f"--lengths {lengths!r} must be comma-separated integers"))
    if not parsed or min(parsed) < 1:
        _fail(ValueError(f"--lengths {lengths!r} must be positive"))
    if prefill_runs < 1:
        _fail(ValueError(f"--prefill-runs {prefill_runs} must be at least 1"))
    try:
        chosen = check_rows(None if rows.strip() == "all" else [r.strip() for r in rows.split(",") if r.strip()])
    except ValueError as exc:
        _fail(ValueError(f"--rows {rows!r}: {exc} (or all)"))
    if preset == "tiny":
        checkpoint = build_demo_checkpoint(demo_checkpoint_dir())
    else:
        typer.echo(f"[bench] building the {preset} checkpoint (once, cached) ...", err=True)
        checkpoint = build_demo_checkpoint(demo_checkpoint_dir().parent / f"checkpoint-{preset}", preset=preset)
    try:
        typer.echo(run_bench(checkpoint, work_dir / preset, parsed, log=lambda m: typer.echo(m, err=True), rows=chosen,
                             prefill_runs=prefill_runs))
    except USER_ERRORS as exc:
        _fail(exc)


@app.command()
def demo(
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Where the demo checkpoint and export live."),
) -> None:
    """Build (once) the demo checkpoint, export it, generate for the shipped photo, check parity."""
    from .demo import run_demo

    try:
        ok = run_demo(max_new_tokens=max_new_tokens, cache_dir=cache_dir)
    except USER_ERRORS as exc:
        _fail(exc)
    if not ok:
        raise typer.Exit(code=1)


@app.command()
def chat(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Most tokens per reply. [default: until end of sequence or capacity]"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed."),
    no_thinking: bool = typer.Option(False, "--no-thinking", help="Pass enable_thinking=false to the chat template."),
) -> None:
    """Interactive multi-turn chat: one line per turn, /image PATH attaches an image, /reset, /quit."""
    from .chat_repl import HELP, run_chat
    from .pipeline import Pipeline
    from .runtime.sampling import SamplingConfig

    try:
        pipe = Pipeline.from_exported(model)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    except USER_ERRORS as exc:
        _fail(exc)
    interactive = sys.stdin.isatty()
    if interactive:
        typer.echo(HELP, err=True)
    kwargs = {"enable_thinking": False} if no_thinking else None
    show_prompt = (lambda: sys.stderr.write("> ") and sys.stderr.flush()) if interactive else None
    try:
        run_chat(pipe, sys.stdin, sys.stdout, sys.stderr, system=system, max_new_tokens=max_new_tokens,
                 sampling=sampling, chat_template_kwargs=kwargs, prompt=show_prompt)
    except KeyboardInterrupt:
        typer.echo("", err=True)


@app.command()
def serve(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free port, printed at start)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="QWEN35_ONNX_API_KEY", show_envvar=False,
        help="Require `Authorization: Bearer KEY` on /v1/* (or set QWEN35_ONNX_API_KEY). [default: no auth]",
    ),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id shown in /v1/models and replies. [default: the export folder's name]"),
    max_queue: int = typer.Option(8, "--max-queue", help="Requests that may wait while one generation runs; more get 429."),
    max_body_bytes: int = typer.Option(32 * 1024 * 1024, "--max-body-bytes", help="Largest request body; larger gets 413."),
    max_image_bytes: int = typer.Option(20 * 1024 * 1024, "--max-image-bytes", help="Largest encoded image; larger gets 413."),
    max_image_pixels: int = typer.Option(50_000_000, "--max-image-pixels", help="Largest image in pixels (width x height, read before decoding); larger gets 413."),
    allowed_image_dir: Optional[Path] = typer.Option(None, "--allowed-image-dir", help="Folder from which local image paths / file:// URLs may be read. [default: none, data: URLs only]"),
    threads: int = typer.Option(0, "--threads", help="ONNX Runtime intra-op threads (0: its default)."),
) -> None:
    """OpenAI-compatible chat server (POST /v1/chat/completions, GET /v1/models, GET /health)."""
    try:
        from .server import ServerOptions, serve as run_server
    except ImportError as exc:  # fastapi / uvicorn missing
        _fail(ValueError(f"serve needs the 'serve' extra (pip install 'qwen35-onnx[serve]'): {exc}"))
    if threads < 0:
        _fail(ValueError(f"--threads must be >= 0, got {threads}"))
    if not 0 <= port <= 65535:
        _fail(ValueError(f"--port must be in [0, 65535], got {port}"))
    options = ServerOptions(
        model_name=model_name if model_name is not None else model.resolve().name,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
        allowed_image_dir=allowed_image_dir,
    )
    try:
        run_server(model, options, host=host, port=port, threads=threads,
                   announce=lambda line: typer.echo(line, err=True))
    except USER_ERRORS as exc:
        _fail(exc)


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
