"""A run whose training diverged stops at that round, in one line, instead of averaging NaN into
every client and training nothing for the rest of its rounds (or of a sweep's trial)."""

from __future__ import annotations

import math

import pytest
from conftest import only_run, tiny_overrides
from in_process import client_task

from fedray.platform.catalog import load_config
from fedray.platform.runtime.coordinator import build_server, divergence
from fedray.platform.runtime.driver import federation_meta, prepare_federation, run_experiment
from fedray.platform.runtime.session import RunAborted
from fedray.platform.runtime.worker import ClientHost
from fedray.platform.tracking.names import Metrics

LOSS = Metrics.LOSS_TRAIN
EXPLODING = {"train.lr": 1e12, "train.momentum": 0.0}


def test_a_round_diverged_when_no_client_that_trained_has_a_finite_loss():
    nan, inf = float("nan"), float("inf")
    assert divergence(4, {3: {LOSS: nan}, 1: {LOSS: inf}, 2: {"acc": 0.5}}) == (
        "round 5: training diverged, the training loss is not finite on any of the 2 clients that "
        "trained (client 1: inf); a lower train.lr keeps it finite"
    )
    assert divergence(4, {3: {LOSS: nan}, 1: {LOSS: 2.3}}) is None  # a client that still trains
    assert divergence(4, {1: {"loss/proto": nan}}) is None  # no training loss reported (a warm-up)
    assert divergence(4, {}) is None


def test_a_real_client_at_an_exploding_learning_rate_reports_a_loss_the_check_catches(tmp_path):
    cfg = load_config(None, tiny_overrides(**EXPLODING))
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    payload = build_server(cfg, federation_meta(fed)).configure(0, [0])[0]
    (result,) = host.train(0, [client_task(0, fed.shards[0], str(tmp_path))], [[payload]])
    assert result.error is None and not math.isfinite(result.stats[LOSS])
    assert divergence(0, {0: result.stats}).startswith("round 1: training diverged")


def test_a_diverged_run_stops_in_one_line_marked_failed_without_a_resume(ray_session, mlflow_store, tmp_path):
    with pytest.raises(RunAborted) as err:
        run_experiment(load_config(None, tiny_overrides(rounds=4, **EXPLODING)))
    line = str(err.value)
    assert "\n" not in line and "training diverged, the training loss is not finite on any of the" in line
    diverged_at = int(line.split(":")[0].removeprefix("round "))
    assert diverged_at in (1, 2), line  # the round it happened or the next (an average spread it)
    assert "resume" not in line  # it would diverge again
    client, run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    # every round before it logged, and neither it (not aggregated) nor any after it
    logged = client.get_metric_history(run.info.run_id, Metrics.COMM_UP_BYTES)
    assert sorted(m.step for m in logged) == list(range(1, diverged_at))
