"""Ray Tune sweeps: space files checked without Ray; a real 4-trial sweep; interrupt and resume."""

import dataclasses
import importlib.util
import json
import logging
import os
import pickle
import re
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import run_fresh_python, tiny_overrides
from mlflow.tracking import MlflowClient
from ui_helpers import browser_or_skip, page_dom, ui_server

from fedray.platform.apps.cli import main
from fedray.platform.catalog import load_config
from fedray.platform.config import load_yaml
from fedray.platform.errors import ConfigError, Diverged
from fedray.platform.runtime import storage
from fedray.platform.tracking.mlflow_run import RunTracker
from fedray.platform.tracking.names import Metrics, RunKind, Tags, tag_filter
from fedray.sweeps.space import SPACES_DIR, check_space, load_space, trial_config
from fedray.sweeps.tune_sweep import (
    NOT_RUN_AGAIN,
    SWEEP_STATE,
    InterruptAfterTrials,
    SweepResult,
    _close_stopped_children,
    _scheduler,
    _TrialLines,
    all_trials_ended,
    best_row,
    failed_otherwise,
    is_divergence,
    point_key,
    prepare_base,
    remember_divergences,
    require_no_stopped_sweep,
    restored_tuner,
    run_sweep,
    run_trial,
    trial_status,
    trial_table,
    tune_key,
    tune_settings,
    unreported_metric,
)

ROOT = Path(__file__).resolve().parents[1]
SPACE_FILES = sorted(SPACES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", SPACE_FILES, ids=[p.stem for p in SPACE_FILES])
def test_shipped_space_parses_and_every_point_builds_a_config(path):
    space = load_space(path)
    base = load_yaml(ROOT / "configs" / "quickstart.yaml")
    base["algorithm"] = path.stem
    for point in space.grid_points() + space.sample_points(20):
        cfg = trial_config(base, point)
        for key, value in point.items():
            section, name = key.split(".")
            got = getattr(cfg.algo if section == cfg.algorithm else getattr(cfg, section), name)
            assert got == value or got == pytest.approx(value), key


def test_a_points_values_are_taken_as_given():
    # Tune may hand numpy numbers; a choice of text or null is that text or None, not re-read as YAML
    base = load_yaml(ROOT / "configs" / "quickstart.yaml")
    point = {"train.local_epochs": np.int64(2), "tracking.experiment": "007", "data.train_subset": None}
    cfg = trial_config(base, point)
    assert cfg.train.local_epochs == 2 and type(cfg.train.local_epochs) is int
    assert cfg.tracking.experiment == "007" and cfg.data.train_subset is None


def test_required_hyperparameters_are_in_the_spaces():
    keys = {p.stem: {param.key for param in load_space(p).params} for p in SPACE_FILES}
    assert {"fedssa.mu0", "fedssa.t_stable"} <= keys["fedssa"]
    assert {"fedcross.alpha", "fedcross.selection", "fedcross.num_middleware"} <= keys["fedcross"]
    assert {"fedl2g.server_lr", "fedl2g.variant"} <= keys["fedl2g"]
    assert {"fedsc.tau", "fedsc.neighbors"} <= keys["fedsc"]
    assert "fedprox.mu" in keys["fedprox"]
    assert {"scaffold.server_lr", "train.momentum"} <= keys["scaffold"]
    for algo in ("fedssa", "fedcross", "fedl2g", "fedsc", "fedprox", "scaffold"):
        assert {"train.lr", "train.local_epochs"} <= keys[algo], algo


@pytest.mark.parametrize(("search", "trials"), [("grid", 2 * 3 * 2), ("random", 2 * 3 * 2), ("optuna", 2)])
def test_the_trial_count_is_what_tune_runs_for_the_search(tmp_path, search, trials):
    """Grid and random search repeat the grid ``samples`` times; Optuna samples grid values like
    choices and runs ``samples`` trials in all (counted as more, a finished sweep closed as KILLED)."""
    path = tmp_path / "space.yaml"
    params = {
        "fedprox.mu": [0.0, 0.1],
        "train.lr": {"grid": [0.01, 0.05, 0.1]},
        "train.local_epochs": {"choice": [1, 2]},
    }
    path.write_text(yaml.safe_dump({"samples": 2, "params": params}))
    space = dataclasses.replace(load_space(path), search=search)  # optuna itself is not installed here
    assert space.num_trials() == trials


BAD_SPACES = [
    ({"fedprox.muu": {"grid": [0.1]}}, "unknown config key 'fedprox.muu'"),
    ({"fedprox.mu": {"choice": []}}, "choice needs a non-empty list"),
    ({"fedprox.mu": {"grid": [-1.0]}}, "fedprox.mu=-1.0"),
    ({"fedprox.mu": {"gaussian": [0, 1]}}, "unknown distribution 'gaussian'"),
    ({"train.lr": {"loguniform": [0.1, 0.01]}}, "low <= high"),
    ({"train.lr": {"randint": [1.5, "abc"]}}, "randint needs [low, high] as numbers, got [1.5, 'abc']"),
    ({"train.local_epochs": {"randint": [1, 2.5]}}, "randint needs [low, high] as integers"),
    ({"train.lr": {"quniform": [0.01, 0.1, 0]}}, "quniform needs a step > 0"),
    ({"train.lr": {"uniform": [0.01, True]}}, "uniform needs [low, high] as numbers"),
    # the ninth grid point (30 clients, 20 images) is the only bad one: every combination is checked
    (
        {"data.num_clients": {"grid": [10, 20, 30]}, "data.train_subset": {"grid": [1000, 500, 20]}},
        "data.train_subset=20: must be >= data.num_clients",
    ),
    # bad only at a range's end, which a handful of draws would almost never reach
    ({"fedprox.mu": {"uniform": [-0.001, 1.0]}}, "fedprox.mu=-0.001"),
    # another algorithm's valid key: the trials would not read it, and all be the same
    (
        {"fedcross.alpha": {"grid": [0.9, 0.99]}},
        "params.fedcross.alpha: the sweep runs fedprox, which does not",
    ),
]


def bad_space_file(tmp_path, params, name: str = "bad.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"search": "grid", "params": params}))
    return str(path)


@pytest.mark.parametrize(("params", "needle"), BAD_SPACES)
def test_invalid_space_fails_in_one_line(tmp_path, params, needle, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        run_sweep("fedprox", space_file=bad_space_file(tmp_path, params), overrides=tiny_overrides())
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / ".fedray").exists()


BAD_METRICS = [
    ("acc/globl", [], "'acc/globl': the rounds do not report it"),  # a platform name misspelt
    ("acc/personal_mean", ["eval.clients=selected"], "acc/personal_mean_selected"),  # renamed by eval.clients
    ("time/wall_s", [], "they report acc/personal_mean, "),  # once per run, not per round
]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"samples": "abc"}, "samples='abc': expected an integer"),
        ({"grace_rounds": 1.5}, "grace_rounds=1.5: expected an integer"),
        ({"samples": 0}, "samples=0: must be >= 1"),
        ({"metric": 5}, "metric=5: a per-round metric's name"),
    ],
)
def test_a_space_files_settings_fail_in_one_line(tmp_path, settings, needle):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({**settings, "params": {"fedprox.mu": [0.1]}}))
    with pytest.raises(ConfigError) as err:
        load_space(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("optuna") is not None, reason="optuna is installed here")
def test_an_optuna_search_without_optuna_fails_in_one_line_before_any_run_is_made(tmp_path, mlflow_store):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"search": "optuna", "params": {"fedprox.mu": [0.1]}}))
    with pytest.raises(ConfigError, match=r"search=optuna needs the optuna package"):
        run_sweep("fedprox", space_file=str(path), overrides=tiny_overrides())
    assert MlflowClient(mlflow_store).search_experiments(filter_string="name != 'Default'") == []


