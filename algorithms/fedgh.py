"""FedGH: Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header" (ACM MM
2023, arXiv:2303.13137); a baseline of the FedL2G paper (Sec. 4), in the form HtFLlib runs it.

Clients keep their own (possibly heterogeneous) feature extractors and share one linear header
``head = Linear(d, C)``. Each round a selected client replaces its header with the global one, trains
its whole model with cross-entropy, then uploads the mean representation of each class it holds,
from one eval-mode pass of the trained model over its training samples

.. math::  \\bar z_k^c = \\frac{1}{n_k^c} \\sum_{i: y_i = c} f_k(x_i)

The server trains the global header with cross-entropy on the uploaded ``(\\bar z_k^c, c)`` pairs, one
per client and class, with SGD (``server_lr``) for ``server_epochs`` epochs of shuffled mini-batches
of ``train.batch_size``, and sends it back.

Choices where the paper is silent (docs/algorithms/fedgh.md):
- The server's optimiser: plain SGD at lr 0.01 (HtFLlib's) in batches of the clients' batch size, for
  one epoch per round (the FedL2G paper: "even with one server epoch per iteration"; HtFLlib's
  ``--server_epochs`` defaults to 100).
- The initial global header is LG-FedAvg's, drawn from the run seed (docs/algorithms/fedssa.md,
  Initial global header); HtFLlib copies client 0's.
- Clients are tested with their own extractor under the current global header (HtFLlib's evaluation
  follows the header download).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.algorithms.lgfedavg import LGFedAvgClient, LGFedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    Payload,
    class_prototypes,
    eval_pass,
    register,
    stream,
    torch_generator,
)

stream("fedgh/prototype_order", "rnd")  # the server's shuffle of the uploaded prototypes each round

# ------------------------------------------------------------------------------------------- the math


def train_header(
    rows: Tensor, protos: Tensor, labels: Tensor, lr: float, epochs: int, batch: int, gen: torch.Generator
) -> Tensor:
    """The header ``[C, d+1]`` (rows ``[W_c | b_c]``) after ``epochs`` epochs of SGD on the mean
    cross-entropy of ``protos [M, d]`` with ``labels [M]``, each epoch in an order drawn from ``gen``."""
    d = rows.shape[1] - 1
    head = nn.Linear(d, rows.shape[0])
    with torch.no_grad():
        head.weight.copy_(rows[:, :d])
        head.bias.copy_(rows[:, d])
    optimizer = torch.optim.SGD(head.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=gen).split(batch):
            loss = F.cross_entropy(head(protos[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return torch.cat([head.weight, head.bias[:, None]], dim=1).detach()


# ------------------------------------------------------------------------------------------- server half


class FedGHServer(LGFedAvgServer):
    """LG-FedAvg's server (the global header ``[C, d+1]``, sent whole), training it on the uploaded
    class prototypes each round instead of averaging headers."""

    hp: FedGHConfig  # type: ignore[assignment]
    UPLINK_KEYS = ("classes", "protos")

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        pairs = [(u["protos"], u["classes"]) for u in uplinks.values() if len(u["classes"])]
        if not pairs:
            return
        protos = torch.cat([p for p, _ in pairs]).to(self.header.dtype)
        labels = torch.cat([c for _, c in pairs])
        cfg = self.ctx.cfg
        gen = torch_generator("fedgh/prototype_order", cfg.seed, rnd)
        self.header = train_header(
            self.header, protos, labels, self.hp.server_lr, self.hp.server_epochs, cfg.train.batch_size, gen
        )

    def eval_payload(self) -> Payload | None:
        return {"header": self.header}


# ------------------------------------------------------------------------------------------- client half


class FedGHClient(LGFedAvgClient):
    """LG-FedAvg's client (the global header replaces its own before training and testing), uploading
    its class prototypes instead of its header."""

    hp: FedGHConfig  # type: ignore[assignment]

    def upload(self) -> Payload:
        _, z, y = eval_pass(self.model, self.training_data())
        protos, counts = class_prototypes(z.float(), y, self.ctx.num_classes)
        held = counts > 0
        return {"classes": held.nonzero().squeeze(1), "protos": protos[held]}


@register("fedgh", server=FedGHServer, client=FedGHClient)
@dataclass
class FedGHConfig(AlgorithmConfig):
    SHARED_FEATURES: ClassVar[bool] = True  # one global header [C, d+1]: one d across the group

    server_lr: float = 0.01  # the server's SGD step on the header (HtFLlib's)
    server_epochs: int = 1  # epochs over the uploaded prototypes per round (the FedL2G paper's)

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.server_lr > 0:
            raise ConfigError(f"fedgh.server_lr={self.server_lr}: must be > 0")
        if self.server_epochs < 1:
            raise ConfigError(f"fedgh.server_epochs={self.server_epochs}: must be >= 1")
