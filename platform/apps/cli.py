"""``fedray`` command line: ``fedray run CONFIG [key=value ...]``, ``fedray run --resume RUN_ID``.

Every user error (bad config value, missing data, unknown algorithm) ends as one line on stderr
and exit status 2, before Ray or any training starts.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from fedray.platform.config import RayConfig, build_dataclass, read_config, scale
from fedray.platform.config.comparison import read_comparison
from fedray.platform.errors import ConfigError, OneLineParser
from fedray.platform.tracking.names import Metrics

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"  # in a checkout


def require_gpus_here(raw: dict) -> None:
    """GPUs asked for that this machine lacks: the line in a few seconds (torch alone), not after the
    algorithms, the data and MLflow have loaded."""
    ray_cfg = build_dataclass(RayConfig, raw.get("ray"), prefix="ray")
    if ray_cfg.num_gpus_per_client > 0:  # only then torch
        from fedray.platform.runtime.devices import require_visible_gpus

        require_visible_gpus(ray_cfg.num_gpus_per_client, ray_cfg.cluster_address())


def _run(args: argparse.Namespace) -> int:
    if args.stop_after is not None and args.stop_after < 1:
        raise ConfigError(f"--stop-after {args.stop_after}: must be >= 1 round")
    if args.resume is not None:
        if not args.resume.strip():
            raise ConfigError(
                "--resume: give the id of the run to resume (fedray printed it; make ui lists them)"
            )
        if args.config or args.overrides or args.scale is not None:
            raise ConfigError(
                "--resume RUN_ID takes no config, overrides or --scale: the run's own config is used"
            )
        from fedray.platform.runtime.driver import resume_experiment

        result = resume_experiment(args.resume, stop_after_round=args.stop_after)
    else:
        config, overrides = args.config, list(args.overrides)
        if config and "=" in config:  # `fedray run rounds=5`: overrides only, default config
            config, overrides = None, [config, *overrides]
        raw = read_config(config, overrides)  # a typo's line at once, before torch loads
        require_gpus_here(raw)
        from fedray.platform.catalog import build_config

        cfg = build_config(raw)  # the algorithm's section, the dataset and the model; before Ray starts
        if args.scale is not None:
            cfg = scale(cfg, args.scale)
        from fedray.platform.runtime.driver import run_experiment

        result = run_experiment(cfg, stop_after_round=args.stop_after)
    from fedray.platform.apps.tables import print_table, summary_table
    from fedray.platform.runtime.driver import personal_column

    row = result.summary_row()
    best = result.best(result.logged(Metrics.ACC_PERSONAL_MEAN))
    row[personal_column(result.config.eval.clients, "best personal %")] = (
        None if best is None else round(100 * best, 2)
    )
    print_table(
        summary_table(
            [row], title=f"{result.config.name}: {result.config.algorithm}, {len(result.history)} rounds"
        )
    )
    print(
        f"MLflow run id: {result.run_id}   (make ui, experiment {result.config.tracking.experiment or result.config.name!r})"
    )
    if not result.finished:
        print(f"stopped after round {len(result.history)}: resume with  fedray run --resume {result.run_id}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    read_comparison(args.config, args.overrides)  # a typo's line before torch loads
    from fedray.platform.apps.compare import run_comparison
    from fedray.platform.apps.tables import print_table, summary_table

    rows = run_comparison(args.config, args.overrides)
    print_table(summary_table(rows, title=f"compare: {args.config}"))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    if args.restart_errored and not args.resume:
        raise ConfigError("--restart-errored: only with --resume (a new sweep has no failed trials)")
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: must be >= 1")
    if args.stop_after_trials is not None and args.stop_after_trials < 1:
        raise ConfigError(f"--stop-after-trials {args.stop_after_trials}: must be >= 1 trial")
    if args.name is not None and not args.name.strip():
        raise ConfigError("--name: must not be empty (default: sweep-<algo>-<config name>)")
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    read_config(config, [f"algorithm={args.algo}", *args.overrides])  # a typo's line before torch loads
    from fedray.platform.apps.tables import print_table, summary_table
    from fedray.sweeps.tune_sweep import run_sweep

    result = run_sweep(
        args.algo,
        config_path=str(config) if config else None,
        space_file=args.space,
        samples=args.samples,
        overrides=args.overrides,
        resume=args.resume,
        name=args.name,
        stop_after_trials=args.stop_after_trials,
        restart_errored=args.restart_errored,
    )
    records = result.trials.to_dict("records")
    rows = [
        {k: f"{v:.6g}" if k in result.params and isinstance(v, float) else _short(v) for k, v in row.items()}
        for row in records
    ]  # the swept values to six digits, however small or large (lr=0.0001 is not 0.00); results rounded
    print_table(summary_table(rows, title=f"sweep {result.path.name}: {len(rows)} trials"))
    # the first row, unless no trial has a result (best_config is empty: every trial failed): its
    # values whole, to copy into a config
    best = (
        ", ".join(f"{k}={records[0][k]}" for k in result.params if k in records[0])
        if result.best_config
        else "-"
    )
    print(f"best trial: {best}")
    print(f"MLflow parent run: {result.parent_run_id} (best_config.yaml and trials.csv are its artifacts)")
    return 0


def _short(value):
    return round(value, 4) if isinstance(value, float) else value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedray", description="Federated-learning experiments on Lightning + Ray + MLflow"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one federated experiment")
    run.add_argument("config", nargs="?", help="experiment YAML (default: built-in defaults)")
    run.add_argument(
        "overrides", nargs="*", default=[], help="dotted key=value overrides, e.g. rounds=30 fedprox.mu=0.1"
    )
    run.add_argument(
        "--resume", metavar="RUN_ID", help="continue an interrupted run from its last checkpoint"
    )
    run.add_argument(
        "--scale", type=float, help="shrink rounds and clients by this factor (paper configs on a CPU)"
    )
    run.add_argument(
        "--stop-after",
        type=int,
        metavar="ROUNDS",
        help="stop (resumably: a checkpoint of that round) once this many rounds are done, e.g. to fit a job's time limit",
    )
    run.set_defaults(func=_run)

    from fedray.dashboards.report import add_report_parser

    add_report_parser(sub)

    from fedray.platform.apps.ui import add_ui_parser

    add_ui_parser(sub)

    compare = sub.add_parser("compare", help="several algorithms on the same partition and seeds, one table")
    compare.add_argument("config", help="compare YAML, e.g. configs/compare_digits.yaml")
    compare.add_argument("overrides", nargs="*", default=[], help="key=value overrides applied to every run")
    compare.set_defaults(func=_compare)

    sweep = sub.add_parser("sweep", help="Ray Tune sweep of one algorithm, every trial in MLflow")
    sweep.add_argument("--algo", required=True, help="algorithm to tune, e.g. fedcross")
    sweep.add_argument("--space", help="search space YAML (default: sweeps/spaces/<algo>.yaml)")
    sweep.add_argument("--samples", type=int, help="override the space's samples")
    sweep.add_argument("--config", help="experiment YAML (default: configs/quickstart.yaml)")
    sweep.add_argument("--name", help="sweep name (default: sweep-<algo>-<config name>)")
    sweep.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    sweep.add_argument(
        "--restart-errored",
        action="store_true",
        help="with --resume: trials that failed start again from round 0 in a new MLflow run "
        "(by default they continue from their last checkpoint)",
    )
    sweep.add_argument(
        "--stop-after-trials",
        type=int,
        metavar="N",
        help="stop (resumably) once N trials have ended in this command, failed ones too",
    )
    sweep.add_argument("overrides", nargs="*", help="key=value overrides for every trial")
    sweep.set_defaults(func=_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow an option (`fedray run CONFIG --stop-after 2 rounds=8`): argparse leaves
    # those after the option unparsed
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides, extra = [*args.overrides, *extra], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"fedray: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from fedray.platform.runtime.session import RunAborted

        if not isinstance(err, RunAborted):
            raise
        print(f"fedray: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def command() -> None:
    """The ``fedray`` console script: :func:`main`, then an exit without the interpreter's last
    garbage collections. With torch, Lightning, Ray and MLflow loaded (about 770,000 objects) they
    took 2-3 s after a run had ended, a tenth of a small run's command; atexit (Ray's shutdown,
    MLflow's flush) still runs first, and the OS frees the memory."""
    code = main()
    gc.freeze()  # everything alive now is out of the collector's reach, so the last walk is short
    sys.exit(code)


if __name__ == "__main__":
    command()