@pytest.mark.usefixtures("ray_session")
def test_a_sweep_whose_set_up_fails_closes_its_parent_run_failed(tmp_path, mlflow_store, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the view could not be saved")

    monkeypatch.setattr("fedray.sweeps.tune_sweep.save_sweep_view", broken)
    with pytest.raises(RuntimeError, match="the view could not be saved"):
        run_sweep("fedprox", space_file=_tiny_space(tmp_path), overrides=tiny_overrides(), name="broken")
    client = MlflowClient(mlflow_store)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [(r.data.tags.get(Tags.KIND), r.info.status) for r in runs] == [(RunKind.SWEEP, "FAILED")]


def test_resuming_a_finished_sweep_is_one_line_and_leaves_its_parent_run_finished(tmp_path, mlflow_store):
    from fedray.sweeps.tune_sweep import require_unfinished

    cfg = load_config(None, tiny_overrides())
    client = MlflowClient(mlflow_store)
    parent = client.create_run(client.create_experiment("sweeps")).info.run_id
    require_unfinished(cfg, parent, "sweep-x")  # running (an interrupted sweep's): resumable
    client.set_terminated(parent, "KILLED")
    require_unfinished(cfg, parent, "sweep-x")
    client.set_terminated(parent, "FINISHED")
    with pytest.raises(ConfigError, match=r"^--resume: the sweep sweep-x finished, every trial ended"):
        require_unfinished(cfg, parent, "sweep-x")
    assert client.get_run(parent).info.status == "FINISHED"
    with pytest.raises(ConfigError, match=r"^--resume: the sweep sweep-x's parent run nope is not in the"):
        require_unfinished(cfg, "nope", "sweep-x")  # another store than the sweep's


def test_a_new_sweep_under_the_name_of_a_stopped_one_is_one_line_and_leaves_it_resumable(
    tmp_path, mlflow_store
):
    """Starting the sweep's command again without --resume after a Ctrl-C would write over the state
    --resume reads (its parent run among it): refused before anything starts."""
    client = MlflowClient(mlflow_store)
    parent = client.create_run(client.create_experiment("quickstart")).info.run_id
    client.set_terminated(parent, "KILLED")
    cfg = load_config(None, tiny_overrides())
    state_file = Path(cfg.storage_path).resolve() / "sweeps" / "sweep-fedprox-quickstart" / SWEEP_STATE
    state_file.parent.mkdir(parents=True)
    state_file.write_text(json.dumps({"parent_run_id": parent, "algorithm": "fedprox", "diverged": {}}))
    before = state_file.read_bytes()
    with pytest.raises(
        ConfigError, match=r"^a sweep named sweep-fedprox-quickstart was stopped part way"
    ) as err:
        run_sweep("fedprox", space_file=_tiny_space(tmp_path), overrides=tiny_overrides())
    assert "\n" not in str(err.value) and "--resume" in str(err.value) and "--name" in str(err.value)
    assert state_file.read_bytes() == before
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [parent]  # no new parent run


@pytest.mark.parametrize(
    ("status", "refused"), [("RUNNING", True), ("KILLED", True), ("FINISHED", False), ("FAILED", False)]
)
def test_only_a_sweep_stopped_part_way_or_running_keeps_its_name(tmp_path, mlflow_store, status, refused):
    cfg = load_config(None, tiny_overrides())
    client = MlflowClient(mlflow_store)
    parent = client.create_run(client.create_experiment("sweeps")).info.run_id
    if status != "RUNNING":
        client.set_terminated(parent, status)
    state_file = tmp_path / SWEEP_STATE
    state_file.write_text(json.dumps({"parent_run_id": parent}))
    if refused:
        with pytest.raises(ConfigError, match=f"parent run {parent} is {status}"):
            require_no_stopped_sweep(cfg, state_file, "s")
    else:
        require_no_stopped_sweep(cfg, state_file, "s")
    state_file.write_text(json.dumps({"parent_run_id": "elsewhere"}))  # another store's: not resumable here
    require_no_stopped_sweep(cfg, state_file, "s")
    require_no_stopped_sweep(cfg, tmp_path / "none.json", "s")


@pytest.mark.parametrize(("metric", "overrides", "needle"), BAD_METRICS)
def test_a_platform_metric_the_rounds_do_not_report_fails_in_one_line(tmp_path, metric, overrides, needle):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"search": "grid", "metric": metric, "params": {"fedprox.mu": [0.1]}}))
    base = prepare_base(None, "fedprox", [*tiny_overrides(), *overrides])
    with pytest.raises(ConfigError) as err:
        check_space(load_space(path), base)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_algorithms_own_metric_passes_and_is_checked_against_what_the_trials_reported(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(
        yaml.safe_dump({"search": "grid", "metric": "loss/proxx", "params": {"fedprox.mu": [0.1]}})
    )
    space = load_space(path)
    check_space(space, prepare_base(None, "fedprox", tiny_overrides()))  # it may be fedprox's own
    # what a fedprox trial reports to Tune each round (tune_key: "/" -> "_"), and Tune's own fields
    results = [{"round": 2, "acc_global": 0.5, "loss_train": 1.2, "loss_prox": 0.01, "done": True}]
    error = unreported_metric(space, results, "all")
    assert "metric='loss/proxx': no trial reported it; they reported acc/global, loss/train" in str(error)
    assert unreported_metric(space, [{"round": 1, "loss_proxx": 0.1}], "all") is None
    # no round reported at all (every trial failed): the trials' errors say why, not the metric
    assert unreported_metric(space, [{}], "all") is None


def test_an_invalid_space_starts_no_ray(tmp_path):
    """In a fresh process (this one's Ray may already run for other tests)."""
    files = [bad_space_file(tmp_path, params, f"bad{i}.yaml") for i, (params, _) in enumerate(BAD_SPACES)]
    script = """
        import json, sys
        import psutil, ray
        from conftest import tiny_overrides
        from fedray.platform.errors import ConfigError, Diverged
        from fedray.sweeps.tune_sweep import run_sweep
        for space in json.loads(sys.argv[1]):
            try:
                run_sweep("fedprox", space_file=space, overrides=tiny_overrides())
            except ConfigError:
                pass
            else:
                raise AssertionError(space)
            assert not ray.is_initialized(), space
            assert psutil.Process().children(recursive=True) == [], space
        print("no Ray")
    """
    done = run_fresh_python(script, json.dumps(files), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["no", "Ray"], done.stderr[-2000:]
    assert not (tmp_path / ".fedray").exists()


def _tiny_space(tmp_path, mus=(0.0, 1.0)):
    path = tmp_path / "space.yaml"
    space = {
        "search": "grid",
        "scheduler": "none",
        "metric": Metrics.ACC_GLOBAL,
        "params": {"fedprox.mu": list(mus)},
    }
    path.write_text(yaml.safe_dump(space))
    return str(path)


def actor_classes() -> dict[str, str]:
    """Every actor this Ray has started, dead or alive, by id: its class's name. (Ray's public state
    API needs the dashboard, which the tests' Ray runs without.)"""
    from ray._private import state

    # Ray's table names Tune's trial class ImplicitFunc or wrap_function.<locals>.ImplicitFunc (both seen)
    return {actor: info["ActorClassName"].rsplit(".", 1)[-1] for actor, info in state.actors().items()}


@pytest.mark.usefixtures("ray_session")
def test_two_trial_sweep_lands_as_parent_and_children_and_a_trial_cut_short_resumes_in_its_run(
    tmp_path, mlflow_store, monkeypatch, capsys
):
    # the store named as a user often does, relative to where the sweep starts: the trials run in
    # their own directories, and must still log into this store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    before = set(actor_classes())
    rounds = 8
    overrides = tiny_overrides(rounds=rounds, checkpoint_every=1)

    # Ctrl-C (Tune's SIGUSR1) once the second trial's first round reaches Tune; its Coordinator may
    # run a round or two ahead before Tune stops it, and a checkpoint lands every round. The
    # processes are counted before: as Tune ends the trial's process, the ClientActors it owns die
    # with it, and the Coordinator, still in its round, may start replacements before it dies too
    started = []

    def interrupt(self, iteration, trials, trial, result, **info):
        if trial.config["fedprox.mu"] == 1.0 and result.get("round") == 1:
            started.extend(sorted(name for actor, name in actor_classes().items() if actor not in before))
            os.kill(os.getpid(), signal.SIGUSR1)

    with monkeypatch.context() as patch:
        patch.setattr(_TrialLines, "on_trial_result", interrupt)
        first = run_sweep("fedprox", space_file=_tiny_space(tmp_path), overrides=overrides)
    status = dict(zip(first.trials["fedprox.mu"], first.trials["status"], strict=True))
    cut_at = dict(zip(first.trials["fedprox.mu"], first.trials["rounds run"], strict=True))[1.0]
    assert status == {0.0: "ok", 1.0: "interrupted"} and cut_at < rounds, first.trials
    # the second trial ran in the first one's processes (Tune's reuse_actors and KeptRuntime): one
    # trial process, one Coordinator and two ClientActors started for both
    assert started == ["ClientActor", "ClientActor", "Coordinator", "ImplicitFunc"], started
    client = MlflowClient(mlflow_store)
    experiment = client.get_run(first.parent_run_id).info.experiment_id
    cut = client.search_runs(
        [experiment],
        filter_string=f"{tag_filter(Tags.PARENT_RUN_ID, first.parent_run_id)} and params.`fedprox.mu` = '1.0'",
    )
    assert [(c.info.status, Tags.STOPPED_EARLY in c.data.tags) for c in cut] == [("KILLED", False)]

    # the resume goes on with the cut trial from its checkpoint, in its run
    result = run_sweep("fedprox", space_file=_tiny_space(tmp_path), overrides=overrides, resume=True)
    assert len(result.trials) == 2 and set(result.trials["status"]) == {"ok"}
    # Tune's result files for its own resume, no TensorBoard files nor a command to read them
    assert len(list(result.path.rglob("result.json"))) == 2 and not list(result.path.rglob("events.out.*"))
    # the sweep's own lines only: none of Tune's configuration box, nor a command to read TensorBoard
    out = capsys.readouterr().out
    assert "TensorBoard" not in out and "Search algorithm" not in out and "View detailed results" not in out
    assert "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS" not in os.environ  # set for the fit only
    assert "TUNE_PRINT_ALL_TRIAL_ERRORS" not in os.environ and "RAY_AIR_NEW_OUTPUT" not in os.environ
    assert result.parent_run_id == first.parent_run_id
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags[Tags.KIND] == RunKind.SWEEP and parent.info.status == "FINISHED"
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=tag_filter(Tags.PARENT_RUN_ID, result.parent_run_id)
    )
    assert len(children) == 2 and cut[0].info.run_id in {c.info.run_id for c in children}
    assert sorted(float(c.data.params["fedprox.mu"]) for c in children) == [0.0, 1.0]
    for child in children:
        assert child.data.tags[Tags.SWEEP_ID] == result.path.name and child.info.status == "FINISHED"
        # ray.max_actors=2 reserves two ClientActor bundles, and the trial runs two workers in them
        assert child.data.tags[Tags.WORKERS] == "2" and child.data.tags[Tags.DEVICE] == "cpu"
        # every round logged once: the cut trial was not run again from round 0
        steps = [m.step for m in client.get_metric_history(child.info.run_id, Metrics.ACC_GLOBAL)]
        assert sorted(steps) == list(range(1, rounds + 1)), steps
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"best_config.yaml", "trials.csv", "search_space.yaml", "trial_curves.png"} <= artifacts
    best = result.trials.iloc[0]
    assert best[Metrics.ACC_GLOBAL] == max(result.trials[Metrics.ACC_GLOBAL])
    assert result.best_config["fedprox"]["mu"] == pytest.approx(best["fedprox.mu"])

    # the UI reads a sweep without opening files: trials named by their values, the parent's
    # description gives the space, the search and the best trial with its run
    assert sorted(c.info.run_name for c in children) == ["fedprox mu=0", "fedprox mu=1"]
    best_child = next(c for c in children if float(c.data.params["fedprox.mu"]) == best["fedprox.mu"])
    note = parent.data.tags[Tags.NOTE]
    assert "grid search over fedprox.mu grid [0.0, 1.0]" in note and "2 trials" in note
    assert f"Best trial: fedprox.mu={best['fedprox.mu']}" in note and best_child.info.run_id in note
    # a saved view of the runs page (experiment tag) that shows only this sweep, grouped by mu, and
    # the chart-view address that opens it
    key = parent.data.tags[Tags.UI_VIEW]
    view = json.loads(client.get_experiment(parent.info.experiment_id).tags[f"mlflow.sharedViewState.{key}"])
    state = json.loads(view["state"])
    assert state["searchFilter"] == f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    assert state["groupBy"]["groupByKeys"] == [{"mode": "param", "groupByData": "fedprox.mu"}]
    assert f"#/experiments/{parent.info.experiment_id}/runs?workflowType=machine_learning" in note
    assert f"viewStateShareKey={key}&compareRunsMode=CHART" in note

    # and the page applies it: the chart view groups the trials by mu, one group per value
    browser = browser_or_skip()
    chart = re.search(r"http://127\.0\.0\.1:5000/\S+CHART", note).group(0)
    with ui_server(mlflow_store, tmp_path) as (_, port):
        dom = page_dom(browser, chart.replace(":5000/", f":{port}/"), tmp_path / "profile")
    assert "Group by: fedprox.mu" in dom
    assert "Group: 0.0" in dom and "Group: 1.0" in dom
    assert "fedprox mu=0" in dom and "fedprox mu=1" in dom


