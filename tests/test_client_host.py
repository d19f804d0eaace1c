"""What the platform guarantees every algorithm's client, checked on a ClientHost driven directly
(no Ray): the round is set before ``receive``, and every call is seeded by (seed, round, client)."""

from __future__ import annotations

import copy
import random
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import tiny_overrides
from in_process import client_task

from fedray.platform.api.algorithm import ClientModule, Server
from fedray.platform.api.registry import available, register
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.errors import ContractError
from fedray.platform.runtime import storage
from fedray.platform.runtime.coordinator import build_server
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.state_store import ClientTask, state_file
from fedray.platform.runtime.worker import ClientHost, client_model_state


class DrawingClient(ClientModule):
    """Trains only when told to, never sets ``self.rnd`` itself, and draws from torch's global RNG
    where an algorithm would (dropout in FedL2G's meta-step, random crops)."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.built_with = np.random.rand()  # a draw while the module is built, from numpy's global generator

    def receive(self, rnd, payload) -> None:
        pass  # no super(), no self.rnd = rnd

    def local_epochs(self, rnd: int) -> int:
        return self.hp.epochs

    def upload(self):
        # numpy's and Python's global generators too, as code that skips the named streams draws
        return {
            "rnd": self.rnd,
            "draw": torch.rand(3),
            "np": np.random.rand(),
            "py": random.random(),
            "built_with": self.built_with,
        }


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
    with tempfile.TemporaryDirectory() as states:
        (result,) = host.train(rnd, [client_task(cid, fed.shards[cid], states)], [[payload or {}]])
    assert result.error is None, result.error
    return result.uplink


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
    torch.rand(100), np.random.rand(100), random.random()
    again = uplink(other, fed, 0, 5)
    assert torch.equal(again["draw"], first["draw"])
    assert (again["np"], again["py"], again["built_with"]) == (first["np"], first["py"], first["built_with"])
    later = uplink(other, fed, 0, 6)
    assert not torch.equal(later["draw"], first["draw"]) and later["np"] != first["np"]


@pytest.mark.parametrize(
    "algorithm", [a for a in available() if a not in ("drawing_probe", "round_modes_probe", "fedavg_killer")]
)
def test_every_algorithm_trains_at_the_round_it_is_given(algorithm):
    cfg, fed, host = host_for(algorithm=algorithm, **{"train.local_epochs": 1})
    server = build_server(cfg, federation_meta(fed))  # the Coordinator's server, context and all
    payload = server.configure(7, list(range(clients_per_round(cfg))))
    for cid in (0, 1):
        uplink(host, fed, cid, 7, payload[cid])
        if host.keeps_state:
            assert host.modules[cid][1].rnd == 7


class RoundModesClient(ClientModule):
    """Keeps a part of its own in eval mode from __init__ (a teacher, a frozen normalisation), puts
    its whole model in eval mode in one round's receive (``round_modes_probe.eval_round``), and tells what
    modes it trained in and what the fit counters read when its round began."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.frozen = torch.nn.Dropout(0.5).eval()

    def receive(self, rnd, payload) -> None:
        self.began_at = (self.current_epoch, self.global_step)
        if rnd == self.hp.eval_round:
            self.model.eval()

    def training_step(self, batch, batch_idx):
        self.modes = (self.model.training, self.frozen.training)
        return super().training_step(batch, batch_idx)

    def upload(self):
        return {
            "modes": self.modes,
            "began_at": self.began_at,
            "ended_at": (self.current_epoch, self.global_step),
        }


@register("round_modes_probe", server=Server, client=RoundModesClient)
@dataclass
class RoundModesConfig(AlgorithmConfig):
    eval_round: int = -1


def test_every_round_starts_in_the_modes_the_module_was_built_with_and_its_counters_at_zero():
    _, fed, host = host_for(
        "round_modes_probe.eval_round=0", algorithm="round_modes_probe", **{"train.local_epochs": 2}
    )
    with tempfile.TemporaryDirectory() as states:
        tasks = [client_task(0, fed.shards[0], states, version=v) for v in (0, 1)]
        (first,) = host.train(0, tasks[:1], [[{}]])
        assert first.uplink["modes"] == (
            False,
            False,
        )  # round 0's receive put the model in eval: so it trains
        assert first.uplink["began_at"] == (0, 0) and first.uplink["ended_at"][0] == 2
        assert 0 in host.modules  # the module stays cached, as its last fit and receive left it
        (second,) = host.train(1, tasks[1:], [[{}]])
    assert second.uplink["modes"] == (True, False)  # as built: the model trains, the frozen part stays
    assert second.uplink["began_at"] == (0, 0)  # not the last fit's counters


