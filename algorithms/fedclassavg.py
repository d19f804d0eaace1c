"""FedClassAvg: Jang, Ha, Jung and Yoon, "FedClassAvg: Local Representation Learning for Personalized
Federated Learning on Heterogeneous Neural Networks" (ICPP 2022, arXiv:2210.14226); a baseline of the
FedSSA paper (Sec. 2 and 6.1, Tables 1-2), in the form of the authors' code (github.com/hukla/FedClassAvg).

Clients keep their own (possibly heterogeneous) feature extractors and share one linear classifier
``head = Linear(d, C)``, averaged by the server as LG-FedAvg's header is (weighted by train sizes).
A selected client loads the global classifier ``phi_g`` and trains its whole model on two augmented
views ``x', x''`` of every image, with

.. math::  \\ell = \\ell_{CE}(\\phi(z'), y) + \\ell_{SupCon}(z', z''; y)
           + \\frac{\\mu}{2} \\sum_{p \\in \\{W, b\\}} \\mathrm{mean}\\big((p - p_g)^2\\big)

where ``z = f(x)`` is the extractor's representation and ``l_SupCon`` is the supervised contrastive
loss of Khosla et al. (2020) over the ``2B`` representations: for an anchor ``i`` with positives
``P(i)`` (the other samples of its class, its other view included) and every other sample ``A(i)``,

.. math::  \\ell_{SupCon} = \\frac{1}{2B} \\sum_i -\\frac{\\tau}{\\tau_b} \\frac{1}{|P(i)|}
           \\sum_{p \\in P(i)} \\log \\frac{\\exp(z_i \\cdot z_p / \\tau)}{\\sum_{a \\in A(i)} \\exp(z_i \\cdot z_a / \\tau)}

Choices where the paper is silent or fedray's models differ (docs/algorithms/fedclassavg.md):
- [Loss] ``l_SupCon`` on unit-length representations with ``tau = tau_b = 0.07``, Khosla et al.'s:
  the authors' form (not normalised, ``tau = 100``: ``normalize=false temperature=100``) does not
  learn under SGD. The proximal term is the authors': ``mu/2`` times the sum of ``MSELoss`` (a mean per
  tensor), ``mu = 0.1`` (their README's run).
- [Views] two ``crop_flip`` draws of each batch (fedray's CIFAR recipe, drawn from the client's own
  stream), not SimCLR's colour jitter and resized crops; the run's ``data.augment`` must be ``none``.
  ``flip: false`` keeps them unmirrored, for digits (the digits configs set it).
- [Warm-up] the authors' code trains every client one local epoch before round 1; fedray does not.
- [Evaluation] each client is tested with its own extractor and the classifier it last trained, as
  the authors' code tests it (``fedclassavg.eval_head: local``).
- The global classifier starts from LG-FedAvg's seeded header (docs/algorithms/fedssa.md, Initial global
  header); the optimiser is the run's ``train.*`` (the authors' code: Adam, lr 1e-4, betas
  (0.5, 0.999), which ``train.optimizer=adam train.lr=1e-4 train.momentum=0.5`` gives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fedray.algorithms.lgfedavg import LGFedAvgClient, LGFedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    check_views_fit,
    crop_flip_views,
    register,
    stream,
    torch_generator,
)

stream("fedclassavg/views", "rnd", "client")  # the crop-and-flip views of a client's round, step by step

# ------------------------------------------------------------------------------------------- the math


def supcon_loss(z: Tensor, labels: Tensor, tau: float, tau_base: float) -> Tensor:
    """``l_SupCon`` (the module docstring's equation) of ``z [2B, d]``, the rows of every view stacked
    (view 1's ``B`` rows, then view 2's), with ``labels [B]``: every row an anchor, every other row a
    candidate, the rows of its class its positives. A scalar."""
    y = labels.repeat(len(z) // len(labels))
    sim = (z @ z.T) / tau
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)
    log_prob = sim - torch.logsumexp(sim.masked_fill(self_pair, float("-inf")), dim=1, keepdim=True)
    positive = (y[:, None] == y[None, :]) & ~self_pair
    mean_log_prob_pos = (log_prob * positive).sum(1) / positive.sum(1)
    return -(tau / tau_base) * mean_log_prob_pos.mean()


def classifier_proximal(weight: Tensor, bias: Tensor, global_rows: Tensor) -> Tensor:
    """``sum_{p in {W, b}} mean((p - p_g)^2)``: a classifier's ``weight [C, d]`` and ``bias [C]``
    against the global one's rows ``[C, d+1]`` of ``[W_g | b_g]``, a mean over each tensor's entries."""
    d = weight.shape[1]
    return ((weight - global_rows[:, :d]) ** 2).mean() + ((bias - global_rows[:, d]) ** 2).mean()


# ------------------------------------------------------------------------------------------- server half


class FedClassAvgServer(LGFedAvgServer):
    """LG-FedAvg's server: the global classifier ``[C, d+1]``, sent whole, averaged by train sizes."""

    hp: FedClassAvgConfig  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------- client half


class FedClassAvgClient(LGFedAvgClient):
    """Loads the global classifier, trains on two views with cross-entropy, the supervised contrastive
    loss and a proximal pull of its classifier toward the global one; uploads its classifier."""

    hp: FedClassAvgConfig  # type: ignore[assignment]
    global_rows: Tensor  # held: this round's global classifier, rows [W | b]
    views: torch.Generator  # this round's draws of views, drawn anew in every receive

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.hold("global_rows", payload["header"])
        self.views = torch_generator("fedclassavg/views", self.ctx.cfg.seed, rnd, self.ctx.client_id)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        z = self.model.features(
            torch.cat(crop_flip_views(x, self.views, flip=self.hp.flip))
        )  # one pass: BatchNorm sees both views
        zc = F.normalize(z, dim=1) if self.hp.normalize else z
        ce = F.cross_entropy(self.model.head(z[: len(y)]), y)
        con = supcon_loss(zc, y, self.hp.temperature, self.hp.base_temperature)
        prox = classifier_proximal(self.model.head.weight, self.model.head.bias, self.global_rows)
        self.record(Metrics.LOSS_TRAIN, ce)
        self.record("loss/supcon", con)
        self.record("loss/proximal", prox)
        return ce + con + self.hp.mu / 2 * prox


@register("fedclassavg", server=FedClassAvgServer, client=FedClassAvgClient)
@dataclass
class FedClassAvgConfig(AlgorithmConfig):
    SHARED_FEATURES: ClassVar[bool] = True  # one global classifier [C, d+1]: one d across the group

    mu: float = 0.1  # weight of the classifier's proximal term (the authors' README run)
    temperature: float = 0.07  # tau of l_SupCon (Khosla et al.'s; the authors' code: 100, unnormalised)
    base_temperature: float = 0.07  # tau_b: l_SupCon is scaled by tau / tau_b (SupConLoss's default)
    normalize: bool = True  # l_SupCon on unit-length representations (Khosla et al.'s; not the authors' code)
    flip: bool = True  # views mirrored half the time (the authors'); false where a mirror changes the class
    eval_head: Literal["global", "local"] = "local"  # the classifier clients are tested with

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"fedclassavg.mu={self.mu}: must be >= 0")
        if not self.temperature > 0:
            raise ConfigError(f"fedclassavg.temperature={self.temperature}: must be > 0")
        if not self.base_temperature > 0:
            raise ConfigError(f"fedclassavg.base_temperature={self.base_temperature}: must be > 0")
        check_views_fit(cfg)
