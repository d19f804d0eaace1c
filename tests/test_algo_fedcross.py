"""FedCross math and server half, checked against hand computations; no Ray, no Lightning trainer."""

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.fedcross import (
    FedCrossConfig,
    FedCrossServer,
    cosine_from_gram,
    cosine_similarity_matrix,
    cross_aggregate,
    dynamic_alpha,
    fuse_states,
    in_order_collaborators,
    mean_state,
    propeller_aggregate,
    select_collaborators,
    similarity_gram,
)
from fedray.platform.api.algorithm import ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.errors import ConfigError
from fedray.platform.models import FedModel

# v0 = (1, 0), v1 = (1, 1), v2 = (10, 20):
#   cos(0,1) = 1/sqrt(2)             = 0.70711     "+" version: 1/(1+sqrt(2))           = 0.41421
#   cos(0,2) = 10/sqrt(500)          = 0.44721     "+" version: 10/(1+sqrt(500))        = 0.42800
#   cos(1,2) = 30/(sqrt(2)sqrt(500)) = 0.94868     "+" version: 30/(sqrt(2)+sqrt(500))  = 1.26180
# Row 0 separates the two formulas: product -> lowest partner 2, highest 1; sum -> lowest 1, highest 2.
HAND_V = torch.tensor([[1.0, 0.0], [1.0, 1.0], [10.0, 20.0]], dtype=torch.float64)


# --------------------------------------------------------------------------------------------- math


def test_cosine_uses_product_of_norms():
    # Execute
    sim = cosine_similarity_matrix(HAND_V)
    # Assert: the hand values above, symmetric, 1 on the diagonal
    c01, c02, c12 = 1 / math.sqrt(2), 10 / math.sqrt(500), 30 / math.sqrt(1000)
    expected = torch.tensor([[1.0, c01, c02], [c01, 1.0, c12], [c02, c12, 1.0]], dtype=torch.float64)
    assert_close(sim, expected)


def test_lowest_and_highest_similarity_pick_hand_computed_partners():
    # lowest: row0 min(.707, .447) -> 2; row1 min(.707, .949) -> 0; row2 min(.447, .949) -> 0
    # highest: row0 -> 1; row1 -> 2; row2 -> 1.  With "|x|+|y|" row 0 would give 1 and 2 instead.
    lowest = select_collaborators(3, 0, "lowest_similarity", cosine_similarity_matrix(HAND_V))
    highest = select_collaborators(3, 7, "highest_similarity", cosine_similarity_matrix(HAND_V))
    assert lowest.tolist() == [2, 0, 0]
    assert highest.tolist() == [1, 2, 1]


def test_similarity_selection_never_picks_self_and_breaks_ties_by_lowest_index():
    # v1 == v2, so for row 0 both are equally (dis)similar -> 1; row 1's most similar other is 2 (cos 1)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    assert select_collaborators(3, 0, "lowest_similarity", cosine_similarity_matrix(v)).tolist() == [1, 0, 0]
    assert select_collaborators(3, 0, "highest_similarity", cosine_similarity_matrix(v)).tolist() == [1, 2, 1]
    # all identical: every other is a tie -> the lowest index that is not self
    same = torch.ones(4, 3)
    assert select_collaborators(4, 0, "lowest_similarity", cosine_similarity_matrix(same)).tolist() == [
        1,
        0,
        0,
        0,
    ]


def test_in_order_rotates_with_round_and_never_selects_self():
    # K = 4: offsets r % 3 + 1 = 1, 2, 3, 1 for r = 0..3 (0-based i)
    assert in_order_collaborators(4, 0).tolist() == [1, 2, 3, 0]
    assert in_order_collaborators(4, 1).tolist() == [2, 3, 0, 1]
    assert in_order_collaborators(4, 2).tolist() == [3, 0, 1, 2]
    assert in_order_collaborators(4, 3).tolist() == [1, 2, 3, 0]
    for rnd in range(10):
        co = select_collaborators(5, rnd, "in_order")
        assert (co != torch.arange(5)).all()


