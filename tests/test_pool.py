"""Dispatch policy of the worker pool, without Ray: which job an idle worker takes next, and what a
round's training calls carry."""

from types import SimpleNamespace

import pytest

from fedray.platform.config import RayConfig
from fedray.platform.errors import ConfigError
from fedray.platform.runtime import dispatch
from fedray.platform.runtime import pool as pool_module
from fedray.platform.runtime.coordinator import worker_asks
from fedray.platform.runtime.dispatch import TrainingDispatch
from fedray.platform.runtime.failures import ClientCodeError, Failure
from fedray.platform.runtime.pool import PLACEMENT_WAIT_S, Job, PoolClosed, WorkerPool, unplaced
from fedray.platform.runtime.state_store import StateStore


def test_a_jobs_arguments_are_made_when_it_is_first_sent_and_let_go_once_it_is_done():
    made = []

    class Worker:
        class train:  # an actor method's shape: .remote(...)
            @staticmethod
            def remote(*args):
                return ("ref", args)

    job = Job(0, "train", lambda: made.append(1) or ("tasks",))
    assert made == []  # nothing made until a worker takes the job
    assert job.submit(Worker()) == ("ref", ("tasks",))
    job.submit(Worker())  # a retry sends what the first call sent
    assert made == [1] and job.args == ("tasks",)
    job.done()
    assert job.args == ()


def jobs(*prefers):
    return [Job(key, "train", (), prefer) for key, prefer in enumerate(prefers)]


def test_a_worker_takes_its_cached_client_first():
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=False)
    queue = jobs(None, (1, 0), (0, 0))
    assert pool.pick(queue, 0).key == 2  # its own, though not first in line
    assert pool.pick(queue, 1).key == 1


def test_otherwise_the_largest_uncached_job_before_another_workers_client():
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=False)
    assert pool.pick(jobs((1, 0), None, None), 0).key == 1
    # nothing else left: it steals rather than idle
    assert pool.pick(jobs((1, 0)), 0).key == 0


def test_a_replaced_worker_caches_nothing():
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=False)
    pool.generation[1] += 1  # as replace() does after a death
    queue = jobs((1, 0), None)
    assert pool.pick(queue, 0).key == 0  # (1, 0) names a dead worker: anyone may take it
    assert pool.identity(1) == (1, 1)


def test_pinned_clients_run_only_on_their_own_worker():
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=True)
    queue = jobs((1, 0), (1, 0))
    assert pool.pick(queue, 0) is None
    assert pool.pick(queue, 1).key == 0
    assert pool.pick(jobs(None), 0).key == 0  # work of no client (global test chunks) runs anywhere


def test_a_pinned_client_runs_elsewhere_while_its_worker_waits_for_a_node():
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=True)
    pool.placing[1] = "set-up of a replacement no node has room for yet"
    assert pool.pick(jobs((1, 1)), 0).key == 0
    assert pool.pick(jobs((0, 0)), 1) is None  # a client whose worker runs still waits for it


def test_a_run_starts_with_the_first_workers_ray_placed_and_says_so_in_one_line_when_none(monkeypatch):
    # Ray sizes a pool from sums of free resources: a worker no GPU has room for waits for a node
    # (the pool's placing slots, as a replacement) while the others train
    waits = []

    def wait(refs, num_returns, timeout):
        waits.append((num_returns, timeout))
        up = [r for r in refs if not r.startswith("stuck")]
        return up[:num_returns], [r for r in refs if r not in up[:num_returns]]

    monkeypatch.setattr(pool_module.ray, "wait", wait)
    assert unplaced(["up0", "stuck1", "up2"], "1 CPU", wait_s=60) == {1: "stuck1"}
    # the first up within PLACEMENT_WAIT_S, then the others given ray.pool_wait_s at least
    assert waits[0] == (1, PLACEMENT_WAIT_S) and waits[1][0] == 3 and waits[1][1] >= 60
    with pytest.raises(ConfigError) as err:
        unplaced(
            ["stuck0", "stuck1"], worker_asks(RayConfig(num_cpus_per_client=1, num_gpus_per_client=0.25)), 60
        )
    message = str(err.value)
    assert "none of the run's 2 ClientActors (1 CPU and 0.25 GPU each) could be placed in 600 s" in message
    assert "\n" not in message


