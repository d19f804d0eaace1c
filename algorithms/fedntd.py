"""FedNTD: Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in Federated
Learning" (NeurIPS 2022, arXiv:2106.03097), Sec. 4; a baseline of the FedSC paper (Sec. 5.1).

Each client trains the received global model with cross-entropy plus a distillation from that global
model restricted to the classes that are not the sample's label. With ``q~`` a softmax at temperature
``tau`` over the ``C - 1`` not-true logits, for a sample of label ``y``

.. math::  \\mathcal{L} = \\mathcal{L}_{CE}(q_l, y) + \\beta\\, \\mathcal{L}_{NTD},  \\qquad
           \\mathcal{L}_{NTD} = \\sum_{c \\ne y} \\tilde q_g^c \\log \\frac{\\tilde q_g^c}{\\tilde q_l^c}

averaged over the batch (KL divergence, the official code's ``KLDivLoss(reduction="batchmean")``,
without a ``tau^2`` factor). The server is FedAvg's.

Choices where the paper is silent (docs/algorithms/fedntd.md):
- The global model's logits come from its weights as received, in eval mode (BatchNorm's running
  statistics, no dropout), without gradient (:func:`~fedray.platform.api.frozen_call`).
- ``tau = 1`` and ``beta = 1``: the official repository's configuration (``config/fedntd.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fedray.algorithms.fedavg import FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    flat_state,
    frozen_call,
    register,
)

# ------------------------------------------------------------------------------------------- the math


def not_true_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Each row without its label's column, the others in order: ``[B, C]`` -> ``[B, C-1]``."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(len(labels), device=labels.device), labels] = False
    return logits[keep].view(len(labels), logits.shape[1] - 1)


def not_true_distillation(logits: Tensor, teacher_logits: Tensor, labels: Tensor, tau: float) -> Tensor:
    """``L_NTD``: KL(teacher || student) of the not-true softmaxes at ``tau``, averaged over the batch."""
    student = F.log_softmax(not_true_logits(logits, labels) / tau, dim=1)
    teacher = F.softmax(not_true_logits(teacher_logits, labels) / tau, dim=1)
    return F.kl_div(student, teacher, reduction="batchmean")


# ------------------------------------------------------------------------------------------- client half


class FedNTDClient(ClientModule):
    """Cross-entropy plus ``beta * L_NTD`` against the round's global model; keeps nothing between rounds."""

    hp: FedNTDConfig
    keeps_state = False  # the downlink overwrites the whole model; the teacher is this round's
    global_weights: Tensor  # held: the received global model, flat

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.hold("global_weights", flat_state(self.model))

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x)
        ce = F.cross_entropy(logits, y)
        self.record(Metrics.LOSS_TRAIN, ce)
        teacher = frozen_call(self.model, self.global_weights, x)
        ntd = not_true_distillation(logits, teacher, y, self.hp.tau)
        self.record("loss/ntd", ntd)
        return ce + self.hp.beta * ntd


@register("fedntd", server=FedAvgServer, client=FedNTDClient)
@dataclass
class FedNTDConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # FedAvg's server: one architecture for all clients

    tau: float = 1.0  # temperature of the not-true softmaxes
    beta: float = 1.0  # weight of L_NTD

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.tau > 0:
            raise ConfigError(f"fedntd.tau={self.tau}: must be > 0")
        if not self.beta >= 0:
            raise ConfigError(f"fedntd.beta={self.beta}: must be >= 0")