def test_in_order_pairs_each_model_with_every_other_once_over_k_minus_1_rounds():
    k = 5
    for start in (0, 3):  # any K-1 consecutive rounds
        partners = torch.stack([in_order_collaborators(k, r) for r in range(start, start + k - 1)], dim=1)
        for i in range(k):
            assert sorted(partners[i].tolist()) == [j for j in range(k) if j != i]


def test_cross_aggregate_by_hand_and_in_order_preserves_the_sum():
    # Prepare: K = 3, in-order round 0 -> co = (1, 2, 0), alpha = 0.75
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    co = select_collaborators(3, 0, "in_order")
    # Execute
    w = cross_aggregate(v, co, 0.75)
    # Assert: w0 = .75(1,0)+.25(0,1) = (.75,.25); w1 = .75(0,1)+.25(2,2) = (.5,1.25);
    #         w2 = .75(2,2)+.25(1,0) = (1.75,1.5); sum = (3,3) = sum of v
    assert co.tolist() == [1, 2, 0]
    assert_close(w, torch.tensor([[0.75, 0.25], [0.5, 1.25], [1.75, 1.5]], dtype=torch.float64))
    assert_close(w.sum(0), v.sum(0))
    torch.manual_seed(0)
    big = torch.randn(6, 11, dtype=torch.float64)
    for rnd in range(5):
        assert_close(
            cross_aggregate(big, select_collaborators(len(big), rnd, "in_order"), 0.9).sum(0), big.sum(0)
        )


def test_lowest_similarity_does_not_preserve_the_sum():
    # co = (2, 0, 0): model 1 is nobody's partner, so sum(w) != sum(v)
    # (see docs/algorithms/fedcross.md, Shared collaborators and ties)
    w = cross_aggregate(
        HAND_V, select_collaborators(3, 0, "lowest_similarity", cosine_similarity_matrix(HAND_V)), 0.5
    )
    # sum w = .5*sum(v) + .5*(v2 + v0 + v0) = (6, 10.5) + (6, 10) = (12, 20.5) vs sum v = (12, 21)
    assert_close(w.sum(0), torch.tensor([12.0, 20.5], dtype=torch.float64))


def test_alpha_one_leaves_models_unchanged():
    torch.manual_seed(0)
    v = torch.randn(4, 9, dtype=torch.float64)
    for strategy in ("in_order", "lowest_similarity", "highest_similarity"):
        assert torch.equal(
            cross_aggregate(v, select_collaborators(len(v), 2, strategy, cosine_similarity_matrix(v)), 1.0), v
        )


def test_propeller_fusion_by_hand():
    # K = 4 scalar models v = (1, 2, 4, 8), P = 2 propellers (i+1, i+2) mod 4, default weight 1/3:
    #   w0 = (1+2+4)/3 = 7/3, w1 = (2+4+8)/3 = 14/3, w2 = (4+8+1)/3 = 13/3, w3 = (8+1+2)/3 = 11/3
    v = torch.tensor([[1.0], [2.0], [4.0], [8.0]], dtype=torch.float64)
    assert_close(
        propeller_aggregate(v, 2), torch.tensor([[7.0], [14.0], [13.0], [11.0]], dtype=torch.float64) / 3
    )
    # self weight 0.5: w0 = .5*1 + .25*(2+4) = 2.0; w3 = .5*8 + .25*(1+2) = 4.75
    w = propeller_aggregate(v, 2, self_weight=0.5)
    assert_close(w[[0, 3], 0], torch.tensor([2.0, 4.75], dtype=torch.float64))
    # P = K-1: every model becomes the global mean 15/4
    assert_close(propeller_aggregate(v, 3), torch.full((4, 1), 3.75, dtype=torch.float64))
    with pytest.raises(ValueError):
        propeller_aggregate(v, 4)


