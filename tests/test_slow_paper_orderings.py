"""Slow real-data checks (``make test-slow``): the four papers' headline comparisons on the CIFAR-10
JPEGs in ../shared/data, at a scale a 2-core CPU finishes in about half an hour.

Each comparison trains every algorithm on the identical partition (same data config and seed) and
prints one table. The assertions are sanity bounds (every run finishes and beats chance); whether
the paper's ordering shows up at this scale is read from the printed tables, not asserted.
"""

from pathlib import Path

import pytest

from fedray.platform.config import load_config
from fedray.platform.data.archive import unpack_image_archive
from fedray.platform.progress import print_table, summary_table

ARCHIVE = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tar.gz"

pytestmark = pytest.mark.slow

# name -> (shared overrides, [(label, algorithm-specific overrides)], metric the paper reports)
COMPARISONS = {
    "fedcross_vs_fedavg_dir0.1": (
        {
            "data.partition.kind": "dirichlet",
            "data.partition.alpha": 0.1,
            "data.num_clients": 20,
            "data.split.train": 1.0,
            "data.split.test": 0.0,
            "model.group": "fedavg_cnn",
            "train.fraction": 0.25,
            "train.local_epochs": 2,
            "train.batch_size": 50,
            "train.lr": 0.01,
            "train.momentum": 0.5,
            "rounds": 40,
        },
        [("fedavg", {}), ("fedcross", {"fedcross.alpha": 0.99})],
        "acc/global",
    ),
    "fedssa_vs_lgfedavg_local_pat2": (
        {
            "data.partition.kind": "shamsian",
            "data.partition.classes_per_client": 2,
            "data.num_clients": 20,
            "data.split.train": 0.8,
            "data.split.val": 0.1,
            "data.split.test": 0.1,
            "model.group": "fedssa_cnns",
            "train.fraction": 0.5,
            "train.local_epochs": 2,
            "train.batch_size": 64,
            "train.lr": 0.01,
            "train.momentum": 0.9,
            "train.weight_decay": 5e-5,
            "train.grad_clip": 50,
            "rounds": 20,
        },
        [("local", {}), ("lgfedavg", {}), ("fedssa", {"fedssa.mu0": 0.5, "fedssa.t_stable": 2})],
        "acc/personal_mean",
    ),
    "fedl2g_vs_fedproto_hetero_dir0.1": (
        {
            "data.partition.kind": "dirichlet",
            "data.partition.alpha": 0.1,
            "data.partition.min_samples": 20,
            "data.num_clients": 10,
            "data.split.train": 0.75,
            "data.split.test": 0.25,
            "model.group": "small_hetero",
            "train.local_epochs": 1,
            "train.batch_size": 10,
            "train.lr": 0.01,
            "train.momentum": 0.0,
            "rounds": 25,
        },
        [("fedproto", {}), ("fedl2g", {"fedl2g.variant": "f", "fedl2g.warmup_rounds": 5})],
        "acc/personal_weighted",
    ),
    "fedsc_vs_fedavg_dir0.2": (
        {
            "data.partition.kind": "dirichlet",
            "data.partition.alpha": 0.2,
            "data.num_clients": 10,
            "data.split.train": 1.0,
            "data.split.test": 0.0,
            "model.group": "fedavg_cnn",
            "train.local_epochs": 2,
            "train.batch_size": 64,
            "train.lr": 0.01,
            "train.momentum": 0.9,
            "train.weight_decay": 1e-5,
            "rounds": 20,
        },
        [("fedavg", {}), ("fedsc", {"fedsc.tau": 0.05, "fedsc.neighbors": 2})],
        "acc/global",
    ),
}


@pytest.fixture(scope="module")
def cifar_root():
    if not ARCHIVE.is_file():
        pytest.skip(f"the CIFAR-10 JPEG archive is not at {ARCHIVE}")
    return unpack_image_archive(ARCHIVE, Path.home() / ".cache" / "fedray" / "cifar10-jpeg")


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("name", list(COMPARISONS))
def test_paper_comparison_at_reduced_scale(name, cifar_root, mlflow_store):
    from fedray.platform.run import run_experiment

    shared, entries, metric = COMPARISONS[name]
    base = {
        "name": f"slow_{name}",
        "data.dataset": "imagefolder",
        "data.root": cifar_root,
        "data.train_subset": 10000,
        "eval_every": 5,
        "checkpoint_every": 0,
        "progress": False,
        **shared,
    }
    rows = []
    for label, extra in entries:
        overrides = {**base, "algorithm": label, **extra}
        result = run_experiment(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
        assert result.finished
        value = result.last(metric)
        assert value is not None and value > 0.12, (label, value)  # chance is 0.10
        row = result.summary_row()
        row[f"final {metric}"] = round(100 * value, 2)
        row[f"best {metric}"] = round(100 * result.best(metric), 2)
        rows.append(row)
    table = summary_table(rows, title=f"{name} (CIFAR-10 JPEGs, 10k train images, seed 0)")
    print_table(table)
    out = Path(__file__).resolve().parents[1] / ".fedray" / "slow_results.md"
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as fh:
        fh.write(f"\n## {name}\n\n")
        cols = list(rows[0])
        fh.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for row in rows:
            fh.write("| " + " | ".join(str(row[c]) for c in cols) + " |\n")