@pytest.mark.usefixtures("ray_session")
def test_restart_errored_runs_a_failed_trial_again_from_round_0_in_a_new_run(
    tmp_path, mlflow_store, monkeypatch
):
    """A real Tune sweep where one trial's run fails in its second round (every client's error while
    a marker file exists: a disk gone, say). Once the cause is gone, ``--resume --restart-errored``
    runs that trial again from round 0 under a new run, its failed run stays FAILED, and the trial
    that finished is not run again."""
    import killer_algorithm

    from fedray.sweeps import tune_sweep

    monkeypatch.setattr(tune_sweep, "run_trial", killer_algorithm.run_trial)  # trials know fedavg_killer
    marker = tmp_path / "disk-gone"
    marker.write_text("")
    rounds = 3
    extra = {"fedavg_killer.stage": "fail_while", "fedavg_killer.marker": str(marker), "checkpoint_every": 1}
    # one ClientActor a trial: each of the three trials starts its own processes (the failed one's are
    # not trusted with the next trial), three fewer to import torch on a loaded machine
    overrides = tiny_overrides(algorithm="fedavg_killer", rounds=rounds, **extra, **{"ray.max_actors": 1})
    space = tmp_path / "space.yaml"
    params = {"fedavg_killer.round": [1, 99]}  # round 1 (0-based): after a checkpoint; 99: never
    space.write_text(
        yaml.safe_dump(
            {"search": "grid", "scheduler": "none", "metric": Metrics.ACC_GLOBAL, "params": params}
        )
    )

    first = run_sweep("fedavg_killer", space_file=str(space), overrides=overrides)
    status = dict(zip(first.trials["fedavg_killer.round"], first.trials["status"], strict=True))
    assert status == {1: "error", 99: "ok"}, first.trials
    marker.unlink()  # the cause fixed
    again = run_sweep(
        "fedavg_killer", space_file=str(space), overrides=overrides, resume=True, restart_errored=True
    )
    assert len(again.trials) == 2 and set(again.trials["status"]) == {"ok"}, again.trials

    client = MlflowClient(mlflow_store)
    experiment = client.get_run(first.parent_run_id).info.experiment_id
    children = client.search_runs(
        [experiment], filter_string=tag_filter(Tags.PARENT_RUN_ID, first.parent_run_id)
    )
    runs = sorted((int(c.data.params["fedavg_killer.round"]), c.info.status, c.info.run_id) for c in children)
    assert [r[:2] for r in runs] == [(1, "FAILED"), (1, "FINISHED"), (99, "FINISHED")], runs
    steps = {r[1:]: [m.step for m in client.get_metric_history(r[2], Metrics.ACC_GLOBAL)] for r in runs}
    failed, restarted, finished = (steps[r[1:]] for r in runs)
    assert failed == [1]  # its first round logged, its second failed
    assert sorted(restarted) == list(range(1, rounds + 1))  # from round 0, every round once
    assert sorted(finished) == list(range(1, rounds + 1))  # not run again


