"""FedKD: Wu et al., "Communication-efficient federated learning via knowledge distillation" (Nature
Communications 2022, arXiv:2108.13323), as the FedSSA paper (Sec. 6.1) and the FedL2G paper (Sec. 4)
run it as a baseline through HtFLlib: model-heterogeneous, the smallest model of the group shared.

Each client trains its own (possibly heterogeneous) mentor model, logits ``y_t`` and representation
``H_t``, and the shared mentee model, ``y_s`` and ``H_s``, by adaptive mutual distillation: with the
task losses ``CE_t``, ``CE_s`` and a learned projection ``W_h`` of the mentee's representation onto the
mentor's,

.. math::  \\mathcal{L}_t = CE_t + \\frac{\\mathrm{KL}(y_s \\| y_t) + \\mathrm{MSE}(H_t, W_h H_s)}{CE_t + CE_s},
   \\qquad \\mathcal{L}_s = CE_s + \\frac{\\mathrm{KL}(y_t \\| y_s) + \\mathrm{MSE}(H_t, W_h H_s)}{CE_t + CE_s}

(the mentor minimises ``L_t``, the mentee ``L_s``; the distillations are weighted down when the two
models predict badly). The mentee travels compressed: every weight matrix (a convolution's as
``[out, in * k * k]``) as its truncated SVD, keeping the fewest singular values whose squared sum
exceeds the fraction ``T_r`` of the total, ``T_r`` rising linearly from ``energy_start`` at the first round to
``energy_end`` at the last. The server averages the recovered mentees and compresses the mean for the
next downlink. Clients are tested with their mentor; the mean mentee is tested on the global test set.

Choices where the papers are silent (docs/algorithms/fedkd.md):
- The mentee is the group's member with the fewest parameters (``ServerContext.smallest_arch``), as
  for FML.
- Each KL and each adaptive weight ``1 / (CE_t + CE_s)`` is a constant for the gradient (HtFLlib lets
  them carry gradient); each model gets the gradient of its own loss, ``W_h`` that of the shared MSE.
- The KL divergence is averaged over the batch (HtFLlib's ``nn.KLDivLoss()``: over batch and classes).
- Compression follows HtFLlib (the mentee's weights each way, ``T`` from 0.95 to 0.98, the unweighted
  mean), but a convolution is one matrix, where HtFLlib takes one SVD per ``k x k`` kernel slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    Server,
    cpu_state,
    register,
    weighted_average,
)

# ------------------------------------------------------------------------------------------- the math


def adaptive_losses(
    logits_t: Tensor, logits_s: Tensor, h_t: Tensor, h_s_projected: Tensor, y: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(CE_t + KL(y_s||y_t) / w, CE_s + KL(y_t||y_s) / w, MSE(H_t, W_h H_s) / w)`` with
    ``w = CE_t + CE_s`` a constant: the mentor's and the mentee's own terms, and the shared one."""
    ce_t, ce_s = F.cross_entropy(logits_t, y), F.cross_entropy(logits_s, y)
    weight = (ce_t + ce_s).detach()
    kl_t = F.kl_div(F.log_softmax(logits_t, 1), F.softmax(logits_s.detach(), 1), reduction="batchmean")
    kl_s = F.kl_div(F.log_softmax(logits_s, 1), F.softmax(logits_t.detach(), 1), reduction="batchmean")
    hidden = F.mse_loss(h_t, h_s_projected)
    return ce_t + kl_t / weight, ce_s + kl_s / weight, hidden / weight


def energy_at(rnd: int, rounds: int, start: float, end: float) -> float:
    """``T_r``: ``start`` at round 0, rising linearly to ``end`` at the last round ``rounds - 1`` (as
    HtFLlib's, whose loop runs one round more than it divides by)."""
    return start + rnd / max(rounds - 1, 1) * (end - start)


