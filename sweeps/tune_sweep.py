"""Ray Tune sweeps: every trial is a full federated run through ``run_experiment``.

A trial reserves its Coordinator and ClientActors through a placement group (an empty head bundle
for the trial's driver, one bundle per ClientActor), so trials run side by side as far as the
cluster allows and never oversubscribe it. Each round reaches Tune with ``tune.report`` and an ASHA
scheduler stops weak trials early on the round axis. MLflow gets one parent run per sweep and one
nested child run per trial.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import yaml
from ray.tune import Callback
from ray.tune.error import TuneError
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

from fedray.platform.catalog import build_config
from fedray.platform.config import ExperimentConfig, merge, raw_config
from fedray.platform.environ import environ_restored
from fedray.platform.errors import ConfigError, Diverged, last_line
from fedray.platform.runtime import storage
from fedray.platform.runtime.checkpoint import recorded_checkpoint
from fedray.platform.runtime.driver import (
    Trial,
    ensure_ray,
    require_before_ray,
    require_cpus,
    require_gpus,
    resume_experiment,
    run_experiment,
)
from fedray.platform.runtime.processes import KeptRuntime
from fedray.platform.runtime.session import StoppedEarly
from fedray.platform.tracking.descriptions import sweep_description
from fedray.platform.tracking.mlflow_run import RunTracker, tracking_uri
from fedray.platform.tracking.names import RunKind, Tags, tag_filter
from fedray.platform.tracking.outage import PatientCalls, shorten_http_retries
from fedray.platform.tracking.views import DEFAULT_SERVER, runs_table_url, save_sweep_view
from fedray.sweeps.space import (
    SearchSpace,
    check_space,
    load_space,
    round_metrics,
    space_path,
    trial_config,
)

SWEEP_STATE = "fedray_sweep.json"  # parent run id and settings, for --resume


# how a trial ended that leaves it out of the best trial's choice: its last value is not its result
UNRANKED = ("error", "diverged")


def tune_key(metric: str) -> str:
    """A metric's name in the results a trial reports to Tune (which reads a ``/`` as nesting)."""
    return metric.replace("/", "_")


@dataclass
class SweepResult:
    parent_run_id: str
    # a row per trial, best first (failed ones last): params, metric, rounds run, status, trial id
    trials: pd.DataFrame
    best_config: dict[str, Any]
    path: Path
    params: list[str] = field(default_factory=list)  # the swept keys, as the space names them


def unreported_metric(
    space: SearchSpace, results: list[dict[str, Any]], eval_clients: str
) -> ConfigError | None:
    """The sweep's error when its trials reported rounds but never its metric (an algorithm's own
    name misspelt, or the global model's accuracy of an algorithm without one); None otherwise."""
    reported = {key for result in results for key in result}
    if "round" not in reported or tune_key(space.metric) in reported:
        return None
    platform = sorted(m for m in round_metrics(eval_clients) if tune_key(m) in reported)
    return ConfigError(
        f"{space.path}: metric={space.metric!r}: no trial reported it; they reported "
        f"{', '.join(platform)} and the algorithm's own"
    )


# --------------------------------------------------------------------------------------------- resources


def trial_actors(cfg: ExperimentConfig) -> int:
    """ClientActors one trial runs: ``ray.max_actors`` (default 1), never more than it has clients."""
    return max(1, min(cfg.ray.max_actors or 1, cfg.data.num_clients))


def trial_resources(cfg: ExperimentConfig):
    """Placement group of one trial: nothing for its driver, one bundle per ClientActor. (Tune drops
    the empty head bundle from the group it creates, so the trial counts its actors from the config,
    :func:`trial_actors`, not from the group's bundles.)"""
    from ray import tune

    bundle = {"CPU": cfg.ray.num_cpus_per_client}
    if cfg.ray.num_gpus_per_client > 0:
        bundle["GPU"] = cfg.ray.num_gpus_per_client
    actors = trial_actors(cfg)
    return tune.PlacementGroupFactory([{}] + [dict(bundle) for _ in range(actors)], strategy="PACK")


# --------------------------------------------------------------------------------------------- trial


def tune_result(rnd: int, metrics: dict[str, float]) -> dict[str, float]:
    """A round's metrics as a trial reports them to Tune."""
    return {"round": rnd, **{tune_key(k): v for k, v in metrics.items()}}


