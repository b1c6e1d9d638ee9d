"""The bench's peers: transformers (the PyTorch reference), onnxruntime-genai, and OpenVINO's own
Qwen3.5 pipeline (optimum-intel's export run by openvino-genai's ``VLMPipeline``, from a virtual
environment of its own: optimum-intel pins an older transformers). Each measures with the
:class:`~.protocol.Protocol` it is given and returns a :class:`~.protocol.PeerResult`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .protocol import PeerResult, Protocol, decode_weight_bytes, median_ms, run_tool

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
OPTIMUM_EXPORT_ARGS = (
    "--task",
    "image-text-to-text",
    "--weight-format",
    "int4",
    "--sym",
    "--group-size",
    "32",
    "--ratio",
    "1.0",
)


# ---- transformers -------------------------------------------------------------------------
def bench_transformers(checkpoint: Path, prompts: dict[int, np.ndarray], protocol: Protocol) -> PeerResult:
    """transformers eager on the CPU: the text model with a ``DynamicCache``, greedy."""
    import torch
    from transformers import DynamicCache

    from ..verify import load_reference

    model = load_reference(checkpoint)
    text = model.model.language_model
    result = PeerResult("transformers eager")

    def forward(ids, cache):
        hidden = text(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
        return model.lm_head(hidden[:, -1:])

    def one_length(ids) -> tuple[float, float]:
        """Prefill ms and decode ms/token of the prompt ``ids`` ``[1, S]``."""
        prefill = median_ms(
            lambda: forward(ids, DynamicCache(config=model.config.text_config)),
            protocol.prefill_warmup,
            protocol.prefill_runs,
        )
        cache = DynamicCache(config=model.config.text_config)
        token = forward(ids, cache).argmax(-1)

        def step():
            nonlocal token
            token = forward(token.view(1, 1), cache).argmax(-1)

        return prefill, median_ms(step, protocol.decode_warmup, protocol.decode_runs)

    with torch.no_grad():
        for length, ids in prompts.items():
            result.prefill_ms[length], result.decode_ms[length] = one_length(torch.from_numpy(ids))
        ids = torch.from_numpy(prompts[min(prompts)])
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=protocol.e2e_tokens,
            min_new_tokens=protocol.e2e_tokens,
            do_sample=False,
            pad_token_id=0,
        )
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
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(checkpoint),
                "-o",
                str(out),
                "-p",
                precision,
                "-e",
                "cpu",
                "-c",
                str(out.parent / "genai-cache"),
            ],
            check=True,
            capture_output=True,
        )
    return out


def bench_genai(name: str, model_dir: Path, prompts: dict[int, np.ndarray], protocol: Protocol) -> PeerResult:
    """onnxruntime-genai's ``Generator`` on its own export of the checkpoint, greedy."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    result = PeerResult(name)

    def generator(total: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, do_sample=False)
        return og.Generator(model, params)

    def one_length(length: int, ids32: np.ndarray) -> tuple[float, float]:
        """Prefill ms and decode ms/token of the prompt ``ids32`` (``length`` tokens)."""
        prefill = median_ms(
            lambda: generator(length + 1).append_tokens(ids32), protocol.prefill_warmup, protocol.prefill_runs
        )
        gen = generator(length + protocol.decode_warmup + protocol.decode_runs + 2)
        gen.append_tokens(ids32)
        return prefill, median_ms(gen.generate_next_token, protocol.decode_warmup, protocol.decode_runs)

    for length, ids in prompts.items():
        result.prefill_ms[length], result.decode_ms[length] = one_length(length, ids[0].astype(np.int32))
    ids32 = prompts[min(prompts)][0].astype(np.int32)
    gen = generator(len(ids32) + protocol.e2e_tokens)
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
    run_tool([sys.executable, "-m", "venv", "--clear", str(venv)], "python -m venv")
    run_tool(
        [str(python), "-m", "pip", "install", "--quiet", *OPTIMUM_VENV_PINS], "pip install (optimum-intel environment)"
    )
    run_tool(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", OPTIMUM_INTEL_PIN],
        f"pip install {OPTIMUM_INTEL_PIN}",
    )
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
    done = run_tool(
        [
            str(python.parent / "optimum-cli"),
            "export",
            "openvino",
            "--model",
            str(checkpoint),
            *OPTIMUM_EXPORT_ARGS,
            str(out),
        ],
        "optimum-cli export openvino",
    )
    (out / "export.log").write_text(done.stdout + done.stderr)
    stamp.write_text(args)
    return out


def bench_ovgenai(
    name: str,
    python: Path,
    model_dir: Path,
    prompts: dict[int, np.ndarray],
    precision: str,
    protocol: Protocol,
    image: dict | None = None,
) -> PeerResult:
    """Run :mod:`.ovgenai_peer` in the peer's environment (that file as a script: it imports nothing
    of this project; ``-P``: its folder stays off ``sys.path``) and read its JSON. ``image``:
    ``{"path", "question"}`` of the image prompt whose time to first token it also measures
    (``result.image``: ``{"ttft_ms", "prompt_tokens"}``)."""
    spec = {
        "model_dir": str(model_dir),
        "precision": precision,
        "protocol": asdict(protocol),
        "prompts": {str(n): ids[0].tolist() for n, ids in prompts.items()},
        "image": image,
    }
    script = Path(__file__).resolve().with_name("ovgenai_peer.py")
    done = run_tool([str(python), "-P", str(script)], f"openvino-genai peer {name}", input=json.dumps(spec))
    out = json.loads(done.stdout.strip().splitlines()[-1])
    result = PeerResult(
        name,
        {int(n): v for n, v in out["prefill_ms"].items()},
        {int(n): v for n, v in out["decode_ms"].items()},
        out["e2e_tokens_per_s"],
    )
    # weights one decode step reads: the language model IR (the token embedding is its own model,
    # one row read per token)
    result.decode_bytes = (model_dir / "openvino_language_model.bin").stat().st_size
    result.note = json.dumps({k: out[k] for k in ("input_tokens", "tpot_ms", "versions")})
    result.peak_rss_bytes = out.get("peak_rss_bytes")  # the peer's own process
    result.image = out.get("image")
    return result
