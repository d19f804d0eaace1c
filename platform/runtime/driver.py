"""``run_experiment(config) -> Result``: the one call used by the CLI, the sweeps and the tests.

The driver validates the config and builds the partition before Ray starts (so bad input fails
fast), puts the shards in Ray's object store, starts the Coordinator and streams its events to the
progress display and to MLflow. ``resume_experiment(run_id)`` continues an interrupted run from its
last checkpoint, logging into the same MLflow run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import ray
import torch

from fedray.platform.api.registry import get as get_algorithm
from fedray.platform.catalog import build_config, model_inputs
from fedray.platform.config import ExperimentConfig, address_ok, bad_address
from fedray.platform.data import (
    Federation,
    build_federation,
    check_data,
    histogram_heatmap,
    load_dataset,
    majority_baseline,
    normalize,
)
from fedray.platform.data.federation import sample_pool
from fedray.platform.data.split_file import dumps_split, federation_to_split
from fedray.platform.errors import ALGORITHM_ERRORS, ConfigError, first_line
from fedray.platform.models import arch_for_client
from fedray.platform.network import no_answer
from fedray.platform.runtime import storage
from fedray.platform.runtime.checkpoint import (
    CONFIG_FILE,
    checkpoint_dir_of,
    checkpoint_file,
    has_checkpoint,
    new_checkpoint_dir,
    require_storage,
    saved_config_mapping,
)
from fedray.platform.runtime.coordinator import pool_size
from fedray.platform.runtime.devices import missing_gpus, require_visible_gpus
from fedray.platform.runtime.events import ClientFailed, RoundEnded, WorkerJoined
from fedray.platform.runtime.process_roles import set_up_driver
from fedray.platform.runtime.processes import (
    KeptRuntime,
    Runtime,
    StoppedProcesses,
    node_resources,
    start_runtime,
)
from fedray.platform.runtime.progress import Progress, mb
from fedray.platform.runtime.run_folder import held
from fedray.platform.runtime.session import Ending, RunSession
from fedray.platform.runtime.worker import model_of_arch
from fedray.platform.tracking.dataset import federation_dataset
from fedray.platform.tracking.descriptions import run_description
from fedray.platform.tracking.mlflow_run import (
    RunTracker,
    require_tracking_store,
    tracking_uri,
    tracking_uri_source,
)
from fedray.platform.tracking.names import Metrics, Tags, best_of, best_round_of, final_of, personal_on

logger = logging.getLogger(__name__)

FINAL_KEYS = (
    Metrics.ACC_PERSONAL_MEAN,
    Metrics.ACC_PERSONAL_STD,
    Metrics.ACC_PERSONAL_WEIGHTED,
    Metrics.ACC_GLOBAL,
)
BEST_KEYS = (Metrics.ACC_PERSONAL_MEAN, Metrics.ACC_PERSONAL_WEIGHTED, Metrics.ACC_GLOBAL)


def personal_column(clients: str, column: str = "personal acc %") -> str:
    """A summary table's personalised column: it names the clients evaluated unless they are all."""
    return column if clients == "all" else f"{column} ({clients})"


@dataclass
class Result:
    run_id: str
    experiment_id: str
    config: ExperimentConfig
    history: list[dict[str, float]]
    client_acc: dict[int, float]
    finished: bool
    wall_time_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def last(self, key: str) -> float | None:
        """The latest logged value of a metric (evaluation metrics are not logged every round)."""
        for metrics in reversed(self.history):
            if key in metrics:
                return metrics[key]
        return None

    def best(self, key: str) -> float | None:
        values = [m[key] for m in self.history if key in m]
        return max(values) if values else None

    def best_round(self, key: str) -> int | None:
        """The round (1-based, as logged) of the best value; the first one on ties."""
        rounds = [(m[key], -i) for i, m in enumerate(self.history, start=1) if key in m]
        return -max(rounds)[1] if rounds else None

    def logged(self, metric: str) -> str:
        """The name this run logs ``metric`` under (a personalised one carries ``eval.clients``)."""
        return personal_on(metric, self.config.eval.clients)

    @property
    def final(self) -> dict[str, float | None]:
        """The last value of each of ``FINAL_KEYS``, by its plain name, however this run logs it."""
        return {key: self.last(self.logged(key)) for key in FINAL_KEYS}

    def summary_row(self) -> dict[str, Any]:
        f = self.final
        mean, std = f[Metrics.ACC_PERSONAL_MEAN], f[Metrics.ACC_PERSONAL_STD]
        acc_global = f[Metrics.ACC_GLOBAL]
        pers = None if mean is None else f"{100 * mean:.2f} ± {100 * (std or 0):.2f}"
        baseline = self.extra.get(Metrics.ACC_MAJORITY_BASELINE)
        return {
            "algorithm": self.config.algorithm,
            personal_column(self.config.eval.clients): pers,
            "majority baseline %": None
            if baseline is None or math.isnan(baseline)
            else round(100 * baseline, 2),
            "global acc %": None if acc_global is None else round(100 * acc_global, 2),
            "MB up": round(mb(self.last(Metrics.COMM_UP_BYTES_CUM) or 0), 3),
            "MB down": round(mb(self.last(Metrics.COMM_DOWN_BYTES_CUM) or 0), 3),
            "wall s": round(self.wall_time_s, 1),
            "run id": self.run_id,
        }


