"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients"
(AAAI 2022, arXiv:2105.00243).

Clients share class prototypes instead of weights, so every client may run its own architecture
(only the representation size ``d`` must agree). Client i's prototype of class j is the mean
representation of its class-j samples (Eq. 4 of the paper); the server averages each class over the
clients that hold it, weighting by their sample counts (Eq. 6):

.. math::  C_i^{(j)} = \\frac{1}{|D_{i,j}|} \\sum_{(x,y) \\in D_{i,j}} h_i(x), \\qquad
           \\bar C^{(j)} = \\sum_{i \\in N_j} \\frac{|D_{i,j}|}{\\sum_{k \\in N_j} |D_{k,j}|} C_i^{(j)}

and clients train with cross-entropy plus a pull toward the global prototype of each sample's class
(Eq. 5), for classes that have one:

.. math::  L_i = \\ell_{ce}(f_i(x), y) + \\lambda \\, \\mathrm{MSE}(h_i(x), \\bar C^{(y)})

Personalised: no global model; each client is tested with its own model on its own test split.
FedDistill (``feddistill.py``) is this algorithm in the logit space and reuses every function here.

Spec choices (no FedProto spec; where the paper is silent, HtFLlib's ``clientproto``/``serverproto``,
which FedL2G's baselines use, is followed):
- Eq. 6 weights normalised per class (the paper's extra 1/|N_j| would shrink prototypes);
  ``fedproto.weighted=false`` gives the official code's / HtFLlib's plain mean over holders.
- Guide loss = MSE over all B*d entries, samples of classes without a global prototype add 0 (HtFLlib).
- Prototypes are the representations local training produced (``fedproto.collect=during``, the
  default): each batch's, in train mode, before that batch's step, over every epoch, as HtFLlib's
  ``clientproto`` and the official code collect them (the paper's Eq. 4 does not say with which
  weights). ``collect=after`` computes them in one eval-mode, no-grad pass over the train split
  after local training, from the trained model.
- The global prototypes are rebuilt each round from that round's uploads only (official code, HtFLlib).
- Evaluation as in the paper, PFLlib and HtFLlib: a sample is predicted as the class of the nearest
  global prototype, ``argmin_j ||h_i(x) - C_j||`` (classes without one are never predicted); the
  reported loss is the cross-entropy of the negative squared distances. ``fedproto.eval=head``
  scores with the local model's own head instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    Server,
    ServerContext,
    class_prototypes,
    eval_pass,
    register,
    scatter_rows,
)

# ------------------------------------------------------------------------------------------- math


def aggregate_prototypes(protos: Tensor, counts: Tensor, weighted: bool = True) -> tuple[Tensor, Tensor]:
    """Eq. 6: per-class average of K clients' prototypes over the clients holding the class.

    ``weighted``: weight client i by ``counts[i, c]`` (normalised over the holders of c); otherwise a
    plain mean over the holders. Shape: ``protos [K, C, d]``, ``counts [K, C]`` -> ``global [C, d]``
    (zero rows where nobody holds the class), ``mask [C]`` bool (True where some client holds it).
    Values of ``protos`` where ``counts`` is 0 are ignored.
    """
    held = counts > 0
    w = torch.where(held, counts, 0) if weighted else held
    w = w.to(protos.dtype)  # [K, C]
    total = w.sum(0)  # [C]
    out = torch.einsum("kc,kcd->cd", w, torch.where(held[..., None], protos, 0))
    return out / total.clamp(min=1e-12).unsqueeze(1), total > 0


def prototype_loss(z: Tensor, targets: Tensor, mask: Tensor, y: Tensor) -> Tensor:
    """Eq. 5's regulariser: ``mean over B*d of (z - targets[y])^2``; rows with ``mask[y]`` False add 0.

    Shape: ``z [B, d]``, ``targets [C, d]``, ``mask [C]`` bool, ``y [B]`` -> scalar.
    """
    keep = mask[y].unsqueeze(1).to(z.dtype)  # [B, 1]
    return ((z - targets[y]) ** 2 * keep).sum() / z.numel()


def nearest_prototype_scores(z: Tensor, protos: Tensor, mask: Tensor) -> Tensor:
    """Scores whose argmax is the nearest global prototype: ``-||z - C_j||^2``, ``-inf`` where
    ``mask[j]`` is False. Shape: ``z [B, d]``, ``protos [C, d]``, ``mask [C]`` bool -> ``[B, C]``."""
    scores = -torch.cdist(z, protos.to(z.dtype)).pow(2)
    return scores.masked_fill(~mask, float("-inf"))


# ------------------------------------------------------------------------------------------- server half


class FedProtoServer(Server):
    """Keeps the global prototypes ``[C, d]`` and their mask ``[C]``; none before the first uploads."""

    hp: FedProtoConfig
    UPLINK_KEYS = ("classes", "protos", "counts")
    STATE = ("dim", "protos", "mask")

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.dim = self.representation_dim(ctx)
        self.protos: Tensor | None = None
        self.mask: Tensor | None = None

    def representation_dim(self, ctx: ServerContext) -> int:
        return ctx.feature_dim

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        if self.protos is None or self.mask is None:  # before the first aggregation
            return self.broadcast(selected, {})
        down = {"protos": self.protos.clone(), "mask": self.mask.clone()}
        return self.broadcast(selected, down)

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        ups = list(uplinks.values())
        classes = [u["classes"] for u in ups]
        protos, _ = scatter_rows([u["protos"] for u in ups], classes, self.ctx.num_classes)
        counts, _ = scatter_rows([u["counts"][:, None] for u in ups], classes, self.ctx.num_classes)
        counts = counts[..., 0].to(torch.int64)
        self.protos, self.mask = aggregate_prototypes(protos, counts, self.hp.weighted)

    def eval_payload(self) -> Payload | None:
        if self.hp.eval != "prototype" or self.protos is None:
            return None  # each client's own head
        return {"protos": self.protos, "mask": self.mask}


# ------------------------------------------------------------------------------------------- client half


class FedProtoClient(ClientModule):
    """CE + lam * prototype pull (Eq. 5); uploads the prototypes of the classes it holds (Eq. 4)."""

    hp: FedProtoConfig
    eval_mode = "own"  # its own extractor, scored against the global prototypes (load_for_eval)
    targets: Tensor  # held
    has_target: Tensor  # held
    seen_sum: Tensor  # held: per class, the sum of what this fit's training produced
    seen_count: Tensor  # held
    class_counts: Tensor  # held: the client's training samples per class (Eq. 6's weights)

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        # rebuilt from every downlink: held, not checkpointed
        self.hold("targets", torch.zeros(0))
        self.hold("has_target", torch.zeros(0, dtype=torch.bool))
        self.hold("class_counts", ctx.class_counts)  # fixed for the run
        self.forget_seen()

    def guided(self, logits: Tensor, z: Tensor) -> Tensor:
        """The representation that prototypes live in: features (FedProto)."""
        return z

    def representation_size(self) -> int:
        return self.model.feature_dim

    def forget_seen(self) -> None:
        """Per class, the sum and count of the representations training produced (``collect=during``),
        from nothing: when the module is built and when ``upload`` has read them, so a round without
        training uploads no class."""
        c, d = self.ctx.num_classes, self.representation_size()
        self.hold("seen_sum", torch.zeros(c, d))
        self.hold("seen_count", torch.zeros(c, dtype=torch.int64))

    def receive(self, rnd: int, payload: Payload) -> None:
        if "protos" in payload:
            self.hold("targets", payload["protos"])
            self.hold("has_target", payload["mask"])

    def load_for_eval(self, payload: Payload) -> None:
        self.receive(self.rnd, payload)  # the global prototypes, for eval_logits

    def eval_logits(self, x: Tensor) -> Tensor:
        if self.hp.eval != "prototype" or self.has_target.numel() == 0:
            return self.model(x)
        logits, z = self.model.forward_with_features(x)
        return nearest_prototype_scores(self.guided(logits, z), self.targets, self.has_target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, z = self.model.forward_with_features(x)
        rep = self.guided(logits, z)
        if self.hp.collect == "during":  # index_add_ for both: no host sync on a GPU (bincount has one)
            self.seen_sum.index_add_(0, y, rep.detach().to(self.seen_sum.dtype))
            self.seen_count.index_add_(0, y, torch.ones_like(y))
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.record(Metrics.LOSS_TRAIN, loss)
        if self.has_target.numel() == 0:  # round 0: no global prototypes yet
            return loss
        reg = self.regulariser(rep, y)
        self.record("loss/proto", reg)
        return loss + self.hp.lam * reg

    def regulariser(self, rep: Tensor, y: Tensor) -> Tensor:
        """Eq. 5's pull toward the global prototype of each sample's class."""
        return prototype_loss(rep, self.targets, self.has_target, y)

    @torch.no_grad()
    def upload(self) -> Payload:
        if self.hp.collect == "during":  # what training produced; no class if it took no step
            seen = self.seen_count
            protos = self.seen_sum / seen.clamp(min=1).unsqueeze(1).to(self.seen_sum.dtype)
            # Eq. 6's weights count the client's samples of a class, not how often training saw them
            counts = torch.where(seen > 0, self.class_counts, 0)
            self.forget_seen()
        else:
            protos, counts = self.after_training()
        held = counts > 0
        return {"classes": held.nonzero().squeeze(1), "protos": protos[held], "counts": counts[held]}

    def after_training(self) -> tuple[Tensor, Tensor]:
        """Each class's prototype from one eval-mode pass of the trained model over the train split
        (``collect=after``), and its sample count."""
        logits, z, y = eval_pass(self.model, self.training_data())
        return class_prototypes(self.guided(logits, z).float(), y, self.ctx.num_classes)


@register("fedproto", server=FedProtoServer, client=FedProtoClient)
@dataclass
class FedProtoConfig(AlgorithmConfig):
    SHARED_FEATURES: ClassVar[bool] = True  # prototypes of every client live in one space
    lam: float = 1.0  # lambda of Eq. 5
    weighted: bool = True  # Eq. 6 sample-count weights; false = plain mean over holders (official code)
    eval: Literal["prototype", "head"] = "prototype"  # nearest global prototype (paper) or the own head
    # the prototypes: the representations training produced (HtFLlib, the official code), or one
    # eval-mode pass of the trained model after it
    collect: Literal["during", "after"] = "during"

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.lam < 0:
            raise ConfigError(f"{cfg.algorithm}.lam={self.lam}: must be >= 0")
