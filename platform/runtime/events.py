"""What the Coordinator tells the driver while a run goes: typed events, queued in the Coordinator
(:class:`EventQueue`) and polled by the driver, which shows them (:mod:`.progress`) and logs the
rounds to MLflow.

Rounds are numbered as the display and MLflow count them: ``round`` is the number of rounds begun
(``rnd + 1`` of the loop's 0-based index).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedray.platform.runtime.failures import Failure


@dataclass(frozen=True)
class RoundStarted:
    round: int
    selected: list[int]


@dataclass(frozen=True)
class RoundEnded:
    round: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class ClientFailed:
    """A client, or an evaluation job, whose code raised; the run goes on. The failure carries its
    traceback the first time its origin (type and place) shows in the run only."""

    round: int
    job: str  # as the display names it (job_label)
    failure: Failure


@dataclass(frozen=True)
class JobRetried:
    """A job whose worker died, re-run from the committed state on another worker."""

    round: int
    job: str  # as the display names it: "client 3", "clients 3, 7", "global test chunk 2"
    error: str


@dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint has landed: it is written while the next rounds run, so this may come after
    their :class:`RoundEnded`."""

    round: int
    path: str


@dataclass(frozen=True)
class WorkerJoined:
    """A worker Ray placed after the run's set-up: one of the first that waited for room, or a dead
    worker's replacement (``replacement``), in the pool's ``slot``. The run's ``device`` tag counts
    its device, and ``fedray.workers`` its slot, once."""

    slot: int
    device: str  # as the worker describes it, e.g. "cuda (NVIDIA H200, Ray GPU 0)"
    replacement: bool


Event = RoundStarted | RoundEnded | ClientFailed | JobRetried | CheckpointSaved | WorkerJoined


def job_label(key: Any) -> str:
    """A job's key as the progress display names it: ``client 3``, ``clients 3, 7``, ``global test chunk 2``."""
    if key and key[0] == "global":
        return f"global test chunk {key[1]}"
    if key and key[0] == "clients":
        return f"evaluation from client {key[1]}"
    return f"client{'s' if len(key) > 1 else ''} {', '.join(map(str, key))}"


class EventQueue:
    """The Coordinator's events, put by the round loop's thread and taken by the driver's poll in the
    other, and the reporters that turn a round's job failures into events."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.traced: set[str] = set()  # the failures' origins whose traceback went out

    def client_failed(self, rnd: int, key: Any, failure: Failure) -> None:
        """A :class:`ClientFailed` for a job of round ``rnd`` (0-based); its traceback goes with the
        first failure of its origin only: a bug in an algorithm fails every client alike, and a
        message that differs per client (a shape, an index) does not make it another error."""
        if failure.origin in self.traced:
            failure = dataclasses.replace(failure, traceback="")
        elif failure.traceback:
            self.traced.add(failure.origin)
        self.emit(ClientFailed(rnd + 1, job_label(key), failure))

    def emit(self, event: Event) -> None:
        self.events.put(event)

    def poll(self, timeout: float = 0.5) -> list[Event]:
        """Events since the last poll; waits up to ``timeout`` for the first one."""
        out = []
        try:
            out.append(self.events.get(timeout=timeout))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    def retry_reporter(self, rnd: int) -> Callable[[Any, str], None]:
        """What the pool calls when a job of round ``rnd`` is re-run: a :class:`JobRetried`."""

        def report(key: Any, error: str) -> None:
            self.emit(JobRetried(rnd + 1, job_label(key), error))

        return report

    def failure_reporter(self, rnd: int) -> Callable[[Any, Failure], None]:
        """What the evaluation calls when a job of round ``rnd`` fails: :meth:`client_failed`."""

        def report(key: Any, failure: Failure) -> None:
            self.client_failed(rnd, key, failure)

        return report
