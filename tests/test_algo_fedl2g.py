"""FedL2G math and halves, checked against hand computations and an independently written meta-gradient;
no Ray, no Lightning trainer."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import fedray.algorithms.fedl2g as fedl2g_module
from fedray.algorithms.fedl2g import (
    FedL2GClient,
    FedL2GServer,
    average_rows,
    guide_loss,
    meta_gradient,
    nonzero_rows,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import FedModel, arch_for_client, build_model

C = 4  # classes of the tiny problems


def float_data(x: torch.Tensor, y: torch.Tensor) -> ArrayDataset:
    """A train split as the client sees it: normalised float images."""
    return ArrayDataset(x, y)


def tiny_mlp(dtype=torch.float64, bn: bool = False) -> FedModel:
    """features = tanh(Linear(4, 3)) on 1x2x2 inputs (optionally with BatchNorm), head = Linear(3, C)."""
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(4, 3)] + ([nn.BatchNorm1d(3)] if bn else []) + [nn.Tanh()]
    return FedModel(nn.Sequential(*layers), 3, C, arch="tiny", in_channels=1, image_size=2).to(dtype)


def batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(5, 1, 2, 2, generator=g, dtype=dtype)
    xq = torch.randn(6, 1, 2, 2, generator=g, dtype=dtype)
    ys = torch.tensor([0, 2, 2, 0, 2])  # classes 1 and 3 are not in the study batch
    yq = torch.tensor([0, 1, 2, 3, 1, 2])
    return (xs, ys), (xq, yq)


def hand_forward(W1, b1, W2, b2, x):
    z = torch.tanh(x.flatten(1) @ W1.T + b1)
    return z @ W2.T + b2, z


def hand_ce(logits, y):
    return -(logits - logits.exp().sum(1, keepdim=True).log()).gather(1, y[:, None]).mean()


# ------------------------------------------------------------------------------------------- math


def test_guide_loss_by_hand():
    # z - G[y] = [[1,2]-[1,1], [3,4]-[0,0]] = [[0,1],[3,4]] -> squares 0,1,9,16 -> mean over B*M = 26/4
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    G = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    assert_close(guide_loss(z, G, torch.tensor([1, 0])), torch.tensor(6.5))


@pytest.mark.parametrize("variant", ["f", "l"])
def test_meta_gradient_equals_autograd_through_an_explicit_sgd_step(variant):
    """Eq. 6 written out by hand: theta' = theta - lr * grad L_s (graph kept w.r.t. G), then grad_G CE_q."""
    # Prepare
    model, lr = tiny_mlp(), 0.3
    (xs, ys), (xq, yq) = batches()
    M = 3 if variant == "f" else C
    G = torch.randn(C, M, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    theta = [
        t.detach().clone().requires_grad_()
        for t in (model.features[1].weight, model.features[1].bias, model.head.weight, model.head.bias)
    ]
    Gv = G.clone().requires_grad_()
    logits, z = hand_forward(*theta, xs)
    guided = z if variant == "f" else logits
    study = hand_ce(logits, ys) + ((guided - Gv[ys]) ** 2).mean()
    grads = torch.autograd.grad(study, theta, create_graph=True)
    stepped = [t - lr * g for t, g in zip(theta, grads)]
    (expected,) = torch.autograd.grad(hand_ce(hand_forward(*stepped, xq)[0], yq), Gv)
    # Execute
    pi = meta_gradient(model, dict(model.named_parameters()), G, (xs, ys), (xq, yq), lr, variant)
    # Assert
    assert_close(pi, expected, atol=1e-6, rtol=0)
    assert pi.abs().sum() > 1e-4  # not trivially zero


def test_meta_gradient_matches_the_papers_jvp_formula():
    """Paper Eq. 9 (App. C, Eq. C.11) with l_g's 1/M kept and the class indicator explicit
    (docs/algorithms/fedl2g.md, The meta-gradient):
    pi[c] = 2*lr/(B*M) * sum_{b: y_b = c} J_z(x_b; theta) . g_q, g_q = grad_theta CE_q(theta')."""
    model, lr = tiny_mlp(), 0.3
    (xs, ys), (xq, yq) = batches()
    G = torch.randn(C, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    theta = tuple(
        t.detach().clone().requires_grad_()
        for t in (model.features[1].weight, model.features[1].bias, model.head.weight, model.head.bias)
    )
    logits, z = hand_forward(*theta, xs)
    grads = torch.autograd.grad(hand_ce(logits, ys) + ((z - G[ys]) ** 2).mean(), theta)
    stepped = tuple((t - lr * g).detach().requires_grad_() for t, g in zip(theta, grads))
    g_q = torch.autograd.grad(hand_ce(hand_forward(*stepped, xq)[0], yq), stepped)
    _, jvp = torch.func.jvp(lambda *p: hand_forward(*p, xs)[1], theta, g_q)  # [B, M]
    expected = 2 * lr / (len(ys) * 3) * torch.zeros(C, 3, dtype=torch.float64).index_add_(0, ys, jvp)

    pi = meta_gradient(model, dict(model.named_parameters()), G, (xs, ys), (xq, yq), lr, "f")
    assert_close(pi, expected, atol=1e-9, rtol=1e-6)


def test_only_classes_of_the_study_batch_get_nonzero_rows():
    model = tiny_mlp()
    (xs, ys), quiz = batches()  # study classes {0, 2}; the quiz has all four
    G = torch.randn(C, 3, dtype=torch.float64)
    pi = meta_gradient(model, dict(model.named_parameters()), G, (xs, ys), quiz, 0.1, "f")
    assert torch.all(pi[[1, 3]] == 0)
    assert torch.all(pi[[0, 2]].abs().sum(1) > 0)
    classes, rows = nonzero_rows(pi)
    assert classes.tolist() == [0, 2]
    assert_close(rows, pi[[0, 2]])


def test_meta_gradient_leaves_parameters_and_batchnorm_stats_alone():
    model = tiny_mlp(bn=True).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    study, quiz = batches()
    G = torch.randn(C, 3, dtype=torch.float64)
    pi = meta_gradient(model, dict(model.named_parameters()), G, study, quiz, 0.1)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert pi.abs().sum() > 0


def test_nonzero_rows_by_hand():
    pi = torch.tensor([[0.0, 0.0], [0.0, -1.0], [0.0, 0.0], [2.0, 3.0]])
    classes, rows = nonzero_rows(pi)
    assert classes.tolist() == [1, 3]
    assert_close(rows, torch.tensor([[0.0, -1.0], [2.0, 3.0]]))


def test_average_rows_means_over_the_senders_of_each_class():
    # A sends classes 0, 2; B sends 2, 3; nobody sends 1.
    # class 0: [1,1]; class 1: 0 (count 0); class 2: ([2,2] + [4,4]) / 2 = [3,3]; class 3: [6,6]
    a = (torch.tensor([0, 2]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    b = (torch.tensor([2, 3]), torch.tensor([[4.0, 4.0], [6.0, 6.0]]))
    mean, count = average_rows([a, b], 4)
    assert_close(mean, torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0], [6.0, 6.0]]))
    assert count.tolist() == [1, 0, 2, 1]


# ------------------------------------------------------------------------------------------- server


def server_for(*overrides: str, group: str = "cnn_small") -> FedL2GServer:
    cfg = load_config(None, ["algorithm=fedl2g", f"model.group={group}", *overrides])
    archs = [arch_for_client(group, cid) for cid in range(3)]
    return FedL2GServer(ServerContext(cfg, 3, 3, archs, lambda cid: build_model(archs[cid], 1, 8, 3)))


UPLINKS = {
    0: {"classes": torch.tensor([0, 2]), "rows": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])},
    1: {"classes": torch.tensor([2]), "rows": torch.tensor([[2.0, 1.0, 0.0]])},
    2: {"classes": torch.tensor([], dtype=torch.int64), "rows": torch.zeros(0, 3)},
}
# per-class mean: class 0 [1,2,3] (one sender); class 1 nobody -> 0; class 2 ([4,5,6] + [2,1,0]) / 2 = [3,3,3]
MEAN = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]])


