"""Dispatch policy of the worker pool, without Ray: which job an idle worker takes next."""

from fedray.platform.runtime.pool import Job, WorkerPool


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