def test_a_worker_placed_late_is_checked_and_counted_before_it_takes_a_job(monkeypatch):
    # the first workers are checked as the run starts (the run's folder seen from their node); one
    # placed later, or a replacement, is checked when it is placed, and a failed check stops the run.
    # The hook hears the worker's slot and what it trains on; one whose set-up failed is not placed
    # (its first job fails and replaces it), and one that died since is left to its first job
    def get(ref):
        if ref == "set-up that failed":
            raise pool_module.ray.exceptions.RayTaskError("setup", "Traceback", RuntimeError("x"))
        return {"device": f"cpu ({ref})"}

    monkeypatch.setattr(pool_module.ray, "wait", lambda refs, timeout: (refs, []))
    monkeypatch.setattr(pool_module.ray, "get", get)
    monkeypatch.setattr(pool_module.ray, "kill", lambda worker, no_restart: None)
    spawned = iter([("w1 again", "set-up of w1 again")])
    pool = WorkerPool(["w0", "w1"], spawn=lambda: next(spawned), pinned=False, placing={1: "set-up of w1"})
    checked = []
    pool.on_placed = lambda slot, worker, info: checked.append((slot, worker, info["device"]))
    assert pool.ready(0) and checked == []
    assert pool.ready(1) and checked == [(1, "w1", "cpu (set-up of w1)")] and pool.placing == {}
    pool.replace(1)  # w1 died
    assert pool.ready(1) and checked[1:] == [(1, "w1 again", "cpu (set-up of w1 again)")]
    pool.placing[0] = "set-up that failed"
    assert pool.ready(0) and len(checked) == 2 and pool.placing == {}

    def died(slot, worker, info):
        raise pool_module.ray.exceptions.RayActorError()

    pool.placing[0], pool.on_placed = "set-up of a replacement", died
    assert pool.ready(0)

    def refuse(slot, worker, info):
        raise ConfigError("storage_path: the run's folder is not there on node 10.0.0.2")

    pool.placing[0], pool.on_placed = "set-up of a replacement", refuse
    with pytest.raises(ConfigError, match="not there on node"):
        pool.ready(0)


@pytest.mark.parametrize("commits", [False, True])
def test_a_broadcast_is_put_in_the_object_store_once_a_round(monkeypatch, commits):
    """50 clients sharing one downlink: one object, so each worker reads it once (it keys what it
    read by the object's ref); a client's own downlink goes with its call, never put on its own;
    clients that share one of several downlinks get one object per downlink."""
    stored = []
    monkeypatch.setattr(dispatch.ray, "put", lambda value: stored.append(value) or f"ref{len(stored)}")
    pool = WorkerPool(["w0", "w1"], spawn=lambda: ("new", None), pinned=False)
    clients = list(range(50))
    store = StateStore()
    store.directory = "/the/run"
    training = TrainingDispatch(pool, store, [f"shard{c}" for c in clients], [50] * 50, commits)
    broadcast = {"model": "the global state"}

    jobs = training.jobs(0, clients, dict.fromkeys(clients, broadcast))
    assert stored == [broadcast]
    sent = [boxed for job in jobs for boxed in job.args()[2]]
    assert len(sent) == 50 and all(boxed == ["ref1"] for boxed in sent)

    stored.clear()
    own = {c: {"model": f"state of {c}"} for c in clients}
    jobs = training.jobs(1, clients, own)
    assert stored == []
    by_client = {c: boxed[0] for job in jobs for c, boxed in zip(job.key, job.args()[2], strict=True)}
    assert by_client == own

    halves = [{"model": "even"}, {"model": "odd"}]
    jobs = training.jobs(2, clients, {c: halves[c % 2] for c in clients})
    assert sorted(stored, key=str) == sorted(halves, key=str)
    sent = {c: boxed[0] for job in jobs for c, boxed in zip(job.key, job.args()[2], strict=True)}
    assert {sent[c] for c in clients[::2]} == {f"ref{stored.index(halves[0]) + 1}"}


