"""What the Coordinator tells the driver while a run goes: typed events, queued in the Coordinator
and polled by the driver, which shows them (:mod:`.progress`) and logs the rounds to MLflow.

Rounds are numbered as the display and MLflow count them: ``round`` is the number of rounds begun
(``rnd + 1`` of the loop's 0-based index).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """A client (or an evaluation job, named by its first client) whose code raised; the run goes on."""

    round: int
    client: int
    error: str  # its one line


@dataclass(frozen=True)
class JobRetried:
    """A job whose worker died, re-run from the committed state on another worker."""

    round: int
    job: str  # as the display names it: "client 3", "clients 3, 7", "global test chunk 2"
    error: str


@dataclass(frozen=True)
class CheckpointSaved:
    round: int
    path: str


Event = RoundStarted | RoundEnded | ClientFailed | JobRetried | CheckpointSaved