@pytest.mark.usefixtures("ray_session")
def test_an_asha_sweep_closes_stopped_trials_as_killed_and_resumes_without_redoing_any(
    tmp_path, mlflow_store, capsys, monkeypatch
):
    # one trial at a time: lr=0.1 runs its 2 rounds; lr=1e-4 is far behind it after round 1, so ASHA
    # (grace 1 round, halving) stops it there, in the first trial's reused process; the third trial
    # starts in that process only once the stopped one has closed its run, and diverges in its first
    # round; then Ctrl-C (an interrupt right after the stopped trial would race its closing); the
    # resumes never run the diverged one again (it would diverge again), nor start a process for it:
    # no other trial failed, so Tune resumes none of the failed ones. (When one failed otherwise,
    # Tune resumes them all and the diverged one ends at once: the unit tests of restored_tuner and
    # run_trial, without Ray; a Tune trial's error cleared by an interrupted resume: the table's.)
    path = tmp_path / "space.yaml"
    exploding = 1e30
    lrs = [0.1, 0.0001, exploding, 0.05, 0.08]
    space = {"search": "grid", "scheduler": "asha", "grace_rounds": 1, "metric": Metrics.ACC_GLOBAL}
    path.write_text(yaml.safe_dump({**space, "params": {"train.lr": lrs}}))
    overrides = tiny_overrides(rounds=2)
    before = set(actor_classes())
    first = run_sweep(
        "fedavg", space_file=str(path), overrides=overrides, max_concurrent=1, stop_after_trials=3
    )
    rounds = dict(zip(first.trials["train.lr"], first.trials["rounds run"], strict=True))
    assert len(rounds) == 3 and rounds[0.1] == 2 and rounds[0.0001] == 1
    status = dict(zip(first.trials["train.lr"], first.trials["status"], strict=True))
    assert status == {0.1: "ok", 0.0001: "stopped early", exploding: "diverged"}, status
    trial = dict(zip(first.trials["train.lr"], first.trials["trial"], strict=True))
    lines = capsys.readouterr().out.splitlines()
    assert f"trial {trial[0.1]} finished after 2 rounds: acc_global=" in "\n".join(lines), lines
    assert f"trial {trial[0.0001]} stopped early by the scheduler after 1 round: " in "\n".join(lines), lines
    assert f"trial {trial[exploding]} diverged after 0 rounds: acc_global=-; round 1: training diverged" in (
        "\n".join(lines)
    ), lines
    assert not [line for line in lines if "errored after" in line or "Error file" in line], lines  # Tune's
    # the stopped trial's Coordinator was halted between rounds and its processes served the third
    # trial: one trial process, one Coordinator and two ClientActors for all three
    started = sorted(name for actor, name in actor_classes().items() if actor not in before)
    assert started == ["ClientActor", "ClientActor", "Coordinator", "ImplicitFunc"], started
    client = MlflowClient(mlflow_store)
    assert client.get_run(first.parent_run_id).info.status == "KILLED"

    # a resume stopped as it starts (Tune's stop, as a Ctrl-C, before any trial ran): the diverged
    # trial is still one
    with monkeypatch.context() as patch:
        patch.setattr(_TrialLines, "setup", lambda self, *a, **info: os.kill(os.getpid(), signal.SIGUSR1))
        interrupted = run_sweep("fedavg", space_file=str(path), overrides=overrides, resume=True)
    assert "started" not in capsys.readouterr().out
    status = dict(zip(interrupted.trials["train.lr"], interrupted.trials["status"], strict=True))
    assert status[exploding] == "diverged", status
    assert client.get_run(first.parent_run_id).info.status == "KILLED"

    # a resume with a budget of its own (a job's time limit), one trial: lr=0.05; the diverged one
    # neither starts nor counts
    error_before = next(first.path.glob(f"*{trial[exploding]}*/error.txt")).read_text()
    resumed = run_sweep("fedavg", space_file=str(path), overrides=overrides, resume=True, stop_after_trials=1)
    out = capsys.readouterr().out
    assert re.findall(r"^trial \S+ started \(1 running\): (.*)$", out, re.M) == ["train.lr=0.05"], out
    assert len(re.findall(r"^trial \S+ (finished|stopped early) ", out, re.M)) == 1, out
    assert not re.findall(rf"^trial {trial[exploding]} ", out, re.M), out
    assert client.get_run(first.parent_run_id).info.status == "KILLED"
    assert resumed.parent_run_id == first.parent_run_id
    children = client.search_runs(
        [client.get_run(first.parent_run_id).info.experiment_id],
        filter_string=tag_filter(Tags.PARENT_RUN_ID, first.parent_run_id),
    )
    by_lr = {float(c.data.params["train.lr"]): c for c in children}
    # each trial ran once (none was redone, the diverged one neither), and the budget left lr=0.08
    assert sorted(by_lr) == sorted([0.1, 0.0001, exploding, 0.05]) and len(children) == 4, sorted(by_lr)
    # the resumed sweep still says how each trial ended, and Tune still kept its result files
    status = dict(zip(resumed.trials["train.lr"], resumed.trials["status"], strict=True))
    assert status[0.1] == "ok" and status[0.0001] == "stopped early", status
    assert status[exploding] == "diverged" and by_lr[exploding].info.status == "FAILED", status
    (error_file,) = resumed.path.glob(f"*{trial[exploding]}*/error.txt")
    assert error_file.read_text() == error_before and NOT_RUN_AGAIN not in error_before
    assert len(list(resumed.path.rglob("result.json"))) == 4
    # the trial that ran its rounds finished (its last round reached Tune after the run was closed);
    # the one ASHA stopped is closed as KILLED, tagged, with the one round it ran
    assert by_lr[0.1].info.status == "FINISHED" and Tags.STOPPED_EARLY not in by_lr[0.1].data.tags
    stopped = by_lr[0.0001]
    assert stopped.info.status == "KILLED" and stopped.data.tags[Tags.STOPPED_EARLY] == "true"
    assert Metrics.TIME_WALL_S in stopped.data.metrics  # closed by its own run, not by the sweep after it
    assert [m.step for m in client.get_metric_history(stopped.info.run_id, Metrics.ACC_GLOBAL)] == [1]


@pytest.mark.parametrize(
    ("metrics", "error", "point", "status"),
    [
        ({"round": 5, "done": True}, None, {}, "ok"),
        ({"round": 3, "done": True}, None, {}, "stopped early"),  # Tune counts a stopped trial as done
        ({"round": 3, "done": True}, None, {"rounds": 3}, "ok"),  # the space sweeps the rounds
        ({"round": 3}, None, {}, "interrupted"),
        # its last round reported, Tune's done flag not in the results a loaded resume restored
        ({"round": 5}, None, {}, "ok"),
        ({"round": 5, "done": True}, RuntimeError("x"), {}, "error"),
        # what Tune keeps of a run that stopped on Diverged: its line, in the trial's error
        (
            {"round": 2},
            RuntimeError("RunAborted: round 3: training diverged, the training loss ..."),
            {},
            "diverged",
        ),
    ],
)
def test_a_trial_status_says_how_it_ended(metrics, error, point, status):
    assert trial_status(metrics, error, 5, point) == status