def compress(tensor: Tensor, energy: float) -> Tensor | dict[str, Tensor]:
    """A weight of two or more dimensions as its truncated SVD ``{"u", "s", "v"}`` of the matrix
    ``[out, rest]``, with the fewest singular values whose squared sum exceeds ``energy`` of the total
    (all of them if none does); a smaller tensor as it is."""
    if tensor.dim() < 2 or not tensor.is_floating_point():
        return tensor
    u, s, vh = torch.linalg.svd(tensor.reshape(tensor.shape[0], -1).double(), full_matrices=False)
    total = (s**2).sum()
    if total == 0:
        return tensor
    kept = int((torch.cumsum(s**2, 0) > energy * total).nonzero()[0]) + 1 if energy < 1 else len(s)
    dtype = tensor.dtype
    return {
        "u": u[:, :kept].to(dtype),
        "s": s[:kept].to(dtype),
        "v": vh[:kept].to(dtype),
        "shape": torch.tensor(tensor.shape),
    }


def recover(part: Tensor | dict[str, Tensor]) -> Tensor:
    """The tensor :func:`compress` took apart: ``U diag(s) V`` in its shape, or the tensor itself."""
    if isinstance(part, Tensor):
        return part
    return ((part["u"] * part["s"]) @ part["v"]).reshape(part["shape"].tolist())


def compress_state(state: dict[str, Tensor], energy: float) -> dict[str, Any]:
    return {k: compress(v, energy) for k, v in state.items()}


def recover_state(compressed: dict[str, Any]) -> dict[str, Tensor]:
    return {k: recover(v) for k, v in compressed.items()}


# ------------------------------------------------------------------------------------------- server half


class FedKDServer(Server):
    """Holds the mean mentee; sends it compressed, replaces it with the uploaders' recovered mean."""

    hp: FedKDConfig
    UPLINK_KEYS = ("mentee",)
    STATE = ("mentee",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.mentee = ctx.model_of_arch(ctx.smallest_arch)

    def energy(self, rnd: int) -> float:
        return energy_at(rnd, self.ctx.cfg.rounds, self.hp.energy_start, self.hp.energy_end)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        energy = self.energy(rnd)
        return self.broadcast(
            selected, {"mentee": compress_state(cpu_state(self.mentee), energy), "energy": energy}
        )

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        # (not summed early in uplinks_arrived: the recovered states are new objects each time, which a
        # RunningMean would sum again)
        if uplinks:
            recovered = [recover_state(u["mentee"]) for u in uplinks.values()]
            self.mentee.load_state_dict(weighted_average(recovered, [1.0] * len(recovered)))

    def global_model(self) -> nn.Module:
        return self.mentee

    def eval_payload(self) -> Payload | None:
        return None  # each client is tested with its mentor


# ------------------------------------------------------------------------------------------- client half


class FedKDClient(ClientModule):
    """The mentor (``model``, kept), the mentee (``mentee``, replaced by every downlink) and the
    projection ``W_h`` of the mentee's representation onto the mentor's (kept)."""

    hp: FedKDConfig
    eval_mode = "own"  # the mentor

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.mentee = ctx.model_of_arch(ctx.smallest_arch)
        self.projection = nn.Linear(self.mentee.feature_dim, model.feature_dim, bias=False)  # W_h
        self.energy = self.hp.energy_start  # this round's T_r, from the downlink

    def receive(self, rnd: int, payload: Payload) -> None:
        self.mentee.load_state_dict(recover_state(payload["mentee"]))
        self.energy = float(payload["energy"])

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits_t, h_t = self.model.forward_with_features(x)
        logits_s, h_s = self.mentee.forward_with_features(x)
        mentor, mentee, hidden = adaptive_losses(logits_t, logits_s, h_t, self.projection(h_s), y)
        self.record(Metrics.LOSS_TRAIN, mentor + hidden)
        self.record("loss/mentee", mentee + hidden)
        return mentor + mentee + hidden

    def upload(self) -> Payload:
        return {"mentee": compress_state(cpu_state(self.mentee), self.energy)}


@register("fedkd", server=FedKDServer, client=FedKDClient)
@dataclass
class FedKDConfig(AlgorithmConfig):
    energy_start: float = 0.95  # T at the first round (HtFLlib's T_start)
    energy_end: float = 0.98  # T at the last round (HtFLlib's T_end)

    def validate(self, cfg: ExperimentConfig) -> None:
        for name in ("energy_start", "energy_end"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"fedkd.{name}={value}: must be in (0, 1]")
