"""MLflow tracking: the only module that talks to MLflow.

Default store: ``sqlite:///<cwd>/mlflow.db`` with artifacts in ``<cwd>/mlartifacts``; overridden by
``MLFLOW_TRACKING_URI`` or ``tracking.uri``. One experiment per config name; per-round metrics are logged
with ``step = rounds completed`` under fixed names that every algorithm shares
(:mod:`fedray.platform.tracking.names`; README, "What a run records (MLflow)"), so MLflow compares runs.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedray.platform.config import ExperimentConfig, config_yaml, flatten
from fedray.platform.environ import environ_restored
from fedray.platform.errors import ConfigError, first_line
from fedray.platform.interrupts import deferred
from fedray.platform.network import no_answer
from fedray.platform.tracking.descriptions import partition_names
from fedray.platform.tracking.names import Metrics, Tags
from fedray.platform.tracking.outage import PatientCalls, shorten_http_retries, unreachable


def quiet_mlflow() -> None:
    """MLflow announces database migrations at INFO; a run's output is for the run."""
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # its warning that pickled models execute code when loaded: log_model pickles on purpose
    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)


def tracking_uri(cfg: ExperimentConfig | None = None) -> str:
    """``MLFLOW_TRACKING_URI``, else ``tracking.uri``, else ``./mlflow.db``; a local store's path made
    absolute here (a sweep's trials, a resume, run in other directories)."""
    uri = (
        os.environ.get("MLFLOW_TRACKING_URI") or (cfg.tracking.uri if cfg else None) or "sqlite:///mlflow.db"
    )
    if uri.startswith("sqlite:///"):
        path, query = uri.removeprefix("sqlite:///").partition("?")[::2]
        return f"sqlite:///{Path(path).expanduser().resolve()}" + (f"?{query}" if query else "")
    if "://" not in uri and not uri.startswith("file:"):  # a bare path: MLflow's file store
        return str(Path(uri).expanduser().resolve())
    return uri


def tracking_uri_source() -> str:
    """Where :func:`tracking_uri` comes from, named as a user sets it."""
    return "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri"


def require_tracking_store(uri: str, source: str) -> None:
    """A tracking URI MLflow has no store for fails in one line before anything starts; MLflow itself
    raises a long traceback when the run is first opened, after Ray and the rounds have started."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:  # a later MLflow keeps its registry elsewhere: the URI is left to it
        return
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # MLflow's "unsupported URI" exceptions have no common public base
        raise ConfigError(
            f"{source}={uri}: MLflow has no tracking store for that scheme; give sqlite:///<file>, "
            "http(s)://<server>, or a database URI (postgresql://, mysql://)"
        ) from None
    if is_file_store(uri) and os.environ.get("MLFLOW_ALLOW_FILE_STORE") != "true":
        raise ConfigError(
            f"{source}={uri}: a folder is MLflow's old file store, which it refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true; give sqlite:///<file> (mlflow migrate-filestore moves old runs)"
        )
    require_sqlite_folder(uri, source)
    require_server_answer(uri, source)
    require_database(uri, source)


def is_file_store(uri: str) -> bool:
    """Whether ``uri`` names MLflow's folder store (a bare path or ``file:``)."""
    return "://" not in uri or uri.startswith("file:")


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (its query left out), or None for another store."""
    return Path(uri.removeprefix("sqlite:///").partition("?")[0]) if uri.startswith("sqlite:///") else None


def require_sqlite_folder(uri: str, source: str) -> None:
    """A SQLite store's folder that cannot be made fails in one line here; MLflow would make it as
    the run is first opened, after Ray and the first round have started."""
    database = sqlite_file(uri)
    if database is None or database.parent.is_dir():
        return
    folder = database.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{source}={uri}: cannot make the folder {folder} ({err.strerror})") from None


def missing_sqlite_store(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` store that is not there (MLflow would make an empty one), or None."""
    path = sqlite_file(uri)
    return None if path is None or path.is_file() else path


def require_server_answer(uri: str, source: str) -> None:
    """A tracking server where nothing answers fails in one line at once. MLflow itself retries each
    request for minutes: a report or ``fedray ui`` would wait in silence, and a run would start Ray
    and train its first round before its first write failed with a traceback. (An outage once the
    run is going is waited out: ``tracking.max_outage_s``.)"""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if parts.scheme in getproxies() and not proxy_bypass(parts.hostname):
        return  # MLflow's requests go through the proxy (HTTP(S)_PROXY), which may be all that reaches it
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as err:  # a port out of range
        why: str | None = str(err)
    else:
        why = no_answer(parts.hostname, port)
    if why:
        raise ConfigError(
            f"{source}={uri}: no tracking server answers there ({why}); start it (mlflow server ...) or give its address"
        )


