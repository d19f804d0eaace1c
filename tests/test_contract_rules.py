"""A third-party algorithm that breaks a rule of the contract gets one line naming the rule, before its
run starts or in its first round: never a silently wrong run, never a KeyError deep in the Coordinator.

Rules a class shows in its code are checked when the algorithm is looked up (no Ray); rules only a
running client shows are checked by a ClientHost on its first client; the uplink rule ends a real
``fedray run`` with its line.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import only_run, tiny_overrides
from test_client_host import host_for

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api import AlgorithmConfig, ClientModule, ContractError, Server, ServerContext, register
from fedray.platform.api.algorithm import tests_with_global_model as global_model_evaluation
from fedray.platform.api.contract import check_parameters_apart, check_uplinks, holds_tensor, storages
from fedray.platform.api.registry import available, get
from fedray.platform.catalog import load_config
from fedray.platform.errors import CheckpointError, ConfigError
from fedray.platform.runtime.coordinator import check_evaluable, server_stats
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.runtime.session import RunAborted
from fedray.platform.runtime.state_store import ClientTask
from fedray.platform.tracking.names import Metrics


def probe(name: str, client: type, server: type = Server) -> str:
    """Register ``client`` under ``name`` (once per process) and return the name."""
    if name not in available():
        register(name, server=server, client=client)(dataclass(type(f"{name}Config", (AlgorithmConfig,), {})))
    return name


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ what the class shows: at lookup


class RoundClient(ClientModule):
    def begin_round(self, rnd, payload):
        self.receive(rnd, payload)  # forgets self.rnd, on which the data order depends


class PersonalEvalClient(ClientModule):
    """Loads a header for its test but leaves eval_mode at 'global', where load_for_eval is never called."""

    def load_for_eval(self, payload):
        self.model.head.load_state_dict(payload["head"])


class ModeClient(ClientModule):
    eval_mode = "personal"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("name", "client", "rule"),
    [
        (
            "round_probe",
            RoundClient,
            "RoundClient overrides ClientModule.begin_round, which the platform owns",
        ),
        ("eval_probe", PersonalEvalClient, "overrides load_for_eval, which eval_mode='global' never calls"),
        ("mode_probe", ModeClient, "ModeClient.eval_mode='personal': must be one of ('global', 'own')"),
    ],
)
def test_a_class_that_breaks_a_rule_is_refused_when_its_algorithm_is_looked_up(name, client, rule):
    with pytest.raises(ContractError) as err:
        get(probe(name, client))
    assert rule in one_line(err)


def test_the_cli_refuses_it_before_anything_starts(capsys):
    from fedray.platform.apps.cli import main

    assert main(["run", *tiny_overrides(algorithm=probe("round_probe", RoundClient))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "fedray: error: algorithm 'round_probe': RoundClient overrides ClientModule.begin_round"
    )
    assert "\n" not in err


@register("averaging_probe", server=FedAvgServer, client=FedAvgClient)
@dataclass
class AveragingConfig(AlgorithmConfig):
    WHOLE_MODEL = True  # averages whole models: one architecture for every client


def test_model_needs_are_checked_when_the_config_is_built_before_ray():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm=averaging_probe", "model.group=fedssa_cnns"])
    assert "averaging_probe" in one_line(err) and "heterogeneous" in str(err.value)

    class FeatureServer(Server):  # reads the feature size without declaring SHARED_FEATURES
        def __init__(self, ctx):
            super().__init__(ctx)
            self.dim = ctx.feature_dim

    with pytest.raises(ContractError) as err:
        FeatureServer(server_ctx(algorithm="averaging_probe"))
    assert "reads ServerContext.feature_dim without declaring it" in one_line(err)


def test_scaled_fields_listed_by_name_are_refused_at_definition():
    with pytest.raises(ContractError) as err:

        @dataclass
        class OldStyle(AlgorithmConfig):
            ROUND_FIELDS = ("warmup",)
            warmup: int = 5

    assert "OldStyle.ROUND_FIELDS: declare each scaled field with round_count()" in one_line(err)


# ------------------------------------------------------------------ what a running client shows: first client


class ForgotReceiveClient(ClientModule):
    """Overrides receive without calling super(): the downlink's model is never loaded."""

    def receive(self, rnd, payload):
        self.lr_scale = 1.0