def test_dynamic_alpha_ramp_values():
    # DA alone (R = 100 from round 0): 0.5 + 0.49 * r / 100
    assert dynamic_alpha(0, 0.99, 0, 100) == pytest.approx(0.5)
    assert dynamic_alpha(50, 0.99, 0, 100) == pytest.approx(0.745)
    assert dynamic_alpha(99, 0.99, 0, 100) == pytest.approx(0.9851)
    assert dynamic_alpha(100, 0.99, 0, 100) == pytest.approx(0.99)
    # PM-DA: ramp over rounds 50..99; plain alpha before and after
    assert dynamic_alpha(49, 0.99, 50, 50) == pytest.approx(0.99)
    assert dynamic_alpha(50, 0.99, 50, 50) == pytest.approx(0.5)
    assert dynamic_alpha(75, 0.99, 50, 50) == pytest.approx(0.745)
    assert dynamic_alpha(100, 0.99, 50, 50) == pytest.approx(0.99)
    # off
    assert dynamic_alpha(3, 0.9, 0, 0) == 0.9


def test_fuse_states_keeps_dtypes_and_takes_int_buffers_from_self():
    a = {"w": torch.tensor([[1.0, 2.0]]), "n": torch.tensor(3), "b": torch.tensor([5.0], dtype=torch.float64)}
    b = {"w": torch.tensor([[3.0, 4.0]]), "n": torch.tensor(9), "b": torch.tensor([6.0], dtype=torch.float64)}
    swapped = fuse_states([a, b], lambda x: x.flip(0))  # each model takes the other's floats
    assert swapped[1]["w"].dtype == torch.float32 and swapped[1]["b"].dtype == torch.float64
    assert_close(swapped[1]["w"], a["w"])
    assert_close(swapped[0]["b"], b["b"])
    assert [s["n"].item() for s in swapped] == [3, 9]
    mean = mean_state([a, b])
    assert_close(mean["w"], torch.tensor([[2.0, 3.0]]))
    assert mean["b"].dtype == torch.float64 and mean["n"].item() == 3


def flat(states: list[dict], keys: list[str]) -> torch.Tensor:
    """The K states' ``keys`` as one float64 ``[K, P]`` matrix: the whole-vector form of the math."""
    return torch.stack([torch.cat([s[k].reshape(-1).double() for k in keys]) for s in states])


def test_block_by_block_gives_the_bits_of_the_whole_vector(monkeypatch):
    # Prepare: blocks of 7 elements cut every entry of 4 random models (one of 30 elements) into pieces
    monkeypatch.setattr("fedray.algorithms.fedcross.BLOCK_ELEMENTS", 7)
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 6), "b": (5,), "v": (1,)}
    states = [{k: torch.randn(shape, generator=gen) for k, shape in shapes.items()} for _ in range(4)]
    keys = list(shapes)
    v = flat(states, keys)
    co = torch.tensor([2, 0, 3, 1])
    # Execute / Assert: the fusions and the mean are the whole-vector math, bit for bit
    fused = fuse_states(states, lambda x: cross_aggregate(x, co, 0.9))
    assert torch.equal(flat(fused, keys), cross_aggregate(v, co, 0.9).float().double())
    fused = fuse_states(states, lambda x: propeller_aggregate(x, 2))
    assert torch.equal(flat(fused, keys), propeller_aggregate(v, 2).float().double())
    assert torch.equal(flat([mean_state(states)], keys)[0], v.mean(dim=0).float().double())
    # the Gram matrix summed over blocks is the whole vectors' (to the last bits of float64)
    assert_close(similarity_gram(states, keys), v @ v.T, rtol=1e-12, atol=1e-12)
    assert_close(cosine_from_gram(similarity_gram(states, keys)), cosine_similarity_matrix(v))


# --------------------------------------------------------------------------------------------- server


