"""FedSSA: Yi et al., "FedSSA: Semantic Similarity-based Aggregation for Efficient Model-Heterogeneous
Personalized Federated Learning" (IJCAI 2024, arXiv:2312.09006). Choices where the paper is silent:
docs/algorithms/fedssa.md; [code] = the authors' implementation, github.com/LipingYi/FedSSA.

Each client k has its own extractor and the shared linear header ``head``, split by class into rows
``theta_k^s = [W_s | b_s]`` (``d+1`` values). ``S_k`` = the classes in k's train data (fixed for the run).
Clients upload only their seen rows; the server averages each class over this round's uploaders K_s^t
that saw it (Eq. 3, unweighted); a class nobody uploaded keeps its previous global rows:

.. math::  \\theta^{t,s} = \\frac{1}{|K_s^t|} \\sum_{k \\in K_s^t} \\theta_k^{t,s}

Before training, a selected client fuses the global rows into its seen rows (Eq. 4, not a convex mix)
and keeps its unseen rows:

.. math::  \\hat\\theta_k^{t,s} = \\theta^{t-1,s} + \\mu_t \\theta_k^{t-1,s},\\ s \\in S_k

.. math::  \\mu_t = \\mu_0 \\cos(\\pi t / (2 T_{stable})) \\text{ if } t \\le T_{stable}, \\text{ else } 0

then trains the whole model with plain cross-entropy (Eq. 6; inherited ``training_step``).

Implementation choices (docs/algorithms/fedssa.md, under the heading named in each line):
- Header = ``head`` weight rows + bias, d+1 values per class (Sec. 4.1; "Header scope").
- The global header starts from a random Linear init drawn by the server from the run seed
  ("Initial global header").
- Downlink carries only the S_k rows (Sec. 4.1; "What travels each way"); the first one is the whole
  header (S_k not yet known).
- Uplink = seen rows + their int64 class indices (Sec. 4.1), not Sec. 4.3's zero-padded full header.
  ``fedssa.comm=full_header`` sends the whole header each way instead (unseen rows zero on the way up,
  the server reads S_k from the non-zero rows), to compare with the paper's Fig. 5 communication costs.
- Aggregation over this round's uploaders (Alg. 1); ``aggregate_all_latest`` = [code]'s variant
  ("Aggregation set").
- That variant averages the latest rows of every client heard from so far; never-heard clients count nothing.
- Defaults mu0 = 0.5, T_stable = 45 from [code] ("Default hyperparameters"); mu0 = 0 allowed (Table 5
  B ablation: mu = 0).
- Personalised evaluation: no global model; each client is tested with its own model (Sec. 4.2,
  Sec. 6.1; "Evaluation").
- Appendix F's ablations are settings ("Ablations"): ``aggregation=whole_header`` turns M1 off (every
  client uploads its whole header, the server averages whole headers, as LG-FedAvg);
  ``unseen_rows=replaced`` gives a client the global rows of its unseen classes (LG-FedAvg's
  replacement) where Eq. 4 keeps its own; with ``mu0=0`` too, the whole header is replaced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from fedray.algorithms.lgfedavg import global_header
from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Payload,
    Server,
    header_rows,
    load_header_rows,
    masked_mean,
    register,
    round_count,
    scatter_rows,
)

# ------------------------------------------------------------------------------------------- math


def mu_schedule(t: int, mu0: float, t_stable: int) -> float:
    """Eq. 4's local-header weight: ``mu0 * cos(pi t / (2 T_stable))`` for ``t <= T_stable``, else 0."""
    return mu0 * math.cos(math.pi * t / (2 * t_stable)) if t <= t_stable else 0.0


def fuse_header(
    global_rows: Tensor, local_rows: Tensor, seen: Tensor, mu: float, keep_unseen: bool = True
) -> Tensor:
    """Eq. 4: ``global + mu * local`` on seen rows; unseen rows are the local ones, bit for bit (or,
    with ``keep_unseen=False``, the global ones: LG-FedAvg's replacement, Appendix F's ablations).

    Shape: ``global_rows, local_rows [C, d+1]``, ``seen [C]`` bool -> ``[C, d+1]``. Global values on
    unseen rows are ignored when they are kept.
    """
    unseen = local_rows if keep_unseen else global_rows
    return torch.where(seen[:, None], global_rows + mu * local_rows, unseen)


def classwise_mean(headers: Tensor, seen: Tensor, previous: Tensor) -> Tensor:
    """Eq. 3: unweighted mean of each class's rows over the clients that saw it; ``previous`` where none.

    Shape: ``headers [K, C, d+1]``, ``seen [K, C]`` bool, ``previous [C, d+1]`` -> ``[C, d+1]``. Values
    of ``headers`` where ``seen`` is False are ignored.
    """
    mean, count = masked_mean(headers, seen)
    return torch.where(count[:, None] > 0, mean, previous)


def seen_rows_of(uplink: Payload, every_row: bool = False) -> Payload:
    """An uplink as seen rows and classes; a zero-padded full header gives its non-zero rows, a whole
    header (``every_row``: M1 off) all of them, a zero row too."""
    if "header" not in uplink:
        return uplink
    header = uplink["header"]
    if every_row:
        classes = torch.arange(len(header))
    else:
        classes = header.ne(0).any(1).nonzero().squeeze(1)
    return {"rows": header[classes], "classes": classes}


# ------------------------------------------------------------------------------------------- server half


