"""FedClassAvg's supervised contrastive loss, classifier proximal term and client step, against hand
and independent computations; its views and its settings. No Ray."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedclassavg import (
    FedClassAvgClient,
    FedClassAvgServer,
    classifier_proximal,
    supcon_loss,
)
from fedray.algorithms.lgfedavg import LGFedAvgServer
from fedray.platform.api import crop_flip_views, header_rows, torch_generator
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError

Y = torch.tensor([0, 0, 2, 1])


def loop_supcon(z: torch.Tensor, labels: list[int], tau: float, tau_base: float) -> float:
    """Khosla et al.'s loss written out anchor by anchor, positive by positive, in plain floats."""
    rows = z.tolist()
    y = labels * (len(rows) // len(labels))
    total = 0.0
    for i, zi in enumerate(rows):
        dots = {
            a: sum(p * q for p, q in zip(zi, za, strict=True)) / tau for a, za in enumerate(rows) if a != i
        }
        log_denominator = math.log(sum(math.exp(v) for v in dots.values()))
        positives = [p for p in dots if y[p] == y[i]]
        total += -(tau / tau_base) * sum(dots[p] - log_denominator for p in positives) / len(positives)
    return total / len(rows)


def test_supcon_by_hand_where_each_anchors_only_positive_is_its_other_view():
    # B = 2 samples of two classes, two views: rows 0, 1 are view 1, rows 2, 3 view 2
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 2.0]])
    tau = 0.5
    # anchor 0: dots 0, 1, 0 (rows 1, 2, 3) / tau; its positive is row 2
    a0 = -(2 - math.log(math.exp(0) + math.exp(2) + math.exp(0)))
    # anchor 1: dots with rows 0, 2, 3: 0, 1, 2 -> 0, 2, 4; positive row 3
    a1 = -(4 - math.log(math.exp(0) + math.exp(2) + math.exp(4)))
    # anchor 2: dots with rows 0, 1, 3: 1, 1, 2 -> 2, 2, 4; positive row 0
    a2 = -(2 - math.log(2 * math.exp(2) + math.exp(4)))
    # anchor 3: dots with rows 0, 1, 2: 0, 2, 2 -> 0, 4, 4; positive row 1
    a3 = -(4 - math.log(math.exp(0) + 2 * math.exp(4)))
    expected = (tau / 1.0) * (a0 + a1 + a2 + a3) / 4
    assert_close(supcon_loss(z, torch.tensor([0, 1]), tau, 1.0), torch.tensor(expected))


def test_supcon_against_a_loop_with_several_positives_per_anchor():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 3, generator=gen)
    labels = [0, 1, 0, 0]  # class 0 has three samples: five positives per anchor of class 0
    got = supcon_loss(z, torch.tensor(labels), 0.3, 0.07)
    assert_close(got, torch.tensor(loop_supcon(z, labels, 0.3, 0.07)))
    # the same samples, their classes told apart: fewer positives, another loss
    assert not torch.isclose(got, supcon_loss(z, torch.tensor([0, 1, 2, 3]), 0.3, 0.07))


def test_the_classifier_proximal_term_is_a_mean_per_tensor():
    weight, bias = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([3.0, -1.0])
    global_rows = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, -1.0]])
    # weight diffs 1, 2, 0, -2 -> mean of squares 9/4; bias diffs 2, 0 -> 4/2
    assert_close(classifier_proximal(weight, bias, global_rows), torch.tensor(9 / 4 + 2.0))


def make_client(*overrides: str) -> FedClassAvgClient:
    cfg = load_config(
        None,
        [
            "algorithm=fedclassavg",
            "train.batch_size=4",
            "fedclassavg.mu=2",
            "fedclassavg.temperature=0.5",
            "fedclassavg.base_temperature=0.2",
            "seed=3",
            *overrides,
        ],
    )
    return FedClassAvgClient(bn_model(0), ClientContext(1, cfg, 3, ArrayDataset(X, Y)))


def independent_step(client: FedClassAvgClient, global_rows: torch.Tensor, step: int = 0):
    """CE on view 1 + mu/2 * the proximal term, on a copy of the model with the views drawn from the
    client's stream at (seed, round, client) after ``step`` steps, plus l_SupCon of both views' unit-length
    representations as a plain float (the loop's); the copy and its loss."""
    model = copy.deepcopy(client.model)
    gen = torch_generator("fedclassavg/views", 3, client.rnd, 1)
    for _ in range(step):  # the steps before take their views first
        crop_flip_views(X, gen, flip=client.hp.flip)
    v1, v2 = crop_flip_views(X, gen, flip=client.hp.flip)
    z = model.features(torch.cat([v1, v2]))
    ce = F.cross_entropy(model.head(z[:4]), Y)
    hp = client.hp
    zc = F.normalize(z, dim=1) if hp.normalize else z
    con = loop_supcon(zc.detach(), Y.tolist(), hp.temperature, hp.base_temperature)
    w_g, b_g = global_rows[:, :3], global_rows[:, 3]
    prox = ((model.head.weight - w_g) ** 2).mean() + ((model.head.bias - b_g) ** 2).mean()
    return model, ce + 2 / 2 * prox, con


