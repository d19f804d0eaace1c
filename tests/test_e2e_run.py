"""End to end through real Ray actors and a real (temporary) sqlite MLflow store."""

import math
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
from conftest import tiny_overrides, without_timing
from mlflow.tracking import MlflowClient

from fedray.platform.catalog import load_config
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.tracking.names import (
    Metrics,
    Params,
    Tags,
    best_of,
    best_round_of,
    final_of,
    personal_on,
)


@pytest.mark.usefixtures("ray_session")
def test_three_round_run_logs_params_metrics_and_artifacts(mlflow_store):
    cfg = load_config(None, tiny_overrides(algorithm="fedprox", **{"fedprox.mu": 0.1}))
    result = run_experiment(cfg)

    assert result.finished and len(result.history) == 3
    client = MlflowClient(mlflow_store)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "fedprox-synthetic-dir1-s0"
    assert run.data.params["fedprox.mu"] == "0.1"
    assert run.data.params[Params.NUM_CLIENTS] == "4"
    assert run.data.tags[Tags.ALGORITHM] == "fedprox"

    # every per-round metric read back equals what the Result holds
    for key in (
        Metrics.ACC_PERSONAL_MEAN,
        Metrics.ACC_GLOBAL,
        Metrics.COMM_UP_BYTES,
        Metrics.LOSS_TRAIN,
        "loss/prox",
    ):
        logged = client.get_metric_history(result.run_id, key)
        assert [m.step for m in logged] == [1, 2, 3], key
        assert [m.value for m in logged] == pytest.approx([h[key] for h in result.history]), key
    assert math.isclose(run.data.metrics[Metrics.ACC_GLOBAL], result.final[Metrics.ACC_GLOBAL])
    assert result.final[Metrics.ACC_GLOBAL] > 0.3  # synthetic classes are separable: well above chance (0.1)

    # FedAvg-style payloads: each of the 4 clients gets and sends one full model per round
    h = result.history[0]
    assert h[Metrics.COMM_DOWN_BYTES] == h[Metrics.COMM_UP_BYTES] - 4 * 8  # uplinks also carry num_samples
    assert result.history[-1][Metrics.COMM_UP_BYTES_CUM] == 3 * h[Metrics.COMM_UP_BYTES]

    # the round's parts: its clients over the pool and the server's aggregate, inside the round
    for h in result.history:
        parts = h[Metrics.TIME_TRAIN_S] + h[Metrics.TIME_AGGREGATE_S]
        assert h[Metrics.TIME_AGGREGATE_S] > 0 and h[Metrics.TIME_CLIENT_S] < h[Metrics.TIME_TRAIN_S]
        assert parts < h[Metrics.TIME_ROUND_S]

    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "partition.csv", "partition.png", "client_accuracy.csv", "split.json"} <= artifacts
    mlflow.set_tracking_uri(mlflow_store)
    logged = mlflow.search_logged_models([run.info.experiment_id], output_format="list")
    models = {m.name for m in logged if m.source_run_id == run.info.run_id}
    assert models == {"global_model"}  # clients are evaluated with the global model
    assert "global model" in run.data.tags[Tags.CLIENT_MODELS]


@pytest.mark.usefixtures("ray_session")
def test_local_sends_nothing_and_has_no_global_model(mlflow_store, tmp_path):
    result = run_experiment(load_config(None, tiny_overrides(algorithm="local", rounds=2)))
    assert all(h[Metrics.COMM_UP_BYTES] == 0 and h[Metrics.COMM_DOWN_BYTES] == 0 for h in result.history)
    assert result.final[Metrics.ACC_GLOBAL] is None
    assert result.final[Metrics.ACC_PERSONAL_MEAN] > 0.3
    # personalised models are logged: every client trained, so all four
    mlflow.set_tracking_uri(mlflow_store)
    logged = mlflow.search_logged_models([result.experiment_id], output_format="list")
    assert sorted(m.name for m in logged if m.source_run_id == result.run_id) == [
        f"client_{k}" for k in range(4)
    ]
    model = mlflow.pytorch.load_model(f"runs:/{result.run_id}/client_2")
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)  # the synthetic set has 10 classes
    # the input example goes with the architecture's first client model; every one has the signature
    info = {k: mlflow.models.get_model_info(f"runs:/{result.run_id}/client_{k}") for k in (0, 2)}
    assert info[0].saved_input_example_info is not None and info[2].saved_input_example_info is None
    assert info[2].signature == info[0].signature and info[2].signature is not None


