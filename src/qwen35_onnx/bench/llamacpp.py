"""llama.cpp and ik_llama.cpp as bench peers: each built once from a source distribution on PyPI
that vendors it (``llama-cpp-python``: llama.cpp, its checkpoint converter and gguf-py;
``ik-llama-cpp-python``: ik_llama.cpp, the CPU-tuned fork), the checkpoint converted to GGUF by
mainline's converter in an environment of its own, quantized with ``llama-quantize``, measured with
each engine's ``llama-bench`` (text) and ``llama-mtmd-cli`` (an image prompt). One implementation
for both: an :class:`Engine` says what differs (the pin, CMake options, how its llama-bench times
decode at a depth, its log options); a :class:`GgufRow` says which engine runs which file how.

What is cached where (``root`` is the bench's work folder's parent, shared by every preset):

- ``root/.llama.cpp/``: the source distribution (:data:`LLAMA_CPP_PYTHON_PIN`), its vendored
  llama.cpp and the CMake build of :data:`TOOLS` (``-DGGML_NATIVE=ON``: the build machine's
  instruction set, AVX-512 / VNNI where present, less AMX, whose path in this llama.cpp crashes:
  see :data:`NO_AMX`), marked finished by a stamp holding the pin and the CMake flags;
- ``root/.ik_llama.cpp/``: the same for :data:`IK_LLAMA_CPP_PYTHON_PIN` (:data:`IK_CMAKE_FLAGS`,
  :data:`IK_TOOLS`), built only when an ik_llama.cpp row is measured;
- ``root/.venv-llamacpp/``: the converter's environment (:data:`CONVERTER_PINS` and the vendored
  gguf-py): the converter's own requirements pin a transformers too old for ``qwen3_5``;
- ``WORK_DIR/llama.cpp/``: the GGUF files of the preset: ``model-BF16.gguf`` (the converter's
  output), the quantized rows' files (:attr:`GgufRow.file_name`) and ``mmproj-F16.gguf`` (the
  vision tower).

The converter's tokenizer check and this project's answer to it: see :mod:`.llamacpp_convert`;
:func:`check_tokenizer` then compares each engine's token ids with transformers' on a sample text.

Protocol: the bench's lengths and thread count, one llama-bench process per figure and length
(:func:`bench_llamacpp`). Prefill: ``llama-bench -p N -n 0``, median of the protocol's prefill runs
after llama-bench's own warm-up; decode at context ``N``: D generated tokens after N prefilled ones
(``D`` = the protocol's decode steps; :meth:`Engine.decode_args`), each repetition's time / ``D``,
median of 3 repetitions; end to end: ``-pg 32,128``'s tokens / time (its prompt included, as this
project's row includes its prefill). llama-bench sizes each context to its test (prompt + depth +
generated tokens), so no ``-c`` is needed at any length. Peak memory: ``ru_maxrss`` of the processes
(``os.wait4``): per length the larger of its prefill and decode processes, per row the largest.
Times are milliseconds.
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
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import has_mtp_weights
from .protocol import LONG_PROMPT, PeerResult, Protocol, run_tool, tool_failure

__all__ = [
    "ENGINES",
    "IK_LLAMA_CPP",
    "LLAMACPP_ROWS",
    "LLAMA_CPP",
    "Engine",
    "GgufRow",
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
IK_LLAMA_CPP_PYTHON_PIN = "ik-llama-cpp-python==0.1.5"
"""The source distribution that vendors the ik_llama.cpp measured (ikawrakow's CPU-tuned fork of
llama.cpp: its own GEMM/GEMV kernels, run-time repacked quant layouts, its IQ*_K quant types)."""
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
IK_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native, as the llama.cpp build (ik_llama.cpp has no AMX path to leave out)
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # its tools (llama-bench, llama-quantize, llama-mtmd-cli) are examples
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DGGML_IQK_FA_ALL_QUANTS=OFF",  # flash attention over q4_0 / q4_1 / iq4_nl KV caches: not measured
)
"""ik_llama.cpp's CMake options (its defaults otherwise: ``GGML_IQK_MUL_MAT`` and
``GGML_IQK_FLASH_ATTENTION`` on, OpenMP on). ``GGML_IQK_FA_ALL_QUANTS`` (on by default) compiles its
flash attention for every quantized KV cache type and is most of the build's time; off, the f16, bf16,
q8_0 and q6_0 caches remain (the bench's KV cache is llama-bench's default f16)."""
IK_TOOLS = ("llama-bench", "llama-quantize", "llama-mtmd-cli", "llama-tokenize")
IK_BUILD_INFO = (
    "common/build-info.cpp",
    "int LLAMA_BUILD_NUMBER = 0;\n"
    f'char const *LLAMA_COMMIT = "{IK_LLAMA_CPP_PYTHON_PIN}";\n'
    'char const *LLAMA_COMPILER = "";\n'
    'char const *LLAMA_BUILD_TARGET = "";\n',
)
"""The file that ik_llama.cpp's build generates with ``common/cmake/build-info-gen-cpp.cmake``, a
script its source distribution leaves out (the build then stops at ``build_info``): written before
the build, newer than its template, so the build uses it. Its version fields name the pin."""


@dataclass(frozen=True)
class Engine:
    """One engine of the llama.cpp family, built from a source distribution on PyPI that vendors it.

    ``pin`` the distribution, ``vendor`` the engine's folder inside it, ``cache`` the build's folder
    name next to the bench's work folders, ``cmake_flags`` and ``tools`` (CMake targets) what is
    built. ``depth_option``: how its ``llama-bench`` times decode after a context of N tokens
    (:meth:`decode_args`). ``mtmd_log``: the ``llama-mtmd-cli`` log options: its timings printed,
    nothing written to files (mainline prints them with ``--perf`` at log verbosity 4; ik_llama.cpp
    always does, and ``--log-disable`` keeps its trace log out of the working folder).
    """

    name: str
    pin: str
    vendor: str
    cache: str
    cmake_flags: tuple[str, ...]
    tools: tuple[str, ...]
    depth_option: str
    mtmd_log: tuple[str, ...]
    written: tuple[tuple[str, str], ...] = ()

    def decode_args(self, depth: int, steps: int) -> list[str]:
        """``llama-bench`` options of one test that times ``steps`` generated tokens after a context
        of ``depth`` tokens (prefilled untimed): mainline's ``-p 0 -n STEPS -d DEPTH`` (its n_ctx is
        depth + steps), ik_llama.cpp's ``-p 0 -n 0 -gp DEPTH,STEPS`` (no ``-d`` there; n_ctx likewise)."""
        if self.depth_option == "-d":
            return ["-p", "0", "-n", str(steps), "-d", str(depth)]
        return ["-p", "0", "-n", "0", "-gp", f"{depth},{steps}"]

    def depth_of(self, test: dict) -> int:
        """The context (tokens) before the timed tokens of a :meth:`decode_args` test in
        ``llama-bench -o json``'s output: ``n_depth`` (mainline) or ``n_prompt`` (ik_llama.cpp's ``-gp``)."""
        return int(test["n_depth"] if self.depth_option == "-d" else test["n_prompt"])


