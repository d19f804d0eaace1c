"""The sample-weighted mean of model states (FedAvg's aggregate), summed while the uplinks arrive.

.. math::  \\bar w = \\frac{\\sum_k n_k w_k}{\\sum_k n_k}

:class:`RunningMean` adds states in the order given: a server adds a round's uplinks in
``Server.uplinks_arrived`` while other clients still train, and its ``aggregate`` adds only those not
yet in the sum. The coordinator would otherwise sum all of them between rounds, while every worker
(and its GPU) waits: 40 ms of a 0.36 s cross-device round on an H200 node. Each element is summed in
float64 in the same order however the states were split between calls, so the bits never depend on
when an uplink arrived.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Hashable, Mapping
from typing import Any

import torch

# elements of one entry summed over every state at a time: the float64 block stays in the cache while
# each state adds its part (1.5x faster than whole tensors for 50 states of the FedAvg CNN, same bits)
AVERAGE_BLOCK = 1 << 15
# blocks are independent, so threads sum them at once, each in the same order (the same bits)
AVERAGE_THREADS = 4

State = dict[str, torch.Tensor]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all of them)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


@functools.cache
def average_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that sum blocks, started once per process (a round adds states several times)."""
    return concurrent.futures.ThreadPoolExecutor(AVERAGE_THREADS, thread_name_prefix="fedray-average")


class RunningMean:
    """The weighted mean of states added in order, under a tag (the round): ``add`` sums some while
    the round's other clients train (on one thread: the workers have the cores), ``mean`` adds the
    rest (blocks on up to ``AVERAGE_THREADS`` threads: the workers wait) and returns the mean.
    Floating entries are summed in float64, one pass per block of ``AVERAGE_BLOCK`` elements over
    the states of one call (no stacked copy), and cast back; integer buffers (BatchNorm's
    ``num_batches_tracked``) are not averageable and are taken from the first state.

    A round's working memory, not server state: ``Server.state_dict`` leaves it out, and refuses one
    that still holds a sum when a checkpoint is taken (it would be lost on resume)."""

    def __init__(self) -> None:
        self.reset(None)

    def reset(self, tag: Hashable) -> None:
        self.tag = tag
        # what is in the sum, in order: (key, the state object, its weight), so that a mean over other
        # states under the same keys (a subclass that changed them first) is not served this sum
        self.added: list[tuple[Hashable, int, float]] = []
        self.total = 0.0
        self.sums: State = {}  # floating entries: float64 sums
        self.first: State = {}  # every entry of the first state (integer ones are the mean's)

    def add(self, tag: Hashable, weighted: Mapping[Hashable, tuple[State, float]], threads: int = 1) -> None:
        """Add ``weighted`` (key -> (state, weight)), in its order, to the sum kept under ``tag``; a
        new tag starts a new sum."""
        if tag != self.tag:
            self.reset(tag)
        if not weighted:
            return
        states = [state for state, _ in weighted.values()]
        weights = [float(weight) for _, weight in weighted.values()]
        if not self.added:
            self.first = dict(states[0])
            self.sums = {
                k: torch.zeros(v.numel(), dtype=torch.float64)
                for k, v in self.first.items()
                if v.is_floating_point()
            }
        blocks = []
        for key, acc in self.sums.items():
            flats = [state[key].reshape(-1) for state in states]
            blocks += [(acc, flats, lo) for lo in range(0, acc.numel(), AVERAGE_BLOCK)]

        def add_blocks(jobs: list[tuple[torch.Tensor, list[torch.Tensor], int]]) -> None:
            for acc, flats, lo in jobs:
                block = acc[lo : lo + AVERAGE_BLOCK]
                for flat, weight in zip(flats, weights, strict=True):
                    block.add_(flat[lo : lo + AVERAGE_BLOCK], alpha=weight)

        threads = min(threads, usable_cpus(), len(blocks))
        try:
            if threads > 1:
                futures = [average_pool().submit(add_blocks, blocks[i::threads]) for i in range(threads)]
                concurrent.futures.wait(futures)  # every thread done with the sums before an error is raised
                for future in futures:
                    future.result()
            else:
                add_blocks(blocks)
        except BaseException:
            self.reset(None)  # a half-added sum is never used
            raise
        self.added += [(key, id(state), weight) for key, (state, weight) in zip(weighted, weighted.values())]
        for weight in weights:
            self.total += weight

    def mean(self, tag: Hashable, weighted: Mapping[Hashable, tuple[State, float]]) -> State:
        """The weighted mean of every state of ``weighted``, in its order: those already added under
        ``tag`` (the same states, a prefix of its keys) are not added again. The sum is then cleared."""
        given = [(key, id(state), float(weight)) for key, (state, weight) in weighted.items()]
        if tag != self.tag or self.added != given[: len(self.added)]:
            self.reset(tag)  # not the states summed so far: start again
        keys = list(weighted)[len(self.added) :]
        self.add(tag, {k: weighted[k] for k in keys}, threads=AVERAGE_THREADS)
        if self.total <= 0:
            raise ValueError(f"a weighted mean of {len(weighted)} states whose weights sum to {self.total}")
        out = {}
        for key, first in self.first.items():  # the first state's order of entries
            if key in self.sums:  # one float64 sum at a time left while cast back
                out[key] = self.sums.pop(key).div_(self.total).to(first.dtype).reshape(first.shape)
            else:
                out[key] = first.clone()
        self.reset(None)
        return out


def weighted_average(states: list[State], weights: list[float]) -> State:
    """The weighted mean of ``states`` (see :class:`RunningMean`), in one call."""
    return RunningMean().mean(None, dict(enumerate(zip(states, weights, strict=True))))


def weighted_models(uplinks: Mapping[Any, Mapping[str, Any]]) -> dict[Any, tuple[State, float]]:
    """Uplinks' ``model`` states and their ``num_samples``, as ``RunningMean`` takes them."""
    return {cid: (uplink["model"], float(uplink["num_samples"])) for cid, uplink in uplinks.items()}


def unweighted_models(uplinks: Mapping[Any, Mapping[str, Any]]) -> dict[Any, tuple[State, float]]:
    """Uplinks' ``model`` states, each of weight 1 (a plain mean over the uploaders: SCAFFOLD, FedNH)."""
    return {cid: (uplink["model"], 1.0) for cid, uplink in uplinks.items()}