class CarryingClient(ClientModule):
    """Carries a count from round to round in held tensors, as a SCAFFOLD c_i kept with hold() would:
    the module a worker cached would see it, one built again elsewhere would not."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.hold("carried", torch.zeros(1))

    def receive(self, rnd, payload) -> None:
        super().receive(rnd, payload)
        self.seen_at_receive = (self.carried.item(), "late" in dict(self.named_buffers()))

    def upload(self):
        self.carried += 1  # in place, on the tensor construction held
        self.hold("late", torch.ones(1))  # held for the first time after construction
        return {"seen_at_receive": self.seen_at_receive}


register("carrying_probe", server=Server, client=CarryingClient)(
    dataclass(type("carrying_probeConfig", (AlgorithmConfig,), {}))
)


def test_a_held_tensor_never_reaches_the_next_round_of_a_cached_module():
    _, fed, host = host_for(algorithm="carrying_probe")
    with tempfile.TemporaryDirectory() as states:
        tasks = [client_task(0, fed.shards[0], states, version=v) for v in (0, 1)]
        (first,) = host.train(0, tasks[:1], [[{}]])
        assert 0 in host.modules  # the next round reuses this module
        module = host.modules[0][1]
        host.evaluate(tasks[1:], None)  # evaluation too sees what a module built for it would hold
        assert module.carried.item() == 0 and "late" not in dict(module.named_buffers())
        (second,) = host.train(1, tasks[1:], [[{}]])
    # as a module built for round 1 would hold: the construction's zero, and nothing held since
    assert first.uplink["seen_at_receive"] == (0.0, False)
    assert second.uplink["seen_at_receive"] == (0.0, False)


class PersonalClient(ClientModule):
    """Trains a personal copy beside the shared model and is tested with it, as Ditto is."""

    eval_mode = "own"
    tested_model = "personal"

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.personal = copy.deepcopy(model)
        with torch.no_grad():
            for p in self.personal.parameters():
                p.add_(1.0)  # unlike the shared model

    def eval_logits(self, x):
        return self.personal(x)


class MisnamedClient(PersonalClient):
    tested_model = "personnal"


for _name, _client in [("personal_probe", PersonalClient), ("misnamed_probe", MisnamedClient)]:
    register(_name, server=Server, client=_client)(dataclass(type(f"{_name}Config", (AlgorithmConfig,), {})))


def test_the_model_logged_for_a_client_is_the_one_it_is_tested_with():
    _, fed, host = host_for(algorithm="personal_probe")
    with tempfile.TemporaryDirectory() as states:
        task = client_task(0, fed.shards[0], states)
        (result,) = host.train(0, [task], [[{}]])
        assert result.error is None
        state = storage.load_torch(task.commit_file)
    module = host.modules[0][1]
    logged = client_model_state(state, PersonalClient.tested_model)
    assert logged.keys() == module.personal.state_dict().keys()
    for key, value in module.personal.state_dict().items():
        assert torch.equal(logged[key], value)
    assert not torch.equal(logged["head.weight"], module.model.head.weight.detach())

    _, fed, host = host_for(algorithm="misnamed_probe")
    with tempfile.TemporaryDirectory() as states, pytest.raises(ContractError) as err:
        host.train(0, [client_task(0, fed.shards[0], states)], [[{}]])
    assert "MisnamedClient.tested_model='personnal' names no model of self.model's architecture" in str(
        err.value
    )


def test_a_reused_model_reaches_a_new_clients_module_in_train_mode():
    # clients that keep nothing share one model per architecture; the global model's evaluation or an
    # algorithm may have left it in eval mode
    _, fed, host = host_for(algorithm="fedavg")
    host.arch_model("cnn_small").eval()
    modes = []
    real = host.training.fit
    host.training.fit = lambda module, *args: (modes.append(module.model.training), real(module, *args))[1]
    payload = {"model": {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}}
    uplink(host, fed, 0, 0, payload)
    assert modes == [True]
    # a client that keeps its state, built on an evicted client's model left in eval mode
    _, fed, host = host_for(algorithm="round_modes_probe", **{"train.local_epochs": 1})
    with tempfile.TemporaryDirectory() as states:
        host.train(0, [client_task(0, fed.shards[0], states)], [[{}]])
        host.drop(0)  # its model becomes the spare the next client of its architecture is loaded into
        (spare,) = host.spare["cnn_small"]
        spare.eval()
        (result,) = host.train(0, [client_task(1, fed.shards[1], states)], [[{}]])
    assert host.modules[1][1].model is spare and result.uplink["modes"] == (True, False)


# ------------------------------------------------------------------------------------ the worker's rules


class ForgetfulClient(ClientModule):
    """Says it keeps nothing, but loads only the head of the downlink: the rest of its model would be
    whatever client the worker trained last."""

    keeps_state = False

    def receive(self, rnd, payload) -> None:
        self.model.head.load_state_dict(payload["head"])


class TwoModelClient(ClientModule):
    """Says it keeps nothing and loads its whole model, but also trains a personal copy (as Ditto
    does) that no downlink overwrites: the worker's shared module would hand it to the next client."""

    keeps_state = False

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.personal = copy.deepcopy(model)

    def receive(self, rnd, payload) -> None:
        self.model.load_state_dict(payload["model"])


