"""FedDistill (FD): FedProto's math in the logit space, checked by hand; no Ray, no Lightning trainer."""

import torch
import torch.nn.functional as F
from test_algo_fedproto import UPLINK_A, UPLINK_B, X, Y, flatten_model, float_data
from torch.testing import assert_close

from fedray.algorithms.feddistill import FedDistillClient, FedDistillConfig, FedDistillServer
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config


def make_client(*overrides: str) -> FedDistillClient:
    cfg = load_config(None, ["algorithm=feddistill", *overrides])
    ctx = ClientContext(0, cfg, 3, float_data(X, Y), torch.bincount(Y, minlength=3))
    return FedDistillClient(flatten_model(), ctx)


def test_defaults_plain_mean_lam_one_soft_targets_head_scoring():
    cfg = load_config(None, ["algorithm=feddistill"])
    assert isinstance(cfg.algo, FedDistillConfig)
    assert cfg.algo.lam == 1.0 and cfg.algo.weighted is False
    assert cfg.algo.loss == "soft_ce" and cfg.algo.eval == "head"


def test_client_uploads_per_class_mean_logits():
    # head W = [[1,0,0,0],[0,1,0,0],[1,1,1,1]], b = [0,1,0]; logits are linear in x, so the class mean of
    # the logits is the head applied to the class mean of x: class 0 mean x [2,2,2,2] -> [2, 3, 8];
    # class 2 mean x [1,1,1,4] -> [1, 2, 7]
    up = make_client("feddistill.collect=after").upload()
    assert up["classes"].tolist() == [0, 2]
    assert_close(up["protos"], torch.tensor([[2.0, 3.0, 8.0], [1.0, 2.0, 7.0]]))
    assert up["counts"].tolist() == [2, 2]


def test_server_plain_mean_of_logits_over_holders_and_heterogeneous_models_allowed():
    cfg = load_config(None, ["algorithm=feddistill"])

    def no_model(cid):  # the logit space needs no shared feature size: models are never built
        raise AssertionError("FedDistill's server must not inspect the models")

    server = FedDistillServer(ServerContext(cfg, 2, 4, ["a", "b"], no_model))
    assert server.dim == 4
    server.aggregate(0, {0: UPLINK_A, 1: UPLINK_B})  # FedProto's worked example
    # plain mean over holders: class 0 (1 + 3) / 2 = 2; class 1: 7; class 2: 4; class 3: nobody
    assert_close(server.protos, torch.tensor([[2.0], [7.0], [4.0], [0.0]]))
    assert server.mask.tolist() == [True, True, True, False]


def test_training_step_distils_with_soft_targets_from_the_global_class_means():
    client = make_client("feddistill.lam=2.0")
    x, y = X[1:], Y[1:]  # classes 0, 2, 2: logits [3,3,6] (x = [3,2,1,0]), [0,1,8], [2,3,6]
    plain = F.cross_entropy(client.model(x), y)
    targets = torch.tensor([[0.0, 0, 0], [0, 0, 0], [1, 2, 7]])
    client.receive(1, {"protos": targets, "mask": torch.tensor([False, False, True])})
    # by hand: p = softmax([1,2,7]); each class-2 sample adds -sum_c p_c log softmax(logits)_c, the
    # class-0 sample (no global mean) adds 0; the sum is divided by B = 3, times lam 2
    p = torch.exp(torch.tensor([1.0, 2, 7])) / torch.exp(torch.tensor([1.0, 2, 7])).sum()

    def log_softmax(v):
        v = torch.tensor(v)
        return v - torch.log(torch.exp(v).sum())

    soft = -(p * log_softmax([0.0, 1, 8])).sum() - (p * log_softmax([2.0, 3, 6])).sum()
    assert_close(client.training_step((x, y), 0), plain + 2.0 * soft / 3)


def test_mse_option_distils_logits_toward_the_global_class_means():
    client = make_client("feddistill.lam=2.0", "feddistill.loss=mse")
    x, y = X[2:], Y[2:]  # class 2: logits [0,1,8] (x = [0,0,0,8]) and [2,3,6] (x = [2,2,2,0])
    plain = F.cross_entropy(client.model(x), y)
    targets = torch.tensor([[0.0, 0, 0], [0, 0, 0], [1, 2, 7]])
    client.receive(1, {"protos": targets, "mask": torch.tensor([False, False, True])})
    # (logits - [1,2,7])^2: [1,1,1] + [1,1,1] = 6 over B*C = 6 -> 1.0; times lam 2 = 2.0
    assert_close(client.training_step((x, y), 0), plain + 2.0)
