"""A run stopped from outside: SIGTERM (a scheduler's preemption) and a Coordinator that dies.

Each test runs ``fedray run`` as a user would, in its own process with its own local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient

from fedray.platform.run import resume_experiment

FEDRAY = str(Path(sys.executable).with_name("fedray"))


def start_run(tmp_path, *extra: str) -> subprocess.Popen:
    args = [a for a in tiny_overrides(rounds=8, checkpoint_every=1) if not a.startswith("progress")]
    return subprocess.Popen(
        [FEDRAY, "run", *args, "ray.num_cpus=2", *extra],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )


def wait_for_round(proc: subprocess.Popen, rnd: int) -> None:
    for line in proc.stdout:
        if line.startswith(f"round {rnd:>4}/"):
            return
    pytest.fail(f"the run ended before round {rnd}: {proc.stderr.read()[-2000:]}")


def only_run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


@pytest.mark.usefixtures("ray_session")
def test_sigterm_stops_the_run_as_ctrl_c_and_it_resumes(tmp_path, monkeypatch):
    proc = start_run(tmp_path)
    wait_for_round(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-2000:]
    assert "resume with  fedray run --resume" in out
    client, run = only_run(tmp_path)
    assert run.info.status == "KILLED"
    first_wall = run.data.metrics["time/wall_s"]  # the interrupted command's time is recorded too

    # resumed from another directory, in this process (its Ray is already up: no second cold start)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    began = time.time()
    resumed = resume_experiment(run.info.run_id)
    segment = time.time() - began
    assert resumed.finished
    after = client.get_run(run.info.run_id)
    assert after.info.status == "FINISHED"
    # the wall time is the sum of both commands' time, not the last one's alone (the resume's own
    # clock also holds the Ray teardown that follows the run's end: an upper bound)
    assert first_wall + 0.5 * segment < resumed.wall_time_s <= first_wall + segment
    assert after.data.metrics["time/wall_s"] == resumed.wall_time_s
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "acc/global")]
    assert sorted(steps) == list(range(1, 9))  # none lost, none twice


def coordinator_of(proc: subprocess.Popen) -> psutil.Process:
    """The Coordinator among the run's own Ray processes (it carries FEDRAY_ROLE=coordinator)."""
    for _ in range(100):
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if child.environ().get("FEDRAY_ROLE") == "coordinator":
                    return child
            except psutil.Error:
                continue
        time.sleep(0.1)
    pytest.fail("no Coordinator process found")


def test_a_dead_coordinator_is_one_line_with_the_resume_command(tmp_path):
    proc = start_run(tmp_path)
    wait_for_round(proc, 1)
    coordinator_of(proc).kill()  # SIGKILL
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    _, run = only_run(tmp_path)
    last = err.strip().splitlines()[-1]
    assert last.startswith("fedray: error: the Coordinator process died")
    assert last.endswith(f"fedray run --resume {run.info.run_id}")
    assert "Traceback" not in err
    assert run.info.status == "FAILED"
