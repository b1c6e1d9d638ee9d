"""llama.cpp as a bench peer: built once from the ``llama-cpp-python`` source distribution (it
vendors llama.cpp, its checkpoint converter and gguf-py), the checkpoint converted to GGUF in a
converter environment of its own, quantized with ``llama-quantize``, measured with ``llama-bench``
(text) and ``llama-mtmd-cli`` (an image prompt).

What is cached where (``root`` is the bench's work folder's parent, shared by every preset):

- ``root/.llama.cpp/``: the source distribution (:data:`LLAMA_CPP_PYTHON_PIN`), its vendored
  llama.cpp and the CMake build of :data:`TOOLS` (``-DGGML_NATIVE=ON``: the build machine's
  instruction set, AVX-512 / VNNI where present, less AMX, whose path in this llama.cpp crashes:
  see :data:`NO_AMX`), marked finished by a stamp holding the pin and the CMake flags;
- ``root/.venv-llamacpp/``: the converter's environment (:data:`CONVERTER_PINS` and the vendored
  gguf-py): the converter's own requirements pin a transformers too old for ``qwen3_5``;
- ``WORK_DIR/llama.cpp/``: the GGUF files of the preset: ``model-BF16.gguf`` (the converter's
  output), the quantized rows' files and ``mmproj-F16.gguf`` (the vision tower).

The converter's tokenizer check and this project's answer to it: see :mod:`.llamacpp_convert`;
:func:`check_tokenizer` then compares llama.cpp's token ids with transformers' on a sample text.

Protocol: the bench's lengths and thread count. Prefill: ``llama-bench -p N -n 0``, median of the
protocol's prefill runs after llama-bench's own warm-up; decode at context ``N``: ``llama-bench -p 0
-n D -d N`` (``D`` = the protocol's decode steps), each repetition's time / ``D``, median of 3
repetitions; end to end: ``-pg 32,128``'s tokens / time (its prompt included, as this project's row
includes its prefill). Peak memory: the largest ``ru_maxrss`` of the llama.cpp processes of a row
(``os.wait4``). Times are milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..paths import has_mtp_weights
from .protocol import PeerResult, Protocol, run_tool, tool_failure

__all__ = [
    "LLAMACPP_ROWS",
    "LlamaCpp",
    "LlamaCppPeer",
    "bench_llamacpp",
    "bench_llamacpp_row",
    "check_tokenizer",
    "convert",
    "ensure_converter_venv",
    "ensure_llamacpp",
    "gguf_for",
    "image_ttft",
    "prepare_llamacpp",
]

LLAMA_CPP_PYTHON_PIN = "llama-cpp-python==0.3.36"
"""The source distribution that vendors the llama.cpp measured (0.3.36: llama.cpp 0c1e570)."""
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that leave llama.cpp's AMX path out: on CPUs with AMX (the development machine of
2026-12-03) this vendored llama.cpp's ``ggml_backend_amx_mul_mat`` crashes on the first matrix product
(SIGSEGV in llama-bench; upstream issue ggml-org/llama.cpp#20824, closed unfixed). GCC's explicit
``-mno-amx-*`` win over ``-march=native``; elsewhere they change nothing. Q4_0 keeps its AVX-512
repacked kernels."""
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
TOOLS = ("llama-bench", "llama-quantize", "llama-mtmd-cli", "llama-tokenize", "llama-server")
CONVERTER_PINS = (
    "torch==2.13.0",  # the CPU build (a local wheel here); an unpinned torch pulls a multi-GB CUDA build
    "transformers==5.24.*",  # the first line with qwen3_5 is 5.2; the project's tests run 5.24
    "numpy>=2.2.6",
    "sentencepiece>=0.1.98,<0.3",
    "safetensors>=0.4",
    "protobuf>=4.21",
)
#: Row name -> (llama-quantize type, llama-quantize options); BF16 is the converter's own output.
LLAMACPP_ROWS = {
    "llama.cpp Q4_0": ("Q4_0", ()),  # llama-quantize's default mix: the output layer Q6_K
    "llama.cpp Q4_0 pure": ("Q4_0", ("--pure",)),  # every tensor Q4_0, as this project's int4
    "llama.cpp Q8_0": ("Q8_0", ()),
    "llama.cpp BF16": ("BF16", ()),
}
E2E_PROMPT = 32
TOKENIZER_SAMPLE = (
    "Qwen3.5 reads text, code and pictures: def f(x):\n    return x ** 2  # 3.14159\n"
    "  Zwei  Leerzeichen, 中文的句子，日本語も。 🦙🚀 It's 100% done!!! 'RE \t tabs\r\n"
)


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build: ``source`` the vendored llama.cpp, ``bin`` its tools' folder."""

    source: Path
    bin: Path

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def _run_measured(cmd: list[str], what: str) -> tuple[str, str, int]:
    """Run ``cmd``: ``(stdout, stderr, peak resident bytes of that process)``; RuntimeError as
    :func:`~.protocol.run_tool`."""
    with tempfile.TemporaryFile() as stderr:  # a file: a full stderr pipe cannot block the child
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr)
        out = proc.stdout.read().decode(errors="replace")
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)  # reaps the child with its resource usage
        proc.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        err = stderr.read().decode(errors="replace")
    if proc.returncode:
        raise RuntimeError(tool_failure(what, proc.returncode, err or out))
    return out, err, usage.ru_maxrss * 1024


