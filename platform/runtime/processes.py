"""The run's processes: its Coordinator and first ClientActors, started together, stopped at its end,
or kept for the driver's next run while ``sharing_processes()`` is open (``docs/runtime.md``, "Runs
in one driver")."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from fedray.platform.config import ExperimentConfig
from fedray.platform.runtime.coordinator import (
    Coordinator,
    coordinator_scheduling,
    pool_size,
    start_worker,
    worker_options,
)


@dataclass
class Runtime:
    """The run's processes: the Coordinator and the first ClientActors, started together."""

    coordinator: Any
    workers: list
    worker_options: dict[str, Any]

    def held(self, workers: int | None = None) -> dict[str, float]:
        """What the workers hold: their CPUs and GPU slices (of ``workers`` of them; by default,
        every one the run started with)."""
        cpus, gpus = worker_resources(self.worker_options)
        count = len(self.workers) if workers is None else workers
        return {"CPU": cpus * count, "GPU": gpus * count}

    def available_before_kill(self) -> dict[str, float] | None:
        """Ray's available resources just before some of these processes are killed, for the next
        run to wait for what they free (:class:`StoppedProcesses`). None for workers in a Tune
        trial's placement group: they free their resources into its bundles, which no pool is sized
        by (a trial's pool is its bundles)."""
        import ray

        if "scheduling_strategy" in self.worker_options:
            return None
        with contextlib.suppress(Exception):  # no Ray, or one that no longer answers
            return dict(ray.available_resources())
        return None

    def expect_freed(self, before: dict[str, float] | None, workers: int | None = None) -> None:
        """The next run waits for what ``workers`` of these workers held (all of them by default)
        once they are killed (:class:`StoppedProcesses`); ``before``: :meth:`available_before_kill`.
        Never raises: a failure costs the next run that wait, never these processes."""
        if before is not None:
            with contextlib.suppress(Exception):  # a Ray Client connection lost meanwhile
                StoppedProcesses.expect(before, self.held(workers))

    def stop(self) -> None:
        import ray

        before = self.available_before_kill()
        # the Coordinator kills the workers it started as replacements (a dead one took them with
        # it), and counts its pool's workers: not a dead one it replaced. Without its count, every
        # worker the run started with counts
        pooled = None
        with contextlib.suppress(ray.exceptions.RayError):
            pooled = ray.get(self.coordinator.shutdown.remote(), timeout=10)
        for actor in [self.coordinator, *self.workers]:
            with contextlib.suppress(Exception):  # a handle of a Ray since shut down
                ray.kill(actor)
        self.expect_freed(before, pooled)


class KeptRuntime:
    """The Coordinator and ClientActors of the last finished run, kept for the next one while
    ``sharing_processes()`` is open (``fedray compare``, a notebook's loop, the test session) or in a
    Tune trial's process (:meth:`keep_between_trials`): a run on them starts at once instead of
    waiting seconds for new processes to import torch and Lightning. Idle, they hold their CPUs and
    GPU slices, so they are kept only where the next run is known to come: inside that scope or
    that trial's placement group, on the same Ray, for a run with the same worker resources, and
    after a failed run only if it failed on the algorithm's own error (``RunSession.guard``)."""

    sharing = 0  # open sharing_processes() scopes
    between_trials = False  # this process is a Tune trial's, reused for the sweep's next trial
    kept: Runtime | None = None
    node: str = ""  # the node the kept processes' Ray was joined from
    group: str | None = None  # the placement group they run in (a trial's), or None

    @classmethod
    def keep_between_trials(cls) -> None:
        """This process runs a Tune trial and Tune hands it the sweep's next trial in the same
        placement group (``reuse_actors``): a finished trial's processes wait there for that one.
        They need no stopping: Tune ends this process and removes the group when it has no next
        trial, and Ray ends the actors with their owner and their group."""
        cls.between_trials = True

    @staticmethod
    def this_node() -> str:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    @classmethod
    def put(cls, runtime: Runtime, placement_group=None) -> None:
        """After a run that ended well: its processes, emptied, wait for the next run if one may
        have them; otherwise they stop."""
        import ray

        next_run_may_come = cls.between_trials if placement_group is not None else cls.sharing
        if next_run_may_come:
            before = runtime.available_before_kill()
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                workers, killed = ray.get(runtime.coordinator.release.remote(), timeout=30)
                # a replacement still waiting for a node was killed: the next run's pool counts its
                # share once Ray shows it free (else a pool sized at once misses its CPU)
                if killed:
                    runtime.expect_freed(before, killed)
                cls.kept, cls.node, cls.group = (
                    Runtime(runtime.coordinator, workers, runtime.worker_options),
                    cls.this_node(),
                    group_id(placement_group),
                )
                return
        runtime.stop()

    @classmethod
    def take(cls, options: dict[str, Any], placement_group=None) -> Runtime | None:
        """The kept processes if a run with these worker ``options`` may have them and all still
        answer; otherwise None, and whatever was kept stops (its resources are wanted)."""
        kept, cls.kept = cls.kept, None
        if kept is None:
            return None
        fits = (
            worker_resources(options) == worker_resources(kept.worker_options)
            and group_id(placement_group) == cls.group
            and cls.this_node() == cls.node
        )
        answers = answered([kept.coordinator, *kept.workers], timeout_s=10 if fits else 1)
        if fits and all(answers):
            return kept
        # a worker that died holds nothing: the stop counts only the others' resources as freed
        alive = [worker for worker, answer in zip(kept.workers, answers[1:]) if answer is not False]
        Runtime(kept.coordinator, alive, kept.worker_options).stop()
        return None

    @classmethod
    def release(cls) -> None:
        """Stop the kept processes: something else wants their resources (a sweep's trials)."""
        kept, cls.kept = cls.kept, None
        if kept is not None:
            kept.stop()


