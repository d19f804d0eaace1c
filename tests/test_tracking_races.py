"""Runs started together write the same rows: MLflow looks a row up, then inserts it, and another
process can insert it in between. A sweep's trials all log one dataset as they start (a real sweep's
trial failed at set-up this way in 3 of 11 runs of test_sweeps' restart test); runs started beside each
other on a new experiment name both create it. The loser tries again and finds the row."""

from __future__ import annotations

import threading
import uuid

import mlflow.data
import numpy as np
import pytest
from conftest import store_in
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_ALREADY_EXISTS
from mlflow.store.tracking import sqlalchemy_store
from mlflow.tracking import MlflowClient

from fedray.platform.catalog import load_config
from fedray.platform.tracking.mlflow_run import RunTracker, experiment_id, lost_an_insert_race


class LookupsBeforeInserts:
    """``uuid.uuid4`` as the SQL store sees it: the first call in each thread, made between the
    store's lookup of a dataset and its insert, waits until the other thread got there too."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.waited = threading.local()

    def uuid4(self) -> uuid.UUID:
        if not getattr(self.waited, "done", False):
            self.waited.done = True
            self.barrier.wait()
        return uuid.uuid4()


def test_two_runs_logging_one_dataset_at_once_both_record_it(tmp_path, monkeypatch):
    uri = store_in(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(None, ["tracking.system_metrics_s=0"])
    trackers = [RunTracker(cfg), RunTracker(cfg)]  # two trials of one sweep: one experiment
    dataset = mlflow.data.from_numpy(np.zeros((4, 2), np.float32), name="shared", digest="d1")
    monkeypatch.setattr(sqlalchemy_store, "uuid", LookupsBeforeInserts())
    errors: list[BaseException] = []

    def log(tracker: RunTracker) -> None:
        try:
            tracker.log_dataset(dataset)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=log, args=(t,)) for t in trackers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    client = MlflowClient(uri)  # named: an earlier test in this process may have set MLflow's default
    for tracker in trackers:
        (logged,) = client.get_run(tracker.run_id).inputs.dataset_inputs
        assert (logged.dataset.name, logged.dataset.digest) == ("shared", "d1")


class LateLookup:
    """A client whose first lookup of an experiment misses it: another run created it just after."""

    def __init__(self, client: MlflowClient) -> None:
        self.client = client
        self.looked = False

    def get_experiment_by_name(self, name):
        if not self.looked:
            self.looked = True
            return None
        return self.client.get_experiment_by_name(name)

    def create_experiment(self, name, artifact_location=None):
        return self.client.create_experiment(name, artifact_location=artifact_location)


def test_an_experiment_created_by_another_run_after_the_lookup_is_the_one_used(tmp_path):
    uri = store_in(tmp_path)
    client = MlflowClient(uri)
    made = client.create_experiment("together")
    assert experiment_id(LateLookup(client), "together", uri) == made


@pytest.mark.parametrize(
    ("err", "lost"),
    [
        (MlflowException("Experiment(name=x) already exists.", RESOURCE_ALREADY_EXISTS), True),
        (MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.name"), True),
        (
            MlflowException('(psycopg2.errors.UniqueViolation) duplicate key value violates "dataset_pk"'),
            True,
        ),
        (MlflowException("(pymysql.err.IntegrityError) (1062, \"Duplicate entry 'x' for key\")"), True),
        (MlflowException("Invalid value for parameter", INVALID_PARAMETER_VALUE), False),
        (ValueError("UNIQUE constraint failed"), False),  # not MLflow's refusal
    ],
)
def test_only_a_row_inserted_first_by_another_is_tried_again(err, lost):
    assert lost_an_insert_race(err) is lost
