"""FedCDA: Wang, Xu, Li, Xu, Li and Zhang, "FedCDA: Federated Learning with Cross-rounds
Divergence-aware Aggregation" (ICLR 2024, OpenReview nbPGqeH3lt); a baseline of the FedSC paper
(Sec. 5.1, Table 1). Its authors' code is not public (an OpenReview supplement); fedray follows the
paper's Algorithm 1 and Eq. 8 (docs/algorithms/fedcda.md says how they were read).

The server keeps each client's ``K`` most recent uploaded models, each with the client's mean training
loss over its last local epoch, ``F_n(w)``, and a selected one per client. After ``warmup_rounds`` of
FedAvg, each round it re-selects the models of the round's clients, split at random into ``B`` batches
taken in turn: for batch ``b`` it tries every combination of its clients' cached models and keeps the
one that minimises, over the set ``S`` of every other client's selected model (the clients not in the
round, and the batches before ``b``) and the combination,

.. math::  J(S) = \\frac{1}{|S|} \\sum_{n \\in S} \\big( F_n(w_n) + \\tfrac{L}{2} \\lVert w_n \\rVert^2 \\big)
           - \\tfrac{L}{2} \\lVert \\bar w_S \\rVert^2
         = \\mathrm{mean}_{S} F_n(w_n) + \\tfrac{L}{2} \\, \\mathrm{mean}_{S} \\lVert w_n - \\bar w_S \\rVert^2

(an upper bound on the loss of the mean ``w_S`` of L-smooth losses at local optima). The new global
model is the plain mean of the selected models of every client seen so far.

Choices where the paper is silent (docs/algorithms/fedcda.md):
- [Unequal batches] the round's clients in a random order, cut into ``min(B, P)`` batches whose sizes
  differ by at most one (4 clients in 3 batches: 2, 1, 1).
- [The norms] over the model's parameters (not BatchNorm's running statistics), measured from the
  round's global model; the mean is over the whole state, statistics included.
- [No batch trained] a client reports its uploaded model's loss on its training data (eval mode).
- [Clients never seen] out of ``S`` and of the mean; a client in its first rounds searches the models it
  has. During the warm-up each client's newest model is its selected one.
- [Ties] the newer model wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
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
    clients_per_round,
    cpu_state,
    eval_pass,
    numpy_rng,
    register,
    stream,
    weighted_average,
)

stream("fedcda/batches", "rnd")  # the order the round's clients are cut into batches

State = Mapping[str, Tensor]
CHUNK = 1 << 15  # combinations scored at once
MAX_COMBINATIONS = 10**6  # per batch (K^ceil(P/B)): beyond, a round's search takes minutes

# ------------------------------------------------------------------------------------------- the math


@dataclass
class SelectionPool:
    """What ``J`` reads of a round's models, as float64 inner products: the candidates' (every cached
    model of the round's clients) among themselves and with the sum ``s`` of the fixed models (the
    selected ones of the clients not in the round), and the fixed models' own sums."""

    cross: Tensor  # [V, V] <c_i, c_j>
    with_fixed: Tensor  # [V] <c_i, s>
    losses: Tensor  # [V] F of each candidate
    fixed_square: float  # ||s||^2
    fixed_norms: float  # sum of the fixed models' ||w||^2
    fixed_loss: float  # sum of the fixed models' F
    fixed_count: int

    @classmethod
    def of(
        cls,
        candidates: list[State],
        losses: list[float],
        fixed: list[State],
        fixed_losses: list[float],
        keys: list[str],
        origin: State | None = None,
    ) -> SelectionPool:
        """The pool of ``candidates`` beside ``fixed``, over the entries ``keys`` (the parameters),
        measured from ``origin`` (``J`` is the same from any point; from one near the models, the
        global model, its two large terms cancel less)."""
        v = len(candidates)
        cross, with_fixed = torch.zeros(v, v, dtype=torch.float64), torch.zeros(v, dtype=torch.float64)
        fixed_square = fixed_norms = 0.0
        for key in keys:  # one entry at a time: no copy of whole flattened models
            shift = (
                torch.zeros((), dtype=torch.float64) if origin is None else origin[key].reshape(-1).double()
            )
            c = torch.stack([s[key].reshape(-1).double() - shift for s in candidates])
            cross += c @ c.T
            total = torch.zeros(c.shape[1], dtype=torch.float64)
            for state in fixed:  # summed one model at a time
                f = state[key].reshape(-1).double() - shift
                total += f
                fixed_norms += float(f @ f)
            with_fixed += c @ total
            fixed_square += float(total @ total)
        return cls(
            cross,
            with_fixed,
            torch.tensor(losses, dtype=torch.float64),
            fixed_square,
            fixed_norms,
            float(sum(fixed_losses)),
            len(fixed),
        )

    def objective(self, chosen: list[int], smoothness: float) -> float:
        """``J`` of the fixed models with the candidates ``chosen`` (indices into the pool)."""
        return float(self.objectives([], torch.tensor([chosen], dtype=torch.long), smoothness)[0])

    def objectives(self, prior: list[int], combinations: Tensor, smoothness: float) -> Tensor:
        """``J`` of the fixed models with the candidates ``prior`` and each row of ``combinations``
        ``[n, b]`` (indices into the pool), for all rows at once: ``[n]``."""
        p = torch.tensor(prior, dtype=torch.long)
        c = combinations
        m = self.fixed_count + len(prior) + c.shape[1]
        with_prior = self.cross[:, p].sum(1)  # <c_i, sum of the prior ones>
        square = (
            self.fixed_square
            + 2 * self.with_fixed[p].sum()
            + self.cross[p][:, p].sum()
            + 2 * (self.with_fixed + with_prior)[c].sum(1)
            + self.cross[c[:, :, None], c[:, None, :]].sum((1, 2))
        )
        diagonal = self.cross.diagonal()
        norms = self.fixed_norms + diagonal[p].sum() + diagonal[c].sum(1)
        loss = self.fixed_loss + self.losses[p].sum() + self.losses[c].sum(1)
        return loss / m + smoothness / 2 * (norms / m - square / m**2)


