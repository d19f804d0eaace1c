"""FedCDA's selection objective, its batch-wise search and its server and client halves, against
direct and brute-force computations; no Ray."""

import io
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X, Y
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedcda import (
    FedCDAClient,
    FedCDAServer,
    SelectionPool,
    cut_into_batches,
    select_by_batches,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.storage import torch_bytes
from fedray.platform.seeds import numpy_rng

KEYS = ["a", "b"]  # the "parameters"; "stat" stands for a BatchNorm statistic, outside the norms


def random_states(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "a": torch.randn(3, generator=gen),
            "b": torch.randn(2, 2, generator=gen),
            "stat": torch.randn(4, generator=gen),
        }
        for _ in range(n)
    ]


def flat(state) -> torch.Tensor:
    return torch.cat([state[k].reshape(-1) for k in KEYS]).double()


def direct_objective(states, losses, smoothness: float) -> float:
    """The paper's form: (1/M) sum (F + L/2 ||w||^2) - L/2 ||mean w||^2, on explicit vectors."""
    w = torch.stack([flat(s) for s in states])
    m = len(states)
    return float(
        sum(f + smoothness / 2 * float(v @ v) for f, v in zip(losses, w, strict=True)) / m
        - smoothness / 2 * float(w.mean(0) @ w.mean(0))
    )


def test_the_objective_is_the_mean_loss_plus_half_l_times_the_spread_around_the_mean():
    states, losses = random_states(5, 0), [0.3, 0.1, 0.7, 0.2, 0.5]
    pool = SelectionPool.of(states[2:], losses[2:], states[:2], losses[:2], KEYS)
    got = pool.objective([0, 1, 2], 0.8)
    assert got == pytest.approx(direct_objective(states, losses, 0.8), rel=1e-12)
    w = torch.stack([flat(s) for s in states])
    spread = float(((w - w.mean(0)) ** 2).sum(1).mean())
    assert got == pytest.approx(np.mean(losses) + 0.4 * spread, rel=1e-12)
    # a subset of the candidates: only those, beside the fixed ones
    assert pool.objective([1], 0.8) == pytest.approx(
        direct_objective([states[0], states[1], states[3]], [0.3, 0.1, 0.2], 0.8), rel=1e-12
    )
    # no fixed models at all (full participation, the first batch)
    alone = SelectionPool.of(states, losses, [], [], KEYS)
    assert alone.objective([4, 0], 1.0) == pytest.approx(
        direct_objective([states[4], states[0]], [0.5, 0.3], 1.0)
    )


def test_the_objectives_of_many_combinations_at_once_are_each_ones():
    states = random_states(7, 1)
    losses = [0.1 * i for i in range(7)]
    pool = SelectionPool.of(states[1:], losses[1:], states[:1], losses[:1], KEYS)
    combinations = torch.tensor([[0, 3], [4, 5], [2, 2]])
    got = pool.objectives([1], combinations, 2.0)
    for row, value in zip(combinations.tolist(), got.tolist(), strict=True):
        assert value == pytest.approx(pool.objective([1, *row], 2.0), rel=1e-12)


def brute_force(states, losses, fixed_states, fixed_losses, batches, smoothness):
    """Eq. 8 written out: each batch's combinations scored by the direct objective over the fixed
    models, the batches before it and the combination; the first lowest kept."""
    chosen: list[int] = []
    for batch in batches:
        best, best_value = None, float("inf")
        for combination in itertools.product(*batch):
            picked = [*chosen, *combination]
            value = direct_objective(
                fixed_states + [states[i] for i in picked],
                fixed_losses + [losses[i] for i in picked],
                smoothness,
            )
            if value < best_value:
                best, best_value = combination, value
        chosen.extend(best)
    return chosen


@pytest.mark.parametrize("seed", range(4))
def test_the_batchwise_search_is_the_brute_force_one(seed):
    # five clients of the round with three cached models each (candidates 3c .. 3c+2), two fixed clients
    states = random_states(17, seed)
    gen = torch.Generator().manual_seed(100 + seed)
    losses = (torch.rand(17, generator=gen) * 3).tolist()  # losses large enough to matter against the spread
    fixed_states, fixed_losses, candidates = states[15:], losses[15:], states[:15]
    batches = [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]], [[12, 13, 14]]]
    pool = SelectionPool.of(candidates, losses[:15], fixed_states, fixed_losses, KEYS)
    got = select_by_batches(pool, batches, 1.0)
    assert got == brute_force(candidates, losses[:15], fixed_states, fixed_losses, batches, 1.0)
    one_batch = [[c for b in batches for c in b]]  # B = 1: the exact search over the round's clients
    exact = select_by_batches(pool, one_batch, 1.0)
    assert exact == brute_force(candidates, losses[:15], fixed_states, fixed_losses, one_batch, 1.0)
    assert pool.objective(exact, 1.0) <= pool.objective(got, 1.0) + 1e-12