def run_trial(
    point: dict[str, Any],
    base: dict[str, Any],
    parent_run_id: str,
    sweep_id: str,
    diverged: dict[str, str] | None = None,
    resumed: bool = False,
    restart_errored: bool = False,
    diverged_points: dict[str, str] | None = None,
) -> None:
    """The Tune trainable: one federated run with the sampled values, reporting every round.
    ``diverged`` (the sweep's state, :func:`remember_divergences`) names the trials whose run
    diverged before a resume: when Tune resumes them (with a trial that failed otherwise,
    :func:`failed_otherwise`), one of these ends as soon as it is scheduled, before a run starts,
    with its line: the same settings would diverge again. In a ``resumed`` sweep, a trial that ran
    before goes on from its run's last checkpoint, in that run (:func:`earlier_run`); with
    ``restart_errored`` one whose run failed starts again from round 0 under a new run (the failed
    one stays, FAILED). Tune's restart gives every failed trial a new folder, a diverged one too:
    ``diverged_points`` (by :func:`point_key`) knows those by their values."""
    import ray
    from ray import tune

    line = (diverged or {}).get(Path(tune.get_context().get_trial_dir()).name)
    line = line or (diverged_points or {}).get(point_key(point))
    if line is not None:
        raise Diverged(line + NOT_RUN_AGAIN)
    cfg = trial_config(base, point)
    # the sweep's store, made absolute by prepare_base: a relative MLFLOW_TRACKING_URI inherited by
    # this worker would name a store in the trial's own directory
    if cfg.tracking.uri:
        os.environ["MLFLOW_TRACKING_URI"] = cfg.tracking.uri
    trial_id = tune.get_context().get_trial_id() or ""
    earlier = earlier_run(cfg, parent_run_id, trial_id) if resumed else None
    if earlier is not None and earlier.info.status == "FINISHED":
        # it ended before Tune heard its last round: that round (each metric's value at its last
        # step, as MLflow keeps it), and nothing run again
        tune.report(tune_result(cfg.rounds, dict(earlier.data.metrics)))
        return
    # one cut short before its first checkpoint starts again, under a new run; so does one that
    # failed, when asked (its checkpoints are its failing code's; Tune gives a trial it restarts a
    # new id, so its failed run is not found, but that is Tune's choice, not a promise)
    restart = earlier is not None and restart_errored and earlier.info.status == "FAILED"
    cut_short = (
        earlier.info.run_id if earlier is not None and not restart and recorded_checkpoint(earlier) else None
    )
    pg = ray.util.get_current_placement_group()
    actors = trial_actors(cfg) if pg is not None else None  # as many as trial_resources reserved
    KeptRuntime.keep_between_trials()  # Tune hands this process the next trial (reuse_actors)
    tags = {
        Tags.SWEEP_ID: sweep_id,
        Tags.TRIAL_ID: trial_id,
        Tags.RUN_NAME: f"{cfg.algorithm} {trial_label(point)}",  # charts' legends name the values
    }
    last: list[dict[str, float]] = []

    def report(rnd: int, metrics: dict[str, float]) -> None:
        if rnd == cfg.rounds:  # reported once the run is closed: ASHA stops every trial at its last report
            last.append(tune_result(rnd, metrics))
            return
        try:
            tune.report(tune_result(rnd, metrics))
        except SystemExit:  # what tune.report raises once Tune stops the trial (its scheduler, or the sweep)
            raise StoppedEarly(f"stopped by Tune after round {rnd}") from None

    # A stopped trial's thread wakes in tune.report only when Tune hands its process the next trial
    # (or ends the process); it then closes its MLflow run and stops its processes, and Tune waits
    # this many seconds (default 2) for that before it fails the *next* trial: as long as the
    # tracking server may be waited for, and a minute more
    os.environ["TUNE_FUNCTION_THREAD_TIMEOUT_S"] = str(int(cfg.tracking.max_outage_s) + 60)
    trial = Trial(parent_run_id, pg, actors)
    try:
        if cut_short is None:
            result = run_experiment(cfg, tags=tags, on_round=report, trial=trial)
        else:  # the config its checkpoint saved, which is this trial's
            result = resume_experiment(cut_short, tags=tags, on_round=report, trial=trial)
    except StoppedEarly:
        # closed as KILLED, tagged stopped early. SystemExit ends the thread as Tune ends a stopped
        # trial's; returning would make Tune's wrapper report the function's end and wait forever
        # for a go-ahead that a stopped trial never gets
        raise SystemExit(0) from None
    if not last and result.finished and result.history:
        # continued from its last round's checkpoint, which its run had logged already
        last.append(tune_result(len(result.history), result.history[-1]))
    for final in last:
        tune.report(final)


def earlier_run(cfg: ExperimentConfig, parent_run_id: str, trial_id: str):
    """The newest MLflow run of this trial in the sweep's store (None if it has none): in a resumed
    sweep, one the interruption (or a failure other than diverging) cut short, or one that finished
    before Tune heard its last round. Waits out an outage of the tracking server as a run does."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)  # the sweep's store
    client, patient = MlflowClient(tracking_uri=uri), PatientCalls(uri, cfg.tracking.max_outage_s)
    parent = patient(client.get_run, parent_run_id)
    runs = patient(
        client.search_runs,
        [parent.info.experiment_id],
        filter_string=f"{tag_filter(Tags.PARENT_RUN_ID, parent_run_id)} and {tag_filter(Tags.TRIAL_ID, trial_id)}",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


# --------------------------------------------------------------------------------------------- sweep


def rounds_planned(base_rounds: int, point: dict[str, Any]) -> int:
    """The rounds a trial was set to run: the base config's, unless the space sweeps ``rounds``."""
    return int(point.get("rounds", base_rounds))


