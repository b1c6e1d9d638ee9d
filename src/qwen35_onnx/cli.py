"""The qwen35-onnx command: export, quantize, generate, chat, serve, verify, bench and demo.

Option groups are declared once, as dataclasses (:class:`~.export.options.ExportOptions`,
:class:`~.runtime.backend.RuntimeOptions`, :class:`~.runtime.sampling.SamplingConfig`,
:class:`~.server.options.ServerOptions`); :func:`with_options` turns each into command-line options
and hands the command one instance per group. Errors the user can fix (bad options, bad input,
mismatched exports) are printed as one ``error: ...`` line with exit status 2, never as a
traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import types
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

import typer

from .cluster.options import ClusterOptions
from .contract import ContractError
from .export.options import ExportOptions, QuantizeOptions
from .interrupts import unwinding
from .options import Declared, declared
from .runtime.backend import RuntimeOptions
from .runtime.sampling import SamplingConfig
from .server.options import ServerOptions

# rich_markup_mode=None: option help ends in "[default: ...]", which rich would take for a style tag
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0], rich_markup_mode=None)
USER_ERRORS = (ValueError, OSError, ContractError, TypeError)
"""Errors a user can fix (bad values, files, exports): reported as one line. OSError covers
missing, unreadable and unwritable files and folders."""


def _fail(exc: BaseException) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2)


# ---- options declared once -------------------------------------------------------------------
def _cli_type(o: Declared):
    """The type the command line reads for ``o``: a string for modes (the group's ``validate``
    names the value and the choices) and for options with a parser; optional types stay optional."""
    if o.parse is not None:
        return Optional[str]
    kind = o.type
    optional = get_origin(kind) in (Union, types.UnionType) and type(None) in get_args(kind)
    if optional:
        kind = next(a for a in get_args(kind) if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        kind = str
    return Optional[kind] if optional or kind is not bool else kind


def _cli_option(o: Declared, given_only: bool, default_from: str | None = None) -> Any:
    """The typer option of ``o``. ``given_only``: the command line's default is None, so the command
    can tell a value the user gave from the group's default (shown in the help, or ``default_from``:
    where the command takes the defaults from)."""
    default = o.default.value if isinstance(o.default, StrEnum) else o.default
    help_text = o.help
    if given_only and o.type is not bool:
        if default_from:
            help_text += f" [default: {default_from}]"
        elif default is not None:
            help_text += f" [default: {default}]"
        default = None
    return typer.Option(
        default,
        o.flag,
        help=help_text,
        envvar=o.env,
        show_envvar=False,
        show_default=not given_only and default is not None,
    )


def with_options(given_only: tuple[str, ...] = (), default_from: dict[str, str] | None = None, **groups: type):
    """Decorate a command so that it takes every declared option of each dataclass in ``groups``
    (parameter name -> dataclass) and receives one instance per group under that name. A command
    parameter named ``<group>_given`` receives the set of that group's options the user gave; for
    the groups named in ``given_only`` (or in ``default_from``: group -> where the command takes
    that group's defaults from, for the help) an option not given takes the dataclass default (the
    CLI default is None, so giving the default value explicitly still counts as given).

    Raises (when the command runs):
        typer.Exit: a value the group's ``parse`` refuses (one ``error:`` line, exit status 2).
    """

    default_from = default_from or {}
    given_only = (*given_only, *default_from)

    def wrap(command):
        signature = inspect.signature(command)
        kept = [p for p in signature.parameters.values() if p.name not in groups and not p.name.endswith("_given")]
        added = [
            inspect.Parameter(
                o.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=_cli_type(o),
                default=_cli_option(o, name in given_only, default_from.get(name)),
            )
            for name, group in groups.items()
            for o in declared(group)
        ]

        @functools.wraps(command)
        def run(**values):
            for name, group in groups.items():
                raw = {o.name: values.pop(o.name) for o in declared(group)}
                # a plain switch (--overwrite) is given when on; an optional one (--x/--no-x) when set either way
                given = {
                    o.name
                    for o in declared(group)
                    if raw[o.name] is not None and (raw[o.name] is not False or o.type is not bool)
                }
                chosen = {}
                for o in declared(group):
                    value = raw[o.name]
                    if value is None and o.default is not None:
                        continue
                    try:
                        chosen[o.name] = o.parse(value) if o.parse is not None and value is not None else value
                    except ValueError as exc:
                        _fail(exc)
                values[name] = group(**chosen)
                if f"{name}_given" in signature.parameters:
                    values[f"{name}_given"] = given
            return command(**values)

        run.__signature__ = signature.replace(parameters=kept + added)
        run.__annotations__ = {p.name: p.annotation for p in kept + added}  # typer reads these first
        return run

    return wrap


# ---- commands ------------------------------------------------------------------------------
@app.command()
@with_options(given_only=("options",), options=ExportOptions)
def export(
    model_id: Path = typer.Option(..., "--model-id", help="Local Hugging Face checkpoint folder."),
    output_dir: str = typer.Option(  # a string: typer would read an empty path as the current folder
        ...,
        "--output-dir",
        metavar="<path>",
        help="Folder to write (vision/, text/ with the prefill and decode graphs and their shared weights, "
        "manifest.json).",
    ),
    options: ExportOptions = None,
    options_given: set[str] = frozenset(),
) -> None:
    """Export a Qwen3.5 checkpoint to fixed-shape ONNX graphs."""
    try:
        from .export.exporter import export as run_export
        from .export.weight_source import peak_rss_bytes
    except ImportError as exc:  # torch / onnx missing
        _fail(ValueError(f"export needs the 'export' extra (torch, onnx, onnxscript, ml_dtypes): {exc}"))
    try:
        contract = run_export(model_id, output_dir, options, show_progress=True, explicit=set(options_given))
    except USER_ERRORS as exc:
        _fail(exc)
    typer.echo(
        f"exported {options.component} to {output_dir} (capacity {contract.capacity}, kv {contract.kv_mode}, "
        f"{contract.n_image_tokens} image tokens); peak resident memory {peak_rss_bytes() / 2**30:.2f} GiB",
        err=True,
    )


@app.command()
@with_options(options=QuantizeOptions)
def quantize(
    model: Path = typer.Option(
        ..., "--model", help="Export folder written by `qwen35-onnx export` without --quantize."
    ),
    output_dir: str = typer.Option(  # a string: typer would read an empty path as the current folder
        ..., "--output-dir", metavar="<path>", help="Folder to write the quantized export to."
    ),
    options: QuantizeOptions = None,
) -> None:
    """Quantize the text graphs of an existing export (int4 or int8 weights) without tracing the checkpoint again."""
    try:
        from .export.requantize import quantize_export
        from .export.weight_source import peak_rss_bytes
    except ImportError as exc:  # onnx / onnxscript missing
        _fail(ValueError(f"quantize needs the 'export' extra (torch, onnx, onnxscript, ml_dtypes): {exc}"))
    try:
        contract = quantize_export(model, output_dir, options, show_progress=True)
    except USER_ERRORS as exc:
        _fail(exc)
    typer.echo(
        f"quantized {model} to {output_dir} ({contract.quantize}, block {contract.quant_block_size}, embedding "
        f"{'quantized' if contract.quantize_embedding else 'kept'}); peak resident memory "
        f"{peak_rss_bytes() / 2**30:.2f} GiB",
        err=True,
    )


def _load(model: Path, runtime: RuntimeOptions):
    """The Pipeline of the export at ``model``, or one ``error:`` line."""
    from .pipeline import Pipeline
    from .runtime.select import share_threads

    try:
        share_threads(runtime)  # this process is the command's: one thread pool for all its graphs
        return Pipeline.from_exported(model, runtime)
    except USER_ERRORS as exc:
        _fail(exc)


CHECKPOINT_SAMPLING = "as the export's generation_config.json says (greedy without one)"
"""Where ``generate`` and ``chat`` take the sampling options a user does not give."""

MAX_IMAGE_TOKENS_HELP = (
    "Image-token limit per image (from the image processor's minimum, 64 for Qwen3.5, up to the export's "
    "--image-tokens). [default: the export's budget]"
)
THINKING_HELP = "Turn the chat template's thinking on or off (its enable_thinking). [default: the template's own]"
FPS_HELP = "Frames sampled per second of video. [default: the checkpoint's video processor's, 2]"
MAX_VIDEO_TOKENS_HELP = (
    "Video-token limit per video (frames are sized down to fit it). [default: the video processor's own most "
    "or half the export's capacity, the smaller]"
)


def _thinking_kwargs(thinking: bool | None) -> dict | None:
    return None if thinking is None else {"enable_thinking": thinking}


def _check_image_limit(pipe, max_image_tokens: int | None) -> None:
    """``--max-image-tokens`` within the export's range, or one ``error:`` line."""
    try:
        pipe.preprocessor.sizing.limit(max_image_tokens)
    except USER_ERRORS as exc:
        _fail(ValueError(str(exc).replace("max_image_tokens", "--max-image-tokens", 1)))


