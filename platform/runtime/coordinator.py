"""Coordinator: the Ray actor that owns the server half and the one round loop.

Per round: sample clients, ask the server for downlinks, dispatch the clients over the worker pool
(:mod:`fedray.platform.runtime.dispatch`, :mod:`fedray.platform.runtime.pool`), commit the states of
the accepted uplinks (:mod:`fedray.platform.runtime.state_store`), aggregate, evaluate (dispatched the
same way: :mod:`fedray.platform.runtime.evaluation`), count the bytes each way, checkpoint
(:mod:`fedray.platform.runtime.checkpoint`), and emit metrics as events that the driver streams
(:mod:`fedray.platform.runtime.events`: progress display, MLflow). What a finished run hands back is
in :mod:`fedray.platform.runtime.results`.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import ray
import torch

from fedray.platform.api.algorithm import (
    ClientModule,
    Payload,
    Server,
    ServerContext,
    commits_state,
    tests_with_global_model,
)
from fedray.platform.api.contract import check_uplinks
from fedray.platform.api.registry import AlgorithmSpec
from fedray.platform.api.registry import get as get_algorithm
from fedray.platform.config import ExperimentConfig, RayConfig, clients_per_round
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError, ContractError, Diverged, RoundFailed, ServerFailed
from fedray.platform.models import arch_for_client
from fedray.platform.runtime import results, storage
from fedray.platform.runtime.checkpoint import (
    CONFIG_FILE,
    CheckpointWriter,
    LoopRecord,
    drop_partial_writes,
    load_checkpoint,
    take_checkpoint,
)
from fedray.platform.runtime.dispatch import TrainingDispatch
from fedray.platform.runtime.evaluation import Evaluation, global_test_chunks
from fedray.platform.runtime.events import (
    CheckpointSaved,
    ClientFailed,
    Event,
    EventQueue,
    RoundEnded,
    RoundStarted,
    WorkerJoined,
)
from fedray.platform.runtime.failures import Failure, algorithm_files, failure_of
from fedray.platform.runtime.pool import PoolClosed, WorkerPool, unplaced
from fedray.platform.runtime.process_roles import set_up_coordinator
from fedray.platform.runtime.state_store import STATES_DIR, StateStore
from fedray.platform.runtime.worker import ClientActor, make_client_model, member_model, smallest_arch
from fedray.platform.seeds import seed_global_draws, seed_of
from fedray.platform.tracking.names import Metrics

T = TypeVar("T")

SEES_TIMEOUT_S = 120.0  # a worker's answer is one look at a file: a mount that hangs must not hang the run


def check_workers_see(workers: list, checkpoint_dir: str) -> None:
    """Every worker writes and reads client states under the run's folder: one on a node that does not
    see it (a local storage_path on a cluster) stops the run now, in one line, not when a client
    first moves between nodes."""
    config = storage.join(checkpoint_dir, CONFIG_FILE)  # the driver wrote it before the run started
    try:
        answers = ray.get([worker.sees.remote(config) for worker in workers], timeout=SEES_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(
            f"storage_path: a ClientActor did not say in {SEES_TIMEOUT_S:.0f} s whether its node sees the "
            f"run's folder {checkpoint_dir}: is a network mount hanging there?"
        ) from None
    for seen, node in answers:
        if seen:
            continue
        raise ConfigError(
            f"storage_path: the run's folder {checkpoint_dir} is not there on node {node}, where a "
            "ClientActor writes client states: on a cluster, set storage_path to a directory every node "
            "shares, or to a pyarrow.fs URI such as s3://bucket/fedray"
        )


def checked_selection(server: Server, rnd: int, selected: Any, num_clients: int) -> list[int]:
    """``Server.select``'s clients, sorted; a ContractError (one line) unless they are distinct client
    ids, at least one."""
    where = f"round {rnd + 1}: {type(server).__name__}.select"
    ids = list(selected) if isinstance(selected, (list, tuple)) else None
    if not ids or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in ids):
        raise ContractError(
            f"{where} returned {type(selected).__name__} {selected!r:.60}: a non-empty list of client ids"
        )
    bad = next((c for c in ids if not 0 <= c < num_clients), None)
    if bad is not None:
        raise ContractError(f"{where} returned client {bad}: ids run from 0 to {num_clients - 1}")
    twice = next((c for c, n in Counter(ids).items() if n > 1), None)  # one pass, not a count per id
    if twice is not None:
        raise ContractError(
            f"{where} returned client {twice} twice: a round's clients are distinct (weigh a client drawn "
            "twice in aggregate)"
        )
    return sorted(int(c) for c in ids)


def mean_stats(per_client: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each training statistic over the clients that report it, summed in client-id order
    (not arrival order) so the same run always logs the same bits."""
    names = dict.fromkeys(name for stats in per_client for name in stats)
    return {name: float(np.mean([s[name] for s in per_client if name in s])) for name in names}


