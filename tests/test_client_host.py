"""What the platform guarantees every algorithm's client, checked on a ClientHost driven directly
(no Ray): the round is set before ``receive``, and every call is seeded by (seed, round, client)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_overrides

from fedray.platform.algorithm import ClientModule, Server, ServerContext
from fedray.platform.algorithm_config import AlgorithmConfig
from fedray.platform.client import ClientHost, make_client_model
from fedray.platform.config import clients_per_round, load_config
from fedray.platform.registry import available, register
from fedray.platform.run import federation_meta, prepare_federation
from fedray.platform.store import ClientTask


class DrawingClient(ClientModule):
    """Trains only when told to, never sets ``self.rnd`` itself, and draws from torch's global RNG
    where an algorithm would (dropout in FedL2G's meta-step, random crops)."""

    def receive(self, rnd, payload) -> None:
        pass  # no super(), no self.rnd = rnd

    def local_epochs(self, rnd: int) -> int:
        return self.hp.epochs

    def upload(self):
        return {"rnd": self.rnd, "draw": torch.rand(3)}


@register("drawing_probe", server=Server, client=DrawingClient)
@dataclass
class DrawingConfig(AlgorithmConfig):
    epochs: int = 0


def host_for(*overrides: str, **settings):
    cfg = load_config(None, [*tiny_overrides(**settings), *overrides])
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    return cfg, fed, host


def uplink(host: ClientHost, fed, cid: int, rnd: int, payload=None):
    (up, _), _ = host.train(ClientTask(cid, [fed.shards[cid]]), rnd, payload or {})
    return up


@pytest.mark.parametrize("epochs", [0, 1])
def test_the_platform_sets_the_round_and_seeds_every_call(epochs):
    _, fed, host = host_for(f"drawing_probe.epochs={epochs}", algorithm="drawing_probe")
    first = uplink(host, fed, 0, 5)
    assert first["rnd"] == 5  # set before receive, though receive never sets it

    # the same client and round on a worker that ran other clients first draws the same numbers,
    # in a warm-up round (no training) as in a training one
    _, _, other = host_for(f"drawing_probe.epochs={epochs}", algorithm="drawing_probe")
    uplink(other, fed, 1, 5)
    uplink(other, fed, 2, 3)
    torch.rand(100)
    assert torch.equal(uplink(other, fed, 0, 5)["draw"], first["draw"])
    assert not torch.equal(uplink(other, fed, 0, 6)["draw"], first["draw"])


@pytest.mark.parametrize("algorithm", [a for a in available() if a not in ("drawing_probe", "fedavg_killer")])
def test_every_algorithm_trains_at_the_round_it_is_given(algorithm):
    cfg, fed, host = host_for(algorithm=algorithm, **{"train.local_epochs": 1})
    meta = federation_meta(fed)
    archs = [make_client_model(cfg, c, meta).arch for c in range(len(fed.shards))]
    ctx = ServerContext(
        cfg, len(fed.shards), meta["num_classes"], archs, lambda c: make_client_model(cfg, c, meta)
    )
    server = host.spec.server_cls(ctx)
    payload = server.configure(7, list(range(clients_per_round(cfg))))
    for cid in (0, 1):
        uplink(host, fed, cid, 7, payload[cid])
        assert host.modules[cid][1].rnd == 7
