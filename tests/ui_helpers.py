"""The MLflow UI as a user opens it: ``fedray ui`` started as ``make ui`` starts it, and headless
Chromium reading the page a printed address leads to."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

FEDRAY = Path(sys.executable).parent / "fedray"


def browser_or_skip() -> str:
    """Debian's chromium (or a Chrome) on PATH; else skip, saying why (also as a warning, shown
    without pytest -rs)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    reason = (
        "no headless browser: `chromium` is not on PATH "
        "(install it with `apt-get install -y chromium`; .ci/run does so where apt is available)"
    )
    warnings.warn(f"browser test skipped: {reason}", stacklevel=2)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ui_server(uri: str, cwd: Path):
    """``fedray ui`` on the store ``uri``; yields (its first line, port); stopped by its process
    group's id, whatever the test did."""
    port = _free_port()
    log = cwd / f"ui-{port}.log"  # a file, not a pipe: the server's access log must never block it
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(FEDRAY), "ui", "--port", str(port)],
            cwd=cwd,
            env={**os.environ, "MLFLOW_TRACKING_URI": uri},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the UI's own workers share its group
        )
    try:
        deadline = time.monotonic() + 300
        while True:  # the server is up when its page answers
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(1)
        yield log.read_text().splitlines()[0], port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def page_dom(browser: str, url: str, profile: Path) -> str:
    """The DOM after the page's scripts ran (30 s of virtual time: the UI fetches its runs)."""
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=30000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout
