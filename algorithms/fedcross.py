"""FedCross: Hu et al., "FedCross: Towards Accurate Federated Learning via Multi-Model Cross-Aggregation"
(ICDE 2024, arXiv:2210.08285), paper Sec. III and Alg. 1; fedray's choices where the paper is silent are
explained in docs/algorithms/fedcross.md.

The server keeps K middleware models ``W = [w^0 .. w^{K-1}]`` (K = clients per round). Each round it
shuffles them onto the K sampled clients, each client trains its model and uploads ``v^i``, and every
uploaded model is fused with one collaborator chosen from the uploaded set ``V`` (Sec. III-B2)

.. math::  w_{r+1}^i = \\alpha\\, v_{r+1}^i + (1 - \\alpha)\\, v_{r+1}^{co(i)},   \\alpha \\in [0.5, 1)

with ``co(i) != i`` picked by CoModelSel (Sec. III-B1):

- in-order:  ``co(i) = (i + (r mod (K-1) + 1)) mod K``  (0-based i; keeps ``sum_i w^i = sum_i v^i``, Eq. 2)
- highest / lowest similarity:  ``co(i) = argmax / argmin_{j != i} cos(v^i, v^j)``

The global model ``w_g = 1/K sum_i w^i`` (Sec. III-B3) is used for evaluation only; it is never sent
for training. Training acceleration (Sec. III-D gives no equations; these formulas are fedray's choice,
see docs/algorithms/fedcross.md, Propeller models and Dynamic alpha schedule):

- propeller models (PM): ``w^i = a v^i + (1-a)/P sum_{o=1..P} v^{(i+o) mod K}``, ``a = 1/(P+1)``
- dynamic alpha (DA): ``alpha_r = 0.5 + (alpha - 0.5) (r - r_0) / R_DA`` for ``r_0 <= r < r_0 + R_DA``

Choices where the paper is silent or ambiguous; the bracket names the heading in
docs/algorithms/fedcross.md that explains each one:
- [In-order model indices] in-order uses 0-based model indices i = 0..K-1 (1-based i with ``% K``
  could return 0).
- [Similarity measure] similarity is the standard cosine ``<x,y> / (|x| |y|)`` (Sec. III-B1 prints
  ``|x| + |y|``, a typo for "classic cosine"), over the parameters of the uploaded models (not their
  BN statistics), flattened, float64.
- [Shared collaborators and ties] several models may share a collaborator; ties go to the lowest index.
- [BatchNorm statistics and integer buffers] BN running statistics are fused by the same alpha rule;
  integer buffers are copied from self.
- [Initialisation of the middleware models] all K models start from one random init
  (``same_init: true``); false = K independent inits.
- [Shuffling models onto clients] the shuffle is a random permutation assigning the K models to the K
  sampled clients, drawn from (seed, round) so a resumed run shuffles identically.
- [Propeller models] PM: P = ``propeller_num`` = 4 in-order propellers ``(i+o) mod K, o = 1..P``
  (not rotated with the round), self weight 1/(P+1).
- [Dynamic alpha schedule] DA: linear ramp from 0.5 to ``alpha`` over ``dynamic_alpha_rounds`` rounds
  starting at ``dynamic_alpha_start_round`` (PM-DA as in Sec. IV-E3 / Fig. 9: PM for rounds 0..49, DA
  for 50..99).
- [Local optimizer] local training is the base client's (a fresh optimizer from ``train.*`` each round,
  no momentum kept); ``train.keep_optimizer_state`` is refused.

Other choices: [The range of alpha] ``alpha = 1.0`` is accepted (the paper's range is [0.5, 1)), since
it is the identity fusion tests rely on. A client that fails mid-round leaves its middleware model as it was dispatched
(``v^i = w_r^i``), and the fusion still reads the full set V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Payload,
    Server,
    ServerContext,
    client_count,
    clients_per_round,
    cpu_state,
    register,
    round_count,
    stream,
    torch_generator,
)

Selection = Literal["in_order", "highest_similarity", "lowest_similarity"]

# the per-round model -> client permutation. Its tag comes from its name: the hand-picked 5 it had
# was coordinator/eval_sample's, so both drew from the same seed every round
stream("fedcross/shuffle", "rnd")
DA_ALPHA_START = 0.5  # dynamic alpha starts here (Sec. III-D: "from 0.5 to a specific threshold")
# the fusions read at most this many elements of one entry of the K models at a time: float64 copies of
# K whole models would take K * 8 bytes a parameter (10.7 GB for ten ImageNet-style VGG-16s)
BLOCK_ELEMENTS = 1 << 20


# --------------------------------------------------------------------------------------------- math


def entry_blocks(states: Sequence[Mapping[str, Tensor]], key: str) -> Iterator[tuple[slice, Tensor]]:
    """The K states' entry ``key``, flattened, as float64 blocks of at most ``BLOCK_ELEMENTS`` each.

    Shape: yields ``(part, x)`` with ``x [K, b]``, ``x[i] = states[i][key].flatten()[part]``. The
    fusions are elementwise, so block by block gives the bits of the whole vector at once.
    """
    n = states[0][key].numel()
    for start in range(0, max(n, 1), BLOCK_ELEMENTS):
        part = slice(start, min(n, start + BLOCK_ELEMENTS))
        yield part, torch.stack([s[key].detach().reshape(-1)[part].double() for s in states])


def fuse_states(
    states: Sequence[Mapping[str, Tensor]], fuse: Callable[[Tensor], Tensor]
) -> list[dict[str, Tensor]]:
    """``fuse`` (elementwise over the K models: ``[K, b] -> [K, b]``, in float64) applied to every
    floating-point entry of K state dicts; each result keeps its own entry's dtype, and integer
    entries are copied from its own state (counters come from self; docs/algorithms/fedcross.md,
    BatchNorm statistics and integer buffers)."""
    out: list[dict[str, Tensor]] = [{} for _ in states]
    for key, ref in states[0].items():
        if not ref.is_floating_point():
            for own, state in zip(out, states):
                own[key] = state[key].detach().clone()
            continue
        fused = [torch.empty(ref.shape, dtype=state[key].dtype) for state in states]
        for part, x in entry_blocks(states, key):
            for target, row in zip(fused, fuse(x)):
                target.view(-1)[part] = row  # cast back to the entry's dtype
        for own, value in zip(out, fused):
            own[key] = value
    return out


def mean_state(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The uniform mean of K state dicts, entry by entry in float64 (integer entries from the first)."""
    out: dict[str, Tensor] = {}
    for key, ref in states[0].items():
        if not ref.is_floating_point():
            out[key] = ref.detach().clone()
            continue
        out[key] = torch.empty(ref.shape, dtype=ref.dtype)
        for part, x in entry_blocks(states, key):
            out[key].view(-1)[part] = x.mean(dim=0)
    return out


def similarity_gram(states: Sequence[Mapping[str, Tensor]], keys: Sequence[str]) -> Tensor:
    """The Gram matrix ``G[i, j] = <v_i, v_j>`` of the K states' entries ``keys`` flattened into one
    vector each, in float64, summed block by block (no ``[K, P]`` copy of the models).

    Shape: ``[K, K]``.
    """
    gram = torch.zeros(len(states), len(states), dtype=torch.float64)
    for key in keys:
        for _, x in entry_blocks(states, key):
            gram += x @ x.T
    return gram


def cosine_from_gram(gram: Tensor) -> Tensor:
    """Pairwise cosine similarity ``S[i, j] = G[i, j] / (|v_i| |v_j|)`` from the Gram matrix (Sec. III-B1).

    The paper prints ``|v_i| + |v_j|`` in the denominator; fedray reads it as a typo for the classic cosine
    (see docs/algorithms/fedcross.md, Similarity measure). A zero vector has similarity 0 to everything.
    """
    norms = gram.diagonal().clamp_min(0).sqrt()
    return gram / torch.outer(norms, norms).clamp_min(torch.finfo(torch.float64).tiny)


def cosine_similarity_matrix(v: Tensor) -> Tensor:
    """Pairwise cosine similarity of the rows of ``v [K, P]`` -> ``[K, K]``, in float64."""
    v = v.double()
    return cosine_from_gram(v @ v.T)


def in_order_collaborators(num_models: int, rnd: int) -> Tensor:
    """In-order CoModelSel: ``co(i) = (i + (rnd mod (K-1) + 1)) mod K`` for 0-based i (Sec. III-B1).

    Shape: ``[K]`` (long). The offset runs through 1..K-1, so over K-1 consecutive rounds every model
    is paired with each of the others exactly once, and ``co`` is a permutation (mean-preserving).
    """
    offset = rnd % (num_models - 1) + 1
    return (torch.arange(num_models) + offset) % num_models


def select_collaborators(num_models: int, rnd: int, strategy: Selection, sim: Tensor | None = None) -> Tensor:
    """CoModelSel for every uploaded model at once (Sec. III-B1, Alg. 1 line 13).

    Shape: ``sim [K, K]`` (the uploads' cosine similarities; in-order needs none) -> ``co [K]`` (long),
    ``co[i] != i``. ``lowest_similarity`` = argmin and ``highest_similarity`` = argmax of the cosine over
    ``j != i``; ties go to the lowest index.
    """
    k = num_models
    if k < 2:
        raise ValueError(f"cross-aggregation needs at least 2 models, got {k}")
    if strategy == "in_order":
        return in_order_collaborators(k, rnd)
    if sim is None or sim.shape != (k, k):
        raise ValueError(f"{strategy} needs the {k} x {k} similarity matrix of the uploaded models")
    self_mask = torch.eye(k, dtype=torch.bool)
    if strategy == "lowest_similarity":
        return sim.masked_fill(self_mask, float("inf")).argmin(dim=1)
    if strategy == "highest_similarity":
        return sim.masked_fill(self_mask, float("-inf")).argmax(dim=1)
    raise ValueError(f"unknown selection strategy {strategy!r}")


def cross_aggregate(v: Tensor, co: Tensor, alpha: float) -> Tensor:
    """CrossAggr: ``w_i = alpha * v_i + (1 - alpha) * v_{co[i]}`` (Sec. III-B2; numbered Eq. 1 in Sec. III-C2).

    Shape: ``v [K, P]``, ``co [K]`` -> ``[K, P]``. Reads only the uploaded snapshot ``v``.
    """
    return alpha * v + (1 - alpha) * v[co]


def propeller_aggregate(v: Tensor, num_propellers: int, self_weight: float | None = None) -> Tensor:
    """Propeller-model fusion (Sec. III-D; the paper gives no formula, this one is fedray's:
    see docs/algorithms/fedcross.md, Propeller models).

    ``w_i = a * v_i + (1 - a) / P * sum_{o=1..P} v_{(i+o) mod K}`` with in-order propellers and
    ``a = 1 / (P + 1)`` by default (a uniform mean of the model and its P propellers).
    Shape: ``v [K, P_params]`` -> ``[K, P_params]``; needs ``1 <= P <= K - 1``.
    """
    k = v.shape[0]
    if not 1 <= num_propellers <= k - 1:
        raise ValueError(f"num_propellers={num_propellers}: must be in 1..K-1 = 1..{k - 1}")
    a = 1.0 / (num_propellers + 1) if self_weight is None else self_weight
    idx = (torch.arange(k)[:, None] + torch.arange(1, num_propellers + 1)[None, :]) % k  # [K, P]
    return a * v + (1 - a) / num_propellers * v[idx].sum(dim=1)


