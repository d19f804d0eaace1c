"""FedSC math (Eq. 3-15) against hand computations and loop-based evaluations; no Ray, no Trainer."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from fedray.algorithms.fedsc import (
    class_prototypes,
    consistent_prototypes,
    cpdr_loss,
    discrepancy_weights,
    distance_scale,
    relational_prototypes,
    rpcl_loss,
)
from fedray.platform.tracking.names import Metrics

# ------------------------------------------------------------------------------------------ Eq. 3-4


def test_class_prototypes_are_class_means_with_zero_rows_for_absent_classes():
    # class 0: (1,2),(3,4) -> (2,3); class 1: (5,0) -> (5,0); class 2: none -> (0,0), count 0
    z = torch.tensor([[1.0, 2.0], [5.0, 0.0], [3.0, 4.0]])
    y = torch.tensor([0, 1, 0])
    protos, counts = class_prototypes(z, y, 3)
    assert_close(protos, torch.tensor([[2.0, 3.0], [5.0, 0.0], [0.0, 0.0]]))
    assert counts.tolist() == [2, 1, 0]


# ------------------------------------------------------------------------------------------ Eq. 5, 7-9


def hand_example():
    """4 clients, 3 classes, d = 2. Masked-out slots hold garbage that must be ignored.

    class 0 (all hold): c = (3,0), (1,1), (3,-4), (1,3)
        g = mean = (8/4, 0/4) = (2, 0)  -> phi = cosine with the x axis
        phi = [3/3, 1/sqrt2, 3/5, 1/sqrt10] = [1, 0.70711, 0.6, 0.31623]
        |phi_k1 - phi_k| (row k1, columns other k):
            k1=1: k2 0.29289, k3 0.40000, k4 0.68377
            k1=2: k1 0.29289, k3 0.10711, k4 0.39088
            k1=3: k1 0.40000, k2 0.10711, k4 0.28377
            k1=4: k1 0.68377, k2 0.39088, k3 0.28377
    class 1 (client 3 lacks it): c1 = (0,2), c2 = (1,1), c4 = (-1,3)
        g = (0, 6/3) = (0, 2) -> phi = [1, 1/sqrt2, -, 3/sqrt10] = [1, 0.70711, -, 0.94868]
            k1=1: k2 0.29289, k4 0.05132 ;  k1=2: k1 0.29289, k4 0.24157 ;  k1=4: k1 0.05132, k2 0.24157
    class 2 (only clients 1 and 4): c1 = (1,0), c4 = (0,1) -> K_j = 2, M_j = min(M, 1) = 1
    """
    garbage = torch.tensor([100.0, -50.0])
    protos = torch.stack(
        [
            torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 0.0]]),
            torch.stack([torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), garbage]),
            torch.stack([torch.tensor([3.0, -4.0]), garbage, garbage]),
            torch.tensor([[1.0, 3.0], [-1.0, 3.0], [0.0, 1.0]]),
        ]
    )
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    return protos, mask


def test_relational_prototypes_m2_by_hand():
    protos, mask = hand_example()
    rel = relational_prototypes(protos, mask, neighbors=2)
    # class 0, M = 2, divide by 3:
    #   k1=1 -> nearest {2, 3}: (c1+c2+c3)/3 = ((3+1+3)/3, (0+1-4)/3) = (7/3, -1)
    #   k1=2 -> nearest {3, 1}: same three prototypes = (7/3, -1)
    #   k1=3 -> nearest {2, 4}: (c3+c2+c4)/3 = ((3+1+1)/3, (-4+1+3)/3) = (5/3, 0)
    #   k1=4 -> nearest {3, 2}: (5/3, 0)
    assert_close(rel[:, 0], torch.tensor([[7 / 3, -1.0], [7 / 3, -1.0], [5 / 3, 0.0], [5 / 3, 0.0]]))
    # class 1: K_j = 3 holders, M_j = min(2, 2) = 2 -> all three: ((0+1-1)/3, (2+1+3)/3) = (0, 2)
    #          client 3 lacks it -> 0
    assert_close(rel[:, 1], torch.tensor([[0.0, 2.0], [0.0, 2.0], [0.0, 0.0], [0.0, 2.0]]))
    # class 2: K_j = 2, M_j = 1, divide by 2 (not M+1 = 3): (c1+c4)/2 = (0.5, 0.5)
    assert_close(rel[:, 2], torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [0.5, 0.5]]))


def test_relational_prototypes_m1_by_hand():
    protos, mask = hand_example()
    rel = relational_prototypes(protos, mask, neighbors=1)
    # class 0, nearest one, divide by 2:
    #   k1=1 -> 2: ((3+1)/2, (0+1)/2) = (2, 0.5)     k1=2 -> 3: ((1+3)/2, (1-4)/2) = (2, -1.5)
    #   k1=3 -> 2: (2, -1.5)                          k1=4 -> 3: ((1+3)/2, (3-4)/2) = (2, -0.5)
    assert_close(rel[:, 0], torch.tensor([[2.0, 0.5], [2.0, -1.5], [2.0, -1.5], [2.0, -0.5]]))
    # class 1 (holders 1, 2, 4; g = (0,2) from holders only):
    #   k1=1 -> 4 (0.05132 < 0.29289): ((0-1)/2, (2+3)/2) = (-0.5, 2.5)
    #   k1=2 -> 4 (0.24157 < 0.29289): ((1-1)/2, (1+3)/2) = (0, 2)
    #   k1=4 -> 1 (0.05132 < 0.24157): (-0.5, 2.5)
    assert_close(rel[:, 1], torch.tensor([[-0.5, 2.5], [0.0, 2.0], [0.0, 0.0], [-0.5, 2.5]]))
    assert_close(rel[:, 2], torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [0.5, 0.5]]))


def test_relational_prototypes_m0_is_own_prototype():
    protos, mask = hand_example()
    assert_close(relational_prototypes(protos, mask, 0), protos * mask.unsqueeze(-1))


# ------------------------------------------------------------------------------------------ Eq. 10-12


def test_discrepancy_weights_by_hand():
    # (the 1/2 in Eq. 10 scales every d_k alike, so it cancels in d_k / sum d; the other terms do not)
    # n_k^j: client 1 [6, 2] (n=8), client 2 [2, 2] (n=4), client 3 [0, 4] (n=4); N = 16; H = 1/2
    #   B_1 = [0.75, 0.25] -> d_1 = sqrt(0.5 * (0.25^2 + 0.25^2)) = sqrt(0.0625) = 0.25
    #   B_2 = [0.5, 0.5]   -> d_2 = 0
    #   B_3 = [0, 1]       -> d_3 = sqrt(0.5 * (0.5^2 + 0.5^2)) = sqrt(0.25) = 0.5 ; sum d = 0.75
    #   n/N - d/sum d = [0.5 - 1/3, 0.25 - 0, 0.25 - 2/3] = [0.166667, 0.25, -0.416667]
    #   sigmoid = [0.5415705, 0.5621765, 0.3973147], sum = 1.5010616
    #   e = [0.3607916, 0.3745193, 0.2646891]
    counts = torch.tensor([[6, 2], [2, 2], [0, 4]])
    e = discrepancy_weights(counts)
    assert_close(e, torch.tensor([0.3607916, 0.3745193, 0.2646891]))
    assert_close(e.sum(), torch.tensor(1.0))


def test_consistent_prototypes_renormalise_over_holders():
    # e = [0.5, 0.3, 0.2]; client 2 lacks class 1 (garbage 99 there)
    #   o^0 = 0.5*1 + 0.3*3 + 0.2*5 = 0.5 + 0.9 + 1.0 = 2.4
    #   o^1 = (0.5*2 + 0.2*6) / (0.5 + 0.2) = 2.2 / 0.7 = 3.142857
    rel = torch.tensor([[[1.0], [2.0]], [[3.0], [99.0]], [[5.0], [6.0]]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    out = consistent_prototypes(rel, torch.tensor([0.5, 0.3, 0.2]), mask)
    assert_close(out, torch.tensor([[2.4], [2.2 / 0.7]]))


# ------------------------------------------------------------------------------------------ Eq. 13-14


def loop_distance_scale(z, rel):
    """U(r) = (1/n) sum_q ||z_q - r||_2, one prototype at a time."""
    k, c, _ = rel.shape
    out = torch.zeros(k, c, dtype=torch.float64)
    for a in range(k):
        for j in range(c):
            out[a, j] = sum(math.sqrt(float(((zq - rel[a, j]) ** 2).sum())) for zq in z) / len(z)
    return out


def loop_rpcl(z, y, rel, mask, tau, scale):
    """Eq. 14 per sample with plain floats; samples with no same-class prototype are skipped."""
    k, c, _ = rel.shape
    losses = []
    for i in range(len(y)):
        pos = neg = 0.0
        for a in range(k):
            for j in range(c):
                if not mask[a, j]:
                    continue
                r = rel[a, j]
                cos = float(z[i] @ r) / (float(z[i].norm()) * float(r.norm()))
                s = cos / (float(scale[a, j]) if scale is not None else 1.0)  # Eq. 13
                if j == int(y[i]):
                    pos += math.exp(s / tau)
                else:
                    neg += math.exp(s / tau)
        if pos > 0:
            losses.append(-math.log(pos / (pos + neg)))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("use_u", [True, False])
def test_rpcl_matches_loop_evaluation_of_eq14(use_u):
    # Prepare: K=3 clients, C=3 classes, d=4; nobody holds class 2 (its samples are skipped),
    # client 1 lacks class 1; masked slots hold garbage
    g = torch.Generator().manual_seed(0)
    rel = torch.randn(3, 3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, False]])
    rel[~mask] = 1e3
    z = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1])
    local = torch.randn(7, 4, generator=g, dtype=torch.float64)  # all local features for U
    scale = distance_scale(local, rel) if use_u else None
    # Execute
    loss = rpcl_loss(z, y, rel, mask, tau=0.05, scale=scale)
    # Assert
    if use_u:
        assert_close(scale[mask], loop_distance_scale(local, rel)[mask])
    expected = loop_rpcl(z.detach(), y, rel, mask, 0.05, scale)
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(z.grad).all()
    assert z.grad[2].abs().sum() == 0  # class 2 has no prototype: that sample contributes nothing


def test_rpcl_with_no_prototype_for_any_sample_is_zero():
    z = torch.randn(2, 3, requires_grad=True)
    loss = rpcl_loss(z, torch.tensor([1, 1]), torch.randn(2, 2, 3), torch.tensor([[True, False]] * 2), 0.05)
    assert loss.item() == 0.0
    loss.backward()  # still part of the graph


# ------------------------------------------------------------------------------------------ Eq. 15


def test_cpdr_mse_and_l1_by_hand():
    # samples (1,2)|y=0, (3,1)|y=1, (5,5)|y=2 (class 2 has no prototype: skipped); O^0 = (0,0), O^1 = (1,1)
    #   differences: (1,2), (2,0)
    #   mse = (1 + 4 + 4 + 0) / 4 = 2.25          (mean over kept samples and dims)
    #   l1  = ((1 + 2) + (2 + 0)) / 2 = 2.5        (sum over d, mean over kept samples)
    z = torch.tensor([[1.0, 2.0], [3.0, 1.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])
    o = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    mask = torch.tensor([True, True, False])
    assert_close(cpdr_loss(z, y, o, "mse", mask), torch.tensor(2.25))
    assert_close(cpdr_loss(z, y, o, "l1", mask), torch.tensor(2.5))
    # without a mask every sample counts: mse adds (4^2 + 4^2) -> 41/6 ; l1 adds 8 -> 13/3
    assert_close(cpdr_loss(z, y, o, "mse"), torch.tensor(41 / 6))
    assert_close(cpdr_loss(z, y, o, "l1"), torch.tensor(13 / 3))


# ------------------------------------------------------------------------------------------ plain loops
# The equations once more, written as loops over clients, classes and samples with nothing shared
# with the module's vectorised code: the expected values of the two halves' tests below.


def plain_server_round(protos, mask, counts, neighbors):
    """(R, O) of Eq. 5, 7-12: protos [K, C, d], mask [K, C], counts [K, C]."""
    k_all, c_all, _ = protos.shape
    rel = torch.zeros_like(protos)
    for j in range(c_all):
        holders = [k for k in range(k_all) if mask[k, j]]
        if not holders:
            continue
        g = sum(protos[k, j] for k in holders) / len(holders)  # Eq. 5
        phi = {k: F.cosine_similarity(g, protos[k, j], dim=0).item() for k in holders}  # Eq. 7
        m = min(neighbors, len(holders) - 1)
        for k in holders:  # Eq. 8-9: itself and its m nearest in phi (ties: lower index)
            nearest = sorted((q for q in holders if q != k), key=lambda q: (abs(phi[k] - phi[q]), q))[:m]
            rel[k, j] = sum((protos[q, j] for q in [k, *nearest]), torch.zeros_like(g)) / (m + 1)
    n = [float(counts[k].sum()) for k in range(k_all)]
    d = [  # Eq. 10
        math.sqrt(0.5 * sum((float(counts[k, j]) / n[k] - 1 / c_all) ** 2 for j in range(c_all)))
        for k in range(k_all)
    ]
    raw = [1 / (1 + math.exp(-(n[k] / sum(n) - d[k] / sum(d)))) for k in range(k_all)]  # Eq. 11
    e = [r / sum(raw) for r in raw]
    consistent = torch.zeros(c_all, protos.shape[2])
    for j in range(c_all):  # Eq. 12, e renormalised over the holders of j
        holders = [k for k in range(k_all) if mask[k, j]]
        if holders:
            total = sum(e[k] for k in holders)
            consistent[j] = sum(e[k] / total * rel[k, j] for k in holders)
    return rel, consistent


def plain_client_loss(logits, z, y, all_z, rel, rmask, consistent, omask, tau, cpdr_kind="l1"):
    """CE + RPCL (Eq. 13-14, U over all local features) + CPDR (Eq. 15: l1, or the mean square), sample
    by sample."""
    slots = [(k, j) for k in range(rel.shape[0]) for j in range(rel.shape[1]) if rmask[k, j]]
    u = {kj: sum(torch.dist(q, rel[kj]) for q in all_z) / len(all_z) for kj in slots}  # Eq. 13
    rpcl, cpdr = [], []
    for zi, yi in zip(z, y.tolist()):
        s = {kj: F.cosine_similarity(zi, rel[kj], dim=0) / u[kj] / tau for kj in slots}
        if any(j == yi for _, j in slots):
            pos = sum(torch.exp(v) for (_, j), v in s.items() if j == yi)
            rpcl.append(-torch.log(pos / sum(torch.exp(v) for v in s.values())))
        if omask[yi]:
            gap = zi - consistent[yi]
            cpdr.append(gap.abs().sum() if cpdr_kind == "l1" else (gap**2).mean())
    return F.cross_entropy(logits, y) + sum(rpcl) / len(rpcl) + sum(cpdr) / len(cpdr)


# ------------------------------------------------------------------------------------------ halves


def make_client(overrides=()):
    from fedray.algorithms.fedsc import FedSCClient
    from fedray.platform.api.algorithm import ClientContext
    from fedray.platform.catalog import load_config
    from fedray.platform.data import ArrayDataset
    from fedray.platform.models import build_model

    cfg = load_config(None, ["algorithm=fedsc", *overrides])
    torch.manual_seed(0)
    data = ArrayDataset(torch.randn(24, 1, 8, 8), torch.arange(24) % 3)  # classes 0..2 of C = 4
    model = build_model("cnn_small", 1, 8, 4)
    client = FedSCClient(model, ClientContext(0, cfg, 4, data, torch.bincount(data.y, minlength=4)))
    return client, data


def receive_prototypes(client, rel, rmask, o, omask) -> None:
    """Round 1's downlink: the client's own model, relational prototypes R and consistent ones O."""
    payload = {"relational": rel, "relational_mask": rmask, "consistent": o, "consistent_mask": omask}
    client.receive(1, {"model": client.model.state_dict(), **payload})


def test_round0_client_loss_is_plain_ce():
    client, data = make_client()
    client.receive(0, {"model": client.model.state_dict()})
    client.on_train_epoch_start()
    loss = client.training_step((data.x, data.y), 0)
    assert_close(loss, F.cross_entropy(client.model(data.x), data.y))
    assert "loss/rpcl" not in client.pop_stats()


def test_client_loss_is_ce_plus_rpcl_plus_cpdr_with_u_from_epoch_start():
    client, data = make_client(["fedsc.cpdr=l1"])
    g = torch.Generator().manual_seed(1)
    rel, rmask = torch.rand(2, 4, 128, generator=g), torch.tensor([[True, True, True, False]] * 2)
    o, omask = torch.rand(4, 128, generator=g), torch.tensor([True, True, False, False])
    receive_prototypes(client, rel, rmask, o, omask)
    client.on_train_epoch_start()
    loss = client.training_step((data.x, data.y), 0)
    with torch.no_grad():
        logits, z = client.model.forward_with_features(data.x)  # no dropout/BN: eval == train features
        expected = plain_client_loss(logits, z, data.y, z, rel, rmask, o, omask, tau=0.05)
    assert_close(loss.detach(), expected)
    stats = client.pop_stats()
    assert {"loss/ce", "loss/rpcl", "loss/cpdr", Metrics.LOSS_TRAIN} <= set(stats)


def test_default_loss_on_one_batch_reads_u_from_every_local_sample_and_cpdr_as_mse():
    # Prepare: the defaults (cpdr mse, use_u true); a batch of half the client's 24 samples, the other
    # half scaled so that their features move U far from what the batch alone would give
    client, data = make_client()
    data.x[12:] *= 5
    g = torch.Generator().manual_seed(2)
    rel, rmask = torch.rand(2, 4, 128, generator=g), torch.tensor([[True, True, True, False]] * 2)
    o, omask = torch.rand(4, 128, generator=g), torch.tensor([True, False, True, False])
    receive_prototypes(client, rel, rmask, o, omask)
    client.on_train_epoch_start()
    half = slice(0, 12)
    # Execute
    loss = client.training_step((data.x[half], data.y[half]), 0)
    # Assert: Eq. 13's U averages over all n_k local samples, not over the batch
    with torch.no_grad():
        logits, z = client.model.forward_with_features(data.x)
        expected = plain_client_loss(
            logits[half], z[half], data.y[half], z, rel, rmask, o, omask, tau=0.05, cpdr_kind="mse"
        )
    assert_close(loss.detach(), expected)


def test_client_upload_has_eval_mode_prototypes_and_counts():
    client, data = make_client()
    client.receive(0, {"model": client.model.state_dict()})
    up = client.upload()
    with torch.no_grad():
        z = client.model.features(data.x)
    assert_close(up["prototypes"][1], z[data.y == 1].mean(0))
    assert_close(up["prototypes"][3], torch.zeros(128))
    assert up["class_counts"].tolist() == [8, 8, 8, 0]
    assert up["num_samples"] == 24 and "model" in up


def test_server_builds_r_and_o_from_participants_and_sends_them():
    from fedray.algorithms.fedsc import FedSCServer
    from fedray.platform.api.algorithm import ServerContext, payload_nbytes
    from fedray.platform.catalog import load_config
    from fedray.platform.models import build_model

    cfg = load_config(None, ["algorithm=fedsc", "fedsc.neighbors=1"])
    server = FedSCServer(
        ServerContext(cfg, 5, 3, ["cnn_small"] * 5, lambda cid: build_model("cnn_small", 1, 8, 3))
    )
    first = server.configure(0, [0, 2])
    assert set(first[0]) == {"model"}  # round 0: no R / O yet
    protos, mask = hand_example()
    protos = torch.cat([protos, torch.zeros(4, 3, 126)], dim=2)  # pad to d = 128
    counts = torch.tensor([[3, 1, 2], [2, 2, 0], [4, 0, 0], [1, 1, 1]])
    states = [build_model("cnn_small", 1, 8, 3).state_dict() for _ in range(4)]
    uplinks = {
        cid: {
            "model": states[i],
            "num_samples": int(counts[i].sum()),
            "prototypes": protos[i],
            "class_counts": counts[i],
        }
        for i, cid in enumerate([0, 1, 3, 4])
    }
    server.aggregate(0, uplinks)
    down = server.configure(1, [1, 2])[1]
    rel, consistent = plain_server_round(protos, mask, counts, neighbors=1)
    assert_close(down["relational"], rel)
    assert torch.equal(down["relational_mask"], mask)
    assert_close(down["consistent"], consistent)
    assert down["consistent_mask"].tolist() == [True, True, True]
    # FedAvg's model, weighted by the clients' sample counts 6, 4, 4, 3
    expected = sum(n * state["head.weight"] for n, state in zip([6, 4, 4, 3], states)) / 17
    assert_close(down["model"]["head.weight"], expected)
    extra = 4 * 3 * 128 * 4 + 4 * 3 + 3 * 128 * 4 + 3  # R float32, R mask bool, O float32, O mask bool
    assert payload_nbytes(down) == payload_nbytes({"model": down["model"]}) + extra


def test_config_validation():
    from fedray.platform.catalog import load_config
    from fedray.platform.errors import ConfigError

    assert load_config(None, ["algorithm=fedsc"]).algo.tau == 0.05
    for bad in (["fedsc.tau=0"], ["fedsc.neighbors=-1"], ["fedsc.cpdr=l2"], ["model.group=small_hetero"]):
        with pytest.raises(ConfigError):
            load_config(None, ["algorithm=fedsc", *bad])