# --------------------------------------------------------------------------------------------- pieces


def prepare_federation(cfg: ExperimentConfig) -> Federation:
    """Validate the data side and partition it; everything here runs before Ray starts."""
    check_data(cfg.data)
    return build_federation(load_dataset(cfg.data), cfg.data, cfg.seed)


def federation_meta(fed: Federation) -> dict[str, Any]:
    """What workers and the Coordinator need to know of the data to build models and read samples."""
    return {
        "num_classes": fed.num_classes,
        "inputs": model_inputs(fed.info()),
        "embeddings": fed.embeddings,  # pretrained word vectors (Sent140 with GloVe) or None
        "mean": fed.mean,
        "std": fed.std,
        "train_sizes": [len(shard.train) for shard in fed.shards],
    }


# The local Ray's settings:
# - Ray prestarts one worker process per CPU when the driver connects, and keeps them. A run uses one
#   per ClientActor: on a 16-CPU GPU node with four 0.25-GPU workers, twelve more processes would
#   import torch and Lightning (about 6 s of CPU and 0.3 GB each) and idle. Workers start for the
#   actors the driver creates, right after Ray does.
# - Each worker imports the client module before it registers (torch, Lightning, torchvision), so
#   the ClientActors' set-up finds it loaded.
# - Ray starts its workers at nice 15: beside any other busy process they get 1/28 of its CPU share
#   (a 6 s run took 165 s beside two busy loops on 2 cores). The workers are the experiment, so they
#   run at the user's own priority (as Ray Jobs run theirs).
LOCAL_RAY_CONFIG = {
    "prestart_worker_first_driver": False,
    "preload_python_modules": ["fedray.platform.runtime.worker"],
    "worker_niceness": 0,
}


def start_local_ray(num_cpus: int, prestart: bool = False, **kwargs: Any) -> None:
    """A Ray of this machine only, owned by this process (its processes end with it). ``prestart``:
    Ray's own worker per CPU, started and importing before any run (a benchmark's warm figure)."""
    system = {**LOCAL_RAY_CONFIG, "prestart_worker_first_driver": True} if prestart else LOCAL_RAY_CONFIG
    ray.init(num_cpus=num_cpus, _system_config=system, **kwargs)


def ensure_ray(cfg: ExperimentConfig, prestart: bool = False) -> None:
    """Join ``RAY_ADDRESS`` / ``ray.address`` if given; otherwise start a local Ray with this machine's CPUs
    (``LOCAL_RAY_CONFIG``: a worker process starts for each actor the run creates; ``prestart``:
    :func:`start_local_ray`'s)."""
    if not ray.is_initialized():
        address = cfg.ray.cluster_address()
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "logging_level": logging.ERROR,
            "log_to_driver": os.environ.get("FEDRAY_RAY_LOGS", "0") == "1",
        }
        if address:
            source = cfg.ray.cluster_address_source()
            require_answer(address, source)
            try:
                ray.init(address=address, **kwargs)
            except ConnectionError as err:  # "auto" with no Ray running here, a ray:// with none there
                raise ConfigError(
                    f"{source}={address}: {first_line(err).rstrip('.')}; start the cluster (ray start --head) "
                    f"or unset {source} for a local Ray"
                ) from None
        else:
            if cfg.ray.object_store_mb is not None:
                kwargs["object_store_memory"] = cfg.ray.object_store_mb * 2**20
            start_local_ray(local_cpus(cfg), prestart, **kwargs)
    set_up_driver()  # the shards and the global test set leave as raw bytes


