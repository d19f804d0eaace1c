"""FedNH: Dai, Chen, Wei, Wang, Gu, Sen and Roy, "Tackling Data Heterogeneity in Federated Learning with
Class Prototypes" (AAAI 2023, arXiv:2211.13339); a baseline of the FedSC paper (Sec. 5.1, Table 1), in
the form of the authors' code (github.com/Yutong-Dai/FedNH, ``src/flbase/strategies/FedNH.py``).

The classifier is a set of class prototypes ``P [C, d]`` of unit length, spread over the sphere at
the start and never trained by clients, with a learned scale ``s``: a sample's scores are

.. math::  \\mathrm{logits}_c = s \\, \\langle \\hat z, P_c \\rangle, \\qquad \\hat z = z / \\lVert z \\rVert

A selected client trains its extractor and ``s`` with cross-entropy on these scores, then uploads its
model and, for each class it holds, the unit-length mean of its samples' unit representations
``mu_kc = normalize(mean_i z_hat_i)`` with the class's count ``n_kc``. The server averages the models
(an unweighted mean over the round's clients, as the authors' code) and moves each class's prototype
toward the count-weighted mean of the uploads, smoothed by ``rho``:

.. math::  P_c \\leftarrow \\mathrm{normalize}\\Big(\\rho P_c + (1 - \\rho)\\,
           \\mathrm{normalize}\\big(\\textstyle\\sum_k n_{kc} \\mu_{kc}\\big)\\Big)

A class no client of the round holds keeps its prototype.

Choices where the paper is silent or fedray's models differ (docs/algorithms/fednh.md):
- [The classifier in a fedray model] the model's linear head holds ``s P`` (bias 0), so a FedNH model
  is a plain zoo model: its scores are its head on unit-length features (``model_scores``), and its
  plain forward pass ranks the classes the same way (``s > 0``, ``||z|| > 0``).
- [Initial prototypes] random orthonormal rows (the authors' ``orthogonal`` init, every shipped
  config's), drawn from the run seed; ``s`` starts at 1 (their CNN's) and is learned.
- [Uploaded prototypes] from one eval-mode pass of the trained model over the client's training
  samples (``eval_pass``), without augmentation (the authors' pass reads their augmented loader).
- [Optimiser] the run's ``train.*``: the authors' code decays lr by 0.99 a round (``train.lr_decay=0.99``;
  the default is constant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.algorithms.fedavg import FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    FedModel,
    Metrics,
    Payload,
    class_prototypes,
    cpu_state,
    eval_pass,
    register,
    scatter_rows,
    stream,
    torch_generator,
    unweighted_models,
)

stream("fednh/prototypes")  # the server's initial prototypes

# ------------------------------------------------------------------------------------------- the math


def initial_prototypes(num_classes: int, feature_dim: int, gen: torch.Generator) -> Tensor:
    """``[C, d]`` random orthonormal rows; where ``C > d``, when no ``C`` rows of ``d`` can be
    orthogonal, the orthogonal draw's rows scaled to unit length."""
    rows = nn.init.orthogonal_(torch.empty(num_classes, feature_dim), generator=gen)
    return F.normalize(rows, dim=1)


def cosine_scores(z: Tensor, prototypes: Tensor, scale: Tensor) -> Tensor:
    """``s <z_hat, P_c>`` for every class: ``z [B, d]``, unit ``prototypes [C, d]``, ``scale`` a scalar."""
    return scale * F.normalize(z, dim=1) @ prototypes.T


