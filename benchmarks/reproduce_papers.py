"""Re-run a paper's headline comparison and write its table and report page.

    python benchmarks/reproduce_papers.py fedssa                  # CPU scale, seeds 0 and 1
    python benchmarks/reproduce_papers.py fedcross --scale full   # the paper's settings (GPU hours)
    make reproduce PAPER=fedl2g ARGS="--seeds 0,1,2"
    make reproduce PAPER=fedcross ARGS="--only fedcross rounds=400"   # one entry, longer
    make reproduce PAPER=fedcross_femnist ARGS="--data ~/leaf/data/femnist/data"   # LEAF's files

The CIFAR-10 comparisons read the CIFAR-10 JPEGs (``--data``, else the archive); the LEAF ones
(``fedcross_femnist``, ``fedcross_shakespeare``) need LEAF's files given by ``--data``: without them the
script says where to get them and how to lay them out, and exits 2.

Each paper is a compare file in ``benchmarks/papers/`` (the paper's settings from
``configs/paper_*.yaml``, one entry per algorithm, same partition per seed). ``--scale cpu`` adds the
overrides below, which shrink rounds, data and models until a 2-core CPU finishes the comparison in
minutes; they are printed with the table. Every run lands in the MLflow experiment
``repro_<paper>_<scale>``; the script then writes ``reports/repro_<paper>_<scale>/report.html``
(``fedray report``: curves, rounds to target, communication) and ``results.md`` beside it: per
algorithm the final and best value of the paper's metric (mean ± std over seeds), the majority-class
accuracy of the same clients (what a client that always predicts its most frequent training label
scores: the floor every personalised number must be read against) and the paper's number.

``results.md`` covers this invocation's runs; the page reads the whole experiment, so a second
invocation with other seeds adds to it (``--experiment NAME`` starts a fresh one).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedray.platform.data.archive import cifar10_jpeg_archive
from fedray.platform.tracking.names import Metrics, Tags

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = cifar10_jpeg_archive(ROOT)  # $FEDRAY_CIFAR10_ARCHIVE, else .data/
CACHE = Path.home() / ".cache" / "fedray" / "cifar10-jpeg"


@dataclass
class Paper:
    metric: str  # what the paper's table reports
    paper_numbers: dict[str, str]  # label -> the paper's number (its setting named in the compare file)
    cpu: dict[str, object] = field(default_factory=dict)  # overrides for --scale cpu
    leaf_task: str | None = None  # a LEAF dataset: its files come from --data only


LEAF_HELP = """{paper} needs LEAF's {task} files: --data <LEAF's data/{task}/data folder>.
Get them with LEAF (https://github.com/TalwalkarLab/leaf):
  git clone https://github.com/TalwalkarLab/leaf && cd leaf/data/{task}
  ./preprocess.sh {flags}
then pass --data leaf/data/{task}/data (it holds train/ and test/, or all_data/). README, "LEAF datasets"."""
LEAF_FLAGS = {  # LEAF's preprocessing for the paper's setting: full-size, non-IID, per-user 90/10 sample split
    "femnist": "-s niid --sf 1.0 -k 101 -t sample --tf 0.9",
    "shakespeare": "-s niid --sf 1.0 -k 5701 -t sample --tf 0.9",
}


PAPERS = {
    "fedcross": Paper(
        Metrics.ACC_GLOBAL,
        {"fedavg": "46.12 ± 2.35", "fedcross": "55.70 ± 0.74", "fedcross-da": "—"},
        # 100 clients, 10 per round, Dir(0.1), 5 local epochs kept; 200 images per client on average
        # instead of 500, 150 rounds instead of 2,000 (FedAvg's curve flattens from about round 100)
        {"data.train_subset": 20000, "rounds": 150, "eval_every": 10},
    ),
    "fedssa": Paper(
        Metrics.ACC_PERSONAL_MEAN,
        {
            "standalone": "96.53 (N=10) / 91.97 (N=100)",
            "lg-fedavg": "96.30 / 91.27",
            "fedssa": "96.54 / 92.92",
        },
        # 20 clients, 10 per round (paper: 10 at 100 % and 100 at 10 %), 500 images per client,
        # 1 local epoch instead of 10, 30 rounds instead of 500
        {
            "data.num_clients": 20,
            "train.fraction": 0.5,
            "data.train_subset": 10000,
            "train.local_epochs": 1,
            "rounds": 30,
            "eval_every": 5,
        },
    ),
    "fedl2g": Paper(
        Metrics.ACC_PERSONAL_WEIGHTED,
        {"fedproto": "82.1", "fd": "86.0", "fedl2g-f": "87.6"},
        # 20 clients, all per round, Dir(0.1), merged 75/25 kept; three small CNNs (small_hetero, K=128)
        # instead of HtFE8's eight ResNets/GoogLeNet/MobileNet (K=512), 10,000 training images,
        # 30 rounds with 5 warm-up instead of 1,000 with 50
        {
            "model.group": "small_hetero",
            "data.train_subset": 10000,
            "rounds": 30,
            "fedl2g.warmup_rounds": 5,
            "eval_every": 5,
        },
    ),
    "fedcross_femnist": Paper(
        Metrics.ACC_GLOBAL,
        {"fedavg": "81.67 ± 0.36", "fedcross": "83.49 ± 0.18"},
        # 36 writers of more than 100 samples, 9 per round (paper: 180, 18), 1 local epoch instead of 5,
        # 60 rounds instead of 2,000; the FedAvg CNN, batch 50, lr 0.01 and alpha 0.99 kept
        {
            "data.num_clients": 36,
            "train.fraction": 0.25,
            "train.local_epochs": 1,
            "rounds": 60,
            "eval_every": 10,
        },
        leaf_task="femnist",
    ),
    "fedcross_shakespeare": Paper(
        Metrics.ACC_GLOBAL,
        {"fedavg": "52.08 ± 0.29", "fedcross": "54.81 ± 0.07"},
        # 10 speaking roles of more than 5,700 samples, 3 per round (paper: 128, 13), 1 local epoch
        # instead of 5, 20 rounds instead of 1,000; LEAF's 2-layer LSTM, batch 50, lr 0.01, alpha 0.99 kept
        {
            "data.num_clients": 10,
            "train.fraction": 0.3,
            "train.local_epochs": 1,
            "rounds": 20,
            "eval_every": 5,
        },
        leaf_task="shakespeare",
    ),
    "fedsc": Paper(
        Metrics.ACC_GLOBAL,
        {"fedavg": "84.65", "fedsc": "88.13"},
        # 10 clients, Dir(0.2), crop+flip kept; the FedAvg CNN instead of ResNet-10, 10,000 training
        # images, 1 local epoch instead of 10, 25 rounds instead of 100
        {
            "model.group": "fedavg_cnn",
            "data.train_subset": 10000,
            "train.local_epochs": 1,
            "rounds": 25,
            "eval_every": 5,
        },
    ),
}


def cifar_root(arg: str | None) -> str:
    """The folder holding train/ and test/: ``--data`` if given, else the archive unpacked once."""
    from fedray.platform.data.archive import unpack_image_archive

    if arg:
        return str(Path(arg).expanduser())
    return str(unpack_image_archive(ARCHIVE, CACHE))


def mean_std(values: list[float | None]) -> str:
    vals = [100 * v for v in values if v is not None]  # None: the metric was never logged
    if not vals:
        return "—"
    return f"{np.mean(vals):.2f}" if len(vals) == 1 else f"{np.mean(vals):.2f} ± {np.std(vals):.2f}"


def results_table(paper: Paper, results: dict[str, list]) -> str:
    """Markdown: one row per algorithm, mean ± std over seeds (population std)."""
    m = paper.metric
    personal = m.startswith(Metrics.ACC_PERSONAL_PREFIX)
    head = ["algorithm", "seeds", f"final {m} %", f"best {m} %"]
    head += ["majority-class %"] if personal else []
    head += ["paper %", "wall s (mean)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in results.items():
        row = [
            label,
            str(len(runs)),
            mean_std([r.last(m) for r in runs]),
            mean_std([r.best(m) for r in runs]),
        ]
        if personal:  # the floor in the metric's own averaging (plain or sample-weighted mean)
            weighted = m.endswith("weighted")
            floor = Metrics.ACC_MAJORITY_BASELINE_WEIGHTED if weighted else Metrics.ACC_MAJORITY_BASELINE
            row.append(mean_std([r.extra[floor] for r in runs]))
        row += [paper.paper_numbers.get(label, "—"), f"{np.mean([r.wall_time_s for r in runs]):.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def scale_overrides(paper: Paper, scale: str) -> list[str]:
    return [f"{k}={v}" for k, v in paper.cpu.items()] if scale == "cpu" else []


def paper_entries(
    name: str,
    overrides: list[str],
    data_root: str,
    seeds: str,
    experiment: str,
    only: list[str] | None = None,
) -> list:
    """The comparison's validated runs (one per entry and seed), ``only`` the entries with those labels;
    ``overrides`` are the scale's and the user's, in that order."""
    from fedray.platform.apps.compare import load_comparison
    from fedray.platform.errors import ConfigError

    leaf = PAPERS[name].leaf_task is not None
    data = [f"data.root={data_root}"] if leaf else ["data.dataset=imagefolder", f"data.root={data_root}"]
    entries = load_comparison(
        ROOT / "benchmarks" / "papers" / f"{name}.yaml",
        [*data, "checkpoint_every=0", *overrides],
        name=experiment,
        seeds=[int(s) for s in seeds.split(",")],
    )
    labels = {entry.label for entry in entries}
    if only and set(only) - labels:
        missing, have = ", ".join(sorted(set(only) - labels)), ", ".join(sorted(labels))
        raise ConfigError(f"--only: no entry labelled {missing} (have {have})")
    return [entry for entry in entries if not only or entry.label in only]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paper", choices=sorted(PAPERS))
    parser.add_argument("--scale", choices=["cpu", "full"], default="cpu")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    parser.add_argument(
        "--data",
        help="CIFAR-10 JPEG folder with train/ and test/ (default: $FEDRAY_CIFAR10_ARCHIVE or "
        ".data/cifar10-jpeg.tar.gz, unpacked once); for a LEAF paper, LEAF's data/<task>/data folder (required)",
    )
    parser.add_argument("--experiment", help="MLflow experiment (default: repro_<paper>_<scale>)")
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        help="comma-separated labels of the compare file to run (default: all)",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_intermixed_args(argv)  # overrides may follow --options (make's ARGS)

    from fedray.dashboards.report import build_report
    from fedray.platform.errors import ConfigError
    from fedray.platform.runtime.driver import run_experiment

    paper = PAPERS[args.paper]
    experiment = args.experiment or f"repro_{args.paper}_{args.scale}"
    overrides = [*scale_overrides(paper, args.scale), *args.overrides]  # what runs is what results.md lists
    if paper.leaf_task and not args.data:
        task = paper.leaf_task
        print(LEAF_HELP.format(paper=args.paper, task=task, flags=LEAF_FLAGS[task]), file=sys.stderr)
        return 2
    root = str(Path(args.data).expanduser()) if paper.leaf_task else cifar_root(args.data)
    try:  # every config is checked before the first run starts
        entries = paper_entries(args.paper, overrides, root, args.seeds, experiment, args.only)
    except ConfigError as err:
        parser.error(str(err))
    results: dict[str, list] = {}
    for entry in entries:
        print(f"== {experiment}: {entry.label}, seed {entry.config.seed}", flush=True)
        results.setdefault(entry.label, []).append(
            run_experiment(entry.config, tags={Tags.LABEL: entry.label})
        )

    out = ROOT / "reports" / experiment
    out.mkdir(parents=True, exist_ok=True)
    merged = dict(o.split("=", 1) for o in overrides)  # a later key=value wins, as in the runs
    settings = " ".join(f"{k}={v}" for k, v in merged.items()) or "the paper's (configs/paper_*.yaml)"
    text = f"# {experiment}\n\nSeeds {args.seeds}; overrides: {settings}\n\n{results_table(paper, results)}\n"
    (out / "results.md").write_text(text)  # first: the table does not depend on the page
    print(text)
    print(f"report: {build_report(experiment, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
