"""FedNH's prototypes, scores, smoothed update, server and client, against hand and independent
computations without Ray; and the worker testing FedNH's global model by its scores, in process."""

import copy
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
from in_process import client_task
from test_algo_fedproto import X
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fednh import (
    FedNHClient,
    FedNHServer,
    client_prototypes,
    cosine_scores,
    initial_prototypes,
    smoothed_prototypes,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext, sample_clients
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import arch_for_client
from fedray.platform.runtime.coordinator import build_server
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.worker import ClientHost

Y = torch.tensor([0, 0, 2, 2])  # class 1 absent from this client


def test_the_initial_prototypes_are_orthonormal_rows_drawn_from_the_generator():
    p = initial_prototypes(4, 6, torch.Generator().manual_seed(0))
    assert_close(p @ p.T, torch.eye(4))
    assert torch.equal(p, initial_prototypes(4, 6, torch.Generator().manual_seed(0)))
    assert not torch.equal(p, initial_prototypes(4, 6, torch.Generator().manual_seed(1)))
    wide = initial_prototypes(5, 3, torch.Generator().manual_seed(0))  # more classes than dimensions
    assert_close(wide.norm(dim=1), torch.ones(5))


def test_scores_are_the_scale_times_the_cosine_with_each_prototype():
    z = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    # z_hat = [0.6, 0.8] and [0, -1]
    expected = 2.0 * torch.tensor([[0.6, 0.8, 1.0], [0.0, -1.0, -0.8]])
    assert_close(cosine_scores(z, prototypes, torch.tensor(2.0)), expected)


def test_a_clients_prototype_is_the_unit_mean_of_its_unit_representations():
    z = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, 0.0 + 1.0], [-3.0, 0.0]])
    y = torch.tensor([0, 0, 2, 2])
    protos, counts = client_prototypes(z, y, 3)
    # class 0: mean of [1, 0] and [0, 1] = [0.5, 0.5] -> [1, 1]/sqrt(2); class 2: [0, 1], [-1, 0]
    r = 1 / math.sqrt(2)
    assert_close(protos, torch.tensor([[r, r], [0.0, 0.0], [-r, r]]))
    assert torch.equal(counts, torch.tensor([2, 0, 2]))


def test_the_smoothed_update_by_hand_and_a_class_nobody_held_keeps_its_prototype():
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    r = 1 / math.sqrt(2)
    uploads = torch.tensor(
        [
            [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]],  # client 0: class 0 only, 3 samples
            [[r, r], [0.0, 0.0], [0.0, 0.0]],  # client 1: class 0, 1 sample (class 1: no one)
        ]
    )
    counts = torch.tensor([[3.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    got = smoothed_prototypes(prototypes, uploads, counts, rho=0.5)
    # class 0: 3 [0, 1] + 1 [r, r] = [r, 3 + r] -> unit u; then normalize(0.5 [1, 0] + 0.5 u)
    u = torch.tensor([r, 3 + r]) / math.hypot(r, 3 + r)
    mixed = 0.5 * torch.tensor([1.0, 0.0]) + 0.5 * u
    assert_close(got[0], mixed / mixed.norm())
    assert torch.equal(got[1:], prototypes[1:])
    assert_close(smoothed_prototypes(prototypes, uploads, counts, rho=0.0)[0], u)  # no memory: the mean


def server_of(*overrides: str) -> FedNHServer:
    cfg = load_config(None, ["algorithm=fednh", "fednh.rho=0.5", *overrides])
    return FedNHServer(ServerContext(cfg, 2, 3, ["flat_bn"] * 2, lambda cid: bn_model(cid)))


def test_the_server_averages_models_unweighted_and_writes_the_mean_scale_times_the_new_prototypes():
    server = server_of("fednh.scale_init=2")
    p0 = server.prototypes.clone()
    assert_close(server.model.head.weight, 2 * p0) and torch.equal(server.model.head.bias, torch.zeros(3))
    states = []
    for k, scale in enumerate((1.0, 4.0)):
        model = bn_model(10 + k)
        with torch.no_grad():
            model.head.weight.copy_(scale * p0)
            model.head.bias.zero_()
        states.append({n: v.clone() for n, v in model.state_dict().items()})
    uplinks = {
        0: {"model": states[0], "classes": torch.tensor([0]), "protos": torch.tensor([[0.0, 1, 0]]), "counts": torch.tensor([3])},
        1: {"model": states[1], "classes": torch.tensor([0, 2]), "protos": torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]), "counts": torch.tensor([1, 2])},
    }  # fmt: skip
    server.aggregate(0, uplinks)
    key = "features.1.weight"
    assert_close(
        server.model.state_dict()[key], (states[0][key] + states[1][key]) / 2
    )  # 1 and 9 samples: equal
    uploads = torch.zeros(2, 3, 3)
    uploads[0, 0], uploads[1, 0], uploads[1, 2] = (
        torch.tensor([0.0, 1, 0]),
        torch.tensor([1.0, 0, 0]),
        torch.tensor([0, 0, 1.0]),
    )
    expected = smoothed_prototypes(p0, uploads, torch.tensor([[3.0, 0, 0], [1.0, 0, 2.0]]), 0.5)
    assert_close(server.prototypes, expected)
    assert torch.equal(server.prototypes[1], p0[1])  # class 1: no one held it
    assert_close(server.model.head.weight, 2.5 * expected)  # the mean scale (1 + 4) / 2
    assert torch.equal(server.model.head.bias, torch.zeros(3))
    assert set(server.state_dict()) == {"model", "prototypes"}


def make_client(*overrides: str) -> FedNHClient:
    cfg = load_config(None, ["algorithm=fednh", "train.batch_size=4", *overrides])
    return FedNHClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))


