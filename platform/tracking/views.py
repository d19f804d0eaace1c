"""Addresses and saved views of MLflow's runs page: the runs table of an experiment (classic ML, not
the GenAI overview MLflow 3 opens by default), and a sweep's trials grouped by their swept values."""

from __future__ import annotations

import json
import re
import time

from fedray.platform.tracking.names import Tags, tag_filter

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


def save_sweep_view(client, experiment_id: str, sweep_id: str, parent_run_id: str, params: list[str]) -> str:
    """Save a view of the runs page on the experiment: the sweep's trials only, grouped by the swept
    params (the chart view then draws one curve per group). Returns the key that opens it
    (``viewStateShareKey``); the view is also listed by name under the page's Views."""
    state = {
        "searchFilter": tag_filter(Tags.PARENT_RUN_ID, parent_run_id),  # the trials, not the parent
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "param", "groupByData": p} for p in params],
        },
    }
    view = {"name": f"{sweep_id} by {', '.join(params)}", "createdAt": int(time.time() * 1000)}
    view["state"] = json.dumps(state)
    key = re.sub(r"[^A-Za-z0-9_-]", "_", f"{sweep_id}-{parent_run_id[:8]}")  # a re-run gets its own
    client.set_experiment_tag(experiment_id, Tags.SHARED_VIEW_PREFIX + key, json.dumps(view))
    return key
