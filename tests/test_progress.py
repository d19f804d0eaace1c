"""The live progress display, off a terminal (CI, pipes): one plain line per round, a line for each
failed client and each re-run job, drawn from the Coordinator's typed events."""

from __future__ import annotations

import io

from rich.console import Console

from fedray.platform.runtime.events import (
    CheckpointSaved,
    ClientFailed,
    JobRetried,
    RoundEnded,
    RoundStarted,
    WorkerJoined,
)
from fedray.platform.runtime.failures import Failure
from fedray.platform.runtime.progress import Progress
from fedray.platform.tracking.names import Metrics

ROUND = {
    Metrics.CLIENTS_SELECTED: 4,
    Metrics.CLIENTS_FAILED: 1,
    Metrics.COMM_UP_BYTES: 3 * 2**20,
    Metrics.COMM_DOWN_BYTES: 2**19,
    Metrics.TIME_ROUND_S: 1.25,
}


def shown(*events, capsys) -> list[str]:
    out = io.StringIO()
    with Progress(10, "fedavg on synthetic", console=Console(file=out, width=200)) as progress:
        for event in events:
            progress.handle(event)
    return [line.rstrip() for line in out.getvalue().splitlines() + capsys.readouterr().out.splitlines()]


def test_each_event_is_a_line_and_the_accuracy_is_carried_to_rounds_without_evaluation(capsys):
    lines = shown(
        RoundStarted(1, [0, 1, 2, 3]),
        ClientFailed(1, "client 2", Failure("ValueError: bad batch")),
        JobRetried(1, "clients 0, 1", "worker died"),
        WorkerJoined(1, "cpu", replacement=True),
        WorkerJoined(2, "cuda (Fake GPU, Ray GPU [1])", replacement=False),  # not read as markup
        RoundEnded(1, {**ROUND, Metrics.LOSS_TRAIN: 0.5, Metrics.ACC_PERSONAL_MEAN: 0.8125}),
        CheckpointSaved(1, "/tmp/x/checkpoint.pt"),
        RoundEnded(2, ROUND),  # no training loss (a warm-up round), no evaluation
        capsys=capsys,
    )
    assert lines == [
        "round 1: client 2 failed: ValueError: bad batch",
        "round 1: worker lost running clients 0, 1, re-running from the committed state (worker died)",
        "a replacement worker joins, on cpu",
        "a worker Ray placed late joins the run, on cuda (Fake GPU, Ray GPU [1])",
        "round    1/10  clients 3/4  acc personal 81.25  global -  up 3.00 MB  down 0.50 MB  loss 0.500  1.2s",
        "round    2/10  clients 3/4  acc personal 81.25  global -  up 3.00 MB  down 0.50 MB  loss -  1.2s",
    ]


def test_a_failures_traceback_is_shown_under_its_line_and_neither_is_read_as_markup(capsys):
    trace = (
        "Traceback (most recent call last):\n  File \"algorithms/x.py\", line 3, in upload\nKeyError: '[b]'\n"
    )
    error = f"KeyError: '[b]' {'and more ' * 25}(at algorithms/x.py:3 in upload)"  # wider than the console
    first, again = Failure(error, "KeyError (at algorithms/x.py:3 in upload)", trace), Failure(error)
    lines = shown(ClientFailed(1, "client 0", first), ClientFailed(1, "client 1", again), capsys=capsys)
    assert lines == [
        f"round 1: client 0 failed: {error}",
        *trace.rstrip().splitlines(),
        f"round 1: client 1 failed: {error}",  # the same origin again: the Coordinator sent its line only
    ]


def test_the_round_line_shows_personalised_accuracy_under_the_name_the_run_logs(capsys):
    """With ``eval.clients=selected`` the rounds report ``acc/personal_mean_selected``; the line reads it."""
    out = io.StringIO()
    with Progress(
        10, "x", console=Console(file=out, width=200), personal="acc/personal_mean_selected"
    ) as progress:
        progress.handle(
            RoundEnded(1, {**ROUND, "acc/personal_mean_selected": 0.5, Metrics.ACC_PERSONAL_MEAN: 0.9})
        )
    assert "acc personal 50.00  global -" in out.getvalue() + capsys.readouterr().out