def test_a_tie_keeps_the_first_combination_the_newest_model():
    same = random_states(1, 0)[0]
    pool = SelectionPool.of([same, same], [0.2, 0.2], [], [], KEYS)
    assert select_by_batches(pool, [[[1, 0]]], 1.0) == [1]


def test_clients_are_cut_into_near_equal_batches_in_a_drawn_order():
    batches = cut_into_batches([3, 5, 8, 9], 3, np.random.default_rng(0))
    assert [len(b) for b in batches] == [2, 1, 1] and sorted(itertools.chain(*batches)) == [3, 5, 8, 9]
    assert cut_into_batches([3, 5, 8, 9], 3, np.random.default_rng(0)) == batches
    assert len(cut_into_batches([1, 2], 3, np.random.default_rng(0))) == 2  # no empty batch
    orders = {
        tuple(itertools.chain(*cut_into_batches(list(range(6)), 2, np.random.default_rng(s))))
        for s in range(5)
    }
    assert len(orders) > 1  # the order is drawn


def server_of(*overrides: str, clients: int = 3) -> FedCDAServer:
    cfg = load_config(None, ["algorithm=fedcda", "fedcda.warmup_rounds=1", "fedcda.cache_size=2", *overrides])
    return FedCDAServer(ServerContext(cfg, clients, 3, ["flat_bn"] * clients, lambda cid: bn_model(cid)))


def uplink(seed: int, loss: float, samples: int = 4) -> dict:
    state = dict(bn_model(seed).state_dict())
    state["features.2.num_batches_tracked"] = torch.tensor(seed)  # tells the models' counters apart
    return {"model": state, "num_samples": samples, "train_loss": loss}


def test_the_warmup_is_fedavg_and_every_client_keeps_its_last_k_uploads():
    server = server_of("fedcda.warmup_rounds=3")
    ups = {0: uplink(10, 0.5, samples=1), 1: uplink(11, 0.4, samples=3)}
    server.uplinks_arrived(0, ups)
    server.aggregate(0, ups)
    key = "features.1.weight"
    assert_close(server.model.state_dict()[key], 0.25 * ups[0]["model"][key] + 0.75 * ups[1]["model"][key])
    assert server.selected == {0: 0, 1: 0} and server.cache_losses == {0: [0.5], 1: [0.4]}
    for rnd, seed in ((1, 20), (2, 30)):
        server.aggregate(rnd, {0: uplink(seed, 0.1)})
    assert len(server.cache[0]) == 2 and server.cache_losses[0] == [0.1, 0.1]  # K = 2: the first one left
    assert server.selected[0] == 1  # the newest, during the warm-up
    assert torch.equal(server.cache[0][0][key], bn_model(20).state_dict()[key])


