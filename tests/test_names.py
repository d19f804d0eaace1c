"""The names runs are recorded under are a stored format: runs already in a store, saved views and
users' searches hold these strings, so the literals below are the point of the test. A rename here
is a change of format, made on purpose."""

from pathlib import Path

from fedray.platform.tracking.names import (
    Metrics,
    Params,
    RunKind,
    Tags,
    best_of,
    best_round_of,
    final_of,
    metric_column,
    param_column,
    personal_on,
    tag_filter,
)

README = Path(__file__).resolve().parent.parent / "README.md"

STORED = {
    Metrics: {
        "ACC_PERSONAL_MEAN": "acc/personal_mean",
        "ACC_PERSONAL_STD": "acc/personal_std",
        "ACC_PERSONAL_WEIGHTED": "acc/personal_weighted",
        "LOSS_PERSONAL": "loss/personal",
        "ACC_GLOBAL": "acc/global",
        "LOSS_GLOBAL": "loss/global",
        "ACC_PERSONAL_PREFIX": "acc/personal",
        "LOSS_TRAIN": "loss/train",
        "COMM_UP_BYTES": "comm/up_bytes",
        "COMM_DOWN_BYTES": "comm/down_bytes",
        "COMM_UP_BYTES_CUM": "comm/up_bytes_cum",
        "COMM_DOWN_BYTES_CUM": "comm/down_bytes_cum",
        "CLIENTS_SELECTED": "clients/selected",
        "CLIENTS_FAILED": "clients/failed",
        "CLIENTS_RETRIED": "clients/retried",
        "TIME_ROUND_S": "time/round_s",
        "TIME_CLIENT_S": "time/client_s",
        "TIME_TRAIN_S": "time/train_s",
        "TIME_AGGREGATE_S": "time/aggregate_s",
        "ACC_MAJORITY_BASELINE": "acc/majority_baseline",
        "ACC_MAJORITY_BASELINE_WEIGHTED": "acc/majority_baseline_weighted",
        "TIME_WALL_S": "time/wall_s",
        "RUN_COORDINATOR_RESTARTS": "run/coordinator_restarts",
        "TIME_PREFIX": "time/",
        "SYSTEM_PREFIX": "system/",
        "BEST_PREFIX": "best/",
        "BEST_ROUND_PREFIX": "best_round/",
        "FINAL_PREFIX": "final/",
    },
    Tags: {
        "ALGORITHM": "algorithm",
        "DATASET": "dataset",
        "PARTITION": "partition",
        "MODEL_GROUP": "model_group",
        "SEED": "seed",
        "LABEL": "label",
        "SWEEP_ID": "sweep_id",
        "TRIAL_ID": "trial_id",
        "DEVICE": "device",
        "WORKERS": "fedray.workers",
        "CHECKPOINT_DIR": "fedray.checkpoint_dir",
        "COORDINATOR_RESTARTS": "fedray.coordinator_restarts",
        "CLIENT_MODELS": "fedray.client_models",
        "STOPPED_EARLY": "fedray.stopped_early",
        "KIND": "fedray.kind",
        "UI_VIEW": "fedray.ui_view",
        "REPORT_RUNS": "fedray.report_runs",
        "RUN_NAME": "mlflow.runName",
        "PARENT_RUN_ID": "mlflow.parentRunId",
        "NOTE": "mlflow.note.content",
        "DATASET_CONTEXT": "mlflow.data.context",
        "SOURCE_DATASET": "fedray.dataset",
        "SOURCE_LOADER": "fedray.loader",
        "SHARED_VIEW_PREFIX": "mlflow.sharedViewState.",
    },
    RunKind: {"SWEEP": "sweep", "REPORT": "report"},
    Params: {
        "SEED": "seed",
        "ALGORITHM": "algorithm",
        "NAME": "name",
        "STORAGE_PATH": "storage_path",
        "PROGRESS": "progress",
        "CHECKPOINT_EVERY": "checkpoint_every",
        "NUM_CLIENTS": "data.num_clients",
        "DATA_PREFIX": "data.",
        "TRACKING_PREFIX": "tracking.",
        "RAY_PREFIX": "ray.",
    },
}


def test_every_name_is_the_string_stored_runs_hold():
    for group, expected in STORED.items():
        names = {k: v for k, v in vars(group).items() if k.isupper()}
        assert names == expected, group.__name__


def test_names_built_from_others():
    assert personal_on(Metrics.ACC_PERSONAL_MEAN, "all") == "acc/personal_mean"
    assert personal_on(Metrics.ACC_PERSONAL_WEIGHTED, "selected") == "acc/personal_weighted_selected"
    assert personal_on(Metrics.LOSS_PERSONAL, "sample") == "loss/personal_sample"
    assert best_of(Metrics.ACC_PERSONAL_MEAN) == "best/personal_mean"
    assert best_round_of(Metrics.ACC_GLOBAL) == "best_round/global"
    assert final_of(Metrics.ACC_PERSONAL_WEIGHTED) == "final/personal_weighted"
    assert metric_column(Metrics.ACC_GLOBAL) == "metrics.acc/global"
    assert param_column(Params.NUM_CLIENTS) == "params.data.num_clients"
    assert tag_filter(Tags.PARENT_RUN_ID, "abc") == "tags.mlflow.parentRunId = 'abc'"


def test_every_metric_the_platform_records_is_in_the_readme():
    readme = README.read_text()
    missing = [v for k, v in vars(Metrics).items() if k.isupper() and f"`{v}" not in readme]
    assert missing == []