class TeacherClient(ClientModule):
    """Keeps nothing, rightly: a constant buffer made from its context in ``__init__``, and a teacher
    copied from the model it received (not from the worker's shared model before it)."""

    keeps_state = False

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.register_buffer("prior", ctx.class_counts.float() / ctx.class_counts.sum())
        self.teacher = copy.deepcopy(model)

    def receive(self, rnd, payload) -> None:
        self.model.load_state_dict(payload["model"])
        self.teacher = copy.deepcopy(self.model)


class InPlaceClient(ClientModule):
    """Keeps its state, but scales the downlink it was given in place (the worker shares it)."""

    def receive(self, rnd, payload) -> None:
        payload["scale"].mul_(2)


class TrainerClient(ClientModule):
    """Reaches for Lightning's Trainer, which fedray's worker loop does not have."""

    def training_step(self, batch, batch_idx):
        self.trainer.optimizers[0].zero_grad()
        return super().training_step(batch, batch_idx)


class StepClient(ClientModule):
    """Overrides a Lightning hook the worker loop does not call."""

    def optimizer_step(self, *args, **kwargs):
        raise AssertionError("never called")


for _name, _client in [
    ("forgetful_probe", ForgetfulClient),
    ("inplace_probe", InPlaceClient),
    ("two_model_probe", TwoModelClient),
    ("teacher_probe", TeacherClient),
    ("trainer_probe", TrainerClient),
    ("step_probe", StepClient),
]:
    register(_name, server=Server, client=_client)(dataclass(type(f"{_name}Config", (AlgorithmConfig,), {})))


def test_a_client_that_keeps_nothing_must_load_its_whole_model():
    _, fed, host = host_for(algorithm="forgetful_probe")
    head = {k: v.clone() for k, v in host.arch_model("cnn_small").head.state_dict().items()}
    with pytest.raises(ContractError) as err:
        host.train(0, [ClientTask(0, [fed.shards[0]])], [[{"head": head}]])
    assert "keeps_state = False, but receive() left model.features.conv1.weight as it was" in str(err.value)


def test_a_client_that_keeps_nothing_may_not_keep_another_model_either():
    _, fed, host = host_for(algorithm="two_model_probe")
    model = {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}
    with pytest.raises(ContractError) as err:
        host.train(0, [ClientTask(0, [fed.shards[0]])], [[{"model": model}]])
    assert (
        "keeps_state = False, but personal.features.conv1.weight copies the worker's shared model as its "
        "previous client left it" in str(err.value)
    )


def test_a_client_that_keeps_nothing_may_build_what_it_needs_each_round():
    _, fed, host = host_for(algorithm="teacher_probe")
    model = {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}
    (result,) = host.train(0, [ClientTask(0, [fed.shards[0]])], [[{"model": model}]])
    assert result.error is None


def test_a_downlink_changed_in_place_is_refused():
    _, fed, host = host_for(algorithm="inplace_probe")
    with pytest.raises(ContractError, match="changed a tensor of its downlink in place"):
        host.train(0, [ClientTask(0, [fed.shards[0]])], [[{"scale": torch.ones(3)}]])


def test_the_trainer_is_not_there_and_says_so():
    _, fed, host = host_for(algorithm="trainer_probe", **{"train.local_epochs": 1})
    with pytest.raises(
        ContractError, match=r"TrainerClient\.trainer: fedray trains clients with its own loop"
    ):
        host.train(0, [ClientTask(0, [fed.shards[0]])], [[{}]])


