"""FedKD's adaptive mutual distillation, its SVD compression and its halves, against hand and
independent computations; no Ray."""

import copy
import math

import pytest
import torch
from test_algo_fml import small_hetero_cfg
from torch.testing import assert_close

from fedray.algorithms.fedkd import (
    FedKDClient,
    FedKDServer,
    adaptive_losses,
    compress,
    compress_state,
    energy_at,
    recover,
    recover_state,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext, payload_nbytes
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import arch_for_client
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.worker import member_model, model_of_arch, smallest_arch


def test_the_adaptive_losses_by_hand_and_where_their_gradients_go():
    lt = torch.tensor([[0.0, math.log(3)]], requires_grad=True)  # softmax [1/4, 3/4]
    ls = torch.tensor([[0.0, 0.0]], requires_grad=True)  # softmax [1/2, 1/2]
    ht = torch.tensor([[1.0, 2.0]], requires_grad=True)
    hs = torch.tensor([[0.0, 4.0]], requires_grad=True)
    y = torch.tensor([1])
    ce_t, ce_s = -math.log(0.75), -math.log(0.5)
    w = ce_t + ce_s
    kl_s_t = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(y_s || y_t)
    kl_t_s = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    mse = ((1 - 0) ** 2 + (2 - 4) ** 2) / 2
    mentor, mentee, hidden = adaptive_losses(lt, ls, ht, hs, y)
    assert_close(mentor, torch.tensor(ce_t + kl_s_t / w))
    assert_close(mentee, torch.tensor(ce_s + kl_t_s / w))
    assert_close(hidden, torch.tensor(mse / w))
    mentor.backward()  # the mentor's own loss reaches only the mentor's logits
    assert ls.grad is None and lt.grad is not None
    # the weight 1/(CE_t + CE_s) is a constant: d(mentor)/d(lt) is CE_t's gradient plus KL's over w
    p_t = torch.tensor([0.25, 0.75])
    expected = (p_t - torch.tensor([0.0, 1.0])) + (p_t - torch.tensor([0.5, 0.5])) / w
    assert_close(lt.grad[0], expected)


def test_the_energy_rises_linearly_from_start_to_end():
    assert energy_at(0, 11, 0.95, 0.98) == 0.95
    assert_close(torch.tensor(energy_at(5, 11, 0.95, 0.98)), torch.tensor(0.965))
    assert_close(torch.tensor(energy_at(10, 11, 0.95, 0.98)), torch.tensor(0.98))  # the last of 11 rounds
    assert energy_at(0, 1, 0.95, 0.98) == 0.95  # a one-round run


def test_compression_keeps_the_fewest_singular_values_past_the_energy_and_recovers():
    # singular values 3, 2, 1: squared 9, 4, 1 of 14; cumulative 9, 13, 14
    q1, _ = torch.linalg.qr(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    q2, _ = torch.linalg.qr(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)))
    m = q1 @ torch.diag(torch.tensor([3.0, 2.0, 1.0])) @ q2.T  # [4, 5], rank 3
    assert len(compress(m, 0.6)["s"]) == 1  # 9 > 0.6 * 14
    assert len(compress(m, 0.9)["s"]) == 2  # 13 > 12.6, 9 is not
    assert len(compress(m, 1.0)["s"]) == 4  # every one (the fourth is 0): recovered exactly
    assert_close(recover(compress(m, 1.0)), m)
    two = recover(compress(m, 0.9))  # the best rank-2 approximation: drops the last singular pair
    assert_close(torch.linalg.matrix_norm(m - two), torch.tensor(1.0))
    conv = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(2))  # one [2, 12] matrix
    packed = compress(conv, 1.0)
    assert packed["u"].shape == (2, 2) and packed["v"].shape == (2, 12)
    assert_close(recover(packed), conv)
    bias, steps = torch.randn(3), torch.tensor(7)
    assert compress(bias, 0.5) is bias and compress(steps, 0.5) is steps  # 1-D and integer: as they are
    state = {"w": m, "b": bias}
    assert set(recover_state(compress_state(state, 1.0))) == {"w", "b"}
    # a low-rank weight travels in fewer bytes
    assert payload_nbytes(compress(m, 0.6)) < payload_nbytes(m)


def setup(cfg):
    meta = federation_meta(prepare_federation(cfg))
    small = smallest_arch(cfg, meta)
    shared = {"find_smallest": lambda: small, "make_arch": lambda a: member_model(cfg, a, meta)}
    return meta, small, shared


def test_the_server_sends_the_compressed_mean_and_averages_what_it_recovers():
    cfg = small_hetero_cfg("fedkd.energy_start=0.5", "fedkd.energy_end=1.0", "rounds=5", "algorithm=fedkd")
    meta, small, shared = setup(cfg)
    n = cfg.data.num_clients
    archs = [arch_for_client(cfg.model.group, c) for c in range(n)]
    server = FedKDServer(ServerContext(cfg, n, meta["num_classes"], archs, lambda c: None, **shared))  # type: ignore[arg-type, return-value]
    assert server.mentee.arch == small and server.eval_payload() is None
    down = server.configure(2, [0, 1])[0]
    assert down["energy"] == 0.75  # 0.5 + 2/4 * 0.5: round 2 of 0..4
    state = {k: v.clone() for k, v in server.mentee.state_dict().items()}
    for k, v in compress_state(state, 0.75).items():
        if isinstance(v, dict):
            assert torch.equal(down["mentee"][k]["s"], v["s"])
    # two uploads, recovered and averaged without weights
    a = {k: v.clone() for k, v in state.items()}
    b = {k: (v * 3 if v.is_floating_point() else v) for k, v in state.items()}
    ups = {0: {"mentee": compress_state(a, 1.0)}, 1: {"mentee": compress_state(b, 1.0)}}
    server.aggregate(2, ups)
    for k, v in server.mentee.state_dict().items():
        if v.is_floating_point():
            assert_close(v, 2 * state[k], atol=1e-5, rtol=1e-5)


def test_the_client_trains_mentor_mentee_and_projection_and_uploads_at_the_rounds_energy():
    cfg = small_hetero_cfg("algorithm=fedkd")
    meta, small, shared = setup(cfg)
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    ctx = ClientContext(0, cfg, meta["num_classes"], ArrayDataset(x, y), **shared)
    client = FedKDClient(model_of_arch(arch_for_client(cfg.model.group, 0), meta), ctx)
    assert client.mentee.arch == small and client.model.arch != small
    mentor_before = copy.deepcopy(client.model.state_dict())
    sent = model_of_arch(small, meta).state_dict()
    client.begin_round(0, {"mentee": compress_state(sent, 1.0), "energy": 0.6})
    for k, v in client.mentee.state_dict().items():
        assert_close(v, sent[k], atol=1e-5, rtol=1e-5)  # recovered from its SVD
    for k, v in client.model.state_dict().items():
        assert torch.equal(v, mentor_before[k]), k
    mentor, mentee, proj = (
        copy.deepcopy(client.model),
        copy.deepcopy(client.mentee),
        copy.deepcopy(client.projection),
    )
    lt, ht = mentor.forward_with_features(x)
    ls, hs = mentee.forward_with_features(x)
    assert_close(client.training_step((x, y), 0), sum(adaptive_losses(lt, ls, ht, proj(hs), y)))
    up = client.upload()["mentee"]
    weight = next(k for k, v in up.items() if isinstance(v, dict))
    assert torch.equal(up[weight]["s"], compress(client.mentee.state_dict()[weight], 0.6)["s"])


@pytest.mark.parametrize(("key", "value"), [("energy_start", 0), ("energy_end", 1.5)])
def test_an_energy_outside_zero_one_is_a_one_line_error(key, value):
    with pytest.raises(ConfigError, match=rf"fedkd\.{key}={float(value)}: must be in \(0, 1\]"):
        load_config(None, ["algorithm=fedkd", f"fedkd.{key}={value}"])
