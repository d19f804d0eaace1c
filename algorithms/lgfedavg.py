"""LG-FedAvg: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations" (arXiv:2001.01523), in the form the FedSSA and FedL2G papers use as a baseline
(FedSSA paper Sec. 2 and 6.1, Table 4 case A; FedL2G paper Sec. 2.1 and 4).

Every client keeps its own (possibly heterogeneous) feature extractor; only the linear header
``head = Linear(d, C)`` is shared. Written as one ``[C, d+1]`` tensor of rows ``[W_c | b_c]``, the server
FedAvg-averages this round's uploaders, weighted by their train sizes ``n_k``,

.. math::  \\theta^{t} = \\sum_{k \\in K^t} \\frac{n_k}{\\sum_{j \\in K^t} n_j} \\theta_k^{t}

and each selected client replaces its whole local header with ``\\theta^{t-1}`` before training (the
extractor is left alone). Plain cross-entropy on the whole model (base ``ClientModule``).

Implementation choices:
- The global header starts from PyTorch's Linear init U(-1/sqrt(d), 1/sqrt(d)), drawn once by the server
  from the run seed (docs/algorithms/fedssa.md, Initial global header), so every client trains on the
  same header at round 0.
- Personalised evaluation as in the LG-FedAvg paper and HtFLlib: each client is tested with its own
  extractor and the current global header, sent to every client before evaluation
  (``lgfedavg.eval_head: global``); ``local`` tests with the header the client last trained instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    Payload,
    Server,
    ServerContext,
    header_rows,
    load_header_rows,
    register,
    seed_of,
    stream,
)

# the server's initial header (LG-FedAvg's and FedSSA's); its tag predates named streams
stream("lgfedavg/header", tag=(4, 1))

# ------------------------------------------------------------------------------------------- header math


def init_header(num_classes: int, feature_dim: int, seed: int) -> Tensor:
    """A random header ``[C, d+1]`` with PyTorch's ``nn.Linear`` init: U(-1/sqrt(d), 1/sqrt(d)) for all."""
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(feature_dim)
    return (torch.rand(num_classes, feature_dim + 1, generator=g) * 2 - 1) * bound


def average_headers(headers: Tensor, weights: Tensor) -> Tensor:
    """FedAvg of headers: ``sum_k (n_k / sum_j n_j) theta_k`` (the equation in the module docstring).

    Shape: ``headers [K, C, d+1]``, ``weights [K]`` (sample counts ``n_k``) -> ``[C, d+1]``.
    """
    w = weights.to(torch.float64)
    return torch.tensordot(w / w.sum(), headers.to(torch.float64), dims=1).to(headers.dtype)


# ------------------------------------------------------------------------------------------- server half


def global_header(ctx: ServerContext) -> Tensor:
    """The server's initial header ``[C, d+1]`` (LG-FedAvg's and FedSSA's), seeded by the run."""
    d = ctx.make_model(0).head.in_features
    return init_header(ctx.num_classes, d, seed_of("lgfedavg/header", ctx.cfg.seed))


class LGFedAvgServer(Server):
    """Holds the global header ``[C, d+1]``; sends it whole, FedAvg-averages the uploaded headers."""

    hp: LGFedAvgConfig
    UPLINK_KEYS = ("header", "num_samples")
    STATE = ("header",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.header = global_header(ctx)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"header": self.header.clone()})

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        headers = torch.stack([u["header"] for u in uplinks.values()])
        weights = torch.tensor([float(u["num_samples"]) for u in uplinks.values()])
        self.header = average_headers(headers, weights)

    def eval_payload(self) -> Payload | None:
        return {"header": self.header} if self.hp.eval_head == "global" else None


# ------------------------------------------------------------------------------------------- client half


class LGFedAvgClient(ClientModule):
    """Replaces its header with the global one, trains the whole model, uploads the header."""

    hp: LGFedAvgConfig
    eval_mode = "own"  # its own extractor under the global header (eval_head: global)

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        load_header_rows(self.model, payload["header"])

    def upload(self) -> Payload:
        return {"header": header_rows(self.model), "num_samples": self.ctx.num_train}

    def load_for_eval(self, payload: Payload) -> None:
        load_header_rows(self.model, payload["header"])  # own extractor, global header


@register("lgfedavg", server=LGFedAvgServer, client=LGFedAvgClient)
@dataclass
class LGFedAvgConfig(AlgorithmConfig):
    """The header is the model's ``head``; training uses ``train.*``."""

    SHARED_FEATURES: ClassVar[bool] = True  # one global header [C, d+1]: one d across the group

    eval_head: Literal["global", "local"] = "global"  # the header clients are tested with