def _check_video_options(pipe, fps: float | None, max_video_tokens: int | None, videos: bool = True) -> None:
    """``--fps`` and ``--max-video-tokens`` in range (and the export takes videos, where ``videos``), or one
    ``error:`` line."""
    from .conversation.videos import check_fps

    try:
        if fps is not None:
            check_fps(fps)
        if videos or max_video_tokens is not None:
            pipe.preprocessor.video_sizing.limit(max_video_tokens)
    except USER_ERRORS as exc:
        _fail(ValueError(str(exc).replace("max_video_tokens", "--max-video-tokens", 1).replace("fps", "--fps", 1)))


def _sampling(pipe, given: SamplingConfig, given_names: set[str]) -> SamplingConfig:
    """The export's sampling defaults with the values the user gave on top, or one ``error:`` line."""
    chosen = dataclasses.replace(pipe.sampling_defaults, **{n: getattr(given, n) for n in given_names})
    try:
        chosen.validate()
    except USER_ERRORS as exc:
        _fail(exc)
    return chosen


@app.command()
@with_options(default_from={"sampling": CHECKPOINT_SAMPLING}, runtime=RuntimeOptions, sampling=SamplingConfig)
def generate(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    image: Optional[list[Path]] = typer.Option(
        None,
        "--image",
        help="Image file (any size and mode; repeatable, up to the export's --max-images); omit for a text-only "
        "prompt.",
    ),
    video: Optional[list[Path]] = typer.Option(
        None, "--video", help="Video file (repeatable; after the images, before the prompt)."
    ),
    prompt: str = typer.Option(..., "--prompt", help="User prompt."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate."),
    max_image_tokens: Optional[int] = typer.Option(
        None, "--max-image-tokens", help=MAX_IMAGE_TOKENS_HELP, show_default=False
    ),
    fps: Optional[float] = typer.Option(None, "--fps", help=FPS_HELP, show_default=False),
    max_video_tokens: Optional[int] = typer.Option(
        None, "--max-video-tokens", help=MAX_VIDEO_TOKENS_HELP, show_default=False
    ),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); not included in the output."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP, show_default=False),
    runtime: RuntimeOptions = None,
    sampling: SamplingConfig = None,
    sampling_given: set[str] = frozenset(),
) -> None:
    """Stream text for images, videos and a prompt; timings go to stderr."""
    try:
        sampling.validate()
    except USER_ERRORS as exc:
        _fail(exc)
    pipe = _load(model, runtime)
    _check_image_limit(pipe, max_image_tokens)
    _check_video_options(pipe, fps, max_video_tokens, bool(video))
    sampling = _sampling(pipe, sampling, sampling_given)
    try:
        stream = pipe.stream(
            image or None,
            prompt,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop=stop,
            chat_template_kwargs=_thinking_kwargs(thinking),
            max_image_tokens=max_image_tokens,
            video=video or None,
            fps=fps,
            max_video_tokens=max_video_tokens,
        )
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
        raise typer.Exit(code=1) from None
    except USER_ERRORS as exc:
        _fail(exc)
    result = stream.result
    typer.echo(f"[{result.finish_reason}] {len(result.token_ids)} tokens | {result.timings.summary()}", err=True)