class PlainTensorClient(ClientModule):
    """Keeps what came down as a plain attribute: on a GPU it stays on the CPU and the step fails."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = [p.detach().clone() for p in self.model.parameters()]


@dataclass
class Anchor:
    """A third-party algorithm's own record of what came down."""

    weights: list
    round: int = 0


class DataclassTensorClient(ClientModule):
    """Keeps the downlink's weights inside a dataclass instance of its own."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = Anchor([p.detach().clone() for p in self.model.parameters()], rnd)


class SetTensorClient(ClientModule):
    """Keeps them in a set (tensors hash by identity)."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = {p.detach().clone() for p in self.model.parameters()}


class FrozensetTensorClient(ClientModule):
    """Keeps them in a frozenset."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = frozenset(p.detach().clone() for p in self.model.parameters())


class DeepTensorClient(ClientModule):
    """Keeps them three containers down: a dict of lists of lists."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor = {"round": rnd, "layers": [[p.detach().clone()] for p in self.model.parameters()]}


class CyclicTensorClient(ClientModule):
    """Keeps a record that points back at itself before it gets to the weights."""

    def receive(self, rnd, payload):
        super().receive(rnd, payload)
        self.anchor: dict = {"previous": None}
        self.anchor["previous"] = self.anchor
        self.anchor["weights"] = [[p.detach().clone() for p in self.model.parameters()]]


def first_client(algorithm: str):
    _, fed, host = host_for(algorithm=algorithm, **{"train.local_epochs": 1})
    state = {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}
    return lambda: host.train(0, [ClientTask(0, [fed.shards[0]])], [[{"model": state}]])


def test_a_downlink_key_receive_never_reads_is_refused_on_the_first_client():
    with pytest.raises(ContractError) as err:
        first_client(probe("forgot_probe", ForgotReceiveClient))()
    assert one_line(err) == (
        "algorithm 'forgot_probe': ForgotReceiveClient.receive never read downlink key 'model' (call "
        "super().receive(rnd, payload), which loads it)"
    )


class AliasingClient(ClientModule):
    """Loads the downlink as ``vector_to_parameters`` does a flat one: each parameter's ``.data``
    set to the downlink's tensor, so training writes into the downlink the worker's next client
    gets, and ``.data`` hides it from the version check."""

    def receive(self, rnd, payload):
        for name, param in self.model.named_parameters():
            param.data = payload["model"][name]


def test_parameters_that_share_memory_with_the_downlink_are_refused():
    with pytest.raises(ContractError) as err:
        first_client(probe("aliasing_probe", AliasingClient))()
    assert one_line(err).startswith(
        "algorithm 'aliasing_probe': AliasingClient.model."
    ) and "shares memory with the downlink after receive (vector_to_parameters or .data =" in one_line(err)


