"""Build the report of one MLflow experiment: the page, its figures, its CSVs, and the MLflow log.

Reads the experiment's finished runs back from MLflow (``load``), reduces them with pandas
(``summary``), draws the figures (``figures``), writes ``report.html`` + ``figures/*.png`` +
``summary.csv`` + ``runs.csv`` into the output folder (``html``), and logs those files as the
``report/`` artifacts of the runs' sweep parent, or of a run named ``report`` in the experiment, so
the page also opens from the MLflow UI. ``report`` holds the command line around it.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from fedray.dashboards import figures as figs
from fedray.dashboards import load
from fedray.dashboards import summary as sm
from fedray.dashboards.html import Cell, Section, figure, heading, page, paragraph, table
from fedray.dashboards.load import ExperimentRuns
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.progress import mb
from fedray.platform.tracking.names import (
    METRICS_COLUMN_PREFIX,
    Metrics,
    Params,
    RunKind,
    Tags,
    metric_column,
    param_column,
    tag_filter,
)

HTML_NAME = "report.html"
ARTIFACT_DIR = "report"
MAX_HEATMAPS = 6  # per algorithm: pairs of swept params beyond this are left to the line plots
MAX_CONFIG_ROWS = 25
# whom a run's personalised accuracy is over, by its eval.clients
EVALUATED = {
    "all": "all clients",
    "selected": "each evaluation round's selected clients (eval.clients=selected)",
    "sample": "a seeded sample of clients each evaluation round (eval.clients=sample)",
}


@dataclass
class ReportInfo:
    """What a report read and where it went, for the command's closing lines."""

    path: Path
    run_ids: list[str]
    logged_to: str | None  # MLflow run id holding the report/ artifacts


def default_out_dir(experiment: str) -> Path:
    return Path("reports") / re.sub(r"[^A-Za-z0-9._-]+", "_", experiment)


def make_report(
    experiment: str,
    out_dir: str | Path | None = None,
    tracking_uri: str | None = None,
    target: float | None = None,
    *,
    log: bool = True,
) -> ReportInfo:
    """Build the report; ``target`` (a fraction) defaults to the best accuracy every algorithm reaches."""
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"--target {target:g}: give the accuracy as a fraction in (0, 1], e.g. 0.9")
    ex = load.load_runs(experiment, tracking_uri)
    out = Path(out_dir) if out_dir is not None else default_out_dir(experiment)
    fig_dir = out / "figures"
    try:
        fig_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot make the report's folder there ({err.strerror})") from None
    if not os.access(fig_dir, os.W_OK | os.X_OK) or not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: the report's folder cannot be written to")
    for stale in fig_dir.glob("*.png"):  # figures of an earlier report that this one may not redraw
        stale.unlink()

    hparams = sm.hyperparameters(ex.runs)
    runs = sm.with_configs(ex.runs, hparams)
    metric = ex.metric  # ranks sweep configurations and defines the target
    selected = sm.best_configs(runs, metric)
    history = load.load_history(ex, list(selected["run_id"]))
    history["comm_mb"] = (
        history[Metrics.COMM_UP_BYTES_CUM].fillna(0) + history[Metrics.COMM_DOWN_BYTES_CUM].fillna(0)
    ).map(mb)
    auto = target is None
    target = sm.auto_target(selected, metric) if target is None else float(target)
    colors = figs.group_colors(sorted(runs["group"].unique()))
    personal = ex.personal(Metrics.ACC_PERSONAL_MEAN)
    rows = sm.summary_table(selected, history, target, metric, personal)

    target_run, created = _report_run(ex) if log else (None, False)
    try:
        sections = [
            _summary_section(rows, target, auto, hparams, metric, ex.clients),
            *_curve_sections(selected, history, colors, fig_dir, any(hparams.values()), metric, personal),
            _client_section(ex, selected, colors, fig_dir),
            _sweep_section(runs, hparams, colors, fig_dir, metric),
            _partition_section(ex, runs, fig_dir),
            _runs_section(ex, runs, selected),
        ]
        meta = _meta(ex, runs, target_run)
        html_path = out / HTML_NAME
        html_path.write_text(page(f"fedray report: {experiment}", meta, sections), encoding="utf-8")
        sm.summary_frame(rows).to_csv(out / "summary.csv", index=False)
        _runs_frame(runs, selected).to_csv(out / "runs.csv", index=False)
        if target_run is not None:
            _log_files(ex, target_run, out)
    except BaseException:
        if created:
            ex.client().set_terminated(target_run, status="FAILED")
        raise
    if created:
        ex.client().set_terminated(target_run, status="FINISHED")
    return ReportInfo(html_path, list(runs["run_id"]), target_run)