def test_server_step_is_g_minus_eta_s_times_the_mean():
    server = server_for("fedl2g.variant=l", "fedl2g.server_lr=0.5", "fedl2g.server_clip=1000")
    G0 = server.guide.weight.detach().clone()
    assert G0.shape == (3, 3)  # logit space: M = C
    server.aggregate(0, UPLINKS)
    assert_close(server.guide.weight.detach(), G0 - 0.5 * MEAN)
    assert_close(server.configure(1, [0, 1])[1]["guide"], G0 - 0.5 * MEAN)


def test_server_clip_bites():
    # ||MEAN|| = sqrt(1 + 4 + 9 + 27) = sqrt(41) > 1 -> the step is 0.5 * MEAN / sqrt(41)
    server = server_for("fedl2g.variant=l", "fedl2g.server_lr=0.5", "fedl2g.server_clip=1")
    G0 = server.guide.weight.detach().clone()
    server.aggregate(0, UPLINKS)
    assert_close(server.guide.weight.detach(), G0 - 0.5 * MEAN / 41**0.5, rtol=1e-5, atol=1e-6)


def test_server_defaults_per_variant_and_feature_dim():
    f = server_for(group="small_hetero")
    assert f.guide.weight.shape == (3, 128)  # K = the shared feature dim
    assert f.optimizer.param_groups[0]["lr"] == 100.0
    assert server_for("fedl2g.variant=l").optimizer.param_groups[0]["lr"] == 0.1
    assert abs(float(f.guide.weight.detach().std()) - 1) < 0.2  # N(0, 1) init