def require_answer(address: str, source: str) -> None:
    """A cluster address where nothing answers fails in one line at once: Ray itself retries for about
    a minute (Ray Client half a minute), then fails with a stack trace. ``auto``, ``local``, a module's
    own scheme and anything not ``host:port`` are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if "://" in host or not host or not port.isdigit():
        return
    why = no_answer(host.strip("[]"), int(port))
    if why:
        raise ConfigError(
            f"{source}={address}: nothing answers there ({why}); start the cluster's "
            "head there (ray start --head) or give its address"
        )


def require_gpus(cfg: ExperimentConfig, before_ray: bool = False) -> None:
    """A run that asks for GPUs needs a cluster that has them: Ray would otherwise wait forever to
    place a ClientActor that no node can hold (a GPU run resumed on a CPU machine, a typo).
    ``before_ray``: checked against this machine's visible GPUs when the run will start a local Ray
    (nothing is started for a run that cannot go); a cluster is asked once it is joined."""
    need = cfg.ray.num_gpus_per_client
    if need <= 0:
        return
    if before_ray:
        require_visible_gpus(need, cfg.ray.cluster_address())
        return
    have = ray.cluster_resources().get("GPU", 0)
    if have < need:
        raise missing_gpus(need, have, "the Ray cluster has")


def log_partition(tracker: RunTracker, fed: Federation, baseline: dict[str, float], split: dict) -> None:
    """The class histogram (table and heatmap), the split itself (``federation_to_split``:
    re-runnable elsewhere with ``data.partition.kind=file``) and the majority-label reference accuracy."""
    tracker.log_table(fed.histogram_table(), "partition.csv")
    with tempfile.TemporaryDirectory() as tmp:
        histogram_heatmap(fed, Path(tmp) / "partition.png")
        tracker.log_file(Path(tmp) / "partition.png")
    tracker.log_text(dumps_split(split), "split.json")
    tracker.log_metrics(baseline, step=0)


def baseline_metrics(fed: Federation) -> dict[str, float]:
    """Each client predicting its most frequent training label: the reference every personalised
    accuracy is read against under label skew. NaN when no client has test data."""
    plain, weighted, _ = majority_baseline(fed)
    return {Metrics.ACC_MAJORITY_BASELINE: plain, Metrics.ACC_MAJORITY_BASELINE_WEIGHTED: weighted}


# --------------------------------------------------------------------------------------------- driver


def stream_rounds(
    runtime: Runtime,
    run_ref,
    progress: Progress,
    tracker: RunTracker,
    on_round,
    logged: list[int],
    on_joined: Callable[[WorkerJoined], None],
) -> dict:
    """Show and log the Coordinator's events until its ``run`` returns; returns its summary.
    ``logged[0]`` is the last round logged: a restarted Coordinator's recomputed rounds are shown
    again but logged (and reported to ``on_round``) once. ``on_joined``: a worker placed during the
    rounds (:meth:`RunSession.worker_joined`)."""
    done = False
    while not done:
        done = bool(ray.wait([run_ref], timeout=0)[0])
        for event in ray.get(runtime.coordinator.poll.remote(0.0 if done else 0.5)):
            progress.handle(event)
            if isinstance(event, RoundEnded):
                log_round(tracker, event.round, event.metrics, on_round, logged)
            elif isinstance(event, ClientFailed):
                log_failure(tracker, event)
            elif isinstance(event, WorkerJoined):
                on_joined(event)
    return ray.get(run_ref)


def log_failure(tracker: RunTracker, event: ClientFailed) -> None:
    """A failure's traceback (the first of its origin carries one) as the run's artifact
    ``failures/round-0001-client-3.txt`` (``round-0002-global-test-chunk-1.txt``, ...)."""
    failure = event.failure
    if failure.traceback:
        name = f"round-{event.round:04d}-{event.job.replace(', ', '-').replace(' ', '-')}.txt"
        tracker.log_text(f"{failure.line}\n\n{failure.traceback}", name, folder="failures")


def log_round(tracker: RunTracker, rnd: int, metrics: dict[str, float], on_round, logged: list[int]) -> None:
    """A round's metrics to MLflow and to ``on_round``, once: ``logged[0]`` is the last round logged."""
    if rnd > logged[0]:
        tracker.log_metrics(metrics, step=rnd)
        logged[0] = rnd
        if on_round is not None:
            on_round(rnd, metrics)


def log_unlogged_rounds(
    tracker: RunTracker, history: list[dict[str, float]], logged: list[int], on_round=None
) -> None:
    """Rounds the checkpoint holds but MLflow missed (the Coordinator runs ahead of the driver, which
    was stopped, or whose Coordinator died): logged now, once, so the curves have no holes."""
    for rnd, metrics in enumerate(history, start=1):
        log_round(tracker, rnd, metrics, on_round, logged)


