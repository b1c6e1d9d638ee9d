"""Real coding agents, unmodified, against ``qwen35-onnx serve`` of the test checkpoint: Codex CLI (the Responses
API), Claude Code (Anthropic's Messages API) and Qwen Code (chat completions), one small task each, offline.

Not part of the test suite (their first requests are 20-50 thousand tokens; the export and three runs take
minutes). What it does:

1. finds the agents (their npm packages) under ``--agents-dir``, installing the pinned versions there with npm when
   they are missing (``--install`` forces it);
2. builds the test checkpoint (the demo checkpoint: the tiny preset, random weights, a locally trained tokenizer),
   a copy of it whose ``max_position_embeddings`` is ``--max-seq-len`` (the tiny preset says 4096; its RoPE has no
   learned table, the number is a cap), and its export at ``--max-seq-len`` tokens with prefill chunks (the agents'
   first requests hold 22k-46k tokens of the demo tokenizer), cached under ``--work-dir``;
3. starts ``serve`` with an API key, behind a recording proxy (each request: method, route, body bytes, status,
   seconds to the first byte and to the end, and the prompt, cached and output tokens its reply reports);
4. runs each agent in a home of its own (nothing of the user's read or written), telemetry, error reports and
   update checks off, pointed at the proxy with its own settings: Codex's ``config.toml`` model provider
   (``wire_api = "responses"``), ``ANTHROPIC_BASE_URL`` for Claude Code, ``OPENAI_BASE_URL`` for Qwen Code; non
   interactive (``codex exec``, ``claude -p``, ``qwen -p``), in a folder holding ``hello.py``;
5. stores what happened as JSON (``--out``): each agent's version, command, exit code, seconds, the ends of its
   output and error streams, whether an answer was printed and whether its error stream shows a client-side
   error, and the requests it made; with the machine, date and version of the run.

The model has random weights: the answers are noise, the point is that every agent speaks to the server without a
client-side error and exits 0 with an answer.

Usage (from the repository root, in the development environment; node and npm on the PATH)::

    .venv/bin/python benchmarks/agents.py --out benchmarks/agents/amd-epyc-2c-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from qwen35_onnx.bench.results import run_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_load import Server  # noqa: E402 - the benchmarks' serve in a subprocess

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-agents-bench"
MODEL = "qwen35-test"
PACKAGES = {
    "codex": "@openai/codex@0.171.0",
    "claude": "@anthropic-ai/claude-code@2.1.197",
    "qwen": "@qwen-code/qwen-code@0.15.10",
}
TASK = "What does hello.py print? Answer in one line."
CLIENT_ERRORS = re.compile(
    r"^ERROR|API Error|error decoding|[Ff]ailed to parse|[Uu]nexpected (event|token)|stream disconnected|"
    r"stream closed before",
    re.M,
)
"""What an agent's error stream shows when it could not read the server's reply (or the server refused)."""


# ---- the checkpoint and its export ---------------------------------------------------------------------------------
def agent_export(work: Path, capacity: int) -> Path:
    """The demo checkpoint with ``max_position_embeddings`` = ``capacity``, exported at that capacity (cached)."""
    from qwen35_onnx.checkpoints import build_demo_checkpoint
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportOptions

    out = work / f"export-{capacity}"
    if (out / "manifest.json").is_file():
        return out
    checkpoint = work / f"checkpoint-{capacity}"
    if not (checkpoint / "config.json").is_file():
        demo = build_demo_checkpoint(work / "demo")
        shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.copytree(demo, checkpoint)
        config = json.loads((checkpoint / "config.json").read_text())
        config.get("text_config", config)["max_position_embeddings"] = capacity
        (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    export(checkpoint, out, ExportOptions(capacity=capacity))
    return out


# ---- the agents ----------------------------------------------------------------------------------------------------
def find_agents(folder: Path, install: bool) -> dict[str, dict]:
    """``{name: {"bin", "package", "version"}}`` of the three agents under ``folder`` (npm installs them there when
    missing or ``install``)."""
    bins = {name: folder / "node_modules" / ".bin" / name for name in PACKAGES}
    if install or not all(b.exists() for b in bins.values()):
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(folder), *PACKAGES.values()], check=True
        )
    found = {}
    for name, spec in PACKAGES.items():
        package = spec.rpartition("@")[0]
        meta = json.loads((folder / "node_modules" / package / "package.json").read_text())
        found[name] = {"bin": str(bins[name]), "package": package, "version": meta["version"]}
    return found


def agent_run(name: str, binary: str, base: str, home: Path, workdir: Path, capacity: int) -> tuple[list[str], dict]:
    """The command and environment that point agent ``name`` at the server at ``base`` (``http://host:port``,
    serving an export of ``capacity`` tokens), with ``home`` as its home; its own settings written there."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
    }
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\n'
            'model_provider = "local"\n'
            f"model_context_window = {capacity}\n"
            "check_for_update_on_startup = false\n"
            "\n[analytics]\nenabled = false\n"
            "\n[model_providers.local]\n"
            'name = "qwen35-onnx"\n'
            f'base_url = "{base}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "QWEN35_ONNX_API_KEY"\n'
        )
        env.update(CODEX_HOME=str(codex_home), QWEN35_ONNX_API_KEY=KEY)
        return [binary, "exec", "--skip-git-repo-check", "-C", str(workdir), TASK], env
    if name == "claude":
        env.update(
            ANTHROPIC_BASE_URL=base,
            ANTHROPIC_API_KEY=KEY,
            ANTHROPIC_MODEL=MODEL,
            ANTHROPIC_SMALL_FAST_MODEL=MODEL,
            ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL,
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        )
        return [binary, "-p", TASK], env
    settings = home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(
        json.dumps(
            {
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False},
                "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            }
        )
    )
    env.update(OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY=KEY, OPENAI_MODEL=MODEL)
    return [binary, "-p", TASK], env


