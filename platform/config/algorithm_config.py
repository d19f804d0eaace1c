"""The base every algorithm's hyperparameters derive from: its config section (``fedssa.mu0=0.7``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from fedray.platform.config.schema import ExperimentConfig


@dataclass
class AlgorithmConfig:
    """An algorithm's hyperparameters, with the paper's defaults, as dataclass fields.

    What the platform asks of every algorithm, declared here instead of looked up by name:
    ``ROUND_FIELDS`` are round counts that ``--scale`` shrinks with the run (a warm-up keeps its
    share), ``CLIENT_FIELDS`` are client counts it shrinks with the number of clients,
    ``MIN_PARTICIPANTS`` is the fewest clients per round the algorithm can aggregate,
    ``WHOLE_MODEL`` says it averages whole models (every client must run one architecture) and
    :meth:`needs_shared_features` that it exchanges representations (one feature size across the
    model group). Config validation checks the last two against ``model.group`` before Ray starts.
    """

    ROUND_FIELDS: ClassVar[tuple[str, ...]] = ()
    CLIENT_FIELDS: ClassVar[tuple[str, ...]] = ()
    MIN_PARTICIPANTS: ClassVar[int] = 1
    WHOLE_MODEL: ClassVar[bool] = False
    SHARED_FEATURES: ClassVar[bool] = False

    def needs_shared_features(self) -> bool:
        """Whether every client's model must produce one representation size (``ctx.feature_dim``)."""
        return self.SHARED_FEATURES

    def validate(self, cfg: ExperimentConfig) -> None:
        """Raise ConfigError (one line) for a value, or a combination with ``cfg``, the run cannot use."""

    def participants(self) -> int | None:
        """Clients per round when a hyperparameter fixes it (FedCross's K); None = train.fraction * N."""
        return None
