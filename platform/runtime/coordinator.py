"""Coordinator: the Ray actor that owns the server half and the one round loop.

Per round: sample clients, ask the server for downlinks, dispatch the clients over the worker pool
(:mod:`fedray.platform.runtime.pool`), commit the states of the accepted uplinks (:mod:`fedray.platform.runtime.state_store`),
aggregate, evaluate (dispatched the same way), count the bytes each way, checkpoint, and emit
metrics as events that the driver streams (progress display, MLflow).
"""

from __future__ import annotations

import math
import queue
import time
from functools import partial
from typing import Any

import numpy as np
import ray
import torch

from fedray.platform.api.algorithm import (
    Payload,
    Server,
    ServerContext,
    commits_state,
    tests_with_global_model,
)
from fedray.platform.api.contract import check_uplinks
from fedray.platform.api.registry import get as get_algorithm
from fedray.platform.config import ExperimentConfig, clients_per_round
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ContractError
from fedray.platform.models import arch_for_client
from fedray.platform.runtime import storage
from fedray.platform.runtime.checkpoint import LoopRecord, load_checkpoint, save_checkpoint
from fedray.platform.runtime.evaluation import Evaluation
from fedray.platform.runtime.events import (
    CheckpointSaved,
    ClientFailed,
    Event,
    JobRetried,
    RoundEnded,
    RoundStarted,
)
from fedray.platform.runtime.pool import Job, Outcome, WorkerPool
from fedray.platform.runtime.process_roles import set_up_coordinator
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.runtime.worker import (
    EVAL_CHUNK,
    ClientActor,
    ClientResult,
    client_model_state,
    make_client_model,
)
from fedray.platform.seeds import numpy_rng, seed_of
from fedray.platform.tracking.names import Metrics

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


def hold_here(refs: tuple, here: str) -> tuple:
    """Objects a worker returned (client states), held on this process's node: one produced on
    another node is copied to ``here`` (this process's node id; this process owns the copy), so
    losing that node loses nothing.
    On one machine nothing is copied; on a cluster it costs a transfer of the state per client."""
    if not refs:
        return refs
    locations = ray.experimental.get_object_locations(list(refs))
    # an object with no node is small enough to live in this process already
    remote = [r for r in refs if locations[r]["node_ids"] and here not in locations[r]["node_ids"]]
    if not remote:
        return refs
    copies = dict(zip(remote, [ray.put(value) for value in ray.get(remote)]))
    return tuple(copies.get(r, r) for r in refs)


def sample_clients(seed: int, rnd: int, num_clients: int, k: int) -> list[int]:
    """K distinct clients, a pure function of (seed, round) so a resumed run samples the same ones."""
    rng = numpy_rng("coordinator/sample", seed, rnd)
    return sorted(rng.choice(num_clients, size=k, replace=False).tolist())


def accept_uplinks(
    trained: Outcome, store: StateStore
) -> tuple[dict[int, Payload], dict[int, dict[str, float]], dict[int, str]]:
    """The round's uplinks and statistics by client id, and the clients that failed with their line;
    an accepted client's new state is committed to the store (its uplink is in, so it is the truth)."""
    uplinks: dict[int, Any] = {}  # a payload each; check_uplinks refuses anything else
    stats: dict[int, dict[str, float]] = {}
    failed: dict[int, str] = {}
    for _, (results, state_refs, worker) in trained.results.items():
        states = state_refs or (None,) * len(results)
        result: ClientResult
        for result, state_ref in zip(results, states, strict=True):
            if result.error is not None:
                failed[result.client] = result.error
                continue
            if state_ref is not None:
                store.commit(result.client, state_ref, worker)
            uplinks[result.client], stats[result.client] = result.uplink, result.stats
    for clients, error in trained.failed.items():
        failed.update(dict.fromkeys(clients, error))
    return dict(sorted(uplinks.items())), stats, failed


