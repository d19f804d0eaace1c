"""FedAvg and FedProx math, checked against hand computations; no Ray, no Lightning trainer."""

import pytest
import torch
from torch.testing import assert_close

from fedray.algorithms.fedavg import AVERAGE_BLOCK, weighted_average
from fedray.algorithms.fedprox import proximal_term


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


def test_weighted_average_equal_weights_is_plain_mean():
    states = [{"w": torch.full((3,), float(i))} for i in range(4)]
    assert_close(weighted_average(states, [2, 2, 2, 2])["w"], torch.full((3,), 1.5))


def test_weighted_average_over_blocks_is_the_whole_tensor_sum_bit_for_bit():
    # an entry of two blocks and a remainder, in a 2-d shape, and one smaller than a block
    gen = torch.Generator().manual_seed(0)
    shapes = {"big": (3, AVERAGE_BLOCK - 5), "small": (7,)}
    states = [{k: torch.randn(shape, generator=gen) for k, shape in shapes.items()} for _ in range(5)]
    weights = [3, 1, 4, 1, 5]
    out = weighted_average(states, weights)
    for key, shape in shapes.items():
        # independently: each whole tensor added in float64 in the given order, then cast back
        acc = torch.zeros(shape, dtype=torch.float64)
        for state, weight in zip(states, weights, strict=True):
            acc.add_(state[key], alpha=weight / sum(weights))
        assert out[key].shape == shape and out[key].is_contiguous()
        assert torch.equal(out[key], acc.float()), key


def test_weighted_average_on_threads_is_the_one_thread_sum_bit_for_bit(monkeypatch):
    """Blocks summed on several threads at once give the bits one thread gives, keys in order."""
    import fedray.algorithms.fedavg as fedavg

    gen = torch.Generator().manual_seed(1)
    shapes = {"conv": (4, 3, 5, 5), "fc": (5, AVERAGE_BLOCK + 7), "steps": ()}
    states = [
        {
            k: torch.randn(shape, generator=gen) if k != "steps" else torch.tensor(i)
            for k, shape in shapes.items()
        }
        for i in range(6)
    ]
    weights = [5, 1, 2, 9, 3, 4]
    monkeypatch.setattr(fedavg, "AVERAGE_THREADS", 1)
    alone = weighted_average(states, weights)
    started = []
    real_executor = fedavg.ThreadPoolExecutor

    def counted(threads, **kwargs):
        started.append(threads)
        return real_executor(threads, **kwargs)

    monkeypatch.setattr(fedavg, "AVERAGE_THREADS", 4)
    monkeypatch.setattr(fedavg, "usable_cpus", lambda: 8)  # a 1-CPU CI too
    monkeypatch.setattr(fedavg, "ThreadPoolExecutor", counted)
    threaded = weighted_average(states, weights)
    assert started == [4]  # the fc entry's 6 blocks and conv's 1: four threads
    assert list(threaded) == list(alone) == list(shapes)
    for key in shapes:
        assert torch.equal(threaded[key], alone[key]), key
    assert threaded["steps"].item() == 0  # the first state's integer buffer

    def broken(*args, **kwargs):
        raise RuntimeError("a block failed")

    monkeypatch.setattr(torch.Tensor, "add_", broken)
    with pytest.raises(RuntimeError, match="a block failed"):  # an error in a thread is not lost
        weighted_average(states, weights)


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