def dynamic_alpha(rnd: int, alpha: float, start_round: int, ramp_rounds: int) -> float:
    """Dynamic alpha (Sec. III-D): 0.5 -> ``alpha`` over ``ramp_rounds``.

    The paper gives no schedule; the linear ramp is fedray's (see docs/algorithms/fedcross.md,
    Dynamic alpha schedule).

    ``alpha_r = 0.5 + (alpha - 0.5) * (r - r_0) / R`` for ``r_0 <= r < r_0 + R``, else ``alpha``
    (also when ``R = 0``, i.e. DA is off).
    """
    if ramp_rounds > 0 and start_round <= rnd < start_round + ramp_rounds:
        return DA_ALPHA_START + (alpha - DA_ALPHA_START) * (rnd - start_round) / ramp_rounds
    return alpha


# --------------------------------------------------------------------------------------------- server


class FedCrossServer(Server):
    """Keeps the K middleware models (state dicts), the round's model -> client assignment, and the
    global model (their uniform mean), which is only evaluated."""

    hp: FedCrossConfig
    UPLINK_KEYS = ("model",)  # K uploads of equal weight: no sample count
    STATE = ("num_models", "model", "middleware", "assignment", "collaborators")

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.num_models = self.hp.num_middleware or clients_per_round(ctx.cfg)
        self.model = ctx.make_model(0)  # holds the global model; built once
        if self.hp.same_init:
            init = cpu_state(self.model)
            self.middleware = [{k: v.clone() for k, v in init.items()} for _ in range(self.num_models)]
        else:
            self.middleware = [cpu_state(ctx.distinct_model(i)) for i in range(self.num_models)]
        self.assignment: dict[int, int] = {}  # client id -> index of the middleware model it got
        self.collaborators: list[int] = []  # last round's co(i), for inspection
        self._update_global()

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        if len(selected) != self.num_models:
            raise ValueError(f"{len(selected)} clients sampled for {self.num_models} middleware models")
        gen = torch_generator("fedcross/shuffle", self.ctx.cfg.seed, rnd)
        order = torch.randperm(self.num_models, generator=gen).tolist()  # model i -> selected[order[i]]
        self.assignment = {selected[j]: i for i, j in enumerate(order)}
        # a distinct payload object per client: each carries a different model
        return {cid: {"model": dict(self.middleware[i])} for cid, i in self.assignment.items()}

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:  # every client failed: nothing was trained, nothing to fuse
            return
        uploaded = list(self.middleware)  # a model whose client failed stays as dispatched
        for cid, uplink in uplinks.items():
            uploaded[self.assignment[cid]] = uplink["model"]
        # the snapshot V: every fusion reads it, none reads a fused model
        self.middleware = fuse_states(uploaded, self.fusion(rnd, uploaded))
        self._update_global()

    def fusion(self, rnd: int, uploaded: Sequence[Mapping[str, Tensor]]) -> Callable[[Tensor], Tensor]:
        """This round's elementwise fusion of the uploaded set ``[K, b] -> [K, b]``: PM while it is on,
        else CrossAggr with alpha_r and the collaborators CoModelSel picks from the uploads."""
        hp = self.hp
        if rnd < hp.propeller_rounds:
            self.collaborators = []
            return partial(propeller_aggregate, num_propellers=hp.propeller_num)
        sim = None
        if hp.selection != "in_order":  # "the number of parameters" (Sec. III-B1): BN statistics are not
            parameters = [name for name, _ in self.model.named_parameters()]
            sim = cosine_from_gram(similarity_gram(uploaded, parameters))
        co = select_collaborators(len(uploaded), rnd, hp.selection, sim)
        self.collaborators = co.tolist()
        alpha = dynamic_alpha(rnd, hp.alpha, hp.dynamic_alpha_start_round, hp.dynamic_alpha_rounds)
        return partial(cross_aggregate, co=co, alpha=alpha)

    def _update_global(self) -> None:
        """GlobalModelGen: ``w_g = 1/K sum_i w^i`` (Sec. III-B3), uniform, over the fused models."""
        self.model.load_state_dict(mean_state(self.middleware))

    def global_model(self) -> nn.Module:
        return self.model


