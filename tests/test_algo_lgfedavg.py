"""LG-FedAvg: the header FedAvg checked by hand; receive swaps exactly the head. No Ray, no trainer."""

import torch
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.lgfedavg import (
    LGFedAvgClient,
    LGFedAvgServer,
    average_headers,
    header_rows,
    init_header,
    load_header_rows,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext, payload_nbytes
from fedray.platform.catalog import load_config
from fedray.platform.models import FedModel, build_model


class Shard:
    """Stands in for the client's train ArrayDataset: these tests only use its length."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 1, 8, 8), torch.zeros(n, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.y)


def test_average_headers_matches_hand_computation():
    # Prepare: K = 2 clients with n = 1 and 3 samples -> weights 0.25, 0.75; C = 2, d + 1 = 2
    a = torch.tensor([[1.0, 2.0], [0.0, 4.0]])
    b = torch.tensor([[5.0, -2.0], [4.0, 0.0]])
    # Execute
    out = average_headers(torch.stack([a, b]), torch.tensor([1.0, 3.0]))
    # Assert: 0.25*1 + 0.75*5 = 4 ; 0.25*2 + 0.75*(-2) = -1 ; 0.25*0 + 0.75*4 = 3 ; 0.25*4 + 0 = 1
    assert_close(out, torch.tensor([[4.0, -1.0], [3.0, 1.0]]))
    assert out.dtype == torch.float32


def test_header_rows_roundtrip_and_init_bounds():
    model = FedModel(nn.Identity(), 4, 3, arch="identity", in_channels=1, image_size=1)
    rows = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # [C=3, d+1=5]
    load_header_rows(model, rows)
    assert_close(model.head.weight.detach(), rows[:, :4])
    assert_close(model.head.bias.detach(), rows[:, 4])
    assert torch.equal(header_rows(model), rows)
    h = init_header(10, 64, seed=7)  # PyTorch Linear init: U(-1/sqrt(64), 1/sqrt(64)) = U(-0.125, 0.125)
    assert h.shape == (10, 65) and h.abs().max() <= 0.125 and h.std() > 0.05
    assert torch.equal(h, init_header(10, 64, seed=7))


def test_receive_replaces_exactly_the_head_and_upload_is_the_header():
    cfg = load_config(None, ["algorithm=lgfedavg", "model.group=small_hetero"])
    torch.manual_seed(0)
    model = build_model("cnn_small_wide@128", 1, 8, 10)
    client = LGFedAvgClient(model, ClientContext(1, cfg, 10, Shard(12)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    header = torch.randn(10, 129)
    # Execute
    client.receive(3, {"header": header})
    # Assert: head = global header, every other tensor bit-identical
    assert torch.equal(model.head.weight.detach(), header[:, :128])
    assert torch.equal(model.head.bias.detach(), header[:, 128])
    for k, v in model.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(v, before[k]), k
    up = client.upload()
    assert torch.equal(up["header"], header) and up["num_samples"] == 12
    assert payload_nbytes(up) == 10 * 129 * 4 + 8  # whole header + the sample count


def test_server_round_sample_weighted():
    cfg = load_config(None, ["algorithm=lgfedavg"])

    def make(cid):
        return FedModel(nn.Identity(), 1, 2, arch="identity", in_channels=1, image_size=1)

    server = LGFedAvgServer(ServerContext(cfg, 3, 2, ["identity"] * 3, make))
    down = server.configure(0, [0, 2])
    assert down[0] is down[2] and down[0]["header"].shape == (2, 2)
    # clients 0 and 2 with n = 10 and 30 -> 0.25 * h0 + 0.75 * h2
    h0, h2 = torch.tensor([[4.0, 0.0], [0.0, 8.0]]), torch.tensor([[0.0, 4.0], [4.0, 0.0]])
    server.aggregate(0, {0: {"header": h0, "num_samples": 10}, 2: {"header": h2, "num_samples": 30}})
    assert_close(server.header, torch.tensor([[1.0, 3.0], [3.0, 2.0]]))
    # no global model; by default every client is tested with the global header (the paper, HtFLlib)
    assert server.global_model() is None
    assert torch.equal(server.eval_payload()["header"], server.header)
    local = LGFedAvgServer(
        ServerContext(
            load_config(None, ["algorithm=lgfedavg", "lgfedavg.eval_head=local"]),
            3,
            2,
            ["identity"] * 3,
            make,
        )
    )
    assert local.eval_payload() is None  # each client's own last header


def test_load_for_eval_puts_the_global_header_on_the_own_extractor():
    cfg = load_config(None, ["algorithm=lgfedavg"])
    torch.manual_seed(0)
    model = build_model("cnn_small", 1, 8, 10)
    client = LGFedAvgClient(model, ClientContext(1, cfg, 10, Shard(12)))
    features = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("head.")}
    header = torch.randn(10, model.head.in_features + 1)
    client.load_for_eval({"header": header})
    assert torch.equal(header_rows(model), header)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in features.items())