LLAMA_CPP = Engine(
    name="llama.cpp",
    pin=LLAMA_CPP_PYTHON_PIN,
    vendor="vendor/llama.cpp",
    cache=".llama.cpp",
    cmake_flags=CMAKE_FLAGS,
    tools=TOOLS,
    depth_option="-d",
    mtmd_log=("--perf", "-lv", "4"),
)
IK_LLAMA_CPP = Engine(
    name="ik_llama.cpp",
    pin=IK_LLAMA_CPP_PYTHON_PIN,
    vendor="vendor/ik_llama.cpp",
    cache=".ik_llama.cpp",
    cmake_flags=IK_CMAKE_FLAGS,
    tools=IK_TOOLS,
    depth_option="-gp",
    mtmd_log=("--log-disable",),  # it prints its timings anyway; without it, it writes ./llama.log
    written=(IK_BUILD_INFO,),
)
ENGINES = {e.name: e for e in (LLAMA_CPP, IK_LLAMA_CPP)}
CONVERTER_PINS = (
    "torch==2.13.0",  # the CPU build (a local wheel here); an unpinned torch pulls a multi-GB CUDA build
    "transformers==5.24.*",  # the first line with qwen3_5 is 5.2; the project's tests run 5.24
    "numpy>=2.2.6",
    "sentencepiece>=0.1.98,<0.3",
    "safetensors>=0.4",
    "protobuf>=4.21",
)


