"""Faults cost time, not results: a worker killed with SIGKILL mid-round is replaced, its client
re-runs from its committed state, and the run ends with the numbers of an undisturbed run."""

from __future__ import annotations

import killer_algorithm  # noqa: F401  (registers fedavg_killer in this process)
import pytest
from conftest import store_in, tiny_overrides
from mlflow.tracking import MlflowClient

from fedray.platform.catalog import load_config
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.tracking.names import Metrics, Tags

pytestmark = pytest.mark.usefixtures("patient_pool_sizing")  # their kills free CPUs the next run waits for


def comparable(history):
    """Per-round metrics without wall times and the retry counter (the only things a fault changes)."""
    return [
        {k: v for k, v in h.items() if not k.startswith(Metrics.TIME_PREFIX) and k != Metrics.CLIENTS_RETRIED}
        for h in history
    ]


def killer_run(tmp_path, stage: str, **extra):
    overrides = tiny_overrides(
        algorithm="fedavg_killer",
        rounds=3,
        **{"fedavg_killer.stage": stage, "fedavg_killer.marker": str(tmp_path / f"{stage}.killed"), **extra},
    )
    return run_experiment(load_config(None, overrides))


@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undisturbed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", store_in(tmp))
        mp.chdir(tmp)
        return killer_run(tmp, "none")


@pytest.mark.parametrize("stage", ["train", "eval", "cuda_error"])
def test_a_lost_worker_mid_round_changes_no_number(undisturbed, mlflow_store, tmp_path, stage):
    """SIGKILL of a worker in training or evaluation, or a CUDA error that leaves its device unusable:
    the worker is replaced and its calls run again from the committed states."""
    disturbed = killer_run(tmp_path, stage)

    assert (tmp_path / f"{stage}.killed").is_file()  # the worker really broke
    assert disturbed.finished
    assert comparable(disturbed.history) == comparable(undisturbed.history)
    assert disturbed.client_acc == undisturbed.client_acc
    # the broken call's clients re-ran; so may those of the call queued behind it on that worker
    retried = sum(h[Metrics.CLIENTS_RETRIED] for h in disturbed.history)
    assert 1 <= retried <= disturbed.history[0][Metrics.CLIENTS_SELECTED]
    assert all(h[Metrics.CLIENTS_FAILED] == 0 for h in disturbed.history)
    logged = MlflowClient(mlflow_store).get_metric_history(disturbed.run_id, Metrics.CLIENTS_RETRIED)
    assert sum(m.value for m in logged) == retried
    # the replacement takes its predecessor's place in the run's record
    tags = MlflowClient(mlflow_store).get_run(disturbed.run_id).data.tags
    assert (tags[Tags.WORKERS], tags[Tags.DEVICE]) == ("2", "cpu")


def test_out_of_memory_is_retried_in_place(undisturbed, mlflow_store, tmp_path):
    """CUDA's out-of-memory error frees the cache and runs the client again on the same worker."""
    disturbed = killer_run(tmp_path, "oom")

    assert (tmp_path / "oom.killed").is_file()  # the error was raised
    assert comparable(disturbed.history) == comparable(undisturbed.history)
    assert disturbed.client_acc == undisturbed.client_acc
    assert sum(h[Metrics.CLIENTS_RETRIED] for h in disturbed.history) == 0  # no worker was replaced
    assert all(h[Metrics.CLIENTS_FAILED] == 0 for h in disturbed.history)


@pytest.mark.usefixtures("ray_session")
def test_a_worker_killed_mid_round_loses_no_committed_client_state(mlflow_store, tmp_path):
    """Clients that keep state (FedAvg keeping its optimizer's state): a worker writes each client's
    new state to its file before its call returns, so a SIGKILL'd worker loses none, and the clients
    re-run on its replacement (reading their states from their files) repeat the undisturbed run."""
    extra = {"train.keep_optimizer_state": True, "train.momentum": 0.9}
    undisturbed = killer_run(tmp_path, "none", **extra)
    disturbed = killer_run(tmp_path, "train", **extra)
    assert (tmp_path / "train.killed").is_file() and disturbed.finished
    assert comparable(disturbed.history) == comparable(undisturbed.history)
    assert disturbed.client_acc == undisturbed.client_acc
    assert sum(h[Metrics.CLIENTS_RETRIED] for h in disturbed.history) >= 1