# what to install for the Python module a database URI's driver is (SQLAlchemy's default per scheme)
DATABASE_DRIVERS = {
    "MySQLdb": "pip install mysqlclient, or mysql+pymysql:// and pip install pymysql",
    "pymysql": "pip install pymysql",
    "psycopg": "pip install 'psycopg[binary]'",
    "psycopg2": "pip install psycopg2-binary",
    "pyodbc": "pip install pyodbc",
}
DATABASE_PORTS = {"mysql": 3306, "postgresql": 5432, "mssql": 1433}


def require_database(uri: str, source: str) -> None:
    """A database store (postgresql://, mysql://, mssql://) whose driver is not installed, or where
    nothing answers, fails in one line here: MLflow would fail with a traceback as the run is first
    opened, after Ray has started. The password is not shown."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    scheme = uri.split("://", 1)[0].split("+", 1)[0]
    if scheme not in DATABASE_PORTS:
        return
    try:
        url = make_url(uri)
        shown = url.render_as_string(hide_password=True)
        dialect = url.get_dialect()
        import_dbapi: Any = getattr(dialect, "import_dbapi", None) or dialect.dbapi  # SQLAlchemy 2, or 1.4
        import_dbapi()
    except ModuleNotFoundError as err:
        install = DATABASE_DRIVERS.get(err.name or "", f"pip install {err.name}")
        raise ConfigError(
            f"{source}={shown}: its database driver {err.name} is not installed ({install})"
        ) from None
    except (ArgumentError, ValueError):  # a URI it cannot parse; its message would show the password
        raise ConfigError(f"{source}: not a database URI SQLAlchemy reads") from None
    if not url.host:  # a local socket: MLflow's connection says
        return
    why = no_answer(url.host, url.port or DATABASE_PORTS[scheme])
    if why:
        raise ConfigError(
            f"{source}={shown}: no database answers there ({why}); start it or give its address"
        )


def _artifact_root(uri: str) -> str | None:
    """Local stores keep artifacts beside the database; a tracking server decides for itself."""
    if uri.startswith("sqlite:///") or is_file_store(uri):
        base = Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else Path.cwd()
        return (base / "mlartifacts").resolve().as_uri()
    return None


def partition_label(cfg: ExperimentConfig) -> str:
    return partition_names(cfg)[0]


def run_name(cfg: ExperimentConfig) -> str:
    return f"{cfg.algorithm}-{cfg.data.dataset}-{partition_label(cfg)}-s{cfg.seed}"


def run_tags(cfg: ExperimentConfig) -> dict[str, str]:
    return {
        Tags.ALGORITHM: cfg.algorithm,
        Tags.DATASET: cfg.data.dataset,
        Tags.PARTITION: partition_label(cfg),
        Tags.MODEL_GROUP: cfg.model.group,
        Tags.SEED: str(cfg.seed),
    }


class RunTracker:
    """One MLflow run, created or re-opened (resume), logged through an explicit client."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        extra_tags: dict[str, str] | None = None,
        start_time: float | None = None,
    ) -> None:
        """``start_time`` (seconds since the epoch): when the command began, so the UI's Duration is
        the wall time the user waited, not the time since the run record was created."""
        from mlflow.tracking import MlflowClient

        quiet_mlflow()
        self.uri = tracking_uri(cfg)
        shorten_http_retries(self.uri)
        # every write once the run exists waits out an outage of the tracking server (bounded)
        self.patient = PatientCalls(self.uri, cfg.tracking.max_outage_s)
        self.reopened_tags: dict[str, str] = {}  # a resumed run's tags as its last segment left them
        with deferred():  # not retried (a store down at the start fails the run), but never cut short
            self.client = MlflowClient(tracking_uri=self.uri)  # a new SQLite store creates its tables
            self.run_id, self.experiment_id = self._open(cfg, run_id, parent_run_id, extra_tags, start_time)

    def _open(self, cfg, run_id, parent_run_id, extra_tags, start_time) -> tuple[str, str]:
        """The run to log into: ``run_id`` set running again, or a new one."""
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            run = self.client.get_run(run_id)
            self.reopened_tags = dict(run.data.tags)
            if Tags.STOPPED_EARLY in run.data.tags:  # a sweep's trial cut short, continued: no longer so
                self.client.delete_tag(run_id, Tags.STOPPED_EARLY)
            return run_id, run.info.experiment_id
        experiment = experiment_id(self.client, cfg.tracking.experiment or cfg.name, self.uri)
        tags = {**run_tags(cfg), **(extra_tags or {})}
        name = tags.pop(Tags.RUN_NAME, None) or run_name(cfg)  # a caller may name the run
        if parent_run_id:
            tags[Tags.PARENT_RUN_ID] = parent_run_id
        start_ms = None if start_time is None else int(start_time * 1000)
        return self.client.create_run(experiment, start_ms, tags, name).info.run_id, experiment

    # ---- params, metrics, artifacts
    def log_params(self, cfg: ExperimentConfig) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in flatten(cfg.to_dict()).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.patient(self.client.log_batch, self.run_id, params=params[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # fixed before any retry: a batch sent twice is stored once
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(batch), 1000):
            self.patient(self.client.log_batch, self.run_id, metrics=batch[i : i + 1000])

    def model_names(self) -> set[str]:
        """The names of the models this run logged whole (``log_model``; one cut short is not one)."""
        from mlflow.entities import LoggedModelStatus

        found, token = set(), None
        while True:
            page = self.patient(
                self.client.search_logged_models,
                [self.experiment_id],
                filter_string=f"source_run_id = '{self.run_id}'",
                page_token=token,
            )
            found |= {model.name for model in page if model.status == LoggedModelStatus.READY}
            token = page.token
            if not token:
                return found

    def latest(self, key: str) -> float | None:
        """The value of ``key`` at its highest step (None when never logged)."""
        history = self.patient(self.client.get_metric_history, self.run_id, key)
        return max(history, key=lambda m: (m.step, m.timestamp)).value if history else None

    def last_step(self, key: str) -> int:
        """The highest step logged for ``key`` (0 when none)."""
        return max(
            (m.step for m in self.patient(self.client.get_metric_history, self.run_id, key)), default=0
        )

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.patient(self.client.set_tag, self.run_id, k, v)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.patient(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_text(self, text: str, name: str, folder: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.log_file(path, folder)

    def log_config(self, cfg: ExperimentConfig) -> None:
        self.log_text(config_yaml(cfg), "config.yaml")

    def log_table(self, frame, name: str) -> None:
        self.log_text(frame.to_csv(index=False), name)

    def log_model(self, model, name: str, example, step: int = 0, with_example: bool = True) -> None:
        """``model`` as an MLflow model ``runs:/<run id>/<name>`` with the signature ``example``
        implies, and the example itself unless ``with_example`` is False (an example costs about
        55 ms of a model's 0.2 s: MLflow saves it, loads the model back and predicts it).
        Pickled (the model's classes come from fedray at load time), since MLflow's default, a
        torch.export graph, does not trace every architecture in the zoo."""
        import mlflow
        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        model = model.eval()
        with torch.no_grad():
            out = model(example)
        # MLflow >= 3.5 defaults to torch.export ("pt2"); earlier 3.x pickles without being asked
        fmt = {"serialization_format": "pickle"}
        if "serialization_format" not in inspect.signature(mlflow.pytorch.log_model).parameters:
            fmt = {}
        with mlflow_globals(self.uri, self.experiment_id), validated_on_the_cpu():
            self.patient(
                mlflow.pytorch.log_model,
                model,
                name=name,
                input_example=example.numpy() if with_example else None,
                signature=infer_signature(example.numpy(), out.numpy()),
                pip_requirements=[f"torch>={torch.__version__.split('+')[0]}", "fedray"],
                run_id=self.run_id,
                step=step,
                **fmt,
            )

    def log_dataset(self, dataset) -> None:
        """An ``mlflow.data`` dataset as the run's training input (the UI's Dataset column)."""
        from mlflow.entities import DatasetInput, InputTag

        inputs = [
            DatasetInput(dataset._to_mlflow_entity(), [InputTag(key=Tags.DATASET_CONTEXT, value="train")])
        ]
        try:
            self.patient(self.client.log_inputs, self.run_id, inputs)
        except Exception as err:
            if not lost_an_insert_race(err):
                raise
            # a sweep's trials start together and log one dataset: MLflow looks for it, then inserts
            # it, and another trial's insert came in between; the second try finds it and links to it
            self.patient(self.client.log_inputs, self.run_id, inputs)

    def describe(self, text: str) -> None:
        """The run's description in the UI."""
        self.patient(self.client.set_tag, self.run_id, Tags.NOTE, text)

    def system_metrics(self, interval_s: float) -> SystemMetrics | None:
        """MLflow's own system metrics of this machine every ``interval_s`` seconds, until
        ``.finish()``; None when turned off."""
        return SystemMetrics(self.run_id, interval_s, self.uri) if interval_s > 0 else None

    def end(self, status: str = "FINISHED", wall_s: float | None = None) -> None:
        """Close the run; ``wall_s`` is logged as ``time/wall_s`` (what the CLI prints)."""
        if wall_s is not None:
            self.log_metrics({Metrics.TIME_WALL_S: wall_s}, step=0)
        self.patient(self.client.set_terminated, self.run_id, status=status)


@contextlib.contextmanager
def validated_on_the_cpu():
    """``log_model`` loads the model it wrote and predicts the input example, in this process, on
    ``cuda`` wherever CUDA is visible: the driver of a run on a GPU node (which trains nowhere)
    would hold a CUDA context of its own. MLflow's prediction device is set to the CPU for the call
    (a user's own choice of ``MLFLOW_DEFAULT_PREDICTION_DEVICE`` is kept)."""
    key = "MLFLOW_DEFAULT_PREDICTION_DEVICE"
    if key in os.environ:
        yield
        return
    os.environ[key] = "cpu"
    try:
        yield
    finally:
        os.environ.pop(key, None)


@contextlib.contextmanager
def mlflow_globals(uri: str, experiment_id: str):
    """MLflow's process-wide store and experiment, set for one call and then put back as they were.

    ``Model.log`` finds both globally (a logged model in another experiment than its run's would make
    ``runs:/<id>/<name>`` unresolvable), and setting them also writes ``MLFLOW_TRACKING_URI`` and
    ``MLFLOW_EXPERIMENT_ID`` into the environment, which later runs of the same process (a compare, a
    sweep, the tests) would otherwise inherit instead of their own ``tracking.uri``."""
    import mlflow
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    saved = (utils._tracking_uri, fluent._active_experiment_id)
    with environ_restored(("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")):
        try:
            with deferred():  # it reads the experiment
                mlflow.set_tracking_uri(uri)
                mlflow.set_experiment(experiment_id=experiment_id)
            yield
        finally:
            utils._tracking_uri, fluent._active_experiment_id = saved


class SystemMetrics:
    """MLflow's SystemMetricsMonitor (CPU, memory, disk, network; GPU where pynvml finds one), plus
    one last sample when the run ends: the monitor publishes after each full interval, so a run
    shorter than one would otherwise have none."""

    def __init__(self, run_id: str, interval_s: float, uri: str) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        with deferred():  # it reads the run
            self.monitor = SystemMetricsMonitor(
                run_id, sampling_interval=interval_s, tracking_uri=uri, resume_logging=True
            )
        self.monitor.start()

    def finish(self) -> None:
        with deferred():  # both steps write to the store
            self.monitor.finish()  # stops the sampling thread, and sends what it holds
            self.monitor.collect_metrics()
            self._last_sample()

    def _last_sample(self) -> None:
        try:
            self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            self.monitor.mlflow_logger.flush()
        except Exception as err:  # samples are MLflow's own, taken while the server was down: best effort
            if not unreachable(err):
                raise
            print(f"system metrics: the last sample was not sent ({first_line(err)})", file=sys.stderr)


def existing_experiment(client, name: str, uri: str):
    """The experiment called ``name``; a one-line ConfigError naming the ones there when missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        known = ", ".join(repr(n) for n in sorted(e.name for e in client.search_experiments())) or "none"
        raise ConfigError(f"no MLflow experiment named {name!r} in {uri} (experiments there: {known})")
    return found


def experiment_id(client, name: str, uri: str) -> str:
    """The id of the experiment called ``name``, created if none is."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_artifact_root(uri))
    except Exception as err:
        if not lost_an_insert_race(err):
            raise
        return client.get_experiment_by_name(name).experiment_id  # created by a run started beside this one


def lost_an_insert_race(err: BaseException) -> bool:
    """Whether MLflow refused to insert a row because another process inserted it after MLflow had
    looked for it (runs started together creating one experiment or logging one dataset): trying again
    finds the row. Store-side, from SQLite, PostgreSQL or MySQL, directly or through a tracking server."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    text = str(err)
    return err.error_code == "RESOURCE_ALREADY_EXISTS" or any(
        said in text
        for said in ("UNIQUE constraint failed", "UniqueViolation", "duplicate key value", "Duplicate entry")
    )


def recorded_checkpoint_dir(run_id: str, uri: str | None = None) -> str | None:
    """The checkpoint folder (a path or a storage URI) a run recorded in its tag, if any."""
    return run_to_resume(run_id, uri).data.tags.get(Tags.CHECKPOINT_DIR)


def run_to_resume(run_id: str, uri: str | None = None):
    """The MLflow run ``fedray run --resume RUN_ID`` names; one line if there is none."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if uri is None:  # the user's --resume: checked here (a reopened run's tracker has its store)
        uri = tracking_uri()
        if missing_sqlite_store(uri):
            raise ConfigError(f"--resume {run_id}: no MLflow store at {uri} (run fedray where its store is)")
        require_tracking_store(uri, tracking_uri_source())
    quiet_mlflow()
    try:
        with deferred():  # a resume reads it while the run's signals are taken
            return MlflowClient(tracking_uri=uri).get_run(run_id)
    except MlflowException:
        raise ConfigError(f"--resume {run_id}: no such run in the MLflow store {uri}") from None
