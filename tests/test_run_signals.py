"""A run stopped from outside, mid-round, finishes with the numbers of a run never stopped:
SIGTERM (a scheduler's preemption), SIGKILL of the driver, and SIGKILL of the Coordinator (restarted
on its own, or past its restarts resumed by hand).

A run whose driver is stopped is ``fedray run`` as a user starts it, in its own process with its own
local Ray; a run whose Coordinator is killed has its driver in this process, on the session's Ray.
The run is FedAvg held at a gate in round 5 (``tests/gate_algorithm.py``): the stop lands mid-round,
after round 4 was done and before round 5's clients train, with round 3's checkpoint the last one, so
the resume (or restart) replays round 4, whatever the machine's load. Every comparison is value for
value, every round, with one uninterrupted run of the same config."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gate_algorithm  # noqa: F401  (registers fedavg_gate in this process, for the resumes)
import psutil
import pytest
import torch
from conftest import only_run, store_in, tiny_overrides
from mlflow.tracking import MlflowClient

from fedray.platform.catalog import load_config
from fedray.platform.runtime.driver import resume_experiment, run_experiment
from fedray.platform.runtime.session import RunAborted
from fedray.platform.tracking.names import Metrics, Tags

TESTS = Path(__file__).parent
# `fedray run` with the test algorithm registered first (an installed plugin would use an entry point)
FEDRAY_RUN = [
    sys.executable,
    "-c",
    "import gate_algorithm; from fedray.platform.apps.cli import command; command()",
]
ROUNDS, CHECKPOINT_EVERY, GATED_ROUND = 6, 3, 4  # 0-based round 4 is the fifth: round 4 done, 3 checkpointed


def gated_overrides(gate: Path, **extra) -> list[str]:
    settings = {
        "algorithm": "fedavg_gate",
        "rounds": ROUNDS,
        "checkpoint_every": CHECKPOINT_EVERY,
        "fedavg_gate.round": GATED_ROUND,
        "fedavg_gate.gate": str(gate),
        **extra,
    }
    return [a for a in tiny_overrides(**settings) if not a.startswith("progress")]  # round lines on


def start_run(tmp_path, *extra: str, **popen) -> subprocess.Popen:
    # one ClientActor (the resume in this process trains on two: the numbers do not depend on it);
    # stderr to a file: a pipe that nothing reads while the test waits on stdout could fill and block the run
    with open(tmp_path / "stderr.txt", "w") as stderr:
        return subprocess.Popen(
            [*FEDRAY_RUN, "run", *gated_overrides(tmp_path / "gate"), "ray.num_cpus=1", *extra],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={
                **os.environ,
                "MLFLOW_TRACKING_URI": store_in(tmp_path),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
            },
            **popen,
        )


def stderr_tail(tmp_path) -> str:
    return (tmp_path / "stderr.txt").read_text()[-2000:]


def wait_at_gate(proc: subprocess.Popen, tmp_path) -> None:
    """Round 4 shown, round 5 started and held: the stop that follows lands mid-round."""
    for line in proc.stdout:
        if line.startswith(f"round {GATED_ROUND:>4}/"):
            break
    else:
        pytest.fail(f"the run ended before round {GATED_ROUND}: {stderr_tail(tmp_path)}")
    reached = tmp_path / "gate.reached"
    while not reached.exists():
        assert proc.poll() is None, stderr_tail(tmp_path)
        time.sleep(0.05)
    wait_for_checkpoint(tmp_path)


def wait_for_checkpoint(tmp_path) -> None:
    """Round 3's checkpoint has landed: it is written while rounds 4 and 5 run (the Coordinator's
    writer thread), so a stop at the gate could otherwise come before it, on a loaded machine."""
    deadline = time.monotonic() + 300
    while (
        not list((tmp_path / ".fedray").rglob("checkpoint.pt"))
        or checkpointed_rounds(tmp_path) < CHECKPOINT_EVERY
    ):
        assert time.monotonic() < deadline, "round 3's checkpoint never landed"
        time.sleep(0.05)


def open_gate(tmp_path) -> None:
    (tmp_path / "gate.open").touch()


def round_metrics(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every logged value of every round metric, as (step, value) in step order; clocks left out."""
    keys = [
        k
        for k in client.get_run(run_id).data.metrics
        if not k.startswith((Metrics.TIME_PREFIX, Metrics.SYSTEM_PREFIX, Metrics.RUN_COORDINATOR_RESTARTS))
    ]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def checkpointed_rounds(tmp_path) -> int:
    (checkpoint,) = (tmp_path / ".fedray").rglob("checkpoint.pt")
    return len(torch.load(checkpoint, weights_only=True)["history"])


