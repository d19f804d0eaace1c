"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017, arXiv:1602.05629).

Each selected client starts from the global model, trains locally, and uploads its weights; the
server replaces the global model with the sample-weighted mean

.. math::  w^{t+1} = \\sum_{k \\in S_t} \\frac{n_k}{\\sum_{j \\in S_t} n_j} w_k^{t+1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    Payload,
    RunningMean,
    Server,
    cpu_state,
    register,
    weighted_models,
)


class FedAvgServer(Server):
    UPLINK_KEYS: ClassVar[tuple[str, ...]] = ("model", "num_samples")
    STATE: ClassVar[tuple[str, ...]] = ("model",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.model = ctx.make_model(0)
        self.summed = RunningMean()  # this round's uplinks, summed as they arrive

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"model": cpu_state(self.model)})

    def models_weighted(self, uplinks: dict[int, Payload]) -> dict:
        """The uploaded models and their weights in the mean: train sizes (FedAvg's ``n_k``). A server
        that weighs otherwise (FedNH: equally; CluSamp: by draws) overrides this alone."""
        return weighted_models(uplinks)

    def uplinks_arrived(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        self.summed.add(rnd, self.models_weighted(uplinks))

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if uplinks:
            self.model.load_state_dict(self.summed.mean(rnd, self.models_weighted(uplinks)))

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