# ---- build ---------------------------------------------------------------------------------
def ensure_llamacpp(root: Path, log=print) -> LlamaCpp:
    """Download (once) :data:`LLAMA_CPP_PYTHON_PIN`'s source distribution into ``root``, unpack its
    vendored llama.cpp and build :data:`TOOLS` with CMake (:data:`CMAKE_FLAGS`, all cores).

    Raises:
        RuntimeError: pip, CMake or the compiler failed (the end of its output named).
    """
    root = Path(root)
    source = root / "llama.cpp"
    build = root / "build"
    stamp = root / "qwen35-bench-build.txt"
    wanted = "\n".join((LLAMA_CPP_PYTHON_PIN, *CMAKE_FLAGS, *TOOLS)) + "\n"
    found = LlamaCpp(source, build / "bin")
    if stamp.is_file() and stamp.read_text() == wanted and all((found.bin / t).is_file() for t in TOOLS):
        return found
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake (Debian: apt-get install cmake)")
    root.mkdir(parents=True, exist_ok=True)
    log(f"[bench] building llama.cpp from {LLAMA_CPP_PYTHON_PIN}'s source distribution (once) ...")
    download = root / "sdist"
    shutil.rmtree(download, ignore_errors=True)
    run_tool(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        + [LLAMA_CPP_PYTHON_PIN, "-d", str(download)],
        f"pip download {LLAMA_CPP_PYTHON_PIN}",
    )
    (archive,) = download.glob("*.tar.gz")
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(source, members=[m for m in members if m.name], filter="data")
    run_tool(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "cmake (llama.cpp configure)")
    run_tool(
        ["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(os.cpu_count() or 1)],
        "cmake --build (llama.cpp)",
    )
    stamp.write_text(wanted)
    return found


def ensure_converter_venv(venv: Path, llama: LlamaCpp, log=print) -> Path:
    """Create (once) the converter's virtual environment at ``venv`` (:data:`CONVERTER_PINS`, then
    the vendored gguf-py); returns its python. A stamp file holding the pins marks it finished."""
    python = Path(venv) / "bin" / "python"
    stamp = Path(venv) / "qwen35-bench-pins.txt"
    wanted = "\n".join((*CONVERTER_PINS, LLAMA_CPP_PYTHON_PIN)) + "\n"
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    log(f"[bench] creating llama.cpp's converter environment {venv} (once) ...")
    run_tool([sys.executable, "-m", "venv", "--clear", str(venv)], "python -m venv")
    run_tool([str(python), "-m", "pip", "install", "--quiet", *CONVERTER_PINS], "pip install (converter environment)")
    run_tool([str(python), "-m", "pip", "install", "--quiet", str(llama.source / "gguf-py")], "pip install gguf-py")
    stamp.write_text(wanted)
    return python


# ---- GGUF files ----------------------------------------------------------------------------
def convert(python: Path, llama: LlamaCpp, checkpoint: Path, out_dir: Path, log=print) -> tuple[Path, Path]:
    """The checkpoint as GGUF (once; cached in ``out_dir``): ``(model-BF16.gguf, mmproj-F16.gguf)``,
    through :mod:`.llamacpp_convert` (``--no-mtp`` when the checkpoint has no ``mtp.*`` tensors).

    Raises:
        RuntimeError: the converter failed, e.g. a pre-tokenizer that is not Qwen3.5's (named).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).resolve().with_name("llamacpp_convert.py")
    outputs = {"model-BF16.gguf": ("bf16", False), "mmproj-F16.gguf": ("f16", True)}
    for name, (outtype, mmproj) in outputs.items():
        target = out_dir / name
        if target.is_file():
            continue
        log(f"[bench] convert_hf_to_gguf.py --outtype {outtype}{' --mmproj' if mmproj else ''} ...")
        partial = out_dir / f"partial-{name}"
        spec = {
            "source": str(llama.source),
            "checkpoint": str(checkpoint),
            "outfile": str(partial),
            "outtype": outtype,
            "mmproj": mmproj,
            "no_mtp": not has_mtp_weights(checkpoint),
        }
        run_tool([str(python), "-P", str(script)], "llama.cpp's convert_hf_to_gguf.py", input=json.dumps(spec))
        written = partial if partial.is_file() else out_dir / f"mmproj-{partial.name}"  # --mmproj prefixes
        written.rename(target)
    return out_dir / "model-BF16.gguf", out_dir / "mmproj-F16.gguf"


def gguf_for(row: str, llama: LlamaCpp, bf16: Path, log=print) -> Path:
    """The GGUF file of ``row`` (:data:`LLAMACPP_ROWS`), quantized from ``bf16`` once."""
    qtype, options = LLAMACPP_ROWS[row]
    if qtype == "BF16":
        return bf16
    target = bf16.with_name(f"model-{qtype}{'-pure' if '--pure' in options else ''}.gguf")
    if not target.is_file():
        log(f"[bench] llama-quantize {' '.join(options)} {qtype} ...")
        partial = target.with_name("partial-" + target.name)
        run_tool([llama.tool("llama-quantize"), *options, str(bf16), str(partial), qtype], f"llama-quantize {qtype}")
        partial.rename(target)
    return target


def check_tokenizer(llama: LlamaCpp, model: Path, checkpoint: Path, text: str = TOKENIZER_SAMPLE) -> int:
    """Compare llama.cpp's token ids for ``text`` (``llama-tokenize``) with transformers' tokenizer
    of the checkpoint; returns the token count.

    Raises:
        RuntimeError: the ids differ (the first differing position and both ids named).
    """
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(str(checkpoint))(text, add_special_tokens=False)["input_ids"]
    done = run_tool(
        [llama.tool("llama-tokenize"), "-m", str(model), "--stdin", "--ids", "--no-bos", "--log-disable"],
        "llama-tokenize",
        input=text,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise RuntimeError(
            f"llama.cpp tokenizes {model.name} differently from transformers at token {at}: "
            f"{got[at : at + 5]} vs {expected[at : at + 5]} ({len(got)} vs {len(expected)} tokens)"
        )
    return len(got)


# ---- measuring -----------------------------------------------------------------------------
def _llama_bench(llama: LlamaCpp, model: Path, threads: int, args: list[str]) -> tuple[list[dict], int]:
    """``llama-bench -o json`` with ``args``: its tests and the process's peak resident bytes."""
    out, _, peak = _run_measured(
        [llama.tool("llama-bench"), "-m", str(model), "-t", str(threads), "-o", "json", *args], "llama-bench"
    )
    return json.loads(out), peak


def bench_llamacpp(
    name: str, llama: LlamaCpp, model: Path, lengths, protocol: Protocol, threads: int | None = None
) -> PeerResult:
    """Measure ``model`` with ``llama-bench`` at ``lengths`` (tokens) as the module docstring says."""
    threads = threads or os.cpu_count() or 1
    result = PeerResult(name, decode_bytes=None)
    peaks = []
    lengths = sorted(lengths)
    tests, peak = _llama_bench(
        llama, model, threads, ["-p", ",".join(map(str, lengths)), "-n", "0", "-r", str(protocol.prefill_runs)]
    )
    peaks.append(peak)
    for t in tests:
        result.prefill_ms[int(t["n_prompt"])] = statistics.median(t["samples_ns"]) / 1e6
    steps = protocol.decode_runs
    tests, peak = _llama_bench(
        llama, model, threads, ["-p", "0", "-n", str(steps), "-d", ",".join(map(str, lengths)), "-r", "3"]
    )
    peaks.append(peak)
    for t in tests:
        result.decode_ms[int(t["n_depth"])] = statistics.median(t["samples_ns"]) / 1e6 / int(t["n_gen"])
    tests, peak = _llama_bench(llama, model, threads, ["-pg", f"{E2E_PROMPT},{protocol.e2e_tokens}", "-r", "1"])
    peaks.append(peak)
    result.e2e_tokens_per_s = protocol.e2e_tokens / (statistics.median(tests[-1]["samples_ns"]) / 1e9)
    result.peak_rss_bytes = max(peaks)
    result.decode_bytes = model.stat().st_size
    return result


_IMAGE_TOKENS = re.compile(r"decoding image batch \d+/\d+, n_tokens_batch = (\d+)")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def image_ttft(
    llama: LlamaCpp,
    model: Path,
    mmproj: Path,
    image: Path,
    question: str,
    max_image_tokens: int,
    runs: int = 3,
    threads: int | None = None,
    context: int = 2048,
) -> dict:
    """Time to first token (ms) of ``question`` about ``image`` through ``llama-mtmd-cli`` (its chat
    template, greedy, one generated token, ``--image-max-tokens`` as this project's budget): its
    ``prompt eval time`` (``--perf``, printed at log verbosity 4), which holds the vision encoder's
    run and the prompt's evaluation, image tokens included (checked against the log's timestamps:
    from "encoding mtmd batch" to the end of the prompt), median of ``runs`` processes after one
    warm-up process (model loading is not in it); ``context``: its context size in tokens (its
    default is the model's 262,144 positions, whose cache alone would dominate the memory). Returns
    ``{"ttft_ms", "prompt_tokens", "image_tokens", "peak_rss_bytes"}``.

    Raises:
        RuntimeError: llama-mtmd-cli failed or printed none of its timings.
    """
    threads = threads or os.cpu_count() or 1
    cmd = [llama.tool("llama-mtmd-cli"), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image)]
    cmd += ["-p", question, "-n", "1", "--temp", "0", "-t", str(threads), "-c", str(context)]
    cmd += ["--image-max-tokens", str(max_image_tokens), "--no-warmup", "--perf", "-lv", "4"]
    samples, tokens, image_tokens, peak = [], 0, 0, 0
    for i in range(runs + 1):
        out, err, used = _run_measured(cmd, "llama-mtmd-cli")
        log = out + err
        evaluated, image_runs = _PROMPT_EVAL.search(log), _IMAGE_TOKENS.findall(log)
        if not evaluated or not image_runs:
            raise RuntimeError(f"llama-mtmd-cli printed no image or prompt timings: {log.strip()[-500:]}")
        if i:  # the first run warms the page cache and the CPU
            samples.append(float(evaluated.group(1)))
        tokens = int(evaluated.group(2))
        image_tokens = sum(map(int, image_runs))
        peak = max(peak, used)
    return {
        "ttft_ms": statistics.median(samples),
        "prompt_tokens": tokens,
        "image_tokens": image_tokens,
        "peak_rss_bytes": peak,
    }