def select_by_batches(pool: SelectionPool, batches: list[list[list[int]]], smoothness: float) -> list[int]:
    """Eq. 8 batch by batch: ``batches[b][i]`` are the candidates (pool indices, newest first) of the
    ``i``-th client of batch ``b``; each batch takes the combination of lowest ``J`` over the fixed
    models and the batches before it (the first such combination on a tie). Returns the chosen index
    of every client, batch after batch."""
    chosen: list[int] = []
    for batch in batches:
        combinations = torch.tensor(list(itertools.product(*batch)), dtype=torch.long)
        parts = combinations.split(CHUNK)  # a chunk at a time: each holds [rows, b, b] inner products
        values = torch.cat([pool.objectives(chosen, part, smoothness) for part in parts])
        best = int(values.argmin())  # the first of equals
        chosen.extend(combinations[best].tolist())
    return chosen


def cut_into_batches(clients: list[int], batches: int, rng: np.random.Generator) -> list[list[int]]:
    """The clients in a random order, cut into ``min(batches, len(clients))`` batches of sizes that
    differ by at most one, the larger first."""
    order = rng.permutation(clients).tolist()
    return [
        part.tolist() for part in np.array_split(np.array(order, dtype=np.int64), min(batches, len(order)))
    ]


# ------------------------------------------------------------------------------------------- server half


