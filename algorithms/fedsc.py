"""FedSC: Wang et al., "FedSC: Federated Learning with Semantic-Aware Collaboration"
(KDD 2025, doi:10.1145/3711896.3736957; code github.com/hwang52/FedSC).

Clients train the FedAvg global model and upload it with per-class prototypes ``c_k^j`` (Eq. 3) and
class counts. From this round's K participants the server builds

- relational prototypes: each client's prototype averaged with its M angular neighbours (Eq. 5, 7-9)

  .. math::  g^j = \\frac{1}{K}\\sum_k c_k^j, \\quad \\phi_k^j = \\cos(g^j, c_k^j), \\quad
             r_k^j = \\frac{1}{M+1}\\sum_q A^j(k, q)\\, c_q^j

  with ``A^j(k, q) = 1`` iff ``q = k`` or q is among the M clients with the smallest ``|phi_k^j - phi_q^j|``;
- consistent prototypes by discrepancy aggregation (Eq. 10-12)

  .. math::  d_k = \\sqrt{\\tfrac12 \\sum_j (n_k^j/n_k - 1/|C|)^2}, \\quad
             e_k \\propto \\sigma(n_k/N - d_k/\\textstyle\\sum_i d_i), \\quad o^j = \\sum_k e_k r_k^j

and sends the global model, R and O down. Local loss (Alg. 1 line 28) = CE + RPCL + CPDR, where

.. math::  s(z, r) = \\frac{\\cos(z, r)}{U(r)}, \\quad U(r) = \\frac{1}{n_k}\\sum_q \\lVert z_q - r \\rVert_2
           \\qquad (Eq. 13)

.. math::  L_{RPCL} = -\\log \\frac{\\sum_{r \\in R^y} e^{s(z, r)/\\tau}}{\\sum_{r \\in R} e^{s(z, r)/\\tau}}
           \\qquad (Eq. 14; all K relational prototypes of class y are positives)

.. math::  L_{CPDR} = \\sum_{q=1}^d |z_q - o^y_q| \\quad (Eq. 15, ``cpdr=l1``)
           \\;\\text{ or }\\; \\mathrm{mean}(z - o^y)^2 \\quad (``cpdr=mse``, the default)

Choices where the paper is silent or ambiguous (each explained under the named heading of
docs/algorithms/fedsc.md):

- Participation and aggregation weights: K, N, e_k and the FedAvg weights range over this round's
  participants (weights sum to 1).
- The first round: no R/O exist before the first aggregation, so round 0 trains with CE only.
- Classes a client does not hold: g^j, phi^j, neighbours and r^j use only holders of class j;
  M_j = min(M, K_j - 1), divide by M_j + 1; o^j renormalises e over the holders of j; RPCL/CPDR skip
  samples whose class has no prototype.
- The normaliser U in Eq. 13: U(r) per prototype at each local epoch start, no_grad, current model
  (eval mode); use_u=false drops U.
- Batch reduction: every term is a mean over the batch. (RPCL's positives are all K same-class
  relational prototypes, as Eq. 14 in paper Sec. 4.1 writes them.)
- CPDR distance: CPDR defaults to MSE (F.mse_loss, mean over batch and dims), as the released code;
  cpdr=l1 is Eq. 15 read literally, which trained to chance accuracy at CPU scale.
- When local prototypes are computed: c_k^j come from a separate eval-mode pass over the local train
  data after training (Alg. 1 lines 32-37 fix only that it is after training).
- Class counts on the upload: n_k^j go up with the prototypes every round (Eq. 10-11 need them; the
  paper's Alg. 1 line 7 lists only w_k and P_k, the released code sends them).
- Neighbour ties: ties in |phi_k1 - phi_k| go to the lower client index (stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    Metrics,
    Payload,
    class_prototypes,
    cpu_state,
    eval_pass,
    masked_mean,
    register,
)

# --------------------------------------------------------------------------------------------- math


def relational_prototypes(protos: Tensor, mask: Tensor, neighbors: int) -> Tensor:
    """Relational prototypes ``r_k^j`` (Eq. 5, 7, 8, 9), built per class from the clients holding it.

    ``g^j`` is the mean of the holders' prototypes, ``phi_k^j = cos(g^j, c_k^j)``; holder k averages its own
    prototype with the ``M_j = min(M, K_j - 1)`` other holders q of smallest ``|phi_k^j - phi_q^j|``.

    Shape: protos ``[K, C, d]``, mask ``[K, C]`` (bool: client k holds class j) -> ``[K, C, d]``
    (zero where mask is False).
    """
    k, c, _ = protos.shape
    protos = torch.where(mask.unsqueeze(-1), protos, 0.0)  # garbage (even NaN) in absent slots -> 0
    g, held = masked_mean(protos, mask)  # Eq. 5: g^j [C, d] over the K_j = held[j] holders
    phi = F.cosine_similarity(protos, g.unsqueeze(0), dim=-1).T  # Eq. 7  [C, K]
    holders = mask.T  # [C, K]
    eye = torch.eye(k, dtype=torch.bool, device=mask.device)
    candidate = holders.unsqueeze(1) & holders.unsqueeze(2) & ~eye  # [C, K1, K]: both hold j, k != k1
    gap = (phi.unsqueeze(2) - phi.unsqueeze(1)).abs().masked_fill(~candidate, float("inf"))
    m_j = (held - 1).clamp(0, neighbors)  # [C]
    rank = gap.argsort(dim=-1, stable=True).argsort(dim=-1)  # position of k in k1's sorted list
    adj = (candidate & (rank < m_j.view(c, 1, 1))) | (eye & holders.unsqueeze(2))  # Eq. 8  [C, K1, K]
    rel = torch.einsum("jkq,qjd->kjd", adj.to(protos.dtype), protos)
    return rel / (m_j + 1).to(protos.dtype).view(1, c, 1)  # Eq. 9


def discrepancy_weights(counts: Tensor) -> Tensor:
    """Aggregation weights ``e_k`` of the consistent prototypes (Eq. 10-11).

    ``B_k^j = n_k^j / n_k``, ``H^j = 1/C``, ``d_k = sqrt(0.5 * sum_j (B_k^j - H^j)^2)``,
    ``e_k = sigmoid(n_k / N - d_k / sum_i d_i)``, normalised to sum to 1.

    Shape: counts ``[K, C]`` -> ``[K]``.
    """
    counts = counts.to(torch.float64)
    n = counts.sum(1)  # [K]
    dist = counts / n.clamp_min(1).unsqueeze(1)
    d = (0.5 * (dist - 1.0 / counts.shape[1]).square().sum(1)).sqrt()  # Eq. 10
    s = torch.sigmoid(n / n.sum() - d / d.sum().clamp_min(1e-12))  # Eq. 11: a = 1/N, b = 1/sum d
    return (s / s.sum()).to(torch.float32)


def consistent_prototypes(rel: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """Consistent prototypes ``o^j = sum_k e_k r_k^j`` (Eq. 12), e renormalised over the holders of j.

    Shape: rel ``[K, C, d]``, weights ``[K]``, mask ``[K, C]`` -> ``[C, d]`` (zero rows for classes held
    by nobody).
    """
    w = weights.to(rel.dtype).unsqueeze(1) * mask.to(rel.dtype)  # [K, C]
    w = w / w.sum(0, keepdim=True).clamp_min(1e-12)
    rel = torch.where(mask.unsqueeze(-1), rel, 0.0)
    return torch.einsum("kc,kcd->cd", w, rel)


def distance_scale(z: Tensor, rel: Tensor, chunk: int = 4096) -> Tensor:
    """``U(r) = (1/n) sum_q ||z_q - r||_2``, the mean distance of all local features to r (Eq. 13).

    Shape: z ``[N, d]``, rel ``[K, C, d]`` -> ``[K, C]``.
    """
    flat = rel.flatten(0, 1)
    total = torch.stack([torch.cdist(part, flat).sum(0) for part in z.split(chunk)]).sum(0)
    return (total / z.shape[0]).view(rel.shape[:2])


def rpcl_loss(
    z: Tensor, y: Tensor, rel: Tensor, mask: Tensor, tau: float, scale: Tensor | None = None
) -> Tensor:
    """Relational-prototype contrastive loss (Eq. 13-14), mean over the samples whose class has a prototype.

    Positives: every existing ``r_k^{y_i}``; negatives: every existing prototype of another class.
    ``s = cos(z_i, r) / U(r)`` (Eq. 13; plain cosine when ``scale`` is None).

    Shape: z ``[B, d]``, y ``[B]``, rel ``[K, C, d]``, mask ``[K, C]``, scale ``[K, C]`` or None -> scalar.
    """
    k, c, d = rel.shape
    sim = (F.normalize(z, dim=1) @ F.normalize(rel.reshape(k * c, d), dim=1).T).view(-1, k, c)  # [B, K, C]
    if scale is not None:
        sim = sim / torch.where(mask, scale, torch.ones_like(scale)).clamp_min(1e-12)
    positive = mask & (torch.arange(c, device=y.device) == y.view(-1, 1, 1))  # [B, K, C]
    keep = positive.flatten(1).any(1)
    if not keep.any():
        return z.sum() * 0.0
    logits = (sim[keep] / tau).masked_fill(~mask, float("-inf")).flatten(1)
    pos = logits.masked_fill(~positive[keep].flatten(1), float("-inf"))
    return (logits.logsumexp(1) - pos.logsumexp(1)).mean()


def cpdr_loss(
    z: Tensor, y: Tensor, consistent: Tensor, kind: str = "mse", mask: Tensor | None = None
) -> Tensor:
    """Consistent-prototype regulariser (Eq. 15) over the samples whose class has a prototype.

    ``kind="l1"``: ``sum_q |z_iq - o^{y_i}_q|`` averaged over the batch (Eq. 15 literally);
    ``kind="mse"``: ``F.mse_loss(z_i, o^{y_i})``, the mean over batch and dims
    (docs/algorithms/fedsc.md, CPDR distance).

    Shape: z ``[B, d]``, y ``[B]``, consistent ``[C, d]``, mask ``[C]`` or None -> scalar.
    """
    keep = mask[y] if mask is not None else torch.ones_like(y, dtype=torch.bool)
    if not keep.any():
        return z.sum() * 0.0
    z, target = z[keep], consistent[y[keep]]
    if kind == "mse":
        return F.mse_loss(z, target)
    if kind == "l1":
        return (z - target).abs().sum(1).mean()
    raise ValueError(f"cpdr kind {kind!r}: expected 'mse' or 'l1'")


# --------------------------------------------------------------------------------------------- server


class FedSCServer(FedAvgServer):
    """FedAvg's global model plus R (``[K_r, C, d]`` + mask) and O (``[C, d]`` + mask) of the last round."""

    hp: FedSCConfig
    UPLINK_KEYS = (*FedAvgServer.UPLINK_KEYS, "prototypes", "class_counts")
    STATE = (*FedAvgServer.STATE, "relational", "relational_mask", "consistent", "consistent_mask")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.relational: Tensor | None = None  # [K_r, C, d]
        self.relational_mask: Tensor | None = None  # [K_r, C] bool
        self.consistent: Tensor | None = None  # [C, d]
        self.consistent_mask: Tensor | None = None  # [C] bool

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        down: Payload = {"model": cpu_state(self.model)}
        if self.relational is not None:
            down |= {
                "relational": self.relational,
                "relational_mask": self.relational_mask,
                "consistent": self.consistent,
                "consistent_mask": self.consistent_mask,
            }
        return self.broadcast(selected, down)

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        super().aggregate(rnd, uplinks)  # sample-weighted FedAvg over this round's participants
        if not uplinks:
            return
        protos = torch.stack([u["prototypes"] for u in uplinks.values()]).float()  # [K, C, d]
        counts = torch.stack([u["class_counts"] for u in uplinks.values()])  # [K, C]
        mask = counts > 0
        self.relational = relational_prototypes(protos, mask, self.hp.neighbors)
        self.relational_mask = mask
        self.consistent = consistent_prototypes(self.relational, discrepancy_weights(counts), mask)
        self.consistent_mask = mask.any(0)