# ---- the bench's rows ----------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaCppPeer:
    """What every llama.cpp row of one preset uses: the build, the BF16 GGUF and the vision tower's."""

    llama: LlamaCpp
    bf16: Path
    mmproj: Path


def prepare_llamacpp(checkpoint: Path, work_dir: Path, log=print) -> LlamaCppPeer:
    """Build llama.cpp and its converter environment in ``work_dir``'s parent, convert the checkpoint
    into ``work_dir/llama.cpp`` and check the tokenizer (each step once; see the module docstring).

    Raises:
        RuntimeError: a step failed (named, with the end of its output).
    """
    llama = ensure_llamacpp(Path(work_dir).parent / ".llama.cpp", log)
    python = ensure_converter_venv(Path(work_dir).parent / ".venv-llamacpp", llama, log)
    bf16, mmproj = convert(python, llama, checkpoint, Path(work_dir) / "llama.cpp", log)
    check_tokenizer(llama, bf16, checkpoint)
    return LlamaCppPeer(llama, bf16, mmproj)


def bench_llamacpp_row(
    row: str, peer: LlamaCppPeer, lengths, protocol: Protocol, image: dict | None = None, log=print
) -> PeerResult:
    """One row of :data:`LLAMACPP_ROWS`: :func:`bench_llamacpp` on its GGUF, and with ``image``
    (``{"path", "question", "max_image_tokens"}``) :func:`image_ttft` in ``result.image``."""
    model = gguf_for(row, peer.llama, peer.bf16, log)
    log(f"[bench] {row} ({model.name}, llama-bench)")
    result = bench_llamacpp(row, peer.llama, model, lengths, protocol)
    if image is not None:
        result.image = image_ttft(
            peer.llama,
            model,
            peer.mmproj,
            image["path"],
            image["question"],
            image["max_image_tokens"],
            protocol.prefill_runs,
        )
        result.peak_rss_bytes = max(result.peak_rss_bytes or 0, result.image.pop("peak_rss_bytes"))
    return result
