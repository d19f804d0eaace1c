"""FedL2G: Zhang et al., "FedL2G: Learning to Guide Local Training in Heterogeneous Federated
Learning" (arXiv:2410.06490; code github.com/TsingZ0/FedL2G). Design notes: docs/algorithms/fedl2g.md.

The server learns guiding vectors ``G = {v^y}`` (``C x M``: feature space, M = K, for FedL2G-f; logit
space, M = C, for FedL2G-l). Client i holds out a fixed quiz batch ``D^q`` and trains on the rest,
``D^s``, with cross-entropy plus an MSE pull toward its class's guiding vector (Eq. 4):

.. math::  L_S(\\theta, G) = \\frac{1}{|S|}\\sum_{(x,y) \\in S} \\ell_{ce}(f(x;\\theta), y)
           + \\frac{1}{M}\\lVert z(x;\\theta) - v^y \\rVert^2

Then a pseudo SGD step on one random study batch ``B^s`` (Eq. 5) and the gradient of the quiz CE
through that step with respect to G (Eq. 6):

.. math::  \\theta'(G) = \\theta - \\eta_c \\nabla_\\theta L_{B^s}(\\theta, G), \\qquad
           \\pi_i = \\nabla_G \\, \\frac{1}{|D^q|}\\sum_{(x,y) \\in D^q} \\ell_{ce}(f(x;\\theta'(G)), y)

Only rows of classes in ``B^s`` are non-zero; those go up. The server averages each class over the
clients that sent it and takes a plain SGD step (Algorithm 1, line 17): ``G <- G - eta_s * pi``.
During the first ``warmup_rounds`` rounds clients skip local training (steps 1, 3-7 only).

Implementation choices (reasons in docs/algorithms/fedl2g.md where the paper is silent):
- pi is exact autograd through the pseudo step (double backward), not Eq. 9 literally
  (docs/algorithms/fedl2g.md, The meta-gradient).
- Quiz = ``quiz_size`` train samples drawn once by a permutation seeded by (seed, client), fixed for the
  run, never trained on; B^s re-drawn each round (paper §3.2, App. C after Eq. C.11;
  docs/algorithms/fedl2g.md, Quiz set and study batch).
  A client with fewer than 2*quiz_size train samples holds out half of them instead.
- G starts N(0, 1) (nn.Embedding's init); server SGD has no momentum (Algorithm 1, line 17); server_clip=100
  (the authors' code) (docs/algorithms/fedl2g.md, Initial guiding vectors and the server step).
- Per-class mean over the clients that sent the class, not weighted by n_i; unsent classes get 0 (paper Eq. 6,
  Algorithm 1, lines 15-16; docs/algorithms/fedl2g.md, Uploaded rows and their average).
- Pseudo step and quiz run in train mode (batch statistics); BN running-stat updates are discarded
  (docs/algorithms/fedl2g.md, Batch normalisation in the meta step).
- Warm-up rounds are still evaluated by the platform (the authors' code logs none): models are at init
  (docs/algorithms/fedl2g.md, Evaluation during warm-up).
- Personalised: no global model; each client is tested with its own model on its own test set (paper App. A).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedray.platform.api import (
    AlgorithmConfig,
    ArrayDataset,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    FedModel,
    Metrics,
    Payload,
    Server,
    ServerContext,
    class_prototypes,
    register,
    round_count,
    stream,
    torch_generator,
)

Variant = Literal["f", "l"]
DEFAULT_SERVER_LR = {"f": 100.0, "l": 0.1}  # eta_s per variant: the paper's appendix, Hyperparameter settings

# tags as they were before named streams, so FedL2G's numbers stand
stream("fedl2g/guide_init", tag=11)  # the server's initial guiding vectors G
stream("fedl2g/quiz", "client", tag=13)  # a client's quiz/study split, fixed for the run
stream("fedl2g/study_batch", "rnd", "client", tag=7)  # the study batch of a client's meta step

# ------------------------------------------------------------------------------------------- math


def guide_loss(z: Tensor, G: Tensor, y: Tensor) -> Tensor:
    """Eq. 4's guiding term ``l_g``: MSE between ``z`` and each sample's guiding vector, mean over B*M.

    Shape: ``z [B, M]``, ``G [C, M]``, ``y [B]`` -> scalar.
    """
    return F.mse_loss(z, G[y])


def functional_forward(model: FedModel, state: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """``(logits [B, C], z [B, d])`` of ``model`` run with the tensors in ``state`` (full state-dict
    names; missing ones are the model's own)."""

    def part(prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    z = functional_call(model.features, part("features."), (x,))
    return functional_call(model.head, part("head."), (z,)), z


def meta_gradient(
    model: FedModel,
    params: dict[str, Tensor],
    G: Tensor,
    study_batch: tuple[Tensor, Tensor],
    quiz_batch: tuple[Tensor, Tensor],
    lr: float,
    variant: Variant = "f",
) -> Tensor:
    """Eqs. 5-6: the gradient of the quiz CE w.r.t. G through one pseudo SGD step on the study batch.

    ``params``: the parameters theta stepped (e.g. ``dict(model.named_parameters())``); they are not
    modified. The model runs in whatever mode it is in; the buffers in its state dict are cloned, so
    BatchNorm's running-stat updates are discarded (a buffer outside it, a frozen lookup table, is read
    as it is). ``variant``: guide the features (``"f"``) or the logits
    (``"l"``). Shape: ``G [C, M]``, ``study_batch = (x [B, ...], y [B])``, ``quiz_batch =
    (x [Q, ...], y [Q])`` -> ``pi [C, M]``, zero outside the classes of the study batch.
    """
    G = G.detach().requires_grad_(True)
    state = model.state_dict(keep_vars=True)  # no copy: which buffers are state (not a frozen table)
    buffers = {k: v.clone() if k in state else v for k, v in model.named_buffers()}
    theta = {k: v if v.requires_grad else v.detach().requires_grad_(True) for k, v in params.items()}
    (xs, ys), (xq, yq) = study_batch, quiz_batch

    logits, z = functional_forward(model, {**theta, **buffers}, xs)
    study_loss = F.cross_entropy(logits, ys) + guide_loss(z if variant == "f" else logits, G, ys)
    grads = torch.autograd.grad(study_loss, list(theta.values()), create_graph=True, allow_unused=True)
    stepped = {k: p if g is None else p - lr * g for (k, p), g in zip(theta.items(), grads)}  # Eq. 5

    quiz_logits, _ = functional_forward(model, {**stepped, **buffers}, xq)
    (pi,) = torch.autograd.grad(F.cross_entropy(quiz_logits, yq), G, allow_unused=True)  # Eq. 6
    return torch.zeros_like(G) if pi is None else pi.detach()


def nonzero_rows(pi: Tensor) -> tuple[Tensor, Tensor]:
    """Algorithm 1, line 15: the classes whose row of ``pi`` is non-zero, and those rows.

    Shape: ``pi [C, M]`` -> ``classes [k]`` int64 (ascending), ``rows [k, M]``.
    """
    classes = pi.ne(0).any(1).nonzero().squeeze(1)
    return classes, pi[classes]


def average_rows(uploads: list[tuple[Tensor, Tensor]], num_classes: int) -> tuple[Tensor, Tensor]:
    """Algorithm 1, line 16: per-class mean of the uploaded rows over the clients that sent the class.

    Shape: ``uploads = [(classes [k_i], rows [k_i, M])]`` -> ``mean [C, M]`` (zero rows for classes
    nobody sent), ``count [C]`` int64 senders per class.
    """
    return class_prototypes(
        torch.cat([r for _, r in uploads]), torch.cat([c for c, _ in uploads]), num_classes
    )


# ------------------------------------------------------------------------------------------- server half


class FedL2GServer(Server):
    """Holds G as an ``nn.Embedding(C, M)`` and updates it with a stock SGD step on the mean pi."""

    hp: FedL2GConfig
    UPLINK_KEYS = ("classes", "rows")
    STATE = ("guide", "optimizer")

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        dim = ctx.feature_dim if self.hp.variant == "f" else ctx.num_classes
        self.guide = nn.Embedding(ctx.num_classes, dim)
        with torch.no_grad():  # N(0, 1) as nn.Embedding, from its own seed (independent of model inits)
            gen = torch_generator("fedl2g/guide_init", ctx.cfg.seed)
            self.guide.weight.copy_(torch.randn(ctx.num_classes, dim, generator=gen))
        self.optimizer = torch.optim.SGD(self.guide.parameters(), lr=self.hp.eta_s)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"guide": self.guide.weight.detach().clone()})

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        uploads = [(u["classes"], u["rows"]) for u in uplinks.values() if len(u["classes"])]
        if not uploads:
            return
        mean, _ = average_rows(uploads, self.ctx.num_classes)
        self.optimizer.zero_grad()
        self.guide.weight.grad = mean.to(self.guide.weight.dtype)
        if self.hp.server_clip is not None:
            nn.utils.clip_grad_norm_(self.guide.parameters(), self.hp.server_clip)
        self.optimizer.step()  # G <- G - eta_s * pi  (Algorithm 1, line 17)