class FedCDAServer(FedAvgServer):
    """FedAvg's server for the warm-up; then the plain mean of the models selected by Eq. 8 from each
    client's cache of its recent uploads."""

    hp: FedCDAConfig  # type: ignore[assignment]
    UPLINK_KEYS = ("model", "num_samples", "train_loss")
    STATE = ("model", "cache", "cache_losses", "selected")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.cache: dict[int, list[dict[str, Tensor]]] = {}  # client -> its recent models, oldest first
        self.cache_losses: dict[int, list[float]] = {}  # their F_n
        self.selected: dict[int, int] = {}  # client -> the position of its selected model in its cache

    def uplinks_arrived(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if rnd < self.hp.warmup_rounds:  # FedAvg's running sum, only when FedAvg's mean is taken
            super().uplinks_arrived(rnd, uplinks)

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        for cid, uplink in uplinks.items():
            self.remember(cid, uplink)
        if rnd < self.hp.warmup_rounds:
            super().aggregate(rnd, uplinks)
            return
        self.reselect(rnd, sorted(uplinks))
        states = [self.cache[cid][slot] for cid, slot in sorted(self.selected.items())]
        self.model.load_state_dict(weighted_average(states, [1.0] * len(states)))

    def remember(self, cid: int, uplink: Payload) -> None:
        """The upload joins the client's cache (the oldest beyond ``K`` leaves) and is its selected
        model until a selection says otherwise."""
        models, losses = self.cache.setdefault(cid, []), self.cache_losses.setdefault(cid, [])
        models.append(cpu_state(uplink["model"]))  # a copy of its own, kept past the round's payloads
        losses.append(float(uplink["train_loss"]))
        del models[: -self.hp.cache_size], losses[: -self.hp.cache_size]
        self.selected[cid] = len(models) - 1

    def batches_of(self, rnd: int, clients: list[int]) -> list[list[int]]:
        """The round's clients cut into batches, in an order drawn from (seed, round) alone."""
        rng = numpy_rng("fedcda/batches", self.ctx.cfg.seed, rnd)
        return cut_into_batches(clients, self.hp.num_batches, rng)

    def reselect(self, rnd: int, clients: list[int]) -> None:
        """Eq. 8 over the round's ``clients``: their new selected models (``self.selected``)."""
        fixed = sorted(self.selected.keys() - set(clients))
        # (client, slot), each client's newest first (a tie keeps the newer), and each client's indices
        candidates: list[tuple[int, int]] = []
        options_of: dict[int, list[int]] = {}
        for cid in clients:
            options_of[cid] = list(range(len(candidates), len(candidates) + len(self.cache[cid])))
            candidates += [(cid, slot) for slot in reversed(range(len(self.cache[cid])))]
        keys = [name for name, _ in self.model.named_parameters()]
        pool = SelectionPool.of(
            [self.cache[cid][slot] for cid, slot in candidates],
            [self.cache_losses[cid][slot] for cid, slot in candidates],
            [self.cache[cid][self.selected[cid]] for cid in fixed],
            [self.cache_losses[cid][self.selected[cid]] for cid in fixed],
            keys,
            origin=self.model.state_dict(),  # the round's global model
        )
        options = [[options_of[cid] for cid in batch] for batch in self.batches_of(rnd, clients)]
        chosen = select_by_batches(pool, options, self.hp.smoothness)
        for i in chosen:
            cid, slot = candidates[i]
            self.selected[cid] = slot
        self.record("fedcda/objective", pool.objective(chosen, self.hp.smoothness))  # J of the selection
        self.record("fedcda/kept_older", sum(self.selected[c] < len(self.cache[c]) - 1 for c in clients))


# ------------------------------------------------------------------------------------------- client half


class FedCDAClient(FedAvgClient):
    """FedAvg's client that also uploads its mean training loss over its last local epoch (Alg. 1)."""

    last_epoch_loss: Tensor  # held: the sum of the last epoch's per-sample losses

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.hold("last_epoch_loss", torch.zeros(()))
        self.last_epoch_samples = 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.record(Metrics.LOSS_TRAIN, loss)
        if self.current_epoch == self.local_epochs(self.rnd) - 1:
            self.last_epoch_loss += loss.detach() * len(y)
            self.last_epoch_samples += len(y)
        return loss

    def upload(self) -> Payload:
        if self.last_epoch_samples:
            mean = float(self.last_epoch_loss) / self.last_epoch_samples
        else:  # no batch trained (fewer samples than train.batch_size with drop_last): F at the model
            logits, _, y = eval_pass(self.model, self.training_data())
            mean = float(F.cross_entropy(logits.float(), y))
        return {**super().upload(), "train_loss": mean}


@register("fedcda", server=FedCDAServer, client=FedCDAClient)
@dataclass
class FedCDAConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # averages whole models: one architecture for all clients

    cache_size: int = 3  # K: recent models kept per client (the paper's 3)
    num_batches: int = (
        3  # B: batches the round's clients are selected in (the paper's 3; 1 = Eq. 3's exact search)
    )
    smoothness: float = 1.0  # L of the bound (the paper's 1)
    warmup_rounds: int = 50  # rounds of FedAvg first (the paper's 50 of 200)

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.cache_size < 1:
            raise ConfigError(f"fedcda.cache_size={self.cache_size}: must be >= 1")
        if self.num_batches < 1:
            raise ConfigError(f"fedcda.num_batches={self.num_batches}: must be >= 1")
        if not self.smoothness >= 0:
            raise ConfigError(f"fedcda.smoothness={self.smoothness}: must be >= 0")
        if self.warmup_rounds < 0:
            raise ConfigError(f"fedcda.warmup_rounds={self.warmup_rounds}: must be >= 0")
        per_round = clients_per_round(cfg)
        largest = -(-per_round // min(self.num_batches, per_round))  # clients in the first batch
        if self.cache_size**largest > MAX_COMBINATIONS:
            raise ConfigError(
                f"fedcda.cache_size={self.cache_size} with {per_round} clients a round in fedcda.num_batches="
                f"{self.num_batches}: {self.cache_size}^{largest} combinations a batch, over {MAX_COMBINATIONS:,}; "
                "raise num_batches or lower cache_size"
            )