@pytest.mark.usefixtures("ray_session")
def test_split_written_by_one_run_reproduces_it_in_another(mlflow_store, tmp_path):
    overrides = tiny_overrides(rounds=2, **{"data.partition.alpha": 0.3})
    first = run_experiment(load_config(None, overrides))
    client = MlflowClient(mlflow_store)
    split = client.download_artifacts(first.run_id, "split.json", str(tmp_path))

    # read back on a different actor pool (1 actor instead of 2): numbers depend on neither
    again = run_experiment(
        load_config(
            None, [*overrides, "data.partition.kind=file", f"data.partition.path={split}", "ray.max_actors=1"]
        )
    )
    assert without_timing(again.history) == without_timing(first.history)
    assert again.client_acc == first.client_acc
    # the majority-label reference is logged once and shown beside the personalised numbers
    for run in (first, again):
        logged = client.get_run(run.run_id).data.metrics[Metrics.ACC_MAJORITY_BASELINE]
        assert logged == pytest.approx(run.extra[Metrics.ACC_MAJORITY_BASELINE])
        assert 0 < logged < 1
        assert run.summary_row()["majority baseline %"] == round(100 * logged, 2)
    metrics, last = client.get_run(first.run_id).data.metrics, first.history[-1]
    assert metrics[best_of(Metrics.ACC_PERSONAL_MEAN)] == max(
        h[Metrics.ACC_PERSONAL_MEAN] for h in first.history
    )
    assert metrics[final_of(Metrics.ACC_PERSONAL_WEIGHTED)] == last[Metrics.ACC_PERSONAL_WEIGHTED]
    assert metrics[best_round_of(Metrics.ACC_PERSONAL_MEAN)] in (1, 2)


def test_eval_policies_pick_clients_and_say_so_in_the_metric_name():
    from fedray.platform.runtime.evaluation import eval_clients

    cfg = load_config(
        None, tiny_overrides(**{"data.num_clients": 10, "eval.clients": "sample", "eval.sample_size": 3})
    )
    sample = eval_clients(cfg, 4, [1, 2])
    assert len(sample) == 3 and sample == eval_clients(cfg, 4, [1, 2]) != eval_clients(cfg, 5, [1, 2])
    # the names a user reads in MLflow: the literal strings are the point here
    assert personal_on(Metrics.ACC_PERSONAL_MEAN, cfg.eval.clients) == "acc/personal_mean_sample"
    cfg.eval.clients = "selected"
    assert eval_clients(cfg, 4, [7, 2]) == [7, 2]
    assert personal_on(Metrics.ACC_PERSONAL_MEAN, cfg.eval.clients) == "acc/personal_mean_selected"
    assert personal_on(Metrics.ACC_GLOBAL, cfg.eval.clients) == "acc/global"  # not a personalised one
    cfg.eval.clients = "all"
    assert eval_clients(cfg, 4, [7, 2]) == list(range(10))
    assert personal_on(Metrics.ACC_PERSONAL_MEAN, cfg.eval.clients) == "acc/personal_mean"


@pytest.mark.usefixtures("ray_session")
def test_selected_only_evaluation_and_a_checkpoint_of_current_states_only(mlflow_store):
    from fedray.platform.api.algorithm import sample_clients

    cfg = load_config(
        None,
        tiny_overrides(
            rounds=2,
            checkpoint_every=1,
            # a client state is committed only when it outlives its round: FedAvg's does with momentum kept
            **{"train.fraction": 0.5, "eval.clients": "selected", "train.keep_optimizer_state": True},
        ),
    )
    result = run_experiment(cfg)
    last = result.history[-1]
    selected_mean = personal_on(Metrics.ACC_PERSONAL_MEAN, "selected")
    assert Metrics.ACC_PERSONAL_MEAN not in last and 0 < last[selected_mean] <= 1
    assert sorted(result.client_acc) == sample_clients(cfg.seed, 1, 4, 2)  # the last round's two clients
    assert Metrics.ACC_GLOBAL in last  # the global model is still tested on the global test set
    # the end of the run sums up the metric the rounds logged, under its name
    metrics = MlflowClient(mlflow_store).get_run(result.run_id).data.metrics
    assert metrics["best/personal_mean_selected"] == max(h[selected_mean] for h in result.history)
    assert metrics["final/personal_mean_selected"] == last[selected_mean]
    assert "best/personal_mean" not in metrics and "final/global" in metrics
    assert result.summary_row()["personal acc % (selected)"].startswith(f"{100 * last[selected_mean]:.2f} ± ")

    # the checkpoint directory is tagged; it holds one file per client that trained, at its latest
    # version (each round's checkpoint pruned the versions it superseded)
    ckpt_dir = Path(MlflowClient(mlflow_store).get_run(result.run_id).data.tags[Tags.CHECKPOINT_DIR])
    assert (ckpt_dir / "checkpoint.pt").is_file() and ckpt_dir.name.startswith("fedavg-synthetic-dir1-s0-")
    trained = sample_clients(cfg.seed, 0, 4, 2) + sample_clients(cfg.seed, 1, 4, 2)
    expected = sorted(f"{c}-v{trained.count(c)}.pt" for c in set(trained))
    assert sorted(p.name for p in (ckpt_dir / "states").iterdir()) == expected


