"""CluSamp's distances, clustered distributions (against a literal transcription of the authors'
Algorithm 2), draws and server, without Ray; the platform's ``Server.select`` rule; and a real run
whose rounds train the clients the server drew."""

import math
import tempfile
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_overrides
from in_process import client_task
from scipy.cluster.hierarchy import fcluster, linkage
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.clusamp import (
    CluSampServer,
    cluster_distributions,
    draw_clients,
    flat_parameters,
    gradient_distances,
)
from fedray.platform.api.algorithm import ServerContext, sample_clients
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.errors import ConfigError, ContractError
from fedray.platform.runtime.coordinator import build_server, checked_selection
from fedray.platform.runtime.driver import federation_meta, prepare_federation, run_experiment
from fedray.platform.runtime.worker import ClientHost


def test_distances_by_hand():
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]])
    arccos = gradient_distances(g, "arccos")
    assert_close(arccos[0, 1], torch.tensor(math.pi / 2, dtype=torch.float64))
    assert_close(arccos[0, 2], torch.tensor(math.pi, dtype=torch.float64))
    assert arccos[0, 0] == 0 and (arccos[3] == 0).all() and (arccos[:, 3] == 0).all()  # a zero gradient: 0
    assert gradient_distances(g, "l1")[0, 1] == 3.0 and gradient_distances(g, "l1")[1, 2] == 5.0
    assert (
        gradient_distances(g, "l2")[0, 1] == pytest.approx(5.0) and gradient_distances(g, "l2")[0, 2] == 16.0
    )


def authors_algorithm_2(distances, shares, m, rng):
    """Algorithm 2 as the authors' ``get_clusters_with_alg2`` writes it (their global numpy draws as
    ``rng``'s), for inputs where every client holds at most 1/m of the data."""
    eps = 10**10
    tree = linkage(distances, "ward")
    weights = list(shares)
    for i in range(len(tree)):
        weights.append(weights[int(tree[i, 0])] + weights[int(tree[i, 1])])
        tree[i, 2] = int(weights[-1] * eps)
    clusters = fcluster(tree, int(eps / m), criterion="distance")
    n_clusters = len(set(clusters))
    pop = np.zeros((n_clusters, 2)).astype(int)
    for i in range(n_clusters):
        pop[i, 0] = i + 1
        for client in np.where(clusters == i + 1)[0]:
            pop[i, 1] += int(shares[client] * eps * m)
    pop = pop[pop[:, 1].argsort()]
    rows = np.zeros((m, len(shares))).astype(int)
    for idx, cluster in enumerate(pop[n_clusters - m :, 0]):
        for client in np.where(clusters == cluster)[0]:
            rows[idx, client] = int(shares[client] * m * eps)
    k = 0
    for j in pop[: n_clusters - m, 0]:
        members = np.where(clusters == j)[0]
        rng.shuffle(members)
        for client in members:
            left = int(shares[client] * eps * m)
            while left > 0:
                u = min(eps - np.sum(rows[k]), left)
                rows[k, client] = u
                left -= u
                if np.sum(rows[k]) == eps:
                    k += 1
    rows = rows.astype(float)
    return rows / rows.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("seed", range(6))
def test_the_distributions_are_the_authors_and_unbiased(seed):
    gen = np.random.default_rng(seed)
    n, m = 20, [2, 4, 5][seed % 3]
    points = gen.normal(size=(n, 3))
    distances = np.linalg.norm(points[:, None] - points[None], axis=2)
    shares = gen.integers(20, 60, size=n).astype(float)
    shares /= shares.sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = authors_algorithm_2(distances, shares, m, np.random.default_rng(7))
    got = cluster_distributions(distances, shares, m, np.random.default_rng(7))
    assert_close(got, want, rtol=0, atol=1e-12)
    assert_close(got.sum(axis=1), np.ones(m), rtol=0, atol=1e-12)
    assert_close(got.mean(axis=0), shares, rtol=0, atol=1e-9)  # each client's expected weight: its share


def test_two_clear_groups_fill_one_distribution_each():
    distances = np.array([[0, 1, 9, 9], [1, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, 0]], dtype=float)
    got = cluster_distributions(distances, np.full(4, 0.25), 2, np.random.default_rng(0))
    rows = sorted(tuple(r) for r in got)
    assert rows == [(0.0, 0.0, 0.5, 0.5), (0.5, 0.5, 0.0, 0.0)]  # a round draws one client of each group


def test_a_client_with_more_than_its_share_of_a_distribution_spills_over_and_the_sampling_stays_unbiased():
    shares = np.array([0.5, 0.2, 0.2, 0.1])
    got = cluster_distributions(np.zeros((4, 4)), shares, 4, np.random.default_rng(0))
    assert_close(got.sum(axis=1), np.ones(4), rtol=0, atol=1e-12)
    assert_close(got.mean(axis=0), shares, rtol=0, atol=1e-9)
    assert (got[:, 0] == 1.0).sum() == 1  # a distribution of its own, and half of another


def test_one_draw_per_distribution():
    rows = np.eye(4)[[2, 0, 2]]
    assert draw_clients(rows, np.random.default_rng(0)).tolist() == [2, 0, 2]


