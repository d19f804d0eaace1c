"""SCAFFOLD (Alg. 1, option II) checked against an independent computation; no Ray.

The client runs through the worker's real training loop on a linear softmax classifier; the expected
values come from plain autograd on the classifier's own tensors, step by step as Alg. 1 writes them.
"""

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X, flatten_model  # features = Flatten, head = a known Linear(4, 3)
from torch.testing import assert_close

from fedray.algorithms.scaffold import ScaffoldClient, ScaffoldServer
from fedray.platform.api.algorithm import ClientContext, ServerContext, payload_nbytes
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.local_training import LocalTraining

Y = torch.tensor([0, 0, 2, 1])
LR = 0.5
P = 4 * 3 + 3  # head.weight [3, 4] then head.bias [3], in model.parameters() order


def hand_round(
    w: torch.Tensor, b: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor, steps: int, lr: float = LR
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alg. 1's client: ``steps`` full-batch steps ``y -= lr (g(y) - c_i + c)`` from ``x = (w, b)``,
    then option II's ``c_i+ = c_i - c + (x - y) / (K lr)``. Returns ``(w, b, c_i+)``."""
    x = torch.cat([w.flatten(), b])
    y = x.clone()
    for _ in range(steps):
        y_ = y.clone().requires_grad_(True)
        logits = X.flatten(1) @ y_[:12].view(3, 4).T + y_[12:]
        (g,) = torch.autograd.grad(F.cross_entropy(logits, Y), y_)
        y = y - lr * (g - c_i + c)
    return y[:12].view(3, 4), y[12:], c_i - c + (x - y) / (steps * lr)


def make_client(*overrides: str) -> ScaffoldClient:
    cfg = load_config(
        None,
        ["algorithm=scaffold", "train.batch_size=4", f"train.lr={LR}", "train.momentum=0", *overrides],
    )
    return ScaffoldClient(flatten_model(), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_client_corrects_every_step_and_updates_its_control_variate_by_option_two(decay):
    # two epochs of one full batch: K = 2 steps a round, the shuffle changes nothing; with
    # train.lr_decay the steps and option II's 1 / (K eta_l) both take the round's lr
    client = make_client("train.local_epochs=2", f"train.lr_decay={decay}")
    loop = LocalTraining(client.ctx.cfg.train, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    c_i = torch.zeros(P)  # every client's control variate starts at 0
    x = client.model.state_dict()
    for rnd in range(3):
        c = torch.randn(P, generator=gen)  # the server's control variate this round
        w, b, new_c_i = hand_round(x["head.weight"], x["head.bias"], c, c_i, steps=2, lr=LR * decay**rnd)
        client.begin_round(rnd, {"model": x, "control": c})
        loop.fit(client, 2)
        assert_close(client.model.head.weight.detach(), w)
        assert_close(client.model.head.bias.detach(), b)
        up = client.upload()
        assert set(up) == {"model", "delta_control"}
        assert_close(up["model"]["head.weight"], w)
        assert_close(up["delta_control"], new_c_i - c_i)  # Delta c_i = c_i+ - c_i
        assert_close(client.control, new_c_i)  # kept for the next round
        rebuilt = make_client(
            "train.local_epochs=2", f"train.lr_decay={decay}"
        )  # the committed state in a module built afresh
        rebuilt.load_state_dict(client.state_dict())
        assert torch.equal(rebuilt.control, client.control)
        assert payload_nbytes(up) == 2 * P * 4  # y_i and Delta c_i, as the FedCross paper counts it
        c_i = new_c_i
        # the next round starts from another global model, not from where this client ended
        x = {"head.weight": w + 0.1 * torch.randn(3, 4, generator=gen), "head.bias": b}


def test_a_client_that_takes_no_step_keeps_its_control_variate_and_uploads_zero():
    client = make_client()
    client.control.copy_(torch.arange(P, dtype=torch.float32))
    client.begin_round(0, {"model": client.model.state_dict(), "control": torch.ones(P)})
    up = client.upload()  # local_epochs 0 (FedL2G-style warm-up) or too few samples: no fit
    assert torch.equal(up["delta_control"], torch.zeros(P))
    assert torch.equal(client.control, torch.arange(P, dtype=torch.float32))


class FirstStepOverflows(ScaffoldClient):
    def on_after_backward(self) -> None:
        if self.global_step == 0:  # an fp16 overflow: the loss scaler finds the inf and skips the step
            self.model.head.weight.grad[0, 0] = float("inf")


def test_a_step_the_loss_scaler_skips_is_not_one_of_option_twos_k_steps():
    cfg = load_config(
        None,
        ["algorithm=scaffold", "train.batch_size=4", f"train.lr={LR}", "train.momentum=0",
         "train.precision=16-mixed", "ray.num_gpus_per_client=0.25"],
    )  # fmt: skip
    client = FirstStepOverflows(flatten_model(), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))
    x = {k: v.clone() for k, v in client.model.state_dict().items()}
    c = torch.randn(P, generator=torch.Generator().manual_seed(0))
    client.begin_round(0, {"model": x, "control": c})
    LocalTraining(cfg.train, torch.device("cpu")).fit(client, 3)  # 3 steps, the first one skipped
    assert client.global_step == 3 and client.steps_taken == 2
    trained = torch.cat([client.model.head.weight.detach().flatten(), client.model.head.bias.detach()])
    anchor = torch.cat([x["head.weight"].flatten(), x["head.bias"]])
    assert not torch.equal(trained, anchor)
    # c_i was 0: c_i+ = -c + (x - y) / (K lr) with K = 2, the steps that moved the model
    assert_close(client.upload()["delta_control"], (anchor - trained) / (2 * LR) - c)


def make_server(num_clients: int, *overrides: str) -> ScaffoldServer:
    cfg = load_config(None, ["algorithm=scaffold", *overrides])
    return ScaffoldServer(
        ServerContext(cfg, num_clients, 3, ["flat"] * num_clients, lambda cid: flatten_model())
    )


def test_the_server_steps_along_the_uploaders_mean_and_adds_their_control_deltas_over_all_clients():
    server = make_server(4, "scaffold.server_lr=0.5")
    x_w, x_b = server.model.head.weight.detach().clone(), server.model.head.bias.detach().clone()
    server.control = torch.full((P,), 2.0)
    down = server.configure(0, [1, 3])
    assert torch.equal(down[1]["control"], server.control) and down[1]["control"] is not server.control
    # two uploaders of different sizes: Alg. 1 averages them uniformly
    y1 = {"head.weight": torch.full((3, 4), 1.0), "head.bias": torch.full((3,), -1.0)}
    y3 = {"head.weight": torch.full((3, 4), 3.0), "head.bias": torch.full((3,), 5.0)}
    d1, d3 = torch.arange(P, dtype=torch.float32), torch.full((P,), 4.0)
    uplinks = {1: {"model": y1, "delta_control": d1}, 3: {"model": y3, "delta_control": d3}}
    server.aggregate(0, uplinks)
    # x + 0.5 * ((y1 + y3) / 2 - x): weight -> x/2 + 1, bias -> x/2 + 1
    assert_close(server.model.head.weight.detach(), x_w + 0.5 * (2.0 - x_w))
    assert_close(server.model.head.bias.detach(), x_b + 0.5 * (2.0 - x_b))
    # c + (d1 + d3) / N with N = 4 clients, not the 2 uploaders
    assert_close(server.control, 2.0 + (d1 + d3) / 4)
    assert server.global_model() is server.model


def test_the_server_aggregates_the_same_bits_with_or_without_early_uplinks_and_resumes_its_state():
    gen = torch.Generator().manual_seed(3)
    uplinks = {
        cid: {
            "model": {
                "head.weight": torch.randn(3, 4, generator=gen),
                "head.bias": torch.randn(3, generator=gen),
            },
            "delta_control": torch.randn(P, generator=gen),
        }
        for cid in (0, 2, 5)
    }
    early, alone = make_server(6), make_server(6)
    early.uplinks_arrived(0, {0: uplinks[0]})
    early.aggregate(0, uplinks)
    alone.aggregate(0, uplinks)
    for a, b in ((early.model.state_dict(), alone.model.state_dict()),):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(early.control, alone.control)
    saved = early.state_dict()  # the running sum is a round's scratch, not server state
    assert set(saved) == {"model", "control"}
    resumed = make_server(6)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.control, early.control)
    assert torch.equal(resumed.model.head.weight, early.model.head.weight)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scaffold.server_lr=0"], "scaffold.server_lr=0.0: must be > 0"),
        (["train.keep_optimizer_state=true"], "train.keep_optimizer_state=true with algorithm=scaffold"),
        (["train.optimizer=adam"], "train.optimizer=adam with algorithm=scaffold: option II reads"),
    ],
)
def test_settings_that_break_the_algorithm_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(None, ["algorithm=scaffold", *overrides])
    assert "\n" not in str(caught.value)
