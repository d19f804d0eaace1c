"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020, arXiv:1812.06127).

Clients minimise the local loss plus a proximal term that keeps them near the round's global model

.. math::  h_k(w) = F_k(w) + \\frac{\\mu}{2} \\lVert w - w^t \\rVert^2

The server half is FedAvg's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.utils import parameters_to_vector

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    register,
)


def proximal_term(params: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``||w - w^t||^2`` of the flattened parameter vectors ``[P]``."""
    return ((params - anchor) ** 2).sum()


class FedProxClient(FedAvgClient):
    hp: FedProxConfig
    anchor: torch.Tensor  # held

    def receive(self, rnd: int, payload) -> None:
        super().receive(rnd, payload)
        self.hold("anchor", parameters_to_vector(self.model.parameters()).detach())  # w^t

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        prox = proximal_term(parameters_to_vector(self.model.parameters()), self.anchor)
        self.record("loss/prox", prox)
        return loss + self.hp.mu / 2 * prox


@register("fedprox", server=FedAvgServer, client=FedProxClient)
@dataclass
class FedProxConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True
    mu: float = 0.01  # FedCross paper: 0.01 on CIFAR-10, 0.001 on CIFAR-100

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.mu < 0:
            raise ConfigError(f"fedprox.mu={self.mu}: must be >= 0")