def record_new_run(tracker: RunTracker, cfg, fed, baseline) -> RunTracker:
    """A new MLflow run's description, config, dataset input and partition."""
    tracker.describe(run_description(cfg))
    tracker.log_params(cfg)
    tracker.log_config(cfg)
    split = federation_to_split(fed)  # built once: the split.json artifact and the dataset digest
    tracker.log_dataset(federation_dataset(fed, cfg, split))
    log_partition(tracker, fed, baseline, split)
    return tracker


@dataclass
class Trial:
    """What a Ray Tune trial adds to a run: the sweep's MLflow run it is filed under, the placement
    group its processes must stay in, and how many workers that reservation holds."""

    parent_run_id: str | None = None
    placement_group: Any = None
    num_actors: int | None = None


# How long a run stopped early (Tune's scheduler) waits for its Coordinator to end the round in progress,
# so that its processes serve the driver's next run: a new Coordinator and ClientActors take 10-20 s
# to start on a 2-core machine, so a longer round is cut and its processes stopped.
HALT_WAIT_MAX_S = 30.0
HALT_WAIT_MIN_S = 5.0  # beside twice the last round's time: a tiny round's halt still has a moment
DEATH_WAIT_MAX_S = 60.0  # a restart waits this long at most for the old Coordinator to be gone


class CoordinatorHandle:
    """The run's processes (a Coordinator and its ClientActors) and the Coordinator's ``run`` call;
    a Coordinator that died is replaced by a fresh one at the run's last checkpoint."""

    def __init__(self, cfg: ExperimentConfig, fed: Federation, trial: Trial) -> None:
        self.cfg, self.fed, self.trial = cfg, fed, trial
        self.shard_refs = [ray.put(shard) for shard in fed.shards]  # the driver's: they outlive a Coordinator
        # one object-store copy for every (re)started Coordinator (Sent140's word vectors can be large)
        self.meta_ref = ray.put(federation_meta(fed))
        self.runtime, self.ready = self.launch()
        self.run_ref: Any = None

    def launch(self) -> tuple[Runtime, Any]:
        runtime = start_runtime(self.cfg, self.trial.placement_group, self.trial.num_actors)
        ready = runtime.coordinator.setup.remote(
            self.cfg, self.meta_ref, self.shard_refs, self.fed.global_test, runtime.workers,
            runtime.worker_options,
        )  # fmt: skip
        return runtime, ready

    def devices(self) -> dict[int, str]:
        """What each placed worker trains on, by pool slot, once the Coordinator is set up (its
        errors surface here)."""
        return ray.get(self.ready)["devices"]

    def load_checkpoint(self, ckpt_dir: str) -> list[dict[str, float]]:
        return ray.get(self.runtime.coordinator.load_checkpoint.remote(ckpt_dir))

    def start(self, ckpt_dir: str, stop_after_round: int | None) -> None:
        self.run_ref = self.runtime.coordinator.run.remote(ckpt_dir, stop_after_round)

    def restart(self, ckpt_dir: str) -> list[dict[str, float]]:
        """A fresh Coordinator at the last checkpoint (or at the start, before the first one);
        returns the checkpoint's rounds. The rounds after them are recomputed to the same numbers."""
        old = self.runtime.coordinator
        self.runtime.stop()
        wait_until_dead(old)
        StoppedProcesses.dead_now()  # the new pool's wait for the freed CPUs counts from here
        self.runtime, self.ready = self.launch()
        ray.get(self.ready)
        return self.load_checkpoint(ckpt_dir) if has_checkpoint(ckpt_dir) else []

    def client_models(self) -> tuple[dict[int, dict[str, torch.Tensor]], str]:
        return ray.get(self.runtime.coordinator.client_models.remote(self.cfg.tracking.log_client_models))

    def halted(self, ending: Ending = Ending.FINISHED) -> bool:
        """The Coordinator's ``run`` has returned, or returns at the end of its round: waited for about
        as long as a round takes, and at most ``HALT_WAIT_MAX_S`` (new processes start sooner than a
        longer round ends). False if it did not, or failed: a failure (its last checkpoint's write,
        say) is logged, as nothing else reports it, unless it is the algorithm's own error that the
        run has just stopped on (``Ending.OWN_ERROR``), which leaves the processes sound."""
        if self.run_ref is None:
            return True
        try:
            if not ray.wait([self.run_ref], timeout=0)[0]:
                last_round_s = ray.get(self.runtime.coordinator.halt.remote(), timeout=10)
                ray.wait([self.run_ref], timeout=min(HALT_WAIT_MAX_S, 2 * last_round_s + HALT_WAIT_MIN_S))
            ray.get(self.run_ref, timeout=0)  # its error, or GetTimeoutError if still running
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayError as err:
            if ending is Ending.OWN_ERROR and isinstance(getattr(err, "cause", None), ALGORITHM_ERRORS):
                return True  # the run's line already
            logger.warning("the stopped run's Coordinator failed as it halted: %s", first_line(err))
            return False

    def release(self, ending: Ending) -> None:
        """The run's processes end, or wait for the driver's next run when this one did not end
        ``BROKEN`` and its Coordinator halted. A Tune trial's failed run keeps nothing: Tune never
        hands a failed trial's process another trial."""
        in_a_trial = self.trial.placement_group is not None
        reusable = ending is not Ending.BROKEN and not (ending is Ending.OWN_ERROR and in_a_trial)
        if reusable and self.halted(ending):
            KeptRuntime.put(self.runtime, self.trial.placement_group)
        else:
            self.runtime.stop()


