"""FedDistill (FD): Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated
Distillation and Augmentation under Non-IID Private Data" (NeurIPS 2018 workshop MLPCD, arXiv:1811.11479).

FedProto in the logit space: clients upload per-class mean logits, the server averages each class over
the clients that hold it, and clients distil toward the global mean logits of each sample's class:

.. math::  \\bar F^{(c)} = \\frac{1}{|N_c|} \\sum_{i \\in N_c} \\frac{1}{|D_{i,c}|}
           \\sum_{(x,y) \\in D_{i,c}} f_i(x), \\qquad
           L_i = \\ell_{ce}(f_i(x), y) + \\lambda \\, \\ell_{ce}\\big(\\sigma(f_i(x)), \\sigma(\\bar F^{(y)})\\big)

with ``sigma`` the softmax: a soft-target cross-entropy toward the global mean logits of the sample's
class (the FD paper; HtFLlib at the FedL2G paper's time). ``feddistill.loss=mse`` uses
``MSE(f_i(x), F^(y))`` instead (HtFLlib before April 2024).

Only ``C`` numbers per class travel, and heads may differ (any model group). Every function is
FedProto's (:mod:`fedray.algorithms.fedproto`); this module picks the logit space and the loss.

Spec choices (no FD spec; HtFLlib's ``clientdistill``/``serverdistill``, FedL2G's baseline, is followed):
- Distillation = soft-target cross-entropy with weight ``lam``; samples of classes without a global
  mean add 0 (as in FedProto's pull).
- Evaluation: the client's own head (HtFLlib), ``feddistill.eval=prototype`` = nearest global mean logits.
- Plain mean over the clients holding a class (HtFLlib); ``feddistill.weighted=true`` weights by counts.
- A client's own logits are not removed from the global mean it distils toward (HtFLlib).
- Mean logits are those local training produced, each batch's before its step (``collect=during``:
  the FD paper's local-average logits, HtFLlib); ``collect=after`` takes one eval-mode pass after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from fedray.algorithms.fedproto import FedProtoClient, FedProtoConfig, FedProtoServer
from fedray.platform.api import (
    ServerContext,
    register,
)


def soft_target_ce(logits: Tensor, targets: Tensor, mask: Tensor, y: Tensor) -> Tensor:
    """``mean over B of -sum_c softmax(targets[y])_c * log_softmax(logits)_c``; rows with ``mask[y]``
    False add 0. Shape: ``logits [B, C]``, ``targets [C, C]``, ``mask [C]`` bool, ``y [B]`` -> scalar."""
    per_sample = -(torch.softmax(targets[y], 1) * torch.log_softmax(logits, 1)).sum(1)
    return (per_sample * mask[y].to(logits.dtype)).sum() / len(y)


class FedDistillServer(FedProtoServer):
    hp: FedDistillConfig

    def representation_dim(self, ctx: ServerContext) -> int:
        return ctx.num_classes


class FedDistillClient(FedProtoClient):
    hp: FedDistillConfig

    def guided(self, logits: Tensor, z: Tensor) -> Tensor:
        """Global "prototypes" live in the logit space."""
        return logits

    def representation_size(self) -> int:
        return self.ctx.num_classes

    def regulariser(self, rep: Tensor, y: Tensor) -> Tensor:
        if self.hp.loss == "mse":
            return super().regulariser(rep, y)
        return soft_target_ce(rep, self.targets, self.has_target, y)


@register("feddistill", server=FedDistillServer, client=FedDistillClient)
@dataclass
class FedDistillConfig(FedProtoConfig):
    SHARED_FEATURES: ClassVar[bool] = False  # its "prototypes" are logits: any feature sizes
    lam: float = 1.0  # weight of the distillation term
    weighted: bool = False  # plain mean over the holders of a class (HtFLlib)
    loss: Literal["soft_ce", "mse"] = "soft_ce"  # the FD paper's soft targets, or MSE on logits
    eval: Literal["prototype", "head"] = "head"  # HtFLlib scores FD with the client's own head
