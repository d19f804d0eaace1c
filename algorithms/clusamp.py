"""CluSamp: Fraboni, Vidal, Kameni and Lorenzi, "Clustered Sampling: Low-Variance and Improved
Representativity for Clients Selection in Federated Learning" (ICML 2021, arXiv:2105.05883), Algorithm 2
(clustering by model similarity); a baseline of the FedCross paper (Sec. IV-A, Table II), which
clusters "by model gradient similarity" with the authors' code (github.com/Accenture/
Labs-Federated-Learning, branch ``clustered_sampling``), whose form this follows.

FedAvg, with the round's ``m`` clients drawn from ``m`` distributions ``r_1..r_m`` over the ``N``
clients instead of uniformly: each client's mean probability over them is its share of the data,
``(1/m) sum_j r_j(i) = p_i = n_i / n``, so the aggregate stays unbiased, and clients alike (by their
representative gradients) fall in one distribution, so a round draws unlike ones. Each round:

1. the distance between the last representative gradients of every pair of clients, where a client's
   gradient is its uploaded parameters minus the global parameters it received (zero until it has
   trained), by default the angle ``arccos(cos(g_i, g_j))`` (0 where either is zero);
2. Ward's hierarchy over the rows of that matrix; its merge heights replaced by the merged clusters'
   data shares, cut into the largest clusters of share at most ``1/m``;
3. the ``m`` heaviest clusters each start a distribution (a client's mass ``m p_i``); the clients of
   the lighter ones, cluster by cluster from the lightest and in a drawn order within one, fill the
   distributions one after the other to mass 1, a client split over two where it does not fit;
4. one client drawn from each distribution; a client drawn twice trains once and weighs twice.

The server averages the drawn clients' models with weights ``1/m`` each (a client drawn ``c`` times:
``c/m``), renormalised over those that arrived, and stores their new representative gradients.

Choices where the paper is silent (docs/algorithms/clusamp.md):
- A client drawn twice trains once, as it would from the same global model, and weighs twice (the
  authors' code trains it twice).
- Ward's linkage reads the rows of the distance matrix as observations, as the authors' code passes it
  to ``scipy.cluster.hierarchy.linkage``; gradients are of the parameters only (not BatchNorm's
  statistics), the authors' ``model.parameters()``.
- A client with more than ``1/m`` of the data fills a distribution alone and the rest of its mass is
  poured last (the authors' code loops forever there).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
from scipy.cluster.hierarchy import ClusterWarning, fcluster, linkage
from torch import Tensor

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import (
    AlgorithmConfig,
    Payload,
    cpu_state,
    numpy_rng,
    register,
    stream,
)

stream("clusamp/sample", "rnd")  # the order within light clusters and the draws from each distribution

SCALE = 10**10  # the authors' integer unit of probability mass: their sums are exact

# ------------------------------------------------------------------------------------------- the math


def gradient_distances(grads: Tensor, kind: str) -> Tensor:
    """``[N, N]`` distances between the rows of ``grads [N, P]``: ``arccos`` of their cosine (0 where
    either row is zero), ``l1`` the sum of absolute differences, ``l2`` the sum of squared ones (no
    square root, as the authors' code). In float64."""
    g = grads.float()
    if kind == "l1":  # N^2 P additions without BLAS: slower than the others on a large model
        return torch.cdist(g, g, p=1).double()
    if kind == "l2":
        return torch.cdist(g, g, p=2).double() ** 2
    gram = (g @ g.T).double()  # no float64 copy of the [N, P] gradients
    norms = gram.diagonal().sqrt()
    cos = (gram / (norms[:, None] * norms[None, :])).clamp(-1, 1)
    zero = (norms == 0)[:, None] | (norms == 0)[None, :]
    return torch.where(zero, 0.0, torch.arccos(cos))


def cluster_distributions(
    distances: np.ndarray, shares: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """``[m, N]`` sampling distributions (rows summing to 1, columns averaging to ``shares``) from
    Algorithm 2 over Ward's hierarchy of ``distances [N, N]``; ``shares [N]`` sum to 1."""
    n = len(shares)
    with warnings.catch_warnings():  # rows of a square matrix as observations, on purpose
        warnings.simplefilter("ignore", ClusterWarning)
        tree = linkage(distances, "ward")
    mass = [int(s * SCALE * m) for s in shares]  # a client's total over the m distributions
    # each merge's height: the merged cluster's data share, so the cut keeps clusters of share <= 1/m
    weight = list(shares)
    for row in tree:
        weight.append(weight[int(row[0])] + weight[int(row[1])])
        row[2] = int(weight[-1] * SCALE)
    clusters = fcluster(tree, int(SCALE / m), criterion="distance")
    labels = np.arange(1, clusters.max() + 1)
    members = [np.flatnonzero(clusters == c) for c in labels]
    order = np.argsort(np.array([sum(mass[i] for i in mem) for mem in members]))  # lightest first
    # the m heaviest clusters keep a distribution each; a client holding more than 1/m of the data
    # can leave fewer than m clusters, and then every cluster keeps one
    cut = max(len(order) - m, 0)
    rows = np.zeros((m, n), dtype=np.int64)
    spill: list[tuple[int, int]] = []  # (client, mass) beyond a full distribution of its own
    for row, c in enumerate(order[cut:]):
        for i in members[c]:
            rows[row, i] = mass[i]
        excess = rows[row].sum() - SCALE
        if excess > 0:  # a single client holding more than 1/m of the data
            (i,) = members[c]
            rows[row, i] = SCALE
            spill.append((i, int(excess)))
    pour: list[tuple[int, int]] = []
    for c in order[:cut]:
        clients = members[c].copy()
        rng.shuffle(clients)
        pour += [(int(i), mass[i]) for i in clients]
    k = 0
    for i, left in pour + spill:
        while left > 0 and k < m:
            room = SCALE - rows[k].sum()
            put = min(room, left)
            rows[k, i] += put
            left -= put
            if rows[k].sum() >= SCALE:
                k += 1
    return rows / rows.sum(axis=1, keepdims=True)


def draw_clients(distributions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One client from each row of ``distributions [m, N]``: ``[m]`` ids, repeats possible."""
    return np.array([rng.choice(distributions.shape[1], p=row) for row in distributions])


# ------------------------------------------------------------------------------------------- server half


class CluSampServer(FedAvgServer):
    """FedAvg's global model, its clients drawn from the clustered distributions, weighted by draws."""

    hp: CluSampConfig  # type: ignore[assignment]
    UPLINK_KEYS = ("model",)
    STATE = ("model", "gradients", "draws")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if len(ctx.train_sizes) != ctx.num_clients:
            raise ValueError(
                f"CluSamp draws by data shares: ServerContext.train_sizes has {len(ctx.train_sizes)} sizes for "
                f"{ctx.num_clients} clients"
            )
        size = sum(p.numel() for p in self.model.parameters())
        self.gradients = torch.zeros(ctx.num_clients, size)  # each client's last representative gradient
        # this round's draws per client, from select to aggregate (state to the platform, as every
        # attribute is; a resumed run draws its next round afresh)
        self.draws = torch.zeros(ctx.num_clients, dtype=torch.int64)

    def select(self, rnd: int, k: int) -> list[int]:
        sizes = np.asarray(self.ctx.train_sizes, dtype=np.float64)
        rng = numpy_rng("clusamp/sample", self.ctx.cfg.seed, rnd)
        distances = gradient_distances(self.gradients, self.hp.distance).numpy()
        drawn = draw_clients(cluster_distributions(distances, sizes / sizes.sum(), k, rng), rng)
        self.draws = torch.bincount(torch.from_numpy(drawn), minlength=self.ctx.num_clients)
        return sorted(set(drawn.tolist()))

    def models_weighted(self, uplinks: dict[int, Payload]) -> dict:
        return {cid: (u["model"], float(self.draws[cid])) for cid, u in uplinks.items()}  # c/m per client

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        sent = flat_parameters(self.model, self.model.state_dict())  # before the mean replaces it
        for cid, u in uplinks.items():
            self.gradients[cid] = flat_parameters(self.model, u["model"]) - sent
        super().aggregate(rnd, uplinks)


def flat_parameters(model: torch.nn.Module, state: dict[str, Tensor]) -> Tensor:
    """The entries of ``state`` that are ``model``'s parameters (not its buffers), flat, in float32: the
    authors' gradients read ``model.parameters()`` (``flat_state`` also takes BatchNorm's statistics)."""
    return torch.cat([state[name].detach().reshape(-1).float() for name, _ in model.named_parameters()])


# ------------------------------------------------------------------------------------------- client half


class CluSampClient(FedAvgClient):
    """FedAvg's client; uploads its model alone (the server weighs by draws, not train sizes)."""

    def upload(self) -> Payload:
        return {"model": cpu_state(self.model)}


@register("clusamp", server=CluSampServer, client=CluSampClient)
@dataclass
class CluSampConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # FedAvg's server: one architecture for all clients

    distance: Literal["arccos", "l1", "l2"] = "arccos"  # between representative gradients (the authors')
