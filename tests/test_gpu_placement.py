"""GPU placement without a GPU: what the runtime decides from the config and from Ray's assignment.

The machine has no GPU, so the placement test starts its own local Ray that declares two
(``num_gpus=2``) in a subprocess (the session's Ray is never touched): Ray then hands out 0.25 slices
of GPUs the process cannot use, which is the situation to get right. The device choice and the
sweep's bundles are checked without Ray.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from conftest import run_fresh_python, store_in, tiny_overrides
from mlflow.tracking import MlflowClient

from fedray.platform.apps.cli import main
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.runtime import driver as run_module
from fedray.platform.runtime.coordinator import pool_size
from fedray.platform.runtime.devices import worker_device
from fedray.platform.runtime.driver import run_experiment
from fedray.sweeps.tune_sweep import trial_actors, trial_resources


def config(*extra: str):
    return load_config(None, tiny_overrides(**dict(item.split("=", 1) for item in extra)))


def test_a_run_that_asks_for_no_gpu_trains_on_the_cpu_even_where_cuda_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node
    device, info = worker_device(config(), gpu_ids=("0",))
    assert device.type == "cpu" and info.describe() == "cpu"


def test_the_logged_model_is_checked_on_the_cpu_where_cuda_is_visible(mlflow_store, monkeypatch):
    # MLflow predicts the input example of a logged model on cuda when CUDA is visible: the driver
    # of a run on a GPU node held a CUDA context of its own (gpu-check on an H200, 2026-11-26)
    import mlflow.pytorch

    from fedray.platform.tracking.mlflow_run import RunTracker

    loaded_on = []
    load = mlflow.pytorch._load_model
    monkeypatch.setattr(
        mlflow.pytorch,
        "_load_model",
        lambda path, device=None, **kw: loaded_on.append(device) or load(path, **kw),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MLFLOW_DEFAULT_PREDICTION_DEVICE", raising=False)
    tracker = RunTracker(load_config(None, ["tracking.system_metrics_s=0"]))
    tracker.log_model(torch.nn.Linear(4, 2), "global_model", torch.zeros(3, 4))
    tracker.end()
    assert loaded_on == ["cpu"]
    assert "MLFLOW_DEFAULT_PREDICTION_DEVICE" not in os.environ


def test_a_gpu_slice_without_cuda_trains_on_the_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, info = worker_device(config("ray.num_gpus_per_client=0.25"), gpu_ids=("0",))
    assert device.type == "cpu"
    assert info.describe() == "cpu (Ray assigned GPU 0, but CUDA is not available in this process)"


def test_a_gpu_slice_with_cuda_trains_on_the_gpu_ray_assigned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    device, info = worker_device(config("ray.num_gpus_per_client=0.25"), gpu_ids=("3",))
    # Ray narrows CUDA_VISIBLE_DEVICES to the assigned GPU, which the process then sees as cuda:0
    assert device == torch.device("cuda", 0)
    assert info.describe() == "cuda (Fake GPU, Ray GPU 3)"


def test_a_trial_reserves_a_gpu_slice_per_client_actor_and_runs_that_many():
    cfg = config("ray.num_gpus_per_client=0.25", "ray.max_actors=2")
    factory = trial_resources(cfg)
    assert [b for b in factory.bundles if b] == [{"CPU": 1.0, "GPU": 0.25}] * 2
    assert trial_actors(cfg) == 2
    assert factory.required_resources == {"CPU": 2.0, "GPU": 0.5}


def test_a_worker_placed_during_the_rounds_counts_in_the_runs_device_and_workers_tags():
    from fedray.platform.runtime.events import WorkerJoined
    from fedray.platform.runtime.session import RunSession
    from fedray.platform.tracking.names import Tags

    class Tracker:
        def __init__(self) -> None:
            self.tags: list[dict[str, str]] = []

        def set_tags(self, tags: dict[str, str]) -> None:
            self.tags.append(tags)

        def system_metrics(self, every_s: float) -> None:
            return None

    session = RunSession(config(), None, None)
    session.tracker = tracker = Tracker()  # type: ignore[assignment]
    session.watch({0: "cpu (GPU 0)", 2: "cpu (GPU 0)"})  # slot 1's worker waits for room
    session.worker_joined(WorkerJoined(1, "cpu (GPU 1)", replacement=False))  # placed: one more
    session.worker_joined(WorkerJoined(1, "cpu (GPU 1)", replacement=True))  # replaced: nothing new to say
    session.worker_joined(WorkerJoined(0, "cpu", replacement=True))  # placed where another device was
    # a slot whose first worker's set-up failed joins with its replacement; a restarted Coordinator's
    # workers take the slots the run had
    session.worker_joined(WorkerJoined(3, "cpu", replacement=True))
    session.worker_joined(WorkerJoined(0, "cpu", replacement=True))
    assert tracker.tags == [
        {Tags.DEVICE: "cpu (GPU 0)", Tags.WORKERS: "2"},
        {Tags.DEVICE: "cpu (GPU 0); cpu (GPU 1)", Tags.WORKERS: "3"},
        {Tags.DEVICE: "cpu; cpu (GPU 0); cpu (GPU 1)", Tags.WORKERS: "3"},
        {Tags.DEVICE: "cpu; cpu (GPU 0); cpu (GPU 1)", Tags.WORKERS: "4"},
    ]


def test_a_resumed_runs_tags_name_every_segments_device_and_the_most_workers_one_had(mlflow_store):
    from fedray.platform.runtime.events import WorkerJoined
    from fedray.platform.runtime.session import RunSession
    from fedray.platform.tracking.names import Tags

    cfg = config("tracking.system_metrics_s=0")  # no monitor thread to close
    first = RunSession(cfg, None, None)
    first.open({})
    first.watch({i: "cuda (NVIDIA H200, Ray GPU 0)" for i in range(4)})  # four workers on a GPU node
    first.tracker.end("KILLED")  # type: ignore[union-attr]

    resumed = RunSession(cfg, None, None)  # resumed on a CPU node with two workers
    resumed.reopen(first.tracker.run_id)  # type: ignore[union-attr]
    resumed.watch({0: "cpu", 1: "cpu"})
    resumed.worker_joined(WorkerJoined(2, "cpu", replacement=False))
    tags = MlflowClient(mlflow_store).get_run(resumed.tracker.run_id).data.tags  # type: ignore[union-attr]
    assert (tags[Tags.DEVICE], tags[Tags.WORKERS]) == ("cpu; cuda (NVIDIA H200, Ray GPU 0)", "4")
    resumed.tracker.end("FINISHED")  # type: ignore[union-attr]

    again = RunSession(cfg, None, None)  # and once more, with more workers than ever
    again.reopen(first.tracker.run_id)  # type: ignore[union-attr]
    again.watch({i: "cpu" for i in range(5)})
    tags = MlflowClient(mlflow_store).get_run(again.tracker.run_id).data.tags  # type: ignore[union-attr]
    assert (tags[Tags.DEVICE], tags[Tags.WORKERS]) == ("cpu; cuda (NVIDIA H200, Ray GPU 0)", "5")
    again.tracker.end("FINISHED")  # type: ignore[union-attr]


def test_gpus_asked_for_where_the_cluster_has_none_fail_in_one_line(
    ray_session, mlflow_store, monkeypatch, capsys
):
    started = []
    monkeypatch.setattr(run_module, "start_runtime", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError) as err:
        run_experiment(config("ray.num_gpus_per_client=0.25"))
    message = str(err.value)
    assert "ray.num_gpus_per_client=0.25: the Ray cluster has 0 GPUs" in message and "\n" not in message
    assert started == []  # no actor was started to wait for a GPU
    assert MlflowClient(mlflow_store).search_experiments(filter_string="name = 'quickstart'") == []
    # the command line in a process already joined to a cluster (its own ray.init) asks the cluster,
    # not this machine
    assert main(["run", *tiny_overrides(), "ray.num_gpus_per_client=0.25"]) == 2
    assert "the Ray cluster has 0 GPUs" in capsys.readouterr().err


def test_gpus_this_machine_lacks_fail_before_a_local_ray_and_a_cluster_is_asked_instead(monkeypatch):
    import ray

    from fedray.platform.config import RayConfig
    from fedray.platform.runtime.devices import require_visible_gpus

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # this process has joined no Ray yet
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"ray.num_gpus_per_client=0.25: this machine has 0 GPUs"):
        require_visible_gpus(0.25, RayConfig().cluster_address())
    # a cluster to join, from the config or from RAY_ADDRESS (which wins): its GPUs count, not these
    assert RayConfig(address="head:6379").cluster_address() == "head:6379"
    assert RayConfig(address="head:6379").cluster_address_source() == "ray.address"
    require_visible_gpus(0.25, RayConfig(address="head:6379").cluster_address())
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert RayConfig(address="head:6379").cluster_address() == "10.0.0.1:6379"
    assert RayConfig(address="head:6379").cluster_address_source() == "RAY_ADDRESS"
    require_visible_gpus(0.25, RayConfig().cluster_address())


PLACEMENT = textwrap.dedent(
    """
    import json, os, sys, time
    import gate_algorithm  # registers fedavg_gate (tests/ is on PYTHONPATH)
    import ray
    from mlflow.tracking import MlflowClient
    from fedray.platform.catalog import load_config
    from fedray.platform.runtime.coordinator import pool_size
    from fedray.platform.runtime.driver import run_experiment, start_local_ray
    from fedray.platform.runtime.processes import KeptRuntime, node_resources, sharing_processes
    from fedray.platform.tracking.names import Metrics, Tags
    from ray._private import state
    from ray.util.placement_group import placement_group, remove_placement_group

    # fedray's local Ray (its workers at nice 0, not Ray's 15, which starves them on a loaded machine)
    start_local_ray(2, num_gpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    cfg = load_config(None, json.loads(sys.argv[1]))
    gate = cfg.algo.gate
    # other work holds 0.6 of each GPU: Ray says 0.8 GPU is free, three quarters by the sum, but each
    # GPU has room for one
    held = [placement_group([{"GPU": 0.6}]) for _ in range(2)]
    assert all(pg.wait(60) for pg in held)
    for _ in range(300):  # Ray's view of what is free catches up with the groups a moment later
        if round(ray.available_resources().get("GPU", 0.0), 6) == 0.8:
            break
        time.sleep(0.2)
    pool = pool_size(cfg, ray.available_resources(), node_resources())
    free_gpu = []

    # the Coordinator starts the replacement of a dead worker, which inherits its runtime env: Ray
    # must still assign that one its slice, while the Coordinator itself sees no GPU
    @ray.remote(num_cpus=0, num_gpus=0.25)
    class Replacement:
        def gpu_ids(self):
            return ray.get_gpu_ids()

    def started_by(coordinator):
        return os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get(Replacement.remote().gpu_ids.remote())

    def pending():
        return [a for a in state.actors().values() if a["State"] not in ("ALIVE", "DEAD")]

    def on_round(rnd, metrics):
        free_gpu.append(round(ray.available_resources().get("GPU", 0.0), 6))
        if rnd == 1:  # the Coordinator waits at round 2's gate: the other work frees one GPU now
            while not os.path.exists(f"{gate}.reached"):
                time.sleep(0.05)
            remove_placement_group(held.pop(0))
            for _ in range(1500):  # the third worker, placed there
                if not pending():
                    break
                time.sleep(0.2)
            open(f"{gate}.open", "w").close()

    with sharing_processes():  # the run's Coordinator kept, for the check after it
        result = run_experiment(cfg, on_round=on_round)
        for _ in range(150):  # an unplaced worker is killed as the run ends (ray.kill does not wait)
            left = pending()
            if not left:
                break
            time.sleep(0.2)
        for pg in held:  # room for the replacement
            remove_placement_group(pg)
        coordinator = KeptRuntime.kept.coordinator
        coordinator_sees, replacement_gpus = ray.get(coordinator.__ray_call__.remote(started_by))
    tags = MlflowClient().get_run(result.run_id).data.tags
    print(json.dumps({
        "coordinator_sees": coordinator_sees,
        "replacement_gpus": replacement_gpus,
        "pool": pool,
        "pending_after_the_run": len(left),
        "workers": tags[Tags.WORKERS],
        "device": tags[Tags.DEVICE],
        "free_gpu_during_rounds": free_gpu,
        "finished": result.finished,
        "failed": sum(h[Metrics.CLIENTS_FAILED] for h in result.history),
    }))
    ray.shutdown()
    """
)


def test_a_kept_gpu_worker_set_up_for_a_run_without_deterministic_kernels_drops_them(monkeypatch):
    from fedray.platform.runtime.devices import configure_device

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cuda = torch.device("cuda", 0)  # process-wide flags only: at a whole GPU nothing calls CUDA
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    flags = [cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32]
    try:
        configure_device(cuda, config("train.deterministic=true").train, 1.0)
        assert torch.are_deterministic_algorithms_enabled()
        configure_device(cuda, config("train.deterministic=false").train, 1.0)  # the next run, same process
        assert not torch.are_deterministic_algorithms_enabled() and cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = flags


def test_the_pool_is_as_many_workers_as_the_scarcer_of_cpus_and_gpu_slices():
    quarter = config("ray.num_gpus_per_client=0.25", "ray.max_actors=null", "data.num_clients=20")
    assert pool_size(quarter, {"CPU": 4, "GPU": 1}) == 4  # four quarters of one GPU
    assert pool_size(quarter, {"CPU": 16, "GPU": 1}) == 4  # more CPUs add no slice
    assert pool_size(quarter, {"CPU": 16, "GPU": 2}) == 8
    assert pool_size(quarter, {"CPU": 2, "GPU": 1}) == 2  # the CPUs bind
    # Ray puts a slice on one GPU and an actor on one node; a pool Ray cannot place waits forever
    fill = ("ray.max_actors=null", "data.num_clients=20")
    assert pool_size(config("ray.num_gpus_per_client=0.4", *fill), {"CPU": 16, "GPU": 2}) == 4
    assert pool_size(config("ray.num_gpus_per_client=0.75", *fill), {"CPU": 16, "GPU": 3}) == 3
    assert pool_size(quarter, {"CPU": 16, "GPU": 1.5}) == 6  # a GPU in use: the half left holds two
    # a GPU node of one CPU beside an 8-CPU node: one GPU worker; 2 CPUs a client on two 3-CPU nodes: two
    assert pool_size(quarter, {"CPU": 9, "GPU": 1}, [{"CPU": 1, "GPU": 1}, {"CPU": 8}]) == 1
    # a GPU node without CPUs (Ray leaves the key out) holds none
    assert pool_size(quarter, {"CPU": 9, "GPU": 2}, [{"GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 8}]) == 1
    two_cpus = config("ray.num_cpus_per_client=2", *fill)
    assert pool_size(two_cpus, {"CPU": 6}, [{"CPU": 3}, {"CPU": 3}]) == 2
    assert pool_size(two_cpus, {"CPU": 2}, [{"CPU": 3}, {"CPU": 3}]) == 1  # what is free binds too
    assert (
        pool_size(config("ray.max_actors=null", "data.num_clients=20"), {"CPU": 16, "GPU": 1}) == 16
    )  # no GPU


def test_quarter_gpu_slices_go_where_a_gpu_has_room_and_one_none_has_joins_when_a_gpu_frees(tmp_path):
    gated = {"algorithm": "fedavg_gate", "fedavg_gate.round": 1, "fedavg_gate.gate": str(tmp_path / "gate")}
    overrides = [o for o in tiny_overrides(rounds=4, **gated) if not o.startswith("ray.max_actors")]
    overrides += ["ray.num_gpus_per_client=0.25", "ray.num_cpus_per_client=0.5", "ray.pool_wait_s=5"]
    overrides += [f"storage_path={tmp_path / 'store'}"]
    done = run_fresh_python(
        PLACEMENT, json.dumps(overrides), cwd=tmp_path, env={"MLFLOW_TRACKING_URI": store_in(tmp_path)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Ray's free GPUs are a sum (0.8), so the pool is sized at three quarters; two GPUs have room for
    # one each: the run starts on those two (rather than waiting forever for the third), holding
    # their two slices in round 1. The other work then frees one GPU, while the Coordinator waits at
    # round 2's gate: the third worker is placed there, joins the run and holds its slice in rounds
    # 2-4, and the run's tags count it. Four quarters filling one GPU are left to the pool_size test
    # above and to make gpu-check: here they would cost two more processes importing torch
    assert seen["pool"] == 3 and seen["workers"] == "3", seen
    assert seen["free_gpu_during_rounds"] == [0.3, 0.65, 0.65, 0.65], seen
    assert seen["pending_after_the_run"] == 0
    # each worker was assigned its GPU by Ray, cannot use it here, trained on the CPU and said so
    assert seen["device"] == "; ".join(
        f"cpu (Ray assigned GPU {gpu}, but CUDA is not available in this process)" for gpu in (0, 1)
    ), seen
    assert seen["finished"] and seen["failed"] == 0
    assert seen["coordinator_sees"] == "" and seen["replacement_gpus"] in ([0], [1]), seen
