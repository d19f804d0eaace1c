"""Runs in one driver share their processes (``KeptRuntime``): a run starts on the last finished
run's Coordinator and ClientActors, emptied of that run, and computes what fresh processes compute.
A run stopped early (Tune's scheduler) hands them on once its Coordinator halts between rounds, and so
does a run that failed on its algorithm's own error (a broken rule, a round whose every client
failed). A run after any other failure, after a kept process died, or that needs other worker
resources, gets fresh ones. The local Ray a run starts holds no process it does not use."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import ray
from conftest import run_fresh_python, tiny_overrides, without_timing
from test_contract_rules import BrokenStepConfig  # noqa: F401  (registers brokenstep_probe)

from fedray.platform.catalog import load_config
from fedray.platform.runtime import processes
from fedray.platform.runtime.coordinator import pool_size
from fedray.platform.runtime.driver import CoordinatorHandle, run_experiment, wait_until_dead
from fedray.platform.runtime.processes import KeptRuntime, StoppedProcesses, available_resources
from fedray.platform.runtime.session import RunAborted


def kept_actors() -> dict[str, object]:
    """The kept Coordinator and ClientActors, by actor id."""
    kept = KeptRuntime.kept
    assert kept is not None, "the finished run's processes were not kept"
    return {actor._actor_id.hex(): actor for actor in [kept.coordinator, *kept.workers]}


def what_workers_hold() -> list[tuple[int, int, int, int]]:
    """Per kept worker: client modules, spare models, client data and payloads it still holds."""
    return ray.get(
        [
            w.__ray_call__.remote(
                lambda host: (len(host.modules), len(host.spare), len(host.data), len(host.payloads))
            )
            for w in KeptRuntime.kept.workers
        ]
    )


def all_dead(actors: dict[str, object], within_s: float = 60) -> bool:
    """Whether every actor is gone within ``within_s``: ``ray.kill`` is asynchronous, so a call made
    just after it may still be answered."""
    deadline = time.monotonic() + within_s
    for actor in actors.values():
        while True:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=within_s)
            except ray.exceptions.RayActorError:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


@pytest.mark.usefixtures("ray_session", "mlflow_store", "patient_pool_sizing")
def test_a_run_on_kept_processes_computes_what_fresh_processes_compute():
    KeptRuntime.release()  # whatever an earlier test left: the reference runs on new processes
    # clients that keep state: every worker caches client modules and data during the run
    cfg = load_config(None, tiny_overrides(algorithm="lgfedavg"))
    fresh = run_experiment(cfg)
    ids = set(kept_actors())
    assert len(ids) == 3  # the Coordinator and two ClientActors (ray.max_actors=2)
    assert what_workers_hold() == [(0, 0, 0, 0)] * 2

    between = run_experiment(load_config(None, tiny_overrides(algorithm="fedprox", seed=1)))
    assert between.finished and kept_actors().keys() == ids
    # a run that failed on its algorithm's own code (every client's training step raises) hands
    # its processes on too: they answered with that error, nothing broke in them
    with pytest.raises(RunAborted, match="selected clients failed"):
        run_experiment(load_config(None, tiny_overrides(algorithm="brokenstep_probe")))
    assert kept_actors().keys() == ids
    again = run_experiment(cfg)
    assert kept_actors().keys() == ids  # no process started for any of these runs
    assert without_timing(again.history) == without_timing(fresh.history)
    assert again.client_acc == fresh.client_acc


@pytest.mark.usefixtures("ray_session", "mlflow_store", "patient_pool_sizing")
def test_a_dead_kept_worker_other_worker_resources_or_a_failed_run_get_fresh_processes(monkeypatch):
    cfg = load_config(None, tiny_overrides(rounds=2))
    run_experiment(cfg)
    first = kept_actors()

    # a kept worker that died between runs (the OOM killer, a user's kill): Ray counts its call as
    # answered, with an error for a result. The next run starts on fresh processes instead (handed
    # the dead worker, it would fail at its set-up with ActorDiedError)
    dead = KeptRuntime.kept.workers[0]
    ray.kill(dead)
    assert all_dead({"worker": dead})
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # Ray shows the dead worker's CPU free
    assert ray.available_resources().get("CPU", 0) >= 1, "Ray did not show the dead worker's CPU in 60 s"
    # a pool sized by the CPUs alone (no ray.max_actors) counts that CPU once: counted again as a
    # kept worker's, it would start a third ClientActor that two CPUs never place, and the run's
    # set-up would wait for it forever (the wrapper caps what it starts at two, so this test ends)
    sizes: list[int] = []
    freed: list[dict[str, float]] = []  # what each stop counts as freed: not the dead worker's CPU again
    expect = StoppedProcesses.expect.__func__  # type: ignore[attr-defined]
    with monkeypatch.context() as patch:
        patch.setattr(
            processes,
            "pool_size",
            lambda c, free, nodes: sizes.append(pool_size(c, free, nodes)) or min(sizes[-1], 2),
        )
        patch.setattr(
            StoppedProcesses, "expect", classmethod(lambda cls, b, f: freed.append(f) or expect(cls, b, f))
        )
        assert run_experiment(
            load_config(None, tiny_overrides(rounds=2, **{"ray.max_actors": "null"}))
        ).finished
    assert sizes == [2]
    # on a cluster where other work holds CPUs, counting it again would make the run wait 5 s for a
    # CPU that never comes
    assert freed == [{"CPU": 1, "GPU": 0}], freed
    second = kept_actors()
    assert len(second) == 3 and not second.keys() & first.keys() and all_dead(first)

    other = load_config(None, tiny_overrides(rounds=2, **{"ray.num_cpus_per_client": 2}))
    run_experiment(other)
    third = kept_actors()
    assert not third.keys() & second.keys() and all_dead(second)

    def fail(rnd, metrics):
        raise RuntimeError("the driver's own error")

    with pytest.raises(RuntimeError, match="the driver's own error"):
        run_experiment(other, on_round=fail)
    # a run started at once counts the CPUs they held as free, though Ray shows them available only
    # about 0.1 s after ray.kill returned: it starts two ClientActors, not one
    assert pool_size(cfg, available_resources()) == 2
    assert KeptRuntime.kept is None  # a failed run's processes are not trusted with the next
    assert all_dead(third)


@pytest.mark.usefixtures("ray_session", "mlflow_store", "patient_pool_sizing")
def test_a_replacement_killed_as_its_run_hands_on_counts_its_cpu_for_the_next_pool(monkeypatch):
    """A run that ends with a replacement worker still waiting for its set-up (a worker died late in
    the run; the others finished its jobs) hands on the workers that run and kills that one. The
    next run, started at once, sizes its pool once Ray shows that worker's CPU free: sized before,
    it would count one CPU short and run on one worker (a run's tags said ``workers 1``)."""
    from fedray.platform.runtime import driver

    KeptRuntime.release()  # two fresh workers to start from
    started = []
    monkeypatch.setattr(
        driver, "start_runtime", lambda *a: started.append(processes.start_runtime(*a)) or started[-1]
    )
    cfg = load_config(None, tiny_overrides(rounds=2))

    def replace_a_worker_after_the_last_round(rnd, metrics):
        if rnd == cfg.rounds:  # the pool runs no job after this: its replacement stays unplaced
            ray.get(started[-1].coordinator.__ray_call__.remote(lambda loop: loop.pool.replace(1)))

    freed: list[dict[str, float]] = []
    expect = StoppedProcesses.expect.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        StoppedProcesses, "expect", classmethod(lambda cls, b, f: freed.append(f) or expect(cls, b, f))
    )
    assert run_experiment(cfg, on_round=replace_a_worker_after_the_last_round).finished
    assert freed == [{"CPU": 1, "GPU": 0}]  # the killed replacement's share, to be waited for
    assert len(KeptRuntime.kept.workers) == 1

    sizes: list[int] = []
    monkeypatch.setattr(
        processes, "pool_size", lambda c, free, nodes: sizes.append(pool_size(c, free, nodes)) or sizes[-1]
    )
    assert run_experiment(cfg).finished
    assert sizes == [2]