@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory) -> dict[str, list[tuple[int, float]]]:
    """The same run, never stopped (in this process, on the session's Ray)."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    uri = store_in(tmp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(tmp)
        open_gate(tmp)
        result = run_experiment(load_config(None, gated_overrides(tmp / "gate", progress=False)))
    metrics = round_metrics(MlflowClient(uri), result.run_id)
    assert [step for step, _ in metrics[Metrics.COMM_UP_BYTES]] == list(range(1, ROUNDS + 1))
    return metrics


def resume_and_compare(tmp_path, monkeypatch, undisturbed):
    """Resume the stopped run from another directory, in this process (its Ray is up), and compare."""
    assert checkpointed_rounds(tmp_path) == CHECKPOINT_EVERY  # round 4 is replayed from round 3's state
    open_gate(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_in(tmp_path))
    client, run = only_run(tmp_path)
    began = time.time()
    resumed = resume_experiment(run.info.run_id)
    segment = time.time() - began
    assert resumed.finished
    after = client.get_run(run.info.run_id)
    assert after.info.status == "FINISHED"
    assert round_metrics(client, run.info.run_id) == undisturbed  # every round once, value for value
    return run, resumed, segment


@pytest.mark.usefixtures("ray_session")
def test_sigterm_mid_round_stops_as_ctrl_c_and_the_resume_replays_to_the_same_numbers(
    tmp_path, monkeypatch, undisturbed
):
    proc = start_run(tmp_path)
    wait_at_gate(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, stderr_tail(tmp_path)
    assert "resume with  fedray run --resume" in out
    _, run = only_run(tmp_path)
    assert run.info.status == "KILLED"
    first_wall = run.data.metrics[Metrics.TIME_WALL_S]  # the interrupted command's time is recorded too

    run, resumed, segment = resume_and_compare(tmp_path, monkeypatch, undisturbed)
    # the wall time adds both commands' time (the resume's own clock is inside `segment`)
    assert first_wall < resumed.wall_time_s <= first_wall + segment


@pytest.mark.usefixtures("ray_session")
def test_a_killed_driver_resumes_to_the_same_numbers(tmp_path, monkeypatch, undisturbed):
    proc = start_run(tmp_path)
    wait_at_gate(proc, tmp_path)
    ray_processes = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # SIGKILL: no handler runs, MLflow still says RUNNING
    proc.communicate(timeout=600)
    for process in ray_processes:  # the rest of that machine's run goes too: this test started it
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(ray_processes, timeout=60)
    _, run = only_run(tmp_path)
    assert run.info.status == "RUNNING"

    resume_and_compare(tmp_path, monkeypatch, undisturbed)


def kill_coordinator_at_gate(tmp_path, then_open: bool) -> list[int]:
    """In a thread: once the run's Coordinator waits at the gate, SIGKILL it (its pid is in the gate
    file), then open the gate if asked (for a restarted Coordinator's replay). Returns, once the
    thread has run, the killed Coordinator's nice value."""
    niceness: list[int] = []

    def kill():
        reached = tmp_path / "gate.reached"
        while not reached.exists() or not reached.read_text():
            time.sleep(0.05)
        wait_for_checkpoint(tmp_path)
        coordinator = psutil.Process(int(reached.read_text()))
        niceness.append(coordinator.nice())
        coordinator.kill()  # SIGKILL
        coordinator.wait(timeout=60)
        if then_open:
            open_gate(tmp_path)

    threading.Thread(target=kill, daemon=True).start()
    return niceness


# The Coordinator is killed under a driver in this process (the session's Ray): what is tested is
# the Coordinator's death, so its driver need not be a command of its own.


@pytest.mark.usefixtures("ray_session")
def test_a_dead_coordinator_restarts_from_its_checkpoint_to_the_same_numbers(
    tmp_path, monkeypatch, capfd, undisturbed
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_in(tmp_path))
    monkeypatch.chdir(tmp_path)  # the checkpoints, as under a command started here
    niceness = kill_coordinator_at_gate(tmp_path, then_open=True)
    result = run_experiment(load_config(None, gated_overrides(tmp_path / "gate")))
    assert result.finished
    # Ray's workers run at the user's priority (this process's, under `nice make test` too), not Ray's nice 15
    assert niceness == [psutil.Process().nice()]
    lines = capfd.readouterr().out.splitlines()  # the display's lines, as the command shows them
    assert any(
        line.startswith("the Coordinator died (") and line.endswith("restart 1 of 3") for line in lines
    ), lines
    assert "restarted from round 3's checkpoint" in lines, lines

    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags[Tags.COORDINATOR_RESTARTS] == "1"
    assert round_metrics(client, run.info.run_id) == undisturbed  # round 4 recomputed, logged once


@pytest.mark.usefixtures("ray_session")
def test_a_dead_coordinator_past_its_restarts_is_one_line_and_resumes_to_the_same_numbers(
    tmp_path, monkeypatch, undisturbed
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_in(tmp_path))
    monkeypatch.chdir(tmp_path)
    overrides = gated_overrides(tmp_path / "gate", **{"ray.max_coordinator_restarts": 0})
    kill_coordinator_at_gate(tmp_path, then_open=False)
    with pytest.raises(RunAborted) as stopped:
        run_experiment(load_config(None, overrides))
    _, run = only_run(tmp_path)
    line = str(stopped.value)  # the CLI prints it as `fedray: error: <line>` (test_config_errors)
    assert line.startswith("the Coordinator process died") and "\n" not in line
    assert line.endswith(f"fedray run --resume {run.info.run_id}")
    assert run.info.status == "FAILED"

    resume_and_compare(tmp_path, monkeypatch, undisturbed)
