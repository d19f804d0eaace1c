"""A tracking server that stops answering costs a run time, not results.

The retry logic is checked on a client that fails on demand; the whole story on a real ``mlflow
server`` process, stopped for 30 seconds in the middle of a ``fedray run`` and started again, its
store then read against the rounds in the run's last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requests
import torch
from conftest import free_port, store_in, tiny_overrides
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST
from mlflow.tracking import MlflowClient

from fedray.platform.apps.ui import SERVER_ENV_DEFAULTS
from fedray.platform.tracking import outage as tracking_outage
from fedray.platform.tracking.names import Metrics, Tags
from fedray.platform.tracking.outage import PatientCalls, TrackingUnavailable, unreachable

FEDRAY = str(Path(sys.executable).with_name("fedray"))
MLFLOW = str(Path(sys.executable).with_name("mlflow"))
OUTAGE_S = 30


class FlakyServer:
    """Refuses the first ``down`` calls, then stores what it is sent, in order."""

    def __init__(self, down: int) -> None:
        self.down, self.stored = down, []

    def log(self, item):
        if self.down:
            self.down -= 1
            raise MlflowException(
                "API request to http://tracking/api failed with exception ConnectionRefused"
            )
        self.stored.append(item)
        return item


def test_writes_wait_out_an_outage_in_order_and_say_so(monkeypatch):
    monkeypatch.setattr(tracking_outage, "RETRY_S", 0.01)
    said = []
    calls, server = PatientCalls("http://tracking", 60, said.append), FlakyServer(down=3)
    assert [calls(server.log, i) for i in range(3)] == [0, 1, 2]
    assert server.stored == [0, 1, 2]
    assert len(said) == 2 and "not answering" in said[0] and "is back" in said[1]


def test_past_the_bound_it_stops_in_one_line_and_tries_once_after(monkeypatch):
    monkeypatch.setattr(tracking_outage, "RETRY_S", 0.01)
    calls, server = PatientCalls("http://tracking", 0.05, lambda text: None), FlakyServer(down=10**6)
    with pytest.raises(
        TrackingUnavailable, match=r"has not answered for \d+ s \(tracking\.max_outage_s=0\.05\)"
    ):
        calls(server.log, 1)
    before = server.down
    with pytest.raises(TrackingUnavailable):
        calls(server.log, 2)
    assert before - server.down == 1  # given up: one try, no second wait


def test_a_refused_request_is_not_an_outage():
    assert unreachable(requests.exceptions.ConnectionError("refused"))
    assert unreachable(MlflowException("boom", error_code=INTERNAL_ERROR))
    assert not unreachable(MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not unreachable(ValueError("bad value"))
    calls = PatientCalls("http://tracking", 60, lambda text: None)
    with pytest.raises(MlflowException, match="no such run"):
        calls(
            lambda: (_ for _ in ()).throw(MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST))
        )


# ------------------------------------------------------------------------------------ a real server


def start_server(directory: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on the store in ``directory``; its own session, so it stops as a group."""
    with open(directory / "server.log", "ab") as log:  # the child keeps its own handle
        proc = subprocess.Popen(
            [
                MLFLOW,
                "server",
                "--backend-store-uri",
                store_in(directory, "server.db"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **SERVER_ENV_DEFAULTS},  # as fedray ui starts it
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
        assert proc.poll() is None, (directory / "server.log").read_text()[-3000:]
    stop_server(proc)
    pytest.fail("the mlflow server did not start in 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its uvicorn worker, by the group we started
        proc.wait()


def fedray_run(tmp_path: Path, uri: str) -> subprocess.Popen:
    # one ClientActor: the outage is the driver's
    overrides = tiny_overrides(rounds=12, checkpoint_every=4, **{"ray.max_actors": 1})
    args = [a for a in overrides if not a.startswith("progress")]
    return subprocess.Popen(
        [FEDRAY, "run", *args, "tracking.system_metrics_s=0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
    )


def test_a_server_down_for_30_seconds_mid_run_loses_nothing_and_logs_nothing_twice(tmp_path):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    try:
        run = fedray_run(tmp_path, uri)
        seen = []
        for line in run.stdout:
            seen.append(line)
            if line.startswith("round    3/"):
                break
        else:
            pytest.fail("".join(seen)[-3000:])
        stop_server(server)
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        server = start_server(tmp_path, port)
        out = "".join(seen) + run.communicate(timeout=600)[0]
        assert run.returncode == 0, out[-3000:]
        assert time.monotonic() - down_at >= OUTAGE_S
        assert f"tracking server {uri} not answering" in out and f"tracking server {uri} is back after" in out

        # what the Coordinator computed, round by round, is in the run's last checkpoint: the store
        # must hold exactly that, every value once, none lost in the outage and none sent twice
        client = MlflowClient(uri)
        (experiment,) = [e for e in client.search_experiments() if e.name == "quickstart"]
        (logged,) = client.search_runs([experiment.experiment_id])
        assert logged.info.status == "FINISHED"
        checkpoint = Path(logged.data.tags[Tags.CHECKPOINT_DIR]) / "checkpoint.pt"
        history = torch.load(checkpoint, weights_only=True)["history"]
        assert len(history) == 12
        for key in {k for h in history for k in h if not k.startswith(Metrics.TIME_PREFIX)}:
            got = sorted((m.step, m.value) for m in client.get_metric_history(logged.info.run_id, key))
            assert got == [(i + 1, h[key]) for i, h in enumerate(history) if key in h], key
        names = {a.path for a in client.list_artifacts(logged.info.run_id)}
        assert {"config.yaml", "split.json", "partition.csv"} <= names
    finally:
        stop_server(server)