def test_the_step_is_ce_plus_supcon_plus_the_proximal_pull_toward_the_global_classifier():
    client = make_client()
    global_rows = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    client.begin_round(2, {"header": global_rows})
    assert torch.equal(header_rows(client.model), global_rows)  # the global classifier replaced its own
    with torch.no_grad():  # as after some local steps: the classifier has moved off the global one
        client.model.head.weight.add_(0.5)
        client.model.head.bias.sub_(0.25)
    model, ce_prox, con = independent_step(client, global_rows, 0)
    loss = client.training_step((X, Y), 0)
    assert_close(loss, ce_prox + con, rtol=1e-5, atol=1e-5)
    stats = client.pop_stats()
    assert stats["loss/proximal"] == pytest.approx(0.5**2 + 0.25**2, rel=1e-5)
    assert stats["loss/supcon"] == pytest.approx(con, rel=1e-5)
    # the classifier's gradient is CE's and the proximal term's (l_SupCon reads only the extractor)
    loss.backward()
    ce_prox.backward()
    assert_close(client.model.head.bias.grad, model.head.bias.grad)
    assert_close(client.model.head.weight.grad, model.head.weight.grad)


def test_the_views_are_drawn_step_after_step_from_seed_round_and_client():
    client = make_client()
    global_rows = torch.zeros(3, 4)
    client.begin_round(1, {"header": global_rows})
    first, second = client.training_step((X, Y), 0), client.training_step((X, Y), 1)
    assert not torch.equal(first, second)  # the next step, other views
    assert_close(second, sum(independent_step(client, global_rows, 1)[1:]), rtol=1e-5, atol=1e-5)
    client.begin_round(1, {"header": global_rows})  # the round again (a retried client): the same draws
    assert torch.equal(client.training_step((X, Y), 0), first)
    client.begin_round(2, {"header": global_rows})  # another round, other draws
    assert not torch.equal(client.training_step((X, Y), 0), first)


def test_views_without_flips_are_never_mirrored_and_the_client_draws_them_so():
    x = torch.zeros(64, 1, 8, 8)
    x[:, 0, 3, 2] = 1.0  # off the centre line: a mirror would move it to column 5
    for view in crop_flip_views(x, torch.Generator().manual_seed(0), flip=False):
        cols = view[:, 0].nonzero()[:, 2]
        assert len(cols) == 64 and ((cols - 2).abs() <= 1).all()
    client = make_client("fedclassavg.flip=false")
    global_rows = torch.zeros(3, 4)
    client.begin_round(0, {"header": global_rows})
    _, ce_prox, con = independent_step(client, global_rows)
    assert_close(client.training_step((X, Y), 0), ce_prox + con, rtol=1e-5, atol=1e-5)


def test_an_eighth_of_the_side_bounds_the_shift_of_a_view():
    x = torch.zeros(64, 1, 8, 8)
    x[:, 0, 3, 3] = 1.0
    for view in crop_flip_views(x, torch.Generator().manual_seed(0)):
        rows, cols = view[:, 0].nonzero()[:, 1:].T
        assert len(rows) == 64  # 1 pixel of padding: the dot never leaves the frame
        assert ((rows - 3).abs() <= 1).all()
        assert (((cols - 3).abs() <= 1) | ((cols - 4).abs() <= 1)).all()  # at 3 +- 1, or mirrored to 4 +- 1
        assert (cols >= 4).any() and (cols <= 3).any()  # some flipped, some not


def test_the_server_is_lgfedavgs_and_clients_are_tested_with_the_classifier_they_trained():
    assert issubclass(FedClassAvgServer, LGFedAvgServer)
    cfg = load_config(None, ["algorithm=fedclassavg"])
    server = FedClassAvgServer(ServerContext(cfg, 2, 3, ["flat_bn"] * 2, lambda cid: bn_model(cid)))
    assert server.eval_payload() is None  # own extractor, own classifier
    ones, zeros = torch.ones(3, 4), torch.zeros(3, 4)
    server.aggregate(0, {0: {"header": ones, "num_samples": 1}, 1: {"header": zeros, "num_samples": 3}})
    assert_close(server.header, torch.full((3, 4), 0.25))  # weighted by train sizes
    server.hp.eval_head = "global"
    assert torch.equal(server.eval_payload()["header"], server.header)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedclassavg.mu=-1"], "fedclassavg.mu=-1.0: must be >= 0"),
        (["fedclassavg.temperature=0"], "fedclassavg.temperature=0.0: must be > 0"),
        (["fedclassavg.base_temperature=-1"], "fedclassavg.base_temperature=-1.0: must be > 0"),
        (
            ["data.augment=crop_flip"],
            "data.augment=crop_flip: algorithm 'fedclassavg' crops and flips its own",
        ),
        (
            ["data.dataset=shakespeare", "model.group=leaf_lstm"],
            "algorithm 'fedclassavg' draws cropped and flipped views of its images, and shakespeare is text",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedclassavg", *overrides])


def test_the_authors_form_reads_the_representations_as_they_are():
    client = make_client("fedclassavg.normalize=false", "fedclassavg.temperature=100")
    global_rows = torch.zeros(3, 4)
    client.begin_round(0, {"header": global_rows})
    _, ce_prox, con = independent_step(client, global_rows)
    assert_close(client.training_step((X, Y), 0), ce_prox + con, rtol=1e-5, atol=1e-5)
    normalized = make_client("fedclassavg.temperature=100")
    normalized.begin_round(0, {"header": global_rows})
    assert not torch.isclose(normalized.training_step((X, Y), 0), ce_prox + con)