class StoppedProcesses:
    """Ray's available resources as they will be once the processes this driver stopped last are
    gone. ``ray.kill`` returns about 0.1 s before Ray shows their CPUs available, so a run started
    at once (after a failed run in a notebook's loop or the test session, or a Coordinator's restart)
    would size its pool without them: :func:`available_resources` waits for them, until ``WAIT_S``
    after the stop (another driver may take them first, and a worker that died unreplaced held
    nothing any more)."""

    WAIT_S = 5.0
    expected: ClassVar[dict[str, float]] = {}
    node: ClassVar[str] = ""  # the node of the Ray they were stopped on
    stopped_at: ClassVar[float] = 0.0  # time.monotonic()

    @classmethod
    def expect(cls, before: dict[str, float], freed: dict[str, float]) -> None:
        """``before``: Ray's available resources just before the kill; ``freed``: what they held."""
        pending, _ = cls.take()  # an earlier stop's, that no run has counted yet
        freed = {resource: amount for resource, amount in freed.items() if amount}
        cls.expected = {
            resource: max(before.get(resource, 0), pending.get(resource, 0)) + freed.get(resource, 0)
            for resource in pending.keys() | freed.keys()
        }
        cls.node, cls.stopped_at = KeptRuntime.this_node(), time.monotonic()

    @classmethod
    def dead_now(cls) -> None:
        """The stopped processes are reported dead only now (a Coordinator's restart waits for the old
        one first, which may take seconds on a loaded machine): the wait counts from here."""
        if cls.expected:
            cls.stopped_at = time.monotonic()

    @classmethod
    def take(cls) -> tuple[dict[str, float], float]:
        """The expectation and until when to wait for it (none once that has passed, or on another
        Ray); forgotten here, as a run counts it once."""
        expected, cls.expected = cls.expected, {}
        deadline = cls.stopped_at + cls.WAIT_S
        if not expected or cls.node != KeptRuntime.this_node() or time.monotonic() >= deadline:
            return {}, 0.0
        return expected, deadline


def available_resources() -> dict[str, float]:
    """Ray's available resources, once they include what the processes this driver stopped last
    held (:class:`StoppedProcesses`)."""
    import ray

    expected, deadline = StoppedProcesses.take()
    total = ray.cluster_resources() if expected else {}
    wanted = {resource: min(amount, total.get(resource, 0)) for resource, amount in expected.items()}
    while True:
        free = dict(ray.available_resources() or ray.cluster_resources())
        shown = all(free.get(resource, 0) + 1e-9 >= amount for resource, amount in wanted.items())
        if shown or time.monotonic() >= deadline:
            return free
        time.sleep(0.02)


def answered(actors: list, timeout_s: float = 10) -> list[bool | None]:
    """Each actor's answer to a call: True if it returned within ``timeout_s``, False if it failed
    (a dead or lost actor, its node gone), None if no answer came in time (a hung process still
    holds its resources). Each call's own result: ``ray.wait`` counts a dead actor's call as ready
    (its result is the error), so a process killed between two runs (the OOM killer, a user's
    ``kill``) would look as ready as a live one."""
    import ray

    calls = [actor.__ray_ready__.remote() for actor in actors]
    ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
    returned = set(ready)

    def answer(call) -> bool | None:
        if call not in returned:
            return None
        try:
            ray.get(call)
        except ray.exceptions.RayError:
            return False
        return True

    return [answer(call) for call in calls]


def group_id(placement_group) -> str | None:
    return None if placement_group is None else placement_group.id.hex()


def worker_resources(options: dict[str, Any]) -> tuple[float, float]:
    """What a ClientActor holds, whatever the scheduling strategy object that places it."""
    return options["num_cpus"], options["num_gpus"]


@contextlib.contextmanager
def sharing_processes():
    """Runs in this block start on the last one's Coordinator and ClientActors (KeptRuntime);
    leaving it stops them."""
    KeptRuntime.sharing += 1
    try:
        yield
    finally:
        KeptRuntime.sharing -= 1
        if not KeptRuntime.sharing:
            KeptRuntime.release()


def resources_for_the_pool(taken: Runtime | None) -> dict[str, float]:
    """What a run's pool may use: what Ray has available, and what the kept processes it ``taken``
    hold. Kept processes it did not take were stopped, and are waited for as stopped ones are."""
    free = available_resources()
    if taken is not None:
        for resource, amount in taken.held().items():
            free[resource] = free.get(resource, 0) + amount
    return free


def node_resources() -> list[dict[str, float]]:
    """Each live node's resources (all of them, in use or not)."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def start_runtime(cfg: ExperimentConfig, placement_group=None, num_actors: int | None = None) -> Runtime:
    """Start the Coordinator and the worker pool without waiting: every process imports torch and
    Lightning at the same time, while the driver goes on. The last run's processes are taken
    where they fit (KeptRuntime)."""
    import ray

    options = worker_options(cfg, placement_group)
    # taken first: only processes that still answer count (one that died has freed its CPU already)
    kept = KeptRuntime.take(options, placement_group)
    # a trial's pool is its bundles
    size = num_actors or pool_size(cfg, resources_for_the_pool(kept), node_resources())
    held = kept.workers if kept else []
    reused = held[:size]
    for extra in held[size:]:
        ray.kill(extra)
    workers = reused + [start_worker(cfg, options) for _ in range(size - len(reused))]
    if kept is not None:
        return Runtime(kept.coordinator, workers, options)
    coordinator = Coordinator.options(**coordinator_scheduling(placement_group))  # type: ignore[attr-defined]
    return Runtime(coordinator.remote(), workers, options)