def trial_status(metrics: dict[str, Any], error: Any, base_rounds: int, point: dict[str, Any]) -> str:
    """How a trial ended: ``ok`` (all its rounds), ``stopped early`` (by the scheduler, which Tune
    counts as done), ``interrupted`` (the sweep was, before the trial was done), ``diverged`` (its
    training loss went non-finite: its run stopped, :class:`Diverged`) or ``error``."""
    if error:
        return "diverged" if is_divergence(str(error)) else "error"
    short = metrics.get("round", 0) < rounds_planned(base_rounds, point)
    # a trial that reported its last round is done even where Tune's ``done`` is missing: a resume
    # on a loaded machine restored a finished trial's results from a state saved just before its end
    if not metrics.get("done") and short:
        return "interrupted"
    return "stopped early" if short else "ok"


def all_trials_ended(results: list[Any], base_rounds: int, num_trials: int) -> bool:
    """Whether the sweep is over (its parent run FINISHED, not KILLED): every trial of the space ended,
    by the trial table's rule (:func:`trial_status`), under which a trial that reported its last round
    is done though Tune's ``done`` is missing; Tune's flag alone left a resumed sweep KILLED beside a
    table of "ok" trials on a loaded machine."""
    ended = sum(
        1
        for r in results
        if trial_status(r.metrics or {}, r.error, base_rounds, dict(r.config or {})) != "interrupted"
    )
    return ended >= num_trials


NOT_RUN_AGAIN = " (before the resume; not run again: the same settings diverge again)"
# a run's own line when it diverged (Diverged); a client's error that only mentions the words is not
DIVERGED_LINE = re.compile(r"(\w+: )?round \d+: " + re.escape(Diverged.MARK))


def error_line(error: str) -> str:
    """A trial's error as Tune keeps it (a remote traceback) in one line: its last, without the name
    of fedray's own error class before it (their lines are written to be read alone)."""
    return re.sub(r"^fedray\.[\w.]+: ", "", last_line(error))[:300]


def is_divergence(error: str) -> bool:
    """Whether a trial's error (as Tune keeps it) is its run's divergence."""
    return DIVERGED_LINE.match(error_line(error)) is not None


def remember_divergences(known: dict[str, str], results) -> dict[str, str]:
    """The trials of a sweep whose run diverged, by trial folder (the name Tune keeps for a resumed
    trial), each with the run's line: those ``known`` from the sweep's state (:func:`record_divergence`
    writes each as it ends), and those whose error in Tune's ``results`` says so (one the record
    missed, or a sweep started before it). The state keeps them: a resumed trial's error is cleared
    until it ends again, so a resume interrupted before then would leave Tune's results without it."""
    found = {
        Path(r.path).name: error_line(str(r.error)).removesuffix(NOT_RUN_AGAIN)
        for r in results
        if r.error and is_divergence(str(r.error))
    }
    return {**found, **known}  # the first run's own line, not what its resume raised


def failed_otherwise(results, diverged: Collection[str]) -> bool:
    """Whether a trial in Tune's ``results`` failed on something other than its run diverging (a bug
    since fixed, a lost node), which a resume runs again. Tune resumes every failed trial or none:
    when none did, the diverged ones are left as they ended and cost no trial process."""
    return any(r.error and Path(r.path).name not in diverged for r in results)


def restored_tuner(path: Path, trainable, previous, diverged: Collection[str], restart: bool = False):
    """Tune's sweep at ``path``, to resume: a trial that failed runs again (fixed code, a node back)
    when one failed otherwise than diverging (``previous``: Tune's results before the resume),
    from its last checkpoint, or with ``restart`` (``--restart-errored``) from round 0; a diverged
    one is left as it ended, or, when Tune runs every failed trial again, ends at once in
    :func:`run_trial` (known by its folder, or after a restart, which gives it a new one, by its
    values)."""
    from ray import tune

    again = failed_otherwise(previous, diverged)
    return tune.Tuner.restore(
        str(path), trainable, resume_errored=again and not restart, restart_errored=again and restart
    )


def save_state(state_file: Path, state: dict[str, Any]) -> None:
    """Writes the sweep's state whole or not at all (a second Ctrl-C may land in the write)."""
    storage.write_bytes(str(state_file), json.dumps(state).encode())  # its temporary name is its own


def point_key(point: dict[str, Any]) -> str:
    """A trial's values as one string: how a trial that diverged is known once Tune's restart
    (``--restart-errored``) has given it a new folder; the same values diverge again."""
    return json.dumps(point, sort_keys=True, default=str)