@app.command()
@with_options(runtime=RuntimeOptions)
def verify(
    model: Path = typer.Option(..., "--model", help="Export folder."),
    model_id: Path = typer.Option(..., "--model-id", help="The checkpoint folder it was exported from."),
    image: Optional[Path] = typer.Option(None, "--image", help="Image file; omit for a text-only prompt."),
    video: Optional[Path] = typer.Option(
        None,
        "--video",
        help="Video file (after the image); transformers reads it with its PyAV reader and the checkpoint's "
        "Qwen3VLVideoProcessor, which needs torchvision.",
    ),
    prompt: str = typer.Option("Describe this image.", "--prompt", help="The user's text."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Greedy tokens compared."),
    fps: Optional[float] = typer.Option(None, "--fps", help=FPS_HELP, show_default=False),
    max_video_tokens: Optional[int] = typer.Option(
        None, "--max-video-tokens", help=MAX_VIDEO_TOKENS_HELP, show_default=False
    ),
    runtime: RuntimeOptions = None,
) -> None:
    """Greedy token parity of the exported graphs against transformers; exit 1 on mismatch."""
    from .paths import check_checkpoint_folder
    from .verify import token_parity

    try:
        check_checkpoint_folder(model_id)  # before the ONNX side runs
    except USER_ERRORS as exc:
        _fail(exc)
    pipe = _load(model, runtime)
    _check_video_options(pipe, fps, max_video_tokens, video is not None)
    try:
        parity = token_parity(
            pipe, model_id, image, prompt, max_new_tokens, video=video, fps=fps, max_video_tokens=max_video_tokens
        )
    except (*USER_ERRORS, ImportError) as exc:
        _fail(exc)
    typer.echo(parity.line())
    if not parity.ok:
        raise typer.Exit(code=1)


def _lengths(text: str) -> tuple[int, ...]:
    """``--lengths`` as positive integers (exits naming the value otherwise)."""
    try:
        parsed = tuple(int(n) for n in text.split(","))
    except ValueError:
        _fail(ValueError(f"--lengths {text!r} must be comma-separated integers"))
    if not parsed or min(parsed) < 1:
        _fail(ValueError(f"--lengths {text!r} must be positive"))
    return parsed


def _at_least_one(option: str, value: int) -> int:
    if value < 1:
        _fail(ValueError(f"{option} {value} must be at least 1"))
    return value


@app.command()
def bench(
    lengths: str = typer.Option(
        "32,512,1024,2048", "--lengths", help="Comma-separated prompt/context lengths in tokens."
    ),
    work_dir: Path = typer.Option(
        Path("benchmarks/out"), "--work-dir", help="Exports and reports (bench.md, bench.json, bench.png)."
    ),
    preset: str = typer.Option(
        "qwen3.5-0.8b",
        "--preset",
        help="Checkpoint sizes: qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b or qwen3.5-9b (published Qwen3.5 "
        "dimensions, random weights, bf16: 1.7 / 4.4 / 9.1 / 18.8 GB) or tiny (the demo checkpoint, a quick run).",
    ),
    rows: str = typer.Option(
        "all",
        "--rows",
        help="Comma-separated rows to measure (names as in the table, e.g. 'ort int4,openvino int4 f32'), or all.",
    ),
    prefill_runs: int = typer.Option(
        5,
        "--prefill-runs",
        help="Timed prefill runs per length, after min(2, N) warm-ups (reference protocol: 5 after 2).",
    ),
    rounds: int = typer.Option(
        1,
        "--rounds",
        help="Measure the rows this many times in turn (A B C A B C; at least 1) and report the median of "
        "each figure over the rounds: a slow spell of a shared machine then lands on every row, not on one.",
    ),
    memory: Optional[Path] = typer.Option(
        None,
        "--memory",
        help="Instead: resident memory of a Pipeline with every graph of this export loaded, against "
        "1.2 x weights + states + 0.5 GB, and decode ms/token with shared vs per-session weights.",
    ),
    publish: bool = typer.Option(
        False,
        "--publish",
        help="After the run, store its bench.json as the latest result of this machine and preset "
        "(benchmarks/results/MACHINE/PRESET.json, run from the repository's root), then render as --render does.",
    ),
    render: bool = typer.Option(
        False,
        "--render",
        help="Instead: render every table and chart of measured figures in README.md and docs/ (the blocks between "
        "'<!-- begin rendered: NAME -->' markers, the benchmarks pages, docs/assets/bench/) from the stored results "
        "under benchmarks/, measuring nothing.",
    ),
    streams: str = typer.Option(
        "",
        "--streams",
        help="Instead: several streams at once, e.g. 1,2,4,8: the preset exported at int4 with that many decode "
        "slots, aggregate decode tokens/s and inter-token latency per stream count (in one process, a "
        "generation group), then qwen35-onnx serve against llama-server --parallel 4 under the same client load.",
    ),
    speculative: bool = typer.Option(
        False,
        "--speculative",
        help="Instead: speculative decoding with an MTP head: the preset exported at int4 with its MTP and verify "
        "graphs, the cost of a verify run and of a draft step against a decode step, and decode tokens/s at each "
        "draft length, at fixed acceptance rates 0.5 / 0.7 / 0.9 and at the MTP head's own drafts.",
    ),
    profile: Optional[Path] = typer.Option(
        None,
        "--profile",
        help="Instead: ONNX Runtime's profile of this export's prefill and decode at each of --lengths "
        "(time per operator and per node, the overhead outside the kernels, bytes a decode step reads).",
    ),
) -> None:
    """Speed side by side: this project's variants, transformers, onnxruntime-genai, the floor."""
    from .bench.speed import check_rows, run_bench
    from .checkpoints import build_demo_checkpoint
    from .paths import demo_checkpoint_dir
    from .presets import PRESETS

    _at_least_one("--prefill-runs", prefill_runs)
    _at_least_one("--rounds", rounds)
    if render:
        from .bench.render import render_all

        if publish or memory is not None or profile is not None or rounds != 1:
            _fail(ValueError("--render measures nothing: not with --publish, --memory, --profile or --rounds"))
        try:
            changed = render_all()
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo(f"[bench] rendered: {', '.join(map(str, changed)) or 'nothing changed'}", err=True)
        return
    if publish and (memory is not None or profile is not None):
        _fail(ValueError("--publish stores the side-by-side bench's result: not with --memory or --profile"))
    if publish and not Path("benchmarks/protocol.md").is_file():
        _fail(
            ValueError(
                f"--publish writes benchmarks/results/ of the repository: run it from its root, not {Path.cwd()}"
            )
        )
    if rounds != 1 and (memory is not None or profile is not None):
        _fail(ValueError(f"--rounds {rounds}: the side-by-side bench's option, not one of --memory or --profile"))
    if memory is not None:
        from .bench.memory import measure_memory

        try:
            report = measure_memory(memory, log=lambda m: typer.echo(m, err=True))
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo("\n".join(report.lines()))
        return

    if profile is not None:
        from .bench.profile import profile_export, profile_lines

        try:
            steps = profile_export(profile, _lengths(lengths), runs=prefill_runs, log=lambda m: typer.echo(m, err=True))
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo("\n".join(profile_lines(steps)))
        return

    if preset not in PRESETS:
        _fail(ValueError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}"))
    if streams.strip() and (publish or rounds != 1):
        _fail(ValueError("--streams measures concurrent streams: not with --publish or --rounds"))
    if speculative and (publish or rounds != 1 or streams.strip()):
        _fail(ValueError("--speculative measures speculative decoding: not with --publish, --rounds or --streams"))
    parsed = _lengths(lengths)
    try:
        chosen = check_rows(None if rows.strip() == "all" else [r.strip() for r in rows.split(",") if r.strip()])
    except ValueError as exc:
        _fail(ValueError(f"--rows {rows!r}: {exc} (or all)"))
    if preset == "tiny":
        checkpoint = build_demo_checkpoint(demo_checkpoint_dir())
    else:
        typer.echo(f"[bench] building the {preset} checkpoint (once, cached) ...", err=True)
        checkpoint = build_demo_checkpoint(demo_checkpoint_dir().parent / f"checkpoint-{preset}", preset=preset)
    if speculative:
        from .bench.speculative import report_lines as speculative_lines
        from .bench.speculative import run_speculative

        try:
            report = run_speculative(checkpoint, work_dir / preset, log=lambda m: typer.echo(m, err=True))
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo("\n".join(speculative_lines(report)))
        return
    if streams.strip():
        from .bench.streams import report_lines, run_streams

        try:
            counts = [int(n) for n in streams.split(",")]
        except ValueError:
            _fail(ValueError(f"--streams {streams!r} must be comma-separated stream counts, e.g. 1,2,4,8"))
        try:
            report = run_streams(checkpoint, work_dir / preset, counts, log=lambda m: typer.echo(m, err=True))
        except USER_ERRORS as exc:
            _fail(exc)
        typer.echo("\n".join(report_lines(report)))
        return
    try:
        typer.echo(
            run_bench(
                checkpoint,
                work_dir / preset,
                parsed,
                log=lambda m: typer.echo(m, err=True),
                rows=chosen,
                prefill_runs=prefill_runs,
                rounds=rounds,
                run={"preset": preset},
            )
        )
        if publish:
            from .bench.render import publish as store

            typer.echo(f"[bench] stored {store(work_dir / preset)} and rendered the pages", err=True)
    except USER_ERRORS as exc:
        _fail(exc)


@app.command()
def demo(
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Greedy tokens generated and compared."),
    cache_dir: Optional[Path] = typer.Option(
        None,
        "--cache-dir",
        help="Where the demo checkpoint and export live. [default: $QWEN35_ONNX_CACHE, else ~/.cache/qwen35-onnx]",
    ),
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
@with_options(default_from={"sampling": CHECKPOINT_SAMPLING}, runtime=RuntimeOptions, sampling=SamplingConfig)
def chat(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", help="Most tokens per reply. [default: until end of sequence or capacity]"
    ),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP, show_default=False),
    max_image_tokens: Optional[int] = typer.Option(
        None, "--max-image-tokens", help=MAX_IMAGE_TOKENS_HELP, show_default=False
    ),
    fps: Optional[float] = typer.Option(None, "--fps", help=FPS_HELP, show_default=False),
    max_video_tokens: Optional[int] = typer.Option(
        None, "--max-video-tokens", help=MAX_VIDEO_TOKENS_HELP, show_default=False
    ),
    runtime: RuntimeOptions = None,
    sampling: SamplingConfig = None,
    sampling_given: set[str] = frozenset(),
) -> None:
    """Interactive multi-turn chat: one line per turn, /image PATH and /video PATH attach, /reset, /quit."""
    from .chat_repl import HELP, run_chat

    try:
        sampling.validate()
    except USER_ERRORS as exc:
        _fail(exc)
    if max_new_tokens is not None and max_new_tokens < 1:
        _fail(ValueError(f"--max-new-tokens must be >= 1 (omit it: until end of sequence), got {max_new_tokens}"))
    pipe = _load(model, runtime)
    _check_image_limit(pipe, max_image_tokens)
    _check_video_options(pipe, fps, max_video_tokens, videos=False)
    sampling = _sampling(pipe, sampling, sampling_given)
    interactive = sys.stdin.isatty()
    if interactive:
        typer.echo(HELP, err=True)
    kwargs = _thinking_kwargs(thinking)
    show_prompt = (lambda: sys.stderr.write("> ") and sys.stderr.flush()) if interactive else None
    try:
        run_chat(
            pipe,
            sys.stdin,
            sys.stdout,
            sys.stderr,
            system=system,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            chat_template_kwargs=kwargs,
            prompt=show_prompt,
            max_image_tokens=max_image_tokens,
            fps=fps,
            max_video_tokens=max_video_tokens,
        )
    except KeyboardInterrupt:
        typer.echo("", err=True)


