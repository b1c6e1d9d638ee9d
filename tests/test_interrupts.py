"""SIGTERM and Ctrl-C stop a command and run its cleanup, wherever in the main thread they land.

Each case runs a small script under ``interrupts.unwinding()`` in its own process and signals it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

STOPPED = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": -signal.SIGINT}  # KeyboardInterrupt: killed by SIGINT


def run_script(body: str, name: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import gc, os, signal, sys, threading, time
        from qwen35_onnx.interrupts import unwinding
        SIGNUM = signal.{name}
        with unwinding():
            try:
        {body}
                time.sleep(5)
                print("went on")
            finally:
                print("cleaned up")
        """
    ).format(name=name, body=textwrap.indent(textwrap.dedent(body), " " * 8))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def assert_stopped(proc: subprocess.CompletedProcess, name: str) -> None:
    assert proc.returncode == STOPPED[name], proc.stderr[-2000:]
    assert proc.stdout.split() == ["cleaned", "up"], proc.stdout
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_in_a_finalizer_is_sent_again(name):
    # CPython swallows an exception raised in __del__: the demo's export once ran to its end after
    # SIGTERM, which had landed in a regex object's finalizer
    body = """
        class SignalsInItsFinalizer:
            def __del__(self):
                os.kill(os.getpid(), SIGNUM)
                for _ in range(10000):  # the handler runs on one of these bytecodes, inside __del__
                    pass
        SignalsInItsFinalizer()
    """
    assert_stopped(run_script(body, name), name)


def test_a_signal_in_a_weakref_or_gc_callback_is_sent_again():
    body = """
        import weakref
        class Thing:
            pass
        def signal_self(*_):
            os.kill(os.getpid(), SIGNUM)
            for _ in range(10000):
                pass
        thing = Thing()
        ref = weakref.ref(thing, signal_self)
        del thing
    """
    assert_stopped(run_script(body, "SIGTERM"), "SIGTERM")
    body = """
        gc.callbacks.append(lambda phase, info: phase == "start" and signal_self())
        def signal_self():
            gc.callbacks.clear()
            os.kill(os.getpid(), SIGNUM)
            for _ in range(10000):
                pass
        gc.collect()
    """
    assert_stopped(run_script(body, "SIGTERM"), "SIGTERM")


def test_a_signal_while_another_finalizers_error_is_reported_is_not_lost():
    # most of the loop's time is spent in the default unraisable hook printing ValueError: the
    # signal lands there, in code whose exceptions CPython clears
    proc = run_script(
        """
        class FailsInItsFinalizer:
            def __del__(self):
                raise ValueError("a library's failing finalizer")
        threading.Timer(0.1, os.kill, (os.getpid(), SIGNUM)).start()
        start = time.monotonic()
        while time.monotonic() - start < 1:
            FailsInItsFinalizer()
        """,
        "SIGTERM",
    )
    assert proc.returncode == STOPPED["SIGTERM"], proc.stderr[-2000:]
    assert proc.stdout.split() == ["cleaned", "up"], proc.stdout
    assert "ValueError: a library's failing finalizer" in proc.stderr  # other errors still reported


def test_after_the_block_the_previous_hook_is_back_and_nothing_is_sent_again():
    code = textwrap.dedent(
        """
        import sys
        from qwen35_onnx import interrupts
        before = sys.unraisablehook
        with interrupts.unwinding():
            assert sys.unraisablehook is not before
        assert sys.unraisablehook is before and not interrupts._State.active
        print("restored")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["restored"], proc.stderr
