"""A round's training over the worker pool: the calls it is split into (which clients, on which
worker, with which downlinks), and the uplinks accepted from what the calls return.

Evaluation is dispatched the same way (:mod:`.evaluation`), and asks :meth:`TrainingDispatch.affinity`
which worker still caches a client.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import ray

from fedray.platform.api.algorithm import Payload
from fedray.platform.runtime.failures import Failure
from fedray.platform.runtime.pool import Job, Outcome, WorkerPool
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.runtime.worker import ClientResult

TRAIN_CLIENTS_PER_JOB = 8  # most clients one training call trains
SAMPLES_PER_CALL = 256  # small clients share a call until it holds this many training samples


def call_groups(clients: list[int], sizes: list[int], workers: int) -> list[list[int]]:
    """The clients (in dispatch order) split into training calls. Small clients share a call until it
    holds ``SAMPLES_PER_CALL`` samples (a call costs a Ray round trip and a worker's share of the
    downlink), and calls shrink towards the end of the round, each at most the clients left over
    twice the workers, so the last calls are short and no worker waits long for another to finish."""
    groups, start = [], 0
    while start < len(clients):
        left = len(clients) - start
        cap = max(1, min(TRAIN_CLIENTS_PER_JOB, -(-left // (2 * workers))))
        end, samples = start + 1, sizes[clients[start]]
        while end - start < cap and end < len(clients) and samples < SAMPLES_PER_CALL:
            samples += sizes[clients[end]]
            end += 1
        groups.append(clients[start:end])
        start = end
    return groups


class TrainingDispatch:
    """A round's training over the pool: its selected clients and their downlinks in, the accepted
    uplinks out."""

    def __init__(
        self, pool: WorkerPool, store: StateStore, shards: list, sizes: list[int], commits: bool
    ) -> None:
        self.pool, self.store, self.shards, self.sizes = pool, store, shards, sizes
        self.commits = commits  # clients keep state between rounds: a call writes each one's new state

    def run(
        self,
        rnd: int,
        selected: list[int],
        downlinks: dict[int, Payload],
        on_retry: Callable[[Any, str], None],
        on_uplinks: Callable[[dict[int, Payload]], None] | None = None,
    ) -> tuple[dict[int, Payload], dict[int, dict[str, float]], dict[int, Failure], int]:
        """Train the round's clients: their uplinks and statistics by client id, the clients that
        failed with their error (:func:`accept_uplinks`), and how many clients were re-run. Meanwhile
        ``on_uplinks`` gets the accepted uplinks as they come, in client-id order (:class:`InOrder`)."""
        on_done = None if on_uplinks is None else InOrder(selected, on_uplinks).call_done
        trained = self.pool.run(self.jobs(rnd, selected, downlinks), on_retry, on_done)
        retried = sum(len(clients) for clients in trained.retried)
        return (*accept_uplinks(trained, self.store, self.commits), retried)

    def jobs(self, rnd: int, selected: list[int], downlinks: dict[int, Payload]) -> list[Job]:
        """The round's training calls: clients grouped by the worker that caches them, largest shards
        first, small ones several per call (:func:`call_groups`); one object-store copy of a downlink
        several clients share, and a client's own downlink sent with its call."""
        sizes = self.sizes
        shared = Counter(id(downlinks[c]) for c in selected)
        refs: dict[int, Any] = {}  # id of a shared downlink -> its one object-store copy

        def stored(payload: Payload) -> Any:
            # a broadcast is one object for the round: one put here, one read per worker; a client's
            # own goes with the call's arguments (Ray puts arguments in the store only when large)
            if shared[id(payload)] < 2:
                return payload
            if id(payload) not in refs:
                refs[id(payload)] = ray.put(payload)
            return refs[id(payload)]

        by_worker: dict[Any, list[int]] = {}
        for cid in sorted(selected, key=lambda c: (-sizes[c], c)):
            by_worker.setdefault(self.affinity(cid), []).append(cid)
        jobs = []
        for prefer, cids in by_worker.items():
            for group in call_groups(cids, sizes, len(self.pool)):
                payloads = [[stored(downlinks[c])] for c in group]
                jobs.append(Job(tuple(group), "train", self.call_args(rnd, group, payloads), prefer))
        return sorted(jobs, key=lambda job: (-sizes[job.key[0]], job.key[0]))

    def call_args(self, rnd: int, group: list[int], payloads: list[list]) -> Callable[[], tuple]:
        """A training call's arguments, made when it is sent (a retry sends the same)."""
        return lambda: (rnd, self.store.tasks(group, self.shards, self.commits), payloads)

    def affinity(self, cid: int) -> tuple[int, int] | None:
        """The worker that still caches this client: its own one when every client has a worker; none
        when clients keep nothing (any worker trains any client on the same shared model)."""
        if not self.commits:
            return None
        return self.pool.identity(cid) if self.pool.pinned else self.store.holder.get(cid)


class InOrder:
    """Hands a round's accepted uplinks on in client-id order while its calls end: each as soon as
    every client before it has an outcome (a failed one is skipped), so what gets them in several
    parts (``Server.uplinks_arrived``) sees one order however the calls were spread and timed. Those
    the round's last outcome would release are left to ``aggregate``: no client trains any more."""

    def __init__(self, selected: list[int], hand_on: Callable[[dict[int, Payload]], None]) -> None:
        self.order = sorted(selected)
        self.next = 0  # index in order of the first client not handed on
        self.outcomes: dict[int, Payload | None] = {}  # arrived, not handed on; None: it failed
        self.hand_on = hand_on

    def call_done(self, clients: tuple[int, ...], results: list[ClientResult] | None) -> None:
        """A training call's outcome: its clients' results, or None when the whole call failed."""
        if results is None:
            self.outcomes.update(dict.fromkeys(clients))
        else:
            self.outcomes.update({r.client: r.uplink if r.error is None else None for r in results})
        ready = {}
        while self.next < len(self.order) and self.order[self.next] in self.outcomes:
            cid = self.order[self.next]
            self.next += 1
            uplink = self.outcomes.pop(cid)
            if uplink is not None:
                ready[cid] = uplink
        if ready and self.next < len(self.order):
            self.hand_on(ready)


def accept_uplinks(
    trained: Outcome, store: StateStore, commits: bool
) -> tuple[dict[int, Payload], dict[int, dict[str, float]], dict[int, Failure]]:
    """The round's uplinks and statistics by client id, and the clients that failed with their error;
    with ``commits``, an accepted client's new state (which its worker wrote) is committed to the
    store: its uplink is in, so it is the truth."""
    uplinks: dict[int, Any] = {}  # a payload each; check_uplinks refuses anything else
    stats: dict[int, dict[str, float]] = {}
    failed: dict[int, Failure] = {}
    for _, (results, worker) in trained.results.items():
        result: ClientResult
        for result in results:
            if result.error is not None:
                failed[result.client] = result.error
                continue
            if commits:
                store.commit(result.client, worker)
            uplinks[result.client], stats[result.client] = result.uplink, result.stats
    for clients, error in trained.failed.items():
        failed.update(dict.fromkeys(clients, error))
    if commits:
        for client in failed:
            store.drop_uncommitted(client)
    return dict(sorted(uplinks.items())), stats, failed