# the names the platform logs itself, and the prefixes it gives meanings (timings, end-of-run summaries)
PLATFORM_METRICS = frozenset(v for k, v in vars(Metrics).items() if k.isupper() and isinstance(v, str))
RESERVED_PREFIXES = tuple(v for v in PLATFORM_METRICS if v.endswith("/"))


def server_stats(algorithm: str, server: Server, client_stats: dict[str, float]) -> dict[str, float]:
    """The server's statistics of the round (:meth:`Server.record`), checked not to take a name the
    clients' statistics or the platform's metrics use."""
    stats = server.pop_stats()
    for name in sorted(stats):
        taken = (
            "a client statistic"
            if name in client_stats
            else "a platform metric"
            if name in PLATFORM_METRICS or name.startswith(RESERVED_PREFIXES)
            else None
        )
        if taken is not None:
            raise ContractError(
                f"algorithm {algorithm!r}: {type(server).__name__} records {name!r}, which is {taken} of the round; "
                "name the server's statistic apart (e.g. with the algorithm's name: 'fedgen/teacher_loss')"
            )
    return stats


def divergence(rnd: int, stats: dict[int, dict[str, float]]) -> str | None:
    """The line a run stops with when every client that reported a training loss this round
    reported a non-finite one (:class:`Diverged`); None while any is finite, or none was reported."""
    losses = {cid: s[Metrics.LOSS_TRAIN] for cid, s in stats.items() if Metrics.LOSS_TRAIN in s}
    if not losses or any(math.isfinite(loss) for loss in losses.values()):
        return None
    cid = min(losses)
    return (
        f"round {rnd + 1}: {Diverged.MARK}, the training loss is not finite on any of the {len(losses)} "
        f"clients that trained (client {cid}: {losses[cid]}); a lower train.lr keeps it finite"
    )