def server_of(sizes=(30, 30, 30, 10), *overrides: str) -> CluSampServer:
    cfg = load_config(None, ["algorithm=clusamp", "data.num_clients=4", *overrides])
    ctx = ServerContext(cfg, 4, 3, ["flat_bn"] * 4, lambda cid: bn_model(cid), train_sizes=list(sizes))
    return CluSampServer(ctx)


def shifted(server: CluSampServer, by: float) -> dict[str, torch.Tensor]:
    return {k: v + by if v.is_floating_point() else v.clone() for k, v in server.model.state_dict().items()}


def test_the_server_weighs_by_draws_and_keeps_the_arrived_clients_gradients():
    server = server_of()
    sent = flat_parameters(server.model, server.model.state_dict())
    server.draws = torch.tensor([2, 1, 0, 0])  # client 0 drawn twice
    a, b = shifted(server, 1.0), shifted(server, 4.0)
    server.aggregate(0, {0: {"model": a}, 1: {"model": b}})
    key = "features.1.weight"
    assert_close(server.model.state_dict()[key], (2 * a[key] + b[key]) / 3)
    params = len(sent)
    assert_close(server.gradients[0], torch.full((params,), 1.0))  # parameters only: BatchNorm's buffers not
    assert_close(server.gradients[1], torch.full((params,), 4.0))
    assert (server.gradients[2:] == 0).all()
    assert set(server.state_dict()) == {"model", "gradients", "draws"}


def test_select_draws_m_times_from_the_distributions_and_repeats_nothing():
    server = server_of()
    picked = server.select(3, 3)
    assert picked == sorted(set(picked)) and int(server.draws.sum()) == 3
    assert set(server.draws.nonzero().squeeze(1).tolist()) == set(picked)
    assert server_of().select(3, 3) == picked  # a function of the server's state, the seed and the round


@pytest.mark.parametrize(
    ("selected", "message"),
    [
        ([1, 1], "returned client 1 twice: a round's clients are distinct"),
        ([0, 4], "returned client 4: ids run from 0 to 3"),
        ([], "returned list \\[\\]: a non-empty list of client ids"),
        ([0.5], "returned list \\[0.5\\]: a non-empty list of client ids"),
    ],
)
def test_a_selection_breaking_the_rule_is_one_line(selected, message):
    with pytest.raises(ContractError, match=f"round 2: CluSampServer.select {message}"):
        checked_selection(server_of(), 1, selected, 4)


def test_a_selection_is_sorted():
    assert checked_selection(server_of(), 0, [3, np.int64(0), 2], 4) == [0, 2, 3]


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"clusamp.distance='cosine': allowed values are arccos, l1, l2"):
        load_config(None, ["algorithm=clusamp", "clusamp.distance=cosine"])


def replayed_selections(cfg, rounds: int) -> list[list[int]]:
    """The clients CluSamp's server draws each round, replayed in this process (the real worker's
    training, no Ray): a run's training is the same bits on any worker, so its draws are too."""
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    host = ClientHost(cfg, num_threads=1)
    host.setup(meta)
    server = build_server(cfg, meta)
    out = []
    with tempfile.TemporaryDirectory() as states:
        for rnd in range(rounds):
            selected = checked_selection(
                server, rnd, server.select(rnd, clients_per_round(cfg)), len(fed.shards)
            )
            out.append(selected)
            payloads = server.configure(rnd, selected)
            tasks = [client_task(c, fed.shards[c], states) for c in selected]
            results = host.train(rnd, tasks, [[payloads[c]] for c in selected])
            server.aggregate(rnd, {r.client: r.uplink for r in results})
    return out


@pytest.mark.usefixtures("ray_session")
def test_a_run_trains_the_clients_its_server_draws(mlflow_store):
    cfg = load_config(
        None,
        [
            "algorithm=clusamp",
            *tiny_overrides(
                rounds=3, seed=2, **{"data.num_clients": 8, "train.fraction": 0.5, "eval.clients": "selected"}
            ),
        ],
    )
    replay = replayed_selections(cfg, 3)
    result = run_experiment(cfg)
    assert sorted(result.client_acc) == replay[-1]  # the last round's clients, tested
    assert [h["clients/selected"] for h in result.history] == [len(s) for s in replay]
    # not the uniform draw every other algorithm makes
    assert replay != [sample_clients(cfg.seed, rnd, 8, 4) for rnd in range(3)]


def test_select_reads_the_gradients_aggregate_stored_and_a_reloaded_server_draws_the_same():
    server = server_of((25, 25, 25, 25))
    sent = server.model.state_dict()
    # clients 0 and 2 moved one way, 1 and 3 the other: two groups (not in id order, which is how
    # zero gradients would group them), one draw from each
    server.draws = torch.ones(4, dtype=torch.int64)
    ups = {c: {"model": shifted(server, by)} for c, by in enumerate((1.0, -1.0, 1.1, -0.9))}
    server.aggregate(0, ups)
    assert (server.gradients[0] > 0).all() and (server.gradients[1] < 0).all()
    for rnd in range(1, 9):
        picked = server.select(rnd, 2)
        assert len(picked) == 2 and len(set(picked) & {0, 2}) == 1, (rnd, picked)
    resumed = server_of((25, 25, 25, 25))
    resumed.load_state_dict(server.state_dict())
    assert resumed.select(9, 2) == server.select(9, 2)
    assert sent.keys() == server.model.state_dict().keys()
