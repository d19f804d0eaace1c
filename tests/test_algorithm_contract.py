"""Every algorithm's client keeps its tensors where its module is.

Lightning moves a client module to its GPU after ``receive``; a tensor the client keeps as a plain
attribute stays behind on the CPU and the next training step fails on a device mismatch (on a GPU
worker the Coordinator would report every client as failed). There is no GPU here, so the test
moves modules to float64 instead (``module.double()``, after ``receive`` as Lightning's move comes
after it): a tensor that does not follow the module shows up in the wrong dtype, and a training
step, ``upload`` and evaluation run in float64 throughout. Work a client moves to the CPU itself
(``.cpu()``) and then combines with tensors of its training device fails on a GPU worker in the
same way; ``DeviceMixing`` marks what was moved and finds such an operation on the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_overrides
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.api.registry import available, get, register, registered_by
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.data import ArrayDataset, normalize
from fedray.platform.runtime.coordinator import checked_selection
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.worker import make_client_model, member_model, smallest_arch

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
        # _built_held: the platform's copies of what construction held, put back through hold() (which
        # casts them to the module's dtype and device)
        if name not in ("_parameters", "_buffers", "_modules", "_built_held", "ctx"):
            visit(name, value)
    for name, buf in module.named_buffers():
        visit(name, buf)
    return found


class DeviceMixing(TorchFunctionMode):
    """Marks tensors a client moved to the CPU by name (``.cpu()``, ``.to("cpu")``; ``.to(device)``
    is the training device's, the CPU only here) and what is computed from them alone; an operation
    that combines a marked tensor (more than a scalar) with an unmarked one, which on a GPU worker is
    on the GPU, is recorded by name."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: dict[int, torch.Tensor] = {}  # by id, held so that an id is never reused
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
        marked = [t for t in tensors if id(t) in self.moved]
        to_cpu = func is torch.Tensor.cpu or (
            func is torch.Tensor.to
            and "cpu" in [a for a in [*args[1:], kwargs.get("device")] if isinstance(a, str)]
        )
        if to_cpu or (marked and len(marked) == len(tensors)):
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t):
                    self.moved[id(t)] = t
        elif any(t.dim() > 0 for t in marked):
            self.mixed.append(getattr(func, "__name__", str(func)))
        return out


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


@pytest.mark.parametrize("algorithm", SHIPPED)
def test_no_client_combines_what_it_moved_to_the_cpu_with_its_devices_tensors(algorithm):
    mixing = DeviceMixing()
    strays_over_two_rounds(algorithm, mixing)
    assert mixing.mixed == []


def test_device_mixing_finds_a_moved_tensor_used_with_a_devices_one():
    mixing = DeviceMixing()
    with mixing:
        on_device, labels = torch.ones(3, 2), torch.tensor([0, 1, 1])
        moved = on_device.cpu()
        sums = moved.new_zeros(2, 2)  # made from a moved tensor alone: on the CPU too
        (moved * 2).sum() + on_device  # a scalar from the CPU goes with a GPU tensor
        sums.index_add_(0, labels, moved)  # FedProto's upload before the fix: labels on the device
    assert mixing.mixed == ["index_add_"]


def strays_over_two_rounds(algorithm: str, mixing: DeviceMixing | None = None) -> list[tuple[int, int, str]]:
    """(client, round, attribute) of every floating tensor that did not follow its module to float64
    after ``receive``; every training step, upload and evaluation runs in float64 on the way, under
    ``mixing`` when given."""
    watching = mixing if mixing is not None else contextlib.nullcontext()
    torch.manual_seed(0)
    cfg = load_config(None, tiny_overrides(algorithm=algorithm, **{"fedl2g.warmup_rounds": 0}))
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    spec = get(algorithm)
    n = len(fed.shards)
    models = [make_client_model(cfg, c, meta) for c in range(n)]
    shared = {
        "find_smallest": lambda: smallest_arch(cfg, meta),
        "make_arch": lambda a: member_model(cfg, a, meta),
    }
    server = spec.server_cls(
        ServerContext(
            cfg,
            n,
            meta["num_classes"],
            [m.arch for m in models],
            lambda c: models[c],
            train_sizes=meta["train_sizes"],
            **shared,
        )
    )
    clients, strays = {}, []
    for c in range(n):
        shard = fed.shards[c]
        train = ArrayDataset(normalize(shard.train.x, meta["mean"], meta["std"]).double(), shard.train.y)
        ctx = ClientContext(
            c,
            cfg,
            meta["num_classes"],
            train,
            torch.bincount(train.y, minlength=meta["num_classes"]),
            **shared,
        )
        clients[c] = spec.client_cls(make_client_model(cfg, c, meta), ctx)

    for rnd in (0, 1):  # round 1's downlinks carry what round 0's uplinks built (prototypes, guides)
        selected = checked_selection(server, rnd, server.select(rnd, clients_per_round(cfg)), n)
        payloads = server.configure(rnd, selected)
        uplinks = {}
        for c in selected:
            module = clients[c]
            module.float()
            with watching:
                module.begin_round(rnd, payloads[c])
            module.double()  # where Lightning would move the module to its GPU
            strays += [(c, rnd, name) for name in stray_tensors(module)]
            if strays:  # the step below would fail on the mixed dtypes a stray tensor makes
                return strays
            x, y = module.ctx.train.x[:8], module.ctx.train.y[:8]
            with watching:
                module.training_step((x, y), 0).backward()
                uplinks[c] = as_float32(module.upload())
        server.aggregate(rnd, uplinks)

    payload = server.eval_payload()
    for module in (clients[c] for c in selected):
        if payload is not None and "model" not in payload:  # a client-specific evaluation payload
            module.load_for_eval(payload)
            module.double()
        with watching:
            scores = module.eval_logits(module.ctx.train.x[:8])
        assert scores.shape == (8, meta["num_classes"]) and scores.dtype == torch.float64
    return strays
