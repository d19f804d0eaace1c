"""Ctrl-C and SIGTERM during a run: a ``KeyboardInterrupt`` in the main thread, not in the middle of
a tracking write.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside MLflow's SQLAlchemy
session on a SQLite store, that leaves the database locked for the rest of the process (MLflow rolls
back only on ``Exception``), so the run's closing writes wait on the lock until
``tracking.max_outage_s`` and the command hangs. :func:`stops_as_interrupt` takes both signals for the
length of a run, and :func:`deferred` holds a signal that lands during a write until the write is done.
A second signal does not wait: whoever presses Ctrl-C twice (or a store that does not answer) gets
the interrupt at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held = 0  # how many deferred() blocks the main thread is in
_pending = False  # a signal arrived while held: raised when the outermost block ends


def _interrupt(signum, frame) -> None:
    global _pending
    if _held and not _pending:
        _pending = True
        return
    _pending = False  # this raise serves it
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Neither signal is delivered while the handlers change (it waits, and lands after)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def stops_as_interrupt() -> Iterator[None]:
    """Ctrl-C and SIGTERM (a scheduler preempting the job) stop the body with ``KeyboardInterrupt``,
    held past a :func:`deferred` block. Only the main thread takes signals: elsewhere (a Tune trial's
    thread) this does nothing."""
    global _pending
    if not _main_thread():
        yield
        return
    with _signals_blocked():
        previous = {sig: signal.signal(sig, _interrupt) for sig in SIGNALS}
        _pending = False
    try:
        yield
    finally:
        with _signals_blocked():
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _pending = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The body runs to its end; a Ctrl-C or SIGTERM that arrives meanwhile is raised right after it
    (a second one at once)."""
    global _held, _pending
    if not _main_thread():  # signals interrupt only the main thread
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending:
            _pending = False
            raise KeyboardInterrupt
