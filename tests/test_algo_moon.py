"""MOON's model-contrastive loss and client, checked against hand and independent computations; no Ray.

The client's model has BatchNorm in its extractor, so that a frozen representation computed in
training mode (batch statistics) or one that updated the stored statistics would be caught."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.fedavg import FedAvgServer
from fedray.algorithms.moon import MoonClient, model_contrastive_loss
from fedray.platform.api import registry
from fedray.platform.api.algorithm import ClientContext
from fedray.platform.api.frozen import flat_state, state_views
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import FedModel
from fedray.platform.runtime.local_training import LocalTraining

Y = torch.tensor([0, 0, 2, 1])


def test_the_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[2.0, 0.0], [1.0, 0.0]])  # cosines 1 and 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, -1.0]])  # cosines 0 and -1
    tau = 0.5
    # -log(e^{a/tau} / (e^{a/tau} + e^{b/tau})) = log(1 + e^{(b - a)/tau})
    first = math.log(1 + math.exp((0 - 1) / tau))
    second = math.log(1 + math.exp((-1 - 1 / math.sqrt(2)) / tau))
    assert_close(model_contrastive_loss(z, z_glob, z_prev, tau), torch.tensor((first + second) / 2))
    # the same representation as the global one and far from the previous: the loss falls with tau
    assert model_contrastive_loss(z, z_glob, z_prev, 0.1) < model_contrastive_loss(z, z_glob, z_prev, tau)


def bn_model(seed: int) -> FedModel:
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3))
    return FedModel(features, 3, 3, arch="flat_bn", in_channels=1, image_size=2)


def make_client(*overrides: str) -> MoonClient:
    cfg = load_config(
        None,
        ["algorithm=moon", "train.batch_size=4", "train.lr=0.1", "train.momentum=0", "moon.mu=2", *overrides],
    )
    return MoonClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))


def independent_loss(client: MoonClient, global_state: dict, previous_features: nn.Module) -> torch.Tensor:
    """CE + mu * l_con from copies of the extractor: the global one and the previous one as nn.Modules
    in eval mode; the live one in training mode, as the step sees it."""
    live = copy.deepcopy(client.model)
    glob = copy.deepcopy(client.model.features)
    glob.load_state_dict(
        {k[len("features.") :]: v for k, v in global_state.items() if k.startswith("features.")}
    )
    glob.eval(), previous_features.eval()
    with torch.no_grad():
        z_glob, z_prev = glob(X), previous_features(X)
    z = live.features(X)
    ce = F.cross_entropy(live.head(z), Y)
    cos = F.cosine_similarity
    logits = torch.stack([cos(z, z_glob, dim=1), cos(z, z_prev, dim=1)], dim=1) / 0.5
    return ce + 2.0 * F.cross_entropy(logits, torch.zeros(4, dtype=torch.long))


def test_the_first_round_is_cross_entropy_alone_and_the_next_contrasts_with_the_last_trained_extractor():
    client = make_client("train.local_epochs=2")
    loop = LocalTraining(client.ctx.cfg.train, torch.device("cpu"))
    # round 0: no previous model yet
    global0 = bn_model(1).state_dict()
    client.begin_round(0, {"model": global0})
    assert_close(client.training_step((X, Y), 0), F.cross_entropy(client.model(X), Y))
    assert "loss/contrastive" not in client.pop_stats()
    loop.fit(client, 2)
    trained0 = copy.deepcopy(client.model.features)  # z_prev's extractor from now on
    assert torch.equal(client.previous, flat_state(trained0)) and bool(client.has_previous)
    state = client.state_dict()
    assert {"previous", "has_previous"} <= set(
        state
    ) and "global_features" not in state  # what a checkpoint keeps
    assert set(client.upload()) == {"model", "num_samples"}  # FedAvg's uplink

    # round 1: another global model; the step is CE + mu * l_con against it and the round-0 extractor
    global1 = bn_model(2).state_dict()
    for key in ("features.2.running_mean", "features.2.running_var"):  # statistics unlike a batch's
        global1[key] = torch.rand(3) + 0.5
    client.begin_round(1, {"model": global1})
    previous_before = client.previous.clone()
    loss = client.training_step((X, Y), 0)
    assert_close(loss, independent_loss(client, global1, trained0))
    assert "loss/contrastive" in client.pop_stats()
    # the frozen passes changed nothing: the stored states, the live BatchNorm's statistics and modes
    assert torch.equal(client.previous, previous_before)
    assert all(m.training for m in client.model.modules())
    assert torch.equal(
        state_views(client.global_features, client.model.features)["2.running_mean"],
        global1["features.2.running_mean"],
    )
    loss.backward()  # gradients reach the live model only
    assert client.model.features[1].weight.grad is not None and not client.previous.requires_grad


def test_a_client_that_did_not_train_keeps_its_previous_extractor():
    client = make_client()
    client.begin_round(0, {"model": bn_model(1).state_dict()})
    assert not bool(client.has_previous) and torch.equal(client.previous, torch.zeros_like(client.previous))


def test_the_server_is_fedavgs():
    assert registry.get("moon").server_cls is FedAvgServer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["moon.mu=-1"], "moon.mu=-1.0: must be >= 0"), (["moon.tau=0"], "moon.tau=0.0: must be > 0")],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=moon", *overrides])


def test_a_round_without_training_keeps_the_last_trained_extractor_and_a_reload_keeps_it_too():
    client = make_client()
    loop = LocalTraining(client.ctx.cfg.train, torch.device("cpu"))
    client.begin_round(0, {"model": bn_model(1).state_dict()})
    loop.fit(client, 1)
    trained0 = flat_state(client.model.features)
    client.begin_round(1, {"model": bn_model(2).state_dict()})  # selected, but no step (local_epochs 0)
    client.upload()
    assert torch.equal(client.previous, trained0)
    # the state a worker commits, loaded into a module built afresh (another worker, a resumed run)
    rebuilt = make_client()
    rebuilt.load_state_dict(client.state_dict())
    assert torch.equal(rebuilt.previous, trained0) and bool(rebuilt.has_previous)
    rebuilt.begin_round(2, {"model": bn_model(3).state_dict()})
    assert rebuilt.contrast  # round 2 contrasts with the extractor of round 0
    assert "loss/contrastive" not in rebuilt.pop_stats()
    rebuilt.training_step((X, Y), 0)
    assert "loss/contrastive" in rebuilt.pop_stats()
