"""FedAvg and FedProx math, checked against hand computations; no Ray, no Lightning trainer."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.fedavg import FedAvgServer
from fedray.algorithms.fedprox import proximal_term
from fedray.platform.api import averaging
from fedray.platform.api.algorithm import ServerContext
from fedray.platform.api.averaging import AVERAGE_BLOCK, RunningMean, weighted_average
from fedray.platform.catalog import load_config
from fedray.platform.errors import ContractError
from fedray.platform.models import FedModel


def test_weighted_average_matches_hand_computation():
    # Prepare: two clients with 1 and 3 samples -> weights 0.25 and 0.75
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0]), "n": torch.tensor(7)}
    b = {"w": torch.tensor([5.0, -2.0]), "b": torch.tensor([4.0]), "n": torch.tensor(9)}
    # Execute
    out = weighted_average([a, b], [1, 3])
    # Assert: 0.25*1 + 0.75*5 = 4.0 ; 0.25*2 + 0.75*(-2) = -1.0 ; 0.25*0 + 0.75*4 = 3.0
    assert_close(out["w"], torch.tensor([4.0, -1.0]))
    assert_close(out["b"], torch.tensor([3.0]))
    assert out["n"].item() == 7  # integer buffers are not averaged
    assert out["w"].dtype == torch.float32
    assert list(out) == ["w", "b", "n"]


def test_weighted_average_equal_weights_is_plain_mean():
    states = [{"w": torch.full((3,), float(i))} for i in range(4)]
    assert_close(weighted_average(states, [2, 2, 2, 2])["w"], torch.full((3,), 1.5))


def random_states(seed: int, shapes: dict, count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            k: torch.randn(shape, generator=gen) if k != "steps" else torch.tensor(i)
            for k, shape in shapes.items()
        }
        for i in range(count)
    ]


def independent_mean(states, weights, key):
    """Each whole tensor added in float64 in the given order, divided by the total, cast back."""
    acc = torch.zeros(states[0][key].shape, dtype=torch.float64)
    for state, weight in zip(states, weights, strict=True):
        acc.add_(state[key], alpha=weight)
    return (acc / float(sum(weights))).float()


def test_weighted_average_over_blocks_is_the_whole_tensor_sum_bit_for_bit():
    # an entry of two blocks and a remainder, in a 2-d shape, and one smaller than a block
    shapes = {"big": (3, AVERAGE_BLOCK - 5), "small": (7,)}
    states = random_states(0, shapes, 5)
    weights = [3, 1, 4, 1, 5]
    out = weighted_average(states, weights)
    for key, shape in shapes.items():
        assert out[key].shape == shape and out[key].is_contiguous()
        assert torch.equal(out[key], independent_mean(states, weights, key)), key


def test_weighted_average_on_threads_is_the_one_thread_sum_bit_for_bit(monkeypatch):
    """Blocks summed on several threads at once give the bits one thread gives, keys in order."""
    shapes = {"conv": (4, 3, 5, 5), "fc": (5, AVERAGE_BLOCK + 7), "steps": ()}
    states = random_states(1, shapes, 6)
    weights = [5, 1, 2, 9, 3, 4]
    monkeypatch.setattr(averaging, "AVERAGE_THREADS", 1)
    alone = weighted_average(states, weights)
    submitted = []
    monkeypatch.setattr(averaging, "AVERAGE_THREADS", 4)
    real_pool = averaging.average_pool()  # (started once per process, with AVERAGE_THREADS threads)

    class Counted:
        def submit(self, fn, jobs):
            submitted.append(len(jobs))
            return real_pool.submit(fn, jobs)

    monkeypatch.setattr(averaging, "AVERAGE_THREADS", 4)
    monkeypatch.setattr(averaging, "usable_cpus", lambda: 8)  # a 1-CPU CI too
    monkeypatch.setattr(averaging, "average_pool", Counted)
    threaded = weighted_average(states, weights)
    assert sorted(submitted) == [1, 2, 2, 2]  # the fc entry's 6 blocks and conv's 1 over four threads
    assert list(threaded) == list(alone) == list(shapes)
    for key in shapes:
        assert torch.equal(threaded[key], alone[key]), key
    assert threaded["steps"].item() == 0  # the first state's integer buffer

    def broken(*args, **kwargs):
        raise RuntimeError("a block failed")

    monkeypatch.setattr(torch.Tensor, "add_", broken)
    with pytest.raises(RuntimeError, match="a block failed"):  # an error in a thread is not lost
        weighted_average(states, weights)


def test_a_mean_summed_in_parts_has_the_bits_of_one_sum():
    """States added as they arrive (1, then 3, the last one by ``mean``) give exactly the one-call
    mean; ``mean`` adds only what was not added under the same tag, then starts afresh."""
    shapes = {"conv": (2, 3, 3), "fc": (2, AVERAGE_BLOCK + 3), "steps": ()}
    states = random_states(2, shapes, 5)
    weights = [7.0, 2.0, 9.0, 4.0, 3.0]
    weighted = {10 + i: (s, w) for i, (s, w) in enumerate(zip(states, weights, strict=True))}
    whole = weighted_average(states, weights)
    running = RunningMean()
    running.add(3, {10: weighted[10]})
    running.add(3, {k: weighted[k] for k in (11, 12, 13)})
    assert [key for key, _, _ in running.added] == [10, 11, 12, 13]
    added_by_mean = []
    real_add = running.add
    running.add = lambda tag, part, threads=1: (
        added_by_mean.append(list(part)) or real_add(tag, part, threads)
    )
    parts = running.mean(3, weighted)
    assert added_by_mean == [[14]]  # the four summed early are not summed again
    for key in shapes:
        assert torch.equal(parts[key], whole[key]), key
    assert running.added == [] and running.sums == {}  # cleared for the next round
    del running.add
    # the same keys, another state (a subclass that clipped its uplinks first): summed afresh
    running.add(6, {10: weighted[10]})
    clipped = {10: ({k: v.clamp(-0.1, 0.1) for k, v in states[0].items()}, weights[0]), 11: weighted[11]}
    assert torch.equal(
        running.mean(6, clipped)["fc"], weighted_average([clipped[10][0], states[1]], weights[:2])["fc"]
    )
    # what was added is not a prefix of the mean's states (a client left out), or under another
    # tag (last round's): the sum starts again from the states given
    running.add(4, {10: weighted[10], 12: weighted[12]})
    some = {k: weighted[k] for k in (10, 11, 12)}
    assert torch.equal(running.mean(4, some)["fc"], weighted_average(states[:3], weights[:3])["fc"])
    running.add(4, {10: weighted[10]})
    assert torch.equal(running.mean(5, some)["fc"], weighted_average(states[:3], weights[:3])["fc"])


def test_a_mean_of_weights_summing_to_zero_is_refused():
    with pytest.raises(ValueError, match="weights sum to 0"):
        weighted_average([{"w": torch.ones(2)}], [0])


def test_fedavg_server_aggregates_the_same_with_or_without_early_uplinks():
    """``uplinks_arrived`` in parts then ``aggregate``, against ``aggregate`` alone: the same model;
    the running sum is not server state (no ContractError from state_dict, only ``model`` saved)."""
    cfg = load_config(None, ["algorithm=fedavg", "data.num_clients=4"])

    def tiny_model(seed: int) -> FedModel:  # float parameters and buffers, and BatchNorm's int counter
        torch.manual_seed(seed)
        return FedModel(
            nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), 3, 2, arch="tiny", in_channels=1, image_size=2
        )

    def server() -> FedAvgServer:
        return FedAvgServer(ServerContext(cfg, 4, 2, ["tiny"] * 4, tiny_model))

    states = [{k: v.clone() for k, v in tiny_model(seed).state_dict().items()} for seed in (1, 2, 3)]
    uplinks = {c: {"model": states[i], "num_samples": 10 * (i + 1)} for i, c in enumerate((0, 2, 3))}
    alone, early = server(), server()
    alone.aggregate(1, uplinks)
    early.uplinks_arrived(1, {0: uplinks[0]})
    early.uplinks_arrived(1, {2: uplinks[2]})
    early.aggregate(1, uplinks)
    expected = weighted_average(states, [10, 20, 30])
    for key, value in alone.model.state_dict().items():
        assert torch.equal(value, expected[key]) and torch.equal(early.model.state_dict()[key], value), key
    assert list(early.state_dict()) == ["model"]
    # a sum still held when a checkpoint is taken would be lost on resume: refused
    early.uplinks_arrived(2, {0: uplinks[0]})
    with pytest.raises(ContractError, match=r"FedAvgServer\.summed still holds a sum"):
        early.state_dict()


def test_proximal_term_value_by_hand():
    # ||(1,2,3)-(0,0,1)||^2 = 1 + 4 + 4 = 9
    assert proximal_term(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0])).item() == 9.0


def test_proximal_gradient_is_mu_times_distance():
    mu = 0.3
    w = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    w0 = torch.tensor([0.5, 1.0, 0.5])
    (mu / 2 * proximal_term(w, w0)).backward()
    assert_close(w.grad, mu * (w.detach() - w0))


def test_fedprox_with_mu_zero_trains_exactly_like_fedavg():
    from fedray.algorithms.fedavg import FedAvgClient
    from fedray.algorithms.fedprox import FedProxClient, FedProxConfig
    from fedray.platform.api.algorithm import ClientContext
    from fedray.platform.catalog import load_config
    from fedray.platform.data import ArrayDataset
    from fedray.platform.models import build_model

    cfg = load_config(None, ["algorithm=fedprox", "fedprox.mu=0.0"])
    assert isinstance(cfg.algo, FedProxConfig)
    torch.manual_seed(0)
    data = ArrayDataset(torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,)))

    def one_step(cls):
        torch.manual_seed(1)
        model = build_model("cnn_small", 1, 8, 10)
        client = cls(model, ClientContext(0, cfg, 10, data))
        client.receive(0, {"model": model.state_dict()})
        opt = client.configure_optimizers()
        loss = client.training_step((data.x, data.y), 0)
        loss.backward()
        opt.step()
        return model.state_dict()

    prox, avg = one_step(FedProxClient), one_step(FedAvgClient)
    for key in avg:
        assert torch.equal(prox[key], avg[key]), key


def test_fedprox_client_adds_half_mu_times_the_squared_distance_from_the_round_model():
    from fedray.algorithms.fedprox import FedProxClient
    from fedray.platform.api.algorithm import ClientContext
    from fedray.platform.catalog import load_config
    from fedray.platform.data import ArrayDataset
    from fedray.platform.models import build_model

    cfg = load_config(None, ["algorithm=fedprox", "fedprox.mu=0.4"])
    torch.manual_seed(0)
    data = ArrayDataset(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
    model = build_model("cnn_small", 1, 8, 10)
    client = FedProxClient(model, ClientContext(0, cfg, 10, data))
    round_model = {k: v.clone() for k, v in model.state_dict().items()}
    client.receive(0, {"model": round_model})
    batch = (data.x, data.y)
    ce = torch.nn.functional.cross_entropy(model(data.x), data.y)
    assert_close(client.training_step(batch, 0), ce)  # at w^t the term is 0
    with torch.no_grad():  # a local step moved two weights: by 0.5 everywhere, and by -1 everywhere
        model.head.bias.add_(0.5)
        model.head.weight.sub_(1.0)
    moved = 0.5**2 * model.head.bias.numel() + 1.0**2 * model.head.weight.numel()
    ce = torch.nn.functional.cross_entropy(model(data.x), data.y)
    assert_close(client.training_step(batch, 1), ce + 0.4 / 2 * moved)
    client.receive(1, {"model": {k: v.clone() for k, v in model.state_dict().items()}})
    assert_close(client.training_step(batch, 0), ce)  # the next round's anchor is its own downlink
