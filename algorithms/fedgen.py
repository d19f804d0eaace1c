"""FedGen: Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning"
(ICML 2021, arXiv:2105.10056); a baseline of the FedCross paper (Sec. IV-A, Table II), whose authors
ran the original code (github.com/zhuangdizhu/FedGen) with its settings. fedray follows that code
(``serverpFedGen.py``, ``userpFedGen.py``, ``generator.py``).

The server keeps FedAvg's model and a generator ``G(eps, y) -> z`` of representations (the head's
input, ``d`` wide) from uniform noise ``eps`` and a one-hot label. After the round's clients upload,
the server trains ``G`` so that the clients' heads, the ensemble, recognise its output as ``y``: with
``y`` drawn uniformly from the labels some client of the round holds, ``a_ky = (c_ky + 1) /
sum_j (c_jy + 1)`` client ``k``'s share of label ``y`` (``c_ky`` its count), and ``h_k`` its head,

.. math::  J(G) = \\sum_k \\mathrm{mean}_i \\, a_{k y_i} \\cdot \\mathrm{mean}_j
           \\mathrm{CE}(h_k(G(\\epsilon_j, y_j)), y_j)
           + \\eta \\, \\exp\\big(-\\mathrm{mean}_{ij} \\lVert \\epsilon_i - \\epsilon_j \\rVert_2^2 / n_\\epsilon
           \\cdot \\lVert z_i - z_j \\rVert_1 / d \\big)

(the first term is what the authors' code computes: it multiplies a ``[B]`` loss by ``[B, 1]`` shares,
and the mean of the broadcast ``[B, B]`` product is the product of the means; the second term rewards
outputs that differ as their noise does), then averages the models. From
round 1 on, a client adds two terms to its cross-entropy: its head's cross-entropy on ``B_g``
representations drawn from ``G`` for uniform labels, weighted ``alpha_t B_g / B``, and
``KL(p_G || p)``, ``p_G`` its head's prediction on ``G``'s representation of a sample's label (held
fixed) and ``p`` the model's on the sample, weighted ``beta_t``; ``alpha_t = max(1e-4, alpha 0.98^t)``
and ``beta_t`` alike (``B`` the configured batch size, as the authors' ``gen_ratio``).

Choices where the paper is silent or fedray's platform differs (docs/algorithms/fedgen.md):
- [Label counts] a client uploads its training split's class counts; the authors' clients count the
  labels of the fixed number of batches they train on (20 of 32), so their shares follow each client's
  label proportions, while fedray's also grow with the client's size.
- [Labels a client draws] all ``C`` classes (the authors' ``available_labels``: every label of the
  training data, which holds every class in each dataset fedray ships).
- [The adversarial student term] not implemented: the authors' ``ensemble_beta`` is 0 in every config.
- [Optimiser] the run's ``train.*`` for clients; the authors' decay of 0.99 a round is ``train.lr_decay=0.99``.
- [Representations] fedray's extractors end with a ReLU, so real representations are non-negative; the
  authors' head input has no activation. The generator's output is unconstrained in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    cpu_state,
    register,
    stream,
    torch_generator,
)

stream("fedgen/init")  # the generator's initial weights
stream("fedgen/generator", "rnd")  # the server's labels and noise while it trains the generator

# ------------------------------------------------------------------------------------------- the math


class FeatureGenerator(nn.Module):
    """``G(eps, y)``: ``[eps | onehot(y)]`` through Linear, BatchNorm, ReLU and a Linear to ``d``
    (the authors' ``Generator`` without its optional label embedding)."""

    def __init__(
        self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int, gen: torch.Generator
    ) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.hidden = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.norm = nn.BatchNorm1d(hidden_dim)
        self.out = nn.Linear(hidden_dim, feature_dim)
        with torch.no_grad():  # PyTorch's Linear init, U(+-1/sqrt(fan_in)), drawn from the run's stream
            for layer in (self.hidden, self.out):
                bound = 1 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=gen)
                layer.bias.uniform_(-bound, bound, generator=gen)

    def forward(self, y: Tensor, eps: Tensor | None = None) -> Tensor:
        """Representations ``[B, d]`` of labels ``y [B]``; ``eps [B, noise_dim]`` drawn U(0, 1) from the
        global generator when not given (the authors' ``torch.rand``)."""
        dtype = self.hidden.weight.dtype
        if eps is None:
            eps = torch.rand(len(y), self.noise_dim, device=y.device, dtype=dtype)
        onehot = F.one_hot(y, self.num_classes).to(dtype)
        return self.out(F.relu(self.norm(self.hidden(torch.cat([eps, onehot], dim=1)))))