def tiny_model(cid: int) -> FedModel:
    """Linear(2,3) + BatchNorm1d(3) + head: float params, float BN buffers and an int counter."""
    torch.manual_seed(cid)
    features = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    return FedModel(features, 3, 2, arch="tiny", in_channels=1, image_size=2)


def make_server(*overrides: str) -> FedCrossServer:
    # 6 clients, fraction 0.5 -> K = 3 middleware models
    cfg = load_config(None, ["algorithm=fedcross", "data.num_clients=6", "train.fraction=0.5", *overrides])
    ctx = ServerContext(cfg, 6, 2, ["tiny"] * 6, tiny_model)
    return FedCrossServer(ctx)


def constant_state(template: dict, value: float, counter: int) -> dict:
    return {
        k: torch.full_like(v, value) if v.is_floating_point() else torch.tensor(counter)
        for k, v in template.items()
    }


def test_server_starts_with_k_copies_of_one_init_and_their_mean_as_global():
    server = make_server()
    assert server.num_models == 3
    ref = server.middleware[0]
    for state in server.middleware[1:]:
        for key in ref:
            assert torch.equal(state[key], ref[key])
    for key, value in server.global_model().state_dict().items():
        assert torch.equal(value, ref[key])


def test_configure_gives_each_client_a_distinct_model_and_aggregate_applies_the_cross_rule():
    # Prepare: in-order, alpha = 0.75; make the three models distinguishable (all floats = 10*i)
    server = make_server("fedcross.selection=in_order", "fedcross.alpha=0.75")
    template = server.middleware[0]
    server.middleware = [constant_state(template, 10.0 * i, 0) for i in range(3)]
    selected = [0, 2, 5]
    # Execute
    down = server.configure(0, selected)
    # Assert: every selected client gets its own payload object, carrying the model it was assigned
    assert sorted(down) == selected
    assert len({id(p) for p in down.values()}) == 3
    assert sorted(server.assignment.values()) == [0, 1, 2]
    for cid, payload in down.items():
        assert torch.equal(payload["model"]["head.weight"], torch.full((2, 3), 10.0 * server.assignment[cid]))
    # the shuffle is a function of (seed, round): the same round gives the same assignment
    first = dict(server.assignment)
    server.configure(0, selected)
    assert server.assignment == first

    # Prepare: the client holding model i uploads floats = (1, 2, 4)[i] and counter 10 + i
    uploaded_value = [1.0, 2.0, 4.0]
    uplinks = {
        cid: {"model": constant_state(template, uploaded_value[i], 10 + i)}
        for cid, i in server.assignment.items()
    }
    # Execute
    server.aggregate(0, dict(sorted(uplinks.items())))
    # Assert: round 0 in-order co = (1, 2, 0):
    #   w0 = .75*1 + .25*2 = 1.25 ; w1 = .75*2 + .25*4 = 2.5 ; w2 = .75*4 + .25*1 = 3.25
    #   BN running stats fused alike; num_batches_tracked copied from self (10, 11, 12)
    #   global = (1.25 + 2.5 + 3.25) / 3 = 7/3, its counter from model 0
    assert server.collaborators == [1, 2, 0]
    for i, expected in enumerate([1.25, 2.5, 3.25]):
        state = server.middleware[i]
        for key in ("head.weight", "features.0.bias", "features.1.running_mean", "features.1.running_var"):
            assert_close(state[key], torch.full_like(template[key], expected))
        assert state["features.1.num_batches_tracked"].item() == 10 + i
        assert state["head.weight"].dtype == torch.float32
    glob = server.global_model().state_dict()
    assert_close(glob["head.weight"], torch.full((2, 3), 7.0 / 3))
    assert_close(glob["features.1.running_var"], torch.full((3,), 7.0 / 3))
    assert glob["features.1.num_batches_tracked"].item() == 10
    # the eval payload is the global model
    assert_close(server.eval_payload()["model"]["head.bias"], torch.full((2,), 7.0 / 3))

    # the next round dispatches the fused models
    down = server.configure(1, [1, 3, 4])
    for cid, payload in down.items():
        expected = [1.25, 2.5, 3.25][server.assignment[cid]]
        assert_close(payload["model"]["head.bias"], torch.full((2,), expected))


