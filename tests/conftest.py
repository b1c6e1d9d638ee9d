"""Shared fixtures: the demo checkpoint and its exports, built once per test run.

Exports use a small capacity (CAPACITY tokens) so that the suite stays fast; everything
else is the real flow (`from_pretrained` on a local folder, `torch.onnx.export`, ORT).

The suite runs on several workers (``pytest -n 2``, pytest-xdist, each test file on one
worker): a session fixture that builds a checkpoint or an export builds it once for all of
them (:func:`build_once`: a folder every worker sees, under a file lock).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from .clips import CLIP_GRIDS

CAPACITY = 128
IMAGE_TOKENS = 64
"""Image-token budget of the test exports: the demo processor's minimum (65536 pixels), so that an
image prompt fits CAPACITY (the shipped 256 x 256 photo is exactly 16 x 16 patches, 64 tokens)."""
MAX_NEW_TOKENS = 40
PROMPT = "Describe this image."


@pytest.fixture(scope="session", autouse=True)
def prepacked_cache_dir(tmp_path_factory) -> Path:
    """ONNX Runtime's pre-packed weights caches of this session's exports go to a temporary folder
    (``QWEN35_ONNX_PREPACKED_CACHE``, inherited by subprocesses), not the user's cache."""
    import os

    folder = tmp_path_factory.mktemp("ort-prepacked")
    before = os.environ.get("QWEN35_ONNX_PREPACKED_CACHE")
    os.environ["QWEN35_ONNX_PREPACKED_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("QWEN35_ONNX_PREPACKED_CACHE", None)
    else:
        os.environ["QWEN35_ONNX_PREPACKED_CACHE"] = before


THREADS = "1"
"""Intra-op threads of every runtime session (``$QWEN35_ONNX_THREADS``) and of torch in each xdist
worker: two workers on two cores, one thread each, instead of four threads spinning for two cores."""


def pytest_configure(config) -> None:
    """With xdist: one thread per worker (:data:`THREADS`), set before the workers start (they
    inherit the environment) and in each worker for torch. OpenMP threads sleep when idle
    (``OMP_WAIT_POLICY=PASSIVE``, read when torch loads): the training of the test checkpoints runs 2
    torch threads (``tests/training.py``), and OpenMP's default spin-waiting between operations starves
    the other worker, and itself (measured, AMD EPYC 2 cores: 40 training steps alone 20 s; beside a
    busy core 42 s spinning, 27 s passive; two trainings at once 55 s each spinning, 25 s passive; the
    slot soak's ``serve`` beside a spinning training answered so late that its dropped-stream waits ran
    to their limit: 139 s instead of 17). The thread count, and so the numbers, are the same."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(int(THREADS))
    elif getattr(config.option, "numprocesses", None):
        os.environ.setdefault("QWEN35_ONNX_THREADS", THREADS)
    # the commands run in this process (typer's runner) keep a thread pool per session: ONNX Runtime's
    # process-wide shared pool would bind every later test's sessions to its size (the tests of the shared
    # pool run the command line and the server in processes of their own without this)
    os.environ["QWEN35_ONNX_THREAD_POOL"] = "session"


def shared_root(tmp_path_factory) -> Path:
    """A folder of this test run that every xdist worker sees (the run's base temporary folder,
    above the workers' own); the base temporary folder itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


def build_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """``shared_root / name``, made by ``build(path)`` by the first worker that asks for it; the
    others wait for it (a file lock) and use it. A build that failed leaves nothing, and the next
    worker tries again (and fails the same way, naming its own error)."""
    from filelock import FileLock

    root = shared_root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            _timeline("build-start", name)
            try:
                build(path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            finally:
                _timeline("build-end", name)
            done.touch()
    return path


def pytest_sessionfinish(session) -> None:
    """The controller (or a run without xdist) removes the shared builds (some GB of exports)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and session.testsfailed == 0:
        shutil.rmtree(shared_root(factory), ignore_errors=True)


#: What each of the first xdist workers builds when the run starts, in order, before its first test
#: (only what the run's tests use): the builds most test files wait for, on several workers at once
#: instead of one worker building while the others wait for its lock.
#: gw0 takes the first file of HEAVY_FIRST (the JSON model, trained further from the trained checkpoint),
#: gw1 the second (which needs neither).
PREBUILD = {"gw0": ("trained_checkpoint",), "gw1": ("fixed_export", "dynamic_export")}


#: Test files in the order the workers take them (``make test`` runs ``--dist loadfile
#: --no-loadscope-reorder``): the costliest first, measured in a full run's durations, so that the
#: cheap files fill the end of the run on whichever worker is free (xdist's own order, most tests
#: first, queued the costliest files last and the run ended on one of them). Files not listed
#: follow in their usual order.
HEAVY_FIRST = (
    "test_structured_output.py",
    "test_vision_grids.py",
    "test_portable_quantize.py",
    "test_dtypes.py",
    "test_server.py",
    "test_slots.py",
    "test_speculative.py",
    "test_openvino.py",
    "test_quantized_embedding.py",
    "test_requantize.py",
    "test_cluster.py",
    "test_api.py",
    "test_video.py",
    "test_chunked_prefill.py",
    "test_kv_tiers.py",
    "test_wide_parity.py",
    "test_export_contract.py",
    "test_export_memory.py",
    "test_wheel.py",
    "test_prepacked_cache.py",
    "test_chat.py",
    "test_cli.py",
    "test_shared_weights.py",
    "test_fused_and_quantized.py",
)


TIMELINE = os.environ.get("QWEN35_ONNX_TEST_TIMELINE")
"""A folder: each worker appends ``start|end TIME WORKER NODEID`` lines to ``WORKER.log`` there, and
``build-start|build-end TIME WORKER NAME`` around each :func:`build_once` build (where the run's time goes
per worker: idle ends, waits on another worker's build, the shared builds); unset: nothing."""


def _timeline(event: str, nodeid: str) -> None:
    if TIMELINE:
        import time

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(TIMELINE) / f"{worker}.log", "a") as log:
            log.write(f"{event} {time.time():.2f} {worker} {nodeid}\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _timeline("end", nodeid)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Order the files by :data:`HEAVY_FIRST` (a stable sort: the tests of a file keep their order)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def prebuild(request) -> None:
    """Build this worker's share of :data:`PREBUILD` (see there); nothing without xdist."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for wanted in PREBUILD.get(os.environ.get("PYTEST_XDIST_WORKER", ""), ()):
        name, *args = (wanted,) if isinstance(wanted, str) else wanted
        if name in used:
            value = request.getfixturevalue(name)
            if args:
                value(*args)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from qwen35_onnx.checkpoints import build_demo_checkpoint

    return build_once(tmp_path_factory, "checkpoint-demo", build_demo_checkpoint)


@pytest.fixture(scope="session")
def photo() -> Path:
    from qwen35_onnx.paths import photo_path

    return photo_path()


def export_to(checkpoint: Path, out: Path, **options) -> Path:
    """Export with capacity CAPACITY and IMAGE_TOKENS image tokens per image (unless ``options`` say
    otherwise) and ``options``; returns ``out``."""
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportOptions

    if "prefill_buckets" not in options and "prefill_chunks" not in options:
        options["prefill_chunks"] = ()  # prefill buckets, as these tests expect (tests/test_chunked_prefill.py: chunks)
    export(checkpoint, out, ExportOptions(**{"capacity": CAPACITY, "image_tokens": IMAGE_TOKENS, **options}))
    return out


@pytest.fixture(scope="session")
def wide_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The demo architecture widened to 214 MB of fp32 text weights (hidden 512, MLP 4096, tied
    embeddings as in the published Qwen3.5-0.8B): weights large enough to measure their memory."""
    import shutil

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    def build(folder: Path) -> None:
        shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("model*.safetensors*", "config.json"))
        config = Qwen3_5Config.from_pretrained(checkpoint)
        config.text_config.hidden_size = config.vision_config.out_hidden_size = 512
        config.text_config.intermediate_size = 4096
        config.text_config.initializer_range = 0.02
        config.text_config.tie_word_embeddings = config.tie_word_embeddings = True
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(folder)

    return build_once(tmp_path_factory, "checkpoint-wide", build)


def shared_export(tmp_path_factory, checkpoint: Path, name: str, **options) -> Path:
    """The export of ``checkpoint`` with capacity CAPACITY and ``options``, built once per run
    (:func:`build_once`)."""
    return build_once(tmp_path_factory, f"export-{name}", lambda out: export_to(checkpoint, out, **options))


def quantized_copy(tmp_path_factory, base: Path, name: str, **quantization) -> Path:
    """``qwen35-onnx quantize`` of the export ``base`` with ``quantization`` (the fields of
    :class:`qwen35_onnx.export.options.QuantizeOptions`), built once per run under ``name``: the export that
    ``export --quantize`` writes with ``base``'s other options, KV precision included (tests/test_requantize.py),
    in a fraction of a second instead of a trace."""
    from qwen35_onnx.export.options import QuantizeOptions
    from qwen35_onnx.export.requantize import quantize_export

    return build_once(tmp_path_factory, name, lambda out: quantize_export(base, out, QuantizeOptions(**quantization)))


@pytest.fixture(scope="session")
def tied_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The demo checkpoint with ``tie_word_embeddings`` (as the published Qwen3.5-0.8B): the lm_head is the
    embedding table."""
    import json

    def build(folder: Path) -> None:
        shutil.copytree(checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config))

    return build_once(tmp_path_factory, "checkpoint-tied", build)


TIED_OPTIONS = {"ops": "ort", "kv_dtype": "fp32", "prefill_buckets": (64,)}
"""Options of :func:`tied_export`."""


@pytest.fixture(scope="session")
def tied_export(tied_checkpoint, tmp_path_factory) -> Path:
    """The tied checkpoint's float export (:data:`TIED_OPTIONS`: ``--ops ort``, an fp32 KV cache, one 64-token prefill
    bucket), which the tied quantized exports are quantized copies of (:func:`quantized_copy`)."""
    return shared_export(tmp_path_factory, tied_checkpoint, "tied", **TIED_OPTIONS)


@pytest.fixture(scope="session")
def wide_int4_export(wide_checkpoint, tmp_path_factory) -> Path:
    """The wide checkpoint, ``--ops ort`` int4, buckets 32 / 64 / 128: quantized sessions large
    enough to measure their memory (43 MB of packed text weights each)."""
    return shared_export(
        tmp_path_factory, wide_checkpoint, "wide-int4", ops="ort", quantize="int4", prefill_buckets=(32, 64, 128)
    )


@pytest.fixture(scope="session")
def fixed_export(checkpoint, tmp_path_factory) -> Path:
    """Portable operators (the default --ops ort has its own fixture in test_fused_and_quantized)."""
    return shared_export(tmp_path_factory, checkpoint, "fixed", kv_mode="fixed", ops="portable")


PHOTO_GRID = (16, 16)
"""The shipped 256 x 256 photo's patch grid (64 tokens)."""


@pytest.fixture(scope="session")
def dynamic_export(checkpoint, tmp_path_factory) -> Path:
    """Dynamic KV (the cache grows each step; one dynamic-length prefill graph), ``--ops ort``: its tests
    read the decode graph's KV dimensions and run generations (half the export time of portable
    operators, whose prefill graphs take the longest to trace)."""
    return shared_export(tmp_path_factory, checkpoint, "dynamic", kv_mode="dynamic", ops="ort")


@pytest.fixture(scope="session")
def small_export(checkpoint, tmp_path_factory) -> Path:
    """Half the capacity of `fixed_export` (to mix graphs of different capacities)."""
    return shared_export(
        tmp_path_factory, checkpoint, "small", capacity=CAPACITY // 2, ops="portable", prefill_buckets=(32,)
    )


@pytest.fixture(scope="session")
def chat_export(checkpoint, tmp_path_factory):
    """Default operators (ort), fixed KV, room for two images per prompt (capacity 2 * CAPACITY:
    two images of IMAGE_TOKENS tokens each and their text)."""
    return shared_export(tmp_path_factory, checkpoint, "chat", max_images=2, capacity=2 * CAPACITY)


IMAGE_CAPACITY = 256
"""Capacity of the image exports (:func:`image_exports`): two images and their text."""
IMAGE_BUDGET = 96
"""Image-token budget of the image exports: above the processor's minimum (64 tokens), so that a tiny
image's upscaled grid (70 tokens) fits."""
PREFILL_CHUNKS = (8, 32)
"""Prefill chunk sizes of the chunked image exports (tests/test_chunked_prefill.py: prompts around
the larger one)."""


@pytest.fixture(scope="session")
def shapes(photo) -> dict:
    """Pictures made from the shipped photo: square, landscape 3:2, portrait 2:3, a 6:1 panorama and a
    40 x 30 thumbnail below min_pixels (upscaled by the processor)."""
    from PIL import Image

    base = Image.open(photo).convert("RGB")
    return {
        "square": base,
        "landscape": base.crop((0, 43, 256, 213)).resize((480, 320)),
        "portrait": base.crop((43, 0, 213, 256)).resize((320, 480)),
        "panorama": base.crop((0, 108, 256, 150)).resize((1200, 200)),
        "tiny": base.resize((40, 30)),
    }


def processor_grids(shapes) -> list[tuple[int, int]]:
    """The demo processor's patch grid of each of ``shapes`` at :data:`IMAGE_BUDGET` image tokens."""
    from qwen35_onnx.image_grids import processor_grid

    return [processor_grid(im.height, im.width, 16, 2, 65536, IMAGE_BUDGET * 32 * 32) for im in shapes.values()]


@pytest.fixture(scope="session")
def image_exports(checkpoint, tmp_path_factory, shapes):
    """``image_exports(kind) -> Path``: exports with capacity :data:`IMAGE_CAPACITY`, two images of up to
    :data:`IMAGE_BUDGET` tokens each, built once per run and shared by tests/test_vision_grids.py and
    tests/test_chunked_prefill.py (whose tests depend on the prefill form or on the vision graphs, not
    both):

    - ``"any-ort"``: ``--ops ort``, the any-grid vision graph, prefill chunks :data:`PREFILL_CHUNKS`;
    - ``"any-portable"``: portable operators, the any-grid vision graph, one prefill bucket of the
      capacity (every prompt of tests/test_vision_grids.py holds an image: 64 tokens or more);
    - ``"static"``: portable operators, static vision grids (the processor's grid of every one of
      :func:`shapes`, the photo's :data:`PHOTO_GRID` among them, the frame-pair grids of the test clips
      (``tests/clips.py``), plus 16 x 18, which none has; OpenVINO runs it), prefill chunks
      :data:`PREFILL_CHUNKS`."""
    forms = {
        "any-ort": {"ops": "ort", "prefill_chunks": PREFILL_CHUNKS},
        "any-portable": {"ops": "portable", "prefill_buckets": (IMAGE_CAPACITY,)},
        "static": {
            "ops": "portable",
            "vision_grids": tuple(sorted(set(processor_grids(shapes)) | {PHOTO_GRID, (16, 18)} | CLIP_GRIDS)),
            "prefill_chunks": PREFILL_CHUNKS,
        },
    }

    def get(kind: str) -> Path:
        return shared_export(
            tmp_path_factory,
            checkpoint,
            f"images-{kind}",
            capacity=IMAGE_CAPACITY,
            image_tokens=IMAGE_BUDGET,
            max_images=2,
            **forms[kind],
        )

    return get


@pytest.fixture(scope="session")
def bigram_export(checkpoint, tmp_path_factory) -> Path:
    """The bigram checkpoint's export (``tests/bigram.py``: ``--ops ort``, capacity 2048, two images,
    prefill buckets 32, 512 and 2048), built once per run: the server tests serve it, and
    test_export_contract compares the node counts of its 32- and 2048-token prefill graphs."""
    from .bigram import build_bigram_export

    return build_once(tmp_path_factory, "bigram", lambda folder: build_bigram_export(checkpoint, folder)) / "export"


def remember_generations(model):
    """``model`` (a transformers model) whose ``generate`` answers a call it has answered before from
    memory (a copy of the same output): greedy generation is deterministic, and several tests compare
    their runtimes' tokens with transformers' for the same inputs (the any-grid, static-grid and
    chunked exports, both ``--ops``). Keyword calls only, as :func:`qwen35_onnx.verify.reference_generate`
    makes them."""
    import hashlib

    import torch

    generate, seen = model.generate, {}

    def key(value):
        if isinstance(value, torch.Tensor):
            data = value.detach().contiguous().cpu().numpy().tobytes()
            return (tuple(value.shape), str(value.dtype), hashlib.sha256(data).hexdigest())
        return repr(value)

    def remembered(*args, **kwargs):
        if args:
            return generate(*args, **kwargs)
        k = tuple(sorted((name, key(value)) for name, value in kwargs.items()))
        if k not in seen:
            seen[k] = generate(**kwargs)
        return seen[k].clone()

    model.generate = remembered
    return model


@pytest.fixture(scope="session")
def clips(photo, tmp_path_factory) -> dict:
    """The test clips (``tests/clips.py``), written once per run: ``{name: path}``."""
    from .clips import clip_paths, make_clips

    return clip_paths(build_once(tmp_path_factory, "clips", lambda out: make_clips(photo, out)))


def video_reference_python() -> Path:
    """The reference environment's Python (``make test`` builds it: Makefile ``REF_VENV``), or
    ``$QWEN35_ONNX_VIDEO_REFERENCE_PYTHON``."""
    import os

    path = Path(
        os.environ.get("QWEN35_ONNX_VIDEO_REFERENCE_PYTHON", Path(__file__).parents[1] / ".venv-video-ref/bin/python")
    )
    if not path.exists():
        pytest.fail(f"{path} is missing: the video tests need the reference environment (make test builds it)")
    return path


@pytest.fixture(scope="session")
def video_reference(checkpoint, tmp_path_factory):
    """``video_reference(cases, resizes=()) -> dict``: transformers' own processing of ``cases`` (see
    ``tests/video_reference.py``) in the reference environment, one run per call (about ten seconds)."""
    import json
    import subprocess

    import numpy as np

    folder = tmp_path_factory.mktemp("video-reference")

    def run(cases: list[dict], resizes=()) -> dict:
        spec, out = folder / f"spec-{len(list(folder.iterdir()))}.json", None
        spec.write_text(
            json.dumps({"checkpoint": str(checkpoint), "cases": cases, "resizes": [list(r) for r in resizes]})
        )
        out = spec.with_suffix(".npz")
        script = Path(__file__).parent / "video_reference.py"
        done = subprocess.run(
            [str(video_reference_python()), str(script), str(spec), str(out)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with np.load(out) as data:
            return {key: data[key] for key in data.files}

    return run


@pytest.fixture(scope="session")
def reference_model(checkpoint):
    from qwen35_onnx.verify import load_reference

    return remember_generations(load_reference(checkpoint))


@pytest.fixture(scope="session")
def reference_tokens(fixed_export, reference_model, photo) -> list[int]:
    """Greedy transformers tokens for the demo prompt (shared by all parity tests)."""
    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.verify import reference_generate_prepared

    pipe = Pipeline.from_exported(fixed_export)
    prepared = pipe.prepare(photo, PROMPT)
    return reference_generate_prepared(reference_model, prepared, MAX_NEW_TOKENS, pipe.contract.eos_token_ids)


@pytest.fixture(scope="session")
def trained_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The demo checkpoint after 200 training steps, trained once per session for the quantization
    and the OpenVINO bf16 tests: random weights are a chaotic worst case for anything that
    perturbs the computation (quantization, bf16), see ``tests/training.py``."""
    from .training import train_checkpoint

    return build_once(tmp_path_factory, "checkpoint-trained", lambda out: train_checkpoint(checkpoint, out, steps=200))


@pytest.fixture(scope="session")
def trained_export(trained_checkpoint, tmp_path_factory):
    """``trained_export(ops, dtype="fp32", **options) -> Path``: an export of the trained demo
    checkpoint with one prefill bucket of CAPACITY tokens, built on first request and shared by
    every test of the session (the quantization, dtype and OpenVINO tests compare the same
    exports; built once per run, see :func:`build_once`). A quantized one is ``qwen35-onnx quantize`` of the float
    export with its other options and KV precision (:func:`qwen35_onnx.export.requantize.quantize_export`, which
    tests/test_requantize.py shows gives ``export --quantize``'s graphs and weights): one trace for every
    quantization of an export."""

    def get(ops: str, dtype: str = "fp32", **options) -> Path:
        name = "-".join(["trained", ops, dtype] + [f"{k}-{v}" for k, v in sorted(options.items())])
        if options.get("quantize", "none") != "none":  # a quantized copy of the float export (one trace for all)
            from qwen35_onnx.export.options import ExportOptions

            quantization = {k: v for k, v in options.items() if k in QUANTIZATION_OPTIONS}
            others = {k: v for k, v in options.items() if k not in QUANTIZATION_OPTIONS and k != "kv_dtype"}
            kv = ExportOptions(ops=ops, dtype=dtype, prefill_buckets=(CAPACITY,), **options).kv_precision
            if kv != dtype:  # the KV precision export --quantize gives (a float export's default is its dtype)
                others["kv_dtype"] = str(kv)
            return quantized_copy(tmp_path_factory, get(ops, dtype, **others), name, **quantization)
        return build_once(
            tmp_path_factory,
            name,
            lambda out: export_to(
                trained_checkpoint, out, ops=ops, dtype=dtype, prefill_buckets=(CAPACITY,), **options
            ),
        )

    return get


def _quantization_options() -> tuple[str, ...]:
    from qwen35_onnx.export.options import QuantizeOptions
    from qwen35_onnx.options import declared

    return tuple(o.name for o in declared(QuantizeOptions) if o.name != "overwrite")


QUANTIZATION_OPTIONS = _quantization_options()
"""The options of ``qwen35-onnx quantize`` (:class:`qwen35_onnx.export.options.QuantizeOptions`, less
``overwrite``), read from its declarations."""


class Reference:
    """A reference export (fp32, which the quantized and lower-precision exports are compared with),
    loaded once, and what the tests compare with it for the demo photo and :data:`PROMPT`, each
    computed once: the last prompt position's logits and the greedy tokens. Greedy generation and
    the prefill are deterministic, so every comparison still sees the values its own load would give.
    For reference exports only: a test about loading (sessions, compiles, memory) loads its own."""

    def __init__(self, out: Path, photo: Path):
        from qwen35_onnx.pipeline import Pipeline

        self.path, self.photo = out, photo
        self.pipe = Pipeline.from_exported(out)
        self._logits = None
        self._tokens: dict[int, list[int]] = {}

    def prepared(self):
        """The photo and :data:`PROMPT`, prepared by the reference pipeline (a new object each call)."""
        return self.pipe.prepare(self.photo, PROMPT)

    def last_logits(self):
        """The logits ``[V]`` (fp64) after the prompt; a read-only array."""
        import numpy as np

        if self._logits is None:
            logits = self.pipe.generation(self.prepared()).prefill()
            self._logits = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
            self._logits.flags.writeable = False
        return self._logits

    def greedy(self, n: int) -> list[int]:
        """``n`` greedy tokens after the prompt (a new list each call)."""
        if n not in self._tokens:
            self._tokens[n] = list(self.pipe.generate(self.photo, PROMPT, max_new_tokens=n).token_ids)
        return list(self._tokens[n])


def random_prompt(pipe, length: int, seed: int):
    """[1, length] token ids of ordinary (non-special, non-image) tokens of ``pipe``'s tokenizer."""
    import numpy as np

    specials = set(pipe.preprocessor.tokenizer.all_special_ids) | {pipe.contract.image_token_id}
    pool = np.array([t for t in range(pipe.contract.vocab_size) if t not in specials])
    return np.random.default_rng(seed).choice(pool, size=(1, length))


def forced_logits(pipe, prepared, tokens: list[int]) -> list:
    """The logits ``[V]`` (fp64 copies) ``pipe`` gives before each of ``tokens`` when they are fed
    one after another (teacher forcing through the product's generation object): entry ``i`` is
    the prediction for ``tokens[i]`` after the prompt and ``tokens[:i]``."""
    import numpy as np

    generation = pipe.generation(prepared)
    seen = [np.array(generation.prefill(), dtype=np.float64)]
    for token in tokens[:-1]:
        seen.append(np.array(generation.step(token), dtype=np.float64))
    return seen


def logit_cosine(a, b) -> float:
    """Cosine similarity of two logit vectors (1-D float arrays)."""
    import numpy as np

    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def split_margin(pipe, prepared, tokens: list[int], other: list[int]) -> tuple[int, float]:
    """Where two greedy runs part and how close a call it was for ``pipe``: ``(i, margin)`` with
    ``i`` the first index where ``tokens`` (``pipe``'s greedy tokens) and ``other`` differ and
    ``margin`` = ``pipe``'s logit of ``tokens[i]`` minus its logit of ``other[i]`` there (>= 0; a
    near tie is a margin that is small next to the logits' spread); ``(len, inf)`` when they agree."""
    i = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), None)
    if i is None:
        return min(len(tokens), len(other)), float("inf")
    logits = forced_logits(pipe, prepared, tokens[: i + 1])[i]
    return i, float(logits[tokens[i]] - logits[other[i]])
