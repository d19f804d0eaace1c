"""Split conventions (per_client, merged, official_test) and the majority-label baseline."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from fedray.platform.catalog import load_config
from fedray.platform.config import DataConfig, PartitionConfig, SplitConfig
from fedray.platform.data import (
    ClientShard,
    Federation,
    build_federation,
    check_data,
    load_dataset,
    majority_baseline,
)
from fedray.platform.data.bundle import ArrayDataset
from fedray.platform.errors import ConfigError


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DataConfig(dataset="digits"))


def cfg_for(convention: str, ratios, kind: str = "dirichlet", num_clients: int = 6, **kw) -> DataConfig:
    return DataConfig(
        num_clients=num_clients,
        partition=PartitionConfig(kind=kind, alpha=0.5, classes_per_client=3),
        split=SplitConfig(*ratios, convention=convention),
        **kw,
    )


def all_ids(fed, parts=("train", "val", "test")) -> np.ndarray:
    return np.concatenate([getattr(s, f"{p}_ids") for s in fed.shards for p in parts])


def check_ids_match_data(fed, bundle) -> None:
    for s in fed.shards:
        for p in ("train", "val", "test"):
            expected = bundle.take(getattr(s, f"{p}_ids"))
            assert torch.equal(getattr(s, p).x, expected.x) and torch.equal(getattr(s, p).y, expected.y)


# ------------------------------------------------------------------------------------------ per_client


# the split of seed 7 as fedray has always drawn it: a change of the algorithm (or of numpy's
# generators) would move samples between clients in every stored run's split
PER_CLIENT_DIGEST = {None: "2c7ba3f53c1c23ea", 900: "b1a6edd8484a3eef"}


def split_digest(fed) -> str:
    h = hashlib.sha256()
    for s in fed.shards:
        for part in ("train", "val", "test"):
            h.update(np.asarray(getattr(s, f"{part}_ids"), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("train_subset", [None, 900])
def test_per_client_splits_each_clients_own_samples_by_the_ratios(digits, train_subset):
    fed = build_federation(digits, cfg_for("per_client", (0.8, 0.1, 0.1), train_subset=train_subset), seed=7)
    ids = all_ids(fed)
    # the official train set (or a subset of it) is shared out, each sample once; its test set is the global test
    assert len(ids) == len(np.unique(ids)) == (train_subset or len(digits.train))
    assert (ids < len(digits.train)).all() and fed.global_test is digits.test
    labels = digits.train.y.numpy()
    if train_subset:  # a stratified subset: each class its share of 900, give or take one
        share = np.bincount(labels, minlength=10) * train_subset / len(labels)
        assert (np.abs(np.bincount(labels[ids], minlength=10) - share) <= 1).all()
    for s in fed.shards:
        own = np.concatenate([s.train_ids, s.val_ids, s.test_ids])
        n = len(own)
        # test exactly round(10 %), validation 10 % within one, train the rest
        assert len(s.test) == math.floor(0.1 * n + 0.5) and abs(len(s.val) - 0.1 * n) <= 1
        for c in np.unique(labels[own]):  # and per class: each part its share, give or take one (two)
            held = (labels[own] == c).sum()
            assert abs((labels[s.test_ids] == c).sum() - 0.1 * held) <= 1
            assert abs((labels[s.val_ids] == c).sum() - 0.1 * held) <= 2
    check_ids_match_data(fed, digits)
    assert split_digest(fed) == PER_CLIENT_DIGEST[train_subset]


# ------------------------------------------------------------------------------------------ merged


def test_merged_pools_both_official_splits_and_splits_by_ratio(digits):
    fed = build_federation(digits, cfg_for("merged", (0.75, 0.0, 0.25), kind="iid"), seed=0)
    ids = all_ids(fed)
    n_train = len(digits.train)
    assert len(ids) == len(np.unique(ids)) == digits.num_samples  # every sample of train + test, once
    for s in fed.shards:
        n = len(s.train) + len(s.test)
        assert len(s.test) == math.floor(n * 0.25 + 0.5) and len(s.val) == 0
        assert (s.train_ids >= n_train).any() and (s.train_ids < n_train).any()
        assert (s.test_ids >= n_train).any() and (s.test_ids < n_train).any()
    check_ids_match_data(fed, digits)
    # the official test set is merged away: the global test is the union of the client tests
    union = np.sort(all_ids(fed, ("test",)))
    np.testing.assert_array_equal(fed.global_test_ids, union)
    assert torch.equal(fed.global_test.y, digits.take(union).y)
    assert torch.equal(fed.global_test.x, digits.take(union).x)


def test_merged_with_subset_and_skew_and_pre_flight(digits):
    cfg = cfg_for("merged", (0.6, 0.2, 0.2), kind="shamsian", num_clients=5, train_subset=1000)
    fed = build_federation(digits, cfg, seed=2)
    assert len(all_ids(fed)) <= 1000 and (all_ids(fed) >= len(digits.train)).any()
    for s in fed.shards:
        assert set(s.test.y.tolist()) <= set(s.train.y.tolist())
    # the pre-flight counts train + test as the pool
    check_data(cfg_for("merged", (0.75, 0, 0.25), kind="iid", num_clients=1600))
    with pytest.raises(ConfigError, match="more clients than the 1438 training samples"):
        check_data(cfg_for("per_client", (0.75, 0, 0.25), kind="iid", num_clients=1600))
    with pytest.raises(ConfigError, match="more clients than the 1797 train \\+ test samples"):
        check_data(cfg_for("merged", (0.75, 0, 0.25), kind="iid", num_clients=1800))


# ------------------------------------------------------------------------------------------ official_test


@pytest.mark.parametrize(("kind", "train_subset"), [("shamsian", None), ("dirichlet", None), ("iid", 719)])
def test_official_test_gives_each_client_its_class_proportions(digits, kind, train_subset):
    cfg = cfg_for("official_test", (0.8, 0.2, 0.0), kind=kind, num_clients=5, train_subset=train_subset)
    fed = build_federation(digits, cfg, seed=3)
    n_train = len(digits.train)
    class_train = np.bincount(digits.train.y.numpy(), minlength=10)
    class_test = np.bincount(digits.test.y.numpy(), minlength=10)
    tests = all_ids(fed, ("test",))
    assert (tests >= n_train).all() and len(tests) == len(np.unique(tests))  # official test, disjoint
    assert (all_ids(fed, ("train", "val")) < n_train).all()
    for s in fed.shards:
        share = np.bincount(np.concatenate([s.train.y.numpy(), s.val.y.numpy()]), minlength=10)
        got = np.bincount(s.test.y.numpy(), minlength=10)
        assert set(s.test.y.tolist()) <= set(s.train.y.tolist())
        # the client's share of each class of the official test = its share of that class of the train set
        assert np.abs(got - share * class_test / class_train).max() <= 1
        n = len(s.train) + len(s.val)
        assert abs(len(s.val) - 0.2 * n) <= 1
        assert abs(len(s.test) - n * len(digits.test) / n_train) <= 10  # within per-class rounding
    assert fed.global_test is digits.test
    check_ids_match_data(fed, digits)
    # deterministic; and every shamsian / dirichlet / iid share of the whole pool uses the whole test set
    again = build_federation(digits, cfg, seed=3)
    assert all(np.array_equal(a.test_ids, b.test_ids) for a, b in zip(fed.shards, again.shards))
    if train_subset is None:
        assert len(tests) == len(digits.test)
    else:
        assert abs(len(tests) - len(digits.test) * train_subset / n_train) <= 10


def test_conventions_are_seeded(digits):
    for convention, ratios in (("merged", (0.75, 0, 0.25)), ("official_test", (1.0, 0, 0))):
        cfg = cfg_for(convention, ratios)
        a, b, c = (build_federation(digits, cfg, seed=s) for s in (1, 1, 2))
        assert all(np.array_equal(x.test_ids, y.test_ids) for x, y in zip(a.shards, b.shards))
        assert not all(np.array_equal(x.train_ids, z.train_ids) for x, z in zip(a.shards, c.shards))


def test_convention_config_validation():
    base = ["data.dataset=digits"]
    with pytest.raises(ConfigError, match=r"data.split.test=0.25: data.split.convention=official_test"):
        load_config(overrides=[*base, "data.split.convention=official_test"])
    ratios = ["data.split.train=0.8", "data.split.val=0.2", "data.split.test=0"]
    cfg = load_config(overrides=[*base, "data.split.convention=official_test", *ratios])
    assert cfg.data.split.convention == "official_test"
    with pytest.raises(ConfigError, match=r"data.split.test=0.0: data.split.convention=merged"):
        load_config(
            overrides=[*base, "data.split.convention=merged", "data.split.train=1", "data.split.test=0"]
        )
    with pytest.raises(ConfigError, match=r"data.split.convention='pflib': allowed values are per_client"):
        load_config(overrides=[*base, "data.split.convention=pflib"])
    assert load_config(overrides=base).data.split.convention == "per_client"


# ------------------------------------------------------------------------------------------ majority baseline


def tiny_shard(client_id: int, train: list[int], test: list[int]) -> ClientShard:
    def ds(labels: list[int]) -> ArrayDataset:
        return ArrayDataset(
            torch.zeros(len(labels), 1, 2, 2, dtype=torch.uint8), torch.tensor(labels, dtype=torch.int64)
        )

    return ClientShard(client_id, ds(train), ds([]), ds(test))


def test_majority_baseline_by_hand():
    shards = [
        tiny_shard(0, [0, 0, 1], [0, 1, 1, 0]),  # predicts 0: 2 of 4
        tiny_shard(1, [2, 1, 1, 2], [1, 1, 2]),  # tie 1 vs 2 -> the smaller label 1: 2 of 3
        tiny_shard(2, [3], []),  # no test data: left out of both means
        tiny_shard(3, [2, 2, 2], [2]),  # predicts 2: 1 of 1
        tiny_shard(4, [3, 3, 0], [0, 1]),  # predicts 3: 0 of 2
    ]
    empty = ArrayDataset(torch.zeros(0, 1, 2, 2, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64))
    fed = Federation(shards, empty, 4, 1, 2, (0.5,), (0.25,), ["a", "b", "c", "d"])
    plain, weighted, per_client = majority_baseline(fed)
    np.testing.assert_allclose(per_client, [0.5, 2 / 3, np.nan, 1.0, 0.0])
    assert plain == pytest.approx((0.5 + 2 / 3 + 1.0 + 0.0) / 4)  # FedSSA: mean over clients
    assert weighted == pytest.approx((2 + 2 + 1 + 0) / (4 + 3 + 1 + 2))  # PFLlib: correct / samples
    nothing = Federation([tiny_shard(0, [1], [])], empty, 2, 1, 2, (0.5,), (0.25,), ["a", "b"])
    plain, weighted, per_client = majority_baseline(nothing)
    assert math.isnan(plain) and math.isnan(weighted) and np.isnan(per_client).all()


def test_majority_baseline_is_high_under_label_skew(digits):
    skewed = cfg_for("per_client", (0.75, 0, 0.25), kind="shamsian", num_clients=10)
    skewed.partition.classes_per_client = 2
    balanced = cfg_for("per_client", (0.75, 0, 0.25), kind="iid", num_clients=10)
    high = majority_baseline(build_federation(digits, skewed, 0))
    low = majority_baseline(build_federation(digits, balanced, 0))
    assert high[0] > 0.45 and high[1] > 0.45  # two classes per client: about one half for free
    assert low[0] < 0.2 and low[1] < 0.2  # ten balanced classes: about a tenth