def label_weights(counts: Tensor) -> Tensor:
    """``a [C, K]``: each client's share of each label, from the round's counts ``c [K, C]``, each
    smoothed by 1 (the authors' counts start at 1), so a label's column of shares sums to 1."""
    smoothed = counts.double() + 1
    return (smoothed / smoothed.sum(0)).T.to(torch.float32)


def qualified_labels(counts: Tensor) -> Tensor:
    """The labels the generator trains on: those some client of the round holds (the authors' count
    above its smoothing 1)."""
    return (counts.sum(0) > 0).nonzero().squeeze(1)


def ensemble_loss(z: Tensor, y: Tensor, weights: Tensor, heads_w: Tensor, heads_b: Tensor) -> Tensor:
    """``sum_k mean_i a_{k y_i} * mean_j CE(h_k(z_j), y_j)`` (the first term of ``J``: each head's batch
    cross-entropy weighted by its batch-mean share, as the authors' broadcast computes it):
    representations ``z [B, d]``, labels ``y [B]``, shares ``weights [C, K]``, the clients' heads
    ``heads_w [K, C, d]``, ``heads_b [K, C]``."""
    logits = torch.einsum("bd,kcd->kbc", z, heads_w) + heads_b[:, None, :]  # [K, B, C]
    ce = F.cross_entropy(logits.transpose(1, 2), y.expand(len(heads_w), -1), reduction="none")  # [K, B]
    return (ce.mean(1) * weights[y].mean(0)).sum()


def diversity_loss(eps: Tensor, z: Tensor) -> Tensor:
    """``exp(-mean_ij d_eps(i, j) d_z(i, j))``: ``d_eps`` the mean squared difference of two samples'
    noise, ``d_z`` the mean absolute difference of their representations (the authors' ``DiversityLoss``
    with ``metric='l1'``)."""
    noise_dist = (eps[:, None, :] - eps[None, :, :]).pow(2).mean(2)
    feature_dist = (z[:, None, :] - z[None, :, :]).abs().mean(2)
    return torch.exp(-(noise_dist * feature_dist).mean())


def decayed(weight: float, decay: float, rnd: int) -> float:
    """A client's term weight at round ``rnd``: ``max(1e-4, weight decay^rnd)`` (the authors'
    ``exp_lr_scheduler`` with ``lr_decay_epoch=1``)."""
    return max(1e-4, weight * decay**rnd)


def latent_kl(logits: Tensor, target_logits: Tensor) -> Tensor:
    """``KL(softmax(target) || softmax(logits))`` averaged over the batch, the target held fixed (the
    authors' ``KLDivLoss(reduction="batchmean")`` on a detached target)."""
    target = F.softmax(target_logits.detach(), dim=1)
    return F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")


# ------------------------------------------------------------------------------------------- server half


