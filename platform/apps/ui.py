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
import os
import socket
import sys

from fedray.platform.errors import ConfigError
from fedray.platform.tracking.views import DEFAULT_HOST, DEFAULT_PORT, latest_experiment, runs_table_url

# MLflow's server also starts eight job-runner processes for its GenAI jobs (scorers, prompt
# optimisation, trace roll-ups), which fedray's runs never queue: about 30 s of CPU and 0.5 GB here,
# spent beside the page. Off by default in every MLflow server fedray starts.
SERVER_ENV_DEFAULTS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def find_experiment(uri: str, name: str | None) -> tuple[str, str] | None:
    from mlflow.tracking import MlflowClient

    from fedray.platform.tracking.mlflow_run import existing_experiment, quiet_mlflow

    quiet_mlflow()
    client = MlflowClient(tracking_uri=uri)
    if name is None:
        return latest_experiment(client)
    found = existing_experiment(client, name, uri)
    return found.experiment_id, found.name


def require_listenable(host: str, port: int) -> None:
    """The UI server's address, tried before the server replaces this process: uvicorn logs a host it
    cannot resolve or a port in use and exits 0, which a script would take for a UI that ran."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        raise ConfigError(
            f"--host {host} --port {port}: the UI cannot listen there ({err.strerror or err}); "
            "give this machine's address (127.0.0.1, 0.0.0.0 for every interface) and a free port"
        ) from None


def ui_command(args: argparse.Namespace) -> int:
    from fedray.platform.tracking.mlflow_run import (
        missing_sqlite_store,
        require_tracking_store,
        tracking_uri,
        tracking_uri_source,
    )

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: must be >= 1")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: a TCP port is 1-65535")

    uri = tracking_uri()
    if missing_sqlite_store(uri):
        raise ConfigError(f"no MLflow store at {uri} yet: run something first (make run)")
    require_tracking_store(uri, tracking_uri_source())
    found = find_experiment(uri, args.experiment)
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        print(f"the tracking server {uri} serves the UI: {runs_table_url(found[0], uri) if found else uri}")
        return 0
    require_listenable(args.host, args.port)
    server = f"http://{args.host}:{args.port}"
    if found is None:
        print(f"MLflow UI: {server}/  (the store has no runs yet)")
    else:
        print(f"runs of experiment {found[1]!r}: {runs_table_url(found[0], server)}")
    sys.stdout.flush()
    where = ["--backend-store-uri", uri, "--host", args.host, "--port", str(args.port)]
    if args.workers is not None or "MLFLOW_WORKERS" not in os.environ:  # else mlflow reads the variable
        where += ["--workers", str(args.workers or 1)]
    for key, value in SERVER_ENV_DEFAULTS.items():  # unless the user set them
        os.environ.setdefault(key, value)
    # the UI server replaces this process: Ctrl-C stops it
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", *where])
    return 0  # not reached


def add_ui_parser(subparsers) -> None:
    ui = subparsers.add_parser("ui", help="the MLflow UI on fedray's store; prints the runs table's address")
    ui.add_argument("--experiment", help="experiment whose runs table to print (default: the latest run's)")
    ui.add_argument("--port", type=int, default=DEFAULT_PORT)
    ui.add_argument("--host", default=DEFAULT_HOST)
    # one user's browser: one server process is up in about 9 s here, MLflow's default four in 14-20
    ui.add_argument("--workers", type=int, help="UI server processes (default: MLFLOW_WORKERS, else 1)")
    ui.set_defaults(func=ui_command)