@pytest.mark.usefixtures("ray_session", "mlflow_store")
def test_a_run_stopped_early_hands_on_its_processes_once_its_coordinator_halts(tmp_path, monkeypatch):
    """Tune's scheduler stops a run after round 1 while its Coordinator, ahead of the driver, is in
    round 2 (held at a gate): a Coordinator that ends the round within the wait is halted there and the
    processes serve the next run; one still in its round after the wait has its processes stopped."""
    import gate_algorithm  # noqa: F401  (registers fedavg_gate)

    from fedray.platform.runtime.session import StoppedEarly

    run_experiment(load_config(None, tiny_overrides(rounds=2)))
    first = kept_actors()

    def gated(name: str):
        gate = tmp_path / name
        settings = {"algorithm": "fedavg_gate", "fedavg_gate.round": 1, "fedavg_gate.gate": str(gate)}
        return gate, load_config(None, tiny_overrides(rounds=4, **settings))

    def stop_after_round_1(gate, open_after_s: float | None):
        def on_round(rnd, metrics):
            while not Path(f"{gate}.reached").exists():  # the Coordinator is inside round 2
                time.sleep(0.05)
            if open_after_s is not None:
                threading.Timer(open_after_s, Path(f"{gate}.open").touch).start()
            raise StoppedEarly("stopped after round 1")

        return on_round

    # the wait, long here: on a loaded machine round 2 may take longer than a round's usual wait
    from fedray.platform.runtime import driver

    monkeypatch.setattr(driver, "HALT_WAIT_MIN_S", 600.0)
    monkeypatch.setattr(driver, "HALT_WAIT_MAX_S", 600.0)
    gate, cfg = gated("released")
    with pytest.raises(StoppedEarly):
        run_experiment(cfg, on_round=stop_after_round_1(gate, open_after_s=1.0))
    assert kept_actors().keys() == first.keys()  # halted after round 2: kept, not stopped
    after = run_experiment(load_config(None, tiny_overrides(rounds=2)))
    assert after.finished and kept_actors().keys() == first.keys()

    monkeypatch.setattr(driver, "HALT_WAIT_MIN_S", 1.0)  # and short: the held round outlasts it
    monkeypatch.setattr(driver, "HALT_WAIT_MAX_S", 1.0)
    gate, cfg = gated("held")
    with pytest.raises(StoppedEarly):
        run_experiment(cfg, on_round=stop_after_round_1(gate, open_after_s=None))  # never opened
    assert KeptRuntime.kept is None and all_dead(first)


