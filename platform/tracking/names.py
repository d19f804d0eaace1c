"""The names of what fedray records in MLflow: metrics, run tags and params, and the forms MLflow's
searches spell them in (run-frame columns, filter strings).

This is the vocabulary every layer uses: the runtime and the author API write these names, the
tracking code, the sweeps, the reports and the apps read them back. Each is spelled here once. They
are a stored format: runs already in a store, saved views and users' searches hold the strings, so
renaming one changes the format. An algorithm's own statistics (``self.record("loss/prox", ...)``)
are the algorithm's names and are not listed here.

Nothing of fedray is imported here: the author API, below the tracking layer, records ``loss/train``
through this module, and the import contract places it at the bottom.
"""

from __future__ import annotations

from typing import Final

# The classes below are namespaces of constants (Final: the type check refuses an assignment).


class Metrics:
    """Metric names. Per-round metrics are logged at step = rounds completed; accuracies are
    fractions in [0, 1], losses cross-entropy per sample, sizes payload bytes, times seconds."""

    # evaluation, every eval_every rounds and at the last; the personalised ones are renamed by
    # personal_on when eval.clients is not "all"
    ACC_PERSONAL_MEAN: Final = "acc/personal_mean"  # each client's model on its own test split, mean
    ACC_PERSONAL_STD: Final = "acc/personal_std"  # population std over clients of those accuracies
    ACC_PERSONAL_WEIGHTED: Final = "acc/personal_weighted"  # the same clients' correct / test samples
    LOSS_PERSONAL: Final = "loss/personal"  # the same clients' loss per test sample
    ACC_GLOBAL: Final = "acc/global"  # the global model on the global test set (algorithms with one)
    LOSS_GLOBAL: Final = "loss/global"  # its loss per test sample
    ACC_PERSONAL_PREFIX: Final = "acc/personal"  # begins every personalised accuracy above

    # training and traffic, every round
    LOSS_TRAIN: Final = "loss/train"  # training loss (ClientModule's default), mean over batches, clients
    COMM_UP_BYTES: Final = "comm/up_bytes"  # the round's accepted uplinks
    COMM_DOWN_BYTES: Final = "comm/down_bytes"  # the round's downlinks to the selected clients
    COMM_UP_BYTES_CUM: Final = "comm/up_bytes_cum"  # uplink bytes summed over the rounds so far
    COMM_DOWN_BYTES_CUM: Final = "comm/down_bytes_cum"  # downlink bytes summed over the rounds so far
    CLIENTS_SELECTED: Final = "clients/selected"  # clients sampled this round
    CLIENTS_FAILED: Final = "clients/failed"  # of those, clients whose training failed (not aggregated)
    CLIENTS_RETRIED: Final = "clients/retried"  # clients re-run because their worker died or lost its GPU
    TIME_ROUND_S: Final = "time/round_s"  # the round in the Coordinator, evaluation included
    TIME_CLIENT_S: Final = "time/client_s"  # a client's receive, training and upload, mean over clients
    # the round's parts: its clients over the worker pool (from making its calls to the last uplink
    # in), and the server's aggregate; the rest of time/round_s is the server's configure,
    # evaluation and the Coordinator's own work
    TIME_TRAIN_S: Final = "time/train_s"
    TIME_AGGREGATE_S: Final = "time/aggregate_s"

    # once per run
    # step 0: each client predicting its most frequent training label, the reference personalised
    # accuracy is read against: mean over clients, and correct / test samples
    ACC_MAJORITY_BASELINE: Final = "acc/majority_baseline"
    ACC_MAJORITY_BASELINE_WEIGHTED: Final = "acc/majority_baseline_weighted"
    TIME_WALL_S: Final = "time/wall_s"  # step 0: the command's wall time, summed over resumes
    RUN_COORDINATOR_RESTARTS: Final = "run/coordinator_restarts"  # Coordinators restarted so far

    # families
    TIME_PREFIX: Final = "time/"  # timings: they differ between runs that compute the same numbers
    SYSTEM_PREFIX: Final = "system/"  # MLflow's system metrics of the driver's machine (CPU, memory, GPU)
    BEST_PREFIX: Final = "best/"  # at the end of a run: best_of
    BEST_ROUND_PREFIX: Final = "best_round/"  # at the end of a run: best_round_of
    FINAL_PREFIX: Final = "final/"  # at the end of a run: final_of


PERSONAL_METRICS = (
    Metrics.ACC_PERSONAL_MEAN,
    Metrics.ACC_PERSONAL_STD,
    Metrics.ACC_PERSONAL_WEIGHTED,
    Metrics.LOSS_PERSONAL,
)


def personal_on(metric: str, clients: str) -> str:
    """The name a run logs ``metric`` under: a personalised one names the clients ``eval.clients``
    evaluates (``acc/personal_mean`` on all of them, ``acc/personal_mean_selected`` on the round's
    selected ones, ``..._sample`` on a sample); any other metric keeps its name."""
    return metric if clients == "all" or metric not in PERSONAL_METRICS else f"{metric}_{clients}"


