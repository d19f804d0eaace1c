"""FedRCL: Seo, Kim, Kim and Han, "Relaxed Contrastive Learning for Federated Learning" (CVPR 2024,
arXiv:2401.04928); a baseline of the FedSC paper (Sec. 5.1, Table 1), in the form of the authors' code
(github.com/skynbe/FedRCL: ``clients/rcl_client.py``, ``utils/loss.py``, ``configs/client/fedrcl.yaml``).

FedAvg, with each client adding to cross-entropy a supervised contrastive term and a penalty on
representations of one class that grow too alike (the collapse the paper's relaxation prevents). With
``S = Z Z^T`` the cosine similarities of the batch's unit-length representations, for each sample ``i``:

- its positive ``p_i`` is its *least* similar sample of its own class (itself, ``S_ii = 1``, when it is
  alone), its negatives ``n_i`` the ``negatives`` *most* similar samples of other classes, and

  .. math::  \\ell^{scl}_i = -\\log \\frac{e^{p_i/\\tau}}{e^{p_i/\\tau} + \\sum_{n \\in n_i} e^{n/\\tau}}

- its penalty reads the same least similar classmate ``s_i`` (other than itself) when ``s_i`` is at
  least ``threshold``, i.e. when every classmate of the batch is that close:

  .. math::  \\ell^{div}_i = -\\log \\frac{e^{1/\\tau}}{e^{1/\\tau} + e^{s_i/\\tau}} = \\mathrm{softplus}((s_i - 1)/\\tau)

and ``l = l_CE + scl_weight * L^scl + penalty_weight * L^div``, each ``L`` the mean over the levels of
the batch means: the extractor's representations before their ReLU (a ResNet's stem and stages),
globally average-pooled, as the authors' code reads them. The server is FedAvg's.

Choices where the paper is silent or fedray's models differ (docs/algorithms/fedrcl.md):
- [Levels] ``levels: all`` reads every level the model declares (``FedModel.feature_levels``: a
  ResNet's stem and each stage, a small CNN's convolutions and its last layer), before its ReLU, as
  the authors' ``branch_level: [0,1,2,3,4]`` with ``feature_relu: False``; ``levels: last`` the
  deepest alone (their ``[4]``). A model that declares none (an LSTM, VGG) gives ``z``, the head's
  input, alone.
- [A pair left out] a sample with no classmate in the batch has no penalty, and a sample with fewer
  negatives than ``negatives`` uses those it has (the authors' code scores the missing ones 0).
- The optimiser is the run's ``train.*`` (the authors': SGD lr 0.1 decayed by 0.998 a round, no
  momentum, weight decay 1e-3, gradient clip 10).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import AlgorithmConfig, ConfigError, ExperimentConfig, Metrics, register

# ------------------------------------------------------------------------------------------- the math


def relaxed_contrastive_terms(
    z: Tensor, y: Tensor, tau: float, threshold: float, negatives: int
) -> tuple[Tensor, Tensor]:
    """``(mean_i l^scl_i, mean_i l^div_i)`` (the module docstring's equations) for the batch's
    representations ``z [B, d]`` and labels ``y [B]``."""
    zn = F.normalize(z, dim=1)
    sim = zn @ zn.T
    same = y[:, None] == y[None, :]
    itself = torch.eye(len(y), dtype=torch.bool, device=z.device)
    inf = torch.tensor(float("inf"), dtype=sim.dtype, device=sim.device)
    positive = torch.where(same, sim, inf).min(dim=1).values  # itself included: 1 when alone
    k = min(negatives, len(y) - 1)
    top = torch.where(same, -inf, sim).topk(k, dim=1).values if k > 0 else sim.new_empty(len(y), 0)
    logits = torch.cat([positive[:, None], top], dim=1) / tau  # a missing negative is -inf: e^-inf = 0
    scl = -torch.log_softmax(logits, dim=1)[:, 0]
    classmate = torch.where(same & ~itself, sim, inf).min(dim=1).values
    relaxed = classmate.isfinite() & (classmate >= threshold)
    div = torch.where(relaxed, F.softplus((classmate - 1) / tau), torch.zeros_like(classmate))
    return scl.mean(), div.mean()


def pooled(h: Tensor) -> Tensor:
    """A level's output as one vector per sample: ``[B, C, H, W]`` averaged over H and W, else flat."""
    return F.adaptive_avg_pool2d(h, 1).flatten(1) if h.dim() == 4 else h.flatten(1)


@contextlib.contextmanager
def outputs_of(modules: list[nn.Module]) -> Iterator[list[Tensor]]:
    """The outputs of ``modules`` in the forward passes of the block, in the order they ran; copies,
    since the ReLU after a level may overwrite it in place (the copy keeps its gradient)."""
    outputs: list[Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _in, out: outputs.append(out.clone())) for m in modules]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


# ------------------------------------------------------------------------------------------- client half


class FedRCLClient(FedAvgClient):
    """FedAvg's client with the relaxed contrastive terms added to cross-entropy."""

    hp: FedRCLConfig

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        levels = model.feature_levels()
        self.levels = levels if self.hp.levels == "all" else levels[-1:]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        with outputs_of(self.levels) as outputs:
            logits, z = self.model.forward_with_features(x)
        ce = F.cross_entropy(logits, y)
        hp = self.hp
        terms = [
            relaxed_contrastive_terms(rep, y, hp.tau, hp.threshold, hp.negatives)
            for rep in ([*map(pooled, outputs)] or [z])
        ]
        scl = torch.stack([t[0] for t in terms]).mean()
        div = torch.stack([t[1] for t in terms]).mean()
        self.record(Metrics.LOSS_TRAIN, ce)
        self.record("loss/scl", scl)
        self.record("loss/penalty", div)
        self.record("fedrcl/levels", len(terms))  # what the model declared: 1 is z alone
        return ce + hp.scl_weight * scl + hp.penalty_weight * div


@register("fedrcl", server=FedAvgServer, client=FedRCLClient)
@dataclass
class FedRCLConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # FedAvg's server: one architecture for all clients

    tau: float = 0.05  # temperature of both terms (the authors')
    threshold: float = 0.7  # classmates at least this similar are penalised (the authors')
    negatives: int = 2  # hardest other-class samples per anchor (the authors' topk_neg)
    scl_weight: float = 1.0  # the authors' pair weights: 1 and 1
    penalty_weight: float = 1.0
    # all: every level the model declares (the authors' five on a ResNet); last: the deepest alone
    levels: Literal["all", "last"] = "all"

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.tau > 0:
            raise ConfigError(f"fedrcl.tau={self.tau}: must be > 0")
        if not -1 <= self.threshold <= 1:
            raise ConfigError(f"fedrcl.threshold={self.threshold}: a cosine similarity, in [-1, 1]")
        if self.negatives < 1:
            raise ConfigError(f"fedrcl.negatives={self.negatives}: must be >= 1")
        for name in ("scl_weight", "penalty_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"fedrcl.{name}={getattr(self, name)}: must be >= 0")