# ---- the server and the recording proxy ----------------------------------------------------------------------------
def _usage(text: str) -> dict:
    """The last prompt, cached and output token counts a reply's text reports (any of the three APIs)."""
    found = {}
    for key, names in {
        "prompt_tokens": ("prompt_tokens", "input_tokens"),
        "cached_tokens": ("cached_tokens", "cache_read_input_tokens"),
        "output_tokens": ("completion_tokens", "output_tokens"),
    }.items():
        values = re.findall(rf'"(?:{"|".join(names)})":\s*(\d+)', text)
        if values:
            found[key] = int(values[-1])
    if "cache_read_input_tokens" in text and "prompt_tokens" in found:  # Anthropic's input_tokens leaves them out
        found["prompt_tokens"] += found.get("cached_tokens", 0)
    return found


class Recorder:
    """A reverse proxy to ``upstream`` on a free local port (a thread) that records every request in
    :attr:`requests` (``agent`` names whose requests they are)."""

    def __init__(self, upstream: str):
        self.upstream, self.agent, self.requests = upstream, None, []
        self.client = httpx.AsyncClient(timeout=None)
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "HEAD", "POST", "DELETE"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    async def forward(self, request: Request):
        body = await request.body()
        start = time.monotonic()
        record = {"agent": self.agent, "method": request.method, "path": request.url.path, "bytes": len(body)}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        reply = await self.client.send(
            self.client.build_request(request.method, url, headers=headers, content=body), stream=True
        )
        record["status"] = reply.status_code
        self.requests.append(record)

        async def relay():
            parts, first = [], None
            try:
                async for part in reply.aiter_raw():
                    first = first or time.monotonic()
                    parts.append(part)
                    yield part
            finally:
                await reply.aclose()
                end = time.monotonic()
                text = b"".join(parts).decode(errors="replace")
                record.update(first_byte_s=round((first or end) - start, 3), seconds=round(end - start, 3))
                record.update(_usage(text))
                if reply.status_code >= 400:
                    record["error"] = text[:500]

        dropped = ("content-length", "transfer-encoding", "content-encoding", "connection")
        headers = {k: v for k, v in reply.headers.items() if k.lower() not in dropped}
        return StreamingResponse(relay(), status_code=reply.status_code, headers=headers)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _tail(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out_default = ROOT / "benchmarks" / "out" / "agents"
    parser.add_argument("--agents-dir", type=Path, default=out_default / "npm", help="where the npm packages are")
    parser.add_argument("--install", action="store_true", help="install the pinned agents even when found")
    parser.add_argument("--work-dir", type=Path, default=out_default, help="checkpoint, export, homes, logs")
    parser.add_argument("--max-seq-len", type=int, default=65536, help="the export's capacity")
    parser.add_argument("--threads", type=int, default=0, help="serve --threads (0: all CPUs)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds an agent may run")
    parser.add_argument("--agents", default="codex,claude,qwen", help="which agents, comma-separated")
    parser.add_argument("--out", type=Path, required=True, help="the JSON result to write")
    args = parser.parse_args()

    agents = find_agents(args.agents_dir, args.install)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cached = (args.work_dir / f"export-{args.max_seq_len}" / "manifest.json").is_file()
    export = agent_export(args.work_dir, args.max_seq_len)
    export_s = time.monotonic() - t0
    server = Server(
        ["--model", str(export), "--model-name", MODEL, "--threads", str(args.threads)],
        args.work_dir / "serve.log",
        {**os.environ, "QWEN35_ONNX_API_KEY": KEY},
    )
    recorder = Recorder(server.url)
    results = []
    try:
        for name in args.agents.split(","):
            agent = agents[name]
            with tempfile.TemporaryDirectory(prefix=f"agent-{name}-") as scratch:
                home, workdir = Path(scratch) / "home", Path(scratch) / "project"
                home.mkdir()
                workdir.mkdir()
                (workdir / "hello.py").write_text('print("hello from qwen35-onnx")\n')
                command, env = agent_run(name, agent["bin"], recorder.url, home, workdir, args.max_seq_len)
                recorder.agent = name
                start = time.monotonic()
                try:
                    done = subprocess.run(
                        command,
                        cwd=workdir,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        stdin=subprocess.DEVNULL,
                    )
                    code, stdout, stderr = done.returncode, done.stdout, done.stderr
                except subprocess.TimeoutExpired as exc:
                    code, stdout, stderr = None, exc.stdout or "", (exc.stderr or "") + "\n[timed out]"
                    stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
                    stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
            seconds = time.monotonic() - start
            made = [r for r in recorder.requests if r["agent"] == name]
            results.append(
                {
                    "agent": name,
                    "package": agent["package"],
                    "version": agent["version"],
                    "command": [Path(command[0]).name, *command[1:]],
                    "exit_code": code,
                    "seconds": round(seconds, 1),
                    "answer_printed": bool(stdout.strip()),
                    "client_error": bool(CLIENT_ERRORS.search(stderr)) or any(r["status"] >= 400 for r in made),
                    "stdout_tail": _tail(stdout),
                    "stderr_tail": _tail(stderr),
                    "requests": made,
                }
            )
            print(f"{name} {agent['version']}: exit {code} in {seconds:.0f} s, {len(made)} requests", flush=True)
    finally:
        recorder.stop()
        server.stop()
    result = {
        "run": run_info(program="benchmarks/agents.py"),
        "export": {"capacity": args.max_seq_len, "built_s": None if cached else round(export_s, 1)},
        "task": TASK,
        "agents": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    if not all(r["exit_code"] == 0 and r["answer_printed"] and not r["client_error"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
