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


def round_metrics(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every logged value of every round metric, as (step, value) in step order; clocks left out."""
    keys = [k for k in client.get_run(run_id).data.metrics if not k.startswith(("time/", "system/", "run/"))]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def test_a_dead_coordinator_restarts_from_its_checkpoint_to_the_same_numbers(tmp_path):
    # rounds of a second or so, so the Coordinator is killed with rounds to go
    proc = start_run(tmp_path, "rounds=6", "checkpoint_every=3", "train.local_epochs=20")
    wait_for_round(proc, 4)  # rounds 4.. run past the checkpoint of round 3, and are recomputed
    coordinator_of(proc).kill()  # SIGKILL
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    lines = (out + err).splitlines()
    assert any(
        line.startswith("the Coordinator died (") and line.endswith("restart 1 of 3") for line in lines
    )
    assert "restarted from round 3's checkpoint" in lines, out + err

    reference = start_run(tmp_path, "rounds=6", "checkpoint_every=3", "train.local_epochs=20")
    assert reference.communicate(timeout=600)[0] and reference.returncode == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time"])
    restarted, undisturbed = runs[0], runs[1]
    assert restarted.info.status == "FINISHED" and restarted.data.tags["fedray.coordinator_restarts"] == "1"
    got, want = round_metrics(client, restarted.info.run_id), round_metrics(client, undisturbed.info.run_id)
    assert got == want  # every round once (rounds 4.. were recomputed, not logged twice), bit for bit
    assert [step for step, _ in got["comm/up_bytes"]] == list(range(1, 7))


def test_a_dead_coordinator_past_its_restarts_is_one_line_with_the_resume_command(tmp_path):
    proc = start_run(tmp_path, "ray.max_coordinator_restarts=0")
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
