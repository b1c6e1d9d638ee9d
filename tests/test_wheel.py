"""The package as a user installs it: a wheel made by ``python -m build`` from this checkout's files,
installed into a fresh virtual environment without extras (so without torch), runs ``generate`` and
``chat`` on an existing export; with the ``serve`` extra, ``serve`` answers the OpenAI routes. The
installs come from the package index (pip's cache after ``make``'s own install)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def checkout_files() -> list[str]:
    """The checkout's files as git sees them (tracked, and new files not ignored): what a wheel is
    built from, without the virtual environment, caches and build outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [name for name in listed if (ROOT / name).is_file()]


def run(args: list, cwd: Path, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    """``args`` in a clean environment (no ``PYTHONPATH``, no virtual environment of the suite's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(venv, wheel)``: the wheel built from a copy of the checkout, installed without extras."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "build", "--wheel", "--outdir", base / "dist", source], base)  # as a user builds it
    (wheel,) = (base / "dist").glob("qwen35_onnx-*.whl")
    venv = base / "venv"
    run([sys.executable, "-m", "venv", venv], base)
    run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", wheel], base)
    return venv, wheel


def test_wheel_without_extras_runs_generate_and_chat(installed, small_export, tmp_path):
    """No torch in the environment; ``generate`` streams text and ``chat`` answers a turn and quits;
    the wheel carries the shipped photo and the chat page."""
    venv, wheel = installed
    python, cli = venv / "bin" / "python", venv / "bin" / "qwen35-onnx"
    probe = run([python, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"], tmp_path)
    assert probe.stdout.strip() == "True", "torch is in the environment of a wheel installed without extras"
    where = run([python, "-c", "import qwen35_onnx, sys; print(qwen35_onnx.__file__)"], tmp_path).stdout
    assert str(venv) in where and str(ROOT) not in where
    files = run([python, "-m", "zipfile", "-l", wheel], tmp_path).stdout
    assert "qwen35_onnx/assets/photo.jpg" in files and "qwen35_onnx/server/page.html" in files
    photo = run([python, "-c", "from qwen35_onnx.paths import photo_path; print(photo_path())"], tmp_path)
    generated = run(
        [cli, "generate", "--model", small_export, "--prompt", "Hi", "--max-new-tokens", "6", "--threads", "1"],
        tmp_path,
    )
    assert generated.stdout.strip() and "tokens" in generated.stderr
    assert Path(photo.stdout.strip()).is_file()
    chat = subprocess.run(
        [str(cli), "chat", "--model", str(small_export), "--max-new-tokens", "6", "--threads", "1"],
        input="Hi\n/quit\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout.strip(), chat.stderr[-3000:]


def test_wheel_with_the_serve_extra_serves(installed, small_export, tmp_path):
    """``pip install 'WHEEL[serve]'`` adds the server: ``serve`` starts and answers /health and a chat
    completion."""
    venv, wheel = installed
    run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", f"{wheel}[serve]"], tmp_path)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [venv / "bin" / "qwen35-onnx", "serve", "--model", small_export, "--port", "0", "--threads", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = found.group(1)
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, reply.text
    finally:
        proc.terminate()
        proc.wait(20)