# --------------------------------------------------------------------------------------------- MLflow


def _report_run(ex: ExperimentRuns) -> tuple[str, bool]:
    """The sweep parent when every run shares one; else a new ``report`` run in the experiment."""
    if len(ex.parent_ids) == 1 and (ex.runs["parent_id"] == ex.parent_ids[0]).all():
        return ex.parent_ids[0], False
    n = len(ex.runs)
    note = f"fedray report of {n} runs of experiment {ex.experiment!r}: open artifacts {ARTIFACT_DIR}/{HTML_NAME}."
    run = ex.client().create_run(
        ex.experiment_id,
        run_name="report",
        tags={Tags.KIND: RunKind.REPORT, Tags.REPORT_RUNS: str(n), Tags.NOTE: note},
    )
    return run.info.run_id, True


def _log_files(ex: ExperimentRuns, run_id: str, out: Path) -> None:
    """Log what this report wrote, file by file: ``--out`` may be a folder holding other things."""
    client = ex.client()
    for name in (HTML_NAME, "summary.csv", "runs.csv"):
        client.log_artifact(run_id, str(out / name), ARTIFACT_DIR)
    for png in sorted((out / "figures").glob("*.png")):
        client.log_artifact(run_id, str(png), f"{ARTIFACT_DIR}/figures")


# --------------------------------------------------------------------------------------------- sections


