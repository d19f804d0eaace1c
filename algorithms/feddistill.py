"""FedDistill (FD): Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated
Distillation and Augmentation under Non-IID Private Data" (NeurIPS 2018 workshop MLPCD, arXiv:1811.11479).

FedProto in the logit space: clients upload per-class mean logits, the server averages each class over
the clients that hold it, and clients distil toward the global mean logits of each sample's class:

.. math::  \\bar F^{(c)} = \\frac{1}{|N_c|} \\sum_{i \\in N_c} \\frac{1}{|D_{i,c}|}
           \\sum_{(x,y) \\in D_{i,c}} f_i(x), \\qquad
           L_i = \\ell_{ce}(f_i(x), y) + \\lambda \\, \\mathrm{MSE}(f_i(x), \\bar F^{(y)})

Only ``C`` numbers per class travel, and heads may differ (any model group). Every function is
FedProto's (:mod:`fedray.algorithms.fedproto`); this module only picks the logit space.

Spec choices (no FD spec; HtFLlib's ``clientdistill``/``serverdistill``, FedL2G's baseline, is followed):
- Distillation = MSE on logits with weight ``lam`` (HtFLlib), not the paper's cross-entropy on softmaxes.
- Plain mean over the clients holding a class (HtFLlib); ``feddistill.weighted=true`` weights by counts.
- A client's own logits are not removed from the global mean it distils toward (HtFLlib).
- Mean logits come from one eval-mode pass after local training (HtFLlib collects them during training).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedray.algorithms.fedproto import FedProtoClient, FedProtoConfig, FedProtoServer
from fedray.platform.algorithm import ServerContext
from fedray.platform.registry import register


class FedDistillServer(FedProtoServer):
    def representation_dim(self, ctx: ServerContext) -> int:
        return ctx.num_classes


class FedDistillClient(FedProtoClient):
    def guided(self, logits: Tensor, z: Tensor) -> Tensor:
        """Global "prototypes" live in the logit space."""
        return logits


@register("feddistill", server=FedDistillServer, client=FedDistillClient)
@dataclass
class FedDistillConfig(FedProtoConfig):
    lam: float = 1.0  # weight of the logit-distillation MSE
    weighted: bool = False  # plain mean over the holders of a class (HtFLlib)