def test_a_sweep_is_over_when_every_trial_ended_by_the_trial_tables_rule():
    def trial(metrics, error=None, config=None):
        return SimpleNamespace(metrics=metrics, error=error, config=config)

    # a resumed trial whose last round is in its results but Tune's done flag is not: over (the parent
    # run FINISHED, as its table says "ok"), not KILLED
    done = [trial({"round": 5, "done": True}), trial({"round": 5})]
    assert all_trials_ended(done, 5, 2)
    assert not all_trials_ended([trial({"round": 5}), trial({"round": 3})], 5, 2)  # interrupted
    assert all_trials_ended([trial({"round": 3, "done": True}), trial({}, RuntimeError("x"))], 5, 2)
    assert not all_trials_ended(done[:1], 5, 2)  # a trial never started
    assert all_trials_ended([trial({"round": 3}, config={"rounds": 3})], 5, 1)  # the space sweeps rounds


def test_the_trial_table_keeps_each_value_as_the_trial_had_it(tmp_path):
    # a trial an interrupt left unstarted reports nothing: its row has no values, and the others'
    # integers stay integers (pandas would make the column float, and the best config num_middleware=5.0)
    space = load_space(_tiny_space(tmp_path))
    done = {"round": 5, "done": True}
    results = [
        SimpleNamespace(
            config={"k": 5, "lr": 0.1}, metrics={**done, "acc_global": 0.5}, error=None, path="/t/a"
        ),
        SimpleNamespace(config=None, metrics=None, error=None, path="/t/b"),
        SimpleNamespace(
            config={"k": 7, "lr": 0.2}, metrics={**done, "acc_global": 0.8}, error=None, path="/t/c"
        ),
    ]
    table = trial_table(results, space, base_rounds=5)
    assert list(table["trial"]) == ["c", "a", "b"]  # best first, the unreported last
    assert list(table["k"])[:2] == [7, 5] and all(type(k) is int for k in list(table["k"])[:2])
    assert table["k"][2] is None and table["rounds run"][2] is None
    assert list(table["status"]) == ["ok", "ok", "interrupted"]
    assert best_row(table, space.metric)["trial"] == "c"


def test_a_failed_trial_is_never_the_best_whatever_its_last_value():
    # a high learning rate's trial may report a good round before it diverges: its last value is
    # not its result, so it goes after the trials that ended and is not the best
    space = SimpleNamespace(metric=Metrics.ACC_GLOBAL, mode="max")
    done = {"round": 5, "done": True}
    diverged = RuntimeError("round 4: training diverged, ...")
    results = [
        SimpleNamespace(config={"lr": 0.1}, metrics={**done, "acc_global": 0.6}, error=None, path="/t/ok"),
        SimpleNamespace(
            config={"lr": 9.0}, metrics={"round": 3, "acc_global": 0.9}, error=diverged, path="/t/d"
        ),
        SimpleNamespace(
            config={"lr": 1.0}, metrics={"round": 2, "acc_global": 0.7}, error=OSError("x"), path="/t/e"
        ),
    ]
    table = trial_table(results, space, base_rounds=5)
    assert list(table["trial"]) == ["ok", "d", "e"]
    assert list(table["status"]) == ["ok", "diverged", "error"]
    assert best_row(table, space.metric)["trial"] == "ok"
    assert best_row(table.iloc[1:].reset_index(drop=True), space.metric) is None  # no trial has a result


def test_a_sweep_remembers_its_diverged_trials_by_folder_with_their_own_line(tmp_path):
    # what Tune keeps of a trial's error: a remote traceback whose last line is the run's, after its
    # class's name. A trial that failed otherwise (even on a client's error that mentions the words)
    # runs again on a resume; one resumed once already raised its line and NOT_RUN_AGAIN
    tune_error = "Traceback (most recent call last):\n  ...\n"
    line = "round 1: training diverged, the training loss is not finite on any of the 4 clients"
    client_error = "round 2: all 4 selected clients failed (client 0: ValueError: training diverged)"

    def result(folder, error):
        return SimpleNamespace(path=f"/s/{folder}", error=None if error is None else RuntimeError(error))

    first = [
        result("t0", f"{tune_error}fedray.platform.runtime.session.RunAborted: {line}"),
        result("t1", f"{tune_error}OSError: disk full"),
        result("t2", f"{tune_error}fedray.platform.errors.RoundFailed: {client_error}"),
        result("t3", None),
    ]
    known = remember_divergences({}, first)
    assert known == {"t0": line}
    assert [trial_status({}, r.error, 2, {}) for r in first[:3]] == ["diverged", "error", "error"]
    # the first resume: t0 raised its line again; the second (its state file's map): the same map
    resumed = [result("t0", f"{tune_error}fedray.platform.errors.Diverged: {line}{NOT_RUN_AGAIN}")]
    assert remember_divergences(known, resumed) == {"t0": line}
    assert remember_divergences({}, resumed) == {"t0": line}  # a state without the map: Tune's line
    # a resume interrupted before t0 ended again: Tune holds it as pending, without its error; the
    # state still names it, and the sweep's table says it diverged (not interrupted, not the best)
    pending = [
        SimpleNamespace(
            config={"lr": 1e30}, metrics={"round": 1, "acc_global": 0.9}, error=None, path="/s/t0"
        ),
        SimpleNamespace(
            config={"lr": 0.1},
            metrics={"round": 2, "acc_global": 0.5, "done": True},
            error=None,
            path="/s/t3",
        ),
    ]
    assert remember_divergences(known, pending) == known
    space = SimpleNamespace(metric="acc_global", mode="max")
    table = trial_table(pending, space, base_rounds=2, diverged=known)
    assert list(table["status"]) == ["ok", "diverged"] and best_row(table, "acc_global")["trial"] == "t3"
    assert list(trial_table(pending, space, base_rounds=2)["status"]) == ["interrupted", "ok"]


def test_a_trial_restored_without_values_is_listed_with_those_it_started_with():
    # Tune's results give no values for a trial that never reported (it failed in its first round,
    # was not started before an interrupt, or is pending in an interrupted resume): the table takes
    # them from Tune's experiment state, by folder
    results = [
        SimpleNamespace(config=None, metrics={}, error=RuntimeError("OSError: x"), path="/s/run_trial_a_2"),
        SimpleNamespace(config={}, metrics={}, error=None, path="/s/run_trial_a_3"),
        SimpleNamespace(config=None, metrics={}, error=None, path="/s/not_in_the_state"),
    ]
    configs = {"run_trial_a_2": {"lr": 1e30, "epochs": 2}, "run_trial_a_3": {"lr": 0.1, "epochs": 1}}
    space = SimpleNamespace(metric="acc_global", mode="max")
    table = trial_table(results, space, base_rounds=2, configs=configs).set_index("trial")
    assert table.loc["run_trial_a_2", ["lr", "epochs", "status"]].tolist() == [1e30, 2, "error"]
    assert table.loc["run_trial_a_3", ["lr", "epochs", "status"]].tolist() == [0.1, 1, "interrupted"]
    assert table.loc["not_in_the_state", "lr"] is None