def test_a_flat_downlink_loaded_by_vector_to_parameters_is_refused_and_a_copy_or_a_held_one_is_not():
    _, fed, host = host_for(**{"train.local_epochs": 1})
    module = host.module(ClientTask(0, [fed.shards[0]]))
    params = list(module.model.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach().clone()
    payload = {"x": flat, "mask": torch.ones(3).to_sparse()}  # a sparse tensor has no storage to share
    module.hold("x", payload["x"])  # a held tensor may be the downlink's: training does not write it
    check_parameters_apart("probe", module, storages(payload), "after receive")
    torch.nn.utils.vector_to_parameters(payload["x"], params)  # every parameter a view, at an offset
    with pytest.raises(ContractError) as err:
        check_parameters_apart("probe", module, storages(payload), "after training")
    assert "shares memory with the downlink after training" in one_line(err)
    with torch.no_grad():  # what the line says to do instead
        for param, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
            param.data = torch.empty_like(param)
            param.copy_(part.view_as(param))
    check_parameters_apart("probe", module, storages(payload), "after receive")


def test_a_tensor_kept_outside_hold_is_refused_on_the_first_client():
    with pytest.raises(ContractError) as err:
        first_client(probe("plain_probe", PlainTensorClient))()
    assert "PlainTensorClient keeps a tensor in the plain attribute self.anchor" in one_line(err)
    assert "self.hold('anchor', value)" in str(err.value)


@pytest.mark.parametrize(
    ("name", "client"),
    [
        ("dataclass_probe", DataclassTensorClient),
        ("set_probe", SetTensorClient),
        ("frozenset_probe", FrozensetTensorClient),
        ("deep_probe", DeepTensorClient),
        ("cyclic_probe", CyclicTensorClient),
    ],
)
def test_a_tensor_kept_in_any_container_outside_hold_is_refused(name, client):
    """However the plain attribute holds it: a dataclass's field, a set, a frozenset, nested lists and
    dicts, a structure that refers back to itself."""
    with pytest.raises(ContractError) as err:
        first_client(probe(name, client))()
    assert f"{client.__name__} keeps a tensor in the plain attribute self.anchor" in one_line(err)


def test_the_held_tensor_walk_ends_on_cycles_and_depth():
    cycle: list = [1, {"x": 2.0}]
    cycle.append(cycle)
    assert not holds_tensor(cycle)
    shared = [list(range(100))] * 100
    assert not holds_tensor([shared] * 100)  # each container walked once, not once per path
    deep: list = [torch.zeros(1)]
    for _ in range(10_000):
        deep = [deep]
    assert not holds_tensor(deep)  # past HELD_DEPTH levels: not looked for, and no RecursionError


def test_a_client_that_keeps_the_rules_passes_both_checks():
    first_client("fedavg")()  # the default receive reads the model and holds nothing in plain attributes


# ------------------------------------------------------------------ the server's declarations


def server_ctx(**settings) -> ServerContext:
    cfg = load_config(None, tiny_overrides(**settings))
    return ServerContext(cfg, 4, 10, ["cnn_small"] * 4, lambda cid: torch.nn.Linear(2, 2))  # type: ignore[arg-type,return-value]


def test_an_uplink_without_a_key_the_server_reads_is_named():
    server = FedAvgServer(server_ctx())
    with pytest.raises(ContractError) as err:
        check_uplinks("fedcross_like", server, {0: {"model": {}, "num_samples": 3}, 2: {"model": {}}})
    assert one_line(err) == (
        "algorithm 'fedcross_like': client 2's uplink lacks 'num_samples', which FedAvgServer declares it reads "
        "(uplink_keys: ['model', 'num_samples'])"
    )
    with pytest.raises(
        ContractError, match="client 0's uplink carries 'extra', which FedAvgServer does not declare"
    ):
        check_uplinks("x", server, {0: {"model": {}, "num_samples": 3, "extra": 1}})


class ModelOnlyClient(FedAvgClient):
    """Uploads its model without the sample count FedAvg's aggregate weights by."""

    def upload(self):
        return {"model": super().upload()["model"]}


# registered at import: Ray's processes import this module when they unpickle the run's config
@register("modelonly_probe", server=FedAvgServer, client=ModelOnlyClient)
@dataclass
class ModelOnlyConfig(AlgorithmConfig):
    pass


def test_a_run_whose_uplinks_lack_a_declared_key_ends_in_its_first_round_with_one_line(
    ray_session, mlflow_store
):
    with pytest.raises(ContractError) as err:
        run_experiment(load_config(None, tiny_overrides(algorithm="modelonly_probe", rounds=2)))
    assert "algorithm 'modelonly_probe': client " in one_line(err)
    assert "uplink lacks 'num_samples', which FedAvgServer declares it reads" in str(err.value)


class BrokenStepClient(FedAvgClient):
    """Every training step fails, as FedProto's did on a GPU (a device mismatch)."""

    def training_step(self, batch, batch_idx):
        raise ValueError("Expected all tensors to be on the same device")


@register("brokenstep_probe", server=FedAvgServer, client=BrokenStepClient)  # at import, as above
@dataclass
class BrokenStepConfig(AlgorithmConfig):
    pass


def test_a_round_in_which_every_client_failed_ends_the_run_with_one_line(ray_session, mlflow_store, tmp_path):
    # before: the run went on aggregating nothing, finished, and logged its untrained accuracy
    with pytest.raises(RunAborted) as err:
        run_experiment(load_config(None, tiny_overrides(algorithm="brokenstep_probe", rounds=3)))
    line = one_line(err)
    # the client's error names its type and the line of the algorithm's code that raised it
    where = f"tests/test_contract_rules.py:{BrokenStepClient.training_step.__code__.co_firstlineno + 1}"
    assert line.startswith("round 1: all ") and (
        f"selected clients failed (client 0: ValueError: Expected all tensors to be on the same device "
        f"(at {where} in training_step))" in line
    )
    assert "fedray run --resume " in line
    client, run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    # its traceback, once: every client failed alike. With the first failure to reach the Coordinator,
    # which on two workers need not be the one the line names (the lowest client's)
    (logged,) = client.list_artifacts(run.info.run_id, "failures")
    assert re.fullmatch(r"failures/round-0001-client-\d+\.txt", logged.path), logged.path
    text = Path(client.download_artifacts(run.info.run_id, logged.path)).read_text()
    assert text.startswith("ValueError: Expected all tensors") and "Traceback (most recent call last)" in text
    assert f'{where.split(":")[0]}", line {where.split(":")[1]}, in training_step' in text


class BrokenAggregateServer(FedAvgServer):
    """Its aggregate fails (a typo in a server's own state): before, a 63-line Ray traceback."""

    def aggregate(self, rnd, uplinks):
        raise KeyError("momentum")


@register("brokenaggregate_probe", server=BrokenAggregateServer, client=FedAvgClient)  # at import, as above
@dataclass
class BrokenAggregateConfig(AlgorithmConfig):
    pass


def test_a_server_whose_code_raises_ends_the_run_with_one_line(ray_session, mlflow_store, tmp_path):
    with pytest.raises(RunAborted) as err:
        run_experiment(load_config(None, tiny_overrides(algorithm="brokenaggregate_probe", rounds=3)))
    line = one_line(err)
    where = f"tests/test_contract_rules.py:{BrokenAggregateServer.aggregate.__code__.co_firstlineno + 1}"
    assert line.startswith(
        f"round 1: BrokenAggregateServer.aggregate failed: KeyError: 'momentum' (at {where} in aggregate)"
    ), line
    assert "fedray run --resume " in line
    client, run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    (logged,) = client.list_artifacts(run.info.run_id, "failures")
    assert logged.path == "failures/round-0001-server-aggregate.txt"
    text = Path(client.download_artifacts(run.info.run_id, logged.path)).read_text()
    assert "Traceback (most recent call last)" in text and "in aggregate" in text


class BrokenConfigureServer(FedAvgServer):
    def configure(self, rnd, selected):
        raise IndexError("no such client")


class BrokenEvalPayloadServer(FedAvgServer):
    def eval_payload(self):
        if self.rounds_done:  # set-up's check of the payload passes; the first evaluation's call fails
            raise AttributeError("no global model yet")
        return super().eval_payload()

    def aggregate(self, rnd, uplinks):
        super().aggregate(rnd, uplinks)
        self.rounds_done = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.rounds_done = False

    STATE = (*FedAvgServer.STATE, "rounds_done")


# registered at import, as above: a run's processes import this module to unpickle the config
@register("brokenconfigure_probe", server=BrokenConfigureServer, client=FedAvgClient)
@dataclass
class BrokenConfigureConfig(AlgorithmConfig):
    pass


@register("brokenevalpayload_probe", server=BrokenEvalPayloadServer, client=FedAvgClient)
@dataclass
class BrokenEvalPayloadConfig(AlgorithmConfig):
    pass


@pytest.mark.parametrize(
    ("algorithm", "method", "error"),
    [
        ("brokenconfigure_probe", "configure", "IndexError: no such client"),
        ("brokenevalpayload_probe", "eval_payload", "AttributeError: no global model yet"),
    ],
)
def test_every_server_method_that_raises_ends_the_run_with_its_line(
    ray_session, mlflow_store, algorithm, method, error
):
    with pytest.raises(RunAborted) as err:
        run_experiment(load_config(None, tiny_overrides(algorithm=algorithm, rounds=2)))
    line = one_line(err)
    assert line.startswith("round 1: "), line
    assert f"Server.{method} failed: {error}" in line and "in " + method in line, line


class GlobalDrawServer(FedAvgServer):
    """Shifts the global model by draws from numpy's and Python's global generators, not a named
    stream: the numbers must still depend on (seed, round) only, not on what the process ran before."""

    def aggregate(self, rnd, uplinks):
        super().aggregate(rnd, uplinks)
        with torch.no_grad():
            bias = self.model.head.bias  # a shift per class: one for all would leave every softmax as it was
            bias.add_(torch.from_numpy(np.random.rand(len(bias))).to(bias.dtype) + random.random())


@register("globaldraw_probe", server=GlobalDrawServer, client=FedAvgClient)  # at import, as above
@dataclass
class GlobalDrawConfig(AlgorithmConfig):
    pass


def test_a_servers_draws_from_numpys_global_generator_repeat_in_a_kept_coordinator(ray_session, mlflow_store):
    # the second run's Coordinator is the first's (kept), its generators as the first run left them
    cfg = load_config(None, tiny_overrides(algorithm="globaldraw_probe", rounds=2))
    first, second = run_experiment(cfg), run_experiment(cfg)
    assert first.last(Metrics.LOSS_GLOBAL) == second.last(Metrics.LOSS_GLOBAL)


class BrokenEvalClient(FedAvgClient):
    """Trains as FedAvg's client does; its own evaluation always fails (a typo in eval_logits)."""

    eval_mode = "own"

    def eval_logits(self, x):
        raise KeyError("logits")


@register("brokeneval_probe", server=FedAvgServer, client=BrokenEvalClient)  # at import, as above
@dataclass
class BrokenEvalConfig(AlgorithmConfig):
    pass


def test_a_round_whose_every_client_evaluation_failed_ends_the_run_with_one_line(
    ray_session, mlflow_store, tmp_path
):
    # before: the run trained to its end, each round's personalised metrics missing, and FINISHED
    with pytest.raises(RunAborted) as err:
        run_experiment(load_config(None, tiny_overrides(algorithm="brokeneval_probe", rounds=3)))
    line = one_line(err)
    where = f"tests/test_contract_rules.py:{BrokenEvalClient.eval_logits.__code__.co_firstlineno + 1}"
    assert line.startswith("round 1: all "), line
    assert (
        f"client evaluation jobs failed (evaluation from client 0: KeyError: 'logits' (at {where} in eval_logits))"
        in line
    )
    assert "fedray run --resume " in line
    client, run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    (logged,) = client.list_artifacts(run.info.run_id, "failures")  # the first to arrive, as above
    assert re.fullmatch(r"failures/round-0001-evaluation-from-client-\d+\.txt", logged.path), logged.path
    text = Path(client.download_artifacts(run.info.run_id, logged.path)).read_text()
    assert text.startswith("KeyError: 'logits'") and "Traceback (most recent call last)" in text
    assert f'{where.split(":")[0]}", line {where.split(":")[1]}, in eval_logits' in text


class Counter(FedAvgServer):
    STATE = (*FedAvgServer.STATE, "count")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.count = 0


def test_server_state_is_declared_and_a_checkpoint_with_other_keys_is_refused():
    ctx = server_ctx()
    undeclared = type("Undeclared", (FedAvgServer,), {})(ctx)
    undeclared.seen = {1: 2}  # type: ignore[attr-defined]
    with pytest.raises(ContractError) as err:
        undeclared.state_dict()
    assert "algorithm 'fedavg': Undeclared.seen is not in Undeclared.STATE" in one_line(err)

    saved = Counter(ctx).state_dict()
    renamed = type("Renamed", (FedAvgServer,), {"STATE": (*FedAvgServer.STATE, "rounds_seen")})(ctx)
    with pytest.raises(CheckpointError) as err:
        renamed.load_state_dict(saved)
    assert one_line(err) == (
        "the checkpoint's server state has no 'rounds_seen', which Renamed.STATE declares (it was saved by "
        "another version of the algorithm)"
    )
    Counter(ctx).load_state_dict(saved)  # the same declaration loads


class OwnEval(ClientModule):
    eval_mode = "own"


def test_global_evaluation_needs_a_model_in_the_payload():
    assert global_model_evaluation(ClientModule, {"model": {}})
    assert not global_model_evaluation(OwnEval, {"model": {}})
    assert not global_model_evaluation(ClientModule, None)
    with pytest.raises(ContractError) as err:
        global_model_evaluation(ClientModule, {"header": torch.zeros(2)})
    assert "ClientModule.eval_mode is 'global', but the server's eval_payload has no 'model'" in one_line(err)


class HeaderOnlyServer(Server):
    def eval_payload(self):
        return {"header": torch.zeros(2)}


def test_a_global_evaluation_without_a_model_is_refused_when_the_run_is_set_up():
    """The Coordinator's set-up asks the server for its evaluation payload: the line comes before any
    round trains, not at the first evaluation."""
    server = HeaderOnlyServer(server_ctx())
    with pytest.raises(ContractError) as err:
        check_evaluable("header_only", ClientModule, True, server)
    assert "ClientModule.eval_mode is 'global', but the server's eval_payload has no 'model'" in one_line(err)
    check_evaluable("header_only", OwnEval, True, server)  # a client tested with its own module
    check_evaluable("fedavg", FedAvgClient, False, FedAvgServer(server_ctx()))


def stats_server() -> Server:
    return Server(ServerContext(load_config(None, []), 2, 2, ["a", "a"], lambda cid: None))  # type: ignore[arg-type]


def test_a_servers_statistics_are_the_rounds_means_and_leave_no_state_behind():
    server = stats_server()
    server.record("algo/loss", torch.tensor(2.0))
    server.record("algo/loss", 4)
    server.record("algo/kept", 1.5)
    server.state_dict()  # recorded but not yet popped: not an attribute a checkpoint must keep
    assert server.pop_stats() == {"algo/loss": 3.0, "algo/kept": 1.5}
    assert server.pop_stats() == {}  # the next round starts from none


@pytest.mark.parametrize("value", [torch.ones(2), "high", True, None])
def test_a_server_statistic_that_is_not_one_number_is_one_line(value):
    with pytest.raises(ContractError, match="Server: statistic 'algo/x' must be one number") as info:
        stats_server().record("algo/x", value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("loss/train", "a client statistic"),
        ("acc/global", "a platform metric"),
        ("time/generator_s", "a platform metric"),
    ],
)
def test_a_server_statistic_may_not_take_a_name_the_round_already_logs(name, taken):
    server = stats_server()
    server.record(name, 1.0)
    with pytest.raises(ContractError, match=f"records '{name}', which is {taken} of the round") as info:
        server_stats("probe", server, {"loss/train": 0.5})
    assert "\n" not in str(info.value)
    server.record("probe/generator_loss", 1.0)
    assert server_stats("probe", server, {"loss/train": 0.5}) == {"probe/generator_loss": 1.0}
