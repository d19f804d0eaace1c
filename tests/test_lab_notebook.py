"""What MLflow shows of a run is true and complete: its duration, its dataset, its models, the
machine's load, its description, and the UI opening on the runs table (issue: MLflow as the lab
notebook). Real Ray, a real sqlite store in a temporary folder, real headless Chromium."""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import mlflow
import mlflow.pytorch
import psutil
import pytest
import torch
from conftest import store_in, tiny_overrides
from mlflow.tracking import MlflowClient
from ui_helpers import browser_or_skip, page_dom, ui_server

from fedray.platform.catalog import load_config
from fedray.platform.data import normalize
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.driver import prepare_federation, run_experiment
from fedray.platform.tracking.dataset import dataset_source, split_digest
from fedray.platform.tracking.names import Metrics, Tags


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_session):
    """A FedAvg run (a global model) and a Local run (client models) on the same split."""
    store = tmp_path_factory.mktemp("notebook")
    uri = store_in(store)
    old_cwd, old_uri = os.getcwd(), os.environ.get("MLFLOW_TRACKING_URI")
    os.chdir(store)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        fedavg_cfg = load_config(None, tiny_overrides(rounds=2, **{"tracking.system_metrics_s": 0.5}))
        fedavg = run_experiment(fedavg_cfg)
        local = run_experiment(load_config(None, tiny_overrides(algorithm="local", rounds=1)))
    finally:
        os.chdir(old_cwd)
        if old_uri is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_uri
    return uri, store, fedavg, local


def test_duration_is_the_commands_wall_time(two_runs):
    uri, _, fedavg, _ = two_runs
    run = MlflowClient(uri).get_run(fedavg.run_id)
    duration_s = (run.info.end_time - run.info.start_time) / 1000
    # dated from the call's start; ended once the wall time is taken and logged (a slow disk may
    # take seconds over that last write, so the bound above is loose)
    assert -0.01 <= duration_s - fedavg.wall_time_s < 10.0, (duration_s, fedavg.wall_time_s)
    assert run.data.metrics[Metrics.TIME_WALL_S] == pytest.approx(fedavg.wall_time_s, abs=1.0)
    # the run was dated from the call's start, before the data and Ray: longer than its rounds
    rounds_s = sum(h[Metrics.TIME_ROUND_S] for h in fedavg.history)
    assert duration_s > rounds_s


def test_dataset_input_names_the_split_and_equal_splits_share_a_digest(two_runs):
    uri, _, fedavg, local = two_runs
    client = MlflowClient(uri)
    inputs = [client.get_run(r.run_id).inputs.dataset_inputs for r in (fedavg, local)]
    assert [len(i) for i in inputs] == [1, 1]
    a, b = inputs[0][0], inputs[1][0]
    assert a.dataset.name == "synthetic-dir1-4c"
    assert [t.value for t in a.tags if t.key == Tags.DATASET_CONTEXT] == ["train"]
    assert a.dataset.digest == b.dataset.digest  # same data config and seed: the same split
    assert '"clients": 4' in a.dataset.profile and '"train_samples"' in a.dataset.profile
    # and the digest is the split's: another seed moves samples between clients, and changes it
    other = prepare_federation(load_config(None, tiny_overrides(seed=1)))
    assert split_digest(other) != a.dataset.digest
    same = prepare_federation(load_config(None, tiny_overrides()))
    assert split_digest(same) == a.dataset.digest


