"""FedRCL's relaxed contrastive terms and client step, against hand and loop computations; no Ray."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedavg import FedAvgServer
from fedray.algorithms.fedrcl import FedRCLClient, outputs_of, relaxed_contrastive_terms
from fedray.platform.api import registry
from fedray.platform.api.algorithm import ClientContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import build_model


def loop_terms(
    z: torch.Tensor, y: list[int], tau: float, threshold: float, negatives: int
) -> tuple[float, float]:
    """The two terms sample by sample, in plain floats, from the cosine similarities."""
    zn = F.normalize(z, dim=1).tolist()
    n = len(y)
    cos = [[sum(a * b for a, b in zip(zn[i], zn[j], strict=True)) for j in range(n)] for i in range(n)]
    scl = div = 0.0
    for i in range(n):
        positive = min(cos[i][j] for j in range(n) if y[j] == y[i])
        others = sorted((cos[i][j] for j in range(n) if y[j] != y[i]), reverse=True)[:negatives]
        denominator = math.exp(positive / tau) + sum(math.exp(s / tau) for s in others)
        scl += -(positive / tau - math.log(denominator))
        mates = [cos[i][j] for j in range(n) if j != i and y[j] == y[i]]
        if mates and min(mates) >= threshold:
            s = min(mates)
            div += -(1 / tau - math.log(math.exp(1 / tau) + math.exp(s / tau)))
    return scl / n, div / n


def test_by_hand_on_three_points():
    # unit vectors at 0, 60 and 180 degrees; samples 0 and 1 share a class
    z = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2], [-2.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    tau = 0.5
    scl, div = relaxed_contrastive_terms(z, y, tau, threshold=0.4, negatives=2)
    # sample 0: positive cos 0.5 (its classmate), one negative cos -1
    l0 = -math.log(math.exp(1.0) / (math.exp(1.0) + math.exp(-2.0)))
    # sample 1: positive 0.5, negative cos(120 deg) = -0.5
    l1 = -math.log(math.exp(1.0) / (math.exp(1.0) + math.exp(-1.0)))
    # sample 2: alone in its class: positive itself (1), negatives -1 and -0.5
    l2 = -math.log(math.exp(2.0) / (math.exp(2.0) + math.exp(-2.0) + math.exp(-1.0)))
    assert_close(scl, torch.tensor((l0 + l1 + l2) / 3))
    # penalty: samples 0 and 1 at cos 0.5 >= 0.4: softplus((0.5 - 1) / 0.5) each; sample 2 none
    assert_close(div, torch.tensor(2 * math.log(1 + math.exp(-1.0)) / 3))
    assert relaxed_contrastive_terms(z, y, tau, threshold=0.6, negatives=2)[1] == 0  # below it: relaxed


@pytest.mark.parametrize("seed", range(4))
def test_against_a_loop_on_random_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(12, 5, generator=gen)
    y = torch.randint(0, 4, (12,), generator=gen)
    scl, div = relaxed_contrastive_terms(z, y, 0.3, -0.2, 2)
    want = loop_terms(z, y.tolist(), 0.3, -0.2, 2)
    assert_close(scl, torch.tensor(want[0]), rtol=1e-5, atol=1e-6)
    assert_close(div, torch.tensor(want[1]), rtol=1e-5, atol=1e-6)
    assert want[1] > 0  # some anchor was penalised: the threshold mattered


def test_a_batch_of_one_class_has_no_negatives_and_stays_finite():
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    scl, div = relaxed_contrastive_terms(z, torch.zeros(4, dtype=torch.long), 0.05, 0.7, 2)
    assert scl == 0  # the positive alone: -log 1
    (scl + div).backward()
    assert z.grad is not None and z.grad.isfinite().all()
    lone = torch.randn(3, 3, requires_grad=True)  # every sample alone in its class: no penalty
    scl, div = relaxed_contrastive_terms(lone, torch.tensor([0, 1, 2]), 0.05, 0.7, 2)
    (scl + div).backward()
    assert div == 0 and lone.grad is not None and lone.grad.isfinite().all()


def test_the_step_adds_the_weighted_terms_to_cross_entropy():
    cfg = load_config(
        None,
        [
            "algorithm=fedrcl",
            "fedrcl.scl_weight=2",
            "fedrcl.penalty_weight=3",
            "fedrcl.threshold=-1",
            "fedrcl.tau=1",
        ],
    )
    y = torch.tensor([0, 0, 2, 1])
    client = FedRCLClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, y)))
    client.begin_round(0, {"model": bn_model(1).state_dict()})
    loss = client.training_step((X, y), 0)
    logits, z = client.model.forward_with_features(X)
    scl, div = relaxed_contrastive_terms(z, y, 1.0, -1.0, 2)
    assert_close(loss, F.cross_entropy(logits, y) + 2 * scl + 3 * div)
    stats = client.pop_stats()
    assert stats["loss/penalty"] == pytest.approx(float(div.detach())) and float(div.detach()) > 0
    assert registry.get("fedrcl").server_cls is FedAvgServer


def test_the_terms_are_averaged_over_the_models_levels_before_their_relu():
    # cnn_small declares three levels: conv1's and conv2's outputs and the last layer's, before the ReLU
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, generator=g), torch.tensor([0, 0, 1, 1, 2, 2])
    settings = ["algorithm=fedrcl", "fedrcl.threshold=-1", "fedrcl.tau=0.5"]
    torch.manual_seed(0)
    model = build_model("cnn_small", 1, 8, 3)
    client = FedRCLClient(model, ClientContext(0, load_config(None, settings), 3, ArrayDataset(x, y)))
    loss = client.training_step((x, y), 0)
    # by hand: the extractor's layers one by one, each level read before the in-place ReLU after it
    h, reps = x, []
    for name, layer in model.features.named_children():
        h = layer(h)
        if name in ("conv1", "conv2"):
            reps.append(h.mean((2, 3)))
        elif name == "fc":
            reps.append(h.clone())
    terms = [relaxed_contrastive_terms(r, y, 0.5, -1.0, 2) for r in reps]
    scl, div = sum(t[0] for t in terms) / 3, sum(t[1] for t in terms) / 3
    assert_close(loss, F.cross_entropy(model.head(h), y) + scl + div)
    assert client.pop_stats()["fedrcl/levels"] == 3
    # levels=last: the deepest level alone (the last layer before its ReLU, not z), a different loss
    last = FedRCLClient(
        model, ClientContext(0, load_config(None, [*settings, "fedrcl.levels=last"]), 3, ArrayDataset(x, y))
    )
    deepest = F.cross_entropy(model.head(h), y) + terms[-1][0] + terms[-1][1]
    assert_close(last.training_step((x, y), 0), deepest)
    assert not torch.allclose(loss, deepest)
    assert not any(m._forward_hooks for m in model.modules())  # no hook left behind


# fedray's own blocks, torchvision's BasicBlock and Bottleneck twins
@pytest.mark.parametrize("arch", ["resnet10", "resnet18", "resnet50:imagenet"])
def test_a_resnets_levels_are_read_before_the_in_place_relu_that_follows_them(arch):
    # the stem's BatchNorm and each stage's sum, each followed by an in-place ReLU
    torch.manual_seed(0)
    model = build_model(arch, 3, 8, 3).train()
    with outputs_of(model.feature_levels()) as levels:
        z = model.forward_features(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)))
    assert len(levels) == 5 and all((level < 0).any() for level in levels)  # not overwritten by the ReLU
    assert_close(F.relu(levels[-1]).mean((2, 3)), z)  # z: the last stage after its ReLU, pooled
    assert [level.shape[1] for level in levels][:2] == [64, 64 * (4 if "50" in arch else 1)]
    levels[-1].sum().backward()  # the copies keep their gradient
    assert all(p.grad is not None for p in model.features.parameters())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedrcl.tau=0"], "fedrcl.tau=0.0: must be > 0"),
        (["fedrcl.threshold=1.5"], r"fedrcl.threshold=1.5: a cosine similarity, in \[-1, 1\]"),
        (["fedrcl.negatives=0"], "fedrcl.negatives=0: must be >= 1"),
        (["fedrcl.penalty_weight=-1"], "fedrcl.penalty_weight=-1.0: must be >= 0"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedrcl", *overrides])
