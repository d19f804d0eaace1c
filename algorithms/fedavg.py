"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017, arXiv:1602.05629).

Each selected client starts from the global model, trains locally, and uploads its weights; the
server replaces the global model with the sample-weighted mean

.. math::  w^{t+1} = \\sum_{k \\in S_t} \\frac{n_k}{\\sum_{j \\in S_t} n_j} w_k^{t+1}
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
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

# elements of one entry summed over every state at a time: the float64 block stays in the cache while
# each state adds its part (1.5x faster than whole tensors for 50 states of the FedAvg CNN, same bits)
AVERAGE_BLOCK = 1 << 15
# blocks are independent, so threads sum them at once, each in the same order (the same bits): the
# server averages between rounds, while the clients' CPUs are idle (50 states of the FedAvg CNN: 50 ms
# on one thread of a slow 2-core VM, a GPU left idle meanwhile)
AVERAGE_THREADS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all of them)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Sample-weighted mean of state dicts.

    Floating entries are accumulated in float64, in the order given, and cast back (one pass per
    state over each block of ``AVERAGE_BLOCK`` elements, no stacked copy; blocks on up to
    ``AVERAGE_THREADS`` threads); integer buffers (BatchNorm's ``num_batches_tracked``) are not
    averageable and are taken from the first state.
    """
    total = float(sum(weights))
    alphas = [weight / total for weight in weights]
    out, sums, blocks = {}, {}, []
    for key, first in states[0].items():
        if not first.is_floating_point():
            out[key] = first.clone()
            continue
        flats = [state[key].reshape(-1) for state in states]
        sums[key] = acc = torch.zeros(first.numel(), dtype=torch.float64)
        blocks += [(acc, flats, lo) for lo in range(0, acc.numel(), AVERAGE_BLOCK)]

    def add_block(acc: torch.Tensor, flats: list[torch.Tensor], lo: int) -> None:
        block = acc[lo : lo + AVERAGE_BLOCK]
        for flat, alpha in zip(flats, alphas, strict=True):
            block.add_(flat[lo : lo + AVERAGE_BLOCK], alpha=alpha)

    threads = min(AVERAGE_THREADS, usable_cpus(), len(blocks))
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="fedavg-average") as pool:
            list(pool.map(lambda job: add_block(*job), blocks))  # list(): an error raises here
    else:
        for job in blocks:
            add_block(*job)
    for key in list(sums):
        first = states[0][key]
        out[key] = sums.pop(key).to(first.dtype).reshape(first.shape)  # one float64 sum at a time left
    return {key: out[key] for key in states[0]}


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