def test_uplinks_are_handed_on_in_client_order_as_soon_as_all_before_them_are_in():
    """Calls end out of order; the server gets each accepted uplink once, in client-id order, as soon
    as every smaller client has an outcome; a failed client (its own error, or its whole call) is
    skipped, not waited for."""
    from fedray.platform.runtime.worker import ClientResult

    handed: list[dict] = []
    in_order = dispatch.InOrder([7, 1, 4, 3, 9, 5], lambda uplinks: handed.append(uplinks))

    def results(*clients, failed=()):
        return [
            ClientResult(c, None if c in failed else f"up{c}", {}, Failure("boom") if c in failed else None)
            for c in clients
        ]

    in_order.call_done((4, 5), results(4, 5))
    assert handed == []  # 1 and 3 are still training
    in_order.call_done((1,), results(1))
    assert handed == [{1: "up1"}]
    in_order.call_done((3, 7), results(3, 7, failed=(3,)))  # 3 raised: 4, 5 and 7 follow 1
    assert handed == [{1: "up1"}, {4: "up4", 5: "up5", 7: "up7"}]
    in_order.call_done((9,), None)  # its call failed: nothing to hand on
    assert handed == [{1: "up1"}, {4: "up4", 5: "up5", 7: "up7"}]
    assert in_order.next == 6 and in_order.outcomes == {}


class FakeWorker:
    """An actor handle whose every call, ``.method.remote(key)``, returns ``key`` as its ref."""

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda key: key)


def fake_ray(monkeypatch, get, killed: list | None = None) -> None:
    """WorkerPool.run on :class:`FakeWorker` calls: each call done in the order sent, its outcome
    ``get(key)``; the actors killed appended to ``killed``."""
    monkeypatch.setattr(
        pool_module.ray, "wait", lambda refs, num_returns, timeout=None: ([refs[0]], refs[1:])
    )
    monkeypatch.setattr(pool_module.ray, "get", get)
    monkeypatch.setattr(
        pool_module.ray, "kill", lambda actor, no_restart: None if killed is None else killed.append(actor)
    )


def test_a_job_is_done_once_with_its_value_after_its_worker_died_and_none_when_its_code_raised(monkeypatch):
    """WorkerPool.run's on_done: the retried job of a killed worker reports only its final value; a
    job whose own code raised reports None; each job exactly once."""

    class OwnError(pool_module.ray.exceptions.RayError):
        pass

    # c's code raised in its worker, which built the report (its line, the algorithm's frame)
    reported = Failure(
        "KeyError: 'x' (at algorithms/a.py:3 in upload)", "KeyError (at algorithms/a.py:3 in upload)"
    )
    own = pool_module.ray.exceptions.RayTaskError("train", "Traceback ...", ClientCodeError(reported))
    outcomes = {
        "a": [pool_module.ray.exceptions.RayActorError(), "value a"],
        "b": [OwnError("b raised")],
        "c": [own.as_instanceof_cause()],  # as Ray raises it: a RayTaskError(ClientCodeError)
    }

    def get(key):
        outcome = outcomes[key].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    fake_ray(monkeypatch, get)
    pool = WorkerPool([FakeWorker()], spawn=lambda: (FakeWorker(), None), pinned=False)
    pool.ready = lambda slot: True  # the replacement is placed at once
    done = []
    out = pool.run([Job(k, "train", (k,)) for k in "abc"], on_done=lambda k, v: done.append((k, v)))
    assert sorted(done) == [("a", "value a"), ("b", None), ("c", None)]
    assert out.retried == ["a"] and set(out.failed) == {"b", "c"}
    assert out.failed["c"] == reported and out.failed["b"].line == "OwnError: b raised"


def test_a_worker_the_pools_shutdown_killed_mid_call_is_not_replaced(monkeypatch):
    """The driver stops a run whose Coordinator is still in a round: shutdown() (the Coordinator's
    other thread) kills the workers, their calls fail in run(), which ends there. A replacement
    started then would import torch beside the next run and hold a CPU it counts as freed."""
    spawned, killed = [], []

    def get(key):
        raise pool_module.ray.exceptions.RayActorError()  # the call of a worker shutdown() killed

    fake_ray(monkeypatch, get, killed)
    pool = WorkerPool([FakeWorker()], spawn=lambda: spawned.append(1) or (FakeWorker(), None), pinned=False)
    pool.shutdown()
    with pytest.raises(PoolClosed, match="worker 0 lost as the pool shut down: no replacement started"):
        pool.run([Job("a", "train", ("a",))])
    assert spawned == []
    # before its shutdown, the same death is replaced (and the job retried)
    live = WorkerPool([FakeWorker()], spawn=lambda: spawned.append(1) or (FakeWorker(), None), pinned=False)
    live.ready = lambda slot: True
    with pytest.raises(PoolClosed, match="no replacement started"):  # the replacement's call fails too...
        live.run([Job("a", "train", ("a",))], on_retry=lambda key, why: live.shutdown())  # ...once shut
    assert spawned == [1]
    # shut down while a replacement spawns (the other thread): that one is killed here
    racing = WorkerPool([FakeWorker()], spawn=lambda: (racing.shutdown() or "new worker", None), pinned=False)
    killed.clear()
    with pytest.raises(PoolClosed, match="its replacement killed"):
        racing.replace(0)
    assert killed.count("new worker") == 1 and racing.workers == ["new worker"]