# ------------------------------------------------------------------------------------------- client


def make_client(
    *overrides: str,
    model: FedModel | None = None,
    n: int = 25,
    labels: torch.Tensor | None = None,
    cid: int = 0,
) -> FedL2GClient:
    cfg = load_config(None, ["algorithm=fedl2g", "fedl2g.warmup_rounds=3", *overrides])
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 8, 8).contiguous()  # x = index
    data = float_data(x, torch.arange(n) % 3 if labels is None else labels)
    torch.manual_seed(0)
    model = model or build_model("cnn_small", 1, 8, 3)
    return FedL2GClient(model, ClientContext(cid, cfg, 3, data, torch.bincount(data.y, minlength=3)))


def quiz_ids(client: FedL2GClient) -> list[int]:
    return [int(v) for v in client.quiz.x[:, 0, 0, 0]]


def test_client_never_trains_on_the_quiz_samples():
    client = make_client()
    assert len(quiz_ids(client)) == 10
    seen = torch.cat([x[:, 0, 0, 0] for x, _ in client.train_dataloader()])
    assert sorted(seen.tolist() + quiz_ids(client)) == list(range(25))  # disjoint, together the shard


def test_an_epoch_is_floor_n_over_b_steps_with_drop_last_as_the_paper_and_its_configs_train():
    # 25 samples: a quiz of 10 and 15 to study, in batches of 10 (paper Sec. 4: floor(n_i / 10) steps)
    kept = make_client("train.batch_size=10")
    assert [len(y) for _, y in kept.train_dataloader()] == [10, 5]
    dropped = make_client("train.batch_size=10", "train.drop_last=true")
    assert [len(y) for _, y in dropped.train_dataloader()] == [10]
    for name in ("fedl2g", "paper_fedl2g_cifar10", "paper_fedl2g_flowers102", "paper_fedl2g_tinyimagenet"):
        path = Path(__file__).parents[1] / "configs" / f"{name}.yaml"
        assert load_config(str(path), ["data.root=/nonexistent"]).train.drop_last, name


def test_paper_configs_normalise_as_pfllibs_generators_do():
    # PFLlib's generators apply ToTensor + Normalize(0.5, 0.5) to every dataset of the paper's Table 1
    for name in ("paper_fedl2g_cifar10", "paper_fedl2g_flowers102", "paper_fedl2g_tinyimagenet"):
        path = Path(__file__).parents[1] / "configs" / f"{name}.yaml"
        assert load_config(str(path), ["data.root=/nonexistent"]).data.normalize == "0.5,0.5", name