def record_divergence(trial_path: str, line: str) -> None:
    """Adds a trial whose run just diverged to its sweep's state at once (the sweep's folder holds
    the trial's): a driver that dies before Tune saves its own state would otherwise resume it."""
    state_file = Path(trial_path).parent / SWEEP_STATE
    if not state_file.is_file():
        return
    state = json.loads(state_file.read_text())
    known = state.setdefault("diverged", {})
    if Path(trial_path).name not in known:
        known[Path(trial_path).name] = line.removesuffix(NOT_RUN_AGAIN)
        save_state(state_file, state)


def trial_label(point: dict[str, Any]) -> str:
    """``alpha=0.9 selection=in_order``: a trial's swept values, short keys, in the space's order."""

    def show(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return " ".join(f"{key.rsplit('.', 1)[-1]}={show(v)}" for key, v in point.items())


def prepare_base(config_path: str | None, algorithm: str, overrides: list[str]) -> dict[str, Any]:
    """The base experiment every trial starts from, with paths made absolute (trials run elsewhere)."""

    raw = raw_config(config_path, [f"algorithm={algorithm}", *overrides])
    cfg = build_config(raw)  # one-line errors for the base, before Tune
    raw = merge(
        raw,
        {
            "progress": False,
            "storage_path": storage.resolve(cfg.storage_path),
            "tracking": {"uri": tracking_uri(cfg)},
        },
    )
    if cfg.data.root:
        raw = merge(raw, {"data": {"root": str(Path(cfg.data.root).expanduser().resolve())}})
    return raw


def _search_alg(space: SearchSpace, seed: int):
    if space.search != "optuna":
        return None
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise ConfigError("search=optuna needs the optuna package: pip install optuna") from None
    return OptunaSearch(seed=seed)


def _scheduler(space: SearchSpace, base_rounds: int):
    # ASHA stops every trial at max_t: the most rounds any trial runs, where the space sweeps them
    rounds = int(space.largest("rounds", base_rounds))
    if space.scheduler == "none" or rounds <= space.grace_rounds:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="round", max_t=rounds, grace_period=space.grace_rounds, reduction_factor=2)


