"""FML: Shen et al., "Federated Mutual Learning" (arXiv:2006.16765), as the FedSSA paper (Sec. 6.1) and
the FedL2G paper (Sec. 4) run it as a baseline: model-heterogeneous, with the smallest model of the
group shared.

Each client trains two models on its data at once: its own (possibly heterogeneous) private model,
with logits ``p``, and the shared "meme" model, with logits ``q``, whose weights the server averages.
They teach each other by deep mutual learning

.. math::  \\mathcal{L}_{private} = \\alpha\\, \\mathcal{L}_{CE}(p, y)
              + (1 - \\alpha)\\, \\mathrm{KL}(\\sigma(q) \\,\\|\\, \\sigma(p)),  \\qquad
           \\mathcal{L}_{meme} = \\beta\\, \\mathcal{L}_{CE}(q, y)
              + (1 - \\beta)\\, \\mathrm{KL}(\\sigma(p) \\,\\|\\, \\sigma(q))

(each KL's target distribution a constant for the model it trains). The server replaces the meme
model with the mean of the uploaded ones. Clients are tested with their private model; the meme
model is tested on the global test set (``acc/global``).

Choices where the papers are silent (docs/algorithms/fml.md):
- The meme model is the group's member with the fewest parameters (``ServerContext.smallest_arch``):
  the FedSSA paper's CNN-5, and the FedL2G paper's "smallest model of each group". In a homogeneous
  group it is the clients' own architecture.
- ``alpha = beta = 0.5``: FML's setting. HtFLlib's defaults (1.0) would switch the mutual terms off.
- The KL divergence is averaged over the batch (HtFLlib's ``nn.KLDivLoss()`` averages over batch and
  classes, a factor 1/C smaller), and its target is detached (HtFLlib lets both losses reach both models).
- The server's mean is unweighted over the uploaders, as HtFLlib's, and covers the meme model's whole
  state (HtFLlib averages its parameters only, leaving each client its own BatchNorm statistics).
- Both models train with one optimiser from ``train.*`` (the same step for both: the two losses touch
  disjoint parameters once the targets are detached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    RunningMean,
    Server,
    cpu_state,
    register,
)

# ------------------------------------------------------------------------------------------- the math


def distillation(student: Tensor, teacher: Tensor) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` averaged over the batch, the teacher a constant."""
    return F.kl_div(F.log_softmax(student, dim=1), F.softmax(teacher.detach(), dim=1), reduction="batchmean")


def mutual_losses(p: Tensor, q: Tensor, y: Tensor, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    """``(L_private, L_meme)`` of the module docstring, from the private logits ``p`` and the meme
    logits ``q`` (``[B, C]`` each) of one batch with labels ``y``."""
    private = alpha * F.cross_entropy(p, y) + (1 - alpha) * distillation(p, q)
    meme = beta * F.cross_entropy(q, y) + (1 - beta) * distillation(q, p)
    return private, meme


# ------------------------------------------------------------------------------------------- server half


class FMLServer(Server):
    """Holds the meme model; sends it, replaces it with the uploaders' mean."""

    hp: FMLConfig
    UPLINK_KEYS = ("meme",)
    STATE = ("meme",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.meme = ctx.model_of_arch(ctx.smallest_arch)
        self.summed = RunningMean()  # this round's uploaded meme models, summed as they arrive

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"meme": cpu_state(self.meme)})

    def uplinks_arrived(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        self.summed.add(rnd, {cid: (u["meme"], 1.0) for cid, u in uplinks.items()})

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if uplinks:
            self.meme.load_state_dict(
                self.summed.mean(rnd, {cid: (u["meme"], 1.0) for cid, u in uplinks.items()})
            )

    def global_model(self) -> nn.Module:
        return self.meme

    def eval_payload(self) -> Payload | None:
        return None  # each client is tested with its private model


# ------------------------------------------------------------------------------------------- client half


class FMLClient(ClientModule):
    """A private model (``model``, kept) and the meme model (``meme``, replaced by every downlink)."""

    hp: FMLConfig
    eval_mode = "own"  # the private model

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.meme = ctx.model_of_arch(ctx.smallest_arch)

    def receive(self, rnd: int, payload: Payload) -> None:
        self.meme.load_state_dict(payload["meme"])

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        p, q = self.model(x), self.meme(x)
        private, meme = mutual_losses(p, q, y, self.hp.alpha, self.hp.beta)
        self.record(Metrics.LOSS_TRAIN, private)
        self.record("loss/meme", meme)
        return private + meme

    def upload(self) -> Payload:
        return {"meme": cpu_state(self.meme)}


@register("fml", server=FMLServer, client=FMLClient)
@dataclass
class FMLConfig(AlgorithmConfig):
    alpha: float = 0.5  # the private model's weight on its cross-entropy (1 - alpha on the meme's KL)
    beta: float = 0.5  # the meme model's weight on its cross-entropy (1 - beta on the private's KL)

    def validate(self, cfg: ExperimentConfig) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigError(f"fml.{name}={value}: must be in [0, 1]")