@dataclass(frozen=True)
class GgufRow:
    """A bench row of the llama.cpp family: ``engine`` runs the checkpoint as ``qtype``
    (``llama-quantize``'s type name; BF16: the converter's own file) quantized with ``quantize``
    options by ``quantizer``'s ``llama-quantize`` (None: the engine's own). ``repack``: ik_llama.cpp's
    run-time repacking (``-rtr``: at load, every tensor whose type has a row-interleaved variant,
    Q4_0 -> Q4_0_R8, IQ4_KS -> IQ4_KS_R4, ...)."""

    engine: Engine
    qtype: str
    quantize: tuple[str, ...] = ()
    repack: bool = False
    quantizer: Engine | None = None

    @property
    def maker(self) -> Engine:
        """The engine whose ``llama-quantize`` writes the row's file."""
        return self.quantizer or self.engine

    @property
    def file_name(self) -> str:
        """The row's GGUF file name, e.g. ``model-Q4_0-pure.gguf`` (mainline's quantizer) or
        ``model-IQ4_KS-pure-ik_llama.cpp.gguf``: rows that quantize alike share their file."""
        if self.qtype == "BF16":
            return "model-BF16.gguf"
        tag = "" if self.maker is LLAMA_CPP else f"-{self.maker.name}"
        return f"model-{self.qtype}{'-pure' if '--pure' in self.quantize else ''}{tag}.gguf"

    def bench_options(self) -> list[str]:
        """Options of the row for ``llama-bench`` (``-rtr 1`` takes a value there)."""
        return ["-rtr", "1"] if self.repack else []

    def cli_options(self) -> list[str]:
        """Options of the row for the engine's other tools (``-rtr`` is a flag there)."""
        return ["-rtr"] if self.repack else []