def run_sweep(
    algorithm: str,
    *,
    config_path: str | None = None,
    space_file: str | None = None,
    samples: int | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    name: str | None = None,
    max_concurrent: int | None = None,
    stop_after_trials: int | None = None,
    restart_errored: bool = False,
) -> SweepResult:
    """Run (or ``resume``) a sweep of ``algorithm`` and return its trial table and best config.

    ``stop_after_trials`` stops the sweep as Ctrl-C would once that many trials have ended in this
    call (a job with a time budget), a resumed one too; ``--resume`` continues it.
    ``restart_errored`` (with ``resume``): trials that failed start again from round 0."""
    from ray import tune

    if restart_errored and not resume:
        raise ConfigError("--restart-errored: only with --resume (a new sweep has no failed trials)")

    base = prepare_base(config_path, algorithm, overrides or [])
    space = load_space(space_path(algorithm, space_file))
    if samples is not None:
        space.samples = samples
    check_space(space, base)  # unknown keys, empty choices, invalid values: before Tune starts
    base_cfg = build_config(base)
    name = name or f"sweep-{algorithm}-{base_cfg.name}"
    sweeps_dir = Path(base_cfg.storage_path).resolve() / "sweeps"  # Tune's state is local to its driver
    path = sweeps_dir / name
    state_file = path / SWEEP_STATE
    metric = tune_key(space.metric)

    if stop_after_trials and threading.current_thread() is not threading.main_thread():
        # Tune takes its stop signal in the main thread only: elsewhere the sweep would never stop
        raise ConfigError("--stop-after-trials: run the sweep in the main thread (Tune's stop signal)")
    address = base_cfg.ray.cluster_address()
    if stop_after_trials and address.startswith("ray://"):
        # through Ray Client, Tune runs the sweep in an actor on the cluster: the limit set here, and
        # the stop signal sent to this process, would never reach it
        raise ConfigError(
            f"--stop-after-trials: not through Ray Client ({address}); run the sweep on a node of the "
            "cluster (RAY_ADDRESS=auto) or without the option"
        )
    require_before_ray(base_cfg, new_run=not resume)  # the tracking store among them: read just below
    if resume:
        if not tune.Tuner.can_restore(str(path)) or not state_file.is_file():
            raise ConfigError(f"--resume: no sweep to resume at {path}")
        state = json.loads(state_file.read_text())
        if stop_after_trials and not state.get("interruptible"):
            raise ConfigError(
                "--stop-after-trials: this sweep was started by an older fedray, whose resume cannot "
                "stop after N trials; resume it without the option"
            )
        if not restart_errored:
            require_unfinished(base_cfg, state["parent_run_id"], name)
    else:
        require_no_stopped_sweep(base_cfg, state_file, name)

    ensure_ray(base_cfg)
    require_cpus(base_cfg)  # a trial's workers need that many CPUs on one node
    KeptRuntime.release()  # a caller's last run's processes would hold the CPUs the trials reserve
    require_gpus(base_cfg)  # a trial asking for GPUs the cluster lacks would wait forever to be placed
    if resume:
        # read before the parent run is reopened: a sweep whose state Tune cannot read leaves it as it was
        try:
            previous = tune.Tuner.restore(str(path), run_trial).get_results()
        except RuntimeError as err:  # Tune's: the sweep stopped before its first results were saved
            raise ConfigError(f"--resume: {path}: Tune cannot read the sweep's results ({err})") from None
        state["diverged"] = remember_divergences(state.get("diverged", {}), previous)
        save_state(state_file, state)
        parent = RunTracker(base_cfg, run_id=state["parent_run_id"])
        # a sweep started before fedray passed Tune its loggers itself gets Tune's defaults
        own_loggers = state.get("tune_loggers") == "explicit"
    else:
        parent_cfg = build_config(merge(base, {"name": base_cfg.tracking.experiment or base_cfg.name}))
        parent = RunTracker(parent_cfg, extra_tags={Tags.KIND: RunKind.SWEEP, Tags.SWEEP_ID: name})
        try:  # a parent run whose set-up failed is closed FAILED, not left RUNNING
            parent.client.set_tag(parent.run_id, Tags.RUN_NAME, name)
            parent.describe(sweep_description(algorithm, space, base_cfg))
            params = [p.key for p in space.params]
            view = save_sweep_view(parent.client, parent.experiment_id, name, parent.run_id, params)
            parent.set_tags({Tags.UI_VIEW: view})
            parent.log_text(Path(space.path).read_text(), "search_space.yaml")
            parent.log_text(yaml.safe_dump(base, sort_keys=False), "base_config.yaml")
            path.mkdir(parents=True, exist_ok=True)
        except BaseException:
            parent.end("FAILED")
            raise
        # what --resume reads back: the parent run, Tune's settings, the trials that diverged
        state = {
            "parent_run_id": parent.run_id,
            "algorithm": algorithm,
            "tune_loggers": "explicit",
            "interruptible": True,  # InterruptAfterTrials among the callbacks Tune restores
            "diverged": {},
        }
        own_loggers = True

    status = "FAILED"
    try:  # whatever fails from here (Tune's set-up included), the parent run does not stay RUNNING
        restarted_points: dict[str, str] = {}
        if resume and restart_errored and state["diverged"]:
            configs = trial_configs(
                str(path)
            )  # the diverged trials' values, before Tune gives them new folders
            restarted_points = {
                point_key(configs[f]): line for f, line in state["diverged"].items() if f in configs
            }
        trainable = tune.with_resources(
            tune.with_parameters(
                run_trial,
                base=base,
                parent_run_id=parent.run_id,
                sweep_id=name,
                diverged=state["diverged"],
                resumed=resume,
                restart_errored=restart_errored,
                diverged_points=restarted_points,
            ),
            resources=trial_resources(base_cfg),
        )
        # Tune's own result files (what its ResultGrid reads back), without its TensorBoard files: every
        # round is in MLflow, and Tune would print a TensorBoard command for files nobody needs. A
        # resumed sweep runs the callbacks it was started with (Tune restores them), not these
        callbacks: list[Callback] = [
            _TrialLines(space.metric, base_cfg.rounds),
            CSVLoggerCallback(),
            JsonLoggerCallback(),
            InterruptAfterTrials(),
        ]
        if resume:
            tuner = restored_tuner(path, trainable, previous, state["diverged"], restart=restart_errored)
        else:
            param_space = {p.key: p.tune_domain(space.search) for p in space.params}
            tuner = tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=metric,
                    mode=space.mode,
                    num_samples=space.samples,
                    scheduler=_scheduler(space, base_cfg.rounds),
                    search_alg=_search_alg(space, base_cfg.seed),
                    max_concurrent_trials=max_concurrent,
                    # a finished trial's process, its placement group and its Coordinator and
                    # ClientActors (KeptRuntime) run the next trial: no process imports torch again
                    reuse_actors=True,
                ),
                run_config=tune.RunConfig(
                    name=name, storage_path=str(sweeps_dir), callbacks=callbacks, verbose=0
                ),
            )
            save_state(state_file, state)
        try:
            # a trial that diverged before, which a resume leaves as it ended or ends at once, is no
            # trial of this call's
            with (
                tune_settings(own_loggers),
                InterruptAfterTrials.limited(stop_after_trials, state["diverged"], restarted_points),
            ):
                grid = tuner.fit()
        except (ValueError, TuneError) as err:  # Tune's check of the first result that lacks the metric
            if f"metric(s) `{metric}`" not in str(err):
                raise
            raise ConfigError(
                f"{space.path}: metric={space.metric!r}: a trial's round did not report it; "
                "name a per-round metric of the platform's or one the algorithm records"
            ) from None
        # Ctrl-C makes Tune save its state and return early: unfinished trials mean "interrupted"
        trials = [grid[i] for i in range(len(grid))]
        status = "FINISHED" if all_trials_ended(trials, base_cfg.rounds, space.num_trials()) else "KILLED"
        unreported = unreported_metric(space, [r.metrics or {} for r in trials], base_cfg.eval.clients)
        if unreported is not None:
            status = "FAILED"
            raise unreported
        if status == "KILLED":
            print(
                f"sweep interrupted: resume with  fedray sweep --algo {algorithm} --resume (same arguments)"
            )
    finally:
        parent.end(status)
    return summarize(grid, space, parent, path, base, state["diverged"])


