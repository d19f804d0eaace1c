"""``fedray report EXPERIMENT``: an MLflow experiment of fedray runs as one HTML page with its figures.

This module is the command line and the entry points; the work is in ``build`` (with ``load``,
``summary``, ``figures`` and ``html`` under it). It stays cheap to import, because ``fedray``'s
CLI imports it to register the subcommand on every call: pandas, matplotlib and MLflow load only
when a report is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedray.platform.errors import ConfigError, OneLineParser


def build_report(
    experiment: str,
    out_dir: str | Path | None = None,
    tracking_uri: str | None = None,
    target: float | None = None,
    *,
    log: bool = True,
) -> Path:
    """Write the report of ``experiment`` (default folder ``reports/<experiment>``), log it to
    MLflow unless ``log=False``, and return the HTML path. ``target`` is a fraction (0.9); by
    default the best accuracy every algorithm reaches. User errors raise ``ConfigError``."""
    from fedray.dashboards.build import make_report

    return make_report(experiment, out_dir, tracking_uri, target, log=log).path


# --------------------------------------------------------------------------------------------- CLI


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``fedray report EXPERIMENT [--out DIR] [--target FRACTION] [--tracking-uri URI]``."""
    parser = subparsers.add_parser(
        "report",
        help="an HTML report (figures + table) of an MLflow experiment's runs",
        description="Read the finished runs of an MLflow experiment and write an HTML report with its "
        "PNG figures; the report is also logged to MLflow (artifacts report/).",
    )
    parser.add_argument(
        "experiment", help="MLflow experiment name (a config's `name`, a compare or sweep name)"
    )
    parser.add_argument("--out", metavar="DIR", help="output folder (default: reports/<experiment>)")
    parser.add_argument(
        "--target",
        type=float,
        metavar="FRACTION",
        help="accuracy for the rounds-to-target column, e.g. 0.9 (default: the best every algorithm reaches)",
    )
    parser.add_argument(
        "--tracking-uri", metavar="URI", help="MLflow store (default: MLFLOW_TRACKING_URI or ./mlflow.db)"
    )
    parser.add_argument("--no-log", action="store_true", help="write the files only; log nothing to MLflow")
    parser.set_defaults(func=report_command)
    return parser


def report_command(args: argparse.Namespace) -> int:
    from fedray.dashboards.build import make_report

    info = make_report(args.experiment, args.out, args.tracking_uri, args.target, log=not args.no_log)
    n = len(info.run_ids)
    print(f"report: {info.path}  ({n} run{'s' if n != 1 else ''} read)")
    if info.logged_to:
        print(f"logged to MLflow run {info.logged_to} as report/{info.path.name}  (make ui)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fedray.dashboards.report EXPERIMENT``: the same as ``fedray report``."""
    parser = OneLineParser(prog="fedray")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"fedray: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