def test_the_client_trains_the_extractor_and_scale_on_cosine_scores_with_the_prototypes_frozen():
    server = server_of("fednh.scale_init=1.5")
    client = make_client()
    client.begin_round(0, server.configure(0, [0])[0])
    assert_close(client.prototypes, server.prototypes) and float(client.scale) == pytest.approx(1.5)
    loss = client.training_step((X, Y), 0)
    z = copy.deepcopy(client.model.features)(X)
    expected = F.cross_entropy(1.5 * F.normalize(z, dim=1) @ server.prototypes.T, Y)
    assert_close(loss, expected)
    loss.backward()
    assert client.scale.grad is not None and client.model.features[1].weight.grad is not None
    assert client.model.head.weight.grad is None and not client.prototypes.requires_grad  # frozen
    # a trained scale goes up in the head, beside the prototypes of the classes held
    with torch.no_grad():
        client.scale.fill_(2.5)
    up = client.upload()
    assert_close(up["model"]["head.weight"], 2.5 * server.prototypes)
    assert torch.equal(up["classes"], torch.tensor([0, 2])) and torch.equal(
        up["counts"], torch.tensor([2, 2])
    )
    client.model.eval()
    expected_protos, _ = client_prototypes(client.model.features(X).detach(), Y, 3)
    assert_close(up["protos"], expected_protos[[0, 2]])


def test_the_scale_stays_put_when_it_is_not_learned():
    client = make_client("fednh.learn_scale=false")
    server = server_of()
    client.begin_round(0, server.configure(0, [0])[0])
    client.training_step((X, Y), 0).backward()
    assert client.scale.grad is None


def test_a_fednh_models_scores_are_its_head_on_unit_features_and_rank_as_its_forward_pass():
    server = server_of("fednh.scale_init=3")
    scores = FedNHClient.model_scores(server.model.eval(), X)
    z = server.model.features(X)
    assert_close(scores, cosine_scores(z, server.prototypes, torch.tensor(3.0)))
    assert torch.equal(scores.argmax(1), server.model(X).argmax(1))
    assert not torch.allclose(scores, server.model(X))  # the loss differs: why the worker asks for scores


def test_the_worker_tests_the_global_model_by_fednhs_scores():
    cfg = load_config(
        None,
        ["algorithm=fednh", "data.num_clients=3", "train.local_epochs=1", "fednh.scale_init=4", "seed=1"],
    )
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    host = ClientHost(cfg, num_threads=1)
    host.setup(meta)
    server = build_server(cfg, meta)
    with tempfile.TemporaryDirectory() as states:
        selected = sample_clients(cfg.seed, 0, 3, clients_per_round(cfg))
        payloads = server.configure(0, selected)
        tasks = [client_task(c, fed.shards[c], states) for c in selected]
        results = host.train(0, tasks, [[payloads[c]] for c in selected])
        server.aggregate(0, {r.client: r.uplink for r in results})
        model = server.global_model().eval()
        arch = arch_for_client(cfg.model.group, 0)

        def by_scores(x, y):
            with torch.no_grad():
                scores = FedNHClient.model_scores(model, x)
            return (
                int((scores.argmax(1) == y).sum()),
                len(y),
                float(F.cross_entropy(scores, y, reduction="sum")),
            )

        test = fed.global_test
        correct, total, loss = host.evaluate_chunks(arch, server.model.state_dict(), {0: [test]})[0][1:]
        x = host.on_device(test.x)  # normalised, as the worker tests it
        want = by_scores(x, test.y)
        assert (correct, total) == want[:2] and loss == pytest.approx(want[2], rel=1e-5)
        with torch.no_grad():  # the plain forward pass would report another loss
            assert float(F.cross_entropy(model(x), test.y, reduction="sum")) != pytest.approx(loss, rel=1e-3)
        for cid, correct, total, loss in host.evaluate(tasks, server.eval_payload()):
            data = host.client_data(tasks[selected.index(cid)])
            want = by_scores(data.test_x, data.test_y)
            assert (correct, total) == want[:2] and loss == pytest.approx(want[2], rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fednh.rho=1"], r"fednh.rho=1.0: must be in \[0, 1\)"),
        (["fednh.scale_init=0"], "fednh.scale_init=0.0: must be > 0"),
        (["model.group=small_hetero"], "fednh"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fednh", *overrides])


def test_a_negative_mean_scale_keeps_its_sign_and_a_reloaded_server_keeps_the_prototypes():
    server = server_of()
    p0 = server.prototypes.clone()
    model = bn_model(10)
    with torch.no_grad():
        model.head.weight.copy_(-2.0 * p0)  # a client whose learned scale went negative: the same scores
        model.head.bias.zero_()
    up = {
        "model": model.state_dict(),
        "classes": torch.tensor([0]),
        "protos": p0[:1],
        "counts": torch.tensor([1]),
    }
    server.aggregate(0, {0: up})
    assert_close(server.model.head.weight, -2.0 * server.prototypes)  # not turned around to +2 P
    resumed = server_of()
    resumed.load_state_dict(server.state_dict())
    assert torch.equal(resumed.prototypes, server.prototypes)
    client = make_client()
    client.begin_round(1, resumed.configure(1, [0])[0])
    z = client.model.features(X)
    assert_close(
        cosine_scores(z, client.prototypes, client.scale), -2.0 * F.normalize(z, dim=1) @ server.prototypes.T
    )
