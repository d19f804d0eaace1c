"""Split files: write a federation's partition, read it back (ids and image-folder paths), reject bad files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedray.platform.config import DataConfig, PartitionConfig, SplitConfig
from fedray.platform.data import (
    build_federation,
    check_data,
    federation_to_split,
    load_dataset,
    majority_baseline,
    read_split_file,
    split_file_num_clients,
    write_split,
)
from fedray.platform.data.cache import read_cache
from fedray.platform.errors import ConfigError

PARTS = ("train", "val", "test")


pytestmark = pytest.mark.usefixtures("isolated_home")  # from conftest


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DataConfig(dataset="digits"))


def file_cfg(path: Path | str, num_clients: int, **kw) -> DataConfig:
    return DataConfig(num_clients=num_clients, partition=PartitionConfig(kind="file", path=str(path)), **kw)


def assert_same_federation(a, b) -> None:
    assert a.num_clients == b.num_clients
    for sa, sb in zip(a.shards, b.shards):
        assert sa.client_id == sb.client_id
        for part in PARTS:
            da, db = getattr(sa, part), getattr(sb, part)
            assert torch.equal(da.x, db.x) and torch.equal(da.y, db.y), (sa.client_id, part)
            np.testing.assert_array_equal(getattr(sa, f"{part}_ids"), getattr(sb, f"{part}_ids"))
    assert torch.equal(a.global_test.x, b.global_test.x) and torch.equal(a.global_test.y, b.global_test.y)
    np.testing.assert_array_equal(a.global_test_ids, b.global_test_ids)


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize(
    ("kind", "split"),
    [
        ("dirichlet", SplitConfig(0.8, 0.1, 0.1)),
        ("shamsian", SplitConfig(0.75, 0.0, 0.25, convention="merged")),
        ("iid", SplitConfig(0.8, 0.2, 0.0, convention="official_test")),
    ],
)
def test_written_split_read_back_gives_identical_clients(digits, tmp_path, kind, split):
    cfg = DataConfig(num_clients=6, partition=PartitionConfig(kind=kind, alpha=0.3), split=split)
    fed = build_federation(digits, cfg, seed=4)
    path = write_split(fed, tmp_path / "runs" / "split.json")

    data = json.loads(path.read_text())
    assert data["format"] == "fedray-split-1" and data["dataset"] == "digits"
    assert (data["num_train"], data["num_test"]) == (len(digits.train), len(digits.test))
    assert data["provenance"]["convention"] == split.convention
    assert list(data["clients"]) == [str(k) for k in range(6)]
    assert data["clients"]["2"]["train"] == fed.shards[2].train_ids.tolist()
    assert "subset_paths" not in data
    assert split_file_num_clients(path) == 6

    again = file_cfg(path, 6, split=SplitConfig(0.5, 0.0, 0.5))  # ratios and seed do not matter
    check_data(again)
    back = build_federation(digits, again, seed=99)
    assert_same_federation(fed, back)
    assert majority_baseline(back)[:2] == majority_baseline(fed)[:2]
    # written again, the split file is the same text: a fixed point
    assert federation_to_split(back)["clients"] == data["clients"]
    if split.convention != "merged":
        assert back.global_test is digits.test  # the official test set, not a copy


def test_minimal_external_file_defaults(digits, tmp_path):
    """Only "clients" with train lists: val/test empty, the global test is the official test set."""
    path = tmp_path / "pfl.json"
    path.write_text(json.dumps({"clients": {"1": {"train": [5, 3]}, "0": {"train": [0], "test": [1440]}}}))
    fed = build_federation(digits, file_cfg(path, 2), seed=0)
    assert [s.train_ids.tolist() for s in fed.shards] == [[0], [5, 3]]  # file order kept
    assert torch.equal(fed.shards[1].train.x, digits.train.x[[5, 3]])
    assert torch.equal(fed.shards[0].test.x, digits.test.x[[1440 - len(digits.train)]])
    assert len(fed.shards[1].val) == len(fed.shards[1].test) == 0
    assert fed.global_test is digits.test


def test_explicit_global_test(digits, tmp_path):
    n = len(digits.train)
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"clients": {"0": {"train": [0, 1]}}, "global_test": [n + 3, 7, n]}))
    fed = build_federation(digits, file_cfg(path, 1), seed=0)
    assert torch.equal(
        fed.global_test.y, torch.stack([digits.test.y[3], digits.train.y[7], digits.test.y[0]])
    )


# ------------------------------------------------------------------------------------------ image folders

COLORS = {"ant": (255, 0, 0), "bee": (0, 255, 0), "cow": (0, 0, 255)}


def make_imagefolder(root: Path, n_train: int = 4, n_test: int = 2) -> None:
    """One solid colour per class, shaded by the file number, so every image is distinct."""
    for split, n in (("train", n_train), ("test", n_test)):
        for cls, color in COLORS.items():
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                shade = tuple(max(0, c - 20 * i - (7 if split == "test" else 0)) for c in color)
                Image.new("RGB", (4, 4), shade).save(root / split / cls / f"{i:03d}.png")


def test_imagefolder_bundle_knows_paths_and_caches_them(tmp_path):
    make_imagefolder(tmp_path / "img")
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path / "img"))
    bundle = load_dataset(cfg)
    assert bundle.paths[:2] == ["train/ant/000.png", "train/ant/001.png"]
    assert bundle.paths[len(bundle.train)] == "test/ant/000.png"
    assert len(bundle.paths) == bundle.num_samples == 18
    (cache,) = (tmp_path / "img" / ".fedray_cache").glob("imagefolder-*.pt")
    payload = read_cache([cache])
    assert payload["train_paths"] + payload["test_paths"] == bundle.paths
    assert load_dataset(cfg).paths == bundle.paths  # restored from the cache


def test_imagefolder_split_uses_paths_and_survives_new_images(tmp_path):
    root = tmp_path / "img"
    make_imagefolder(root)
    cfg = DataConfig(
        dataset="imagefolder", root=str(root), num_clients=3, partition=PartitionConfig(kind="iid")
    )
    bundle = load_dataset(cfg)
    fed = build_federation(bundle, cfg, seed=1)
    path = write_split(fed, tmp_path / "split.json")
    data = json.loads(path.read_text())
    parts = [getattr(s, f"{p}_ids") for s in fed.shards for p in PARTS]
    used = np.unique(np.concatenate([fed.global_test_ids, *parts]))
    assert data["subset_paths"] == [bundle.paths[i] for i in used]
    assert data["clients"]["0"]["train"] == np.searchsorted(used, fed.shards[0].train_ids).tolist()

    # new images sort among the old ones and shift the sample ids; the paths still name the same images
    for cls, color in COLORS.items():
        Image.new("RGB", (4, 4), color[::-1]).save(root / "train" / cls / "000a.png")
        Image.new("RGB", (4, 4), color[::-1]).save(root / "test" / cls / "0.png")
    grown = load_dataset(cfg)
    assert grown.num_samples == bundle.num_samples + 6
    again = file_cfg(path, 3, dataset="imagefolder", root=str(root))
    check_data(again)
    back = build_federation(grown, again, seed=0)
    for a, b in zip(fed.shards, back.shards):
        for part in PARTS:
            assert torch.equal(getattr(a, part).x, getattr(b, part).x)
            assert [grown.paths[i] for i in getattr(b, f"{part}_ids")] == [
                bundle.paths[i] for i in getattr(a, f"{part}_ids")
            ]
    assert torch.equal(back.global_test.x, fed.global_test.x)


def test_imagefolder_split_written_by_hand_with_paths(tmp_path):
    root = tmp_path / "img"
    make_imagefolder(root)
    path = tmp_path / "split.json"
    clients = {
        "0": {"train": ["train/bee/001.png", "./train/ant/003.png"], "test": ["test/bee/000.png"]},
        "1": {"train": ["train/cow/000.png", 2], "val": ["train\\cow\\001.png"]},
    }
    path.write_text(json.dumps({"clients": clients, "global_test": ["test/cow/001.png"]}))
    cfg = file_cfg(path, 2, dataset="imagefolder", root=str(root))
    check_data(cfg)
    bundle = load_dataset(cfg)
    fed = build_federation(bundle, cfg, seed=0)
    named = [bundle.paths[i] for i in fed.shards[0].train_ids]
    assert named == ["train/bee/001.png", "train/ant/003.png"]
    assert fed.shards[0].train.y.tolist() == [1, 0] and fed.shards[1].train.y.tolist() == [2, 0]
    pixel = fed.shards[0].train.x[0, :, 0, 0].tolist()
    assert pixel == [0, 255 - 20, 0]  # bee's green, shaded for file 001
    assert fed.global_test.y.tolist() == [2]
    assert bundle.paths[int(fed.shards[1].val_ids[0])] == "train/cow/001.png"


# ------------------------------------------------------------------------------------------ bad files

N_DIGITS = 1797  # 1438 train + 359 test


def ok_clients(k: int = 3) -> dict:
    return {str(c): {"train": [10 * c, 10 * c + 1], "test": [10 * c + 2]} for c in range(k)}


BAD_DIGITS = [
    ("{", r"not valid JSON \(Expecting property name enclosed in double quotes at line 1 column 2\)"),
    ({"format": "fedray-split-1"}, r'no "clients" mapping; expected \{"clients"'),
    ({"clients": []}, r'a malformed "clients" mapping'),
    (
        {"clients": {**ok_clients(2), "3": {"train": [50]}}},
        r"clients must be numbered 0\.\.2; client 2 is missing",
    ),
    ({"clients": {"0": {"train": [1]}, "one": {"train": [2]}}}, r'client key "one" is not a client number'),
    ({"clients": {**ok_clients(4), "4": {"train": [], "test": [99]}}}, r"client 4 has an empty train list$"),
    ({"clients": {"0": {"test": [1]}}}, r"client 0 has no train list"),
    ({"clients": {"0": {"train": [1], "validation": [2]}}}, r'client 0 has unknown key "validation"'),
    (
        {"clients": {**ok_clients(3), "3": {"train": [*range(30, 47), 60012]}}},
        r"client 3 train\[17\] = 60012 is out of range \(dataset has 1797 samples: ids 0\.\.1437 train, "
        r"1438\.\.1796 test\)",
    ),
    ({"clients": {"0": {"train": [1], "test": [4, -1]}}}, r"client 0 test\[1\] = -1 is out of range"),
    ({"clients": {"0": {"train": [1, 10**30]}}}, r"client 0 train\[1\] = 10{30} is out of range"),
    (
        {"clients": {"0": {"train": [1, 2.5]}}},
        r"client 0 train\[1\] = 2\.5 is not a sample id \(an integer\)",
    ),
    ({"clients": {"0": {"train": [1, True]}}}, r"client 0 train\[1\] = true is not a sample id"),
    (
        {
            "clients": {
                "0": {"train": [42]},
                **{str(k): {"train": [k]} for k in range(1, 5)},
                "5": {"train": [9, 42]},
            }
        },
        r"sample 42 is in client 0 train\[0\] and client 5 train\[1\]",
    ),
    (
        {"clients": {"0": {"train": [7, 8], "test": [9, 7]}}},
        r"sample 7 is in client 0 train\[0\] and client 0 test\[1\]",
    ),
    (
        {"clients": {"0": {"train": [1, "train/0/1.png"]}}},
        r'client 0 train\[1\] = "train/0/1.png" is a path, but data.dataset=digits has no files',
    ),
    (
        {"clients": {"0": {"train": [1]}}, "subset_paths": ["a.png"]},
        r'"subset_paths" is given, but data.dataset=digits',
    ),
    (
        {"clients": {"0": {"train": [1]}}, "dataset": "cifar10"},
        r'made for dataset "cifar10", but data.dataset=digits',
    ),
    (
        {"clients": {"0": {"train": [1]}}, "num_train": 1500, "num_test": 297},
        r"written for 1500 train \+ 297 test samples, but data.dataset=digits has 1438 \+ 359",
    ),
    (
        {"clients": {"0": {"train": [1, 5]}}, "global_test": [1440, 5]},
        r"sample 5 is in client 0 train\[1\] and global_test\[1\]; the global test set must hold no training",
    ),
    (
        {"clients": {"0": {"train": [1]}}, "global_test": [1440, 1440]},
        r"sample 1440 is in global_test\[0\] and global_test\[1\]",
    ),
    ({"clients": {"0": {"train": [1]}}, "global_test": []}, r"global_test is empty; leave it out"),
    ({"clients": {"0": {"train": [1]}}, "format": "other-2"}, r'format "other-2" is not supported'),
]


def write(tmp_path: Path, content) -> Path:
    path = tmp_path / "split.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("content", "expected"), BAD_DIGITS, ids=[e[:40] for _, e in BAD_DIGITS])
def test_malformed_split_files_fail_naming_client_and_entry(digits, tmp_path, content, expected):
    path = write(tmp_path, content)
    num_clients = len(content["clients"]) if isinstance(content, dict) and content.get("clients") else 1
    cfg = file_cfg(path, num_clients)
    from_check = one_line_error(check_data, cfg)  # metadata only: nothing is loaded
    from_build = one_line_error(build_federation, digits, cfg, 0)
    assert from_check == from_build
    assert from_build.startswith(f"{path}: ")
    assert re.search(expected, from_build), from_build


def test_missing_file_and_client_count_mismatch(digits, tmp_path):
    missing = tmp_path / "nope.json"
    message = one_line_error(check_data, file_cfg(missing, 3))
    assert message == f"data.partition.kind=file: data.partition.path={str(missing)!r} does not exist"
    path = write(tmp_path, {"clients": ok_clients(3)})
    expected = f"data.num_clients=10, but {path} defines 3 clients; set data.num_clients=3"
    assert one_line_error(check_data, file_cfg(path, 10)).startswith(expected)
    assert one_line_error(build_federation, digits, file_cfg(path, 10), 0).startswith(expected)
    with pytest.raises(ConfigError, match="does not exist"):
        read_split_file(missing)
    no_path = DataConfig(partition=PartitionConfig(kind="file"))
    assert (
        one_line_error(check_data, no_path)
        == "data.partition.kind=file needs data.partition.path=<split.json>"
    )
    assert one_line_error(build_federation, digits, no_path, 0).startswith("data.partition.kind=file needs")


@pytest.mark.parametrize(
    ("clients", "extra", "expected"),
    [
        (
            {"0": {"train": ["train/ant/000.png"]}, "1": {"train": [1], "test": ["train/cat/9999.jpg"]}},
            {},
            r'client 1 test\[0\] = "train/cat/9999.jpg" does not exist under data.root=',
        ),
        (
            {"0": {"train": ["train/ant/000.png", "test/ant/001.png"]}, "1": {"train": [0]}},
            {},
            r'sample 0 \("train/ant/000.png"\) is in client 0 train\[0\] and client 1 train\[0\]',
        ),
        (
            {"0": {"train": [0, 2]}},
            {"subset_paths": ["train/bee/000.png", "test/cow/001.png"]},
            r"client 0 train\[1\] = 2 is out of range \(subset_paths has 2 entries\)",
        ),
        (
            {"0": {"train": [0]}},
            {"subset_paths": ["train/bee/000.png", "train/bee/007.png"]},
            r'subset_paths\[1\] = "train/bee/007.png" does not exist',
        ),
        (
            {"0": {"train": [0]}},
            {"subset_paths": ["train/bee/000.png", "train/bee/../bee/000.png"]},
            r'subset_paths\[1\] = "train/bee/../bee/000.png" repeats subset_paths\[0\]',
        ),
        (
            {"0": {"train": ["train/notes.txt"]}},
            {},
            r'client 0 train\[0\] = "train/notes.txt" is not an image of the dataset',
        ),
    ],
)
def test_malformed_imagefolder_split_files(tmp_path, clients, extra, expected):
    root = tmp_path / "img"
    make_imagefolder(root)
    (root / "train" / "notes.txt").write_text("not an image")
    path = write(tmp_path, {"clients": clients, **extra})
    cfg = file_cfg(path, len(clients), dataset="imagefolder", root=str(root))
    message = one_line_error(check_data, cfg)
    assert re.search(expected, message), message
    assert one_line_error(build_federation, load_dataset(cfg), cfg, 0) == message


def test_validate_and_partition_reject_misuse():
    from fedray.platform.data import partition

    with pytest.raises(ConfigError, match=r"kind=file is not a partitioner"):
        partition(np.zeros(4, dtype=np.int64), PartitionConfig(kind="file", path="x.json"), 2, 1, seed=0)
