"""FedGen's generator, its server objective and the client's two terms, against hand and loop
computations; no Ray."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient
from test_algo_fedproto import X, Y
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedgen import (
    FeatureGenerator,
    FedGenClient,
    FedGenServer,
    decayed,
    diversity_loss,
    ensemble_loss,
    label_weights,
    latent_kl,
    qualified_labels,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.seeds import torch_generator


def test_the_generator_is_a_linear_batchnorm_relu_linear_on_noise_beside_a_one_hot_label():
    g = FeatureGenerator(2, 3, 4, 5, torch.Generator().manual_seed(0))
    y, eps = torch.tensor([2, 0]), torch.tensor([[0.1, 0.9], [0.5, 0.2]])
    inputs = torch.tensor([[0.1, 0.9, 0, 0, 1], [0.5, 0.2, 1, 0, 0]])
    h = inputs @ g.hidden.weight.T + g.hidden.bias
    g.eval()  # BatchNorm's stored statistics: mean 0, variance 1 at the start
    want = F.relu(h / math.sqrt(1 + g.norm.eps) * g.norm.weight + g.norm.bias) @ g.out.weight.T + g.out.bias
    assert_close(g(y, eps), want)
    g.train()  # the batch's statistics
    hn = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + g.norm.eps)
    assert_close(g(y, eps), F.relu(hn) @ g.out.weight.T + g.out.bias)
    # PyTorch's Linear init, drawn from the given generator alone
    again = FeatureGenerator(2, 3, 4, 5, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(g.parameters(), again.parameters(), strict=True))
    assert g.hidden.weight.abs().max() <= 1 / math.sqrt(5) and g.out.weight.abs().max() <= 1 / math.sqrt(4)
    other = FeatureGenerator(2, 3, 4, 5, torch.Generator().manual_seed(1))
    assert not torch.equal(other.hidden.weight, g.hidden.weight)


def test_label_shares_are_smoothed_counts_over_the_round_and_labels_nobody_holds_are_not_trained():
    counts = torch.tensor([[3.0, 0, 1, 0], [0, 0, 2, 5]])  # two clients, four labels; label 1: nobody
    weights = label_weights(counts)
    want = torch.tensor([[4 / 5, 1 / 5], [1 / 2, 1 / 2], [2 / 5, 3 / 5], [1 / 7, 6 / 7]])
    assert_close(weights, want)
    assert qualified_labels(counts).tolist() == [0, 2, 3]


def loop_ensemble_loss(z, y, weights, heads_w, heads_b) -> float:
    """The authors' ``torch.mean(nll [B] * weight [B, 1])`` written out: the mean over every pair
    (i, j) of sample i's share times sample j's cross-entropy, summed over the heads."""
    total = 0.0
    for k in range(len(heads_w)):
        ce = []
        for j in range(len(y)):
            logits = (heads_w[k].double() @ z[j].double() + heads_b[k].double()).tolist()
            ce.append(math.log(sum(math.exp(v) for v in logits)) - logits[int(y[j])])
        pairs = [float(weights[y[i], k]) * ce[j] for i in range(len(y)) for j in range(len(y))]
        total += sum(pairs) / len(pairs)
    return total


@pytest.mark.parametrize("seed", range(3))
def test_the_ensemble_term_weighs_each_clients_cross_entropy_by_its_share_of_the_label(seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 4, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    heads_w, heads_b = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, generator=gen)
    weights = label_weights(torch.randint(0, 9, (2, 3), generator=gen).float())
    got = ensemble_loss(z, y, weights, heads_w, heads_b)
    assert_close(got, torch.tensor(loop_ensemble_loss(z, y, weights, heads_w, heads_b), dtype=torch.float32))
    # the authors' line itself (serverpFedGen.py), head by head
    authors = sum(
        torch.mean(
            F.nll_loss(F.log_softmax(z @ heads_w[k].T + heads_b[k], dim=1), y, reduction="none")
            * weights[y][:, k].reshape(-1, 1)
        )
        for k in range(2)
    )
    assert_close(got, authors)


def test_the_diversity_term_by_a_loop():
    gen = torch.Generator().manual_seed(0)
    eps, z = torch.rand(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    total = 0.0
    for i in range(5):
        for j in range(5):
            noise = sum((float(eps[i, d]) - float(eps[j, d])) ** 2 for d in range(3)) / 3
            feature = sum(abs(float(z[i, d]) - float(z[j, d])) for d in range(4)) / 4
            total += noise * feature
    assert_close(diversity_loss(eps, z), torch.tensor(math.exp(-total / 25)))
    assert diversity_loss(eps, z.mean(0).expand(5, 4)) == 1  # identical outputs: the largest value


def test_the_clients_weights_decay_by_round_to_a_floor():
    assert decayed(10.0, 0.98, 0) == 10.0
    assert decayed(10.0, 0.98, 3) == pytest.approx(10 * 0.98**3)
    assert decayed(10.0, 0.5, 40) == 1e-4


def test_the_latent_term_is_the_kl_from_the_fixed_target_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]], requires_grad=True)
    target = torch.tensor([[0.0, 2.0, 0.0], [1.0, -1.0, 0.0]], requires_grad=True)
    got = latent_kl(logits, target)
    p, log_q = F.softmax(target, 1), F.log_softmax(logits, 1)
    assert_close(got, (p * (p.log() - log_q)).sum() / 2)
    got.backward()
    assert target.grad is None and logits.grad is not None  # the target is held fixed


def server_of(*overrides: str) -> FedGenServer:
    cfg = load_config(None, ["algorithm=fedgen", "fedgen.noise_dim=2", "fedgen.hidden_dim=5", *overrides])
    return FedGenServer(ServerContext(cfg, 3, 3, ["flat_bn"] * 3, lambda cid: bn_model(cid)))


def uplinks_of(heads: list[tuple[torch.Tensor, torch.Tensor]], counts: list[list[float]], sizes: list[int]):
    uplinks = {}
    for k, ((w, b), c, n) in enumerate(zip(heads, counts, sizes, strict=True)):
        state = {name: v.clone() for name, v in bn_model(10 + k).state_dict().items()}
        state["head.weight"], state["head.bias"] = w, b
        uplinks[k] = {"model": state, "num_samples": n, "label_counts": torch.tensor(c)}
    return uplinks


def test_the_server_trains_the_generator_on_the_rounds_heads_then_averages_the_models():
    server = server_of("fedgen.generator_steps=7", "fedgen.generator_batch=6", "seed=3")
    gen = torch.Generator().manual_seed(0)
    heads = [(torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen)) for _ in range(2)]
    uplinks = uplinks_of(heads, [[4.0, 0, 1], [0, 0, 3]], [5, 15])  # label 1: nobody
    rnd = 2
    # the same steps written out: Adam at lr 3e-4 * 0.98^rnd, labels uniform over 0 and 2, U(0, 1) noise
    expected = FeatureGenerator(2, 3, 5, 3, torch_generator("fedgen/init", 3))
    assert all(
        torch.equal(a, b)
        for a, b in zip(expected.state_dict().values(), server.generator.state_dict().values())
    )
    adam = torch.optim.Adam(expected.parameters(), lr=3e-4 * 0.98**rnd, weight_decay=1e-2)
    draws = torch_generator("fedgen/generator", 3, rnd)
    weights = label_weights(torch.tensor([[4.0, 0, 1], [0, 0, 3]]))
    stacked_w, stacked_b = torch.stack([w for w, _ in heads]), torch.stack([b for _, b in heads])
    teachers, diversities = [], []
    for _ in range(7):
        y = torch.tensor([0, 2])[torch.randint(2, (6,), generator=draws)]
        eps = torch.rand(6, 2, generator=draws)
        z = expected(y, eps)
        teachers.append(ensemble_loss(z, y, weights, stacked_w, stacked_b))
        diversities.append(diversity_loss(eps, z))
        loss = teachers[-1] + diversities[-1]
        adam.zero_grad()
        loss.backward()
        adam.step()
    assert 1 not in y.tolist()
    server.generator.eval()  # left in eval mode (as after a test of it): it trains on the batch's statistics
    server.aggregate(rnd, uplinks)
    for (name, got), want in zip(server.generator.state_dict().items(), expected.state_dict().values()):
        assert_close(got, want, msg=name)
    key = "features.1.weight"  # FedAvg's mean, by train size
    assert_close(
        server.model.state_dict()[key],
        0.25 * uplinks[0]["model"][key] + 0.75 * uplinks[1]["model"][key],
    )
    assert set(server.state_dict()) == {"model", "generator", "generator_optimizer"}
    stats = server.pop_stats()  # the round's means over the steps, logged with the round's metrics
    assert stats["fedgen/teacher_loss"] == pytest.approx(
        torch.stack(teachers).detach().mean().item(), rel=1e-5
    )
    assert stats["fedgen/diversity_loss"] == pytest.approx(
        torch.stack(diversities).detach().mean().item(), rel=1e-5
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["fedgen.teacher_weight=0"],
        ["fedgen.diversity_weight=0"],
        ["fedgen.teacher_weight=3", "fedgen.diversity_weight=2"],
    ],
)
def test_each_term_of_the_generators_objective_counts_with_its_weight(overrides):
    # one step at a time, against the same step with the weights applied by hand
    server = server_of("fedgen.generator_steps=1", "train.batch_size=5", *overrides)  # 5 labels a step
    gen = torch.Generator().manual_seed(2)
    heads = [(torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen))]
    uplinks = uplinks_of(heads, [[1.0, 2, 3]], [4])
    hp = server.hp
    expected = FeatureGenerator(2, 3, 5, 3, torch_generator("fedgen/init", 0))
    adam = torch.optim.Adam(expected.parameters(), lr=3e-4, weight_decay=1e-2)
    draws = torch_generator("fedgen/generator", 0, 0)
    y = torch.arange(3)[torch.randint(3, (5,), generator=draws)]
    eps = torch.rand(5, 2, generator=draws)
    z = expected(y, eps)
    weights = label_weights(torch.tensor([[1.0, 2, 3]]))
    loss = hp.teacher_weight * ensemble_loss(z, y, weights, heads[0][0][None], heads[0][1][None])
    (loss + hp.diversity_weight * diversity_loss(eps, z)).backward()
    adam.step()
    server.aggregate(0, uplinks)
    for got, want in zip(server.generator.parameters(), expected.parameters(), strict=True):
        assert_close(got, want)


def test_training_makes_the_ensemble_recognise_the_generators_representations():
    server = server_of("fedgen.generator_lr=0.01", "fedgen.diversity_weight=0")
    heads = [(torch.eye(3) * 3, torch.zeros(3)), (torch.eye(3) * 3, torch.zeros(3))]  # class c: coordinate c
    uplinks = uplinks_of(heads, [[1.0, 1, 1], [1.0, 1, 1]], [1, 1])
    y = torch.tensor([0, 1, 2] * 4)
    eps = torch.rand(12, 2, generator=torch.Generator().manual_seed(0))
    server.generator.eval()
    before = (server.generator(y, eps).argmax(1) == y).float().mean()
    for rnd in range(4):
        server.aggregate(rnd, uplinks)
    server.generator.eval()
    assert (server.generator(y, eps).argmax(1) == y).all() and before < 1


def test_a_reloaded_server_sends_the_same_generator_and_keeps_adams_moments():
    server = server_of()
    gen = torch.Generator().manual_seed(1)
    uplinks = uplinks_of([(torch.randn(3, 3, generator=gen), torch.zeros(3))], [[2.0, 1, 0]], [3])
    server.aggregate(0, uplinks)
    resumed = server_of()
    resumed.load_state_dict(copy.deepcopy(server.state_dict()))  # a checkpoint's copy, not the live tensors
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            resumed.configure(1, [0])[0]["generator"].values(),
            server.configure(1, [0])[0]["generator"].values(),
        )
    )
    server.aggregate(1, uplinks)
    resumed.aggregate(1, uplinks)  # Adam's moments came back too: the same next round
    assert all(
        torch.equal(a, b) for a, b in zip(resumed.generator.parameters(), server.generator.parameters())
    )


def make_client(*overrides: str) -> FedGenClient:
    cfg = load_config(
        None,
        ["algorithm=fedgen", "fedgen.noise_dim=2", "fedgen.hidden_dim=5", "train.batch_size=4",
         "fedgen.synthetic_batch=6", "fedgen.alpha=2", "fedgen.beta=3", *overrides],
    )  # fmt: skip
    counts = torch.tensor([2, 0, 2])
    return FedGenClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y), class_counts=counts))


def test_round_zero_is_plain_cross_entropy_and_the_upload_carries_the_class_counts():
    server, client = server_of(), make_client()
    client.begin_round(0, server.configure(0, [0])[0])
    assert_close(client.training_step((X, Y), 0), F.cross_entropy(client.model(X), Y))
    up = client.upload()
    assert set(up) == {"model", "num_samples", "label_counts"} and up["label_counts"].tolist() == [2, 0, 2]


@pytest.mark.parametrize(("rnd", "rows"), [(1, 4), (3, 4), (3, 3)])
def test_later_rounds_add_the_generated_cross_entropy_and_the_latent_kl_with_decayed_weights(rnd, rows):
    server, client = server_of(), make_client()
    client.begin_round(rnd, server.configure(rnd, [0])[0])
    x, y = X[:rows], Y[:rows]  # a last, shorter batch keeps the configured batch size's ratio
    torch.manual_seed(11)
    loss = client.training_step((x, y), 0)
    got = torch.autograd.grad(loss, list(client.model.parameters()))
    # the same draws, in the same order, by hand: six labels, then G(y)'s noise, then G(drawn)'s
    torch.manual_seed(11)
    drawn = torch.randint(3, (6,))
    g, head = server.generator.eval(), client.model.head
    with torch.no_grad():
        target = head(g(y, torch.rand(rows, 2)))
        z_drawn = g(drawn, torch.rand(6, 2))
    generated = F.cross_entropy(head(z_drawn), drawn)
    logits = client.model(x)
    p = F.softmax(target, 1)
    kl = (p * (p.log() - F.log_softmax(logits, 1))).sum() / rows
    a, b = 2 * 0.98**rnd, 3 * 0.98**rnd
    want = F.cross_entropy(logits, y) + 6 / 4 * a * generated + b * kl
    assert_close(loss, want)
    # and its gradient: both terms train the model (the KL through the real samples' predictions)
    for g_got, g_want in zip(got, torch.autograd.grad(want, list(client.model.parameters())), strict=True):
        assert_close(g_got, g_want)


def test_the_client_draws_from_the_servers_generator_and_never_trains_it():
    server = server_of()
    with torch.no_grad():
        for p in server.generator.parameters():
            p.add_(0.5)
        server.generator.norm.running_mean.fill_(0.3)
    client = make_client("train.lr=0.5")
    client.begin_round(1, server.configure(1, [0])[0])
    assert all(
        torch.equal(a, b)
        for a, b in zip(client.generator.state_dict().values(), server.generator.state_dict().values())
    )
    assert not client.generator.training  # BatchNorm reads the server's statistics
    optimizer = client.configure_optimizers()
    before = [p.clone() for p in client.generator.parameters()]
    head = client.model.head.weight.clone()
    client.training_step((X, Y), 0).backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(client.generator.parameters(), before))
    assert not torch.equal(client.model.head.weight, head)


def test_a_run_logs_the_generators_losses_each_round(mlflow_store):
    cfg = load_config(None, ["algorithm=fedgen", *tiny_overrides(rounds=2)])
    result = run_experiment(cfg)
    assert all(h["fedgen/teacher_loss"] > 0 and 0 < h["fedgen/diversity_loss"] <= 1 for h in result.history)
    logged = MlflowClient().get_metric_history(result.run_id, "fedgen/teacher_loss")
    assert sorted(m.step for m in logged) == [1, 2]
    assert [m.value for m in sorted(logged, key=lambda m: m.step)] == [
        h["fedgen/teacher_loss"] for h in result.history
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["fedgen.generator_batch=1"],
            r"fedgen.generator_batch=1: the server's generator batch \(1\) must be >= 2",
        ),
        (
            ["train.batch_size=1"],
            r"fedgen.generator_batch=None: the server's generator batch \(1\) must be >= 2",
        ),
        (["fedgen.noise_dim=0"], "fedgen.noise_dim=0: must be >= 1"),
        (["fedgen.generator_lr=0"], "fedgen.generator_lr=0.0: must be > 0"),
        (["fedgen.alpha=-1"], "fedgen.alpha=-1.0: must be >= 0"),
        (["model.group=small_hetero"], "fedgen"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedgen", *overrides])
