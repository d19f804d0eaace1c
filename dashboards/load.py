"""MLflow -> pandas: the runs of one experiment, their per-round histories and their artifacts.

Reading goes through ``MlflowClient`` only, so a report works on a local sqlite store and on a
tracking server alike. The run frame uses the column names of ``mlflow.search_runs`` (``params.x``,
``metrics.x``, ``tags.x``) so anyone who knows MLflow's pandas output can read it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fedray.platform.errors import ConfigError
from fedray.platform.tracking.mlflow_run import (
    existing_experiment,
    missing_sqlite_store,
    quiet_mlflow,
    require_tracking_store,
    tracking_uri,
    tracking_uri_source,
)
from fedray.platform.tracking.names import (
    Metrics,
    Params,
    RunKind,
    Tags,
    metric_column,
    param_column,
    personal_on,
)

# Per-round metrics the report draws; other keys stay in the store.
HISTORY_KEYS = (
    Metrics.ACC_PERSONAL_MEAN,
    Metrics.ACC_PERSONAL_STD,
    Metrics.ACC_GLOBAL,
    Metrics.LOSS_TRAIN,
    Metrics.COMM_UP_BYTES_CUM,
    Metrics.COMM_DOWN_BYTES_CUM,
    Metrics.TIME_ROUND_S,
)
PRIMARY_METRIC = Metrics.ACC_PERSONAL_MEAN
GLOBAL_METRIC = Metrics.ACC_GLOBAL  # the metric of experiments whose clients hold no test data
EVAL_CLIENTS = ("all", "selected", "sample")  # eval.clients, in the order a report prefers them


@dataclass
class ExperimentRuns:
    """The finished fedray runs of one experiment, plus what was left out and why."""

    experiment: str
    experiment_id: str
    tracking_uri: str
    runs: (
        pd.DataFrame
    )  # one row per run used; columns run_id, run_name, group, seed, ..., params.*, metrics.*
    skipped: pd.DataFrame = field(default_factory=pd.DataFrame)  # run_id, run_name, status, reason
    parent_ids: list[str] = field(default_factory=list)  # runs that are parents of the used runs (sweeps)
    metric: str = PRIMARY_METRIC  # what ranks configurations and sets the target: personalised, else global
    clients: str = "all"  # the runs' eval.clients, which names their personalised metrics

    def personal(self, metric: str) -> str:
        """The name these runs log ``metric`` under (``acc/personal_mean_selected`` for ``selected``)."""
        return personal_on(metric, self.clients)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri)


def resolve_tracking_uri(uri: str | None) -> str:
    """The project's store unless told otherwise; a missing sqlite file is an error, not a new store."""

    source = "--tracking-uri" if uri else tracking_uri_source()
    uri = uri or tracking_uri()
    require_tracking_store(uri, source)
    path = missing_sqlite_store(uri)
    if path is not None:
        raise ConfigError(f"no MLflow store at {path} (tracking URI {uri}); run an experiment first")
    return uri


def load_runs(experiment: str, tracking_uri: str | None = None) -> ExperimentRuns:
    """Every finished fedray run of ``experiment`` (by name) as one frame; fails clearly on none."""
    from mlflow.tracking import MlflowClient

    quiet_mlflow()
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    found = existing_experiment(client, experiment, uri)
    all_runs = _search_all(client, found.experiment_id)
    runs = [r for r in all_runs if r.data.tags.get(Tags.KIND) != RunKind.REPORT]
    parents = {r.data.tags.get(Tags.PARENT_RUN_ID) for r in runs} - {None}

    # personalised accuracy when a run the report can use has it, under the name its eval.clients gives
    # it (all clients first); global accuracy for experiments without client test data (every client
    # sample used for training, as FedCross and FedSC train). A killed run or a sweep's parent has no say.
    usable = [r for r in runs if r.info.run_id not in parents and _skip_reason(r, None) is None]
    logged = {key for r in usable for key in r.data.metrics}
    clients = evaluated_clients(logged) or "all"
    personal = personal_on(PRIMARY_METRIC, clients)
    metric = personal if personal in logged or GLOBAL_METRIC not in logged else GLOBAL_METRIC
    used, skipped = [], []
    for run in runs:
        if run.info.run_id in parents:
            continue  # a sweep's parent: it carries the sweep, not a federation
        reason = _skip_reason(run, metric)
        if reason:
            skipped.append(
                {
                    "run_id": run.info.run_id,
                    "run_name": run.info.run_name,
                    "status": run.info.status,
                    "reason": reason,
                }
            )
        else:
            used.append(_row(run))
    if not used:
        detail = (
            f"{len(skipped)} runs there, none usable: " + _skip_summary(skipped) if skipped else "it is empty"
        )
        raise ConfigError(
            f"experiment {experiment!r} in {uri} has no finished fedray runs to report ({detail})"
        )
    frame = pd.DataFrame(used).sort_values(["group", "seed_sort", "start_time"], kind="stable")
    frame = frame.drop(columns="seed_sort").reset_index(drop=True)
    used_parents = sorted(set(frame["parent_id"].dropna()) - {""})
    return ExperimentRuns(
        experiment,
        found.experiment_id,
        uri,
        frame,
        pd.DataFrame(skipped, columns=["run_id", "run_name", "status", "reason"]),
        used_parents,
        metric,
        clients,
    )


