"""Shared fixtures: one local Ray for the session, and a throwaway MLflow store per test."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from fedray.platform.tracking.names import Metrics

# Files whose tests start processes of their own (a `fedray run`, a Ray node, a server), slowest first
# (seconds in a 574 s suite, 2026-11-27). `make test` schedules them before the rest (xdist's
# --no-loadscope-reorder keeps this order): ordered by test count, as xdist does by default, they came
# last, and one pytest process ran a two-minute file alone at the end while the other core idled.
SLOW_FILES_FIRST = (
    "test_run_signals.py",  # ~135 s
    "test_tracking_outage.py",  # ~120 s
    "test_sweeps.py",  # ~140 s
    "test_cluster.py",  # ~75 s
    "test_gpu_placement.py",  # ~65 s
    "test_kept_runtime.py",
    "test_modalities.py",
    "test_lab_notebook.py",
    "test_paper_configs.py",
    "test_contract_rules.py",
    "test_checkpoint_safety.py",
    "test_runtime_faults.py",
    "test_dashboards.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        from fedray.platform.runtime.driver import start_local_ray
        from fedray.platform.runtime.processes import sharing_processes

        # Ray's processes inherit this: workers can import test-only algorithms (tests/killer_algorithm.py)
        tests_dir = os.path.dirname(__file__)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))

        start_local_ray(2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    with sharing_processes():  # a test's run starts on the last test's Coordinator and ClientActors
        yield ray
    ray.shutdown()


@pytest.fixture
def client_actor(ray_session):
    """One new, real ClientActor for a tiny 1-channel 8x8 federation, killed after the test. It asks
    Ray for no CPU, so the processes the last run kept (which hold every CPU) stay for the next run:
    releasing them would cost it three fresh processes. New, not one of those: a process that has
    trained is no witness to how a ClientActor's process starts (its allocator has seen large
    blocks freed, for one)."""
    from fedray.platform.catalog import load_config
    from fedray.platform.models import InputShape
    from fedray.platform.runtime.coordinator import start_worker

    meta = {
        "num_classes": 4,
        "inputs": InputShape.image(1, 8),
        "embeddings": None,
        "mean": [0.0],
        "std": [1.0],
        "train_sizes": [],
    }
    actor = start_worker(load_config(None, tiny_overrides()), {"num_cpus": 0})
    ray_session.get(actor.setup.remote(meta), timeout=600)  # a loaded machine starts it in minutes
    yield actor
    ray_session.kill(actor)


def one_torch_thread():
    """The test machine is shared: one intra-op thread avoids oversubscription stalls (a module's
    autouse fixture: ``_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    """Default data root and cache fallback live under HOME: keep the user's out of the tests."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


_STORE_TEMPLATE: list[Path] = []
_TEMPLATE_HOME: list[Path] = []  # the test process's pytest folder: pytest removes old ones itself


@pytest.fixture(scope="session", autouse=True)
def store_template_home(tmp_path_factory):
    """Where :func:`store_in` makes its template: under pytest's own temporary folder, which pytest
    prunes, rather than a folder of /tmp removed at exit (an xdist worker ended without running its
    exit handlers left one behind)."""
    _TEMPLATE_HOME[:] = [tmp_path_factory.mktemp("store-template")]


def store_in(directory, name: str = "mlflow.db") -> str:
    """The URI of the sqlite MLflow store ``directory / name``, made empty if there is none yet: a
    copy of one made once per test process, as making its tables (MLflow's migrations) costs 1.5-2.5 s
    of CPU each time, about 45 times a suite. Experiment 0 (Default) points under ``directory``, as
    if the store were made there."""
    if not _STORE_TEMPLATE:
        from mlflow.tracking import MlflowClient

        if _TEMPLATE_HOME:
            folder = _TEMPLATE_HOME[0]
        else:  # called outside a pytest session
            folder = Path(tempfile.mkdtemp(prefix="fedray-test-store-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
        _STORE_TEMPLATE.append(folder / "mlflow.db")
    path = Path(directory) / name
    if path.exists():
        return f"sqlite:///{path}"
    shutil.copyfile(_STORE_TEMPLATE[0], path)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        location = str(Path(directory).resolve() / "mlruns" / "0")
        moved = db.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (location,)
        )
        assert moved.rowcount == 1, "MLflow's empty store has no experiment 0 (Default) any more"
    return f"sqlite:///{path}"


@pytest.fixture
def patient_pool_sizing(monkeypatch):
    """A worker a test kills frees its CPU when Ray shows it, which on a loaded machine may take
    longer than the 5 s a run waits for it by default; the next run's pool would then be one worker
    short (its tags ``workers 1``). The wait ends as soon as Ray shows the CPU."""
    from fedray.platform.runtime.processes import StoppedProcesses

    monkeypatch.setattr(StoppedProcesses, "WAIT_S", 60.0)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A real sqlite MLflow store in a temporary directory, used through MLFLOW_TRACKING_URI."""
    from mlflow.tracking._tracking_service import utils

    uri = store_in(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # an earlier test's mlflow.set_tracking_uri would win over the variable for MlflowClient()
    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.chdir(tmp_path)
    return uri


def only_run(tmp_path):
    """The one MLflow run in the store at ``tmp_path / "mlflow.db"`` (``mlflow_store``'s), and a client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


def tiny_overrides(**extra):
    """A few seconds of real federated training on the synthetic set."""
    base = {
        "data.dataset": "synthetic",
        "data.num_clients": 4,
        "data.synthetic_samples": 600,
        "data.partition.kind": "dirichlet",
        "data.partition.alpha": 1.0,
        "data.partition.min_samples": 20,
        "model.group": "cnn_small",
        "rounds": 3,
        "train.local_epochs": 3,
        "train.batch_size": 32,
        "progress": False,
        "ray.max_actors": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def without_timing(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """A run's round metrics without its clocks (``time/*``), which differ between identical runs."""
    return [{k: v for k, v in h.items() if not k.startswith(Metrics.TIME_PREFIX)} for h in history]


def free_port() -> int:
    """A TCP port nothing listens on now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_fresh_python(script: str, *args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` (dedented) in a new Python process that can import the tests' modules: for what
    must be checked where no earlier test has started anything (Ray, allocator settings)."""
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )
