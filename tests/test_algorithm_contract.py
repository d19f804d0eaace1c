"""Every algorithm's client keeps its tensors where its module is.

Lightning moves a client module to its GPU after ``receive``; a tensor the client keeps as a plain
attribute stays behind on the CPU and the next training step fails on a device mismatch (on a GPU
worker the Coordinator would report every client as failed). There is no GPU here, so the test
moves modules to float64 instead (``module.double()``, after ``receive`` as Lightning's move comes
after it): a tensor that does not follow the module shows up in the wrong dtype, and a training
step, ``upload`` and evaluation run in float64 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_overrides

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.api.registry import available, get, register, registered_by
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.data import ArrayDataset, normalize
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.worker import make_client_model

SHIPPED = registered_by("fedray.algorithms")


def stray_tensors(module: torch.nn.Module) -> list[str]:
    """Floating tensors kept in plain attributes (or lists / dicts of them) that did not become float64."""
    found = []

    def visit(name, value):
        if torch.is_tensor(value):
            if value.is_floating_point() and value.dtype != torch.float64:
                found.append(name)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{name}[{i}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}[{k!r}]", v)

    for name, value in vars(module).items():
        if name not in ("_parameters", "_buffers", "_modules", "ctx"):
            visit(name, value)
    for name, buf in module.named_buffers():
        visit(name, buf)
    return found


def as_float32(payload):
    """An uplink as a float32 client would have sent it."""
    if torch.is_tensor(payload):
        return payload.float() if payload.is_floating_point() else payload
    if isinstance(payload, dict):
        return {k: as_float32(v) for k, v in payload.items()}
    return payload


def test_the_shipped_algorithms_are_all_covered():
    assert {"fedavg", "fedprox", "fedssa", "fedcross", "fedsc", "fedl2g", "lgfedavg", "fedproto"} <= set(
        SHIPPED
    )


@pytest.mark.parametrize("algorithm", SHIPPED)
def test_client_tensors_follow_the_module_through_train_upload_and_eval(algorithm):
    assert strays_over_two_rounds(algorithm) == []


class StrayClient(FedAvgClient):
    """Keeps what came down as a plain tensor attribute instead of through ``hold()``."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = payload["model"]["head.weight"].clone()


@dataclass
class StrayConfig(AlgorithmConfig):
    pass


def test_a_client_that_keeps_a_plain_tensor_is_caught():
    # the check itself can fail: an algorithm that breaks the rule is found, by the attribute's name
    if "stray_probe" not in available():  # registered here, not at import: other files list available()
        register("stray_probe", server=FedAvgServer, client=StrayClient)(StrayConfig)
    strays = strays_over_two_rounds("stray_probe")
    assert strays and all(name == "anchor" for _, _, name in strays)


def strays_over_two_rounds(algorithm: str) -> list[tuple[int, int, str]]:
    """(client, round, attribute) of every floating tensor that did not follow its module to float64
    after ``receive``; every training step, upload and evaluation runs in float64 on the way."""
    torch.manual_seed(0)
    cfg = load_config(None, tiny_overrides(algorithm=algorithm, **{"fedl2g.warmup_rounds": 0}))
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    spec = get(algorithm)
    n = len(fed.shards)
    models = [make_client_model(cfg, c, meta) for c in range(n)]
    server = spec.server_cls(
        ServerContext(cfg, n, meta["num_classes"], [m.arch for m in models], lambda c: models[c])
    )
    selected = list(range(clients_per_round(cfg)))
    clients, strays = {}, []
    for c in selected:
        shard = fed.shards[c]
        train = ArrayDataset(normalize(shard.train.x, meta["mean"], meta["std"]).double(), shard.train.y)
        ctx = ClientContext(
            c, cfg, meta["num_classes"], train, torch.bincount(train.y, minlength=meta["num_classes"])
        )
        clients[c] = spec.client_cls(make_client_model(cfg, c, meta), ctx)

    for rnd in (0, 1):  # round 1's downlinks carry what round 0's uplinks built (prototypes, guides)
        payloads = server.configure(rnd, selected)
        uplinks = {}
        for c, module in clients.items():
            module.float()
            module.begin_round(rnd, payloads[c])
            module.double()  # where Lightning would move the module to its GPU
            strays += [(c, rnd, name) for name in stray_tensors(module)]
            if strays:  # the step below would fail on the mixed dtypes a stray tensor makes
                return strays
            x, y = module.ctx.train.x[:8], module.ctx.train.y[:8]
            module.training_step((x, y), 0).backward()
            uplinks[c] = as_float32(module.upload())
        server.aggregate(rnd, uplinks)

    payload = server.eval_payload()
    for module in clients.values():
        if payload is not None and "model" not in payload:  # a client-specific evaluation payload
            module.load_for_eval(payload)
            module.double()
        scores = module.eval_logits(module.ctx.train.x[:8])
        assert scores.shape == (8, meta["num_classes"]) and scores.dtype == torch.float64
    return strays