# --------------------------------------------------------------------------------------------- client


class FedSCClient(FedAvgClient):
    """CE + RPCL + CPDR on the received global model; uploads prototypes and class counts.

    R, O and U are per-round inputs, not client state: held (they follow the module to its device
    and stay out of checkpoints); ``receive`` replaces them every round.
    """

    hp: FedSCConfig
    # held (see hold); None before the first global prototypes exist
    relational: Tensor | None
    relational_mask: Tensor | None
    consistent: Tensor | None
    consistent_mask: Tensor | None
    scale: Tensor | None

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        for name in ("relational", "relational_mask", "consistent", "consistent_mask"):
            self.hold(name, payload.get(name))
        self.hold("scale", None)

    @torch.no_grad()
    def local_features(self) -> tuple[Tensor, Tensor]:
        """Eval-mode features of every local training sample with the current model: ``[N, d]``, ``[N]``."""
        _, z, y = eval_pass(self.model, self.training_data())
        return z, y

    def on_train_epoch_start(self) -> None:
        if self.relational is not None and self.hp.use_u:
            self.scale = distance_scale(self.local_features()[0], self.relational)  # Eq. 13, constant

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, z = self.model.forward_with_features(x)
        loss = F.cross_entropy(logits, y)
        self.record("loss/ce", loss)
        if self.relational is not None:
            assert self.relational_mask is not None and self.consistent is not None  # sent together
            rpcl = rpcl_loss(z, y, self.relational, self.relational_mask, self.hp.tau, self.scale)
            cpdr = cpdr_loss(z, y, self.consistent, self.hp.cpdr, self.consistent_mask)
            self.record("loss/rpcl", rpcl)
            self.record("loss/cpdr", cpdr)
            loss = loss + rpcl + cpdr
        self.record(Metrics.LOSS_TRAIN, loss)
        return loss

    def upload(self) -> Payload:
        protos, counts = class_prototypes(*self.local_features(), self.ctx.num_classes)  # Eq. 3-4
        return {**super().upload(), "prototypes": protos.cpu(), "class_counts": counts.cpu()}


@register("fedsc", server=FedSCServer, client=FedSCClient)
@dataclass
class FedSCConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True
    tau: float = 0.05  # RPCL temperature (paper Fig. 5: best 0.05)
    neighbors: int = 2  # M angular neighbours per relational prototype (paper Fig. 5: best 2)
    # cpdr: MSE by default (the released code; Eq. 15 read literally, l1, trains to chance: docs/algorithms/fedsc.md)
    cpdr: Literal["mse", "l1"] = "mse"
    use_u: bool = True  # Eq. 13's 1/U similarity scaling; false = plain cosine (the released code)

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.tau <= 0:
            raise ConfigError(f"fedsc.tau={self.tau}: the RPCL temperature must be > 0")
        if self.neighbors < 0:
            raise ConfigError(f"fedsc.neighbors={self.neighbors}: the number of neighbours M must be >= 0")
