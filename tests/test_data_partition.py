"""Partitioners: coverage, determinism, skew, class counts and the long-tail profile."""

from __future__ import annotations

import numpy as np
import pytest

from fedray.platform.config import PartitionConfig
from fedray.platform.data.partition import (
    apply_plan,
    dirichlet,
    iid,
    long_tail,
    partition,
    shamsian,
    shamsian_plan,
    shards,
    stratified_split,
)
from fedray.platform.errors import ConfigError

NUM_CLASSES = 10
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(NUM_CLASSES), 100))  # 1000, balanced

PARTITIONERS = {
    "iid": lambda labels, seed: iid(labels, 10, seed),
    "dirichlet": lambda labels, seed: dirichlet(labels, 10, 0.3, 10, seed),
    "shards": lambda labels, seed: shards(labels, 10, 2, seed),
    "shamsian": lambda labels, seed: shamsian(labels, 10, 2, seed),  # 10 * 2 slots cover all 10 classes
}


def classes_of(part: np.ndarray, labels: np.ndarray = LABELS) -> set[int]:
    return set(np.unique(labels[part]).tolist())


def label_entropy(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> float:
    """Mean over clients of the entropy (nats) of the client's label distribution."""
    out = []
    for part in parts:
        p = np.bincount(labels[part], minlength=NUM_CLASSES) / len(part)
        out.append(-(p[p > 0] * np.log(p[p > 0])).sum())
    return float(np.mean(out))


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_every_sample_assigned_exactly_once(name):
    parts = PARTITIONERS[name](LABELS, 0)
    assert len(parts) == 10
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS)  # no duplicates ...
    np.testing.assert_array_equal(np.sort(joined), np.arange(len(LABELS)))  # ... and nothing missing
    for part in parts:
        assert part.dtype == np.int64
        assert (np.diff(part) > 0).all()  # sorted


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_same_seed_same_partition_other_seed_differs(name):
    a, b, c = PARTITIONERS[name](LABELS, 7), PARTITIONERS[name](LABELS, 7), PARTITIONERS[name](LABELS, 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in iid(np.zeros(1003, dtype=int), 10, 0)]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == 1003


def test_dirichlet_respects_min_samples():
    for seed in range(3):
        parts = dirichlet(LABELS, 10, 0.3, 40, seed)
        assert min(len(p) for p in parts) >= 40


def test_dirichlet_smaller_alpha_gives_more_label_skew():
    skewed = np.mean([label_entropy(dirichlet(LABELS, 10, 0.05, 0, s)) for s in range(3)])
    uniform = np.mean([label_entropy(dirichlet(LABELS, 10, 100.0, 0, s)) for s in range(3)])
    assert skewed < 0.6 * uniform
    assert uniform > 0.95 * np.log(NUM_CLASSES)  # near-uniform label mix per client


def test_dirichlet_impossible_min_samples_raises_config_error():
    with pytest.raises(ConfigError, match="min_samples"):
        dirichlet(LABELS, 10, 0.5, 101, 0)  # 10 x 101 > 1000 samples
    with pytest.raises(ConfigError, match=r"min_samples=90.*alpha=0\.01.*num_clients=10"):
        dirichlet(LABELS, 10, 0.01, 90, 0, max_tries=20)  # possible in count, never drawn


def test_shards_give_at_most_k_classes():
    for k in (1, 2, 3):
        parts = shards(LABELS, 10, k, 0)
        assert all(1 <= len(classes_of(p)) <= k for p in parts)


