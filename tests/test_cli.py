"""The command line as a user runs it: streamed text on stdout, timings on stderr, and
one-line errors (exit status 2, no traceback) for bad input. Also: the runtime runs with
torch made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .conftest import CAPACITY

pytestmark = pytest.mark.slow


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``qwen35-onnx ARGS`` in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "qwen35_onnx.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def invoke_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """``qwen35-onnx ARGS`` in this process (typer's test runner: the same code as :func:`run_cli`
    without a new interpreter; ``input``: its standard input); an exception the command let escape
    is written to stderr as the traceback a user would see."""
    import traceback

    from typer.testing import CliRunner

    from qwen35_onnx.cli import app

    result = CliRunner().invoke(app, list(args), input=input)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, stderr)


def test_generate_streams_text_and_reports_timings(fixed_export, photo):
    image = ["--image", str(photo)]
    proc = run_cli(
        "generate", "--model", str(fixed_export), *image, "--prompt", "Describe this image.", "--max-new-tokens", "10"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    for word in ("vision", "prefill", "ms/token", "tokens/s", "[length] 10 tokens"):
        assert word in proc.stderr


def _assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_missing_image(fixed_export, tmp_path):
    missing = tmp_path / "nope.jpg"
    proc = invoke_cli("generate", "--model", str(fixed_export), "--image", str(missing), "--prompt", "hi")
    _assert_clean_error(proc, str(missing))


def test_corrupt_image(fixed_export, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    proc = invoke_cli("generate", "--model", str(fixed_export), "--image", str(bad), "--prompt", "hi")
    _assert_clean_error(proc, str(bad))


def test_model_folder_that_is_not_an_export(tmp_path, photo):
    proc = invoke_cli("generate", "--model", str(tmp_path), "--image", str(photo), "--prompt", "hi")
    _assert_clean_error(proc, "manifest.json", "not a complete qwen35-onnx export")


def test_prompt_longer_than_capacity(fixed_export, photo):
    proc = invoke_cli("generate", "--model", str(fixed_export), "--image", str(photo), "--prompt", "word " * CAPACITY)
    _assert_clean_error(proc, "prompt is", f"capacity {CAPACITY}")


def test_bad_max_new_tokens(fixed_export, photo):
    proc = invoke_cli(
        "generate", "--model", str(fixed_export), "--image", str(photo), "--prompt", "hi", "--max-new-tokens", "0"
    )
    _assert_clean_error(proc, "max_new_tokens must be an integer >= 1, got 0")


def test_chat_and_verify_check_their_values_before_loading(fixed_export, tmp_path):
    # tmp_path is not an export: an error about it would mean the model was loaded first
    proc = invoke_cli("chat", "--model", str(tmp_path), "--max-new-tokens", "0")
    _assert_clean_error(proc, "--max-new-tokens must be >= 1 (omit it: until end of sequence), got 0")
    proc = invoke_cli("verify", "--model", str(tmp_path), "--model-id", str(fixed_export))
    _assert_clean_error(proc, "has no checkpoint weights", "it is an export folder")
    proc = invoke_cli("verify", "--model", str(tmp_path), "--model-id", str(tmp_path / "none"))
    _assert_clean_error(proc, "is not a local Hugging Face checkpoint folder (no config.json)")


def test_demo_cache_dir_that_is_a_file(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    proc = invoke_cli("demo", "--cache-dir", str(in_the_way))
    _assert_clean_error(proc, f"--cache-dir {str(in_the_way)!r} is a file, not a folder")


def test_sigterm_during_the_demo_export_leaves_nothing_behind(checkpoint, tmp_path):
    import shutil
    import signal
    import time

    shutil.copytree(checkpoint, tmp_path / "demo-checkpoint")  # the demo goes straight to its export
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwen35_onnx.cli", "demo", "--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not any(".tmp-" in p.name for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-checkpoint"]


def test_generate_and_chat_sample_as_the_checkpoint_says_and_switch_thinking(fixed_export, tmp_path, monkeypatch):
    import json
    import shutil

    from qwen35_onnx.pipeline import Pipeline
    from qwen35_onnx.runtime.sampling import SamplingConfig

    seen = []
    prepare_chat, stream_prepared = Pipeline.prepare_chat, Pipeline.stream_prepared

    def record_template(self, messages, chat_template_kwargs=None, *args, **kwargs):
        seen.append(chat_template_kwargs)
        return prepare_chat(self, messages, chat_template_kwargs, *args, **kwargs)

    def record_sampling(self, prepared, max_new_tokens=128, sampling=None, *args, **kwargs):
        seen.append(sampling)
        return stream_prepared(self, prepared, max_new_tokens, sampling, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "prepare_chat", record_template)
    monkeypatch.setattr(Pipeline, "stream_prepared", record_sampling)
    folder = shutil.copytree(fixed_export, tmp_path / "export")
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    (folder / "generation_config.json").write_text(json.dumps(config))
    checkpoint = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    cases = [
        ((str(fixed_export),), [None, SamplingConfig()]),  # do_sample false: greedy
        ((str(folder),), [None, checkpoint]),
        (
            (str(folder), "--temperature", "0", "--no-thinking"),
            [{"enable_thinking": False}, SamplingConfig(0.0, 20, 0.9)],
        ),
        ((str(folder), "--seed", "5", "--thinking"), [{"enable_thinking": True}, SamplingConfig(0.7, 20, 0.9, 5)]),
    ]
    for args, expected in cases:
        seen.clear()
        proc = invoke_cli("generate", "--model", *args, "--prompt", "hi", "--max-new-tokens", "2")
        assert proc.returncode == 0, proc.stderr
        assert seen == expected, args
    seen.clear()
    proc = invoke_cli(
        "chat", "--model", str(folder), "--top-k", "3", "--no-thinking", "--max-new-tokens", "2", input="hi\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert seen == [{"enable_thinking": False}, SamplingConfig(0.7, 3, 0.9)]
    proc = invoke_cli("generate", "--model", str(folder), "--prompt", "hi", "--top-p", "1.5")
    _assert_clean_error(proc, "top_p must be in (0, 1], got 1.5")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--image-tokens", "32"],
            ["--image-tokens 32 gives 32768 pixels", "below the image processor's min_pixels 65536", "at least 64"],
        ),
        (["--image-tokens", "0"], ["--image-tokens must be an integer >= 1, got 0"]),
        (["--image-tokens", "256", "--max-seq-len", "128"], ["256 image tokens, more than the capacity 128"]),
        (["--vision-grids", "16x15"], ["vision grid 16x15", "multiples of the spatial merge size 2"]),
        (["--vision-grids", "16 by 16"], ["--vision-grids '16 by 16'", "must be HxW", "or 'any' or 'static'"]),
    ],
)
def test_export_bad_image_options(checkpoint, tmp_path, args, fragments):
    proc = invoke_cli("export", "--model-id", str(checkpoint), "--output-dir", str(tmp_path / "o"), *args)
    _assert_clean_error(proc, *fragments)
    assert not (tmp_path / "o").exists()


def test_generate_takes_an_image_limit_and_any_shape(fixed_export, tmp_path):
    """--max-image-tokens within the export's range (64 tokens: the demo processor's minimum and the
    test exports' budget); a 6:1 panorama runs (on its own 6 x 38 grid, unpadded)."""
    from PIL import Image

    panorama = tmp_path / "panorama.png"
    Image.new("RGB", (1536, 256), (200, 120, 40)).save(panorama)
    args = ["generate", "--model", str(fixed_export), "--image", str(panorama), "--prompt", "hi"]
    proc = invoke_cli(*args, "--max-new-tokens", "2", "--max-image-tokens", "64")
    assert proc.returncode == 0, proc.stderr
    proc = invoke_cli(*args, "--max-image-tokens", "63")
    _assert_clean_error(proc, "--max-image-tokens 63 is below the image processor's minimum of 64 tokens")
    proc = invoke_cli(*args, "--max-image-tokens", "65")
    _assert_clean_error(proc, "--max-image-tokens 65 is above this export's budget of 64 image tokens")