def test_a_resume_runs_failed_trials_again_only_when_one_failed_otherwise_than_diverging():
    def result(folder, error):
        return SimpleNamespace(path=f"/s/{folder}", error=None if error is None else RuntimeError(error))

    diverged = {"t0": "round 1: training diverged, ..."}
    assert not failed_otherwise([result("t0", "Diverged: ..."), result("t1", None)], diverged)
    assert failed_otherwise([result("t0", "Diverged: ..."), result("t2", "OSError: disk full")], diverged)
    assert not failed_otherwise([], diverged)


def test_a_resume_asks_tune_to_run_failed_trials_again_only_when_one_failed_otherwise(monkeypatch):
    from ray import tune

    asked = []
    monkeypatch.setattr(tune.Tuner, "restore", lambda path, trainable, **kw: asked.append(kw))

    def result(folder, error):
        return SimpleNamespace(path=f"/s/{folder}", error=None if error is None else RuntimeError(error))

    diverged = {"t0": "round 1: training diverged, ..."}
    diverged_only = [result("t0", "Diverged: ..."), result("t1", None)]
    failed = [result("t0", "Diverged: ..."), result("t2", "OSError")]
    restored_tuner(Path("/s"), run_trial, diverged_only, diverged)
    restored_tuner(Path("/s"), run_trial, failed, diverged)
    # --restart-errored: from round 0, and still only when a trial failed otherwise than diverging
    restored_tuner(Path("/s"), run_trial, diverged_only, diverged, restart=True)
    restored_tuner(Path("/s"), run_trial, failed, diverged, restart=True)
    assert asked == [
        {"resume_errored": False, "restart_errored": False},
        {"resume_errored": True, "restart_errored": False},
        {"resume_errored": False, "restart_errored": False},
        {"resume_errored": False, "restart_errored": True},
    ]


def test_a_trial_that_diverged_before_ends_before_its_run_when_tune_resumes_it(monkeypatch):
    # Tune resumes every failed trial when one failed otherwise: the diverged one raises its first
    # run's line at once, before a config is built or a run opened (base={} would fail to build)
    from ray import tune

    line = "round 1: training diverged, the training loss is not finite on any of the 4 clients"
    folder = "run_trial_a_2_train_lr=1e30"
    context = SimpleNamespace(get_trial_dir=lambda: f"/s/sweep/{folder}")
    monkeypatch.setattr(tune, "get_context", lambda: context)
    with pytest.raises(Diverged) as raised:
        run_trial({"train.lr": 1e30}, base={}, parent_run_id="p", sweep_id="s", diverged={folder: line})
    assert str(raised.value) == line + NOT_RUN_AGAIN and is_divergence(str(raised.value))
    # --restart-errored: Tune restarts it too, under a new folder; its values name it
    restarted = SimpleNamespace(get_trial_dir=lambda: "/s/sweep/run_trial_b_0_train_lr=1e30")
    monkeypatch.setattr(tune, "get_context", lambda: restarted)
    points = {point_key({"train.lr": 1e30}): line}
    with pytest.raises(Diverged) as raised:
        run_trial({"train.lr": 1e30}, base={}, parent_run_id="p", sweep_id="s", diverged_points=points)
    assert str(raised.value) == line + NOT_RUN_AGAIN


@pytest.fixture
def trial_without_ray(monkeypatch, tmp_path):
    """run_trial as Tune calls it, without Ray: what it reports, and how it ran (fresh, continued)."""
    import ray.util
    from ray import tune

    from fedray.platform.runtime.processes import KeptRuntime
    from fedray.sweeps import tune_sweep

    context = SimpleNamespace(get_trial_dir=lambda: "/s/sweep/t0", get_trial_id=lambda: "t0")
    monkeypatch.setattr(tune, "get_context", lambda: context)
    reported, ran = [], []
    monkeypatch.setattr(tune, "report", reported.append)
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)
    monkeypatch.setattr(KeptRuntime, "keep_between_trials", lambda: None)
    for key in ("MLFLOW_TRACKING_URI", "TUNE_FUNCTION_THREAD_TIMEOUT_S"):  # run_trial sets them
        monkeypatch.setenv(key, os.environ.get(key, ""))
    history = [{Metrics.ACC_GLOBAL: 0.1 * (r + 1)} for r in range(3)]

    def run(cfg, tags, on_round, trial, logged=3):  # a run whose rounds up to `logged` were logged before
        for rnd in range(logged + 1, 4):
            on_round(rnd, history[rnd - 1])
        return SimpleNamespace(finished=True, history=history)

    monkeypatch.setattr(
        tune_sweep, "run_experiment", lambda cfg, **kw: ran.append("fresh") or run(cfg, logged=0, **kw)
    )
    monkeypatch.setattr(
        tune_sweep, "resume_experiment", lambda run_id, **kw: ran.append(run_id) or run(None, **kw)
    )
    base = prepare_base(None, "fedavg", tiny_overrides(rounds=3))

    def earlier(status, checkpoint=True):
        folder = tmp_path / f"run-{status}-{checkpoint}"
        if checkpoint:
            storage.save_torch({"history": history}, str(folder / "checkpoint.pt"))
        tags = {Tags.CHECKPOINT_DIR: str(folder)}
        # MLflow keeps each metric's value at its last step
        found = SimpleNamespace(
            info=SimpleNamespace(status=status, run_id=f"r-{status}"),
            data=SimpleNamespace(tags=tags, metrics={**history[-1], Metrics.TIME_WALL_S: 9.0}),
        )
        monkeypatch.setattr(tune_sweep, "earlier_run", lambda cfg, parent, trial: found)

    def trial(resumed=True, restart_errored=False):
        reported.clear(), ran.clear()
        run_trial(
            {"train.lr": 0.1},
            base=base,
            parent_run_id="p",
            sweep_id="s",
            resumed=resumed,
            restart_errored=restart_errored,
        )
        return ran, [r["round"] for r in reported], reported[-1][tune_key(Metrics.ACC_GLOBAL)]

    return earlier, trial


def test_a_resumed_trial_tells_tune_its_last_round_whenever_its_run_logged_it(trial_without_ray):
    earlier, trial = trial_without_ray
    # a first run: every round reaches Tune, the last once its run is closed
    assert trial(resumed=False) == (["fresh"], [1, 2, 3], pytest.approx(0.3))
    # cut short after its last round's checkpoint (closing the run, logging its models): it goes on
    # in its run, which logged every round before; Tune hears the last from the run's result
    earlier("KILLED")
    assert trial() == (["r-KILLED"], [3], pytest.approx(0.3))
    # its run finished before Tune heard its last round: that round, from MLflow, and no run (with a
    # checkpoint or without one: checkpoint_every=0)
    earlier("FINISHED")
    assert trial() == ([], [3], pytest.approx(0.3))
    earlier("FINISHED", checkpoint=False)
    assert trial() == ([], [3], pytest.approx(0.3))
    # cut short before its first checkpoint: it starts again
    earlier("KILLED", checkpoint=False)
    assert trial() == (["fresh"], [1, 2, 3], pytest.approx(0.3))


def test_a_failed_trial_continues_from_its_checkpoint_or_with_restart_errored_starts_again(
    trial_without_ray,
):
    earlier, trial = trial_without_ray
    earlier("FAILED")  # its code raised after its last checkpoint (then fixed, or a node came back)
    assert trial() == (["r-FAILED"], [3], pytest.approx(0.3))  # as `fedray run --resume` of a failed run
    # --restart-errored: its checkpoints are the failing code's, so it runs from round 0, in a new run
    assert trial(restart_errored=True) == (["fresh"], [1, 2, 3], pytest.approx(0.3))
    # a trial the interruption cut short, or one that finished, is not a failed one
    earlier("KILLED")
    assert trial(restart_errored=True) == (["r-KILLED"], [3], pytest.approx(0.3))
    earlier("FINISHED")
    assert trial(restart_errored=True) == ([], [3], pytest.approx(0.3))


