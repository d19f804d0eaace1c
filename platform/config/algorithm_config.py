"""The base every algorithm's hyperparameters derive from: its config section (``fedssa.mu0=0.7``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fedray.platform.errors import ContractError

if TYPE_CHECKING:
    from fedray.platform.config.schema import ExperimentConfig


Scales = Literal["rounds", "clients"]


def round_count(default: int) -> Any:
    """A hyperparameter that counts rounds (a warm-up, a ramp): ``--scale`` shrinks it with the run,
    so it keeps its share (>= 1; 0 stays 0, off)."""
    return field(default=default, metadata={"scales_with": "rounds"})


def client_count(default: int | None) -> Any:
    """A hyperparameter that counts clients (FedCross's K): ``--scale`` shrinks it like the number of
    clients, never below ``MIN_PARTICIPANTS`` (None stays None)."""
    return field(default=default, metadata={"scales_with": "clients"})


@dataclass
class AlgorithmConfig:
    """An algorithm's hyperparameters, with the paper's defaults, as dataclass fields.

    What the platform asks of every algorithm, declared here instead of looked up by name: a field
    declared with :func:`round_count` or :func:`client_count` is one ``--scale`` shrinks with the
    run or with the number of clients, ``MIN_PARTICIPANTS`` is the fewest clients per round the algorithm can aggregate,
    ``WHOLE_MODEL`` says it averages whole models (every client must run one architecture) and
    :meth:`needs_shared_features` that it exchanges representations (one feature size across the
    model group). Config validation checks the last two against ``model.group`` before Ray starts.
    """

    MIN_PARTICIPANTS: ClassVar[int] = 1
    WHOLE_MODEL: ClassVar[bool] = False
    SHARED_FEATURES: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old in ("ROUND_FIELDS", "CLIENT_FIELDS"):  # names in a string list went stale unnoticed
            if old in vars(cls):
                raise ContractError(
                    f"{cls.__name__}.{old}: declare each scaled field with round_count() or client_count() "
                    "instead of listing its name"
                )

    @classmethod
    def scaled_fields(cls, scales_with: Scales) -> list[str]:
        """The fields declared with :func:`round_count` (``"rounds"``) or :func:`client_count`."""
        return [f.name for f in fields(cls) if f.metadata.get("scales_with") == scales_with]

    def needs_shared_features(self) -> bool:
        """Whether every client's model must produce one representation size (``ctx.feature_dim``)."""
        return self.SHARED_FEATURES

    def validate(self, cfg: ExperimentConfig) -> None:
        """Raise ConfigError (one line) for a value, or a combination with ``cfg``, the run cannot use."""

    def participants(self) -> int | None:
        """Clients per round when a hyperparameter fixes it (FedCross's K); None = train.fraction * N."""
        return None