def test_lowest_similarity_pairs_the_uploads_by_their_parameters_alone():
    # Prepare: K = 3 identical middleware models (same_init), so the dispatched models are all alike
    # and a similarity read from them would tie everywhere (lowest partners 1, 0, 0)
    server = make_server("fedcross.selection=lowest_similarity", "fedcross.alpha=0.75")
    template = server.middleware[0]
    server.configure(0, [0, 1, 2])
    # the upload of model i: a_i on head.weight, b_i on features.0.weight (6 elements each), the other
    # parameters 0, so its parameter vector is HAND_V's row i in two equal-norm directions:
    #   (a, b) = (1, 0), (1, 1), (10, 20) -> lowest-cosine partners co = (2, 0, 0) (see HAND_V)
    # and BN running means (1000, 0, 1000): counted, they would make models 0 and 2 the most alike
    a, b, running = (1.0, 1.0, 10.0), (0.0, 1.0, 20.0), (1000.0, 0.0, 1000.0)

    def upload(i: int) -> dict:
        state = constant_state(template, 0.0, 0)
        state["head.weight"] = torch.full((2, 3), a[i])
        state["features.0.weight"] = torch.full((3, 2), b[i])
        state["features.1.running_mean"] = torch.full((3,), running[i])
        return state

    # Execute
    server.aggregate(0, {cid: {"model": upload(i)} for cid, i in server.assignment.items()})
    # Assert: partners from the uploads' parameters; w_i = .75 v_i + .25 v_co(i) on every float entry
    assert server.collaborators == [2, 0, 0]
    expected = {
        "head.weight": (0.75 * 1 + 0.25 * 10, 0.75 * 1 + 0.25 * 1, 0.75 * 10 + 0.25 * 1),
        "features.0.weight": (0.25 * 20, 0.75 * 1, 0.75 * 20),
        "features.1.running_mean": (0.75 * 1000 + 0.25 * 1000, 0.25 * 1000, 0.75 * 1000 + 0.25 * 1000),
    }
    for key, values in expected.items():
        for i, value in enumerate(values):
            assert_close(server.middleware[i][key], torch.full_like(template[key], value))
    # counted with the BN statistics, model 0's least similar partner would be model 1
    every_float = [k for k, v in template.items() if v.is_floating_point()]
    uploads = [upload(i) for i in range(3)]
    sim = cosine_from_gram(similarity_gram(uploads, every_float))
    assert select_collaborators(3, 0, "lowest_similarity", sim)[0].item() == 1


def test_shuffle_changes_across_rounds():
    server = make_server()
    assignments = set()
    for rnd in range(12):
        server.configure(rnd, [0, 1, 2])
        assignments.add(tuple(server.assignment[c] for c in (0, 1, 2)))
    assert len(assignments) > 1


def test_global_model_is_uniform_mean_not_sample_weighted():
    server = make_server("fedcross.selection=lowest_similarity", "fedcross.alpha=1.0")
    down = server.configure(0, [0, 1, 2])
    template = server.middleware[0]
    # alpha = 1: models come back unchanged; very different sample counts must not matter
    uplinks = {
        cid: {"model": constant_state(template, float(server.assignment[cid]), 0), "num_samples": 10**cid}
        for cid in down
    }
    server.aggregate(0, uplinks)
    for i in range(3):
        assert_close(server.middleware[i]["head.weight"], torch.full((2, 3), float(i)))
    assert_close(server.global_model().state_dict()["head.weight"], torch.full((2, 3), 1.0))  # (0+1+2)/3