def test_a_round_the_pools_shutdown_ends_returns_quietly(tmp_path, monkeypatch):
    """The Coordinator's run() after PoolClosed: the driver stops the run and kills the Coordinator
    next, and never fetches the result, so an error there would be printed by Ray as "Unhandled"."""
    from fedray.platform.runtime import coordinator

    loop = object.__new__(coordinator.RoundLoop)
    waited = []
    loop.store = SimpleNamespace(directory=None)
    loop.commits = False
    loop.checkpoints = SimpleNamespace(wait=lambda quietly=False: waited.append(quietly))
    loop.server, loop.record = "server", "record"

    def run_rounds(stop_after_round):
        raise PoolClosed("worker 0 lost as the pool shut down: no replacement started")

    loop.run_rounds = run_rounds
    monkeypatch.setattr(
        coordinator.results, "run_summary", lambda finished, server, record: {"finished": finished}
    )
    assert loop.run(str(tmp_path)) == {"finished": False}
    assert waited == [True]  # the checkpoint on its way lands (or fails) quietly, as on any error


def test_the_uplinks_the_last_outcome_releases_are_left_to_aggregate():
    """Once every selected client has an outcome no client trains any more: what that last outcome
    releases is not handed on early (the server's aggregate sums it, and time/aggregate_s shows it)."""
    from fedray.platform.runtime.worker import ClientResult

    handed: list[dict] = []
    in_order = dispatch.InOrder([2, 0, 1], lambda uplinks: handed.append(uplinks))
    in_order.call_done((1, 2), [ClientResult(c, f"up{c}", {}) for c in (1, 2)])
    assert handed == []
    in_order.call_done((0,), [ClientResult(0, "up0", {})])
    assert handed == []  # 0, 1 and 2 all released by the round's last outcome


def test_a_rounds_training_hands_its_uplinks_on_while_calls_end(monkeypatch):
    """TrainingDispatch.run wires the pool's outcomes through InOrder to ``on_uplinks``: calls ending
    out of order reach it in client-id order (what the last outcome releases left to aggregate), and
    it returns every uplink."""
    from fedray.platform.runtime.pool import Outcome
    from fedray.platform.runtime.worker import ClientResult

    class Pool:
        pinned = False

        def __len__(self):
            return 2

        def run(self, jobs, on_retry, on_done):
            out = Outcome({}, {}, [])
            for job in sorted(jobs, key=lambda j: [1, 5, 3, 4].index(j.key[0])):  # the order calls end in
                value = [ClientResult(c, {"model": f"w{c}"}, {}) for c in job.key]
                out.results[job.key] = (value, (0, 0))
                on_done(job.key, value)
            return out

    monkeypatch.setattr(dispatch.ray, "put", lambda value: value)
    monkeypatch.setattr(dispatch, "TRAIN_CLIENTS_PER_JOB", 1)  # a call per client
    training = TrainingDispatch(Pool(), StateStore(), shards=[None] * 6, sizes=[5] * 6, commits=False)
    handed = []
    broadcast = {"model": "global"}
    downlinks = {c: broadcast for c in [5, 1, 3, 4]}
    uplinks, _, failed, _ = training.run(0, [5, 1, 3, 4], downlinks, lambda *a: None, handed.append)
    assert handed == [{1: {"model": "w1"}}, {3: {"model": "w3"}}]  # 4 releases 4 and 5: the last outcome
    assert list(uplinks) == [1, 3, 4, 5] and failed == {}