def client_prototypes(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``mu_kc = normalize(mean_i z_hat_i)`` per class ``[C, d]`` (zero rows for absent classes), and
    the counts ``n_kc [C]``."""
    means, counts = class_prototypes(F.normalize(z, dim=1), y, num_classes)
    return F.normalize(means, dim=1), counts


def smoothed_prototypes(prototypes: Tensor, uploads: Tensor, counts: Tensor, rho: float) -> Tensor:
    """The server's update (the module docstring's second equation): ``prototypes [C, d]``, the
    round's ``uploads [K, C, d]`` (``mu_kc``, zero where a client lacks the class) and ``counts [K, C]``
    (``n_kc``). A class with no count keeps its prototype: its weighted sum is 0, which ``normalize``
    leaves at 0, and ``normalize(rho P_c) = P_c``."""
    weighted = torch.einsum("kc,kcd->cd", counts.to(uploads.dtype), uploads)
    return F.normalize(rho * prototypes + (1 - rho) * F.normalize(weighted, dim=1), dim=1)


def prototypes_and_scale(head: nn.Linear) -> tuple[Tensor, Tensor]:
    """A FedNH head ``s P`` (bias 0) split into unit prototypes ``P [C, d]`` and the scale ``|s|``. A
    negative ``s`` comes back as ``-P`` and ``|s|``: the same scores, ``|s| <z_hat, -P_c>``."""
    norms = head.weight.detach().norm(dim=1).clamp(min=1e-12)
    return head.weight.detach() / norms[:, None], norms.mean()


def scale_along(head: nn.Linear, prototypes: Tensor) -> Tensor:
    """The signed scale ``s`` of a head ``s P`` whose prototypes ``P`` are known (the server's)."""
    return (head.weight.detach() * prototypes).sum(1).mean()


@torch.no_grad()
def write_head(head: nn.Linear, prototypes: Tensor, scale: Tensor | float) -> None:
    """``head.weight = s P`` and ``head.bias = 0``, in place."""
    head.weight.copy_(scale * prototypes)
    head.bias.zero_()


# ------------------------------------------------------------------------------------------- server half


class FedNHServer(FedAvgServer):
    """FedAvg's server over whole models, unweighted, plus the prototypes' smoothed update. The global
    model's head is ``s P``: the clients' mean scale times the prototypes."""

    hp: FedNHConfig  # type: ignore[assignment]
    UPLINK_KEYS = ("model", "classes", "protos", "counts")  # no train size: the mean is unweighted
    STATE = ("model", "prototypes")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        gen = torch_generator("fednh/prototypes", ctx.cfg.seed)
        self.prototypes = initial_prototypes(ctx.num_classes, self.model.head.in_features, gen)
        write_head(self.model.head, self.prototypes, self.hp.scale_init)

    def models_weighted(self, uplinks: dict[int, Payload]) -> dict:
        return unweighted_models(uplinks)  # the authors' plain mean over the round's clients

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        super().aggregate(rnd, uplinks)
        scale = scale_along(self.model.head, self.prototypes)  # the clients' mean s: each head is s_k P
        uploads, _ = scatter_rows(
            [u["protos"] for u in uplinks.values()],
            [u["classes"] for u in uplinks.values()],
            self.ctx.num_classes,
        )
        counts, _ = scatter_rows(
            [u["counts"][:, None].to(uploads.dtype) for u in uplinks.values()],
            [u["classes"] for u in uplinks.values()],
            self.ctx.num_classes,
        )
        self.prototypes = smoothed_prototypes(
            self.prototypes, uploads.to(self.prototypes.dtype), counts.squeeze(2), self.hp.rho
        )
        write_head(self.model.head, self.prototypes, scale)


# ------------------------------------------------------------------------------------------- client half


class FedNHClient(ClientModule):
    """Trains the extractor and the scale on ``s <z_hat, P_c>`` with the prototypes frozen; uploads the
    model (head ``s P``) and its classes' unit-length prototypes with their counts."""

    hp: FedNHConfig
    keeps_state = False  # the downlink is the whole model, prototypes and scale in its head
    prototypes: Tensor  # held: this round's P [C, d]

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=self.hp.learn_scale)

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        prototypes, scale = prototypes_and_scale(self.model.head)
        self.hold("prototypes", prototypes)
        with torch.no_grad():
            self.scale.copy_(scale)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(cosine_scores(self.model.features(x), self.prototypes, self.scale), y)
        self.record(Metrics.LOSS_TRAIN, loss)
        self.record("scale", self.scale.detach().clone())  # a copy: SGD changes the parameter in place
        return loss

    def upload(self) -> Payload:
        write_head(self.model.head, self.prototypes, self.scale.detach())
        _, z, y = eval_pass(self.model, self.training_data())
        protos, counts = client_prototypes(z.float(), y, self.ctx.num_classes)
        held = counts > 0
        return {
            "model": cpu_state(self.model),
            "classes": held.nonzero().squeeze(1),
            "protos": protos[held],
            "counts": counts[held],
        }

    @staticmethod
    def model_scores(model: FedModel, x: Tensor) -> Tensor:
        return model.head(F.normalize(model.features(x), dim=1))


@register("fednh", server=FedNHServer, client=FedNHClient)
@dataclass
class FedNHConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # averages whole models: one architecture for all clients

    rho: float = 0.9  # smoothing: the share of the old prototype in its update (the authors' 0.9)
    scale_init: float = 1.0  # s at round 0 (the authors' CNN; 20 for their ResNet)
    learn_scale: bool = True  # clients train s (the authors' default; false keeps scale_init)

    def validate(self, cfg: ExperimentConfig) -> None:
        if not 0 <= self.rho < 1:
            raise ConfigError(f"fednh.rho={self.rho}: must be in [0, 1)")
        if not self.scale_init > 0:
            raise ConfigError(f"fednh.scale_init={self.scale_init}: must be > 0")