def test_a_hook_the_loop_does_not_call_is_refused_before_the_run(capsys):
    from fedray.platform.apps.cli import main

    assert main(["run", *tiny_overrides(algorithm="step_probe")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "fedray: error: algorithm 'step_probe': StepClient overrides LightningModule.optimizer_step, which "
        "fedray's worker loop does not call (the platform steps the optimizer (train.grad_clip, "
        "train.precision))"
    )


def test_clients_that_keep_nothing_share_one_model_and_commit_nothing(tmp_path):
    _, fed, host = host_for(algorithm="fedavg")
    payload = {"model": {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}}
    tasks = [client_task(c, fed.shards[c], str(tmp_path)) for c in (0, 1)]
    results = host.train(0, tasks, [[payload], [payload]])
    assert [r.client for r in results] == [0, 1] and all(r.error is None for r in results)
    assert len(host.modules) == 0 and list(host.arch_models) == ["cnn_small"]  # no per-client module

    _, _, stateful = host_for(algorithm="fedavg", **{"train.keep_optimizer_state": True})
    assert list((tmp_path / "states").iterdir()) == []  # nothing written
    stateful.train(0, tasks, [[payload], [payload]])
    states = [storage.load_torch(state_file(str(tmp_path), c, 1)) for c in (0, 1)]
    assert set(states[0]) == {"module", "optimizer"} and states[0]["optimizer"]  # momentum kept: committed
    assert sorted(stateful.modules) == [0, 1]


def test_a_call_that_fails_part_way_caches_none_of_its_clients(tmp_path):
    # client 0 trains, then the call fails (here: client 1's downlink is missing): the Coordinator
    # commits neither, so a module cached at client 0's new version could later pass for another's
    _, fed, host = host_for(algorithm="fedavg", **{"train.keep_optimizer_state": True})
    payload = {"model": {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}}
    tasks = [client_task(c, fed.shards[c], str(tmp_path)) for c in (0, 1)]
    with pytest.raises(IndexError):
        host.train(0, tasks, [[payload], []])
    assert sorted(host.modules) == []  # client 0 trained, but is not kept
    host.train(0, tasks[:1], [[payload]])
    assert sorted(host.modules) == [0]  # a call that succeeds caches as before


def test_caches_forget_the_least_recently_used_by_count_or_by_weight():
    from fedray.platform.runtime.worker import LRU

    by_count = LRU(2)
    assert [by_count.keep(k, k) for k in "abc"] == [[], [], ["a"]]
    by_weight = LRU(10, weigh=len)  # shards are weighed in bytes
    by_weight.keep("a", "x" * 4)
    by_weight.keep("b", "y" * 4)
    assert by_weight.take("a") == "x" * 4  # now the most recent: "b" goes first
    assert by_weight.keep("c", "z" * 4) == ["y" * 4]
    assert list(by_weight) == ["a", "c"] and by_weight.weight == 8
    assert by_weight.keep("d", "w" * 20) == ["x" * 4, "z" * 4]  # the newest stays, however heavy
    assert by_weight.pop("d") == "w" * 20 and by_weight.weight == 0


def test_a_kept_adam_state_is_committed_and_read_back_by_a_worker_that_never_held_the_client(tmp_path):
    settings = {"train.keep_optimizer_state": True, "train.optimizer": "adam"}
    _, fed, host = host_for(algorithm="fedavg", **settings)
    payload = {"model": {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}}
    tasks = [client_task(0, fed.shards[0], str(tmp_path), version=v) for v in (0, 1)]
    host.train(0, tasks[:1], [[payload]])
    first = storage.load_torch(state_file(str(tmp_path), 0, 1))["optimizer"]
    assert first["param_groups"][0]["betas"] == (0.9, 0.999)  # train.momentum as beta1
    steps = {float(s["step"]) for s in first["state"].values()}
    assert len(steps) == 1 and steps.pop() > 0 and all("exp_avg_sq" in s for s in first["state"].values())
    _, _, fresh = host_for(algorithm="fedavg", **settings)  # another worker: the state comes from the file
    fresh.train(1, tasks[1:], [[payload]])
    second = storage.load_torch(state_file(str(tmp_path), 0, 2))["optimizer"]
    for key, state in second["state"].items():
        assert float(state["step"]) == 2 * float(first["state"][key]["step"])  # Adam's count carried on