def test_failed_client_leaves_its_model_as_dispatched():
    server = make_server("fedcross.selection=in_order", "fedcross.alpha=0.5")
    template = server.middleware[0]
    server.middleware = [constant_state(template, 2.0 * i, 0) for i in range(3)]  # 0, 2, 4
    server.configure(0, [0, 1, 2])
    client_of = {i: cid for cid, i in server.assignment.items()}
    # models 0 and 1 come back as 1.0 and 3.0; model 2's client failed -> V[2] = 4.0
    uplinks = {
        client_of[0]: {"model": constant_state(template, 1.0, 0)},
        client_of[1]: {"model": constant_state(template, 3.0, 0)},
    }
    server.aggregate(0, uplinks)
    # co = (1, 2, 0), alpha .5: w = (2.0, 3.5, 2.5)
    got = [server.middleware[i]["head.bias"][0].item() for i in range(3)]
    assert got == pytest.approx([2.0, 3.5, 2.5])
    # a round in which every client failed changes nothing
    server.configure(1, [0, 1, 2])
    server.aggregate(1, {})
    got = [server.middleware[i]["head.bias"][0].item() for i in range(3)]
    assert got == pytest.approx([2.0, 3.5, 2.5])


def test_propeller_rounds_then_plain_cross_aggregation():
    # K = 3, P = 2 for round 0 only: every model -> mean of all three; round 1 is plain in-order CrossAggr
    server = make_server(
        "fedcross.propeller_rounds=1",
        "fedcross.propeller_num=2",
        "fedcross.selection=in_order",
        "fedcross.alpha=0.5",
    )
    template = server.middleware[0]
    server.configure(0, [0, 1, 2])
    server.aggregate(
        0, {cid: {"model": constant_state(template, 3.0 * i, 0)} for cid, i in server.assignment.items()}
    )
    for i in range(3):
        assert_close(server.middleware[i]["head.weight"], torch.full((2, 3), 3.0))  # (0+3+6)/3
    server.configure(1, [0, 1, 2])
    server.aggregate(
        1, {cid: {"model": constant_state(template, 3.0 * i, 0)} for cid, i in server.assignment.items()}
    )
    # round 1 in-order, K = 3: offset 1 % 2 + 1 = 2 -> co = (2, 0, 1)
    # w = .5*(0,3,6) + .5*(6,0,3) = (3, 1.5, 4.5)
    assert server.collaborators == [2, 0, 1]
    got = [server.middleware[i]["head.bias"][0].item() for i in range(3)]
    assert got == pytest.approx([3.0, 1.5, 4.5])


def test_dynamic_alpha_is_applied_by_the_server():
    # DA over rounds 0..1 (R = 2): round 0 uses alpha 0.5; in-order co = (1, 2, 0)
    # v = (0, 1, 2) -> w = .5*(0,1,2) + .5*(1,2,0) = (.5, 1.5, 1.0)  (alpha 0.9 would give (.1, 1.1, 1.8))
    server = make_server(
        "fedcross.dynamic_alpha_rounds=2", "fedcross.selection=in_order", "fedcross.alpha=0.9"
    )
    template = server.middleware[0]
    server.configure(0, [0, 1, 2])
    server.aggregate(
        0, {cid: {"model": constant_state(template, float(i), 0)} for cid, i in server.assignment.items()}
    )
    got = [server.middleware[i]["head.bias"][0].item() for i in range(3)]
    assert got == pytest.approx([0.5, 1.5, 1.0])


# --------------------------------------------------------------------------------------------- config


