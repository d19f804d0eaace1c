"""A round's evaluation: clients on their own test splits (``eval.clients``), then the server's global
model, if any, on the global test set, both dispatched over the worker pool like training.

The global test set is split into fixed-size chunks summed in chunk order, and client rows are
sorted by client id, so the numbers never depend on the pool's size or on which worker ran what.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from torch import nn

from fedray.platform.api.algorithm import Payload, Server, cpu_state
from fedray.platform.config import ExperimentConfig
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import RoundFailed
from fedray.platform.runtime.events import job_label
from fedray.platform.runtime.failures import Failure
from fedray.platform.runtime.pool import Job, WorkerPool
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.runtime.worker import EVAL_CHUNK
from fedray.platform.seeds import numpy_rng
from fedray.platform.tracking.names import Metrics, personal_on

EVAL_CLIENTS_PER_JOB = 32  # clients one evaluation call tests: amortises a call, still spreads the work


def personalized_accuracy(correct: np.ndarray, total: np.ndarray, loss_sum: np.ndarray) -> dict[str, float]:
    """Each client's model on its own test split, reported the two ways the literature does.

    ``acc/personal_mean``: the plain mean of per-client accuracies (FedSSA); ``acc/personal_weighted``:
    total correct over total test samples (PFLlib, FedL2G). Clients without test data are left out;
    with none at all there is nothing to report.
    """
    tested = total > 0
    if not tested.any():
        return {}
    acc = correct[tested] / total[tested]
    return {
        Metrics.ACC_PERSONAL_MEAN: float(acc.mean()),
        Metrics.ACC_PERSONAL_STD: float(acc.std()),
        Metrics.ACC_PERSONAL_WEIGHTED: float(correct.sum() / total.sum()),
        Metrics.LOSS_PERSONAL: float(loss_sum.sum() / total.sum()),
    }


def eval_clients(cfg: ExperimentConfig, rnd: int, selected: list[int]) -> list[int]:
    """The clients the personalised evaluation covers this round (``eval.clients``)."""
    policy, n = cfg.eval.clients, cfg.data.num_clients
    if policy == "selected":
        return list(selected)
    if policy == "sample" and cfg.eval.sample_size < n:
        rng = numpy_rng("coordinator/eval_sample", cfg.seed, rnd)
        return sorted(rng.choice(n, size=cfg.eval.sample_size, replace=False).tolist())
    return list(range(n))


def global_test_chunks(global_test: ArrayDataset) -> list:
    """The global test set in the object store as fixed-size chunks, which evaluation sums in chunk
    order: the same numbers whatever the pool size."""
    n = len(global_test)
    return [
        ray.put(global_test.subset(np.arange(s, min(s + EVAL_CHUNK, n)))) for s in range(0, n, EVAL_CHUNK)
    ]


def stop_if_every_job_failed(rnd: int, failed: dict[Any, Failure], results: dict[Any, Any]) -> None:
    """Every client's evaluation failed, or every chunk of the global test: the algorithm's code or
    the device is broken (as when every client's training fails), and the run would log the round's
    metrics missing, round after round, to its end."""
    for kind, what in (("clients", "client evaluation"), ("global", "global test")):
        lost = [key for key in failed if key[0] == kind]
        if lost and not any(key[0] == kind for key in results):
            first = min(lost)
            raise RoundFailed(
                f"round {rnd + 1}: all {len(lost)} {what} jobs failed ({job_label(first)}: {failed[first].line})"
            )


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Evaluation:
    """Evaluates a round over the pool."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        pool: WorkerPool,
        store: StateStore,
        shards: list,
        global_chunks: list,
        affinity: Callable[[int], Any],
    ) -> None:
        self.cfg, self.pool, self.store, self.shards = cfg, pool, store, shards
        self.global_chunks = global_chunks
        self.affinity = affinity  # client -> the worker that caches it (None: any)

    def run(
        self,
        rnd: int,
        selected: list[int],
        server: Server,
        on_retry,
        on_failed: Callable[[Any, Failure], None],
        server_code: Callable[[str, Callable[[], Any]], Any],
    ) -> tuple[dict[str, float], dict[int, float], int]:
        """The round's evaluation metrics, each tested client's accuracy, and the jobs retried on the way.
        ``server_code(method, call)`` runs a method of the server (the Coordinator's: one line if it raises)."""
        payload = server_code("eval_payload", server.eval_payload)
        model = server_code("global_model", server.global_model)
        done = self.pool.run(self.client_jobs(rnd, selected, payload) + self.global_jobs(model), on_retry)
        for key, failure in done.failed.items():
            on_failed(key, failure)
        stop_if_every_job_failed(rnd, done.failed, done.results)
        rows = sorted(
            row for (kind, _), (part, _) in done.results.items() if kind == "clients" for row in part
        )
        client_acc = {cid: c / t for cid, c, t, _ in rows if t > 0}
        columns = (np.array([r[i] for r in rows], dtype=np.float64) for i in (1, 2, 3))
        # over a subset of the clients (eval.clients), the personalised metrics say so in their name
        out = {personal_on(k, self.cfg.eval.clients): v for k, v in personalized_accuracy(*columns).items()}
        parts = sorted(
            row for (kind, _), (part, _) in done.results.items() if kind == "global" for row in part
        )
        if parts:
            correct, total, loss = (sum(p[i] for p in parts) for i in (1, 2, 3))
            out[Metrics.ACC_GLOBAL] = correct / max(total, 1)
            out[Metrics.LOSS_GLOBAL] = loss / max(total, 1)
        return out, client_acc, len(done.retried)

    def client_jobs(self, rnd: int, selected: list[int], payload: Payload | None) -> list[Job]:
        """Clients grouped by the worker that caches them, a few dozen per call."""
        payload_ref = None if payload is None else ray.put(payload)
        by_worker: dict[Any, list[int]] = {}
        for cid in eval_clients(self.cfg, rnd, selected):
            by_worker.setdefault(self.affinity(cid), []).append(cid)
        count = sum(map(len, by_worker.values()))
        per_job = max(1, min(EVAL_CLIENTS_PER_JOB, math.ceil(count / (4 * len(self.pool)))))
        return [
            Job(("clients", group[0]), "evaluate", self.call_args(group, payload_ref), worker)
            for worker, cids in by_worker.items()
            for group in chunks(cids, per_job)
        ]

    def call_args(self, group: list[int], payload_ref: Any) -> Callable[[], tuple]:
        """An evaluation call's arguments, made when it is sent (a worker reads a client's state from
        its file unless it caches the client)."""
        return lambda: (self.store.tasks(group, self.shards, commits=False), payload_ref)

    def global_jobs(self, model: nn.Module | None) -> list[Job]:
        """One job per chunk of the global test set, for a server with a global model."""
        if model is None:
            return []
        state = ray.put(cpu_state(model))
        return [
            Job(
                ("global", j),
                "evaluate_global",
                (model.arch, state, {j: [ref]}),
                self.pool.identity(j % len(self.pool)),
            )
            for j, ref in enumerate(self.global_chunks)
        ]