def _pct(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def _acc_cell(stat: tuple[float, float], n: int) -> Cell:
    mean, std = stat
    if math.isnan(mean):
        return Cell("—")
    text = f"{_pct(mean)} ± {_pct(std)}" if n > 1 else _pct(mean)
    return Cell(text, value=mean, std=std)


def _metric_words(metric: str) -> tuple[str, str]:
    """How the report names ``metric``: short (a column header) and as an axis label."""
    if metric.startswith(Metrics.ACC_PERSONAL_PREFIX):
        return "personalised", "personalised accuracy"
    return "global", "global model accuracy"


def _rounds_cell(row: dict) -> Cell:
    if row["reached"] == 0:
        return Cell("not reached")
    text = f"{row['rounds_to_target']:.1f}"
    if row["reached"] < row["runs"]:
        text += f" ({row['reached']}/{row['runs']} seeds)"
    return Cell(text, value=row["rounds_to_target"])


def _summary_section(
    rows: list[dict], target: float, auto: bool, hparams: dict[str, list[str]], metric: str, clients: str
) -> Section:
    swept = any(hparams.values())
    headers: list[str | Cell] = [
        Cell("algorithm", css="text"),
        *([Cell("config (best of sweep)", css="text")] if swept else []),
        "seed(s)",
        "personalised acc % (final)",
        "personalised acc % (best round)",
        "global acc % (final)",
        "global acc % (best round)",
        f"rounds to {100 * target:.0f}% {_metric_words(metric)[0]}",
        "MB up",
        "MB down",
        "wall time, s",
    ]
    body = []
    for row in rows:
        n = row["runs"]
        body.append(
            [
                Cell(row["group"], css="text"),
                *([Cell(row["config"] or "—", css="text")] if swept else []),
                Cell(row["seeds"], value=n),
                _acc_cell(row["personal_final"], n),
                _acc_cell(row["personal_best"], n),
                _acc_cell(row["global_final"], n),
                _acc_cell(row["global_best"], n),
                _rounds_cell(row),
                Cell(f"{row['mb_up']:.3f}", value=row["mb_up"]),
                Cell(f"{row['mb_down']:.3f}", value=row["mb_down"]),
                Cell(f"{row['wall_s']:.1f}", value=row["wall_s"]),
            ]
        )
    how = (
        f"Target {100 * target:.0f}% chosen automatically: the highest whole percent every algorithm's mean "
        "best-round accuracy reaches (set it with --target)."
        if auto
        else f"Target {100 * target:.0f}% set with --target."
    )
    section = Section("summary", "Summary").add(table(headers, body))
    section.add(
        paragraph(
            "Mean ± std over seeds (population std; one seed shows no spread). Personalised accuracy is the "
            f"mean over {EVALUATED[clients]} of each client's model on its own test split; global accuracy is the global "
            "model on the dataset's test set (algorithms without one show —). Best round = the highest value "
            f"over the rounds. Rounds to target = the first round whose {metric} reached it, "
            f"mean over the seeds that did. MB = 2^20 bytes, cumulative over all clients. {how}",
            "note",
        )
    )
    return section


def _curve_sections(
    selected: pd.DataFrame,
    history: pd.DataFrame,
    colors: dict,
    fig_dir: Path,
    swept: bool,
    metric: str,
    personal_metric: str,
) -> list[Section]:
    personal = sm.curves(selected, history, personal_metric)
    global_ = sm.curves(selected, history, Metrics.ACC_GLOBAL)
    by_comm = sm.curves(selected, history, metric, x="comm_mb")
    which = " Each algorithm is drawn at its best sweep configuration (see Sweep)." if swept else ""

    rounds = Section("accuracy-round", "Accuracy against round")
    # the same for every run on one partition: their mean
    column = metric_column(Metrics.ACC_MAJORITY_BASELINE)
    majority = float(selected[column].mean()) if column in selected and personal else None
    png = figs.save_png(
        figs.accuracy_vs_round(personal, global_, colors, majority), fig_dir / "accuracy_vs_round.png"
    )
    rounds.add(
        figure(
            png,
            "accuracy against round",
            f"figures/accuracy_vs_round.png: mean over seeds, band = ± std; dashed: the majority-class "
            f"accuracy of the same clients (each predicting its most frequent training label).{which}",
        )
    )

    comm = Section("accuracy-comm", "Accuracy against communication")
    png = figs.save_png(
        figs.accuracy_vs_comm(by_comm, colors, _metric_words(metric)[1]), fig_dir / "accuracy_vs_comm.png"
    )
    comm.add(
        figure(
            png,
            "accuracy against cumulative communication",
            f"figures/accuracy_vs_comm.png: {metric} against the megabytes sent up and down so "
            f"far; further left at the same height is cheaper. An algorithm that sends nothing sits at 0 MB.{which}",
        )
    )
    return [rounds, comm]


def _client_section(ex: ExperimentRuns, selected: pd.DataFrame, colors: dict, fig_dir: Path) -> Section:
    section = Section("client-accuracy", "Per-client accuracy")
    acc = load.load_client_accuracy(ex, list(selected["run_id"]))
    if acc.empty:
        return section.add(
            paragraph("No run logged client_accuracy.csv, so there is no distribution to draw.")
        )
    acc = acc.merge(selected[["run_id", "group"]], on="run_id")
    per_group = {g: frame["accuracy"].to_numpy(dtype=float) for g, frame in acc.groupby("group", sort=True)}
    png = figs.save_png(figs.client_accuracy_box(per_group, colors), fig_dir / "client_accuracy_box.png")
    counts = ", ".join(f"{g}: {len(v)}" for g, v in per_group.items())
    return section.add(
        figure(
            png,
            "per-client accuracy distribution",
            f"figures/client_accuracy_box.png: final accuracy of every client (all seeds pooled; clients: {counts}). "
            "Box = quartiles, line = median, whiskers = 1.5 IQR.",
        )
    )


def _sweep_section(
    runs: pd.DataFrame, hparams: dict[str, list[str]], colors: dict, fig_dir: Path, metric: str
) -> Section:
    section = Section("sweep", "Sweep: hyperparameters")
    swept = {g: ps for g, ps in hparams.items() if ps}
    if not swept:
        return section.add(
            paragraph(
                "Not a sweep: no hyperparameter varies across the runs of one algorithm, so there is nothing "
                "to plot against the final metric."
            )
        )
    sweep_ids = sorted(set(runs["sweep_id"]) - {""})
    if sweep_ids:
        section.add(paragraph("sweep id: " + ", ".join(sweep_ids), "meta"))
    for group, params in swept.items():
        frame = runs[runs["group"] == group]
        slug = _slug(group)
        configs = frame.groupby("config")[metric_column(metric)].agg(
            mean="mean", std=lambda v: v.std(ddof=0), size="size"
        )
        configs = configs.sort_values("mean", ascending=False)
        section.add(heading(f"{group}: {len(frame)} runs, {len(configs)} configurations"))
        png = figs.save_png(
            figs.sweep_lines(group, frame, params, metric, colors[group]), fig_dir / f"sweep_{slug}.png"
        )
        section.add(figure(png, f"{group} hyperparameters", f"figures/sweep_{slug}.png"))
        for p1, p2 in list(itertools.combinations(params, 2))[:MAX_HEATMAPS]:
            grid = sm.sweep_grid(frame, p1, p2, metric)
            name = f"sweep_{slug}_{_slug(p1)}_x_{_slug(p2)}.png"
            png = figs.save_png(figs.sweep_heatmap(group, grid, metric), fig_dir / name)
            section.add(
                figure(png, f"{group} {p1} x {p2}", f"figures/{name}: the red box marks the best cell.")
            )
        rows = [
            [
                Cell(cfg, css="text"),
                Cell(str(int(r["size"])), value=int(r["size"])),
                Cell(_pct(r["mean"]), value=r["mean"]),
                Cell(_pct(r["std"]) if r["size"] > 1 else "—", value=r["std"]),
            ]
            for cfg, r in configs.head(MAX_CONFIG_ROWS).iterrows()
        ]
        section.add(table([Cell("configuration", css="text"), "runs", f"final {metric} %", "± std"], rows))
        if len(configs) > MAX_CONFIG_ROWS:
            section.add(
                paragraph(f"… and {len(configs) - MAX_CONFIG_ROWS} more configurations (runs.csv).", "note")
            )
    return section


def _partition_section(ex: ExperimentRuns, runs: pd.DataFrame, fig_dir: Path) -> Section:
    section = Section("partition", "Data partition")
    names = runs.set_index("run_id")
    with tempfile.TemporaryDirectory() as tmp:
        found = [{**part, "png": part["path"].read_bytes()} for part in load.load_partitions(ex, Path(tmp))]
    for i, part in enumerate(found):
        first = names.loc[part["run_ids"][0]]
        png = part["png"]
        (fig_dir / f"partition_{i}.png").write_bytes(png)
        used = ", ".join(sorted(set(names.loc[part["run_ids"], "group"])))
        clients = first.get(param_column(Params.NUM_CLIENTS), "?")
        section.add(
            figure(
                png,
                f"partition {i}",
                f"figures/partition_{i}.png: {first['dataset']}, {first['partition']}, {clients} clients, "
                f"seed {first['seed']}; used by {len(part['run_ids'])} runs ({used}): "
                + " ".join(r[:8] for r in part["run_ids"]),
            )
        )
    if not found:
        section.add(paragraph("No run logged partition.png."))
    return section


def _runs_section(ex: ExperimentRuns, runs: pd.DataFrame, selected: pd.DataFrame) -> Section:
    section = Section("runs", "Runs read")
    chosen = set(selected["run_id"])
    swept = runs["config"].ne("").any()
    headers = ["run id", "run name", "algorithm", "seed", *(["config"] if swept else []), "in figures"]
    headers += ["sweep id", "parent run"]
    rows = [
        [
            Cell(r["run_id"], css="id text"),
            r["run_name"],
            r["group"],
            str(r["seed"]),
            *([r["config"]] if swept else []),
            "yes" if r["run_id"] in chosen else "no (other config)",
            r["sweep_id"] or "—",
            Cell(r["parent_id"] or "—", css="id text"),
        ]
        for _, r in runs.iterrows()
    ]
    section.add(
        paragraph(
            f"{len(runs)} finished runs of experiment {ex.experiment!r} (id {ex.experiment_id}) in {ex.tracking_uri}."
        )
    )
    section.add(table([Cell(h, css="text") for h in headers], rows))
    for sweep_id in sorted(set(runs["sweep_id"]) - {""}):
        section.add(
            paragraph(f"MLflow UI search box, this sweep: {tag_filter(Tags.SWEEP_ID, sweep_id)}", "meta")
        )
    if len(runs) <= 30:
        ids = ", ".join(f"'{r}'" for r in runs["run_id"])
        section.add(paragraph(f"MLflow UI search box, these runs: attributes.run_id IN ({ids})", "meta"))
    if len(ex.skipped):
        skipped = [
            [Cell(r.run_id, css="id text"), r.run_name, r.status, r.reason] for r in ex.skipped.itertuples()
        ]
        section.add(heading(f"Left out: {len(ex.skipped)} runs"))
        section.add(table([Cell(h, css="text") for h in ["run id", "run name", "status", "why"]], skipped))
    return section


def _meta(ex: ExperimentRuns, runs: pd.DataFrame, target_run: str | None) -> list[str]:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    groups = ", ".join(sorted(runs["group"].unique()))
    meta = [
        f"experiment {ex.experiment!r} (id {ex.experiment_id}) in {ex.tracking_uri}",
        f"{len(runs)} runs read ({groups}); {len(ex.skipped)} left out; generated {when} by fedray report",
    ]
    if target_run:
        meta.append(f"logged to MLflow run {target_run} under {ARTIFACT_DIR}/")
    return meta


def _runs_frame(runs: pd.DataFrame, selected: pd.DataFrame) -> pd.DataFrame:
    cols = ["run_id", "run_name", "group", "algorithm", "seed", "config", "sweep_id", "parent_id", "wall_s"]
    metrics = sorted(c for c in runs.columns if c.startswith(METRICS_COLUMN_PREFIX))
    return runs[cols + metrics].assign(in_figures=runs["run_id"].isin(selected["run_id"]))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")