def wait_until_dead(actor: Any, timeout_s: float = DEATH_WAIT_MAX_S) -> bool:
    """Until Ray reports ``actor`` dead (``ray.kill`` only asks), at most ``timeout_s``; False if it
    was not. A Coordinator that was only unreachable (Ray's ``ActorUnavailableError`` is a
    ``RayActorError`` too) could otherwise land a checkpoint under its successor, deleting state
    files that the successor's store still lists."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass  # not dead yet
        except ray.exceptions.RayError:
            return True  # died (ActorDiedError), or its Ray went with it
        if time.monotonic() >= deadline:
            logger.warning("the old Coordinator was not reported dead within %.0f s", timeout_s)
            return False
        time.sleep(0.2)


def preflight(cfg: ExperimentConfig, new_run: bool = True) -> tuple[Federation, dict[str, float]]:
    """What can fail without Ray fails before it starts (the cluster's address, what this machine's
    Ray would lack, the tracking store, a new run's storage path, the data: the partition is built
    here); then Ray is started or joined, and asked for the CPUs and GPUs one worker needs."""
    require_before_ray(cfg, new_run)
    fed = prepare_federation(cfg)
    if new_run:  # a run saved before this check resumes as it was accepted
        require_a_step(cfg, fed)
    baseline = baseline_metrics(fed)
    ensure_ray(cfg)
    require_gpus(cfg)  # GPUs asked for that the cluster lacks: one line now, not a wait forever
    require_cpus(cfg)
    return fed, baseline


def require_a_step(cfg: ExperimentConfig, fed: Federation) -> None:
    """``train.drop_last`` drops each epoch's last partial batch: with a batch larger than every
    client's training split no client would take a single step, and the run would train nothing."""
    t = cfg.train
    most = max((len(shard.train) for shard in fed.shards), default=0)
    if t.drop_last and most < t.batch_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} with train.drop_last=true: no client has that many training "
            f"samples (the most is {most}), so none would train; lower the batch size or drop_last=false"
        )


def require_before_ray(cfg: ExperimentConfig, new_run: bool = True) -> None:
    """What the run's settings ask of this machine, its cluster address, its tracking store and (a new
    run's) storage path, each one line before Ray starts (a sweep checks these too)."""
    require_address_form(cfg)
    require_gpus(cfg, before_ray=True)
    require_cpus(cfg, before_ray=True)
    require_object_store_room(cfg)
    require_tracking_store(tracking_uri(cfg), tracking_uri_source())
    if new_run:  # a resume takes no overrides (ray.max_actors could not be lowered for it)
        require_memory_for_pool(cfg)
        require_storage(cfg)


def local_cpus(cfg: ExperimentConfig) -> int:
    """The CPUs a local Ray is started with: ``ray.num_cpus``, or the machine's."""
    return cfg.ray.num_cpus or os.cpu_count() or 1


def local_ray(cfg: ExperimentConfig) -> bool:
    """Whether the run will start a Ray of its own on this machine (no cluster, none joined yet)."""
    return not cfg.ray.cluster_address() and not ray.is_initialized()


def require_address_form(cfg: ExperimentConfig) -> None:
    """``RAY_ADDRESS`` (``ray.address`` is checked with the config) in a form Ray takes: one line, not
    Ray's traceback."""
    address = cfg.ray.cluster_address()
    if address and not address_ok(address):
        raise ConfigError(bad_address(cfg.ray.cluster_address_source(), address))