class FedSSAServer(Server):
    """Keeps the global header ``[C, d+1]`` (random init) and each client's seen classes once known."""

    hp: FedSSAConfig
    STATE = ("header", "seen_classes", "latest", "latest_seen")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.header = global_header(ctx)
        self.seen_classes: dict[int, Tensor] = {}  # client id -> S_k as sorted class indices
        self.latest: Tensor | None = None  # [N, C, d+1] every client's latest rows ([code] variant only)
        self.latest_seen: Tensor | None = None  # [N, C] which of them it uploaded
        if self.hp.aggregate_all_latest:  # [code] variant: every client's latest uploaded rows
            self.latest = self.header.new_zeros(ctx.num_clients, *self.header.shape)
            self.latest_seen = torch.zeros(ctx.num_clients, ctx.num_classes, dtype=torch.bool)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        first = {"header": self.header.clone()}  # S_k not known yet: whole header, put in the store once
        if self.hp.whole_header_down:
            return self.broadcast(selected, first)
        return {
            cid: {"seen_rows": self.header[self.seen_classes[cid]]} if cid in self.seen_classes else first
            for cid in selected
        }

    def uplink_keys(self) -> tuple[str, ...]:
        return ("header",) if self.hp.whole_header_up else ("rows", "classes")

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        every_row = self.hp.aggregation == "whole_header"
        uplinks = {cid: seen_rows_of(u, every_row) for cid, u in uplinks.items()}
        classes = [u["classes"] for u in uplinks.values()]
        self.seen_classes.update(zip(uplinks, classes))
        headers, seen = scatter_rows([u["rows"] for u in uplinks.values()], classes, self.ctx.num_classes)
        if self.hp.aggregate_all_latest:
            cids = torch.tensor(list(uplinks))
            latest, latest_seen = self.latest, self.latest_seen
            assert latest is not None and latest_seen is not None  # made in __init__ for this variant
            latest[cids], latest_seen[cids] = headers, seen
            headers, seen = latest, latest_seen
        self.header = classwise_mean(headers, seen, self.header)

    def eval_payload(self) -> Payload | None:
        return None  # each client is tested with its own model, header included


# ------------------------------------------------------------------------------------------- client half


class FedSSAClient(ClientModule):
    """Fuses the global seen rows into its header (Eq. 4), trains with plain CE, uploads seen rows."""

    hp: FedSSAConfig
    seen: Tensor  # held
    seen_idx: Tensor  # held

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.hold("seen", ctx.class_counts > 0)  # [C] S_k as a mask, fixed for the run
        self.hold("seen_idx", self.seen.nonzero().squeeze(1))  # [|S_k|] sorted class indices

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        local = header_rows(self.model)
        if "seen_rows" in payload:  # [|S_k|, d+1]; unseen rows of the [C, d+1] are unused by the fuse
            global_rows = local.index_copy(0, self.seen_idx, payload["seen_rows"].to(local.device))
        else:
            global_rows = payload["header"].to(local.device)
        mu = mu_schedule(rnd, self.hp.mu0, self.hp.t_stable)
        keep = self.hp.unseen_rows == "kept"
        load_header_rows(self.model, fuse_header(global_rows, local, self.seen, mu, keep_unseen=keep))
        self.record("fedssa/mu", mu)

    def upload(self) -> Payload:
        rows = header_rows(self.model)
        if self.hp.aggregation == "whole_header":  # M1 off: every row, as LG-FedAvg uploads
            return {"header": rows}
        if self.hp.comm == "full_header":  # Sec. 4.3: the whole header, unseen rows zero
            return {"header": torch.where(self.seen[:, None], rows, 0)}
        return {"rows": rows[self.seen_idx], "classes": self.seen_idx.clone()}


@register("fedssa", server=FedSSAServer, client=FedSSAClient)
@dataclass
class FedSSAConfig(AlgorithmConfig):
    SHARED_FEATURES: ClassVar[bool] = True  # class-wise header rows [d+1] shared across the group
    mu0: float = 0.5  # [code] default; the paper tunes it in (0, 1]
    # [code] homogeneous runs (2 for heterogeneous): docs/algorithms/fedssa.md, Default hyperparameters
    t_stable: int = round_count(45)
    # True: [code]'s mean over all clients' latest rows (docs/algorithms/fedssa.md, Aggregation set)
    aggregate_all_latest: bool = False
    comm: Literal["seen_rows", "full_header"] = "seen_rows"  # what travels: S_k's rows or the whole header
    # Appendix F's ablations (docs/algorithms/fedssa.md, Ablations): M1 off averages whole headers;
    # replaced gives a client the global rows of the classes it lacks, where Eq. 4 keeps its own
    aggregation: Literal["classwise", "whole_header"] = "classwise"
    unseen_rows: Literal["kept", "replaced"] = "kept"

    @property
    def whole_header_up(self) -> bool:
        """Clients upload a ``[C, d+1]`` header: zero-padded (Sec. 4.3), or every row (M1 off)."""
        return self.comm == "full_header" or self.aggregation == "whole_header"

    @property
    def whole_header_down(self) -> bool:
        """The server sends the whole header every round: Sec. 4.3's broadcast, or as LG-FedAvg does,
        since under M1 off it does not learn S_k and a client that replaces its unseen rows reads them all."""
        return self.whole_header_up or self.unseen_rows == "replaced"

    def validate(self, cfg: ExperimentConfig) -> None:
        if not 0 <= self.mu0 <= 1:
            raise ConfigError(f"fedssa.mu0={self.mu0}: must lie in [0, 1] (0 = no stabilisation)")
        if self.t_stable < 1:
            raise ConfigError(f"fedssa.t_stable={self.t_stable}: must be >= 1 round")
