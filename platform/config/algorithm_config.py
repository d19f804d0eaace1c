"""The base every algorithm's hyperparameters derive from: its config section (``fedssa.mu0=0.7``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from fedray.platform.config import ExperimentConfig


@dataclass
class AlgorithmConfig:
    """An algorithm's hyperparameters, with the paper's defaults, as dataclass fields.

    What the platform asks of every algorithm, declared here instead of looked up by name:
    ``ROUND_FIELDS`` are round counts that ``--scale`` shrinks with the run (a warm-up keeps its
    share), ``CLIENT_FIELDS`` are client counts it shrinks with the number of clients,
    ``MIN_PARTICIPANTS`` is the fewest clients per round the algorithm can aggregate.
    """

    ROUND_FIELDS: ClassVar[tuple[str, ...]] = ()
    CLIENT_FIELDS: ClassVar[tuple[str, ...]] = ()
    MIN_PARTICIPANTS: ClassVar[int] = 1

    def validate(self, cfg: ExperimentConfig) -> None:
        """Raise ConfigError (one line) for a value, or a combination with ``cfg``, the run cannot use."""

    def participants(self) -> int | None:
        """Clients per round when a hyperparameter fixes it (FedCross's K); None = train.fraction * N."""
        return None
