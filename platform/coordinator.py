"""Coordinator: the Ray actor that owns the server half and the one round loop.

Per round: sample clients, ask the server for downlinks, dispatch them to the ClientActors, gather
the uplinks, aggregate, evaluate, count the bytes each way, checkpoint, and emit metrics as events
that the driver streams (progress display, MLflow).
"""

from __future__ import annotations

import math
import os
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from fedray.platform.algorithm import Payload, ServerContext, cpu_state, derive_seed, payload_nbytes
from fedray.platform.client import EVAL_CHUNK, ClientActor, make_client_model
from fedray.platform.config import ExperimentConfig, clients_per_round
from fedray.platform.data import ArrayDataset
from fedray.platform.models import arch_for_client
from fedray.platform.registry import get as get_algorithm
from fedray.platform.transport import use_fast_tensor_transport

CHECKPOINT_FILE = "checkpoint.pt"


def sample_clients(seed: int, rnd: int, num_clients: int, k: int) -> list[int]:
    """K distinct clients, a pure function of (seed, round) so a resumed run samples the same ones."""
    rng = np.random.default_rng(derive_seed(seed, rnd, 3))
    return sorted(rng.choice(num_clients, size=k, replace=False).tolist())


def mean_stats(per_client: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each training statistic over the clients that report it, summed in client-id order
    (not arrival order) so the same run always logs the same bits."""
    names = dict.fromkeys(name for stats in per_client for name in stats)
    return {name: float(np.mean([s[name] for s in per_client if name in s])) for name in names}


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
        "acc/personal_mean": float(acc.mean()),
        "acc/personal_std": float(acc.std()),
        "acc/personal_weighted": float(correct.sum() / total.sum()),
        "loss/personal": float(loss_sum.sum() / total.sum()),
    }


def balance_clients(train_sizes: list[int], num_actors: int) -> list[int]:
    """Actor index per client, balancing the training samples each actor holds (largest first onto
    the least-loaded actor). Clients stay on their actor for the whole run, so a round-robin split of
    a skewed partition would leave one core idle while the other finishes the big clients."""
    load = [0] * num_actors
    placement = [0] * len(train_sizes)
    for cid in sorted(range(len(train_sizes)), key=lambda c: (-train_sizes[c], c)):
        target = min(range(num_actors), key=lambda a: (load[a], a))
        placement[cid] = target
        load[target] += train_sizes[cid]
    return placement


def scheduling(placement_group) -> dict[str, Any]:
    """Ray options that keep an actor inside a Tune trial's placement group (none outside Tune)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group)}


def start_client_actors(
    cfg: ExperimentConfig, meta: dict[str, Any], num_actors: int, placement_group=None
) -> list:
    """The ClientActor pool. The driver starts it together with the Coordinator, so every process
    imports torch and Lightning at the same time instead of one after the other."""
    r = cfg.ray
    options = {
        "num_cpus": r.num_cpus_per_client,
        "num_gpus": r.num_gpus_per_client,
        **scheduling(placement_group),
    }
    threads = max(1, int(r.num_cpus_per_client))
    return [ClientActor.options(**options).remote(cfg, meta, threads) for _ in range(num_actors)]


def pool_size(cfg: ExperimentConfig, resources: dict[str, float]) -> int:
    """How many ClientActors fit the cluster: bounded by CPUs, GPUs (when asked for) and clients."""
    r = cfg.ray
    fit = math.floor(resources.get("CPU", 1) / r.num_cpus_per_client + 1e-9)
    if r.num_gpus_per_client > 0:
        fit = min(fit, math.floor(resources.get("GPU", 0) / r.num_gpus_per_client + 1e-9))
    if r.max_actors:
        fit = min(fit, r.max_actors)
    return max(1, min(fit, cfg.data.num_clients))


class RoundLoop:
    """The coordinator's body. Free of the ``@ray.remote`` decorator so its logic reads plainly."""

    def __init__(self) -> None:
        # Set up in two steps so a Coordinator process can be started before its experiment is known
        # (see ``fedray.platform.run.ensure_ray``): the constructor only readies the process.
        torch.set_num_threads(1)
        self.events: queue.Queue = queue.Queue()

    def setup(
        self,
        cfg: ExperimentConfig,
        meta: dict[str, Any],
        shard_refs: list,
        global_test: ArrayDataset,
        actors: list,
    ) -> None:
        """Build the server half and hand every client its shard."""
        self.cfg = cfg
        self.meta = meta
        self.checkpoint_dir: Path | None = None  # set by run()
        n = cfg.data.num_clients
        archs = [arch_for_client(cfg.model.group, cid) for cid in range(n)]
        spec = get_algorithm(cfg.algorithm)
        ctx = ServerContext(cfg, n, meta["num_classes"], archs, lambda cid: make_client_model(cfg, cid, meta))
        torch.manual_seed(derive_seed(cfg.seed, 4))
        self.server = spec.server_cls(ctx)

        self.actors = actors
        placement = balance_clients(meta["train_sizes"], len(self.actors))
        self.actor_of = {cid: self.actors[placement[cid]] for cid in range(n)}
        self.clients_of = {a: [cid for cid in range(n) if self.actor_of[cid] is a] for a in self.actors}
        # the actors load their shards while the test chunks are cut here; one wait for both
        loading = [a.add_clients.remote([shard_refs[c] for c in cids]) for a, cids in self.clients_of.items()]
        # fixed-size chunks summed in chunk order: the same numbers whatever the pool size
        starts = range(0, len(global_test), EVAL_CHUNK)
        chunks = {
            j: global_test.subset(np.arange(s, min(s + EVAL_CHUNK, len(global_test))))
            for j, s in enumerate(starts)
        }
        loading += [
            a.set_global_test.remote({j: c for j, c in chunks.items() if j % len(self.actors) == k})
            for k, a in enumerate(self.actors)
        ]
        ray.get(loading)

        self.start_round = 0
        self.history: list[dict[str, float]] = []
        self.cum = {"up": 0, "down": 0}
        self.last_client_acc: dict[int, float] = {}

    # ------------------------------------------------------------------------------------ events
    def emit(self, kind: str, **data: Any) -> None:
        self.events.put({"type": kind, **data})

    def poll(self, timeout: float = 0.5) -> list[dict[str, Any]]:
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
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg
        k = clients_per_round(cfg)
        for rnd in range(self.start_round, cfg.rounds):
            metrics = self.run_round(rnd, sample_clients(cfg.seed, rnd, cfg.data.num_clients, k))
            self.history.append(metrics)
            done = rnd + 1
            if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.rounds):
                self.save_checkpoint(done)
            self.emit("round_end", round=done, metrics=metrics)
            if stop_after_round is not None and done >= stop_after_round and done < cfg.rounds:
                return self.summary(finished=False)
        return self.summary(finished=True)

    def run_round(self, rnd: int, selected: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        self.emit("round_start", round=rnd + 1, selected=selected)
        downlinks = self.server.configure(rnd, selected)
        down_bytes = sum(payload_nbytes(downlinks[cid]) for cid in selected)
        refs_by_payload: dict[int, Any] = {}  # one object-store copy per distinct payload object
        pending = {}
        for cid in selected:
            payload = downlinks[cid]
            ref = refs_by_payload.setdefault(id(payload), ray.put(payload))
            pending[self.actor_of[cid].train.remote(cid, rnd, ref)] = cid

        uplinks: dict[int, Payload] = {}
        client_stats: dict[int, dict[str, float]] = {}
        failed = []
        remaining = list(pending)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1)
            cid = pending[ready[0]]
            try:
                _, uplink, client_stats[cid] = ray.get(ready[0])
            except (ray.exceptions.RayError, RuntimeError) as err:  # reported, the round goes on
                failed.append(cid)
                self.emit("client_failed", round=rnd + 1, client=cid, error=str(err).splitlines()[0][:300])
                continue
            uplinks[cid] = uplink
            self.emit(
                "client_done", round=rnd + 1, client=cid, done=len(uplinks) + len(failed), total=len(selected)
            )

        up_bytes = sum(payload_nbytes(u) for u in uplinks.values())
        self.server.aggregate(rnd, dict(sorted(uplinks.items())))
        self.cum["up"] += up_bytes
        self.cum["down"] += down_bytes
        metrics = mean_stats([client_stats[cid] for cid in sorted(client_stats)])
        metrics.update(
            {
                "comm/up_bytes": up_bytes,
                "comm/down_bytes": down_bytes,
                "comm/up_bytes_cum": self.cum["up"],
                "comm/down_bytes_cum": self.cum["down"],
                "clients/selected": len(selected),
                "clients/failed": len(failed),
            }
        )
        if (rnd + 1) % self.cfg.eval_every == 0 or rnd + 1 == self.cfg.rounds:
            metrics.update(self.evaluate())
        metrics["time/round_s"] = time.perf_counter() - start
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Every client on its own test split; the global model, if any, on the global test set."""
        payload = self.server.eval_payload()
        ref = None if payload is None else ray.put(payload)
        results = ray.get([actor.evaluate.remote(cids, ref) for actor, cids in self.clients_of.items()])
        rows = sorted(row for part in results for row in part)
        self.last_client_acc = {cid: c / t for cid, c, t, _ in rows if t > 0}
        out = personalized_accuracy(*(np.array([r[i] for r in rows], dtype=np.float64) for i in (1, 2, 3)))
        model = self.server.global_model()
        if model is not None:
            state = ray.put(cpu_state(model))
            parts = sorted(
                p
                for a in ray.get([a.evaluate_global.remote(model.arch, state) for a in self.actors])
                for p in a
            )
            correct, total, loss = (sum(p[i] for p in parts) for i in (1, 2, 3))
            out["acc/global"] = correct / max(total, 1)
            out["loss/global"] = loss / max(total, 1)
        return out

    # ------------------------------------------------------------------------------------ state
    def save_checkpoint(self, done: int) -> None:
        """Server state, every client's state and the loop's counters, written atomically."""
        client_states: dict[int, Any] = {}
        for part in ray.get([actor.get_state.remote(cids) for actor, cids in self.clients_of.items()]):
            client_states.update(part)
        state = {
            "round": done,
            "server": self.server.state_dict(),
            "clients": client_states,
            "history": self.history,
            "cum": self.cum,
            "last_client_acc": self.last_client_acc,
            "torch_rng": torch.get_rng_state(),
        }
        path = self.checkpoint_dir / CHECKPOINT_FILE
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        self.emit("checkpoint", round=done, path=str(path))

    def load_checkpoint(self, checkpoint_dir: str) -> int:
        path = Path(checkpoint_dir) / CHECKPOINT_FILE
        state = torch.load(path, weights_only=False)
        self.server.load_state_dict(state["server"])
        clients = state["clients"]
        ray.get([a.set_state.remote({c: clients[c] for c in cids}) for a, cids in self.clients_of.items()])
        self.history = state["history"]
        self.cum = state["cum"]
        self.last_client_acc = state["last_client_acc"]
        torch.set_rng_state(state["torch_rng"])
        self.start_round = state["round"]
        return self.start_round

    def summary(self, finished: bool) -> dict[str, Any]:
        model = self.server.global_model()
        return {
            "finished": finished,
            "rounds_done": len(self.history),
            "history": self.history,
            "client_acc": self.last_client_acc,
            "global_model": None if model is None else {k: v.cpu() for k, v in model.state_dict().items()},
        }

    def client_models(self) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for part in ray.get([actor.models.remote(cids) for actor, cids in self.clients_of.items()]):
            out.update(part)
        return dict(sorted(out.items()))


# Two concurrent calls: run() in one thread, poll() from the driver in the other. The env var gives
# the Coordinator a process of its own instead of one of the idle workers Ray prestarts (one per
# CPU, preloaded for the ClientActors that need them).
COORDINATOR_ENV = {"env_vars": {"FEDRAY_ROLE": "coordinator"}}


@ray.remote(num_cpus=0, max_concurrency=2, runtime_env=COORDINATOR_ENV)
class Coordinator(RoundLoop):
    """RoundLoop as a Ray actor."""

    def __init__(self) -> None:
        use_fast_tensor_transport()  # downlinks leave as raw bytes
        super().__init__()
