"""Rounds of an experiment in the test's own process, without Ray: the real server half, the real
worker (``ClientHost``: Lightning modules, the worker's training loop) and real data, round after round.
What ``fedray run`` does minus the processes, for tests that check a config or a dataset trains."""

from __future__ import annotations

import math
import os
import tempfile

import torch

from fedray.platform.config import ExperimentConfig, clients_per_round
from fedray.platform.runtime.coordinator import build_server, checked_selection
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.state_store import STATES_DIR, ClientTask, state_file
from fedray.platform.runtime.worker import ClientHost
from fedray.platform.tracking.names import Metrics


def train_rounds(cfg: ExperimentConfig, rounds: int, first: int = 0) -> list[tuple[int, int, int, float]]:
    """Rounds ``first .. first + rounds - 1``: every selected client trains (a finite loss), every
    aggregation moves the server's state and keeps it finite. Returns the last round's personalised
    evaluation, ``(client, correct, total, loss)`` per trained client."""
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    host = ClientHost(cfg, num_threads=1)
    host.setup(meta)
    server = build_server(cfg, meta)
    n = len(fed.shards)
    states = tempfile.TemporaryDirectory(prefix="fedray-test-states-")
    for rnd in range(first, first + rounds):
        selected = checked_selection(server, rnd, server.select(rnd, clients_per_round(cfg)), n)
        payloads = server.configure(rnd, selected)
        tasks = [client_task(c, fed.shards[c], states.name) for c in selected]
        results = host.train(rnd, tasks, [[payloads[c]] for c in selected])
        assert [r.error for r in results] == [None] * len(selected)
        for r in results:  # every selected client trained: a finite training loss
            assert math.isfinite(r.stats[Metrics.LOSS_TRAIN]), r.stats
        uplinks = {r.client: r.uplink for r in results}
        assert sorted(uplinks) == sorted(selected)

        before = tensors(server.state_dict(), copy=True)
        server.aggregate(rnd, uplinks)
        after = tensors(server.state_dict())
        assert all(t.isfinite().all() for t in after.values() if t.is_floating_point())
        # the aggregation used what the clients sent: the server's state (if it keeps one) moved
        moved = after.keys() != before.keys() or any(not torch.equal(after[k], before[k]) for k in after)
        assert moved or not before
    return host.evaluate(tasks, server.eval_payload())


def client_task(client: int, shard, directory: str, version: int = 0, make_folder: bool = True) -> ClientTask:
    """A training task as the run's state store makes it: the file of the client's committed state
    (version > 0) and the file its next state goes to, under ``directory`` (whose states folder is
    made, as the Coordinator makes it, unless ``make_folder`` is False)."""
    if make_folder:
        os.makedirs(os.path.join(directory, STATES_DIR), exist_ok=True)
    current = state_file(directory, client, version) if version else None
    return ClientTask(client, [shard], current, version, state_file(directory, client, version + 1))


def tensors(tree, prefix: str = "", copy: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor in a nested state (dicts, lists), by its path."""
    if torch.is_tensor(tree):
        return {prefix: tree.clone() if copy else tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    )
    return {k: v for key, value in items for k, v in tensors(value, f"{prefix}.{key}", copy).items()}