#: Row name -> its engine, file and run-time options.
LLAMACPP_ROWS = {
    "llama.cpp Q4_0": GgufRow(LLAMA_CPP, "Q4_0"),  # llama-quantize's default mix: the output layer Q6_K
    "llama.cpp Q4_0 pure": GgufRow(LLAMA_CPP, "Q4_0", ("--pure",)),  # every tensor Q4_0, as this project's int4
    "llama.cpp Q8_0": GgufRow(LLAMA_CPP, "Q8_0"),
    "llama.cpp BF16": GgufRow(LLAMA_CPP, "BF16"),
    # the llama.cpp Q4_0 pure row's own file, repacked at load into ik_llama.cpp's Q4_0_R8
    "ik_llama.cpp Q4_0 pure": GgufRow(IK_LLAMA_CPP, "Q4_0", ("--pure",), repack=True, quantizer=LLAMA_CPP),
    # ik_llama.cpp's own 4-bit type (4.25 bits a weight), every tensor, as stored: see IK_RECOMMENDED
    "ik_llama.cpp IQ4_KS pure": GgufRow(IK_LLAMA_CPP, "IQ4_KS", ("--pure",)),
    # the same file repacked at load into IQ4_KS_R4 (tensors with a row size not a multiple of 256
    # fall back to IQ4_NL: repacked, ik_llama.cpp's kernel then asserts on those with 4 mod 8 rows,
    # as in the tiny preset)
    "ik_llama.cpp IQ4_KS pure rtr": GgufRow(IK_LLAMA_CPP, "IQ4_KS", ("--pure",), repack=True),
}
IK_RECOMMENDED = "ik_llama.cpp IQ4_KS pure"
"""ik_llama.cpp's 4-bit row: IQ4_KS, its own non-linear 4-bit type (4.25 bits a weight: fewer bytes
per decode step than Q4_0's 4.5; ik_llama.cpp PR 83), with Zen4 / AVX-512 prefill kernels (PR 428),
every tensor (``--pure``, as this project's int4). Not repacked: its author's advice for CPUs with
AVX-512 VNNI is the plain layouts (ik_llama.cpp issue 2445, 2026-09); ``... rtr`` measures the
repacked IQ4_KS_R4 beside it. Chosen over IQ4_XS (the same bits, mainline's type) as the fork's own;
this 2-core machine was too loaded on 2026-12-07 for llama-bench to rank the two."""
E2E_PROMPT = 32
TOKENIZER_SAMPLE = (
    "Qwen3.5 reads text, code and pictures: def f(x):\n    return x ** 2  # 3.14159\n"
    "  Zwei  Leerzeichen, 中文的句子，日本語も。 🦙🚀 It's 100% done!!! 'RE \t tabs\r\n"
)


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build of ``engine``: ``source`` its vendored sources, ``bin`` its tools' folder."""

    source: Path
    bin: Path
    engine: Engine = LLAMA_CPP

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def _run_measured(cmd: list[str], what: str) -> tuple[str, str, int]:
    """Run ``cmd``: ``(stdout, stderr, peak resident bytes of that process)``, the peak its own, not
    the bench's (through :mod:`.child_peak`: why, there); RuntimeError as :func:`~.protocol.run_tool`.

    Raises:
        FileNotFoundError: ``cmd[0]`` is not a file.
    """
    if not Path(cmd[0]).is_file():
        raise FileNotFoundError(f"{what}: no program {cmd[0]}")
    script = Path(__file__).resolve().with_name("child_peak.py")
    with tempfile.TemporaryDirectory() as tmp:  # stderr a file: a full stderr pipe cannot block the child
        peak_file, err_file = Path(tmp) / "peak", Path(tmp) / "stderr"
        with open(err_file, "wb") as stderr:
            done = subprocess.run(
                [sys.executable, "-I", "-S", str(script), str(peak_file), *cmd], stdout=subprocess.PIPE, stderr=stderr
            )
        out, err = done.stdout.decode(errors="replace"), err_file.read_bytes().decode(errors="replace")
        peak = int(peak_file.read_text() or 0) * 1024 if peak_file.is_file() else 0
    if done.returncode:
        raise RuntimeError(tool_failure(what, done.returncode, err or out))
    return out, err, peak