@pytest.mark.usefixtures("ray_session")
def test_a_run_cut_short_while_logging_its_end_logs_the_rest_once_on_resume(mlflow_store, monkeypatch):
    # the tracking server goes as the run logs its final metrics, its global model already logged:
    # the resume trains nothing (its checkpoint holds the last round) and logs only what is missing
    from fedray.platform.errors import ConfigError
    from fedray.platform.runtime.driver import resume_experiment
    from fedray.platform.tracking.mlflow_run import RunTracker

    final = final_of(Metrics.ACC_GLOBAL)
    log_metrics = RunTracker.log_metrics

    def server_gone_at_the_finals(self, metrics, step):
        if final in metrics:
            raise OSError("tracking server gone")
        return log_metrics(self, metrics, step)

    with monkeypatch.context() as patch:
        patch.setattr(RunTracker, "log_metrics", server_gone_at_the_finals)
        with pytest.raises(OSError, match="tracking server gone"):
            run_experiment(load_config(None, tiny_overrides(rounds=2)))
    client = MlflowClient(mlflow_store)
    (cut,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert cut.info.status != "FINISHED" and final not in cut.data.metrics

    resumed = resume_experiment(cut.info.run_id)
    assert resumed.finished and len(resumed.history) == 2
    run = client.get_run(cut.info.run_id)
    assert run.info.status == "FINISHED"
    models = client.search_logged_models([run.info.experiment_id], f"source_run_id = '{run.info.run_id}'")
    assert [m.name for m in models] == ["global_model"]  # not logged twice
    assert [m.step for m in client.get_metric_history(run.info.run_id, final)] == [2]
    with pytest.raises(ConfigError, match=f"--resume {run.info.run_id}: the run finished"):
        resume_experiment(run.info.run_id)


@pytest.mark.usefixtures("ray_session")
def test_a_run_is_created_knowing_its_checkpoint_folder(mlflow_store, monkeypatch):
    # a run interrupted as its MLflow run is being described is told to resume: it must find where
    from fedray.platform.tracking.mlflow_run import RunTracker

    def server_gone(self, text):
        raise OSError("tracking server gone")

    monkeypatch.setattr(RunTracker, "describe", server_gone)
    with pytest.raises(OSError, match="tracking server gone"):
        run_experiment(load_config(None, tiny_overrides(rounds=2)))
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert Path(run.data.tags[Tags.CHECKPOINT_DIR]).is_dir()


def test_each_architectures_first_client_model_carries_the_input_example():
    """Without MLflow or Ray: log_final gives the input example to the first client model of each
    architecture of a mixed group only; one that a resume's last segment logged still counts."""
    from fedray.platform.models import arch_for_client
    from fedray.platform.runtime.driver import Result, federation_meta, log_final, prepare_federation
    from fedray.platform.runtime.worker import model_of_arch

    cfg = load_config(None, tiny_overrides(algorithm="lgfedavg", **{"model.group": "small_hetero"}))
    fed = prepare_federation(cfg)
    archs = [arch_for_client(cfg.model.group, cid) for cid in range(4)]
    assert len(set(archs)) > 1 and len(set(archs)) < 4  # some architectures shared, some not
    meta = federation_meta(fed)
    states = {cid: model_of_arch(archs[cid], meta).state_dict() for cid in range(4)}

    class Recorder:
        def __init__(self, logged):
            self.logged, self.calls = logged, []

        def model_names(self):
            return self.logged

        def log_model(self, model, name, example, step=0, with_example=True):
            self.calls.append((name, with_example))

        def __getattr__(self, name):  # every other logging call: nothing to check here
            return lambda *args, **kwargs: 0

    result = Result("run", "0", cfg, [], {}, True, 0.0)
    fresh = Recorder(set())
    log_final(fresh, result, fed, (None, None), states, "")
    firsts = {archs.index(a) for a in set(archs)}
    assert fresh.calls == [(f"client_{cid}", cid in firsts) for cid in range(4)]

    resumed = Recorder({"client_0"})  # the last segment logged client 0, with its example
    log_final(resumed, result, fed, (None, None), {cid: states[cid] for cid in range(4)}, "", resumed=True)
    assert resumed.calls == [(f"client_{cid}", cid in firsts - {0}) for cid in range(1, 4)]
