"""A run's live progress per round (round, clients done, accuracy, bytes sent), drawn from the
Coordinator's events by the driver, so a run started from a notebook shows what ``fedray run`` shows.

On a terminal it is a rich live bar; elsewhere (CI, pipes) one plain line per round.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from fedray.platform.runtime.events import ClientFailed, Event, JobRetried, RoundEnded, WorkerJoined
from fedray.platform.tracking.names import Metrics


def mb(nbytes: float) -> float:
    return nbytes / 2**20


def fmt_acc(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # none: no client trained (FedL2G's warm-up)


class Progress:
    def __init__(
        self,
        total_rounds: int,
        title: str,
        enabled: bool = True,
        console: Console | None = None,
        personal: str = Metrics.ACC_PERSONAL_MEAN,
    ) -> None:
        self.total = total_rounds
        self.personal = personal  # as the run logs it: acc/personal_mean_selected with eval.clients=selected
        self.title = title
        self.enabled = enabled
        self.console = console or Console(file=sys.stdout)
        self.live = self.console.is_terminal and enabled
        self.last_acc: dict[str, float] = {}
        self._bar: Any = None  # a rich Progress while live

    def __enter__(self) -> Progress:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, status="starting")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def warn(self, text: str) -> None:
        """A line that must reach the user whether or not the display is on (stderr when off)."""
        if self.enabled:
            self.console.print(f"[yellow]{text}", soft_wrap=True)  # one line in a log, whatever the width
        else:
            print(text, file=sys.stderr, flush=True)

    def handle(self, event: Event) -> None:
        if not self.enabled:
            return
        if isinstance(event, ClientFailed):
            failure = event.failure
            self.console.print(
                f"[red]round {event.round}: {event.job} failed: {escape(failure.line)}", soft_wrap=True
            )
            if failure.traceback:  # the first failure of its origin carries it
                self.console.print(
                    failure.traceback.rstrip(), style="dim", markup=False, highlight=False, soft_wrap=True
                )
        elif isinstance(event, JobRetried):
            self.console.print(
                f"[yellow]round {event.round}: worker lost running {event.job}, re-running "
                f"from the committed state ({escape(event.error)})",
                soft_wrap=True,
            )
        elif isinstance(event, WorkerJoined):
            what = (
                "a replacement worker joins"
                if event.replacement
                else "a worker Ray placed late joins the run"
            )
            self.console.print(f"[dim]{what}, on {escape(event.device)}", soft_wrap=True)
        elif isinstance(event, RoundEnded):
            self._round_end(event.round, event.metrics)

    def _round_end(self, rnd: int, m: dict[str, float]) -> None:
        for key in (self.personal, Metrics.ACC_GLOBAL):
            if key in m:
                self.last_acc[key] = m[key]
        selected = int(m.get(Metrics.CLIENTS_SELECTED, 0))
        trained = selected - int(m.get(Metrics.CLIENTS_FAILED, 0))
        personal = fmt_acc(self.last_acc.get(self.personal))
        line = (
            f"round {rnd:>4}/{self.total}  clients {trained}/{selected}  acc personal {personal}"
            f"  global {fmt_acc(self.last_acc.get(Metrics.ACC_GLOBAL))}"
            f"  up {mb(m[Metrics.COMM_UP_BYTES]):.2f} MB  down {mb(m[Metrics.COMM_DOWN_BYTES]):.2f} MB"
            f"  loss {fmt_loss(m.get(Metrics.LOSS_TRAIN))}  {m[Metrics.TIME_ROUND_S]:.1f}s"
        )
        if m.get(Metrics.CLIENTS_RETRIED):
            line += f"  retried {int(m[Metrics.CLIENTS_RETRIED])}"
        if self._bar is not None:
            self._bar.update(self._task, completed=rnd, status=line.split("  ", 1)[1])
            self._bar.console.print(line, highlight=False)
        else:
            print(line, flush=True)
