"""One run's record while it runs: its MLflow run (new, or reopened to resume), the system-metrics
monitor, the status it ends with and its wall clock.

:meth:`RunSession.guard` wraps the run: whatever stops it (a Ctrl-C or SIGTERM, a dead Coordinator,
a tracking server down too long, an algorithm that breaks the contract) reaches the user as one
line saying how to resume, and the record is closed with the right status in every case.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from fedray.platform.config import ExperimentConfig
from fedray.platform.errors import ALGORITHM_ERRORS, ConfigError, Diverged, RoundFailed, first_line
from fedray.platform.interrupts import deferred, stops_as_interrupt
from fedray.platform.runtime.events import WorkerJoined
from fedray.platform.tracking.mlflow_run import RunTracker
from fedray.platform.tracking.names import Metrics, Tags
from fedray.platform.tracking.outage import TrackingUnavailable


class RunAborted(RuntimeError):
    """The run cannot go on (its Coordinator died); the message says how to resume. One line."""


class Ending(enum.Enum):
    """How a run ended, as far as its processes go: every ending but ``BROKEN`` leaves them sound,
    to be kept for the driver's next run."""

    FINISHED = "finished"  # its rounds, or as many as --stop-after asked
    STOPPED_EARLY = "stopped early"  # by Tune: its Coordinator halts at the end of its round
    # a broken contract rule, a round whose every client failed or diverged: the processes answered it
    OWN_ERROR = "the algorithm's own error"
    BROKEN = "broken"  # a dead process, the driver's own error, a tracking outage, Ctrl-C


class StoppedEarly(Exception):
    """Raised by a run's ``on_round`` callback to end the run after that round, before its last (Tune
    stopping a trial: ASHA, or the sweep ending): the MLflow run is closed KILLED and tagged
    ``fedray.stopped_early``. Its Coordinator has gone on to later rounds (in a sweep it trains on
    until Tune wakes the stopped trial's thread, which is at once when the next trial is waiting for
    the process); it is halted at the end of its round, and the processes are released as a
    finished run's are (``CoordinatorHandle.halted``)."""


def restarted(cfg: ExperimentConfig) -> str:
    limit = cfg.ray.max_coordinator_restarts
    return f" after {limit} restart{'s' * (limit != 1)}" if limit else ""


def device_tags(devices: list[str], workers: int) -> dict[str, str]:
    """What the run's clients trained on (tag ``device``) and how many workers trained them."""
    return {Tags.DEVICE: "; ".join(sorted(set(devices))), Tags.WORKERS: str(workers)}


def earlier_segments(tags: dict[str, str]) -> tuple[list[str], int]:
    """The devices and the worker count a resumed run's earlier segments tagged (none: nothing)."""
    devices = [d for d in tags.get(Tags.DEVICE, "").split("; ") if d]
    workers = tags.get(Tags.WORKERS, "")
    return devices, int(workers) if workers.isdigit() else 0


