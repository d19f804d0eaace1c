"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017, arXiv:1602.05629).

Each selected client starts from the global model, trains locally, and uploads its weights; the
server replaces the global model with the sample-weighted mean

.. math::  w^{t+1} = \\sum_{k \\in S_t} \\frac{n_k}{\\sum_{j \\in S_t} n_j} w_k^{t+1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    Payload,
    Server,
    cpu_state,
    register,
)


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Sample-weighted mean of state dicts.

    Floating entries are accumulated in float64, in the order given, and cast back (one pass per
    state, no stacked copy); integer buffers (BatchNorm's ``num_batches_tracked``) are not
    averageable and are taken from the first state.
    """
    total = float(sum(weights))
    out = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros(first.shape, dtype=torch.float64)
            for state, weight in zip(states, weights, strict=True):
                acc.add_(state[key], alpha=weight / total)
            out[key] = acc.to(first.dtype)
        else:
            out[key] = first.clone()
    return out


class FedAvgServer(Server):
    UPLINK_KEYS: ClassVar[tuple[str, ...]] = ("model", "num_samples")
    STATE: ClassVar[tuple[str, ...]] = ("model",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.model = ctx.make_model(0)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"model": cpu_state(self.model)})

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        states = [u["model"] for u in uplinks.values()]
        weights = [float(u["num_samples"]) for u in uplinks.values()]
        self.model.load_state_dict(weighted_average(states, weights))

    def global_model(self) -> nn.Module:
        return self.model


class FedAvgClient(ClientModule):
    """Plain cross-entropy on the received global model (the base ClientModule's behaviour). Every
    downlink overwrites the whole model, so nothing of a client outlives its round."""

    keeps_state = False


@register("fedavg", server=FedAvgServer, client=FedAvgClient)
@dataclass
class FedAvgConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # averages every parameter: one architecture for all clients