# ---- build ---------------------------------------------------------------------------------
def ensure_llamacpp(root: Path, log=print, engine: Engine = LLAMA_CPP) -> LlamaCpp:
    """Download (once) ``engine``'s source distribution (:attr:`Engine.pin`) into ``root``, unpack its
    vendored engine and build its :attr:`Engine.tools` with CMake (:attr:`Engine.cmake_flags`, all
    cores). A stamp file holding the pin, flags and tools marks a finished build.

    Raises:
        RuntimeError: pip, CMake or the compiler failed (the end of its output named).
    """
    root = Path(root)
    source = root / engine.vendor.rsplit("/", 1)[-1]
    build = root / "build"
    stamp = root / "qwen35-bench-build.txt"
    wanted = "\n".join((engine.pin, *engine.cmake_flags, *engine.tools, *(t for w in engine.written for t in w))) + "\n"
    found = LlamaCpp(source, build / "bin", engine)
    if stamp.is_file() and stamp.read_text() == wanted and all((found.bin / t).is_file() for t in engine.tools):
        return found
    if shutil.which("cmake") is None:
        raise RuntimeError(f"building {engine.name} needs cmake (Debian: apt-get install cmake)")
    root.mkdir(parents=True, exist_ok=True)
    log(f"[bench] building {engine.name} from {engine.pin}'s source distribution (once) ...")
    download = root / "sdist"
    shutil.rmtree(download, ignore_errors=True)
    run_tool(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        + [engine.pin, "-d", str(download)],
        f"pip download {engine.pin}",
    )
    (archive,) = download.glob("*.tar.gz")
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/{engine.vendor}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(source, members=[m for m in members if m.name], filter="data")
    for path, text in engine.written:
        (source / path).write_text(text)
    run_tool(["cmake", "-S", str(source), "-B", str(build), *engine.cmake_flags], f"cmake ({engine.name} configure)")
    run_tool(
        ["cmake", "--build", str(build), "--target", *engine.tools, "-j", str(os.cpu_count() or 1)],
        f"cmake --build ({engine.name})",
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
    """The GGUF file of ``row`` (:data:`LLAMACPP_ROWS`) next to ``bf16``, quantized from it once by
    ``llama``'s ``llama-quantize`` (the build of the row's :attr:`GgufRow.maker`).

    Raises:
        ValueError: ``llama`` is another engine's build than the row's quantizer.
    """
    spec = LLAMACPP_ROWS[row]
    if spec.qtype == "BF16":
        return bf16
    if llama.engine is not spec.maker:
        raise ValueError(
            f"{row}: its file is quantized by {spec.maker.name}'s llama-quantize, not {llama.engine.name}'s"
        )
    target = bf16.with_name(spec.file_name)
    if not target.is_file():
        log(f"[bench] {spec.maker.name} llama-quantize {' '.join(spec.quantize)} {spec.qtype} ...")
        partial = target.with_name("partial-" + target.name)
        run_tool(
            [llama.tool("llama-quantize"), *spec.quantize, str(bf16), str(partial), spec.qtype],
            f"{spec.maker.name} llama-quantize {spec.qtype}",
        )
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


def _one_test(tests: list[dict], what: str) -> dict:
    """The one test of a ``llama-bench`` run (RuntimeError naming ``what`` otherwise)."""
    if len(tests) != 1:
        raise RuntimeError(f"llama-bench {what}: {len(tests)} tests in its output, expected 1")
    return tests[0]


def bench_llamacpp(
    name: str,
    llama: LlamaCpp,
    model: Path,
    lengths,
    protocol: Protocol,
    threads: int | None = None,
    options: list[str] | tuple[str, ...] = (),
) -> PeerResult:
    """Measure ``model`` with ``llama``'s ``llama-bench`` (``options`` added to each run, e.g. ``-rtr 1``)
    at each of ``lengths`` (tokens), one process per figure and length, so that each length has its
    own peak memory (``peak_rss_by_length``: the larger of its prefill and decode processes, each
    with a context of just that length, as llama-bench sizes it):

    - prefill ``N``: ``-p N -n 0 -r R`` (R: the protocol's prefill runs), the median sample;
    - decode at context ``N``: :meth:`Engine.decode_args` with ``D`` = the protocol's decode steps,
      ``-r 3``: each repetition's time / ``D``, median;
    - end to end: ``-p 0 -n 0 -pg 32,E``'s tokens / time (E: the protocol's end-to-end tokens; its
      prompt included, as this project's row includes its prefill).

    ``peak_rss_bytes``: the largest of every process's. Times in ms.

    Raises:
        RuntimeError: llama-bench failed (named, with the end of its output) or gave other tests.
    """
    threads = threads or os.cpu_count() or 1
    options = list(options)
    result = PeerResult(name, decode_bytes=None)
    steps = protocol.decode_runs
    for n in sorted(lengths):
        tests, prefill_peak = _llama_bench(
            llama, model, threads, ["-p", str(n), "-n", "0", "-r", str(protocol.prefill_at(n)[1]), *options]
        )
        test = _one_test(tests, f"-p {n}")
        if int(test["n_prompt"]) != n:
            raise RuntimeError(f"llama-bench -p {n}: it reports a prompt of {test['n_prompt']} tokens")
        result.prefill_ms[n] = statistics.median(test["samples_ns"]) / 1e6
        tests, decode_peak = _llama_bench(
            llama,
            model,
            threads,
            [*llama.engine.decode_args(n, steps), "-r", "3" if n <= LONG_PROMPT else "1", *options],
        )
        test = _one_test(tests, f"decode at {n}")
        if llama.engine.depth_of(test) != n:
            raise RuntimeError(
                f"llama-bench decode at {n}: it reports a context of {llama.engine.depth_of(test)} tokens"
            )
        result.decode_ms[n] = statistics.median(test["samples_ns"]) / 1e6 / int(test["n_gen"])
        result.peak_rss_by_length[n] = max(prefill_peak, decode_peak)
    tests, peak = _llama_bench(
        llama, model, threads, ["-p", "0", "-n", "0", "-pg", f"{E2E_PROMPT},{protocol.e2e_tokens}", "-r", "1", *options]
    )
    result.e2e_tokens_per_s = protocol.e2e_tokens / (statistics.median(_one_test(tests, "-pg")["samples_ns"]) / 1e9)
    result.peak_rss_bytes = max(peak, *result.peak_rss_by_length.values())
    result.decode_bytes = model.stat().st_size
    return result


MTMD_TRIES = 3
"""Runs of one ``llama-mtmd-cli`` measurement until its log holds the timings: mainline's writes its
log from a thread that sometimes loses the last lines at exit, the timings among them (1 in 6 runs
on the tiny preset, 2026-12-07)."""
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
    options: list[str] | tuple[str, ...] = (),
) -> dict:
    """Time to first token (ms) of ``question`` about ``image`` through ``llama-mtmd-cli`` (its chat
    template, greedy, one generated token, ``--image-max-tokens`` as this project's budget): its
    ``prompt eval time`` (mainline: ``--perf``, printed at log verbosity 4), which holds the vision
    encoder's run and the prompt's evaluation, image tokens included (checked against the log's
    timestamps: from "encoding mtmd batch" to the end of the prompt; ik_llama.cpp's likewise: it
    exceeds its "image slice encoded in" plus "image decoded in" times), median of ``runs``
    processes after one warm-up process (model loading is not in it). A process whose log lacks the
    timings runs again, up to :data:`MTMD_TRIES` times; ``context``: its context size in tokens (its
    default is the model's 262,144 positions, whose cache alone would dominate the memory). Returns
    ``{"ttft_ms", "prompt_tokens", "image_tokens", "peak_rss_bytes"}``. ``options``: added to its
    command line (e.g. ``-rtr``); the log options are the engine's (:attr:`Engine.mtmd_log`).

    Raises:
        RuntimeError: llama-mtmd-cli failed or printed none of its timings.
    """
    threads = threads or os.cpu_count() or 1
    cmd = [llama.tool("llama-mtmd-cli"), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image)]
    cmd += ["-p", question, "-n", "1", "--temp", "0", "-t", str(threads), "-c", str(context)]
    cmd += ["--image-max-tokens", str(max_image_tokens), "--no-warmup", *llama.engine.mtmd_log, *options]
    samples, tokens, image_tokens, peak = [], 0, 0, 0
    for i in range(runs + 1):
        for _ in range(MTMD_TRIES):
            out, err, used = _run_measured(cmd, "llama-mtmd-cli")
            peak = max(peak, used)
            log = out + err
            evaluated, image_runs = _PROMPT_EVAL.search(log), _IMAGE_TOKENS.findall(log)
            if evaluated and image_runs:
                break
        else:
            raise RuntimeError(
                f"llama-mtmd-cli printed no image or prompt timings in {MTMD_TRIES} runs: {log.strip()[-500:]}"
            )
        if i:  # the first run warms the page cache and the CPU
            samples.append(float(evaluated.group(1)))
        tokens = int(evaluated.group(2))
        image_tokens = sum(map(int, image_runs))
    return {
        "ttft_ms": statistics.median(samples),
        "prompt_tokens": tokens,
        "image_tokens": image_tokens,
        "peak_rss_bytes": peak,
    }