def _search_all(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def evaluated_clients(metrics) -> str | None:
    """The ``eval.clients`` whose personalised mean is among ``metrics`` (metric names), all first."""
    return next((c for c in EVAL_CLIENTS if personal_on(PRIMARY_METRIC, c) in metrics), None)


def _skip_reason(run, metric: str | None) -> str | None:
    """Why the report leaves ``run`` out (``metric`` None: whatever it logged), or None."""
    if run.info.status != "FINISHED":
        return f"status {run.info.status}"
    if Tags.ALGORITHM not in run.data.tags:
        return f"no {Tags.ALGORITHM!r} tag (not a fedray run)"
    if metric is not None and metric not in run.data.metrics:
        other = evaluated_clients(run.data.metrics)
        if other is not None and metric.startswith(Metrics.ACC_PERSONAL_PREFIX):  # runs mixing policies
            return f"no {metric} metric (evaluated with eval.clients={other})"
        return f"no {metric} metric"
    return None


def _skip_summary(skipped: list[dict[str, Any]]) -> str:
    counts = pd.Series([s["reason"] for s in skipped]).value_counts()
    return ", ".join(f"{n} with {reason}" for reason, n in counts.items())


def _row(run) -> dict[str, Any]:
    tags, info = run.data.tags, run.info
    seed = tags.get(Tags.SEED, run.data.params.get(Params.SEED, ""))
    try:
        seed_sort = int(seed)
    except ValueError:
        seed_sort = 0
    end = info.end_time or info.start_time
    row: dict[str, Any] = {
        "run_id": info.run_id,
        "run_name": info.run_name,
        "status": info.status,
        "group": tags.get(Tags.LABEL) or tags[Tags.ALGORITHM],
        "algorithm": tags[Tags.ALGORITHM],
        "seed": seed,
        "seed_sort": seed_sort,
        "dataset": tags.get(Tags.DATASET, ""),
        "partition": tags.get(Tags.PARTITION, ""),
        "model_group": tags.get(Tags.MODEL_GROUP, ""),
        "sweep_id": tags.get(Tags.SWEEP_ID, ""),
        "parent_id": tags.get(Tags.PARENT_RUN_ID, ""),
        "start_time": info.start_time,
        # the time the run's command took (summed over resumes); runs logged before fedray recorded
        # it fall back to the run's span
        "wall_s": run.data.metrics.get(Metrics.TIME_WALL_S, (end - info.start_time) / 1000.0),
    }
    row.update({param_column(k): v for k, v in run.data.params.items()})
    row.update({metric_column(k): v for k, v in run.data.metrics.items()})
    return row


def load_history(ex: ExperimentRuns, run_ids: list[str], keys: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Per-round metrics, one row per (run_id, step), one column per metric key (``HISTORY_KEYS`` by
    default, the personalised ones as the runs name them).

    A resumed run may have logged a round twice (before and after the interruption): the later
    value wins, as in MLflow's own "latest" view.
    """
    keys = tuple(map(ex.personal, HISTORY_KEYS)) if keys is None else keys
    client = ex.client()
    rows = []
    for run_id in run_ids:
        for key in keys:
            for m in client.get_metric_history(run_id, key):
                rows.append((run_id, m.step, m.timestamp, key, m.value))
    if not rows:
        return pd.DataFrame(columns=["run_id", "step", *keys])
    long = pd.DataFrame(rows, columns=["run_id", "step", "timestamp", "key", "value"])
    long = long.sort_values("timestamp", kind="stable").drop_duplicates(
        ["run_id", "step", "key"], keep="last"
    )
    wide = long.pivot(index=["run_id", "step"], columns="key", values="value").reset_index()
    wide.columns.name = None
    for key in keys:
        if key not in wide:
            wide[key] = float("nan")
    return wide.sort_values(["run_id", "step"]).reset_index(drop=True)


def download(ex: ExperimentRuns, run_id: str, artifact: str, dst: Path) -> Path | None:
    """One artifact of one run, or None when the run did not log it."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per small file is noise
    dst.mkdir(parents=True, exist_ok=True)
    try:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=artifact, dst_path=str(dst), tracking_uri=ex.tracking_uri
        )
    except (MlflowException, OSError):
        return None
    path = Path(local)
    return path if path.is_file() else None


def load_client_accuracy(ex: ExperimentRuns, run_ids: list[str]) -> pd.DataFrame:
    """``client_accuracy.csv`` of each run, stacked: run_id, client, accuracy."""
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in run_ids:
            path = download(ex, run_id, "client_accuracy.csv", Path(tmp) / run_id)
            if path is not None:
                frame = pd.read_csv(path)
                frames.append(frame.assign(run_id=run_id)[["run_id", "client", "accuracy"]])
    if not frames:
        return pd.DataFrame(columns=["run_id", "client", "accuracy"])
    return pd.concat(frames, ignore_index=True)


def partition_signature(row: pd.Series) -> tuple:
    """Runs with equal data params and seed trained on identical shards (the partition is a pure
    function of the data config and the seed)."""
    data = sorted(
        (k, row[k]) for k in row.index if k.startswith(param_column(Params.DATA_PREFIX)) and pd.notna(row[k])
    )
    return (row["seed"], *data)


def load_partitions(ex: ExperimentRuns, dst: Path) -> list[dict[str, Any]]:
    """One partition picture per distinct partition the runs used, with the runs that used it."""
    groups: dict[tuple, list[str]] = {}
    for _, row in ex.runs.iterrows():
        groups.setdefault(partition_signature(row), []).append(row["run_id"])
    found = []
    for i, run_ids in enumerate(groups.values()):
        path = None
        for run_id in run_ids:  # the first run that logged the picture
            path = download(ex, run_id, "partition.png", dst / f"partition_{i}")
            if path is not None:
                break
        if path is not None:
            found.append({"path": path, "run_ids": run_ids})
    return found