class RunSession:
    """The MLflow side of one run: opened late (a new run while the first round trains), closed once."""

    def __init__(self, cfg: ExperimentConfig, tags: dict[str, str] | None, parent_run_id: str | None) -> None:
        self.cfg, self.tags, self.parent_run_id = cfg, tags, parent_run_id
        self.started = time.time()  # the MLflow run's start: its Duration is the run's wall time
        self.tracker: RunTracker | None = None
        self.monitor: Any = None
        self.status = "FAILED"
        self.earlier_s = 0.0  # wall time of the segments before a resume
        self.wall_s: float | None = None  # set when the run is done; None: it failed or was stopped
        self.outage = False  # the tracking server stayed down past tracking.max_outage_s
        self.devices: list[str] = []  # what each worker that joined the run trains on
        self.slots: set[int] = set()  # the pool's slots a worker joined (a replacement takes its slot)
        # a resumed run's tags cover every segment: the devices of all, the most workers one had
        self.earlier_devices: list[str] = []
        self.earlier_workers = 0

    def open(self, tags: dict[str, str]) -> RunTracker:
        """A new MLflow run, created with ``tags`` (the checkpoint folder: a run interrupted from
        here on says how to resume it, so it must know where it resumes from)."""
        with deferred():  # a Ctrl-C meanwhile lands once the run is ours to close (as KILLED)
            self.tracker = RunTracker(
                self.cfg,
                parent_run_id=self.parent_run_id,
                extra_tags={**(self.tags or {}), **tags},
                start_time=self.started,
            )
        return self.tracker

    def reopen(self, run_id: str) -> RunTracker:
        """The interrupted run's MLflow run, to log into again; its earlier segments' wall time counts."""
        with deferred():  # as in open(): reopened is RUNNING, so it is closed again whatever happens
            tracker = RunTracker(
                self.cfg, run_id=run_id, parent_run_id=self.parent_run_id, extra_tags=self.tags
            )
            self.earlier_s = tracker.latest(Metrics.TIME_WALL_S) or 0.0
            self.earlier_devices, self.earlier_workers = earlier_segments(tracker.reopened_tags)
            self.tracker = tracker
        return tracker

    def watch(self, devices: dict[int, str]) -> None:
        """Tag where the clients train (``devices``: the placed workers' descriptions, by pool slot;
        again on a resume: it may run elsewhere) and start the monitor."""
        assert self.tracker is not None
        self.devices, self.slots = list(devices.values()), set(devices)
        self.tag_devices()
        self.monitor = self.tracker.system_metrics(self.cfg.tracking.system_metrics_s)

    def worker_joined(self, event: WorkerJoined) -> None:
        """A worker Ray placed during the rounds (or a restarted Coordinator's): its device is one
        more the clients may train on, and a slot no worker held before is one more worker."""
        assert self.tracker is not None
        if event.device in self.devices and event.slot in self.slots:
            return  # nothing new to say
        self.devices.append(event.device)
        self.slots.add(event.slot)
        self.tag_devices()

    def tag_devices(self) -> None:
        assert self.tracker is not None
        workers = max(len(self.slots), self.earlier_workers)
        self.tracker.set_tags(device_tags(self.earlier_devices + self.devices, workers))

    def elapsed(self) -> float:
        return self.earlier_s + time.time() - self.started

    def finish(self, finished: bool) -> float:
        """The run is done (or stopped where it was told to): its status and wall time."""
        self.status = "FINISHED" if finished else "KILLED"
        closing, self.monitor = self.monitor, None  # closed here, not again by close()
        if closing is not None:  # a failure to close it is this run's error
            closing.finish()
        self.wall_s = self.elapsed()  # printed by the CLI, logged as time/wall_s
        return self.wall_s

    @contextlib.contextmanager
    def guard(self, release: Callable[[Ending], None]) -> Iterator[RunSession]:
        """Run the body; map what stops it to its one line; close the record; then ``release`` the
        run's processes, told how the run ended (:class:`Ending`: kept for the driver's next run
        unless ``BROKEN``). Ctrl-C and SIGTERM stop the body, and the closing too, between tracking
        writes, never inside one."""
        ending = Ending.BROKEN
        with stops_as_interrupt():
            try:
                yield self
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, ALGORITHM_ERRORS):
                    ending = Ending.OWN_ERROR
                if isinstance(err.cause, ConfigError):  # an algorithm that breaks the contract: its line
                    raise err.cause from None
                if isinstance(err.cause, RoundFailed):
                    self.status = "FAILED"
                    resume = (  # a diverged run would diverge again: a new run with other settings
                        ""
                        if self.tracker is None or isinstance(err.cause, Diverged)
                        else f"; once fixed, {self.resume_advice()}"
                    )
                    raise RunAborted(f"{err.cause}{resume}") from None
                raise
            except ray.exceptions.RayActorError as err:
                self.status = "FAILED"
                if self.tracker is None:
                    raise
                raise RunAborted(
                    f"the Coordinator process died ({first_line(err)}){restarted(self.cfg)}; "
                    + self.resume_advice(how="resume from the last checkpoint with")
                ) from None
            except TrackingUnavailable as err:
                self.status, self.outage = "KILLED", True
                if self.tracker is None:  # only the tracker's writes wait out an outage: it exists
                    raise
                raise RunAborted(
                    f"{err}: the run stopped as Ctrl-C stops it; {self.resume_advice(failed=False)}"
                ) from None
            except StoppedEarly:
                self.status, ending = "KILLED", Ending.STOPPED_EARLY
                if self.tracker is not None:
                    self.tracker.set_tags({Tags.STOPPED_EARLY: "true"})
                raise
            except KeyboardInterrupt:
                self.status = "KILLED"
                if self.tracker is not None:
                    print(f"\ninterrupted: resume with  {self.resume_command()}", flush=True)
                raise
            finally:
                try:
                    self.close()
                finally:  # whatever MLflow did, the run's processes end, or wait for the next if it went well
                    release(Ending.FINISHED if self.wall_s is not None else ending)

    def resume_command(self) -> str:
        """The command that resumes this run (it has an MLflow run: the id names it)."""
        assert self.tracker is not None
        return f"fedray run --resume {self.tracker.run_id}"

    def resume_advice(self, failed: bool = True, how: str = "resume with") -> str:
        """How to go on from where the run stopped: ``how`` and its command, or for a sweep's trial
        (``failed``: it ended in error), its sweep's resume."""
        if self.parent_run_id is None:
            return f"{how}  {self.resume_command()}"
        restart = " (add --restart-errored to start its failed trials again from round 0)" if failed else ""
        return f"resume the sweep with its command and --resume{restart}"

    def close(self) -> None:
        if self.monitor is not None:  # a failed or stopped run: its last sample is best effort
            with contextlib.suppress(Exception, KeyboardInterrupt):  # the run is stopping already
                self.monitor.finish()
        if self.tracker is None:
            return
        try:
            self.tracker.end(self.status, wall_s=self.elapsed() if self.wall_s is None else self.wall_s)
        except TrackingUnavailable as err:
            if not self.outage:  # down only at the end: the rounds are done and checkpointed
                raise RunAborted(
                    f"{err}: the run could not be closed; resume with  {self.resume_command()} "
                    "to log what is missing"
                ) from None
