"""Every ``configs/paper_*.yaml`` shrunk with ``--scale`` still makes a valid run: one real round of it
(server configure, the selected clients' Lightning training on a ClientHost, aggregation), no Ray.

The CIFAR-10 configs run on the synthetic set at the papers' 32x32 (no download); the others on small
files of their own dataset's on-disk format, written by the test (LEAF JSON, Flowers102's .mat layout,
the Tiny-ImageNet tree), read by the real loading code. Model groups too large for a CPU round are
swapped for a small one of the same kind (homogeneous stays homogeneous).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from image_source_files import write_flowers102, write_tiny_imagenet
from in_process import train_rounds
from leaf_files import write_femnist, write_sent140, write_shakespeare

from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round, scale

CONFIGS = sorted(Path(__file__).parents[1].glob("configs/paper_*.yaml"))
CIFAR_CONFIGS = [p for p in CONFIGS if p.stem.endswith("_cifar10")]
SMALL_GROUP = {"fedssa_cnns": "fedssa_cnns", "htfe8": "small_hetero"}  # anything else: cnn_small


def flowers102(root: Path) -> Path:
    return write_flowers102(root, classes=6, per_class=12)


def tiny_imagenet(root: Path) -> Path:
    return write_tiny_imagenet(root, classes=6, train_per_class=20, val_per_class=2)


def femnist(root: Path) -> Path:
    return write_femnist(root, users=12, per_user=(20, 40))


def shakespeare(root: Path) -> Path:
    # a 0.45 train share keeps short roles (LEAF drops 79 windows between a role's train and test)
    return write_shakespeare(root, users=8, per_user=(130, 170), train_fraction=0.45)


def sent140(root: Path) -> Path:
    return write_sent140(root, users=45, per_user=(10, 30))  # 803 users x 0.05 keeps 40


# each other config's dataset, written in its on-disk format: (writer of data.root, overrides); the
# generated LEAF users are smaller than the papers' minimum sample counts, which the overrides lift
SMALL_USERS = "data.leaf.min_samples=0"
FORMATS: dict[str, tuple] = {
    "paper_fedcross_femnist": (femnist, [SMALL_USERS]),
    "paper_fedcross_shakespeare": (shakespeare, [SMALL_USERS]),
    "paper_fedcross_sent140": (sent140, [SMALL_USERS]),
    "paper_fedl2g_flowers102": (flowers102, ["model.group=small_hetero"]),
    "paper_fedl2g_tinyimagenet": (tiny_imagenet, ["model.group=small_hetero"]),
    "paper_fedsc_tinyimagenet": (tiny_imagenet, []),  # its own MobileNetV2 with the 512-d projection
}


def test_every_paper_config_is_covered():
    assert {p.stem for p in CIFAR_CONFIGS} == {
        f"paper_{a}_cifar10" for a in ("fedcross", "fedl2g", "fedsc", "fedssa")
    }
    assert {p.stem for p in CONFIGS} == {p.stem for p in CIFAR_CONFIGS} | set(FORMATS)


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem in FORMATS], ids=lambda p: p.stem)
def test_a_paper_config_at_scale_005_runs_a_round_on_its_own_format(path, tmp_path):
    write, overrides = FORMATS[path.stem]
    root = write(tmp_path)
    paper = load_config(path, [f"data.root={root}", *overrides])
    cfg = scale(paper, 0.05)
    assert cfg.data.dataset == paper.data.dataset and cfg.data.num_clients < paper.data.num_clients
    cfg.train = replace(cfg.train, local_epochs=1)
    one_round(cfg)


@pytest.mark.parametrize("factor", [0.05, 0.1, 0.5])
@pytest.mark.parametrize("path", CIFAR_CONFIGS, ids=lambda p: p.stem)
def test_a_scaled_paper_config_runs_a_round(path, factor):
    paper = load_config(path, ["data.root=/nonexistent"])
    cfg = scale(paper, factor)

    # rounds and clients shrink, the algorithm's round counts keep their share and stay >= 1
    assert 1 <= cfg.rounds <= paper.rounds and 2 <= cfg.data.num_clients <= paper.data.num_clients
    for name in cfg.algo.scaled_fields("rounds"):
        assert getattr(cfg.algo, name) >= min(1, getattr(paper.algo, name)), name
    assert clients_per_round(cfg) >= getattr(cfg.algo, "MIN_PARTICIPANTS", 1)

    group = SMALL_GROUP.get(cfg.model.group, "cnn_small")
    # enough images for the partition's minimum per client under its Dirichlet skew (50 clients at
    # alpha=0.1 need about 80 each); no more, as FedSC and FedL2G pass over a client's data again
    samples = max(1200, 80 * cfg.data.num_clients)
    cfg.data = replace(cfg.data, dataset="synthetic", synthetic_samples=samples, synthetic_image_size=32)
    cfg.model = replace(cfg.model, group=group)
    # batches of 64 (quick) keep their partial last batch: with drop_last a client of fewer samples
    # (FedL2G's configs drop it, as the paper trains) would take no step, and every client must here
    cfg.train = replace(cfg.train, local_epochs=1, batch_size=64, drop_last=False)
    one_round(cfg)


def one_round(cfg) -> None:
    rnd = getattr(cfg.algo, "warmup_rounds", 0)  # the first round its clients train (FedL2G warms up)
    train_rounds(cfg, 1, first=rnd)


@pytest.mark.parametrize(
    ("name", "baseline", "setting", "value"),
    [
        ("paper_fedcross_cifar10", "fedgen", "hidden_dim", 512),
        ("paper_fedcross_cifar10", "fedgen", "noise_dim", 64),
        ("paper_fedcross_femnist", "fedprox", "mu", 0.1),
        ("paper_fedsc_cifar10", "fednh", "scale_init", 20.0),
        ("paper_fedsc_tinyimagenet", "moon", "mu", 1.0),
    ],
)
def test_a_paper_config_gives_its_baselines_their_papers_settings(name, baseline, setting, value):
    path = str(Path(__file__).parents[1] / "configs" / f"{name}.yaml")
    cfg = load_config(path, [f"algorithm={baseline}", "data.root=/nonexistent"])
    assert getattr(cfg.algo, setting) == value