# --------------------------------------------------------------------------------------------- client


class FedCrossClient(ClientModule):
    """Trains the middleware model it received with plain cross-entropy and uploads it (Alg. 1 line 8).

    Aggregation is uniform, so no sample count goes up. The downlink overwrites the whole model,
    so nothing of a client outlives its round.
    """

    hp: FedCrossConfig
    keeps_state = False

    def upload(self) -> Payload:
        return {"model": cpu_state(self.model)}


# --------------------------------------------------------------------------------------------- config


@register("fedcross", server=FedCrossServer, client=FedCrossClient)
@dataclass
class FedCrossConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # cross-aggregates whole middleware models
    MIN_PARTICIPANTS: ClassVar[int] = 2  # cross-aggregation needs a collaborator
    alpha: float = 0.99  # cross-aggregation self weight (paper default; range [0.5, 1))
    selection: Selection = "lowest_similarity"  # CoModelSel; the paper's main experiments use lowest
    num_middleware: int | None = client_count(
        None
    )  # K; null = train.fraction * N; also the clients per round
    same_init: bool = True  # all K models copy one random init
    propeller_rounds: int = round_count(
        0
    )  # PM acceleration for rounds 0..propeller_rounds-1 (paper: 100); 0 = off
    propeller_num: int = 4  # P propeller models per middleware model
    dynamic_alpha_rounds: int = round_count(0)  # DA ramp length (paper: 100; 50 in PM-DA); 0 = off
    dynamic_alpha_start_round: int = round_count(0)  # first DA round (PM-DA: = propeller_rounds)

    def participants(self) -> int | None:
        """The paper's K is both the middleware count and the clients per round: setting one sets both."""
        return self.num_middleware

    def validate(self, cfg: ExperimentConfig) -> None:
        if self.num_middleware is not None and not 2 <= self.num_middleware <= cfg.data.num_clients:
            raise ConfigError(
                f"fedcross.num_middleware={self.num_middleware}: must be in 2..data.num_clients="
                f"{cfg.data.num_clients} (or null = train.fraction * data.num_clients)"
            )
        k = clients_per_round(cfg)
        if not 0.5 <= self.alpha <= 1.0:
            raise ConfigError(f"fedcross.alpha={self.alpha}: must be in [0.5, 1.0] (paper default 0.99)")
        if k < 2:
            raise ConfigError(
                f"train.fraction={cfg.train.fraction}: FedCross needs >= 2 clients per round to "
                f"cross-aggregate, got {k} of data.num_clients={cfg.data.num_clients}"
            )
        if cfg.train.keep_optimizer_state:
            raise ConfigError(
                "train.keep_optimizer_state=true with algorithm=fedcross: the shuffle hands a client another "
                "middleware model almost every round, so the optimizer state it kept belongs to a different model"
            )
        for name in ("propeller_rounds", "dynamic_alpha_rounds", "dynamic_alpha_start_round"):
            if getattr(self, name) < 0:
                raise ConfigError(f"fedcross.{name}={getattr(self, name)}: must be >= 0 (0 = off)")
        if self.propeller_rounds > 0 and not 1 <= self.propeller_num <= k - 1:
            raise ConfigError(f"fedcross.propeller_num={self.propeller_num}: must be in 1..K-1 = 1..{k - 1}")
        start, pm = self.dynamic_alpha_start_round, self.propeller_rounds
        if pm > 0 and self.dynamic_alpha_rounds > 0 and start < pm:
            raise ConfigError(
                f"fedcross.dynamic_alpha_start_round={start}: overlaps the propeller rounds 0..{pm - 1}; "
                f"set it >= {pm} (PM first, then DA)"
            )
