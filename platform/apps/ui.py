"""``fedray ui [--experiment NAME]``: the MLflow UI on the project's store, opened on the runs.

MLflow 3's UI opens an experiment on its GenAI overview unless the address says otherwise: the UI
picks GenAI or classic ML from the ``workflowType`` query parameter, else from a sidebar toggle kept in
the browser, else GenAI (the ``mlflow.experimentKind`` tag is not read; MLflow 3.17's UI bundle).
``http://HOST:PORT/#/experiments/<id>/runs?workflowType=machine_learning`` opens the runs table with
the ML sidebar. This command prints that address for the experiment
asked for (default: the one whose latest run started last), then runs ``mlflow ui`` in the
foreground on the same store fedray logs to (``MLFLOW_TRACKING_URI``, else ``./mlflow.db``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from fedray.platform.errors import ConfigError

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5000  # mlflow ui's own defaults
DEFAULT_SERVER = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


def latest_experiment(client) -> tuple[str, str] | None:
    """(id, name) of the experiment holding the most recently started run; None when there is none."""
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    if not experiments:
        return None
    runs = client.search_runs(list(experiments), order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    eid = runs[0].info.experiment_id
    return eid, experiments[eid]


def runs_table_url(experiment_id: str, server: str, **query: str) -> str:
    """The runs table on the UI at ``server`` (``http://host:port``); ``compareRunsMode=CHART``: its
    chart view; ``viewStateShareKey``: a saved view."""
    params = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{params}"


SHARED_VIEW_TAG = "mlflow.sharedViewState."  # experiment tag prefix the runs page loads a view from


def save_sweep_view(client, experiment_id: str, sweep_id: str, parent_run_id: str, params: list[str]) -> str:
    """Save a view of the runs page on the experiment: the sweep's trials only, grouped by the swept
    params (the chart view then draws one curve per group). Returns the key that opens it
    (``viewStateShareKey``); the view is also listed by name under the page's Views."""
    state = {
        "searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}'",  # the trials, not the parent
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "param", "groupByData": p} for p in params],
        },
    }
    view = {"name": f"{sweep_id} by {', '.join(params)}", "createdAt": int(time.time() * 1000)}
    view["state"] = json.dumps(state)
    key = re.sub(r"[^A-Za-z0-9_-]", "_", f"{sweep_id}-{parent_run_id[:8]}")  # a re-run gets its own
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + key, json.dumps(view))
    return key


def find_experiment(uri: str, name: str | None) -> tuple[str, str] | None:
    from mlflow.tracking import MlflowClient

    from fedray.platform.tracking.mlflow_run import existing_experiment, quiet_mlflow

    quiet_mlflow()
    client = MlflowClient(tracking_uri=uri)
    if name is None:
        return latest_experiment(client)
    found = existing_experiment(client, name, uri)
    return found.experiment_id, found.name


def ui_command(args: argparse.Namespace) -> int:
    from fedray.platform.tracking.mlflow_run import tracking_uri

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ConfigError(f"no MLflow store at {uri} yet: run something first (make run)")
    found = find_experiment(uri, args.experiment)
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        print(f"the tracking server {uri} serves the UI: {runs_table_url(found[0], uri) if found else uri}")
        return 0
    server = f"http://{args.host}:{args.port}"
    if found is None:
        print(f"MLflow UI: {server}/  (the store has no runs yet)")
    else:
        print(f"runs of experiment {found[1]!r}: {runs_table_url(found[0], server)}")
    sys.stdout.flush()
    where = ["--backend-store-uri", uri, "--host", args.host, "--port", str(args.port)]
    # the UI server replaces this process: Ctrl-C stops it
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", *where])
    return 0  # not reached


def add_ui_parser(subparsers) -> None:
    ui = subparsers.add_parser("ui", help="the MLflow UI on fedray's store; prints the runs table's address")
    ui.add_argument("--experiment", help="experiment whose runs table to print (default: the latest run's)")
    ui.add_argument("--port", type=int, default=DEFAULT_PORT)
    ui.add_argument("--host", default=DEFAULT_HOST)
    ui.set_defaults(func=ui_command)