def test_after_the_warmup_the_model_is_the_plain_mean_of_every_seen_clients_selected_model():
    server = server_of()
    server.aggregate(0, {0: uplink(10, 0.9), 1: uplink(11, 0.2), 2: uplink(12, 0.3)})
    ups = {0: uplink(20, 0.1, samples=100), 1: uplink(21, 0.8, samples=1)}  # client 2 sits this round out
    server.uplinks_arrived(1, ups)  # no FedAvg sum after the warm-up: a checkpoint can be taken
    server.aggregate(1, ups)
    # the selection, written out: batches drawn from the round's stream, client 2's model fixed
    batches = cut_into_batches([0, 1], 3, numpy_rng("fedcda/batches", 0, 1))
    states = {
        0: [uplink(10, 0)["model"], uplink(20, 0)["model"]],
        1: [uplink(11, 0)["model"], uplink(21, 0)["model"]],
    }
    losses = {0: [0.9, 0.1], 1: [0.2, 0.8]}
    keys = [k for k, _ in bn_model(0).named_parameters()]
    flat_keys = lambda s: torch.cat([s[k].reshape(-1) for k in keys]).double()  # noqa: E731
    # brute force over each batch in turn, as Eq. 8 says (slots newest first)
    chosen: dict[int, int] = {}
    fixed = [(uplink(12, 0)["model"], 0.3)]
    for batch in batches:
        best, best_value = None, float("inf")
        for slots in itertools.product(*[[1, 0]] * len(batch)):
            members = fixed + [(states[c][chosen[c]], losses[c][chosen[c]]) for c in chosen]
            members += [(states[c][s], losses[c][s]) for c, s in zip(batch, slots, strict=True)]
            w = torch.stack([flat_keys(m) for m, _ in members])
            value = np.mean([f for _, f in members]) + 0.5 * float(((w - w.mean(0)) ** 2).sum(1).mean())
            if value < best_value:
                best, best_value = slots, value
        chosen.update(zip(batch, best, strict=True))
    assert server.selected == {**chosen, 2: 0}
    selected = [states[0][chosen[0]], states[1][chosen[1]], uplink(12, 0)["model"]]
    for key in ("features.1.weight", "features.2.running_mean"):  # unweighted, statistics too
        assert_close(server.model.state_dict()[key], sum(s[key] for s in selected) / 3)
    counter = "features.2.num_batches_tracked"  # an integer: the lowest client id's, as FedAvg's
    assert torch.equal(server.model.state_dict()[counter], selected[0][counter])
    assert set(server.state_dict()) == {"model", "cache", "cache_losses", "selected"}


def moved(key: str, by: float, loss: float) -> dict:
    """The base model (``bn_model(0)``) with ``by`` added to every entry of ``key``, uploaded with ``loss``."""
    state = {k: v.clone() for k, v in bn_model(0).state_dict().items()}
    state[key] += by
    return {"model": state, "num_samples": 4, "train_loss": loss}


@pytest.mark.parametrize(
    ("key", "by", "slot"),
    [
        # a newer model 4 away (squared, over 3 weights: D = 0.75 * 4 * 3) from the two fixed clients: the
        # spread outweighs its lower loss (J rises by D/9 - 0.5/3), the older model is kept
        ("features.2.weight", 2.0, 0),
        ("features.2.weight", 0.2, 1),  # near: the lower loss wins
        ("features.2.running_mean", 2.0, 1),  # a statistic, outside the norms: the lower loss wins
    ],
)
def test_the_fixed_clients_and_the_parameters_alone_decide_the_selection(key, by, slot):
    server = server_of()
    base = moved(key, 0.0, 0.5)
    server.aggregate(0, {0: base, 1: moved(key, 0.0, 0.3), 2: moved(key, 0.0, 0.3)})
    server.aggregate(1, {0: moved(key, by, 0.0)})  # clients 1 and 2 sit out: fixed at the base model
    assert server.selected == {0: slot, 1: 0, 2: 0}


def test_a_client_out_of_the_round_counts_with_its_selected_model_not_its_newest():
    server = server_of()
    key = "features.2.weight"
    server.aggregate(0, {0: moved(key, 0.0, 0.5), 1: moved(key, 0.0, 0.3), 2: moved(key, 0.0, 0.3)})
    server.aggregate(1, {0: moved(key, 2.0, 0.0)})  # too far from the others: client 0 keeps the base model
    assert server.selected[0] == 0
    # client 1 alone: beside client 0's base model (selected) and client 2's, its far model loses; beside
    # client 0's far one (its newest), both of client 1's would spread alike and the lower loss would win
    server.pop_stats()
    server.aggregate(2, {1: moved(key, 2.0, 0.0)})
    assert server.selected == {0: 0, 1: 0, 2: 0}
    stats = server.pop_stats()  # logged with the round: one of its one client kept an older model, and J
    assert stats["fedcda/kept_older"] == 1
    assert stats["fedcda/objective"] == pytest.approx(
        np.mean([0.5, 0.3, 0.3])
    )  # three equal models: no spread


def test_the_round_batches_follow_the_seed_and_the_round():
    server = server_of("seed=5", clients=6)
    got = server.batches_of(4, [0, 1, 2, 3, 4, 5])
    assert got == cut_into_batches([0, 1, 2, 3, 4, 5], 3, numpy_rng("fedcda/batches", 5, 4))
    others = {tuple(itertools.chain(*server.batches_of(rnd, list(range(6))))) for rnd in range(5)}
    others |= {
        tuple(itertools.chain(*server_of(f"seed={s}", clients=6).batches_of(4, list(range(6)))))
        for s in range(5)
    }
    assert len(others) > 2


