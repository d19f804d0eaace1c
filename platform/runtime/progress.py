"""A run's live progress per round (round, clients done, accuracy, bytes sent), drawn from the
Coordinator's events by the driver, so a run started from a notebook shows what ``fedray run`` shows.

On a terminal it is a rich live bar; elsewhere (CI, pipes) one plain line per round.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console


def mb(nbytes: float) -> float:
    return nbytes / 2**20


def fmt_acc(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


class Progress:
    def __init__(
        self, total_rounds: int, title: str, enabled: bool = True, console: Console | None = None
    ) -> None:
        self.total = total_rounds
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

    def handle(self, event: dict[str, Any]) -> None:
        if not self.enabled:
            return
        kind = event["type"]
        if kind == "client_done" and self._bar is not None:
            self._bar.update(
                self._task, status=f"round {event['round']}: clients {event['done']}/{event['total']}"
            )
        elif kind == "client_failed":
            self.console.print(
                f"[red]round {event['round']}: client {event['client']} failed: {event['error']}"
            )
        elif kind == "client_retried":
            self.console.print(
                f"[yellow]round {event['round']}: worker lost running {event['client']}, re-running "
                f"from the committed state ({event['error']})"
            )
        elif kind == "round_end":
            self._round_end(event["round"], event["metrics"])

    def _round_end(self, rnd: int, m: dict[str, float]) -> None:
        for key in ("acc/personal_mean", "acc/global"):
            if key in m:
                self.last_acc[key] = m[key]
        line = (
            f"round {rnd:>4}/{self.total}  clients {int(m.get('clients/selected', 0)) - int(m.get('clients/failed', 0))}"
            f"/{int(m.get('clients/selected', 0))}  acc personal {fmt_acc(self.last_acc.get('acc/personal_mean'))}"
            f"  global {fmt_acc(self.last_acc.get('acc/global'))}"
            f"  up {mb(m['comm/up_bytes']):.2f} MB  down {mb(m['comm/down_bytes']):.2f} MB"
            f"  loss {m.get('loss/train', float('nan')):.3f}  {m['time/round_s']:.1f}s"
        )
        if m.get("clients/retried"):
            line += f"  retried {int(m['clients/retried'])}"
        if self._bar is not None:
            self._bar.update(self._task, completed=rnd, status=line.split("  ", 1)[1])
            self._bar.console.print(line, highlight=False)
        else:
            print(line, flush=True)