def test_a_failed_trial_says_to_resume_its_sweep_and_a_failed_run_itself():
    from fedray.platform.runtime.session import RunSession

    cfg = load_config(None, tiny_overrides())
    trial, run = RunSession(cfg, None, parent_run_id="p"), RunSession(cfg, None, parent_run_id=None)
    run.tracker = trial.tracker = SimpleNamespace(run_id="r1")  # type: ignore[assignment]
    assert trial.resume_advice() == (
        "resume the sweep with its command and --resume (add --restart-errored to start its failed "
        "trials again from round 0)"
    )
    assert run.resume_advice() == "resume with  fedray run --resume r1"
    # a trial stopped by a tracking outage is continued by the resume, not restarted
    assert trial.resume_advice(failed=False) == "resume the sweep with its command and --resume"
    assert run.resume_advice(how="resume from the last checkpoint with").endswith(
        "with  fedray run --resume r1"
    )


def test_a_stop_after_trials_limit_is_the_fits_own_and_holds_for_a_restored_callback(monkeypatch):
    # Tune restores a resumed sweep's callbacks as pickled: the limit is read from the class, for
    # the fit it is set for, the count starts again at every fit (setup), and a trial that diverged
    # before (which the resume ends at once) is not one of the fit's trials
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    restored = pickle.loads(pickle.dumps(InterruptAfterTrials()))
    trial = SimpleNamespace(path="/s/sweep/run_trial_a_1", config={"train.lr": 0.1})
    restored.setup()
    for _ in range(3):  # a fit without the option: no interrupt
        restored.on_trial_complete(0, [], trial)
    assert kills == []
    with InterruptAfterTrials.limited(2, skip={"run_trial_a_0"}):
        restored.setup()
        restored.on_trial_error(0, [], SimpleNamespace(path="/s/sweep/run_trial_a_0"))  # diverged before
        restored.on_trial_error(0, [], trial)  # a trial that failed now counts as ended
        assert kills == []
        restored.on_trial_complete(0, [], trial)
        assert kills == [signal.SIGUSR1]  # Tune's stop, whether or not it took over SIGINT
        restored.on_trial_complete(0, [], trial)  # once only
    assert kills == [signal.SIGUSR1] and InterruptAfterTrials.limit is None
    # after --restart-errored a diverged trial has a new folder: its values are skipped instead
    restarted = SimpleNamespace(path="/s/sweep/run_trial_b_0", config={"train.lr": 1e30})
    with InterruptAfterTrials.limited(1, skip_points={point_key({"train.lr": 1e30})}):
        restored.setup()
        restored.on_trial_error(0, [], restarted)
        assert kills == [signal.SIGUSR1]
        restored.on_trial_complete(0, [], trial)
        assert kills == [signal.SIGUSR1, signal.SIGUSR1]


def test_a_resume_refuses_what_it_cannot_do_before_ray_starts(tmp_path, monkeypatch):
    # a sweep started by an older fedray has no stop-after-trials callback for Tune to restore, and
    # Tune takes its stop signal in the main thread only: each a one-line error, before Ray
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "fedray.sweeps.tune_sweep.ensure_ray", lambda cfg: pytest.fail("Ray started before the error")
    )
    folder = tmp_path / ".fedray" / "sweeps" / "old"
    folder.mkdir(parents=True)
    (folder / "fedray_sweep.json").write_text(json.dumps({"parent_run_id": "x", "tune_loggers": "explicit"}))
    monkeypatch.setattr("ray.tune.Tuner.can_restore", lambda path: path == str(folder))
    args = {"space_file": _tiny_space(tmp_path), "overrides": tiny_overrides(), "name": "old"}
    with pytest.raises(ConfigError, match=r"^--stop-after-trials: this sweep was started by an older fedray"):
        run_sweep("fedprox", resume=True, stop_after_trials=2, **args)
    with pytest.raises(ConfigError, match=r"^--restart-errored: only with --resume"):
        run_sweep("fedprox", restart_errored=True, **args)
    errors = []

    def in_a_thread():
        try:
            run_sweep("fedprox", stop_after_trials=2, **args)
        except ConfigError as err:
            errors.append(str(err))

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join(timeout=60)
    assert errors == ["--stop-after-trials: run the sweep in the main thread (Tune's stop signal)"]
    # through Ray Client Tune runs the sweep in an actor on the cluster, out of the limit's reach
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(
        ConfigError, match=r"^--stop-after-trials: not through Ray Client \(ray://head:10001\)"
    ):
        run_sweep("fedprox", stop_after_trials=2, **args)


def test_trial_lines_restored_from_an_older_sweep_say_finished(capsys, tmp_path):
    # Tune restores a resumed sweep's callbacks as pickled: one from before `rounds` existed lacks it
    old = _TrialLines.__new__(_TrialLines)
    old.__dict__.update(metric="acc_global", running=1, max_running=1)  # max_running: gone since
    trial = SimpleNamespace(trial_id="t1", last_result={"round": 3, "acc_global": 0.5}, config={})
    old.on_trial_complete(0, [], trial)
    assert capsys.readouterr().out == "trial t1 finished after 3 rounds: acc_global=0.5000\n"
    # a trial whose run diverged says so, one that crashed that it failed, each with its error's
    # line (fedray's own without its class name) and where its traceback stays (Tune prints none);
    # the diverged one is in the sweep's state at once, by its folder, with its line
    error_file = tmp_path / "error.txt"  # as Tune writes it, in Ray's session folder
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "fedray_sweep.json").write_text(json.dumps({"parent_run_id": "p", "diverged": {}}))
    diverged = "round 4: training diverged, the training loss is not finite"
    for folder, error, how, line in (
        ("t1", f"fedray.platform.runtime.session.RunAborted: {diverged}", "diverged", diverged),
        ("t2", "OSError: disk full", "FAILED", "OSError: disk full"),
    ):
        error_file.write_text(
            f"Failure # 1 (occurred at before)\nKeyError: 'x'\nFailure # 2 (now)\n  ...\n{error}\n"
        )
        kept = sweep / folder  # the trial's folder in the sweep's storage
        old.on_trial_error(0, [], SimpleNamespace(**vars(trial), error_file=str(error_file), path=str(kept)))
        assert capsys.readouterr().out == (
            f"trial t1 {how} after 3 rounds: acc_global=0.5000; {line}; traceback: {kept / 'error.txt'}\n"
        )
    state = json.loads((sweep / "fedray_sweep.json").read_text())
    assert state == {"parent_run_id": "p", "diverged": {"t1": diverged}}


def test_tune_prints_no_line_the_sweep_says_better_and_only_during_the_fit(caplog):
    # Tune's resume hint is its Python call (the sweep prints its own command) and its list of
    # trials that did not complete repeats the sweep's table; its other warnings still show
    tune_logger = logging.getLogger("ray.tune.tune")
    lines = [
        "Experiment has been interrupted, but the most recent state was saved.\nResume experiment with: Tuner.restore(...)",
        "Trials did not complete: [run_trial_a_00002]",
        "Stop signal received (e.g. via SIGINT/Ctrl+C), ending Ray Tune run.",
    ]
    with caplog.at_level(logging.WARNING, logger="ray.tune"), tune_settings(own_loggers=True):
        for line in lines:
            tune_logger.warning(line)
    assert [r.getMessage() for r in caplog.records] == lines[2:]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray.tune"):
        tune_logger.warning(lines[1])  # outside a sweep's fit: Tune's as it is
    assert [r.getMessage() for r in caplog.records] == lines[1:2]