def test_ties_between_several_clients_keep_the_newest_of_each():
    same = random_states(1, 0)[0]
    pool = SelectionPool.of([same] * 4, [0.2] * 4, [], [], KEYS)
    assert select_by_batches(pool, [[[1, 0], [3, 2]]], 1.0) == [1, 3]


def test_a_tie_between_a_clients_models_keeps_its_newest():
    server = server_of()
    server.aggregate(0, {0: moved("features.1.weight", 0.0, 0.5), 1: moved("features.1.weight", 0.5, 0.2)})
    server.aggregate(1, {0: moved("features.1.weight", 0.0, 0.5)})  # the same model and loss again
    assert server.selected[0] == 1


def test_a_reloaded_server_selects_and_averages_the_same():
    server = server_of("seed=4")
    server.aggregate(0, {0: uplink(10, 0.9), 1: uplink(11, 0.2)})
    sent = uplink(20, 0.1)
    server.aggregate(1, {0: sent, 1: uplink(21, 0.8)})
    with torch.no_grad():
        sent["model"]["features.1.weight"].add_(1.0)  # the round's payload reused: the cache has its own
    assert torch.equal(
        server.cache[0][-1]["features.1.weight"], bn_model(20).state_dict()["features.1.weight"]
    )
    resumed = server_of("seed=4")
    saved = torch.load(io.BytesIO(torch_bytes(server.state_dict())), weights_only=True)  # as a checkpoint
    resumed.load_state_dict(saved)
    for s in (server, resumed):
        s.aggregate(2, {0: uplink(30, 0.5), 1: uplink(31, 0.05), 2: uplink(32, 0.4)})
    assert resumed.selected == server.selected
    assert all(
        torch.equal(a, b)
        for a, b in zip(resumed.model.state_dict().values(), server.model.state_dict().values())
    )


def test_the_client_uploads_its_mean_loss_over_the_last_epoch_alone():
    cfg = load_config(None, ["algorithm=fedcda", "train.local_epochs=3"])
    client = FedCDAClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))
    client.begin_round(0, {"model": bn_model(1).state_dict()})
    for epoch in (0, 1):  # not counted
        client.__dict__["_fit_epoch"] = epoch
        client.training_step((X, Y), 0)
    client.__dict__["_fit_epoch"] = 2  # the last of three epochs, as the worker's loop counts them
    first, second = (X[:3], Y[:3]), (X[3:], Y[3:])
    l1 = F.cross_entropy(client.model(first[0]), first[1]).detach()
    client.training_step(first, 0)
    client.model.eval()  # BatchNorm: one sample has no batch statistics
    l2 = F.cross_entropy(client.model(second[0]), second[1]).detach()
    client.training_step(second, 1)
    up = client.upload()
    assert up["train_loss"] == pytest.approx((3 * l1.item() + l2.item()) / 4, rel=1e-6)
    assert set(up) == {"model", "num_samples", "train_loss"}
    client.begin_round(1, {"model": bn_model(1).state_dict()})  # a new round starts from nothing
    assert float(client.last_epoch_loss) == 0 and client.last_epoch_samples == 0


def test_a_client_that_trained_no_batch_reports_its_models_loss_on_its_training_data():
    cfg = load_config(None, ["algorithm=fedcda"])
    client = FedCDAClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))
    client.begin_round(0, {"model": bn_model(1).state_dict()})  # no training_step: drop_last left none
    client.model.eval()
    want = F.cross_entropy(client.model(X), Y).item()
    client.model.train()
    assert client.upload()["train_loss"] == pytest.approx(want, rel=1e-6)


def test_a_search_too_large_for_a_round_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"3\^20 combinations a batch"):
        load_config(
            None, ["algorithm=fedcda", "data.num_clients=20", "train.fraction=1.0", "fedcda.num_batches=1"]
        )
    load_config(None, ["algorithm=fedcda", "data.num_clients=20", "train.fraction=1.0"])  # 3^7 a batch: fine


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedcda.cache_size=0"], "fedcda.cache_size=0: must be >= 1"),
        (["fedcda.num_batches=0"], "fedcda.num_batches=0: must be >= 1"),
        (["fedcda.smoothness=-1"], "fedcda.smoothness=-1.0: must be >= 0"),
        (["fedcda.warmup_rounds=-1"], "fedcda.warmup_rounds=-1: must be >= 0"),
        (["model.group=small_hetero"], "fedcda"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedcda", *overrides])
