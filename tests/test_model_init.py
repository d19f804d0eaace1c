"""Initial weights (``model.init``): shared per architecture, as PFLlib and HtFLlib start their
clients, or drawn per client. Checked on the models a worker builds and trains (no Ray)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from conftest import tiny_overrides
from in_process import client_task

from fedray.algorithms.fedcross import FedCrossServer
from fedray.platform.api.algorithm import ServerContext, seed_torch
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.models import arch_for_client, build_for
from fedray.platform.runtime import storage
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.state_store import state_file
from fedray.platform.runtime.worker import ClientHost, make_client_model
from fedray.platform.seeds import derive_seed
from fedray.platform.tracking.descriptions import run_description


def states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def setup(*overrides: str, **settings):
    cfg = load_config(None, [*tiny_overrides(**settings), *overrides])
    fed = prepare_federation(cfg)
    return cfg, fed, federation_meta(fed)


def test_shared_clients_of_one_architecture_start_alike_and_part_after_training(tmp_path):
    cfg, fed, meta = setup(algorithm="fedproto", **{"train.local_epochs": 1})
    assert cfg.model.init == "shared"  # the default
    first, second = make_client_model(cfg, 0, meta), make_client_model(cfg, 1, meta)
    assert states_equal(first, second)

    host = ClientHost(cfg, num_threads=1)
    host.setup(meta)
    for cid in (0, 1):
        host.train(1, [client_task(cid, fed.shards[cid], str(tmp_path))], [[{}]])
    trained = [host.modules.take(cid)[1].model for cid in (0, 1)]
    assert not states_equal(trained[0], first)  # it trained from the shared start ...
    assert not states_equal(trained[0], trained[1])  # ... on its own data


def test_shared_architectures_draw_apart_and_client_zero_keeps_its_draw():
    # cnn_small and cnn_small_deep both open with a conv of one shape: a shared draw is per architecture
    cfg, _, meta = setup(algorithm="fedproto", **{"model.group": "small_hetero", "data.num_clients": 6})
    models = [make_client_model(cfg, cid, meta) for cid in range(6)]
    assert [m.arch for m in models[:3]] == [m.arch for m in models[3:]]
    for cid in range(3):
        assert states_equal(models[cid], models[cid + 3])
    common = [
        k
        for k, v in models[0].state_dict().items()
        if k in models[2].state_dict() and models[2].state_dict()[k].shape == v.shape and v.numel() > 1
    ]
    assert common, "the test needs two architectures with a parameter of one name and shape"
    assert not any(torch.equal(models[0].state_dict()[k], models[2].state_dict()[k]) for k in common)

    # client 0's draw, the one FedAvg's global model starts from, is what it always was
    seed_torch(derive_seed(cfg.seed, 0, 0))
    before = build_for(models[0].arch, meta["inputs"], meta["num_classes"])
    assert states_equal(models[0], before)


def test_per_client_is_the_earlier_draw_of_every_client():
    cfg, _, meta = setup(
        "model.init=per_client",
        algorithm="fedproto",
        **{"model.group": "small_hetero", "data.num_clients": 6},
    )
    for cid in range(6):
        arch = arch_for_client(cfg.model.group, cid)
        seed_torch(derive_seed(cfg.seed, cid, 0))  # what every client drew before model.init existed
        earlier = build_for(arch, meta["inputs"], meta["num_classes"])
        assert states_equal(make_client_model(cfg, cid, meta), earlier)
    assert not states_equal(make_client_model(cfg, 0, meta), make_client_model(cfg, 3, meta))


@pytest.mark.parametrize("init", ["shared", "per_client"])
def test_fedcross_independent_middleware_models_stay_independent(init):
    # same_init: false asks for K different starts, whichever way clients are initialised
    cfg, fed, meta = setup(f"model.init={init}", "fedcross.same_init=false", algorithm="fedcross")
    n = len(fed.shards)
    ctx = ServerContext(
        cfg,
        n,
        meta["num_classes"],
        ["cnn_small"] * n,
        make_model=lambda cid: make_client_model(cfg, cid, meta),
        make_distinct_model=lambda i: make_client_model(cfg, i, meta, init="per_client"),
    )
    server = FedCrossServer(ctx)
    first, second = server.middleware[0], server.middleware[1]
    assert not all(torch.equal(first[k], second[k]) for k in first)


def test_the_run_says_how_it_was_initialised():
    shared, _, _ = setup()
    per_client, _, _ = setup("model.init=per_client")
    assert "same weights" in run_description(shared)
    assert "weights of its own" in run_description(per_client)


def test_an_unknown_init_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"model\.init"):
        load_config(None, ["model.init=random"])


@pytest.mark.parametrize("init", ["shared", "per_client"])
def test_a_new_client_on_a_worker_that_trained_many_starts_as_on_a_fresh_one(init):
    """A worker loads new clients into the models of evicted ones (and, shared, copies the one draw
    it made): the client trains to the bits it trains to on a fresh worker, and the worker keeps a
    bounded number of spare models however many clients it has taken up."""
    from fedray.platform.runtime.worker import SPARE_MODELS

    overrides = ("algorithm=fedproto", f"model.init={init}", "ray.cache_clients=2", "train.local_epochs=1")
    cfg, fed, meta = setup(*overrides, **{"data.num_clients": 12, "data.partition.min_samples": 20})
    last = 11

    def trained_state(host: ClientHost, cid: int):
        with tempfile.TemporaryDirectory() as directory:
            results = host.train(1, [client_task(cid, fed.shards[cid], directory)], [[{}]])
            assert results[0].error is None, results[0].error
            return results[0].uplink, storage.load_torch(state_file(directory, cid, 1))

    used = ClientHost(cfg, num_threads=1)
    used.setup(meta)
    for cid in range(last):
        trained_state(used, cid)
    assert sum(len(models) for models in used.spare.values()) <= SPARE_MODELS
    fresh = ClientHost(cfg, num_threads=1)
    fresh.setup(meta)
    for mine, theirs in zip(trained_state(used, last), trained_state(fresh, last), strict=True):
        flat_mine, flat_theirs = tensors_of(mine), tensors_of(theirs)
        assert flat_mine.keys() == flat_theirs.keys()
        assert all(torch.equal(flat_mine[k], flat_theirs[k]) for k in flat_mine)


def tensors_of(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if torch.is_tensor(tree):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensors_of(value, f"{prefix}.{key}").items()}
    return {}
