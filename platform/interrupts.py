"""Ctrl-C and SIGTERM during a run: a ``KeyboardInterrupt`` in the main thread, never in the middle of
a tracking write.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside MLflow's SQLAlchemy
session on a SQLite store, that leaves the database locked for the rest of the process (MLflow rolls
back only on ``Exception``), so the run's closing writes wait on the lock until
``tracking.max_outage_s`` and the command hangs. :func:`stops_as_interrupt` takes both signals for the
length of a run, and :func:`deferred` holds a signal that lands during a write until the write is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_held = 0  # how many deferred() blocks the main thread is in
_pending = False  # a signal arrived while held: raised when the outermost block ends


def _interrupt(signum, frame) -> None:
    global _pending
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stops_as_interrupt() -> Iterator[None]:
    """Ctrl-C and SIGTERM (a scheduler preempting the job) stop the body with ``KeyboardInterrupt``,
    deferred past any :func:`deferred` block. Only the main thread takes signals: elsewhere (a Tune
    trial's thread) this does nothing."""
    global _pending
    if not _main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    _pending = False
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The body runs to its end; a Ctrl-C or SIGTERM that arrives meanwhile is raised right after it."""
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
