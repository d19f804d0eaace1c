"""Local (Standalone) checked by hand: each round is plain full-batch SGD continued from the client's own
weights, nothing goes down or up, and the server keeps nothing. No Ray, no Lightning trainer."""

import torch
import torch.nn.functional as F
from test_algo_fedproto import X, flatten_model  # features = Flatten, head = a known Linear(4, 3)
from torch.testing import assert_close

from fedray.algorithms.local import LocalClient
from fedray.platform.api.algorithm import ClientContext, Server, ServerContext, payload_nbytes
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.models import build_model
from fedray.platform.runtime.local_training import LocalTraining

Y = torch.tensor([0, 0, 2, 1])  # FedProto's four samples (X), every class held
LR = 0.5


def hand_sgd_step(w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-batch SGD step on the mean cross-entropy of the linear softmax classifier, from its
    closed-form gradient: d/dlogits = (softmax - onehot) / n."""
    x = X.flatten(1)
    probs = torch.softmax(x @ w.T + b, dim=1)
    residual = (probs - F.one_hot(Y, 3).float()) / len(Y)
    return w - LR * residual.T @ x, b - LR * residual.sum(0)


def test_each_round_is_plain_sgd_from_the_clients_own_weights_and_nothing_travels():
    # all four samples in one batch: the step is independent of the shuffle
    cfg = load_config(None, ["algorithm=local", "train.batch_size=4", f"train.lr={LR}", "train.momentum=0"])
    client = LocalClient(
        flatten_model(), ClientContext(0, cfg, 3, ArrayDataset(X, Y), torch.bincount(Y, minlength=3))
    )
    w, b = client.model.head.weight.detach().clone(), client.model.head.bias.detach().clone()
    loop = LocalTraining(cfg.train, torch.device("cpu"))
    for rnd in range(2):
        client.begin_round(rnd, {})  # Local's server sends nothing
        assert_close(client.model.head.weight, w)  # receiving nothing changed nothing
        assert_close(client.model.head.bias, b)
        loop.fit(client, 1)
        w, b = hand_sgd_step(w, b)  # continued from the last round's weights, not from any shared model
        assert_close(client.model.head.weight.detach(), w)
        assert_close(client.model.head.bias.detach(), b)
        up = client.upload()
        assert up == {} and payload_nbytes(up) == 0


def test_the_server_sends_nothing_and_keeps_nothing():
    cfg = load_config(None, ["algorithm=local"])
    server = Server(
        ServerContext(cfg, 3, 10, ["cnn_small"] * 3, lambda cid: build_model("cnn_small", 1, 8, 10))
    )
    downlinks = server.configure(0, [0, 2])
    assert set(downlinks) == {0, 2} and all(payload_nbytes(d) == 0 for d in downlinks.values())
    server.aggregate(0, {0: {}, 2: {}})
    assert server.state_dict() == {}  # a checkpoint of it holds nothing
    assert server.eval_payload() is None  # each client is tested on its own model
