"""The worker pool: ClientActors that take the next job when they go idle, and replace the dead.

Dispatch is dynamic: a job goes to the first worker with room (each holds up to ``IN_FLIGHT``
calls), in the order the jobs were given (the Coordinator gives the largest shards first), except
that a worker first takes a job for a client whose module it still caches, and leaves a job
another live worker caches to that worker when there is other work. With ``pinned`` (at least as many workers as clients) a job runs only on its
own worker, so every client keeps its actor for the whole run and no state moves.

A worker that dies (``kill -9``, OOM, a lost node) or whose device breaks (a CUDA error) is replaced
by a fresh one in the same slot and its job runs again from the clients' committed states: faults
cost time, not results. A job whose own code raises is reported as failed and not retried; an
algorithm that breaks the platform's contract, or a config that cannot work, stops the run
(:class:`ConfigError`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from fedray.platform.errors import ConfigError, first_line
from fedray.platform.runtime.devices import DeviceError
from fedray.platform.runtime.failures import ClientCodeError, Failure, remote_failure

MAX_RETRIES = 3  # a client that keeps killing its worker (its own OOM) is reported as failed
IN_FLIGHT = 2  # calls queued in one worker at a time
# how long the pool waits with every worker a replacement that no node has room for (a lost node),
# and a run's set-up for its first worker
PLACEMENT_WAIT_S = 600.0


# a worker gone, with its process or its node: what it was running (and returned) runs again
LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


@dataclass
class Job:
    """A call of a worker method.

    ``args`` may be a function that makes them: called when the job is first submitted (a retry
    sends the same), so they are made as of then; the pool lets go of them once the job is done."""

    key: Any  # what the results are keyed by (a client id, a chunk index)
    method: str
    args: tuple | Callable[[], tuple]
    prefer: tuple[int, int] | None = None  # (slot, generation) of a worker that caches this job's client
    attempts: int = 0

    def submit(self, worker) -> Any:
        if callable(self.args):
            self.args = self.args()
        return getattr(worker, self.method).remote(*self.args)

    def done(self) -> None:
        self.args = ()  # what it sent may leave the object store


@dataclass
class Outcome:
    results: dict[Any, tuple[Any, tuple[int, int]]]  # key -> (value, worker)
    failed: dict[Any, Failure]  # key -> its error
    retried: list[Any]  # keys re-run after their worker died


class PoolClosed(Exception):
    """A worker was lost because the pool was shut down (the driver stops the run): the round ends
    there, with nothing to report."""


class WorkerPool:
    def __init__(
        self,
        workers: list,
        spawn: Callable[[], tuple[Any, Any]],
        *,
        pinned: bool,
        placing: dict[int, Any] | None = None,
    ) -> None:
        self.workers = list(workers)
        self.generation = [0] * len(self.workers)
        # a fresh worker and the ref its set-up returns (its description, "node" among it) once placed
        self.spawn = spawn
        # slot -> set-up ref of a worker not placed yet (a replacement, or one of the first: unplaced())
        self.placing: dict[int, Any] = dict(placing or {})
        self.pinned = pinned
        # told of a worker placed late, before it takes a job: (its slot, the worker, its set-up's
        # description); it may raise to stop the run
        self.on_placed: Callable[[int, Any, dict], None] | None = None
        self.closed = False  # shut down: a worker lost from now on was killed by it, not replaced

    def __len__(self) -> int:
        return len(self.workers)

    def identity(self, slot: int) -> tuple[int, int]:
        return (slot, self.generation[slot])

    def replace(self, slot: int) -> None:
        if self.closed:  # a new worker would start as the run stops and hold a CPU the next run counts on
            raise PoolClosed(f"worker {slot} lost as the pool shut down: no replacement started")
        ray.kill(self.workers[slot], no_restart=True)
        self.workers[slot], self.placing[slot] = self.spawn()
        self.generation[slot] += 1
        if self.closed:  # shut down while it spawned: its loop may have passed this slot
            ray.kill(self.workers[slot], no_restart=True)
            raise PoolClosed(f"worker {slot} lost as the pool shut down: its replacement killed")

    def ready(self, slot: int) -> bool:
        """Whether the slot's worker runs: a replacement waits for a node with room (a lost node's
        CPUs are gone until it, or another, joins) and takes no jobs meanwhile."""
        if slot not in self.placing:
            return True
        if not ray.wait([self.placing[slot]], timeout=0)[0]:
            return False
        try:
            info = ray.get(self.placing.pop(slot))
        except ray.exceptions.RayError:  # a failed set-up fails its first job instead
            return True
        if self.on_placed is not None:
            with contextlib.suppress(*LOST):  # it died since: its first job finds out and replaces it
                self.on_placed(slot, self.workers[slot], info)
        return True

    def wait_for_placement(self, queue: list[Job]) -> None:
        """Nothing runs and jobs are left: every worker is a replacement Ray has not placed yet."""
        placed, _ = ray.wait(list(self.placing.values()), num_returns=1, timeout=PLACEMENT_WAIT_S)
        if not placed:
            raise RuntimeError(
                f"{len(queue)} jobs left and none of the {len(self.workers)} replacement workers could "
                f"be placed in {PLACEMENT_WAIT_S:.0f} s: the cluster has lost the resources they need"
            )

    def pick(self, queue: list[Job], slot: int) -> Job | None:
        """The job an idle worker takes next (see the module docstring)."""
        me = self.identity(slot)
        if (
            self.pinned
        ):  # a client's job runs on its own slot, or anywhere while that slot's worker is being placed
            return next(
                (j for j in queue if j.prefer is None or j.prefer[0] == slot or j.prefer[0] in self.placing),
                None,
            )
        mine = next((j for j in queue if j.prefer == me), None)
        if mine is not None:
            return mine
        live = {self.identity(s) for s in range(len(self.workers))} - {me}
        free = next((j for j in queue if j.prefer not in live), None)
        return free if free is not None else (queue[0] if queue else None)

    def run(
        self,
        jobs: list[Job],
        on_retry: Callable[[Any, str], None] | None = None,
        on_done: Callable[[Any, Any], None] | None = None,
    ) -> Outcome:
        """Run every job to an outcome; returns when all are done or failed. ``on_done(key, value)``
        is called once per job after its outcome: its value, or None when it failed (after the freed
        worker has its next job: what it does never delays a worker).

        Each worker holds up to ``IN_FLIGHT`` calls: the next one is already queued in the worker when
        the current one ends, so a worker never waits for this process to collect a result and
        dispatch again."""
        queue = list(jobs)
        running: dict[Any, tuple[int, int, Job]] = {}  # ref -> (slot, generation, job)
        load = [0] * len(self.workers)
        out = Outcome({}, {}, [])
        ended: list[tuple[Any, Any]] = []  # (key, value) of jobs done, not yet given to on_done
        while queue or running:
            for _ in range(IN_FLIGHT):  # round-robin: the first jobs (the largest) spread over the workers
                for slot in range(len(self.workers)):
                    job = self.pick(queue, slot) if load[slot] < IN_FLIGHT and self.ready(slot) else None
                    if job is None:
                        continue
                    queue.remove(job)
                    load[slot] += 1
                    running[job.submit(self.workers[slot])] = (slot, self.generation[slot], job)
            self.report(ended, on_done)
            if not running and self.placing:
                self.wait_for_placement(queue)
                continue
            if not running:  # cannot happen while every slot holds a worker; never spin
                raise RuntimeError(f"{len(queue)} jobs left that no worker takes")
            # a replacement placed meanwhile wakes the loop, so it takes jobs at once
            done, _ = ray.wait([*running, *self.placing.values()], num_returns=1)
            if done[0] not in running:
                continue
            slot, generation, job = running.pop(done[0])
            current = generation == self.generation[slot]  # not a call to a worker since replaced
            if current:
                load[slot] -= 1
            try:
                value = ray.get(done[0])
            except ray.exceptions.RayError as err:
                cause = getattr(err, "cause", None)
                # the algorithm breaks a rule, or the config cannot work (a storage path another
                # node does not see): the run stops
                if isinstance(cause, ConfigError):
                    raise cause from None
                if isinstance(err, LOST) or isinstance(cause, DeviceError):
                    # the worker died, or its device broke: replace it, run its calls again elsewhere
                    if current:
                        self.replace(slot)
                        load[slot] = 0  # its other calls fail on their own and are queued again
                    job.attempts += 1
                    what = "lost its device" if isinstance(cause, DeviceError) else "died"
                    if job.attempts > MAX_RETRIES:
                        out.failed[job.key] = Failure(
                            f"its worker {what} {job.attempts} times: {first_line(err)}"
                        )
                        self.finish(job, None, ended)
                    else:
                        out.retried.append(job.key)
                        queue.insert(0, job)
                        if on_retry is not None:
                            on_retry(job.key, first_line(err))
                else:  # the job's own code raised: reported, not retried
                    out.failed[job.key] = (
                        cause.failure if isinstance(cause, ClientCodeError) else remote_failure(err)
                    )
                    self.finish(job, None, ended)
            else:
                out.results[job.key] = (value, (slot, generation))
                self.finish(job, value, ended)
        self.report(ended, on_done)
        return out

    @staticmethod
    def finish(job: Job, value: Any, ended: list[tuple[Any, Any]]) -> None:
        job.done()
        ended.append((job.key, value))

    @staticmethod
    def report(ended: list[tuple[Any, Any]], on_done: Callable[[Any, Any], None] | None) -> None:
        if on_done is not None:
            for key, value in ended:
                on_done(key, value)
        ended.clear()

    def shutdown(self) -> None:
        """Kills every worker; the calls in flight in :meth:`run` (the Coordinator's other thread)
        then fail, and end it without starting replacements."""
        self.closed = True
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def placed(self) -> list:
        """The workers that run now: not those still waiting for a node."""
        return [worker for slot, worker in enumerate(self.workers) if slot not in self.placing]

    def detach(self) -> list:
        """The workers that run now, handed over for another run; a worker still waiting for a
        node is killed."""
        for slot in self.placing:
            ray.kill(self.workers[slot], no_restart=True)
        return self.placed()


def unplaced(set_ups: list, asks: str, wait_s: float) -> dict[int, Any]:
    """The first workers' set-ups (by slot) not done once one of them is up and the others had
    ``wait_s`` more (``ray.pool_wait_s``; twice what the first took, if longer): the pool starts
    without them and each joins once placed, as a replacement does. Ray reports free resources as
    sums over GPUs and nodes, so a pool sized from them may hold a worker that no GPU or node has
    room for while other work holds its share: the run goes on without it rather than waiting for
    it. The others started with the first, so one not up by then is most likely that one (a kept
    worker is up at once, a new one may take half a minute on a loaded machine). None up in
    :data:`PLACEMENT_WAIT_S`: one line. ``asks``: what each worker asks for, for that line."""
    started = time.monotonic()
    if not ray.wait(set_ups, num_returns=1, timeout=PLACEMENT_WAIT_S)[0]:
        raise ConfigError(
            f"ray: none of the run's {len(set_ups)} ClientActors ({asks} each) could be placed in "
            f"{PLACEMENT_WAIT_S:.0f} s: no node has that free; free it, or ask for less"
        )
    grace = max(wait_s, 2 * (time.monotonic() - started))
    ready, _ = ray.wait(set_ups, num_returns=len(set_ups), timeout=grace)
    up = set(ready)
    return {slot: ref for slot, ref in enumerate(set_ups) if ref not in up}
