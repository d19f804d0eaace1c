"""Tracking that outlives an outage of its server: MLflow writes retried until it answers, bounded.

The Coordinator never waits on MLflow (it queues each round's events for the driver and goes on), so
while the tracking server is down only the driver waits: it holds the round it is logging, the
Coordinator's next rounds wait in its event queue, and everything is sent, in order, once the server
answers. A retried batch carries the timestamps of its first try, which MLflow's stores use to keep
a metric logged twice once. Past ``tracking.max_outage_s`` the run stops as Ctrl-C does.

MLflow's own HTTP retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
``..._TIMEOUT``) are shortened for a tracking server, unless set, so that one call gives up within
seconds and the outage is reported while it lasts rather than after minutes of silent retrying.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fedray.platform.errors import first_line
from fedray.platform.interrupts import deferred

T = TypeVar("T")
RETRY_S = 2.0  # between tries while the server does not answer
# a call to a tracking server gives up after about 3 s (two retries) or 30 s without an answer
HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


class TrackingUnavailable(RuntimeError):
    """The tracking server did not answer for longer than the run may wait. One line."""


def shorten_http_retries(uri: str) -> None:
    """MLflow's HTTP retry settings for a tracking server, where the user has not set them."""
    if uri.startswith(("http://", "https://")):
        for name, value in HTTP_RETRY_DEFAULTS.items():
            os.environ.setdefault(name, value)


def unreachable(err: BaseException) -> bool:
    """Whether ``err`` says the server did not answer (refused, timed out, 5xx), as opposed to
    refusing the request itself (a bad value, no permission), which retrying cannot fix."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(err, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError)):
        return True
    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
        return "failed with exception" in str(err) or (status >= 500 and status != 501)
    return False


class PatientCalls:
    """Runs MLflow writes, retrying while the server does not answer; says when it goes and comes
    back; raises :class:`TrackingUnavailable` once it has been down ``max_outage_s``. A Ctrl-C lands
    between calls, never inside one (see :mod:`fedray.platform.interrupts`)."""

    def __init__(self, uri: str, max_outage_s: float, warn: Callable[[str], None] | None = None) -> None:
        self.uri = uri
        self.max_outage_s = max_outage_s
        self.warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))
        self.down_since: float | None = None
        self.gave_up = False  # past the bound: later calls try once

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        while True:
            try:
                with deferred():
                    out = fn(*args, **kwargs)
            except Exception as err:
                if not unreachable(err):
                    raise
                self.failed(err)
                time.sleep(RETRY_S)
                continue
            if self.down_since is not None:
                self.warn(
                    f"tracking server {self.uri} is back after {time.monotonic() - self.down_since:.0f} s; "
                    "what waited is being sent"
                )
                self.down_since = None
            return out

    def failed(self, err: BaseException) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.warn(
                f"tracking server {self.uri} not answering ({first_line(err)}); the run goes on and "
                f"its metrics wait here until it is back (at most {self.max_outage_s:.0f} s)"
            )
        if self.gave_up or now - self.down_since > self.max_outage_s:
            self.gave_up = True
            raise TrackingUnavailable(
                f"tracking server {self.uri} has not answered for {now - self.down_since:.0f} s "
                f"(tracking.max_outage_s={self.max_outage_s:g})"
            ) from None