def require_cpus(cfg: ExperimentConfig, before_ray: bool = False) -> None:
    """A ClientActor needs ``ray.num_cpus_per_client`` CPUs on one node: where a local Ray has fewer,
    one line now, not a set-up that waits for room that never comes. ``before_ray``: this machine's
    CPUs, for a Ray the run will start; else the local Ray the process runs. A cluster is not asked:
    its nodes may join later (an autoscaler, a head without CPUs), and the set-up waits for room."""
    need = cfg.ray.num_cpus_per_client
    if before_ray:
        if not local_ray(cfg):
            return
        have: float = local_cpus(cfg)
        where = "ray.num_cpus is" if cfg.ray.num_cpus else "this machine has"
    else:  # a local Ray this process started (an earlier run's, say); a cluster's nodes may join later
        if cfg.ray.cluster_address():
            return
        have = max((node.get("CPU", 0.0) for node in node_resources()), default=0.0)
        where = "the local Ray has"
    if need > have:
        raise ConfigError(
            f"ray.num_cpus_per_client={need:g}: a ClientActor needs that many CPUs on one node, {where} "
            f"{have:g}; lower it"
        )


def require_object_store_room(cfg: ExperimentConfig) -> None:
    """A local Ray's ``ray.object_store_mb`` leaves Ray memory for its tasks (Ray's own rule: at least
    100 MB or 5 % of the total), or one line before Ray refuses it with a traceback."""
    store_mb = cfg.ray.object_store_mb
    if store_mb is None or not local_ray(cfg):
        return
    import psutil

    memory = psutil.virtual_memory()
    room = memory.available - min(100e6, 0.05 * memory.total)
    if store_mb * 2**20 > room:
        raise ConfigError(
            f"ray.object_store_mb={store_mb}: more than this machine's free memory allows "
            f"({room / 2**20:,.0f} MB); lower it, or leave it unset (Ray's default: 30 % of the memory)"
        )


# a ClientActor's own memory (USS) once torch, Lightning and the quickstart's model are loaded:
# 445 MB measured on CPU with torch 2.15's CUDA build; the floor of what a worker costs
WORKER_MEMORY_MB = 400


