"""``qwen35-onnx demo`` (``make demo``): the main job end to end on the built-in demo checkpoint.

1. build the demo checkpoint once (cached): real Qwen3.5 architecture, small config, random
   weights from a fixed seed, locally trained tokenizer;
2. export it with a fixed-capacity KV cache (cached while the export is complete, made by
   this version and newer than the checkpoint);
3. stream the text generated for the shipped photograph and "Describe this image.";
4. generate with transformers on the same inputs and print ``parity: N/N tokens identical``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEMO_PROMPT = "Describe this image."
MIN_PARITY_TOKENS = 32


def _export_is_current(folder: Path, checkpoint: Path) -> bool:
    """The export in ``folder`` was made by this version from ``checkpoint`` as it is now (not from a
    demo checkpoint of an earlier format, rebuilt since: its marker is newer than the manifest)."""
    from . import __version__
    from .checkpoints import _MARKER
    from .contract import ContractError, read_manifest

    try:
        if read_manifest(folder).exporter_version != __version__:
            return False
        return (folder / "manifest.json").stat().st_mtime >= (checkpoint / _MARKER).stat().st_mtime
    except (ContractError, OSError):
        return False


def run_demo(
    max_new_tokens: int = 48, cache_dir: str | os.PathLike | None = None, out=sys.stdout, err=sys.stderr
) -> bool:
    """Run the demo; returns True when at least :data:`MIN_PARITY_TOKENS` tokens were
    generated and all are identical to transformers.

    Raises:
        ValueError: ``max_new_tokens`` below :data:`MIN_PARITY_TOKENS`; ``cache_dir`` is a file.
    """
    from .checkpoints import build_demo_checkpoint
    from .export.exporter import export
    from .export.options import ExportOptions
    from .paths import check_folder, demo_checkpoint_dir, photo_path
    from .pipeline import Pipeline
    from .runtime.sampling import SamplingConfig
    from .verify import token_parity

    if max_new_tokens < MIN_PARITY_TOKENS:
        raise ValueError(f"--max-new-tokens {max_new_tokens} is below the demo's parity minimum {MIN_PARITY_TOKENS}")
    root = check_folder(cache_dir, "--cache-dir") if cache_dir else demo_checkpoint_dir().parent
    checkpoint = root / "demo-checkpoint"
    exported = root / "demo-export"
    print(f"[demo] checkpoint: {checkpoint}", file=err)
    build_demo_checkpoint(checkpoint)
    if not _export_is_current(exported, checkpoint):
        print(f"[demo] exporting to {exported} (fixed KV cache) ...", file=err)
        export(checkpoint, exported, ExportOptions(overwrite=True), show_progress=True)
    else:
        print(f"[demo] using the export in {exported}", file=err)

    pipe = Pipeline.from_exported(exported)
    image = photo_path()
    print(f"[demo] {image.name}: {DEMO_PROMPT}", file=err)
    stream = pipe.stream(image, DEMO_PROMPT, max_new_tokens=max_new_tokens, sampling=SamplingConfig())  # greedy
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    result = stream.result
    print(f"[demo] [{result.finish_reason}] {len(result.token_ids)} tokens | {result.timings.summary()}", file=err)

    parity = token_parity(pipe, checkpoint, image, DEMO_PROMPT, max_new_tokens, result=result)
    print(parity.line(), file=out)
    if parity.total < MIN_PARITY_TOKENS:
        print(f"[demo] failure: only {parity.total} tokens generated, need {MIN_PARITY_TOKENS}", file=err)
        return False
    if not parity.ok:
        print(f"[demo] failure: first difference at token {parity.identical}", file=err)
        return False
    return True