def test_a_data_folder_is_the_datasets_source_without_a_warning(tmp_path):
    cfg = load_config(None, ["data.dataset=imagefolder", f"data.root={tmp_path}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MLflow's "can be interpreted in multiple ways" on every run
        source = dataset_source(cfg)
    assert source.to_dict() == {"uri": str(tmp_path.resolve())}
    assert dataset_source(load_config(None, [])).to_dict()["tags"][Tags.SOURCE_DATASET] == "digits"


def test_global_model_loads_from_mlflow_and_scores_what_the_run_logged(two_runs):
    uri, _, fedavg, _ = two_runs
    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(f"runs:/{fedavg.run_id}/global_model").eval()
    fed = prepare_federation(fedavg.config)
    with torch.no_grad():
        pred = model(normalize(fed.global_test.x, fed.mean, fed.std)).argmax(1)
    accuracy = (pred == fed.global_test.y).float().mean().item()
    assert accuracy == pytest.approx(fedavg.final[Metrics.ACC_GLOBAL], abs=1e-6)


def test_personalised_client_models_are_mlflow_models(two_runs):
    uri, _, _, local = two_runs
    mlflow.set_tracking_uri(uri)
    logged = mlflow.search_logged_models([local.experiment_id], output_format="list")
    names = sorted(m.name for m in logged if m.source_run_id == local.run_id)
    assert names == [f"client_{k}" for k in range(4)]
    # each is that client's own trained model: it scores the client's test split as the run did
    fed = prepare_federation(local.config)
    for k in (1, 3):
        model = mlflow.pytorch.load_model(f"runs:/{local.run_id}/client_{k}").eval()
        test = fed.shards[k].test
        with torch.no_grad():
            pred = model(normalize(test.x, fed.mean, fed.std)).argmax(1)
        assert (pred == test.y).float().mean().item() == pytest.approx(local.client_acc[k], abs=1e-6), k


def test_system_metrics_and_description_are_on_the_run(two_runs):
    uri, _, fedavg, _ = two_runs
    client = MlflowClient(uri)
    run = client.get_run(fedavg.run_id)
    cpu = client.get_metric_history(fedavg.run_id, "system/cpu_utilization_percentage")
    assert len(cpu) >= 1 and all(0 <= m.value <= 100 for m in cpu)
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    note = run.data.tags[Tags.NOTE]
    for needle in ("fedavg", "synthetic", "4 clients", "Dirichlet(alpha=1)", "2 rounds", "cnn_small"):
        assert needle in note, (needle, note)


# --------------------------------------------------------------------------------------------- browser


def test_make_ui_prints_the_runs_table_and_the_page_lists_the_runs(two_runs, tmp_path):
    browser = browser_or_skip()
    uri, store, fedavg, local = two_runs
    with ui_server(uri, store) as (line, port):
        # the latest run's experiment (both runs share one) and its runs table, not the GenAI overview
        match = re.search(rf"(http://127\.0\.0\.1:{port}/#/experiments/(\d+)/runs\S*)", line)
        assert match and match.group(2) == local.experiment_id, line
        dom = page_dom(browser, match.group(1), tmp_path / "profile")
        # and no MLflow job runners beside it (eight processes that fedray's runs never use)
        assert job_runners_of(port) == []
    for run in (fedavg, local):
        name = MlflowClient(uri).get_run(run.run_id).info.run_name
        assert name in dom, name


def job_runners_of(port: int) -> list[int]:
    """The processes of MLflow's job runner started by the UI server on ``port``."""
    runners = []
    for proc in psutil.process_iter(["cmdline"]):
        if "huey_consumer" in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                if any(f"--port {port}" in " ".join(p.cmdline()) for p in proc.parents()):
                    runners.append(proc.pid)
    return runners


def test_fedray_ui_serves_one_worker_unless_told_otherwise(tmp_path, monkeypatch):
    from fedray.platform.apps import ui
    from fedray.platform.apps.cli import build_parser

    store = store_in(tmp_path)
    MlflowClient(store).create_experiment("x")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("MLFLOW_WORKERS", raising=False)
    served: list[list[str]] = []
    monkeypatch.setattr(ui.os, "execv", lambda path, argv: served.append(argv))  # mlflow ui, not run

    def workers(*argv: str) -> str | None:
        args = build_parser().parse_args(["ui", *argv])
        args.func(args)
        command = served.pop()
        return command[command.index("--workers") + 1] if "--workers" in command else None

    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)
    assert workers() == "1"
    assert os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # no job runners...
    monkeypatch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")
    assert workers("--workers", "4") == "4"
    assert os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"  # ...unless asked for
    monkeypatch.setenv("MLFLOW_WORKERS", "3")
    assert workers() is None  # mlflow ui reads the variable itself
    with pytest.raises(ConfigError, match=r"^--workers 0: must be >= 1$"):
        workers("--workers", "0")
