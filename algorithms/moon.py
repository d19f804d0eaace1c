"""MOON: Li, He and Song, "Model-Contrastive Federated Learning" (CVPR 2021, arXiv:2103.16257), Sec. 3
and Alg. 1; a baseline of the FedSC paper (Sec. 5.1).

Each client trains the received global model ``w^t`` with cross-entropy plus a model-contrastive term
that pulls its representation ``z`` of a sample toward the global model's ``z_glob`` and away from
the representation ``z_prev`` of its own model from the last round it trained

.. math::  \\ell_{con} = -\\log \\frac{\\exp(\\mathrm{sim}(z, z_{glob}) / \\tau)}
           {\\exp(\\mathrm{sim}(z, z_{glob}) / \\tau) + \\exp(\\mathrm{sim}(z, z_{prev}) / \\tau)},
   \\qquad \\ell = \\ell_{CE} + \\mu\\, \\ell_{con}

with ``sim`` the cosine similarity. The server is FedAvg's (the sample-weighted mean, as MOON's).

Choices where the paper is silent or fedray's models differ (docs/algorithms/moon.md):
- [The representation] ``z`` is the model's ``features`` output, the input of its linear head: where
  MOON's network has its projection head (base encoder, two-layer MLP, then the classifier).
- [Frozen models] ``z_glob`` and ``z_prev`` come from the round's global weights and the client's
  last trained weights in eval mode (BatchNorm's running statistics, no dropout), without gradients.
- [A client's first round] a client that has never trained has no previous model: its contrastive
  term is 0 and it trains with cross-entropy alone, as in the official code's first round (an empty
  pool of previous models). Under partial participation the official code would contrast a client
  that has not trained yet with its untrained network of round 0; fedray waits for its first round.
- [What a client keeps] only its feature extractor's weights as last trained (MOON's model buffer
  of size 1); the head is never read for ``z``.
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


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """``l_con`` (the module docstring's equation), averaged over the batch: a cross-entropy over the
    two similarities ``[sim(z, z_glob), sim(z, z_prev)] / tau`` whose label is the first.
    Shapes: ``[B, d]`` each -> a scalar."""
    logits = torch.stack(
        [F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], dim=1
    )
    return F.cross_entropy(logits / tau, torch.zeros(len(z), dtype=torch.long, device=z.device))


# ------------------------------------------------------------------------------------------- client half


class MoonClient(ClientModule):
    """Cross-entropy plus ``mu * l_con`` against the global and its own previous feature extractor."""

    hp: MoonConfig
    previous: Tensor  # persistent: the extractor's floating state as this client last trained it
    has_previous: Tensor  # persistent: whether ``previous`` holds one yet
    global_features: Tensor  # held: the round's global extractor, flat

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.register_buffer("previous", torch.zeros_like(flat_state(model.features)))
        self.register_buffer("has_previous", torch.tensor(False))
        self.contrast = False  # this round's: read from has_previous once, not at every step

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.hold("global_features", flat_state(self.model.features))
        self.contrast = bool(self.has_previous)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits, z = self.model.forward_with_features(x)
        ce = F.cross_entropy(logits, y)
        self.record(Metrics.LOSS_TRAIN, ce)
        if not self.contrast:
            return ce
        z_glob = frozen_call(self.model.features, self.global_features, x)
        z_prev = frozen_call(self.model.features, self.previous, x)
        con = model_contrastive_loss(z, z_glob, z_prev, self.hp.tau)
        self.record("loss/contrastive", con)
        return ce + self.hp.mu * con

    def on_train_end(self) -> None:
        self.previous.copy_(flat_state(self.model.features))
        self.has_previous.fill_(True)


@register("moon", server=FedAvgServer, client=MoonClient)
@dataclass
class MoonConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # FedAvg's server: one architecture for all clients

    mu: float = 5.0  # weight of l_con: MOON's 5 on CIFAR-10 (1 on CIFAR-100 and Tiny-ImageNet)
    tau: float = 0.5  # temperature of l_con (MOON's)

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"moon.mu={self.mu}: must be >= 0")
        if not self.tau > 0:
            raise ConfigError(f"moon.tau={self.tau}: must be > 0")
