"""Federation building: per-client splits, disjointness, histogram table and heatmap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedray.platform.config import DataConfig, PartitionConfig, SplitConfig
from fedray.platform.data import build_federation, histogram_heatmap, load_dataset
from fedray.platform.data.bundle import ArrayDataset, DatasetBundle
from fedray.platform.errors import ConfigError


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DataConfig(dataset="digits"))


def make_bundle(n: int = 200, num_classes: int = 4) -> DatasetBundle:
    """Every image holds its own index in its pixels, so shards can be traced back to the pool."""
    idx = torch.arange(n)
    x = torch.stack([idx // 256, idx % 256], dim=1).to(torch.uint8).view(n, 1, 1, 2).expand(n, 1, 2, 2)
    y = idx % num_classes
    train = ArrayDataset(x.contiguous(), y)
    return DatasetBundle(
        "toy",
        train,
        train.subset(range(10)),
        num_classes,
        1,
        2,
        (0.5,),
        (0.25,),
        [f"c{i}" for i in range(num_classes)],
    )


def pool_index(ds: ArrayDataset) -> np.ndarray:
    x = ds.x.numpy().astype(np.int64)
    return x[:, 0, 0, 0] * 256 + x[:, 0, 0, 1]


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards", "shamsian"])
def test_shards_are_disjoint_and_cover_the_pool(kind):
    bundle = make_bundle()
    cfg = DataConfig(
        num_clients=5, partition=PartitionConfig(kind=kind, min_samples=5), split=SplitConfig(0.6, 0.2, 0.2)
    )
    fed = build_federation(bundle, cfg, seed=0)
    ids = np.concatenate(
        [pool_index(getattr(s, part)) for s in fed.shards for part in ("train", "val", "test")]
    )
    assert len(ids) == len(np.unique(ids)) == 200
    for shard in fed.shards:  # labels travel with their images
        for part in (shard.train, shard.val, shard.test):
            np.testing.assert_array_equal(part.y.numpy(), pool_index(part) % 4)


def test_split_ratios_are_respected_per_client(digits):
    cfg = DataConfig(
        num_clients=7,
        partition=PartitionConfig(kind="dirichlet", alpha=1.0),
        split=SplitConfig(train=0.8, val=0.1, test=0.1),
    )
    fed = build_federation(digits, cfg, seed=3)
    for s in fed.shards:
        n = len(s.train) + len(s.val) + len(s.test)
        assert len(s.test) == int(np.floor(n * 0.1 + 0.5))
        assert abs(len(s.val) - n * 0.1) <= 1
        assert len(s.train) >= 1
    assert sum(len(s.train) + len(s.val) + len(s.test) for s in fed.shards) == len(digits.train)
    assert fed.global_test is digits.test


def test_local_test_follows_local_train_distribution(digits):
    cfg = DataConfig(num_clients=5, partition=PartitionConfig(kind="shamsian", classes_per_client=2))
    fed = build_federation(digits, cfg, seed=0)
    for s in fed.shards:
        assert set(s.test.y.tolist()) == set(s.train.y.tolist())


def test_same_seed_same_federation(digits):
    cfg = DataConfig(num_clients=4)
    a, b = build_federation(digits, cfg, seed=5), build_federation(digits, cfg, seed=5)
    c = build_federation(digits, cfg, seed=6)
    assert all(
        torch.equal(x.test.y, y.test.y) and torch.equal(x.train.x, y.train.x)
        for x, y in zip(a.shards, b.shards)
    )
    assert not all(torch.equal(x.train.y, y.train.y) for x, y in zip(a.shards, c.shards))


def test_histogram_table_matches_shards(digits):
    fed = build_federation(digits, DataConfig(num_clients=6), seed=0)
    table = fed.histogram_table()
    assert list(table.columns[:4]) == ["client", "n_train", "n_val", "n_test"]
    assert list(table.columns[4:]) == digits.class_names
    assert len(table) == 6
    np.testing.assert_array_equal(table[digits.class_names].sum(axis=1), table["n_train"])
    np.testing.assert_array_equal(table["n_test"], [len(s.test) for s in fed.shards])
    np.testing.assert_array_equal(fed.train_histogram(), table[digits.class_names].to_numpy())


def test_client_without_training_data_raises_naming_it():
    bundle = make_bundle(n=12, num_classes=4)
    cfg = DataConfig(num_clients=12, partition=PartitionConfig(kind="iid"), split=SplitConfig(0.5, 0.0, 0.5))
    with pytest.raises(ConfigError, match=r"client \d+ has no training samples"):
        build_federation(bundle, cfg, seed=0)  # one sample each, rounded into the test split


def test_heatmap_writes_a_png(digits, tmp_path):
    fed = build_federation(digits, DataConfig(num_clients=8), seed=0)
    path = tmp_path / "plots" / "partition.png"
    histogram_heatmap(fed, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_normalisation_from_the_pool_or_fixed_and_recorded_in_the_provenance(digits, tmp_path):
    from fedray.platform.data import write_split
    from fedray.platform.data.split_file import read_split_file

    cfg = DataConfig(dataset="digits", num_clients=4)
    pooled = build_federation(digits, cfg, seed=0)
    assert (pooled.mean, pooled.std) == (digits.mean, digits.std)  # the pool's per-channel statistics
    fixed = build_federation(digits, DataConfig(dataset="digits", num_clients=4, normalize="0.5,0.5"), seed=0)
    assert fixed.mean == (0.5,) and fixed.std == (0.5,)  # PFLlib's (x - 0.5) / 0.5, every channel
    assert [s.train.y.tolist() for s in fixed.shards] == [s.train.y.tolist() for s in pooled.shards]
    write_split(fixed, tmp_path / "split.json")
    provenance = read_split_file(str(tmp_path / "split.json"))["provenance"]
    assert provenance["normalize"] == {"mode": "0.5,0.5", "mean": [0.5], "std": [0.5]}
    for bad in ("0.5", "a,b", "0.5,0"):
        with pytest.raises(ConfigError, match=r"data\.normalize"):
            build_federation(digits, DataConfig(dataset="digits", num_clients=4, normalize=bad), seed=0)
