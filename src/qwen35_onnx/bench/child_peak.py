"""Run a command and write its own peak resident memory (a script: ``python -I -S child_peak.py
OUT_FILE PROGRAM ARGS...``; the standard library only). :func:`qwen35_onnx.bench.llamacpp.run_measured`
runs the bench's llama.cpp tools through it.

Why a process in between: Linux keeps the larger of a process's ``ru_maxrss`` and the high-water
mark of the memory it replaced at ``execve`` (``fs/exec.c``, ``setmax_mm_hiwater_rss``). A tool
started straight from the bench (``subprocess`` uses ``vfork``: the child runs in the bench's memory
until it execs) therefore reports at least the bench process's own peak, often gigabytes. Started
from this small process instead, the tool reports its own peak, or this process's few megabytes.

Writes ``ru_maxrss`` (KiB, as ``getrusage(2)``) of PROGRAM to OUT_FILE, then ends as PROGRAM ended:
the same exit status, or killed by the same signal. Its standard streams are PROGRAM's.
"""

import os
import signal
import sys


def main(out_file: str, argv: list[str]) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(argv[0], argv)
        except OSError as exc:
            print(f"{argv[0]}: {exc}", file=sys.stderr)
        os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    with open(out_file, "w") as out:
        out.write(str(usage.ru_maxrss))
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