def best_of(metric: str) -> str:
    """``best/personal_mean``: the highest per-round value of ``acc/personal_mean``, logged at the end."""
    return Metrics.BEST_PREFIX + metric.split("/", 1)[1]


def best_round_of(metric: str) -> str:
    """``best_round/personal_mean``: the round (1-based) of that value, the first one on ties."""
    return Metrics.BEST_ROUND_PREFIX + metric.split("/", 1)[1]


def final_of(metric: str) -> str:
    """``final/personal_mean``: the last logged value of ``acc/personal_mean``, logged at the end."""
    return Metrics.FINAL_PREFIX + metric.split("/", 1)[1]


class Tags:
    """Run tags (strings)."""

    # what the run is: every fedray run has these (a run without ALGORITHM is not fedray's)
    ALGORITHM: Final = "algorithm"  # the registered name of the algorithm
    DATASET: Final = "dataset"  # the data.dataset name
    PARTITION: Final = "partition"  # the partition's short label, e.g. dir0.5
    MODEL_GROUP: Final = "model_group"  # model.group
    SEED: Final = "seed"  # the experiment's seed
    LABEL: Final = "label"  # a compare entry's label: reports group runs by it, else by ALGORITHM
    SWEEP_ID: Final = "sweep_id"  # the sweep's name, on its parent and on every trial
    TRIAL_ID: Final = "trial_id"  # Ray Tune's id of a sweep's trial

    # where and how it ran
    DEVICE: Final = "device"  # what the clients trained on, e.g. cpu
    WORKERS: Final = "fedray.workers"  # how many ClientActors trained them (a replacement not counted; resumed: the most a segment had)
    CHECKPOINT_DIR: Final = "fedray.checkpoint_dir"  # the folder (path or storage URI) a resume reads
    COORDINATOR_RESTARTS: Final = "fedray.coordinator_restarts"  # Coordinators restarted so far
    CLIENT_MODELS: Final = "fedray.client_models"  # which client models were not logged, and why
    STOPPED_EARLY: Final = "fedray.stopped_early"  # "true" on a trial the sweep's scheduler stopped
    KIND: Final = "fedray.kind"  # a RunKind, on the runs that hold no experiment of their own
    UI_VIEW: Final = "fedray.ui_view"  # a sweep parent's saved view of its trials (viewStateShareKey)
    REPORT_RUNS: Final = "fedray.report_runs"  # a report run: how many runs it read

    # MLflow's own, set or read by fedray
    RUN_NAME: Final = "mlflow.runName"  # the run's name, given at creation
    PARENT_RUN_ID: Final = "mlflow.parentRunId"  # a sweep trial's parent run
    NOTE: Final = "mlflow.note.content"  # the run's description in the UI

    # on a run's dataset input, not on the run
    DATASET_CONTEXT: Final = "mlflow.data.context"  # what the input was used for: "train"
    SOURCE_DATASET: Final = "fedray.dataset"  # an embedded dataset's source: its name
    SOURCE_LOADER: Final = "fedray.loader"  # an embedded dataset's source: how it was loaded

    # on the experiment, not on a run
    SHARED_VIEW_PREFIX: Final = "mlflow.sharedViewState."  # + a key: a saved view of the runs page


class RunKind:
    """Values of ``Tags.KIND``."""

    SWEEP: Final = "sweep"  # a sweep's parent run: its trials are its children
    REPORT: Final = "report"  # the run a report logged its files to


class Params:
    """Params: the resolved config flattened to dotted keys (``train.lr``), logged once per run. The
    config schema defines them; the ones read back by name are spelled here."""

    SEED: Final = "seed"  # the experiment's seed (read when a run has no seed tag)
    ALGORITHM: Final = "algorithm"  # the algorithm's registered name
    NAME: Final = "name"  # the experiment's name
    STORAGE_PATH: Final = "storage_path"  # where checkpoints are written
    PROGRESS: Final = "progress"  # whether the live display was on
    CHECKPOINT_EVERY: Final = "checkpoint_every"  # rounds between checkpoints
    NUM_CLIENTS: Final = "data.num_clients"  # clients in the federation
    DATA_PREFIX: Final = "data."  # every data param: equal ones and an equal seed make the same partition
    TRACKING_PREFIX: Final = "tracking."  # the MLflow settings
    RAY_PREFIX: Final = "ray."  # the Ray settings and placement


# the column prefixes of a frame of runs, as mlflow.search_runs names them (the report's frame too)
METRICS_COLUMN_PREFIX: Final = "metrics."
PARAMS_COLUMN_PREFIX: Final = "params."


def metric_column(name: str) -> str:
    """``metrics.acc/global``: a metric's column in a frame of runs."""
    return METRICS_COLUMN_PREFIX + name


def param_column(name: str) -> str:
    """``params.data.num_clients``: a param's column in a frame of runs."""
    return PARAMS_COLUMN_PREFIX + name


def tag_filter(tag: str, value: str) -> str:
    """An MLflow search filter (and what the UI's search box takes): runs whose ``tag`` is ``value``."""
    return f"tags.{tag} = '{value}'"