# ---- the bench's rows ----------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaCppPeer:
    """What every llama.cpp-family row of one preset uses: ``llama`` mainline's build (its converter
    wrote the files), the BF16 GGUF, the vision tower's and ``builds``, engine name -> build."""

    llama: LlamaCpp
    bf16: Path
    mmproj: Path
    builds: dict[str, LlamaCpp] = field(default_factory=dict)

    def build(self, engine: Engine) -> LlamaCpp:
        """``engine``'s build (mainline's is :attr:`llama`).

        Raises:
            RuntimeError: ``engine`` was not prepared (:func:`prepare_llamacpp`'s ``engines``).
        """
        if engine is LLAMA_CPP:
            return self.llama
        if engine.name not in self.builds:
            raise RuntimeError(f"{engine.name} was not built for this bench (prepare_llamacpp(engines=...))")
        return self.builds[engine.name]


def prepare_llamacpp(checkpoint: Path, work_dir: Path, log=print, engines=(LLAMA_CPP,)) -> LlamaCppPeer:
    """Build llama.cpp and its converter environment in ``work_dir``'s parent, convert the checkpoint
    into ``work_dir/llama.cpp`` and check the tokenizer; then build each other engine of ``engines``
    there too (:attr:`Engine.cache`) and check that it reads the converter's file and tokenizes as
    transformers (:func:`check_tokenizer`: ik_llama.cpp's own converter has no Qwen3.5, so its rows
    run mainline's GGUF files). Each step once; see the module docstring.

    Raises:
        RuntimeError: a step failed (named, with the end of its output).
    """
    root = Path(work_dir).parent
    llama = ensure_llamacpp(root / LLAMA_CPP.cache, log)
    python = ensure_converter_venv(root / ".venv-llamacpp", llama, log)
    bf16, mmproj = convert(python, llama, checkpoint, Path(work_dir) / "llama.cpp", log)
    check_tokenizer(llama, bf16, checkpoint)
    builds = {}
    for engine in engines:
        if engine is not LLAMA_CPP and engine.name not in builds:
            builds[engine.name] = ensure_llamacpp(root / engine.cache, log, engine)
            check_tokenizer(builds[engine.name], bf16, checkpoint)
    return LlamaCppPeer(llama, bf16, mmproj, builds)


def bench_llamacpp_row(
    row: str, peer: LlamaCppPeer, lengths, protocol: Protocol, image: dict | None = None, log=print
) -> PeerResult:
    """One row of :data:`LLAMACPP_ROWS`: :func:`bench_llamacpp` on its GGUF with its engine and
    options, and with ``image`` (``{"path", "question", "max_image_tokens"}``) :func:`image_ttft` in
    ``result.image``.

    Raises:
        RuntimeError: a tool failed, or the row's engine was not prepared.
    """
    spec = LLAMACPP_ROWS[row]
    build = peer.build(spec.engine)
    model = gguf_for(row, peer.build(spec.maker), peer.bf16, log)
    log(f"[bench] {row} ({model.name}, {spec.engine.name}'s llama-bench {' '.join(spec.bench_options())})")
    result = bench_llamacpp(row, build, model, lengths, protocol, options=spec.bench_options())
    if image is not None:
        result.image = image_ttft(
            build,
            model,
            peer.mmproj,
            image["path"],
            image["question"],
            image["max_image_tokens"],
            protocol.prefill_runs,
            options=spec.cli_options(),
        )
        result.peak_rss_bytes = max(result.peak_rss_bytes or 0, result.image.pop("peak_rss_bytes"))
    return result
