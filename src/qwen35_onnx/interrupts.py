"""SIGTERM and Ctrl-C unwind the command's main thread, even when they land in a finalizer.

Python runs a signal handler at the next bytecode boundary of the main thread. That boundary may
fall inside an object's ``__del__`` (a garbage collection in the middle of an export), a weakref
callback or a ``gc`` callback; CPython does not propagate an exception raised there: it reports it
to ``sys.unraisablehook`` and goes on, so the command would run to its end instead of stopping and
cleaning up. :func:`unwinding` makes both signals raise (``SystemExit(128 + SIGTERM)``, that is
status 143, and ``KeyboardInterrupt``) and installs an unraisable hook that sends a swallowed
signal to the main thread again 10 ms later, when it has left the finalizer. A signal that lands
while the hook itself runs (or the default hook it calls for other exceptions) is only recorded
there and sent again the same way.

The CPython rules relied on are those of the ``signal`` module's documentation ("Execution of Python
signal handlers") and of ``sys.unraisablehook``.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

RESEND_DELAY_S = 0.01
"""How long after a swallowed signal it is sent again (seconds)."""


class Terminated(SystemExit):
    """``SystemExit(128 + signum)`` raised by the SIGTERM handler of :func:`unwinding`."""


class _State:
    active = False  # inside unwinding(): signals are sent again
    in_hook = False  # the unraisable hook runs: a handler records its signal instead of raising
    recorded: int | None = None  # the signal a handler recorded in the hook


def _on_signal(signum: int, frame) -> None:
    if _State.in_hook:
        _State.recorded = signum  # raised here it would be swallowed: the hook sends it again
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(128 + signum)


def _send_again(signum: int) -> None:
    """Send ``signum`` to the main thread after :data:`RESEND_DELAY_S`, from a bare thread (not
    ``threading``'s: nothing to join at exit), unless :func:`unwinding` has ended by then."""
    main = threading.main_thread().ident

    def later() -> None:
        time.sleep(RESEND_DELAY_S)
        if _State.active:
            signal.pthread_kill(main, signum)

    _thread.start_new_thread(later, ())


def _signum_of(exc: BaseException | None) -> int | None:
    if isinstance(exc, Terminated):
        return exc.code - 128
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return None


def _redeliver(unraisable, previous) -> None:
    """The unraisable hook: a swallowed :class:`Terminated` or ``KeyboardInterrupt`` is sent again;
    anything else goes to ``previous``."""
    _State.in_hook, _State.recorded = True, None
    try:
        signum = _signum_of(unraisable.exc_value)
        if signum is None:
            previous(unraisable)
    finally:
        _State.in_hook = False
    signum = signum if signum is not None else _State.recorded
    if signum is not None and _State.active:
        _send_again(signum)


@contextlib.contextmanager
def unwinding() -> Iterator[None]:
    """For the ``with`` block, SIGTERM raises :class:`Terminated` (status 143) and SIGINT raises
    ``KeyboardInterrupt`` in the main thread, so ``finally`` blocks and context managers run (no
    half-written export folders), even when the signal lands in a finalizer (see the module's
    docstring). The previous unraisable hook is restored at the end; the handlers stay, so a
    signal during interpreter exit still raises (and, swallowed there, is not sent again).

    Raises:
        ValueError: when called outside the main thread (``signal.signal``'s rule).
    """
    previous = sys.unraisablehook
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    sys.unraisablehook = lambda unraisable: _redeliver(unraisable, previous)
    _State.active = True
    try:
        yield
    finally:
        _State.active = False
        sys.unraisablehook = previous
