"""FedGH's server training of the global header and its client's prototypes, against hand and
independent computations; no Ray."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedgh import FedGHClient, FedGHServer, train_header
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError

Y = torch.tensor([0, 0, 2, 2])  # class 1 absent from this client


def hand_sgd_step(rows: torch.Tensor, protos: torch.Tensor, labels: torch.Tensor, lr: float) -> torch.Tensor:
    """One full-batch SGD step on the mean cross-entropy of a linear header, from the closed-form
    gradient d/dlogits = (softmax - onehot) / M."""
    d = rows.shape[1] - 1
    w, b = rows[:, :d], rows[:, d]
    residual = (torch.softmax(protos @ w.T + b, dim=1) - F.one_hot(labels, rows.shape[0]).float()) / len(
        labels
    )
    return torch.cat([w - lr * residual.T @ protos, (b - lr * residual.sum(0))[:, None]], dim=1)


def test_the_header_takes_sgd_steps_on_the_prototypes():
    gen = torch.Generator().manual_seed(0)
    rows, protos = torch.randn(3, 5, generator=gen), torch.randn(4, 4, generator=gen)
    labels = torch.tensor([0, 2, 2, 1])
    # one batch holding every prototype: the order drawn does not matter
    one = train_header(rows, protos, labels, lr=0.5, epochs=1, batch=8, gen=torch.Generator().manual_seed(1))
    assert_close(one, hand_sgd_step(rows, protos, labels, 0.5))
    two = train_header(rows, protos, labels, lr=0.5, epochs=2, batch=8, gen=torch.Generator().manual_seed(1))
    assert_close(two, hand_sgd_step(hand_sgd_step(rows, protos, labels, 0.5), protos, labels, 0.5))
    # batches of 2: two steps an epoch, on the halves of the drawn order
    order = torch.randperm(4, generator=torch.Generator().manual_seed(7))
    expected = rows
    for part in order.split(2):
        expected = hand_sgd_step(expected, protos[part], labels[part], 0.5)
    halves = train_header(
        rows, protos, labels, lr=0.5, epochs=1, batch=2, gen=torch.Generator().manual_seed(7)
    )
    assert_close(halves, expected)


def test_the_server_trains_its_header_on_every_uploaded_class_prototype():
    cfg = load_config(
        None, ["algorithm=fedgh", "fedgh.server_lr=0.3", "train.batch_size=64", "data.num_clients=3"]
    )
    server = FedGHServer(ServerContext(cfg, 3, 3, ["flat_bn"] * 3, lambda cid: bn_model(cid)))
    start = server.header.clone()
    assert start.shape == (3, 4) and torch.equal(server.configure(0, [0, 2])[2]["header"], start)
    uplinks = {
        0: {"classes": torch.tensor([0, 2]), "protos": torch.tensor([[1.0, 0, 0], [0, 0, 1]])},
        2: {"classes": torch.tensor([1]), "protos": torch.tensor([[0.0, 2, 0]])},
        1: {"classes": torch.tensor([], dtype=torch.long), "protos": torch.zeros(0, 3)},  # held nothing
    }
    server.aggregate(0, uplinks)
    protos = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 2, 0]])
    assert_close(server.header, hand_sgd_step(start, protos, torch.tensor([0, 2, 1]), 0.3))
    assert torch.equal(server.eval_payload()["header"], server.header)  # clients are tested under it
    assert set(server.state_dict()) == {"header"}


def test_the_client_trains_under_the_global_header_and_uploads_eval_mode_class_means():
    cfg = load_config(None, ["algorithm=fedgh"])
    client = FedGHClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))
    rows = torch.arange(12, dtype=torch.float32).view(3, 4) / 10
    client.begin_round(0, {"header": rows})
    assert_close(client.model.head.weight.detach(), rows[:, :3])
    assert_close(client.model.head.bias.detach(), rows[:, 3])
    with torch.no_grad():  # training moved the BatchNorm statistics away from a batch's
        client.model.features[2].running_mean.copy_(torch.tensor([0.3, -0.2, 0.1]))
    up = client.upload()
    z = copy.deepcopy(client.model).eval().features(X).detach()
    assert up["classes"].tolist() == [0, 2]  # only the classes the client holds
    assert_close(up["protos"], torch.stack([z[:2].mean(0), z[2:].mean(0)]))
    assert all(m.training for m in client.model.modules())  # the eval pass left the modes as they were


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedgh.server_lr=0"], "fedgh.server_lr=0.0: must be > 0"),
        (["fedgh.server_epochs=0"], "fedgh.server_epochs=0: must be >= 1"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedgh", *overrides])


def test_the_servers_shuffle_is_drawn_from_the_seed_and_the_round():
    """Batches of one: the header depends on the order, which a resumed run must draw again."""
    cfg = load_config(
        None, ["algorithm=fedgh", "fedgh.server_lr=0.5", "train.batch_size=1", "data.num_clients=3"]
    )

    def header_after(rnd: int) -> torch.Tensor:
        server = FedGHServer(ServerContext(cfg, 3, 3, ["flat_bn"] * 3, lambda cid: bn_model(cid)))
        gen = torch.Generator().manual_seed(5)
        ups = {
            c: {"classes": torch.tensor([0, 1, 2]), "protos": torch.randn(3, 3, generator=gen)}
            for c in range(3)
        }
        server.aggregate(rnd, ups)
        return server.header

    assert torch.equal(header_after(4), header_after(4))  # the same round again: the same batches
    assert not torch.equal(header_after(4), header_after(5))  # another round: another order