@app.command()
@with_options(options=ServerOptions, runtime=RuntimeOptions, cluster=ClusterOptions)
def serve(
    model: Path = typer.Option(..., "--model", help="Export folder written by `qwen35-onnx export`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free port, printed at start)."),
    options: ServerOptions = None,
    runtime: RuntimeOptions = None,
    cluster: ClusterOptions = None,
) -> None:
    """OpenAI-compatible chat server (POST /v1/chat/completions, GET /v1/models, /health, /metrics, page at /);
    with --replicas N a Ray Serve application of N replicas."""
    announce = lambda line: typer.echo(line, err=True)  # noqa: E731
    try:
        cluster.validate()
        if cluster.replicas:
            from .cluster.app import serve_cluster

            serve_cluster(model, options, runtime, cluster, host=host, port=port, announce=announce)
            return
        try:
            from .server.app import serve as run_server
        except ImportError as exc:  # fastapi / uvicorn missing
            raise ValueError(f"serve needs the 'serve' extra (pip install 'qwen35-onnx[serve]'): {exc}") from None
        run_server(model, options, runtime, host=host, port=port, announce=announce)
    except USER_ERRORS as exc:
        _fail(exc)


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    # SIGTERM and Ctrl-C unwind, so every command's cleanup runs (no half-written export folders
    # from `export`, `demo` or `bench`); `serve` installs uvicorn's own handlers while it runs
    with unwinding():
        app()


if __name__ == "__main__":  # pragma: no cover
    main()