def test_asha_lets_a_trial_run_the_most_rounds_the_space_gives(tmp_path):
    # ASHA stops every trial at max_t: the base config's 2 rounds would cut a 4-round trial at 2
    path = tmp_path / "rounds.yaml"
    path.write_text(
        yaml.safe_dump({"metric": Metrics.ACC_GLOBAL, "grace_rounds": 1, "params": {"rounds": [2, 4]}})
    )
    space = load_space(str(path))
    assert space.largest("rounds", 2) == 4 and space.largest("train.lr", 0.1) == 0.1
    assert _scheduler(space, base_rounds=2)._max_t == 4
    path.write_text(
        yaml.safe_dump({"metric": Metrics.ACC_GLOBAL, "grace_rounds": 1, "params": {"train.lr": [0.1]}})
    )
    assert _scheduler(load_space(str(path)), base_rounds=6)._max_t == 6  # rounds not swept: the base's


def test_the_sweep_command_names_the_best_trial_by_every_swept_key(tmp_path, monkeypatch, capsys):
    # a top-level key ("rounds") as well as a dotted one
    table = pd.DataFrame(
        [{"rounds": 4, "train.lr": 0.1, Metrics.ACC_GLOBAL: 0.3, "status": "ok", "trial": "t1"}], dtype=object
    )
    best = {"rounds": 4, "train": {"lr": 0.1}}
    done = SweepResult("parent", table, best, tmp_path / "sweep-x", ["rounds", "train.lr"])
    asked = []
    monkeypatch.setattr("fedray.sweeps.tune_sweep.run_sweep", lambda *a, **k: asked.append(k) or done)
    assert main(["sweep", "--algo", "fedavg"]) == 0
    assert "best trial: rounds=4, train.lr=0.1\n" in capsys.readouterr().out
    assert main(["sweep", "--algo", "fedavg", "--resume", "--restart-errored"]) == 0
    assert [(k["resume"], k["restart_errored"]) for k in asked] == [(False, False), (True, True)]
    capsys.readouterr()
    # the table shows the swept values to six digits, however small or large; the results rounded;
    # the best trial's line gives its values whole
    table.loc[0, "train.lr"] = 0.073482917
    table.loc[1] = {"rounds": 2, "train.lr": 0.0001, Metrics.ACC_GLOBAL: 0.25, "status": "ok", "trial": "t2"}
    table.loc[2] = {
        "rounds": 2,
        "train.lr": 1e30,
        Metrics.ACC_GLOBAL: None,
        "status": "diverged",
        "trial": "t3",
    }
    assert main(["sweep", "--algo", "fedavg"]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()]
    assert [c[:3] for c in cells if len(c) == 5] == [
        ["4", "0.0734829", "0.30"],
        ["2", "0.0001", "0.25"],
        ["2", "1e+30", "-"],
    ]
    assert "best trial: rounds=4, train.lr=0.073482917\n" in out
    table = table.iloc[:1].copy()
    # every trial failed: no best config, and the line does not name the failed first row
    table.loc[0, "status"] = "diverged"
    failed = SweepResult("parent", table, {}, tmp_path / "sweep-x", ["rounds", "train.lr"])
    monkeypatch.setattr("fedray.sweeps.tune_sweep.run_sweep", lambda *a, **k: failed)
    assert main(["sweep", "--algo", "fedavg"]) == 0
    assert "best trial: -\n" in capsys.readouterr().out


def test_prepare_base_makes_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base = prepare_base(None, "fedavg", ["data.root=rel/data", "storage_path=rel/store"])
    assert base["storage_path"] == str(tmp_path.resolve() / "rel" / "store")
    assert base["data"]["root"] == str(tmp_path.resolve() / "rel" / "data")
    assert base["tracking"]["uri"] == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"  # the default store
    for relative in ("sqlite:///runs/mlflow.db", "runs/mlruns"):  # from the environment or the config
        monkeypatch.setenv("MLFLOW_TRACKING_URI", relative)
        got = prepare_base(None, "fedavg", [])["tracking"]["uri"]
        assert got.removeprefix("sqlite:///") == str(tmp_path.resolve() / relative.removeprefix("sqlite:///"))
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        got = prepare_base(None, "fedavg", [f"tracking.uri={relative}"])["tracking"]["uri"]
        assert got.removeprefix("sqlite:///") == str(tmp_path.resolve() / relative.removeprefix("sqlite:///"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")  # a server is left as given
    assert prepare_base(None, "fedavg", [])["tracking"]["uri"] == "http://tracking:5000"
    with pytest.raises(ConfigError):
        check_space(load_space(SPACE_FILES[0]), {"algorithm": "fedavg", "rounds": 0})


def test_an_interrupted_trials_run_is_closed_killed_and_not_tagged_stopped_early(mlflow_store):
    # Tune stops a running trial as its scheduler would when the sweep is interrupted (Ctrl-C,
    # --stop-after-trials): the trial's own run may have tagged itself stopped early, or still run
    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment("sweep")
    parent = SimpleNamespace(client=client, experiment_id=experiment)
    parent.run_id = client.create_run(experiment).info.run_id

    def child(trial: str, **tags: str) -> str:
        run = client.create_run(
            experiment, tags={Tags.PARENT_RUN_ID: parent.run_id, Tags.TRIAL_ID: trial, **tags}
        )
        return run.info.run_id

    by_asha, running, cut_short = child("a", **{Tags.STOPPED_EARLY: "true"}), child("b"), child("c")
    closed_by_its_own_run = child("d", **{Tags.STOPPED_EARLY: "true"})
    client.set_terminated(by_asha, status="KILLED")
    client.set_terminated(closed_by_its_own_run, status="KILLED")
    _close_stopped_children(parent, interrupted={"c", "d"})
    ended = {
        run_id: client.get_run(run_id) for run_id in (by_asha, running, cut_short, closed_by_its_own_run)
    }
    assert {run.info.status for run in ended.values()} == {"KILLED"}
    stopped_early = {run_id for run_id, run in ended.items() if Tags.STOPPED_EARLY in run.data.tags}
    assert stopped_early == {by_asha, running}

    # a trial's run continued (a resume, after a driver that died before it could untag it): no
    # longer stopped early
    client.set_tag(cut_short, Tags.STOPPED_EARLY, "true")
    RunTracker(load_config(None, tiny_overrides()), run_id=cut_short)
    continued = client.get_run(cut_short)
    assert continued.info.status == "RUNNING" and Tags.STOPPED_EARLY not in continued.data.tags


def test_a_resumed_run_hands_the_rounds_it_logs_late_to_on_round(monkeypatch):
    # without Ray or MLflow: the interrupted run had logged rounds 1-2, its checkpoint holds 1-4 (its
    # Coordinator ran ahead); the resume logs 3 and 4 once, and a sweep's trial reports them to Tune
    from fedray.platform.runtime import driver

    history = [{Metrics.ACC_GLOBAL: r / 10} for r in range(1, 5)]
    logged, seen = [], []
    tracker = SimpleNamespace(
        uri="sqlite:///x.db",
        last_step=lambda key: 2,
        log_metrics=lambda metrics, step: logged.append(step),
    )
    session = SimpleNamespace(reopen=lambda run_id: tracker)
    handle = SimpleNamespace(load_checkpoint=lambda directory: history)
    monkeypatch.setattr(driver, "checkpoint_dir_of", lambda run_id, uri: "/runs/r1")
    folder = driver.reopen_run(session, handle, "r1", lambda rnd, metrics: seen.append((rnd, metrics)))
    assert folder == "/runs/r1" and logged == [3, 4] and seen == [(3, history[2]), (4, history[3])]


def test_a_range_is_checked_where_tune_draws_not_at_its_open_top_end(tmp_path):
    """Tune draws a uniform range from [low, high): momentum in [0.5, 1.0) is a valid space though
    momentum=1.0 is refused, and the point just below the top is what is checked."""
    path = tmp_path / "space.yaml"
    path.write_text(
        yaml.safe_dump({"search": "random", "params": {"train.momentum": {"uniform": [0.5, 1.0]}}})
    )
    check_space(load_space(path), prepare_base(None, "fedavg", tiny_overrides()))