def require_memory_for_pool(cfg: ExperimentConfig) -> None:
    """The pool a local Ray would start (one ClientActor per ``ray.num_cpus_per_client`` CPUs, up to
    the clients) fits this machine's free memory, or one line now: Ray would otherwise start them all
    and its memory monitor kill them part way (``ray.num_cpus=500`` on a 2-core laptop)."""
    if not local_ray(cfg):
        return
    import psutil

    cpus = local_cpus(cfg)
    gpus = torch.cuda.device_count() if cfg.ray.num_gpus_per_client > 0 else 0
    workers = pool_size(cfg, {"CPU": cpus, "GPU": gpus})
    free_mb = psutil.virtual_memory().available / 2**20
    if (workers + 1) * WORKER_MEMORY_MB <= free_mb:  # and the Coordinator's process
        return
    if cfg.ray.max_actors == workers:
        what = f"ray.max_actors={workers}"
    elif cfg.ray.num_cpus:
        what = f"ray.num_cpus={cpus}"
    else:
        what = f"this machine's {cpus} CPUs"
    fits = int(free_mb // WORKER_MEMORY_MB) - 1
    if fits < 1:
        raise ConfigError(
            f"this machine's free memory ({free_mb / 1024:,.1f} GB) cannot hold a ClientActor and the "
            f"Coordinator, each a process of at least {WORKER_MEMORY_MB} MB; free some memory"
        )
    raise ConfigError(
        f"{what}: a pool of {workers} ClientActors, each a process of at least {WORKER_MEMORY_MB} MB, "
        f"needs more than this machine's free {free_mb / 1024:,.1f} GB; set ray.max_actors={fits} or lower"
    )


def reopen_run(
    session: RunSession,
    handle: CoordinatorHandle,
    run_id: str,
    on_round: Callable[[int, dict[str, float]], None] | None,
) -> str:
    """A resumed run: its MLflow run reopened, the Coordinator at its checkpoint, the rounds MLflow
    missed logged (and seen by ``on_round``: a resumed sweep trial's scheduler gets them too).
    Returns the checkpoint folder."""
    tracker = session.reopen(run_id)
    ckpt_dir = checkpoint_dir_of(run_id, tracker.uri)
    history = handle.load_checkpoint(ckpt_dir)
    log_unlogged_rounds(tracker, history, [tracker.last_step(Metrics.COMM_UP_BYTES)], on_round)
    return ckpt_dir


def drive(
    handle: CoordinatorHandle,
    tracker: RunTracker,
    ckpt_dir: str,
    stop_after_round: int | None,
    on_round: Callable[[int, dict[str, float]], None] | None,
    on_joined: Callable[[WorkerJoined], None],
) -> tuple[dict, Any]:
    """Show and log the rounds until the Coordinator's ``run`` returns, restarting a Coordinator that
    died (``ray.max_coordinator_restarts`` times). Returns its summary and, for a finished run, the
    personalised models worth logging."""
    cfg = handle.cfg
    logged, restarts = [tracker.last_step(Metrics.COMM_UP_BYTES)], 0
    personal = personal_on(Metrics.ACC_PERSONAL_MEAN, cfg.eval.clients)
    title = f"{cfg.algorithm} on {cfg.data.dataset}"
    with Progress(cfg.rounds, title, enabled=cfg.progress, personal=personal) as progress:
        while True:
            try:
                if handle.run_ref is None:  # the Coordinator died: a fresh one, at the last checkpoint
                    history = handle.restart(ckpt_dir)
                    progress.warn(
                        f"restarted from round {len(history)}'s checkpoint"
                        if history
                        else "restarted from the start (no checkpoint yet)"
                    )
                    # rounds the dead Coordinator checkpointed before the driver fetched their events
                    log_unlogged_rounds(tracker, history, logged, on_round)
                    for slot, device in handle.devices().items():  # its workers are new processes
                        on_joined(WorkerJoined(slot, device, replacement=True))
                    tracker.set_tags({Tags.COORDINATOR_RESTARTS: str(restarts)})
                    tracker.log_metrics({Metrics.RUN_COORDINATOR_RESTARTS: restarts}, step=logged[0])
                    handle.start(ckpt_dir, stop_after_round)
                summary = stream_rounds(
                    handle.runtime, handle.run_ref, progress, tracker, on_round, logged, on_joined
                )
                # the personalised models, fetched before the loop ends: a Coordinator that dies now
                # restarts at the last round's checkpoint and hands them over
                return summary, handle.client_models() if summary["finished"] else None
            except ray.exceptions.RayActorError as err:
                if restarts >= cfg.ray.max_coordinator_restarts:
                    raise
                restarts += 1
                progress.warn(
                    f"the Coordinator died ({first_line(err)}); restarting it, "
                    f"restart {restarts} of {cfg.ray.max_coordinator_restarts}"
                )
                handle.run_ref = None


def run_experiment(
    cfg: ExperimentConfig,
    *,
    resume_run_id: str | None = None,
    stop_after_round: int | None = None,
    tags: dict[str, str] | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    trial: Trial | None = None,
) -> Result:
    """Run (or resume) one federated experiment end to end and return its numbers.

    ``stop_after_round`` stops after that many rounds as an interruption would (the MLflow run is
    left KILLED, the checkpoint stays); ``on_round`` sees every round's metrics (Ray Tune reporting);
    ``trial`` places a Tune trial's processes in its reservation.
    """
    with contextlib.ExitStack() as folder:  # one command at a time on a run's folder, until this returns
        if resume_run_id is not None:  # another command still on it stops this one before Ray starts
            ckpt_dir = checkpoint_dir_of(resume_run_id, tracking_uri(cfg))
            folder.enter_context(held(ckpt_dir, f"--resume {resume_run_id}"))
        return _run_experiment(cfg, folder, resume_run_id, stop_after_round, tags, on_round, trial)


def _run_experiment(
    cfg: ExperimentConfig,
    folder: contextlib.ExitStack,
    resume_run_id: str | None,
    stop_after_round: int | None,
    tags: dict[str, str] | None,
    on_round: Callable[[int, dict[str, float]], None] | None,
    trial: Trial | None,
) -> Result:
    trial = trial or Trial()
    session = RunSession(cfg, tags, trial.parent_run_id)  # its clock starts: the MLflow run's Duration
    fed, baseline = preflight(cfg, new_run=resume_run_id is None)
    handle = CoordinatorHandle(cfg, fed, trial)
    with session.guard(handle.release):
        devices = handle.devices()  # algorithm and client set-up errors surface here
        if resume_run_id is not None:
            ckpt_dir = reopen_run(session, handle, resume_run_id, on_round)
        else:
            ckpt_dir = new_checkpoint_dir(cfg)  # before the MLflow run: its tag points here
            folder.enter_context(held(ckpt_dir))
        # the rounds start now; a new MLflow run is set up while the first one trains, and the events
        # wait in the Coordinator's queue until the driver streams them
        handle.start(ckpt_dir, stop_after_round)
        tracker = session.tracker or record_new_run(
            session.open({Tags.CHECKPOINT_DIR: ckpt_dir}), cfg, fed, baseline
        )
        session.watch(devices)
        summary, finals = drive(handle, tracker, ckpt_dir, stop_after_round, on_round, session.worker_joined)
        result = Result(
            tracker.run_id, tracker.experiment_id, cfg, summary["history"], summary["client_acc"],
            summary["finished"], 0.0, extra=baseline,
        )  # fmt: skip
        if finals is not None:
            client_models, note = finals
            resumed = resume_run_id is not None
            global_model = summary["global_model"], summary.get("global_arch")
            log_final(tracker, result, fed, global_model, client_models, note, resumed)
        result.wall_time_s = session.finish(summary["finished"])
    return result


def log_final(
    tracker: RunTracker,
    result: Result,
    fed: Federation,
    global_model: tuple[dict | None, str | None],
    client_models,
    note: str,
    resumed: bool = False,
) -> None:
    """Per-client final accuracies; the final global model (``runs:/<id>/global_model``) and the
    personalised client models (``runs:/<id>/client_<k>``) as MLflow models. A resumed run logs
    only what its last segment did not: that one may have been cut short while logging these."""
    frame = pd.DataFrame(
        [{"client": cid, "accuracy": acc} for cid, acc in sorted(result.client_acc.items())],
        columns=["client", "accuracy"],
    )
    tracker.log_table(frame, "client_accuracy.csv")
    cfg, step = result.config, len(result.history)
    example = normalize(fed.global_test.x[:2], fed.mean, fed.std)  # two real test samples

    meta = federation_meta(fed)

    def model_of(arch: str, state: dict) -> torch.nn.Module:
        model = model_of_arch(arch, meta)
        model.load_state_dict(state)
        return model

    logged = tracker.model_names() if resumed else set()
    global_state, global_arch = global_model
    if global_state is not None and "global_model" not in logged:
        # the homogeneous group's one architecture, unless the server's model says which it is
        arch = global_arch or arch_for_client(cfg.model.group, 0)
        tracker.log_model(model_of(arch, global_state), "global_model", example, step)
    # the input example goes with the first client model of each architecture: its validation and
    # its file are a quarter of a model's logging, the same for every other client of that architecture
    shown: set[str] = set()
    for cid, state in sorted(client_models.items()):
        arch = arch_for_client(cfg.model.group, cid)
        if f"client_{cid}" not in logged:
            tracker.log_model(
                model_of(arch, state), f"client_{cid}", example, step, with_example=arch not in shown
            )
        shown.add(arch)
    if note:
        tracker.set_tags({Tags.CLIENT_MODELS: note})
    final = {}
    for key in map(result.logged, BEST_KEYS):
        final[best_of(key)] = result.best(key)
        final[best_round_of(key)] = result.best_round(key)
        final[final_of(key)] = result.last(key)
    if resumed:
        final = {k: v for k, v in final.items() if tracker.last_step(k) < step}
    tracker.log_metrics({k: v for k, v in final.items() if v is not None}, step=step)


def saved_config(raw: dict[str, Any]) -> ExperimentConfig:
    """A run's saved config as the fedray that saved it read it: what it took then and a later check
    refuses becomes what it meant, so the run resumes to the same numbers."""
    # a run saved before model.init existed gave every client its own initial draw
    raw.setdefault("model", {}).setdefault("init", "per_client")
    ray_section, tracking = raw.get("ray") or {}, raw.get("tracking") or {}
    if ray_section.get("num_cpus") == 0:  # before 2026-11-30: all the machine's CPUs
        ray_section["num_cpus"] = None
    if raw.get("storage_path") == "":  # the working directory
        raw["storage_path"] = "."
    if (tracking.get("system_metrics_s") or 0) < 0:  # off
        tracking["system_metrics_s"] = 0
    cfg = build_config(raw)
    subset, kind = cfg.data.train_subset, cfg.data.partition.kind
    # larger than the pool (accepted then), it kept the whole pool, as no subset does
    if subset is not None and kind not in ("file", "natural") and subset > sample_pool(cfg.data)[0]:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_subset=None))
    return cfg


def resume_experiment(run_id: str, **kwargs: Any) -> Result:
    """Continue an interrupted run from its last checkpoint, to the same final numbers."""
    directory = checkpoint_dir_of(run_id)
    saved = storage.load_torch(checkpoint_file(directory))  # an altered checkpoint stops here, before Ray
    raw = saved_config_mapping(directory)
    try:
        cfg = saved_config(raw)
    except ConfigError as err:  # a setting in it that this fedray refuses: say whose setting it is
        raise ConfigError(f"the run's saved config {storage.join(directory, CONFIG_FILE)!r}: {err}") from None
    get_algorithm(cfg.algorithm).server_cls.check_saved(saved["server"])  # before Ray and the MLflow run
    return run_experiment(cfg, resume_run_id=run_id, **kwargs)