def scheduling(placement_group) -> dict[str, Any]:
    """Ray options that keep an actor inside a Tune trial's placement group (none outside Tune)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group)}


def coordinator_scheduling(placement_group) -> dict[str, Any]:
    """The Coordinator runs on the driver's node (outside a Tune trial): the node the run cannot
    lose anyway, so the server state it holds survives the loss of any other node."""
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


def pool_size(
    cfg: ExperimentConfig, resources: dict[str, float], nodes: Sequence[dict[str, float]] = ()
) -> int:
    """How many ClientActors fit the cluster: bounded by CPUs, GPU slices (when asked for) and
    clients. ``resources``: what the cluster has free; ``nodes``: each node's own resources, as Ray
    places an actor on one node (a 4-CPU node and a 1-CPU GPU node do not hold four GPU workers)."""
    fit = actors_fitting(cfg.ray, resources, cpus_if_unknown=1)
    if nodes:  # a node without CPUs (a head started with --num-cpus=0) has no "CPU" key
        fit = min(fit, sum(actors_fitting(cfg.ray, node, cpus_if_unknown=0) for node in nodes))
    if cfg.ray.max_actors:
        fit = min(fit, cfg.ray.max_actors)
    return max(1, min(fit, cfg.data.num_clients))


def actors_fitting(r: RayConfig, resources: dict[str, float], cpus_if_unknown: float) -> int:
    fit = math.floor(resources.get("CPU", cpus_if_unknown) / r.num_cpus_per_client + 1e-9)
    if r.num_gpus_per_client > 0:
        fit = min(fit, gpu_slices(resources.get("GPU", 0), r.num_gpus_per_client))
    return fit


def gpu_slices(gpus: float, share: float) -> int:
    """How many slices of ``share`` GPUs fit in ``gpus``. Ray puts a slice under one GPU on one GPU,
    so each whole GPU holds ``floor(1 / share)`` of them (two GPUs hold four slices of 0.4, not
    five). Ray reports a sum, so what is left over is read as the rest of one GPU in use: exact for
    a run's own GPUs, free whole when its pool is sized, but an over-count where other work holds
    slices of several GPUs."""
    if share >= 1:
        return math.floor(gpus / share + 1e-9)
    whole = math.floor(gpus + 1e-9)
    return whole * math.floor(1 / share + 1e-9) + math.floor(max(0.0, gpus - whole) / share + 1e-9)


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
        find_smallest=lambda: smallest_arch(cfg, meta),
        make_arch=lambda arch: member_model(cfg, arch, meta),
        train_sizes=list(meta["train_sizes"]),
    )
    torch.manual_seed(seed_of("coordinator/server_init", cfg.seed))
    seed_global_draws(seed_of("coordinator/server_init", cfg.seed))
    spec = get_algorithm(cfg.algorithm)
    server = server_code(spec, f"{spec.server_cls.__name__}.__init__", lambda: spec.server_cls(ctx))
    storage.check_plain(server.state_dict(), f"{cfg.algorithm}'s server state")  # checkpointable
    return server


def server_code(
    spec: AlgorithmSpec, label: str, call: Callable[[], T], report: Callable[[Failure], None] | None = None
) -> T:
    """``call()``, code of the algorithm's server half: an error of its own stops the run with one line,
    ``<label> failed: <the error> (at <where>)``, not the Coordinator's traceback through Ray; its
    traceback goes to ``report`` (the run's events), else to the console (no run to log it to yet)."""
    try:
        return call()
    except (ConfigError, RoundFailed):  # the platform's own lines (a broken rule, a diverged round)
        raise
    except Exception as err:
        failure = failure_of(err, own=algorithm_files(spec.server_cls, spec.client_cls, spec.config_cls))
        if report is None:
            print(failure.traceback, file=sys.stderr, flush=True)
        else:
            report(failure)
        raise ServerFailed(f"{label} failed: {failure.line}") from None


def check_evaluable(name: str, client_cls: type[ClientModule], commits: bool, server: Server) -> None:
    """Some model is there to test: the clients keep theirs between rounds, or the server sends one;
    and a client tested with the server's model finds it in the payload (checked again at each
    evaluation, for a server that sends its payload only once it has aggregated)."""
    payload = server.eval_payload()
    if not commits and payload is None:
        raise ContractError(
            f"algorithm {name!r}: its client keeps nothing between rounds (keeps_state = "
            "False) but its server sends no evaluation payload, so no client has a model to test"
        )
    tests_with_global_model(client_cls, payload)  # its one line now, not at the first evaluation


def start_pool(
    cfg: ExperimentConfig, meta: dict[str, Any], workers: list, options: dict[str, Any], commits: bool
) -> tuple[WorkerPool, dict[int, str]]:
    """The worker pool over the driver's workers, each set up for this run (a replacement is started
    and set up the same way), and the device each placed one trains on, by slot."""

    meta_ref = ray.put(meta)  # one object-store copy for every worker, not one per call

    def spawn():
        worker = start_worker(cfg, options)
        return worker, worker.setup.remote(meta_ref)  # runs before any job: an actor's calls run in order

    set_ups = [w.setup.remote(meta_ref, cfg) for w in workers]
    placing = unplaced(set_ups, worker_asks(cfg.ray), cfg.ray.pool_wait_s)
    placed = [slot for slot in range(len(set_ups)) if slot not in placing]
    infos = ray.get([set_ups[slot] for slot in placed])
    # a worker per client keeps each client's module for the run, when clients keep state
    pinned = commits and len(workers) >= cfg.data.num_clients
    pool = WorkerPool(workers, spawn, pinned=pinned, placing=placing)
    return pool, {slot: info["device"] for slot, info in zip(placed, infos, strict=True)}


def worker_asks(r: RayConfig) -> str:
    """What one ClientActor asks Ray for, in words."""
    gpus = f" and {r.num_gpus_per_client:g} GPU" if r.num_gpus_per_client > 0 else ""
    return f"{r.num_cpus_per_client:g} CPU{gpus}"


class RoundLoop:
    """The coordinator's body: runs the rounds, handing each other job to a piece of its own: events
    (:class:`EventQueue`), training (:class:`TrainingDispatch`), :class:`Evaluation`, the checkpoint
    (:class:`CheckpointWriter`, :func:`load_checkpoint`), what a finished run hands back (:mod:`.results`).
    Free of the ``@ray.remote`` decorator so its logic reads plainly."""

    def __init__(self) -> None:
        self.events = EventQueue()
        self.checkpoints = CheckpointWriter(lambda done, path: self.events.emit(CheckpointSaved(done, path)))

    def setup(
        self, cfg: ExperimentConfig, meta: dict[str, Any], shard_refs: list, global_test: ArrayDataset,
        workers: list, options: dict[str, Any],
    ) -> dict[str, Any]:  # fmt: skip
        """Build the server half, the state store, the worker pool and what dispatches over it; returns
        what the workers train on (``devices``: a description per placed worker, by pool slot)."""
        self.cfg = cfg
        self.events = EventQueue()  # a Coordinator kept from the driver's last run starts empty
        self.spec = get_algorithm(cfg.algorithm)
        self.server = build_server(cfg, meta)
        self.commits = commits_state(self.spec.client_cls, cfg)
        check_evaluable(cfg.algorithm, self.spec.client_cls, self.commits, self.server)
        self.store = StateStore()
        self.pool, devices = start_pool(cfg, meta, workers, options, self.commits)
        self.pool.on_placed = self.worker_placed
        self.training = TrainingDispatch(self.pool, self.store, shard_refs, meta["train_sizes"], self.commits)
        chunks = global_test_chunks(global_test)
        self.evaluation = Evaluation(cfg, self.pool, self.store, shard_refs, chunks, self.training.affinity)
        self.start_round, self.record = 0, LoopRecord()
        self.halting = False
        return {"devices": devices}

    def worker_placed(self, slot: int, worker, info: dict[str, Any]) -> None:
        """A worker Ray placed once the rounds had started (one of the first that waited for room, or
        a replacement): checked as the first were when clients keep state (the run's folder seen
        from its node; a failure stops the run), then counted in the run's record."""
        if self.commits:
            check_workers_see([worker], self.checkpoint_dir)
        self.events.emit(WorkerJoined(slot, info["device"], replacement=self.pool.generation[slot] > 0))

    def poll(self, timeout: float = 0.5) -> list[Event]:
        """The driver's call, from its thread while ``run`` goes on in the other: the events since its last."""
        return self.events.poll(timeout)

    def run(self, checkpoint_dir: str, stop_after_round: int | None = None) -> dict[str, Any]:
        """Run rounds ``start_round .. rounds-1``; ``stop_after_round`` simulates an interruption.
        However the run ends, its last checkpoint lands before this returns."""
        self.checkpoint_dir = self.store.directory = checkpoint_dir  # where the workers write states
        drop_partial_writes(checkpoint_dir)  # what an interrupted run's killed checkpoint writer left
        if self.commits:  # the workers write states into this folder, and never make it
            storage.make_dirs(storage.join(checkpoint_dir, STATES_DIR))
            check_workers_see(self.pool.placed(), checkpoint_dir)  # those placed later: worker_placed
            self.store.sweep()  # what a resumed run's interrupted one left that nothing needs
        try:
            summary = self.run_rounds(stop_after_round)
        except BaseException as err:
            self.checkpoints.wait(quietly=True)  # the round's error is the one the user is told
            if isinstance(err, PoolClosed):  # the driver stops the run and kills this process next: an
                # error here would be one nobody fetches, which Ray prints as an "Unhandled error"
                return results.run_summary(False, self.server, self.record)
            raise
        if self.checkpoints.wait() is not None:
            self.store.landed()  # the versions only an earlier checkpoint listed go
        return summary

    def run_rounds(self, stop_after_round: int | None) -> dict[str, Any]:
        cfg = self.cfg
        k = clients_per_round(cfg)
        if stop_after_round is not None and stop_after_round <= self.start_round < cfg.rounds:
            return results.run_summary(False, self.server, self.record)  # a resume already that far
        for rnd in range(self.start_round, cfg.rounds):
            # a server's own draws from numpy's or Python's global generator depend on (seed, round) only
            seed_global_draws(seed_of("coordinator/global_draws", cfg.seed, rnd))
            selected = self.server_code(rnd, "select", lambda: self.server.select(rnd, k))  # noqa: B023
            metrics = self.run_round(rnd, checked_selection(self.server, rnd, selected, cfg.data.num_clients))
            self.record.history.append(metrics)
            done = rnd + 1
            # a stop asked for (--stop-after: a job's time limit) is resumed from this round, whatever
            # checkpoint_every says
            asked_to_stop = stop_after_round is not None and done >= stop_after_round and done < cfg.rounds
            due = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.rounds)
            if due or asked_to_stop:
                self.checkpoint(done)
            self.events.emit(RoundEnded(done, metrics))
            if (self.halting or asked_to_stop) and done < cfg.rounds:
                return results.run_summary(False, self.server, self.record)
        return results.run_summary(True, self.server, self.record)

    def halt(self) -> float:
        """The driver's call, from its thread, when it stops the run early (Tune's scheduler): ``run``
        returns after the round in progress, leaving every process as a finished run leaves it.
        Returns the last round's seconds and a checkpoint's on its way: about how long the driver
        must wait for that."""
        self.halting = True
        last_round_s = self.record.history[-1].get(Metrics.TIME_ROUND_S, 0.0) if self.record.history else 0.0
        return last_round_s + self.checkpoints.busy_s()

    def run_round(self, rnd: int, selected: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        self.events.emit(RoundStarted(rnd + 1, selected))
        downlinks = self.server_code(rnd, "configure", lambda: self.server.configure(rnd, selected))
        on_retry = self.events.retry_reporter(rnd)
        train_start = time.perf_counter()
        uplinks, stats, failed, retried = self.training.run(
            rnd, selected, downlinks, on_retry, self.arrived(rnd)
        )
        train_s = time.perf_counter() - train_start
        for cid, failure in sorted(failed.items()):
            self.events.client_failed(rnd, (cid,), failure)
        if selected and len(failed) == len(selected):
            cid, failure = min(failed.items())
            raise RoundFailed(
                f"round {rnd + 1}: all {len(selected)} selected clients failed (client {cid}: {failure.line})"
            )
        line = divergence(rnd, stats)
        if line is not None:
            raise Diverged(line)
        check_uplinks(self.spec.name, self.server, uplinks)
        aggregate_start = time.perf_counter()
        self.server_code(rnd, "aggregate", lambda: self.server.aggregate(rnd, uplinks))
        aggregate_s = time.perf_counter() - aggregate_start
        metrics = mean_stats([stats[cid] for cid in sorted(stats)])
        metrics.update(server_stats(self.spec.name, self.server, metrics))
        metrics[Metrics.TIME_TRAIN_S], metrics[Metrics.TIME_AGGREGATE_S] = train_s, aggregate_s
        metrics.update(self.record.count_traffic(uplinks.values(), [downlinks[cid] for cid in selected]))
        metrics[Metrics.CLIENTS_SELECTED], metrics[Metrics.CLIENTS_FAILED] = len(selected), len(failed)
        metrics[Metrics.CLIENTS_RETRIED] = retried
        if (rnd + 1) % self.cfg.eval_every == 0 or rnd + 1 == self.cfg.rounds:
            evaluation, self.record.client_acc, retried = self.evaluation.run(
                rnd,
                selected,
                self.server,
                on_retry,
                self.events.failure_reporter(rnd),
                partial(self.server_code, rnd),
            )
            metrics.update(evaluation)
            metrics[Metrics.CLIENTS_RETRIED] += retried
        metrics[Metrics.TIME_ROUND_S] = time.perf_counter() - start
        return metrics

    def arrived(self, rnd: int) -> Callable[[dict[int, Payload]], None]:
        """What takes a round's uplinks while its other clients train: the server, once they are
        checked (its aggregate's work starts while the workers still have theirs)."""

        def hand_on(uplinks: dict[int, Payload]) -> None:
            check_uplinks(self.spec.name, self.server, uplinks)
            self.server_code(rnd, "uplinks_arrived", lambda: self.server.uplinks_arrived(rnd, uplinks))

        return hand_on

    def server_code(self, rnd: int, method: str, call: Callable[[], T]) -> T:
        """``call()``, the server's ``method`` in round ``rnd`` (:func:`server_code`); its traceback
        goes out as a client's does, a ``failures/`` artifact."""
        return server_code(
            self.spec,
            f"round {rnd + 1}: {type(self.server).__name__}.{method}",
            call,
            lambda failure: self.events.emit(ClientFailed(rnd + 1, f"server {method}", failure)),
        )

    def checkpoint(self, done: int) -> None:
        """Taken now, once the last one has landed (the state files only it listed may then go), and
        written while the next rounds run (:class:`CheckpointWriter`)."""
        if self.checkpoints.wait() is not None:
            self.store.landed()
        self.checkpoints.submit(
            done, take_checkpoint(self.checkpoint_dir, done, self.server, self.store, self.record)
        )

    def load_checkpoint(self, checkpoint_dir: str) -> list[dict[str, float]]:
        """Restore the run as the checkpoint left it; returns the rounds' metrics so far."""
        self.start_round, self.record = load_checkpoint(checkpoint_dir, self.server, self.store)
        return self.record.history

    def client_models(self, limit: int) -> tuple[dict[int, dict[str, torch.Tensor]], str]:
        """The personalised models worth logging, and what was left out (:func:`results.client_models`)."""
        num_clients = self.cfg.data.num_clients
        return results.client_models(self.spec.client_cls, self.server, self.store, num_clients, limit)

    def shutdown(self) -> int:
        """Kills the pool's workers, the replacements it started among them; returns how many there
        were (not a dead one it replaced). One waiting for a node counts too, though it holds
        nothing: one whose set-up is under way holds its share, and the pool cannot tell them apart."""
        workers = len(self.pool.workers)
        self.pool.shutdown()
        return workers

    def release(self) -> tuple[list, int]:
        """The run is over and the driver keeps its processes for its next run: the workers that run now,
        emptied, and how many replacements still waiting for a node were killed (counted as holding
        their share, as in :meth:`shutdown`); this run's server and client states go."""
        live = self.pool.detach()
        killed = len(self.pool.workers) - len(live)
        ray.get([worker.clear.remote() for worker in live])
        del self.pool, self.server, self.store, self.training, self.evaluation
        return live, killed


# Two concurrent calls: run() in one thread, poll() from the driver in the other. The runtime env
# gives the Coordinator a process of its own instead of an idle worker (a cluster's Ray prestarts one
# per CPU, for the ClientActors that need them). It must not hide the GPUs: Ray hands an actor's
# runtime env on to the actors it starts, and a replacement ClientActor whose env empties
# CUDA_VISIBLE_DEVICES is assigned no GPU by Ray (``ray.get_gpu_ids()`` is empty) while it holds its
# slice. set_up_coordinator hides them inside this process instead.
COORDINATOR_ENV = {"env_vars": {"FEDRAY_OWN_PROCESS": "1"}}


@ray.remote(num_cpus=0, max_concurrency=2, runtime_env=COORDINATOR_ENV)  # type: ignore[call-overload]
class Coordinator(RoundLoop):
    """RoundLoop as a Ray actor."""

    def __init__(self) -> None:
        set_up_coordinator()
        super().__init__()