def test_quiz_on_class_sorted_data_holds_several_classes():
    # imagefolder shards are stored class by class: the first 10 samples would all be class 0
    labels = torch.tensor([0] * 12 + [1] * 12 + [2] * 12)
    client = make_client(n=36, labels=labels)
    assert len(set(client.quiz.y.tolist())) >= 2
    # fixed per (seed, client): the same client gets the same quiz, another client or seed another one
    assert quiz_ids(make_client(n=36, labels=labels)) == quiz_ids(client)
    assert quiz_ids(make_client(n=36, labels=labels, cid=1)) != quiz_ids(client)
    assert quiz_ids(make_client("seed=1", n=36, labels=labels)) != quiz_ids(client)


def test_warmup_skips_local_training():
    client = make_client("train.local_epochs=2")
    assert [client.local_epochs(r) for r in range(5)] == [0, 0, 0, 2, 2]


def test_training_step_is_ce_plus_guide_mse():
    model = tiny_mlp(torch.float32)
    client = make_client("fedl2g.variant=f", model=model)
    G = torch.randn(3, 3)
    client.receive(3, {"guide": G})
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 2, 1])
    logits, z = model.forward_with_features(x)
    expected = F.cross_entropy(logits, y) + ((z - G[y]) ** 2).mean()
    assert_close(client.training_step((x, y), 0), expected)


def test_client_upload_sends_the_meta_gradient_rows_of_its_study_classes_and_leaves_the_model_alone():
    model = FedModel(
        nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU()),
        8,
        3,
        arch="tiny",
        in_channels=1,
        image_size=8,
    )
    labels = torch.tensor([0, 2] * 12 + [0])  # 13 of class 0, 12 of class 2, class 1 held by nobody
    # 25 samples - 10 in the quiz: a study batch of 15 is the whole study set, in some order
    client = make_client("fedl2g.study_batch=15", model=model, labels=labels)
    guide = torch.randn(3, 8)
    client.receive(0, {"guide": guide})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    up = client.upload()
    after_upload = {k: v.clone() for k, v in model.state_dict().items()}
    # pi (Eqs. 5-6, checked against the JVP formula above) over the study set and the quiz, in train
    # mode: non-zero exactly in the rows of the study set's classes, and those rows are what is sent
    model.train()
    study, quiz = (client.study.x, client.study.y), (client.quiz.x, client.quiz.y)
    lr = client.ctx.cfg.train.lr
    pi = meta_gradient(model, dict(model.named_parameters()), guide, study, quiz, lr, "f")
    assert up["classes"].tolist() == [0, 2] and pi[1].abs().sum() == 0
    assert_close(up["rows"], pi[[0, 2]])
    for key, value in after_upload.items():
        assert torch.equal(value, before[key]), key
    again = client.upload()  # the study batch is a function of (seed, round, client)
    assert torch.equal(up["classes"], again["classes"]) and torch.equal(up["rows"], again["rows"])


def test_the_meta_gradient_steps_with_the_rounds_lr(monkeypatch):
    # train.lr_decay: the SGD step the meta-gradient differentiates through is the round's own
    client = make_client("train.lr=0.2", "train.lr_decay=0.5")
    client.begin_round(2, {"guide": torch.zeros(3, client.model.feature_dim)})
    seen = []

    def spy(model, params, guide, study, quiz, lr, variant):
        seen.append(lr)
        return torch.zeros_like(guide)

    monkeypatch.setattr(fedl2g_module, "meta_gradient", spy)
    client.upload()
    assert seen == [pytest.approx(0.2 * 0.5**2)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedl2g.server_lr=0"], "fedl2g.server_lr=0.0: must be > 0"),
        (["fedl2g.warmup_rounds=-1"], "fedl2g.warmup_rounds=-1: must be >= 0"),
        (["train.optimizer=adamw"], "train.optimizer=adamw with algorithm=fedl2g: the meta-gradient"),
    ],
)
def test_settings_that_break_the_algorithm_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(None, ["algorithm=fedl2g", *overrides])
    assert "\n" not in str(caught.value)