def test_config_defaults_follow_the_paper():
    cfg = load_config(None, ["algorithm=fedcross"])
    assert isinstance(cfg.algo, FedCrossConfig)
    assert cfg.algo.alpha == 0.99 and cfg.algo.selection == "lowest_similarity"
    assert cfg.algo.num_middleware is None and cfg.algo.same_init
    assert cfg.algo.propeller_rounds == 0 and cfg.algo.dynamic_alpha_rounds == 0


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["fedcross.alpha=0.4"], "fedcross.alpha=0.4"),
        (["fedcross.alpha=1.2"], "fedcross.alpha=1.2"),
        (["fedcross.num_middleware=7"], "fedcross.num_middleware=7"),  # more models than clients
        (["fedcross.num_middleware=1"], "fedcross.num_middleware=1"),
        (["train.fraction=0.1"], "train.fraction=0.1"),  # K = 1
        (["fedcross.selection=random"], "fedcross.selection"),
        (["model.group=small_hetero"], "model.group"),
        (["fedcross.propeller_rounds=5", "fedcross.propeller_num=9"], "fedcross.propeller_num=9"),
        (
            ["fedcross.propeller_rounds=50", "fedcross.propeller_num=2", "fedcross.dynamic_alpha_rounds=50"],
            "dynamic_alpha_start_round=0",
        ),
        (["fedcross.dynamic_alpha_rounds=-1"], "fedcross.dynamic_alpha_rounds=-1"),
        (["train.keep_optimizer_state=true"], "train.keep_optimizer_state=true with algorithm=fedcross"),
    ],
)
def test_bad_config_is_a_one_line_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm=fedcross", "data.num_clients=6", "train.fraction=0.5", *overrides])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_pm_da_config_loads_and_the_server_runs_its_schedule():
    # PM-DA as in Fig. 9: PM for rounds 0..49, DA for 50..99; num_middleware equal to K is accepted
    cfg = load_config(
        None,
        [
            "algorithm=fedcross",
            "data.num_clients=10",
            "train.fraction=0.5",
            "fedcross.num_middleware=5",
            "fedcross.propeller_rounds=50",
            "fedcross.dynamic_alpha_rounds=50",
            "fedcross.dynamic_alpha_start_round=50",
            "fedcross.selection=in_order",
            "fedcross.alpha=0.9",
        ],
    )
    hp = cfg.algo
    assert (hp.num_middleware, hp.propeller_rounds, hp.propeller_num) == (5, 50, 4)
    assert (hp.dynamic_alpha_rounds, hp.dynamic_alpha_start_round, hp.alpha) == (50, 50, 0.9)
    server = FedCrossServer(ServerContext(cfg, 10, 2, ["tiny"] * 10, tiny_model))
    assert server.num_models == 5
    v = torch.arange(5, dtype=torch.float64)[:, None]  # model i is the number i
    uploaded = [constant_state(server.middleware[0], float(i), 0) for i in range(5)]

    def fused(rnd: int) -> list[float]:
        return server.fusion(rnd, uploaded)(v)[:, 0].tolist()

    # rounds 0..49, PM with P = 4 of K = 5: every model becomes the mean of all five, (0+1+2+3+4)/5
    assert fused(0) == fused(49) == pytest.approx([2.0] * 5)
    # DA from round 50: alpha 0.5 + 0.4 * (r - 50) / 50 with the in-order partner of round r
    for rnd, alpha in ((50, 0.5), (75, 0.7), (99, 0.5 + 0.4 * 49 / 50), (100, 0.9), (140, 0.9)):
        offset = rnd % 4 + 1  # in-order: co(i) = (i + r mod (K-1) + 1) mod K
        expected = [alpha * i + (1 - alpha) * ((i + offset) % 5) for i in range(5)]
        assert fused(rnd) == pytest.approx(expected), rnd
        assert server.collaborators == [(i + offset) % 5 for i in range(5)]


def test_num_middleware_fixes_the_clients_per_round():
    """The paper's K is both the number of middleware models and of sampled clients."""
    cfg = load_config(None, ["algorithm=fedcross", "data.num_clients=10", "train.fraction=0.5"])
    assert clients_per_round(cfg) == 5
    cfg = load_config(
        None, ["algorithm=fedcross", "data.num_clients=10", "train.fraction=0.5", "fedcross.num_middleware=3"]
    )
    assert clients_per_round(cfg) == 3