def parent_status(cfg: ExperimentConfig, parent_run_id: str) -> str | None:
    """The status of a sweep's parent run in the tracking store; None when the store has no such run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    shorten_http_retries(uri)
    try:
        return MlflowClient(uri).get_run(parent_run_id).info.status
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # the store's own trouble: said as MLflow says it
            raise
        return None


def require_no_stopped_sweep(cfg: ExperimentConfig, state_file: Path, name: str) -> None:
    """A new sweep under the name of one that was stopped part way (Ctrl-C, a killed driver) or is
    running now would write over its state, which is what ``--resume`` continues it from: one line
    instead. A finished or failed sweep's name is free again, as is one whose parent run this
    tracking store does not hold (it cannot be resumed from here)."""
    if not state_file.is_file():
        return
    try:
        parent_run_id = json.loads(state_file.read_text())["parent_run_id"]
    except (ValueError, KeyError):
        return  # not a state fedray can resume
    status = parent_status(cfg, parent_run_id)
    if status in ("RUNNING", "KILLED"):
        how = "is running or its driver was killed" if status == "RUNNING" else "was stopped part way"
        raise ConfigError(
            f"a sweep named {name} {how} (parent run {parent_run_id} is {status}); continue it with "
            "--resume (same arguments), or start another with --name <new name>"
        )


def require_unfinished(cfg: ExperimentConfig, parent_run_id: str, name: str) -> None:
    """A sweep whose trials have all ended has nothing to resume: one line, and its parent run stays
    FINISHED (``--restart-errored`` may still start its failed trials again)."""
    status = parent_status(cfg, parent_run_id)
    if status is None:
        raise ConfigError(
            f"--resume: the sweep {name}'s parent run {parent_run_id} is not in the tracking store "
            f"{tracking_uri(cfg)}; resume with the MLFLOW_TRACKING_URI the sweep was started with"
        )
    if status == "FINISHED":
        raise ConfigError(
            f"--resume: the sweep {name} finished, every trial ended; nothing is left to resume "
            "(--restart-errored starts its failed trials again; --name <new name> starts another sweep)"
        )


def _not_said_better(record: logging.LogRecord) -> bool:
    """Drops Tune's lines that the sweep says better: how to resume (Tune's Python call, where the
    sweep prints its own command) and which trials did not complete (its table says how each ended)."""
    message = record.getMessage()
    return not (message.startswith("Trials did not complete") or "Resume experiment with:" in message)


@contextlib.contextmanager
def tune_settings(own_loggers: bool) -> Iterator[None]:
    """Tune's settings for one fit (it reads them from the environment as the fit starts): no
    traceback of its own per failed trial, whose line (:class:`_TrialLines`) names the error and its
    file; none of Tune's output engine (its configuration box, and an "errored after" line per
    failed trial, printed at ``verbose=0`` too, naming the error file in Ray's session folder); and,
    unless the sweep was started before fedray passed Tune its loggers itself, none of Tune's
    default loggers (its CSV, JSON and TensorBoard files). Nor the lines of :func:`_not_said_better`."""
    # RAY_AIR_NEW_OUTPUT=0: Tune's older reporter, which prints nothing at verbose=0
    values = {"TUNE_PRINT_ALL_TRIAL_ERRORS": "0", "RAY_AIR_NEW_OUTPUT": "0"}
    if own_loggers:
        values["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    tune_logger = logging.getLogger("ray.tune.tune")
    with environ_restored(values):
        os.environ.update(values)
        tune_logger.addFilter(_not_said_better)
        try:
            yield
        finally:
            tune_logger.removeFilter(_not_said_better)


class _TrialLines(Callback):
    """One line per started and finished trial (Tune's own tables are too wide to read); a trial whose
    run diverged goes into the sweep's state as it ends (:func:`record_divergence`)."""

    rounds: int | None = None  # unset in one restored from a sweep started by an older fedray

    def __init__(self, metric: str, rounds: int) -> None:
        self.metric = tune_key(metric)
        self.rounds = rounds  # the base config's: a trial stopped before its rounds was stopped early
        self.running = 0

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        self.running = 0  # this fit's, not the count Tune restored with the callback

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.running += 1
        point = ", ".join(f"{k}={v}" for k, v in trial.config.items())
        print(f"trial {trial.trial_id} started ({self.running} running): {point}", flush=True)

    def _ended(self, trial, how: str, why: str = "") -> None:
        self.running = max(0, self.running - 1)
        last = trial.last_result or {}
        value = last.get(self.metric)
        shown = "-" if value is None else f"{value:.4f}"
        rounds = last.get("round", 0)
        print(
            f"trial {trial.trial_id} {how} after {rounds} round{'s' * (rounds != 1)}: "
            f"{self.metric}={shown}{why}",
            flush=True,
        )

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        stopped = self.rounds is not None and (
            trial_status(trial.last_result or {}, None, self.rounds, trial.config) == "stopped early"
        )
        self._ended(trial, "stopped early by the scheduler" if stopped else "finished")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        # Tune wrote the trial's error to its local folder before it calls this (its storage copy,
        # which outlives Ray's session folder, comes later): the run's line says whether it diverged
        path, error, why = trial.error_file, "", ""
        with contextlib.suppress(OSError, UnicodeError, TypeError):  # a line to print: never the sweep's end
            error = Path(path).read_text().rsplit("Failure # ", 1)[-1]  # the last failure
            kept = Path(trial.path) / Path(path).name if trial.path else path
            why = f"; {error_line(error)}; traceback: {kept}" if error.strip() else ""
        diverged = is_divergence(error)
        if diverged and trial.path:
            with contextlib.suppress(OSError, ValueError):  # the next resume reads Tune's error too
                record_divergence(trial.path, error_line(error))
        self._ended(trial, "diverged" if diverged else "FAILED", why)


class InterruptAfterTrials(Callback):
    """Stops the sweep once :attr:`limit` of its trials have ended in this fit (failed ones too, not
    one that diverged before, which a resume leaves as it ended or ends at once): Tune saves the
    sweep's state and stops, as on a Ctrl-C (SIGUSR1, which Tune always takes so), and ``--resume``
    goes on from there. Every sweep has one, and the limit is the class's, set for one fit by
    :meth:`limited`: Tune pickles a sweep's callbacks into its state and a resumed sweep runs those,
    not the ones it is given, so a limit kept in the instance would be the first fit's forever."""

    limit: ClassVar[int | None] = None
    skip: ClassVar[Collection[str]] = ()  # trial folders not counted
    skip_points: ClassVar[Collection[str]] = ()  # nor trials of these values (point_key): restarted, diverged

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        self.ended = 0  # this fit's count, not the one Tune restored with the callback

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        if Path(trial.path or "").name in self.skip:
            return
        if self.skip_points and point_key(trial.config or {}) in self.skip_points:
            return
        self.ended += 1
        if self.limit is not None and self.ended == self.limit:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.on_trial_complete(iteration, trials, trial, **info)

    @classmethod
    @contextlib.contextmanager
    def limited(
        cls, n: int | None, skip: Collection[str] = (), skip_points: Collection[str] = ()
    ) -> Iterator[None]:
        before = cls.limit, cls.skip, cls.skip_points
        cls.limit, cls.skip, cls.skip_points = n, frozenset(skip), frozenset(skip_points)
        try:
            yield
        finally:
            cls.limit, cls.skip, cls.skip_points = before


def trial_table(
    results,
    space: SearchSpace,
    base_rounds: int,
    diverged: Collection[str] = (),
    configs: dict[str, dict[str, Any]] | None = None,
) -> pd.DataFrame:
    """One row per trial, the best first: its point, the metric, the rounds it ran, how it ended and
    its id. Columns of Python objects: a trial that never reported has no metrics (``None``), and
    must not turn the other trials' integers into floats (``num_middleware=5.0`` in the best config).
    Its point comes from ``configs`` (:func:`trial_configs`, by trial folder): Tune's results give
    none for a trial that never reported. A trial whose folder is in ``diverged`` diverged, whatever
    Tune says (its resume was interrupted before it ended again)."""
    metric = tune_key(space.metric)
    rows = []
    for result in results:
        folder = os.path.basename(result.path or "")
        point = dict(result.config or (configs or {}).get(folder) or {})
        metrics = result.metrics or {}
        status = trial_status(metrics, result.error, base_rounds, point)
        rows.append(
            {
                **point,
                space.metric: metrics.get(metric),
                "rounds run": metrics.get("round"),  # not "rounds": a space may sweep those
                "status": "diverged" if folder in diverged else status,
                "trial": metrics.get("trial_id") or folder,  # Tune's own field
            }
        )
    table = pd.DataFrame(rows, dtype=object)
    table = table.where(table.notna(), None)  # a key a trial lacks is None too, not NaN
    if not table.empty and table[space.metric].notna().any():
        table = table.sort_values(space.metric, ascending=space.mode == "min", na_position="last")
    if not table.empty:  # a failed trial's last value is not its result: after the others
        table = table.sort_values("status", key=lambda s: s.isin(UNRANKED), kind="stable")
    return table.reset_index(drop=True)


def trial_configs(experiment_path: str) -> dict[str, dict[str, Any]]:
    """Every trial's sampled values, by trial folder, from Tune's experiment state: those of a trial
    that never reported too (one that failed in its first round, one not started when the sweep was
    interrupted, one pending in an interrupted resume), which its results lack."""
    from ray.tune import ExperimentAnalysis

    return {os.path.basename(t.path): t.config for t in ExperimentAnalysis(experiment_path).trials if t.path}


def best_row(table: pd.DataFrame, metric: str) -> pd.Series | None:
    """The best trial of a :func:`trial_table`: its first row, unless no trial has a result."""
    if table.empty or table.iloc[0]["status"] in UNRANKED or table.iloc[0][metric] is None:
        return None
    return table.iloc[0]


def summarize(
    grid, space: SearchSpace, parent, path: Path, base: dict[str, Any], diverged: Collection[str] = ()
) -> SweepResult:
    """Trial table, best config (logged on the parent), and stray child runs closed as KILLED."""
    base_cfg = build_config(base)
    # Tune's state is read again only for a trial whose results lack its values
    configs = trial_configs(grid.experiment_path) if any(not r.config for r in grid) else {}
    table = trial_table(grid, space, base_cfg.rounds, diverged, configs)
    top = best_row(table, space.metric)
    best_point = {}
    if top is not None:
        best_point = {p.key: top[p.key] for p in space.params if p.key in table.columns}
    best_config = trial_config(base, best_point).to_dict() if best_point else {}
    parent.log_text(yaml.safe_dump(best_config, sort_keys=False), "best_config.yaml")
    parent.log_table(table, "trials.csv")
    interrupted = set() if table.empty else set(table.loc[table["status"] == "interrupted", "trial"])
    children = _close_stopped_children(parent, interrupted)
    best = None
    if top is not None:
        run_id = next(
            (r.info.run_id for r in children if r.data.tags.get(Tags.TRIAL_ID) == top["trial"]), "?"
        )
        best = {"params": best_point, "value": float(top[space.metric]), "run_id": run_id}
    view = parent.client.get_run(parent.run_id).data.tags.get(Tags.UI_VIEW)
    chart = runs_table_url(
        parent.experiment_id, DEFAULT_SERVER, viewStateShareKey=view, compareRunsMode="CHART"
    )
    parent.describe(sweep_description(base["algorithm"], space, base_cfg, best, chart if view else None))
    if view:
        print(f"trials in the MLflow UI (make ui), grouped by the swept values: {chart}")
    log_trial_curves(parent, children, space, base["algorithm"])
    return SweepResult(parent.run_id, table, best_config, path, [p.key for p in space.params])


def log_trial_curves(parent, children: list, space: SearchSpace, algorithm: str) -> None:
    """``trial_curves.png`` on the parent run: every trial's metric against the round, labelled by its
    swept values, the view MLflow's chart tab gives only after grouping by hand."""
    import tempfile

    from fedray.dashboards.figures import save_png, trial_curves

    newest = {}  # one run per trial: one cut short before its first checkpoint starts a second
    for run in sorted(children, key=lambda r: r.info.start_time):
        newest[run.data.tags.get(Tags.TRIAL_ID) or run.info.run_id] = run
    curves = {}
    for trial, run in newest.items():
        history = parent.client.get_metric_history(run.info.run_id, space.metric)
        if history:
            label = f"{run.info.run_name} ({trial})"  # grid repeats share values, not trial ids
            curves[label] = pd.DataFrame([(m.step, m.value) for m in history], columns=["step", "value"])
    if not curves:
        return
    title = f"{algorithm} sweep: {space.metric} of every trial ({space.search}, {len(curves)} runs)"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trial_curves.png"
        save_png(trial_curves(curves, space.metric, title), path)
        parent.log_file(path)


def _close_stopped_children(parent, interrupted: Collection[str] = ()) -> list:
    """A trial that ASHA stopped closes its own MLflow run (KILLED, tagged) when Tune lets its
    thread finish; one whose process Tune ended first is still RUNNING: mark it the same way. A
    trial of ``interrupted`` (the sweep's Ctrl-C or ``--stop-after-trials``, which Tune stops as its
    scheduler would) is closed KILLED too, but not tagged stopped early: its resume runs it again.
    Returns the sweep's child runs."""
    runs = parent.client.search_runs(
        [parent.experiment_id],
        filter_string=tag_filter(Tags.PARENT_RUN_ID, parent.run_id),
        max_results=10_000,
    )
    for run in runs:
        cut_short = run.data.tags.get(Tags.TRIAL_ID) in interrupted
        if cut_short and Tags.STOPPED_EARLY in run.data.tags:
            parent.client.delete_tag(run.info.run_id, Tags.STOPPED_EARLY)
        if run.info.status == "RUNNING":
            if not cut_short:
                parent.client.set_tag(run.info.run_id, Tags.STOPPED_EARLY, "true")
            parent.client.set_terminated(run.info.run_id, status="KILLED")
    return runs