def mean_stats(per_client: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each training statistic over the clients that report it, summed in client-id order
    (not arrival order) so the same run always logs the same bits."""
    names = dict.fromkeys(name for stats in per_client for name in stats)
    return {name: float(np.mean([s[name] for s in per_client if name in s])) for name in names}


def scheduling(placement_group) -> dict[str, Any]:
    """Ray options that keep an actor inside a Tune trial's placement group (none outside Tune)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group)}


def coordinator_scheduling(placement_group) -> dict[str, Any]:
    """The Coordinator runs on the driver's node (outside a Tune trial): the node the run cannot
    lose anyway, so the client states it holds there survive the loss of any other node."""
    if placement_group is not None:
        return scheduling(placement_group)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # hard: a soft affinity let Ray start it on another node now and then; this node lives as long
    # as the driver does
    here = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def worker_options(cfg: ExperimentConfig, placement_group=None) -> dict[str, Any]:
    r = cfg.ray
    return {
        "num_cpus": r.num_cpus_per_client,
        "num_gpus": r.num_gpus_per_client,
        **scheduling(placement_group),
    }


def start_worker(cfg: ExperimentConfig, options: dict[str, Any]):
    """One ClientActor (the driver starts the first ones while it loads data; the Coordinator starts
    replacements). Its threads follow the CPUs Ray gives it."""

    actor = ClientActor.options(**options)  # type: ignore[attr-defined]  # @ray.remote's ActorClass
    return actor.remote(cfg, max(1, int(cfg.ray.num_cpus_per_client)))


def pool_size(cfg: ExperimentConfig, resources: dict[str, float]) -> int:
    """How many ClientActors fit the cluster: bounded by CPUs, GPUs (when asked for) and clients."""
    r = cfg.ray
    fit = math.floor(resources.get("CPU", 1) / r.num_cpus_per_client + 1e-9)
    if r.num_gpus_per_client > 0:
        fit = min(fit, math.floor(resources.get("GPU", 0) / r.num_gpus_per_client + 1e-9))
    if r.max_actors:
        fit = min(fit, r.max_actors)
    return max(1, min(fit, cfg.data.num_clients))


def job_label(key: Any) -> str:
    """A job's key as the progress display names it: ``client 3``, ``clients 3, 7``, ``global test chunk 2``."""
    if key and key[0] == "global":
        return f"global test chunk {key[1]}"
    if key and key[0] == "clients":
        return f"evaluation from client {key[1]}"
    return f"client{'s' if len(key) > 1 else ''} {', '.join(map(str, key))}"


def build_server(cfg: ExperimentConfig, meta: dict[str, Any]) -> Server:
    """The algorithm's server half, its initial draws seeded, its state checked to be checkpointable."""
    n = cfg.data.num_clients
    ctx = ServerContext(
        cfg,
        n,
        meta["num_classes"],
        [arch_for_client(cfg.model.group, cid) for cid in range(n)],
        make_model=lambda cid: make_client_model(cfg, cid, meta),
        make_distinct_model=lambda i: make_client_model(cfg, i, meta, init="per_client"),
    )
    torch.manual_seed(seed_of("coordinator/server_init", cfg.seed))
    server = get_algorithm(cfg.algorithm).server_cls(ctx)
    storage.check_plain(server.state_dict(), f"{cfg.algorithm}'s server state")  # checkpointable
    return server


class RoundLoop:
    """The coordinator's body. Free of the ``@ray.remote`` decorator so its logic reads plainly."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def setup(
        self,
        cfg: ExperimentConfig,
        meta: dict[str, Any],
        shard_refs: list,
        global_test: ArrayDataset,
        workers: list,
        options: dict[str, Any],
    ) -> dict[str, Any]:
        """Build the server half, the state store and the worker pool; returns what the workers
        train on (``devices``: one description per worker)."""
        self.cfg, self.meta, self.shards = cfg, meta, shard_refs
        self.events = queue.Queue()  # a Coordinator kept from the driver's last run starts empty
        self.spec = get_algorithm(cfg.algorithm)
        self.server = build_server(cfg, meta)
        self.commits = commits_state(self.spec.client_cls, cfg)
        if not self.commits and self.server.eval_payload() is None:
            raise ContractError(
                f"algorithm {cfg.algorithm!r}: its client keeps nothing between rounds (keeps_state = "
                "False) but its server sends no evaluation payload, so no client has a model to test"
            )
        self.store = StateStore()

        def spawn():
            worker = start_worker(cfg, options)
            return worker, worker.setup.remote(meta)  # runs before any job: an actor's calls run in order

        devices = [info["device"] for info in ray.get([w.setup.remote(meta, cfg) for w in workers])]
        node = ray.get_runtime_context().get_node_id()  # where this process holds client states
        # a worker per client keeps each client's module for the run, when clients keep state
        pinned = self.commits and len(workers) >= cfg.data.num_clients
        self.pool = WorkerPool(workers, spawn, pinned=pinned, hold=partial(hold_here, here=node))
        # fixed-size chunks summed in chunk order: the same numbers whatever the pool size
        n = len(global_test)
        self.global_chunks = [
            ray.put(global_test.subset(np.arange(s, min(s + EVAL_CHUNK, n)))) for s in range(0, n, EVAL_CHUNK)
        ]
        self.evaluation = Evaluation(
            cfg, self.pool, self.store, shard_refs, self.global_chunks, self.affinity
        )
        self.start_round = 0
        self.record = LoopRecord()
        return {"devices": devices}

    # ------------------------------------------------------------------------------------ events
    def emit(self, event: Event) -> None:
        self.events.put(event)

    def poll(self, timeout: float = 0.5) -> list[Event]:
        """Events since the last poll; waits up to ``timeout`` for the first one."""
        out = []
        try:
            out.append(self.events.get(timeout=timeout))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    # ------------------------------------------------------------------------------------ the loop
    def run(self, checkpoint_dir: str, stop_after_round: int | None = None) -> dict[str, Any]:
        """Run rounds ``start_round .. rounds-1``; ``stop_after_round`` simulates an interruption."""
        self.checkpoint_dir = checkpoint_dir
        cfg = self.cfg
        k = clients_per_round(cfg)
        for rnd in range(self.start_round, cfg.rounds):
            metrics = self.run_round(rnd, sample_clients(cfg.seed, rnd, cfg.data.num_clients, k))
            self.record.history.append(metrics)
            done = rnd + 1
            if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.rounds):
                self.save_checkpoint(done)
            self.emit(RoundEnded(done, metrics))
            if stop_after_round is not None and done >= stop_after_round and done < cfg.rounds:
                return self.summary(finished=False)
        return self.summary(finished=True)

    def run_round(self, rnd: int, selected: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        self.emit(RoundStarted(rnd + 1, selected))
        downlinks = self.server.configure(rnd, selected)
        trained = self.pool.run(self.train_jobs(rnd, selected, downlinks), self.retry_reporter(rnd))
        uplinks, stats, failed = accept_uplinks(trained, self.store)
        for cid, error in sorted(failed.items()):
            self.emit(ClientFailed(rnd + 1, cid, error))
        check_uplinks(self.spec.name, self.server, uplinks)
        self.server.aggregate(rnd, uplinks)
        metrics = mean_stats([stats[cid] for cid in sorted(stats)])
        metrics.update(self.record.count_traffic(uplinks.values(), [downlinks[cid] for cid in selected]))
        metrics[Metrics.CLIENTS_SELECTED], metrics[Metrics.CLIENTS_FAILED] = len(selected), len(failed)
        metrics[Metrics.CLIENTS_RETRIED] = sum(len(clients) for clients in trained.retried)
        if (rnd + 1) % self.cfg.eval_every == 0 or rnd + 1 == self.cfg.rounds:
            evaluation, self.record.client_acc, retried = self.evaluation.run(
                rnd, selected, self.server, self.retry_reporter(rnd), partial(self.report_failure, rnd)
            )
            metrics.update(evaluation)
            metrics[Metrics.CLIENTS_RETRIED] += retried
        metrics[Metrics.TIME_ROUND_S] = time.perf_counter() - start
        return metrics

    def train_jobs(self, rnd: int, selected: list[int], downlinks: dict[int, Payload]) -> list[Job]:
        """The round's training calls: clients grouped by the worker that caches them, largest shards
        first, small ones several per call (:func:`call_groups`); one object-store copy per distinct
        downlink."""
        sizes = self.meta["train_sizes"]
        refs: dict[int, Any] = {}
        by_worker: dict[Any, list[int]] = {}
        for cid in sorted(selected, key=lambda c: (-sizes[c], c)):
            by_worker.setdefault(self.affinity(cid), []).append(cid)
        jobs = []
        for prefer, cids in by_worker.items():
            for group in call_groups(cids, sizes, len(self.pool)):
                tasks = [self.store.task(c, self.shards[c]) for c in group]
                payloads = [[refs.setdefault(id(downlinks[c]), ray.put(downlinks[c]))] for c in group]
                returns = 1 + len(group) if self.commits else 1
                jobs.append(Job(tuple(group), "train", (rnd, tasks, payloads), prefer, returns=returns))
        return sorted(jobs, key=lambda job: (-sizes[job.key[0]], job.key[0]))

    def affinity(self, cid: int) -> tuple[int, int] | None:
        """The worker that still caches this client: its own one when every client has a worker; none
        when clients keep nothing (any worker trains any client on the same shared model)."""
        if not self.commits:
            return None
        return self.pool.identity(cid) if self.pool.pinned else self.store.holder.get(cid)

    def report_failure(self, rnd: int, key: Any, error: str) -> None:
        self.emit(ClientFailed(rnd + 1, key[1], error))

    def retry_reporter(self, rnd: int):
        def report(key: Any, error: str) -> None:
            self.emit(JobRetried(rnd + 1, job_label(key), error))

        return report

    # ------------------------------------------------------------------------------------ state
    def save_checkpoint(self, done: int) -> None:
        path = save_checkpoint(self.checkpoint_dir, done, self.server, self.store, self.record)
        self.emit(CheckpointSaved(done, path))

    def load_checkpoint(self, checkpoint_dir: str) -> list[dict[str, float]]:
        """Restore the run as the checkpoint left it; returns the rounds' metrics so far."""
        self.start_round, self.record = load_checkpoint(checkpoint_dir, self.server, self.store)
        return self.record.history

    def summary(self, finished: bool) -> dict[str, Any]:
        model = self.server.global_model()
        return {
            "finished": finished,
            "rounds_done": len(self.record.history),
            "history": self.record.history,
            "client_acc": self.record.client_acc,
            "global_model": None if model is None else {k: v.cpu() for k, v in model.state_dict().items()},
        }

    def client_models(self, limit: int) -> tuple[dict[int, dict[str, torch.Tensor]], str]:
        """The personalised models worth logging, and a line saying what was left out and why.

        Clients evaluated with the global model have nothing of their own to show; a client never
        selected still has its initial model; above ``limit`` clients none are logged."""
        if tests_with_global_model(self.spec.client_cls, self.server.eval_payload()):
            return {}, "client models not logged: clients are evaluated with the global model"
        trained = sorted(self.store.refs)
        if len(trained) > limit:
            return (
                {},
                f"client models not logged: {len(trained)} trained clients > tracking.log_client_models={limit}",
            )
        never = self.cfg.data.num_clients - len(trained)
        note = (
            f"{never} never-selected clients still hold their initial model and are not logged"
            if never
            else ""
        )
        return {cid: client_model_state(s) for cid, s in self.store.states(trained).items()}, note

    def shutdown(self) -> None:
        self.pool.shutdown()

    def release(self) -> list:
        """The run is over and the driver keeps its processes for its next run: the workers that
        run now, emptied (a replacement still waiting for a node is killed); this run's server and
        client states go."""
        live = self.pool.detach()
        ray.get([worker.clear.remote() for worker in live])
        del self.pool, self.server, self.store, self.global_chunks, self.shards, self.evaluation
        return live


# Two concurrent calls: run() in one thread, poll() from the driver in the other. The runtime env
# gives the Coordinator a process of its own instead of one of the idle workers Ray prestarts (one
# per CPU, preloaded for the ClientActors that need them), and hides the GPUs from it: the server
# half computes on the CPU, and Ray does not hide them from an actor that asks for none.
COORDINATOR_ENV = {"env_vars": {"FEDRAY_ROLE": "coordinator", "CUDA_VISIBLE_DEVICES": ""}}


@ray.remote(num_cpus=0, max_concurrency=2, runtime_env=COORDINATOR_ENV)  # type: ignore[call-overload]
class Coordinator(RoundLoop):
    """RoundLoop as a Ray actor."""

    def __init__(self) -> None:
        set_up_coordinator()
        super().__init__()