# ------------------------------------------------------------------------------------------- client half


class FedL2GClient(ClientModule):
    """Trains on the study set with CE + guide (Eq. 4); uploads the non-zero rows of pi (Eqs. 5-6)."""

    hp: FedL2GConfig
    guide: Tensor  # held

    def __init__(self, model: FedModel, ctx) -> None:
        super().__init__(model, ctx)
        n_quiz = min(self.hp.quiz_size, ctx.num_train // 2)
        # a seeded draw, fixed per (seed, client) for the run and never trained on: shards are stored
        # class by class, so the first samples would make a one-class quiz
        gen = torch_generator("fedl2g/quiz", ctx.cfg.seed, ctx.client_id)
        order = torch.randperm(ctx.num_train, generator=gen)
        self.quiz = ctx.train.subset(order[:n_quiz].sort().values)
        self.study = ctx.train.subset(order[n_quiz:].sort().values)
        self.hold("guide", torch.zeros(0))  # G, from every downlink

    def training_data(self) -> ArrayDataset:
        return self.study

    def local_epochs(self, rnd: int) -> int:
        return 0 if rnd < self.hp.warmup_rounds else super().local_epochs(rnd)

    def receive(self, rnd: int, payload: Payload) -> None:
        self.hold("guide", payload["guide"])

    def guided(self, logits: Tensor, z: Tensor) -> Tensor:
        return z if self.hp.variant == "f" else logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, z = self.model.forward_with_features(x)
        ce = F.cross_entropy(logits, y)
        guide = guide_loss(self.guided(logits, z), self.guide, y)
        self.record(Metrics.LOSS_TRAIN, ce)
        self.record("loss/guide", guide)
        return ce + guide

    def upload(self) -> Payload:
        device = self.guide.device
        gen = torch_generator("fedl2g/study_batch", self.ctx.cfg.seed, self.rnd, self.ctx.client_id)
        idx = torch.randperm(len(self.study), generator=gen)[: self.hp.study_batch]
        study = (self.study.x[idx].to(device), self.study.y[idx].to(device))
        quiz = (self.quiz.x.to(device), self.quiz.y.to(device))
        was_training = self.model.training
        # batch statistics for the pseudo step and the quiz
        # (docs/algorithms/fedl2g.md, Batch normalisation in the meta step)
        self.model.train()
        pi = meta_gradient(
            self.model,
            {k: p for k, p in self.model.named_parameters() if p.requires_grad},  # what SGD steps
            self.guide,
            study,
            quiz,
            self.round_lr(),
            self.hp.variant,
        )
        self.model.train(was_training)
        classes, rows = nonzero_rows(pi.cpu())
        self.record("fedl2g/rows_sent", len(classes))
        return {"classes": classes, "rows": rows}


@register("fedl2g", server=FedL2GServer, client=FedL2GClient)
@dataclass
class FedL2GConfig(AlgorithmConfig):
    variant: Variant = "f"  # "f": guide features (M = K); "l": guide logits (M = C)
    server_lr: float | None = None  # eta_s; null = the paper's default for the variant: 100 (f), 0.1 (l)
    server_clip: float | None = 100.0  # max norm of the averaged pi before the server step; null = none
    warmup_rounds: int = round_count(50)  # T': rounds without local training
    quiz_size: int = 10  # |D^q|: one batch
    study_batch: int = 10  # |B^s| of the pseudo step

    def needs_shared_features(self) -> bool:
        return self.variant == "f"  # guides in the feature space; "l" guides logits

    @property
    def eta_s(self) -> float:
        return DEFAULT_SERVER_LR[self.variant] if self.server_lr is None else self.server_lr

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.server_lr is not None and self.server_lr <= 0:
            raise ConfigError(f"fedl2g.server_lr={self.server_lr}: must be > 0 (null = the paper default)")
        if self.server_clip is not None and self.server_clip <= 0:
            raise ConfigError(f"fedl2g.server_clip={self.server_clip}: must be > 0 (or null for no clipping)")
        if self.warmup_rounds < 0:
            raise ConfigError(f"fedl2g.warmup_rounds={self.warmup_rounds}: must be >= 0")
        if cfg.train.optimizer != "sgd":
            raise ConfigError(
                f"train.optimizer={cfg.train.optimizer} with algorithm=fedl2g: the meta-gradient is taken "
                "through one SGD step of the client's lr (Eq. 5), the step local training takes; use sgd"
            )
        for key in ("quiz_size", "study_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fedl2g.{key}={getattr(self, key)}: must be >= 1")
