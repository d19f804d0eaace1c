"""FedSSA math (Eq. 3, Eq. 4, the mu_t schedule) and its payloads, checked against hand computations.

No Ray and no Lightning trainer: the server and client halves are driven directly.
"""

import math

import torch
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.fedssa import (
    FedSSAClient,
    FedSSAConfig,
    FedSSAServer,
    classwise_mean,
    fuse_header,
    mu_schedule,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext, payload_nbytes
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.models import FedModel, build_model


class Shard:
    """Stands in for the client's train ArrayDataset: these tests only use its length."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 1, 8, 8), torch.zeros(n, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.y)


def tiny_model(d: int = 2, c: int = 4) -> FedModel:
    return FedModel(nn.Identity(), d, c, arch="identity", in_channels=1, image_size=1)


def server_for(overrides: list[str], d: int = 2, c: int = 4, n: int = 3) -> FedSSAServer:
    cfg = load_config(None, ["algorithm=fedssa", *overrides])
    ctx = ServerContext(cfg, n, c, ["identity"] * n, lambda cid: tiny_model(d, c))
    return FedSSAServer(ctx)


def client_for(class_counts: list[int], overrides: list[str] = ()) -> FedSSAClient:
    """A real FedSSA client on cnn_small@128 (d = 128), C = len(class_counts)."""
    cfg = load_config(None, ["algorithm=fedssa", "model.group=small_hetero", *overrides])
    c = len(class_counts)
    torch.manual_seed(0)
    model = build_model("cnn_small@128", 1, 8, c)
    return FedSSAClient(model, ClientContext(0, cfg, c, Shard(8), torch.tensor(class_counts)))


# ------------------------------------------------------------------------------------------ mu_t


def test_mu_schedule_values():
    # mu_t = mu0 * cos(pi t / (2 T)) for t <= T, 0 after; mu0 = 0.5, T = 10
    assert mu_schedule(0, 0.5, 10) == 0.5  # cos(0) = 1
    assert_close(mu_schedule(5, 0.5, 10), 0.5 * math.cos(math.pi / 4))  # = 0.353553...
    assert_close(mu_schedule(5, 0.5, 10), 0.5 / math.sqrt(2))
    assert abs(mu_schedule(10, 0.5, 10)) < 1e-15  # cos(pi/2) = 0 up to fp (6e-17)
    assert mu_schedule(11, 0.5, 10) == 0.0
    assert mu_schedule(500, 1.0, 45) == 0.0


# ------------------------------------------------------------------------------------------ Eq. 3


def test_classwise_mean_hand_example():
    # Prepare: 3 clients, C = 4 classes, rows of d+1 = 2 values.
    #   client 0 saw {0, 1}, client 1 saw {1, 2}, client 2 saw {1}; nobody saw class 3.
    headers = torch.tensor(
        [
            [[1.0, 2.0], [3.0, 4.0], [99.0, 99.0], [99.0, 99.0]],
            [[99.0, 99.0], [5.0, 6.0], [7.0, 8.0], [99.0, 99.0]],
            [[99.0, 99.0], [10.0, -1.0], [99.0, 99.0], [99.0, 99.0]],
        ]
    )
    seen = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    previous = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [-3.0, 0.5]])
    # Execute
    out = classwise_mean(headers, seen, previous)
    # Assert (unweighted, unseen 99s ignored):
    #   class 0: only client 0 -> (1, 2)
    #   class 1: (3 + 5 + 10)/3 = 6, (4 + 6 - 1)/3 = 3
    #   class 2: only client 1 -> (7, 8)
    #   class 3: nobody -> previous (-3, 0.5)
    expected = torch.tensor([[1.0, 2.0], [6.0, 3.0], [7.0, 8.0], [-3.0, 0.5]])
    assert_close(out, expected)
    assert torch.equal(out[3], previous[3])


# ------------------------------------------------------------------------------------------ Eq. 4


def test_fuse_header_touches_exactly_the_seen_rows():
    # Prepare: C = 3, d = 2 -> rows [w1, w2, b]; seen = {0, 2}; mu = 0.25
    g = torch.tensor([[1.0, 2.0, 3.0], [100.0, 100.0, 100.0], [-1.0, 0.0, 4.0]])
    local = torch.tensor([[4.0, 8.0, -4.0], [0.1, 0.2, 0.3], [2.0, 2.0, 2.0]])
    seen = torch.tensor([True, False, True])
    # Execute
    out = fuse_header(g, local, seen, 0.25)
    # Assert: seen rows = g + 0.25*local (not a convex mix); unseen row = local bit for bit
    #   row 0: (1+1, 2+2, 3-1) = (2, 4, 2); row 2: (-1+0.5, 0+0.5, 4+0.5) = (-0.5, 0.5, 4.5)
    assert_close(out[0], torch.tensor([2.0, 4.0, 2.0]))
    assert_close(out[2], torch.tensor([-0.5, 0.5, 4.5]))
    assert torch.equal(out[1], local[1])


def test_client_receive_fuses_weight_and_bias_of_seen_rows_only():
    # Prepare: C = 4, S_k = {1, 3}; downlink = the seen rows [2, 129]; round 0 -> mu = mu0 = 0.5
    client = client_for([0, 5, 0, 3], ["fedssa.mu0=0.5", "fedssa.t_stable=10"])
    state0 = {k: v.clone() for k, v in client.model.state_dict().items()}
    rows = torch.randn(2, 129)
    # Execute
    client.receive(0, {"seen_rows": rows})
    # Assert
    w, b = client.model.head.weight.detach(), client.model.head.bias.detach()
    for i, s in enumerate([1, 3]):
        assert_close(w[s], rows[i, :128] + 0.5 * state0["head.weight"][s])
        assert_close(b[s], rows[i, 128] + 0.5 * state0["head.bias"][s])
    for s in (0, 2):  # unseen rows: bit-identical to the local ones
        assert torch.equal(w[s], state0["head.weight"][s])
        assert torch.equal(b[s], state0["head.bias"][s])
    for k, v in client.model.state_dict().items():  # extractor untouched
        if not k.startswith("head."):
            assert torch.equal(v, state0[k]), k


def test_client_first_downlink_is_whole_header_and_mu_is_zero_after_t_stable():
    # Round 12 > T_stable = 10 -> mu = 0: seen rows are replaced by the global ones
    client = client_for([2, 0, 1], ["fedssa.t_stable=10"])
    before = client.model.head.weight.detach().clone()
    before_bias = client.model.head.bias.detach().clone()
    full = torch.randn(3, 129)
    client.receive(12, {"header": full})
    assert_close(client.model.head.weight[[0, 2]].detach(), full[[0, 2], :128], rtol=0, atol=0)
    assert_close(client.model.head.bias[[0, 2]].detach(), full[[0, 2], 128], rtol=0, atol=0)
    assert torch.equal(client.model.head.weight[1].detach(), before[1])
    assert torch.equal(client.model.head.bias[1].detach(), before_bias[1])


def test_a_later_round_fuses_with_the_cosine_weight_and_the_header_trained_last():
    # Prepare: S_k = {1, 3}, mu0 0.5, T_stable 10; round 0's downlink, then "training" writes a header
    client = client_for([0, 5, 0, 3], ["fedssa.mu0=0.5", "fedssa.t_stable=10"])
    client.receive(0, {"header": torch.randn(4, 129)})
    trained_w, trained_b = torch.randn(4, 128), torch.randn(4)
    with torch.no_grad():
        client.model.head.weight.copy_(trained_w)
        client.model.head.bias.copy_(trained_b)
    rows = torch.randn(2, 129)
    # Execute: round 5 -> mu = 0.5 cos(5 pi / 20) = 0.5 / sqrt(2)
    client.receive(5, {"seen_rows": rows})
    # Assert: seen rows = global + mu * the header trained last; unseen rows stay as trained
    mu = 0.5 / math.sqrt(2)
    w, b = client.model.head.weight.detach(), client.model.head.bias.detach()
    for i, s in enumerate([1, 3]):
        assert_close(w[s], rows[i, :128] + mu * trained_w[s])
        assert_close(b[s], rows[i, 128] + mu * trained_b[s])
    for s in (0, 2):
        assert torch.equal(w[s], trained_w[s]) and torch.equal(b[s], trained_b[s])


# ------------------------------------------------------------------------------------------ bytes


def test_upload_bytes_are_the_seen_rows_plus_class_indices():
    # C = 10, S_k = {2, 5, 7}, d = 128: 3 * 129 * 4 bytes of float32 rows + 3 * 8 bytes of int64 indices
    client = client_for([0, 0, 4, 0, 0, 1, 0, 9, 0, 0])
    up = client.upload()
    assert payload_nbytes(up) == 3 * (128 + 1) * 4 + 3 * 8
    assert up["classes"].tolist() == [2, 5, 7]
    assert_close(up["rows"][:, :128], client.model.head.weight[[2, 5, 7]].detach())
    assert_close(up["rows"][:, 128], client.model.head.bias[[2, 5, 7]].detach())


def test_downlink_is_whole_header_at_first_contact_then_seen_rows_only():
    # d = 2, C = 4: first contact 4 * 3 * 4 = 48 bytes; after client 0 reported S_0 = {1, 3}: 2 * 3 * 4 = 24
    server = server_for([])
    down = server.configure(0, [0])
    assert payload_nbytes(down[0]) == 4 * 3 * 4
    server.aggregate(0, {0: {"rows": torch.ones(2, 3), "classes": torch.tensor([1, 3])}})
    down = server.configure(1, [0, 1])
    assert payload_nbytes(down[0]) == 2 * 3 * 4
    assert_close(down[0]["seen_rows"], torch.ones(2, 3))
    assert payload_nbytes(down[1]) == 4 * 3 * 4  # client 1 not heard from yet


def test_full_header_comm_counts_the_whole_header_each_way_and_aggregates_the_same():
    # C = 10, S_k = {2, 5, 7}, d = 128: 10 * 129 * 4 bytes up (unseen rows zero) and down, every round
    client = client_for([0, 0, 4, 0, 0, 1, 0, 9, 0, 0], ["fedssa.comm=full_header"])
    up = client.upload()
    assert payload_nbytes(up) == 10 * 129 * 4
    assert up["header"][[0, 1, 3, 4, 6, 8, 9]].abs().sum() == 0
    assert_close(up["header"][[2, 5, 7]], client_for([0, 0, 4, 0, 0, 1, 0, 9, 0, 0]).upload()["rows"])

    rows = {0: torch.tensor([[1.0, 1, 1], [2.0, 2, 2]]), 1: torch.tensor([[4.0, 4, 4], [6.0, 6, 6]])}
    classes = {0: torch.tensor([0, 1]), 1: torch.tensor([1, 2])}
    seen = server_for([])
    seen.aggregate(0, {c: {"rows": rows[c], "classes": classes[c]} for c in rows})
    full = server_for(["fedssa.comm=full_header"])
    init = full.header.clone()
    padded = {c: {"header": torch.zeros(4, 3).index_copy(0, classes[c], rows[c])} for c in rows}
    full.aggregate(0, padded)
    # by hand: class 0 -> 1 (client 0 alone); 1 -> (2 + 4)/2 = 3; 2 -> 6 (client 1 alone); 3 -> unseen,
    # its init (the zero rows padded in for unseen classes are not averaged in)
    assert_close(full.header[:3], torch.tensor([[1.0, 1, 1], [3.0, 3, 3], [6.0, 6, 6]]))
    assert torch.equal(full.header[3], init[3])
    assert torch.equal(full.header, seen.header)
    assert all(payload_nbytes(d) == 4 * 3 * 4 for d in full.configure(1, [0, 1, 2]).values())


# ------------------------------------------------------------------------------------------ server


def test_server_aggregates_this_rounds_uploaders_only_by_default():
    # Prepare: C = 4, rows of 3 values. Round 0: client 0 saw {0, 1}, client 1 saw {1, 2}.
    server = server_for([])
    init = server.header.clone()
    server.aggregate(
        0,
        {
            0: {"rows": torch.tensor([[1.0, 1, 1], [2.0, 2, 2]]), "classes": torch.tensor([0, 1])},
            1: {"rows": torch.tensor([[4.0, 4, 4], [6.0, 6, 6]]), "classes": torch.tensor([1, 2])},
        },
    )
    # class 0 -> 1; class 1 -> (2 + 4)/2 = 3; class 2 -> 6; class 3 -> its random init
    assert_close(server.header[:3], torch.tensor([[1.0, 1, 1], [3.0, 3, 3], [6.0, 6, 6]]))
    assert torch.equal(server.header[3], init[3])
    # Round 1: only client 0 uploads -> classes 0, 1 are its rows; class 2 keeps 6 (no uploader)
    round1 = {"rows": torch.tensor([[5.0, 5, 5], [8.0, 8, 8]]), "classes": torch.tensor([0, 1])}
    server.aggregate(1, {0: round1})
    assert_close(server.header[:3], torch.tensor([[5.0, 5, 5], [8.0, 8, 8], [6.0, 6, 6]]))
    assert server.global_model() is None and server.eval_payload() is None


def test_aggregate_all_latest_keeps_stale_rows_of_earlier_uploaders():
    # Same uploads as above with aggregate_all_latest=true. Round 1 averages client 0's new rows with
    # client 1's stale round-0 rows: class 0 -> 5; class 1 -> (8 + 4)/2 = 6; class 2 -> 6 (stale, client 1)
    server = server_for(["fedssa.aggregate_all_latest=true"])
    init = server.header.clone()
    server.aggregate(
        0,
        {
            0: {"rows": torch.tensor([[1.0, 1, 1], [2.0, 2, 2]]), "classes": torch.tensor([0, 1])},
            1: {"rows": torch.tensor([[4.0, 4, 4], [6.0, 6, 6]]), "classes": torch.tensor([1, 2])},
        },
    )
    round1 = {"rows": torch.tensor([[5.0, 5, 5], [8.0, 8, 8]]), "classes": torch.tensor([0, 1])}
    server.aggregate(1, {0: round1})
    assert_close(server.header[:3], torch.tensor([[5.0, 5, 5], [6.0, 6, 6], [6.0, 6, 6]]))
    assert torch.equal(server.header[3], init[3])  # never uploaded by anyone


def test_config_defaults_and_validation():
    cfg = load_config(None, ["algorithm=fedssa"])
    assert cfg.algo == FedSSAConfig(mu0=0.5, t_stable=45, aggregate_all_latest=False, comm="seen_rows")
    for bad in (["fedssa.mu0=1.5"], ["fedssa.mu0=-0.1"], ["fedssa.t_stable=0"]):
        try:
            load_config(None, ["algorithm=fedssa", *bad])
        except ConfigError as err:
            assert bad[0].split("=")[0] in str(err)
        else:
            raise AssertionError(f"{bad} was accepted")


# ------------------------------------------------------------------------------------------ Appendix F


def test_m1_off_uploads_and_averages_whole_headers_as_lg_fedavg():
    # Table 4 (cases A and B): every client uploads all C rows, the server averages them over uploaders
    client = client_for([0, 3, 0, 1], ["fedssa.aggregation=whole_header"])
    up = client.upload()
    assert set(up) == {"header"} and payload_nbytes(up) == 4 * 129 * 4  # no class indices
    assert torch.equal(up["header"][:, :128], client.model.head.weight.detach())
    assert torch.equal(up["header"][:, 128], client.model.head.bias.detach())
    server = server_for(["fedssa.aggregation=whole_header"])
    assert server.uplink_keys() == ("header",)
    a, b = torch.arange(1.0, 13.0).view(4, 3), torch.full((4, 3), 2.0)
    server.aggregate(0, {0: {"header": a}, 1: {"header": b}})
    assert_close(server.header, (a + b) / 2)  # e.g. row 3: ((10, 11, 12) + 2) / 2 = (6, 6.5, 7)
    b[1] = 0  # a row of zeros is a row like any other: averaged in, not read as a class not held
    server.aggregate(1, {0: {"header": a}, 1: {"header": b}})
    assert_close(server.header[1], a[1] / 2)
    down = server.configure(1, [0, 2])
    assert all(torch.equal(d["header"], server.header) for d in down.values())


def test_replaced_unseen_rows_take_the_global_ones_and_seen_rows_still_fuse():
    # Table 4 case B: LG-FedAvg's replacement plus M2; S_k = {1, 3}, round 0: mu = mu0 = 0.5
    client = client_for([0, 3, 0, 1], ["fedssa.unseen_rows=replaced", "fedssa.mu0=0.5"])
    w0, b0 = client.model.head.weight.detach().clone(), client.model.head.bias.detach().clone()
    header = torch.randn(4, 129)
    client.receive(0, {"header": header})
    w, b = client.model.head.weight.detach(), client.model.head.bias.detach()
    assert_close(w[[1, 3]], header[[1, 3], :128] + 0.5 * w0[[1, 3]])
    assert_close(b[[1, 3]], header[[1, 3], 128] + 0.5 * b0[[1, 3]])
    assert torch.equal(w[[0, 2]], header[[0, 2], :128]) and torch.equal(b[[0, 2]], header[[0, 2], 128])
    assert client.upload()["classes"].tolist() == [1, 3]  # M1 is on: it still uploads S_k's rows
    # the server sends such a client the whole header every round, though it knows S_k
    server = server_for(["fedssa.unseen_rows=replaced"])
    server.aggregate(0, {0: {"rows": torch.ones(2, 3), "classes": torch.tensor([1, 3])}})
    assert torch.equal(server.configure(1, [0])[0]["header"], server.header)


def test_replaced_unseen_rows_with_mu_zero_replace_the_whole_header_as_table_5_case_a():
    client = client_for([0, 3, 0, 1], ["fedssa.unseen_rows=replaced", "fedssa.mu0=0"])
    header = torch.randn(4, 129)
    client.receive(3, {"header": header})
    assert torch.equal(client.model.head.weight.detach(), header[:, :128])
    assert torch.equal(client.model.head.bias.detach(), header[:, 128])