def test_shards_never_straddle_classes_with_uneven_class_sizes():
    labels = np.repeat(np.arange(5), [130, 70, 100, 97, 103])  # sort-and-cut would straddle here
    parts = shards(labels, 10, 2, 3)
    assert all(len(classes_of(p, labels)) <= 2 for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_shards_need_enough_shards_for_all_classes():
    with pytest.raises(ConfigError, match="classes_per_client"):
        shards(LABELS, 3, 2, 0)  # 6 shards for 10 classes


def test_shamsian_gives_exactly_k_distinct_classes_evenly_spread():
    for k in (2, 3, 5):
        parts = shamsian(LABELS, 10, k, 0)
        assert all(len(classes_of(p)) == k for p in parts)
        holders = np.zeros(NUM_CLASSES, dtype=int)
        for p in parts:
            holders[list(classes_of(p))] += 1
        assert holders.max() - holders.min() <= 1  # greedy keeps slots per class even


def test_shamsian_plan_proportions_within_band():
    """Two holders per class, weights ~ U(0.4, 0.6): a normalised share lies in [0.4, 0.6]."""
    plan = shamsian_plan(NUM_CLASSES, 10, 2, 0)
    assert ((plan > 0).sum(axis=1) == 2).all()
    assert ((plan > 0).sum(axis=0) == 2).all()
    np.testing.assert_allclose(plan.sum(axis=0), 1.0)
    shares = plan[plan > 0]
    assert shares.min() >= 0.4 - 1e-12 and shares.max() <= 0.6 + 1e-12
    # four holders per class: share in [0.4 / (0.4 + 3 * 0.6), 0.6 / (0.6 + 3 * 0.4)]
    wide = shamsian_plan(NUM_CLASSES, 20, 2, 1)
    assert ((wide > 0).sum(axis=0) == 4).all()
    assert wide[wide > 0].min() >= 0.4 / 2.2 - 1e-12 and wide[wide > 0].max() <= 0.6 / 1.8 + 1e-12


def test_apply_plan_splits_each_class_by_the_plan_and_carries_to_another_pool():
    plan = shamsian_plan(NUM_CLASSES, 10, 2, 5)
    parts = apply_plan(LABELS, plan, 5)
    counts = np.stack([np.bincount(LABELS[p], minlength=NUM_CLASSES) for p in parts])
    assert np.abs(counts - plan * 100).max() < 1  # largest remainder: within one sample of the share
    test_pool = np.repeat(np.arange(NUM_CLASSES), 20)
    test_parts = apply_plan(test_pool, plan, 5)
    assert [classes_of(p) for p in parts] == [classes_of(p, test_pool) for p in test_parts]


def test_shamsian_leaves_out_classes_nobody_holds():
    parts = shamsian(LABELS, 3, 2, 0)  # 6 slots: 4 classes held by no one
    held = set().union(*(classes_of(p) for p in parts))
    assert len(held) == 6
    joined = np.concatenate(parts)
    assert len(joined) == len(set(joined.tolist())) == 600


@pytest.mark.parametrize("rho", [10.0, 100.0])
def test_long_tail_follows_exponential_profile(rho):
    kept = long_tail(LABELS, rho, 0)
    counts = np.bincount(LABELS[kept], minlength=NUM_CLASSES)
    expected = np.floor(100 * rho ** (-np.arange(NUM_CLASSES) / 9) + 1e-9)
    np.testing.assert_array_equal(counts, expected)
    assert counts[0] / counts[-1] == pytest.approx(rho)
    assert (np.diff(counts) <= 0).all()
    assert len(np.unique(kept)) == len(kept)


def test_long_tail_on_unbalanced_classes_stays_feasible():
    labels = np.repeat(np.arange(4), [50, 80, 30, 100])
    counts = np.bincount(labels[long_tail(labels, 4.0, 0)], minlength=4)
    assert (counts <= [50, 80, 30, 100]).all()
    assert counts[0] / counts[-1] == pytest.approx(4.0, rel=0.1)


def test_long_tail_rho_one_keeps_everything():
    np.testing.assert_array_equal(long_tail(LABELS, 1.0, 0), np.arange(len(LABELS)))


def test_stratified_split_exact_totals_and_per_class_shares():
    labels = np.repeat(np.arange(4), [41, 23, 57, 9])
    train, val, test = stratified_split(labels, (0.8, 0.1, 0.1), 0)
    assert (len(val), len(test)) == (round(130 * 0.1), round(130 * 0.1))
    assert len(train) == 130 - 26
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val, test])), np.arange(130))
    sizes = np.bincount(labels, minlength=4)
    for part, ratio in ((train, 0.8), (val, 0.1), (test, 0.1)):
        per_class = np.bincount(labels[part], minlength=4)
        assert np.abs(per_class - ratio * sizes).max() <= 2


def test_partition_dispatch_applies_long_tail_then_partitions():
    cfg = PartitionConfig(kind="iid", long_tail_rho=10.0)
    parts = partition(LABELS, cfg, 5, NUM_CLASSES, seed=0)
    joined = np.concatenate(parts)
    counts = np.bincount(LABELS[joined], minlength=NUM_CLASSES)
    assert counts[0] == 100 and counts[-1] == 10
    assert len(np.unique(joined)) == len(joined)
    same = partition(LABELS, cfg, 5, NUM_CLASSES, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same))


def test_too_few_samples_after_the_long_tail_names_the_long_tail():
    # min_samples alone fits the whole pool: the message must say what thinned it
    cfg = PartitionConfig(kind="dirichlet", min_samples=50, long_tail_rho=10.0)
    partition(LABELS, PartitionConfig(kind="dirichlet", min_samples=50), 10, NUM_CLASSES, seed=0)
    with pytest.raises(ConfigError) as err:
        partition(LABELS, cfg, 10, NUM_CLASSES, seed=0)
    assert str(err.value) == (
        f"data.partition.min_samples=50: 10 clients x 50 exceeds the 403 samples, which "
        f"data.partition.long_tail_rho=10 left of {len(LABELS)}"
    )


def test_partition_kind_file_is_not_supported_yet():
    with pytest.raises(ConfigError, match=r"data\.partition\.kind=file is not a partitioner"):
        partition(LABELS, PartitionConfig(kind="file", path="x.json"), 5, NUM_CLASSES, seed=0)


def test_the_long_tail_note_is_only_on_the_too_few_samples_error():
    """Another partition error (no Dirichlet draw gave each client its minimum) keeps its own ending."""
    cfg = PartitionConfig(kind="dirichlet", alpha=0.01, min_samples=40, long_tail_rho=10.0)
    with pytest.raises(ConfigError) as err:
        partition(LABELS, cfg, 10, NUM_CLASSES, seed=0)
    assert str(err.value).endswith("or use fewer clients"), err.value