class FedGenServer(FedAvgServer):
    """FedAvg's server (sample-weighted mean of whole models) that also trains the generator on the
    round's uploaded heads, before it averages them, and sends it down with the model."""

    hp: FedGenConfig  # type: ignore[assignment]
    UPLINK_KEYS = ("model", "num_samples", "label_counts")
    STATE = ("model", "generator", "generator_optimizer")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        hp = self.hp
        init = torch_generator("fedgen/init", ctx.cfg.seed)
        self.generator = FeatureGenerator(hp.noise_dim, ctx.num_classes, hp.hidden_dim, ctx.feature_dim, init)
        self.generator_optimizer = torch.optim.Adam(
            self.generator.parameters(), lr=hp.generator_lr, weight_decay=hp.generator_weight_decay
        )

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(
            selected, {"model": cpu_state(self.model), "generator": cpu_state(self.generator)}
        )

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        self.train_generator(rnd, uplinks)
        super().aggregate(rnd, uplinks)

    def train_generator(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        """``generator_steps`` Adam steps on ``J`` (module docstring) with the round's heads as the
        ensemble; the learning rate is ``generator_lr * generator_lr_decay^rnd`` (the authors'
        ExponentialLR, stepped once a round)."""
        hp = self.hp
        counts = torch.stack([u["label_counts"] for u in uplinks.values()]).float()
        weights, labels = label_weights(counts), qualified_labels(counts)
        heads_w = torch.stack([u["model"]["head.weight"] for u in uplinks.values()]).float()
        heads_b = torch.stack([u["model"]["head.bias"] for u in uplinks.values()]).float()
        for group in self.generator_optimizer.param_groups:
            group["lr"] = hp.generator_lr * hp.generator_lr_decay**rnd
        draws = torch_generator("fedgen/generator", self.ctx.cfg.seed, rnd)
        batch = self.ctx.cfg.train.batch_size if hp.generator_batch is None else hp.generator_batch
        self.generator.train()
        for _ in range(hp.generator_steps):
            y = labels[torch.randint(len(labels), (batch,), generator=draws)]
            eps = torch.rand(batch, hp.noise_dim, generator=draws)
            z = self.generator(y, eps)
            teacher, diversity = ensemble_loss(z, y, weights, heads_w, heads_b), diversity_loss(eps, z)
            loss = hp.teacher_weight * teacher + hp.diversity_weight * diversity
            self.record("fedgen/teacher_loss", teacher.detach())  # means over the round's steps, in MLflow
            self.record("fedgen/diversity_loss", diversity.detach())
            self.generator_optimizer.zero_grad()
            loss.backward()
            self.generator_optimizer.step()


# ------------------------------------------------------------------------------------------- client half


class FedGenClient(FedAvgClient):
    """FedAvg's client with the generator's two terms from round 1 on; uploads its class counts too."""

    hp: FedGenConfig

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        hp = self.hp
        blank = torch.Generator()  # the weights come down every round; these are never used
        self.generator = FeatureGenerator(
            hp.noise_dim, ctx.num_classes, hp.hidden_dim, model.feature_dim, blank
        )
        self.generator.eval().requires_grad_(False)  # the server's: clients only draw from it

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.generator.load_state_dict(payload["generator"])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x)
        ce = F.cross_entropy(logits, y)
        self.record(Metrics.LOSS_TRAIN, ce)
        if self.rnd == 0:  # G is untrained (the authors' regularization = glob_iter > 0)
            return ce
        hp = self.hp
        drawn = torch.randint(self.ctx.num_classes, (hp.synthetic_batch,), device=y.device)
        with torch.no_grad():
            target_logits = self.model.head(self.generator(y))
            z_drawn = self.generator(drawn)
        latent = latent_kl(logits, target_logits)
        teacher = F.cross_entropy(self.model.head(z_drawn), drawn)
        self.record("loss/generated", teacher)
        self.record("loss/latent", latent)
        alpha, beta = decayed(hp.alpha, hp.decay, self.rnd), decayed(hp.beta, hp.decay, self.rnd)
        ratio = hp.synthetic_batch / self.ctx.cfg.train.batch_size  # the authors' gen_ratio
        return ce + ratio * alpha * teacher + beta * latent

    def upload(self) -> Payload:
        return {**super().upload(), "label_counts": self.ctx.class_counts.clone()}


@register("fedgen", server=FedGenServer, client=FedGenClient)
@dataclass
class FedGenConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # FedAvg's server: one architecture for all clients
    SHARED_FEATURES: ClassVar[bool] = True  # one generator writes representations every head reads

    # the generator (the authors' MNIST config, their paper's main setting)
    noise_dim: int = 32
    hidden_dim: int = 256
    generator_lr: float = 3e-4  # Adam
    generator_lr_decay: float = 0.98  # per round
    generator_weight_decay: float = 1e-2
    generator_steps: int = 50  # Adam steps a round (the authors' 10 epochs of 5 iterations)
    generator_batch: int | None = None  # labels a step; null: the clients' train.batch_size (the authors')
    teacher_weight: float = 1.0  # the ensemble's cross-entropy (the authors' ensemble_alpha)
    diversity_weight: float = 1.0  # the diversity term (ensemble_eta)
    # the clients' terms
    alpha: float = 10.0  # weight of the cross-entropy on generated representations (generative_alpha)
    beta: float = 10.0  # weight of the KL to the head's prediction on G(y) (generative_beta)
    decay: float = 0.98  # both weights times decay^round, floored at 1e-4
    synthetic_batch: int = 32  # generated representations a step (gen_batch_size)

    def validate(self, cfg: ExperimentConfig) -> None:
        for name in ("noise_dim", "hidden_dim", "generator_steps", "synthetic_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"fedgen.{name}={getattr(self, name)}: must be >= 1")
        batch = cfg.train.batch_size if self.generator_batch is None else self.generator_batch
        if batch < 2:  # BatchNorm and the diversity term compare samples of a batch
            raise ConfigError(
                f"fedgen.generator_batch={self.generator_batch}: the server's generator batch ({batch}) must be >= 2"
            )
        for name in ("generator_lr", "generator_lr_decay", "decay"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fedgen.{name}={getattr(self, name)}: must be > 0")
        for name in ("generator_weight_decay", "teacher_weight", "diversity_weight", "alpha", "beta"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"fedgen.{name}={getattr(self, name)}: must be >= 0")