def test_a_local_ray_starts_a_worker_process_per_actor_and_none_idle(tmp_path):
    """Ray prestarts a worker per CPU when a driver connects (a 16-CPU GPU node with four GPU workers:
    twelve idle processes of about 0.5 GB that imported torch and Lightning). The local Ray fedray
    starts has one worker process for each actor and no other. In a fresh process: this one's Ray
    serves the whole session. (Started as a run starts it, from a config that also caps its object
    store: ``ray.object_store_mb``.)"""
    script = """
        import os, psutil, ray
        from fedray.platform.catalog import load_config
        from fedray.platform.runtime.driver import ensure_ray

        ensure_ray(load_config(None, ["ray.num_cpus=2", "ray.object_store_mb=300"]))
        assert ray.cluster_resources()["object_store_memory"] == 300 * 2**20, ray.cluster_resources()

        @ray.remote(num_cpus=1)
        class One:
            def pid(self):
                return os.getpid()

        actor_pid = ray.get(One.remote().pid.remote())
        # Ray prestarts in the raylet's handler of the driver's connection, before it hears of the actor
        (raylet,) = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
        workers = [p.pid for p in raylet.children() if "agent" not in " ".join(p.cmdline()).lower()]
        print(workers == [actor_pid], workers, actor_pid)
        ray.shutdown()
    """
    done = run_fresh_python(script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "True", done.stdout


@ray.remote(num_cpus=0)  # as the Coordinator's run call: it never waits for CPUs that kept workers hold
def _a_run_that_failed_as_it_halted():
    raise OSError("no space left on device: checkpoint.pt")


@pytest.mark.usefixtures("ray_session")
def test_a_run_that_failed_as_it_halted_is_not_reused_and_says_why(caplog):
    # the Coordinator's run call, already returned with an error (its last checkpoint's write):
    # its processes are not handed on, and the error, which nothing else reports, is logged
    handle = object.__new__(CoordinatorHandle)
    handle.run_ref = _a_run_that_failed_as_it_halted.remote()
    # a loaded machine may take minutes to start the task's worker process
    assert ray.wait([handle.run_ref], timeout=600)[0], "the stand-in run call did not return"
    with caplog.at_level(logging.WARNING, logger="fedray.platform.runtime.driver"):
        assert handle.halted() is False
    assert "failed as it halted: OSError: no space left on device: checkpoint.pt" in caplog.text


@ray.remote(num_cpus=0)
class _Idle:
    def ping(self) -> bool:
        return True


@pytest.mark.usefixtures("ray_session")
def test_a_restart_waits_until_ray_reports_the_old_coordinator_dead(caplog):
    # an actor still running is not dead: waited for (here briefly), and said so
    alive = _Idle.remote()
    assert ray.get(alive.ping.remote(), timeout=600)  # its process may take minutes to start under load
    with caplog.at_level(logging.WARNING, logger="fedray.platform.runtime.driver"):
        assert wait_until_dead(alive, timeout_s=1.0) is False
    assert "not reported dead within 1 s" in caplog.text
    # killed (ray.kill only asks): returns once Ray says it is gone
    ray.kill(alive)
    assert wait_until_dead(alive, timeout_s=600.0) is True
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(alive.ping.remote(), timeout=10)


def test_the_resources_awaited_after_a_stop_add_up_over_stops_no_run_has_counted(monkeypatch):
    """What :func:`available_resources` waits for: what Ray showed available before the kill plus
    what the stopped processes held; a second stop before any run counted it adds to it."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(StoppedProcesses, "expected", {})
    monkeypatch.setattr(StoppedProcesses, "node", "")
    monkeypatch.setattr(KeptRuntime, "this_node", staticmethod(lambda: "node-a"))
    StoppedProcesses.expect({"CPU": 1.0, "GPU": 1.0, "memory": 5.0}, {"CPU": 0.0, "GPU": 0.5})
    assert StoppedProcesses.expected == {"GPU": 1.5}  # no CPU held: nothing to wait for there
    # stopped again before Ray showed the first ones' GPU slices (before: 1, though 1.5 are coming)
    clock[0] += 1
    StoppedProcesses.expect({"CPU": 1.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 0.0})
    assert StoppedProcesses.take() == ({"CPU": 3.0, "GPU": 1.5}, 101.0 + StoppedProcesses.WAIT_S)
    assert StoppedProcesses.take() == ({}, 0.0)  # taken once: a run sized its pool with it
    # a Ray started since (another node), or a run that comes after the wait would have ended: none
    StoppedProcesses.expect({"CPU": 0.0}, {"CPU": 2.0})
    monkeypatch.setattr(KeptRuntime, "this_node", staticmethod(lambda: "node-b"))
    assert StoppedProcesses.take() == ({}, 0.0)
    StoppedProcesses.expect({"CPU": 0.0}, {"CPU": 2.0})
    clock[0] += StoppedProcesses.WAIT_S
    assert StoppedProcesses.take() == ({}, 0.0)


def test_a_coordinators_restart_waits_for_the_freed_cpus_from_when_the_old_one_is_reported_dead(monkeypatch):
    """Ray may take seconds to report the old Coordinator dead on a loaded machine: the new pool's
    wait for the CPUs its stop freed counts from then, not from the stop (its 5 s would be spent)."""
    from fedray.platform.runtime import driver

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(StoppedProcesses, "expected", {})
    monkeypatch.setattr(KeptRuntime, "this_node", staticmethod(lambda: "node-a"))
    monkeypatch.setattr(driver, "wait_until_dead", lambda actor: clock.__setitem__(0, clock[0] + 8.0))
    monkeypatch.setattr(driver, "has_checkpoint", lambda path: False)
    monkeypatch.setattr(ray, "get", lambda ref: None)

    class OldRuntime:
        coordinator = "the old Coordinator"

        def stop(self):
            StoppedProcesses.expect({"CPU": 0.0}, {"CPU": 2.0})

    sized_with = []
    handle = object.__new__(CoordinatorHandle)
    handle.runtime = OldRuntime()
    handle.launch = lambda: sized_with.append(StoppedProcesses.take()) or ("new runtime", "ready")
    assert handle.restart("ckpt") == []
    assert sized_with == [({"CPU": 2.0}, 108.0 + StoppedProcesses.WAIT_S)]
    StoppedProcesses.dead_now()  # nothing pending: nothing to wait for
    assert StoppedProcesses.take() == ({}, 0.0)


def test_a_run_after_a_stop_waits_until_ray_shows_the_resources_or_the_wait_ends(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(StoppedProcesses, "expected", {})
    monkeypatch.setattr(KeptRuntime, "this_node", staticmethod(lambda: "node-a"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})

    def ray_shows(*seen: float) -> list[float]:
        shown = iter(seen)
        asked: list[float] = []
        monkeypatch.setattr(
            ray, "available_resources", lambda: asked.append(clock[0]) or {"CPU": next(shown)}
        )
        return asked

    StoppedProcesses.expect({"CPU": 0.0}, {"CPU": 2.0})
    asked = ray_shows(0.0, 1.0, 2.0, 2.0)
    assert available_resources() == {"CPU": 2.0} and len(asked) == 3  # until both CPUs show
    # more than the cluster has (a worker that died unreplaced): what it has is enough
    StoppedProcesses.expect({"CPU": 1.0}, {"CPU": 2.0})
    asked = ray_shows(0.0, 2.0)
    assert available_resources() == {"CPU": 2.0} and len(asked) == 2
    # taken by another driver meanwhile: asked until WAIT_S after the stop, then what there is
    StoppedProcesses.expect({"CPU": 0.0}, {"CPU": 2.0})
    stopped_at = clock[0]
    clock[0] += 1
    asked = ray_shows(*[1.0] * 1000)
    assert available_resources() == {"CPU": 1.0}
    assert asked[-1] >= stopped_at + StoppedProcesses.WAIT_S > asked[-2]
    # nothing stopped: asked once
    asked = ray_shows(0.0)
    assert available_resources() == {"CPU": 0.0} and len(asked) == 1


def test_a_stop_counts_as_freed_the_workers_of_the_coordinators_pool(monkeypatch):
    # without Ray: a worker that died and was replaced frees nothing when the run stops (its
    # replacement does); counted, it would make the driver's next run wait 5 s for resources that
    # never come. The Coordinator counts its pool's workers
    from fedray.platform.runtime.processes import Runtime

    class Coordinator:
        def __init__(self, answer):
            self.shutdown = type("Method", (), {"remote": staticmethod(lambda: answer)})

    def get(answer, timeout):
        if isinstance(answer, Exception):
            raise answer
        return answer

    freed: list[dict[str, float]] = []
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    monkeypatch.setattr(StoppedProcesses, "expect", classmethod(lambda cls, before, f: freed.append(f)))
    options = {"num_cpus": 1, "num_gpus": 0.25}
    Runtime(Coordinator(1), ["dead, replaced", "w1"], options).stop()  # the Coordinator's count
    Runtime(Coordinator(ray.exceptions.RayError()), ["w0", "w1"], options).stop()  # a dead Coordinator's
    assert freed == [{"CPU": 1, "GPU": 0.25}, {"CPU": 2, "GPU": 0.5}]


def test_a_coordinators_shutdown_counts_its_pools_workers_not_the_dead_it_replaced(monkeypatch):
    from fedray.platform.runtime import pool as pool_module
    from fedray.platform.runtime.coordinator import RoundLoop
    from fedray.platform.runtime.pool import WorkerPool

    killed = []
    monkeypatch.setattr(pool_module.ray, "kill", lambda worker, no_restart: killed.append(worker))
    loop = RoundLoop()
    loop.pool = WorkerPool(["w0", "w1"], spawn=lambda: ("w0 again", "its set-up"), pinned=False)
    loop.pool.replace(0)  # w0 died: its replacement waits for a node, or sets up
    killed.clear()
    assert loop.shutdown() == 2 and killed == ["w0 again", "w1"]