def test_export_missing_checkpoint(tmp_path):
    proc = invoke_cli("export", "--model-id", str(tmp_path / "none"), "--output-dir", str(tmp_path / "o"))
    _assert_clean_error(proc, "is not a local Hugging Face checkpoint folder")


@pytest.fixture(scope="module")
def ov_export(fixed_export):
    """An export OpenVINO runs: the portable fixed-KV export (its any-grid vision graph reshaped per grid)."""
    return fixed_export


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_runtime_generates_without_torch(request, photo, runtime):
    """torch (and the onnx package) made unimportable (as in an install without the export extra);
    OpenVINO on the same export."""
    export = request.getfixturevalue("fixed_export" if runtime == "onnxruntime" else "ov_export")
    code = textwrap.dedent(
        f"""
        import sys
        for name in ("torch", "torchvision", "onnx"):
            sys.modules[name] = None
        from qwen35_onnx.pipeline import Pipeline
        pipe = Pipeline.from_exported({str(export)!r}, runtime={runtime!r})
        result = pipe.generate({str(photo)!r}, "Hi", max_new_tokens=4)
        assert len(result.token_ids) == 4, result
        loaded = [m for m in sys.modules if m.split(".")[0] in ("torch", "onnx") and sys.modules[m] is not None]
        assert not loaded, loaded
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_demo_export_older_than_its_checkpoint_is_made_again(small_export, tmp_path):
    """The demo reuses its cached export only while it is this version's and newer than the demo
    checkpoint (a checkpoint rebuilt in a new format, e.g. another tokenizer, needs a new export)."""
    import os
    import shutil

    from qwen35_onnx.checkpoints import _MARKER
    from qwen35_onnx.demo import _export_is_current

    exported, checkpoint = tmp_path / "demo-export", tmp_path / "demo-checkpoint"
    exported.mkdir()
    shutil.copy(small_export / "manifest.json", exported / "manifest.json")
    checkpoint.mkdir()
    (checkpoint / _MARKER).write_text("{}")
    made = (exported / "manifest.json").stat().st_mtime
    os.utime(checkpoint / _MARKER, (made - 60, made - 60))
    assert _export_is_current(exported, checkpoint)
    os.utime(checkpoint / _MARKER, (made + 60, made + 60))
    assert not _export_is_current(exported, checkpoint)
    assert not _export_is_current(tmp_path / "missing", checkpoint)
