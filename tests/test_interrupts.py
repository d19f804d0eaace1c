"""Ctrl-C and SIGTERM during a run stop it between tracking writes, never inside one: a
KeyboardInterrupt inside MLflow's SQLAlchemy session leaves a SQLite store locked for the rest of the
process, and the run's closing writes then waited on the lock until ``tracking.max_outage_s``.

Signals are sent to this process (pytest runs tests in the main thread, which takes them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from conftest import store_in
from mlflow.tracking import MlflowClient

from fedray.platform.catalog import load_config
from fedray.platform.interrupts import deferred, stops_as_interrupt
from fedray.platform.tracking.mlflow_run import RunTracker
from fedray.platform.tracking.names import Metrics


def signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in the main thread at its next bytecode: within this sleep


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_interrupts_the_run_at_once_outside_a_write(sig):
    after = []
    with stops_as_interrupt(), pytest.raises(KeyboardInterrupt):
        signal_self(sig)
        after.append("ran on")
    assert after == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_write_is_raised_when_the_write_is_done(sig):
    steps = []
    with stops_as_interrupt(), pytest.raises(KeyboardInterrupt):
        with deferred():
            signal_self(sig)
            with deferred():  # nested: held until the outermost block ends
                steps.append("inner done")
            steps.append("outer done")
        steps.append("after the write")
    assert steps == ["inner done", "outer done"]


def test_the_handlers_are_put_back_after_the_run():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stops_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_second_signal_during_a_write_is_raised_at_once():
    """Ctrl-C pressed twice (or a tracking store that does not answer) is not held."""
    steps = []
    with stops_as_interrupt(), pytest.raises(KeyboardInterrupt), deferred():
        signal_self(signal.SIGINT)
        steps.append("held")
        signal_self(signal.SIGINT)
        steps.append("not held")
    assert steps == ["held"]
    with stops_as_interrupt(), deferred():  # served: nothing is left pending for the next run
        steps.append("next run")
    assert steps == ["held", "next run"]


def test_a_write_in_another_thread_holds_no_signal_of_the_main_thread():
    """A Tune trial's thread writes to MLflow too: a signal that lands meanwhile still stops the main
    thread at once, and the trial's thread raises nothing."""
    writing, done = threading.Event(), threading.Event()
    errors = []

    def trial():
        try:
            with deferred():
                writing.set()
                done.wait(10)
        except BaseException as err:  # the assertion below names it
            errors.append(err)

    thread = threading.Thread(target=trial)
    after = []
    with stops_as_interrupt():
        thread.start()
        writing.wait(10)
        with pytest.raises(KeyboardInterrupt):
            signal_self(signal.SIGTERM)
            after.append("ran on")
        done.set()
        thread.join()
    assert after == [] and errors == []


def test_sigterm_at_any_moment_of_the_logging_leaves_the_sqlite_store_writable(tmp_path, monkeypatch):
    """The failure seen in CI: SIGTERM while the driver logged a round, then the run's closing writes
    found the database locked. Here SIGTERM lands at random moments of a stream of writes, and each
    time the run is then closed at once (no waiting: ``tracking.max_outage_s=0``)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_in(tmp_path))
    cfg = load_config(None, ["tracking.max_outage_s=0", "tracking.system_metrics_s=0"])
    draw = random.Random(0)
    for attempt in range(30):
        with stops_as_interrupt():
            tracker = RunTracker(cfg)
            timer = threading.Timer(draw.uniform(0.0, 0.03), os.kill, (os.getpid(), signal.SIGTERM))
            with pytest.raises(KeyboardInterrupt):
                timer.start()  # in here: however soon it fires, the interrupt is this block's
                for step in range(10**6):
                    tracker.log_metrics({f"m{i}": float(step) for i in range(20)}, step=step)
            timer.join()
            tracker.end("KILLED", wall_s=1.0)  # locked, this raises TrackingUnavailable (after ~40 s)
        run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(tracker.run_id)
        assert run.info.status == "KILLED", f"attempt {attempt}"
        assert run.data.metrics[Metrics.TIME_WALL_S] == 1.0
