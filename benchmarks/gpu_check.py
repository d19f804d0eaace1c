"""fedray on a GPU node, checked in one command: nine checks, one table.

About 14 cold commands of 31-58 s each on an H200 machine with 16 CPUs (2026-11-27, third lease: all
nine in 455 s, check 5 65 s of it); ``--only 9,3,1`` picks some, run in the order given; ``--share
0.125`` runs the GPU checks on another slice (eight ClientActors on the GPU).

Every check runs fedray as a user does: a fresh ``fedray run`` (or ``fedray sweep``) process that
starts its own local Ray, with ``MLFLOW_TRACKING_URI`` on a sqlite file and ``storage_path`` in a
temporary folder. What it did is read back from MLflow (tags ``device`` and ``fedray.workers``, the
per-round metrics), and while it runs ``nvidia-smi`` is sampled every half second for the processes
holding a CUDA context and for the GPU's utilisation.

 1. the quickstart with four ClientActors at 0.25 GPU: GPU processes, no failed client, GPU
    utilisation during the rounds, per-round time, final accuracy, device tag ``cuda...``, GPU
    system metrics (``system/gpu*``) in MLflow;
 2. the same on the CPU (``CUDA_VISIBLE_DEVICES=``, ``ray.num_gpus_per_client=0``): final accuracy
    within 0.03 of check 1's;
 3. the default config (no GPU asked for) on the GPU node: no GPU process, device tag ``cpu``;
 4. check 1 again: every metric of every round identical (``train.deterministic``), timings aside;
 5. CIFAR-10 in the cross-device shape (1,000 clients of 50 images, 50 per round, FedAvg CNN, batch
    10) at 0.25 GPU: per-round time, GPU utilisation, time per client;
 6. a two-trial FedProx sweep with ``ray.max_actors=2`` at 0.25 GPU: both trials finish, each on two
    GPU workers;
 7. a run stopped after round 2, resumed on the GPU, its checkpoints loaded in a process that sees
    no GPU (every tensor on the CPU), its rounds equal to an uninterrupted run's (check 1's, when it ran);
 8. two rounds each of FedSC, FedL2G (no warm-up) and FedProto at 0.25 GPU, the client states
    their GPU workers wrote loaded as check 7's are (check 7's FedAvg keeps none);
 9. GPUs asked for where none is visible: exit status 2 and one line naming
    ``ray.num_gpus_per_client``, in well under a minute.

Without a GPU it says so in one line and exits 0. The table is printed and written as markdown
(``--out``, default ``reports/gpu-check.md``) to paste into an issue; the exit status is 0 when every
check passed, 1 otherwise. The temporary folder (logs of every command, the MLflow store) is kept
when a check failed, or with ``--keep``.

    make gpu-check                                        # all nine
    make gpu-check ARGS="--only 1,4 --data ~/data/cifar10-jpeg --rounds 10"
    python benchmarks/gpu_check.py --only 5 --data .data/cifar10-jpeg.tar.gz

Check 5's data: ``--data`` (an unpacked CIFAR-10 JPEG tree, the ``cifar10-jpeg.tar.gz`` archive, or
``synthetic``), else the archive at ``$FEDRAY_CIFAR10_ARCHIVE`` or ``.data/`` (unpacked once into
``~/.cache/fedray``), else the built-in synthetic set at 32x32 (1 channel; the table says so).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import torch
from process_names import process_title

from fedray.platform.api.algorithm import commits_state
from fedray.platform.api.registry import get as get_algorithm
from fedray.platform.catalog import load_config
from fedray.platform.data.archive import cifar10_jpeg_archive
from fedray.platform.runtime.state_store import STATES_DIR
from fedray.platform.tracking.names import Metrics, Tags, personal_on, tag_filter

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
FEDRAY = str(Path(sys.executable).with_name("fedray"))
QUICKSTART = "configs/quickstart.yaml"
DEFAULT_OUT = ROOT / "reports" / "gpu-check.md"

GPU_SHARE = 0.25  # ray.num_gpus_per_client of the GPU checks (--share): four ClientActors share the GPU
SWEEP_WORKERS = 2  # ray.max_actors of check 6's trials
STOP_AFTER, RESUMED_ROUNDS = 2, 4  # check 7
DEFAULT_CONFIG_ROUNDS = 5  # check 3: the built-in defaults (digits, no GPU asked for), shortened
ACC_TOLERANCE = 0.03  # check 2: GPU and CPU final accuracy may differ this much
RUN_TIMEOUT_S = 300  # any one command; killed (its whole process group) beyond it
FAIL_FAST_S = 60  # check 9 must fail in less
LOAD_TIMEOUT_S = 120
STOP_GRACE_S = 10  # SIGTERM first (fedray stops as on Ctrl-C), SIGKILL after this
SAMPLE_S = 0.5  # nvidia-smi and the process tree, sampled this often
SMI_TIMEOUT_S = 5

# timings and machine samples differ between identical runs
IGNORED_PREFIXES = (Metrics.TIME_PREFIX, Metrics.SYSTEM_PREFIX)
# logged once, at a run's last step
END_OF_RUN_PREFIXES = (Metrics.BEST_PREFIX, Metrics.BEST_ROUND_PREFIX, Metrics.FINAL_PREFIX)
HEADLINE_ACC = (
    Metrics.ACC_GLOBAL,
    Metrics.ACC_PERSONAL_MEAN,
    personal_on(Metrics.ACC_PERSONAL_MEAN, "selected"),
)

ARCHIVES = (cifar10_jpeg_archive(ROOT),)  # $FEDRAY_CIFAR10_ARCHIVE, else .data/
UNPACKED = Path.home() / ".cache" / "fedray" / "cifar10-jpeg"
SYNTHETIC = ["data.dataset=synthetic", "data.synthetic_samples=60000", "data.synthetic_image_size=32"]
CROSS_DEVICE_ROUNDS, CROSS_DEVICE_EVAL_EVERY = 20, 10
CROSS_DEVICE = [  # 1,000 IID clients of 50 images, 50 per round, the FedAvg CNN, 5 SGD steps a client
    "name=gpu_check_cross_device",
    "algorithm=fedavg",
    "data.num_clients=1000",
    "data.partition.kind=iid",
    "data.split.train=1.0",
    "data.split.val=0",
    "data.split.test=0",
    "model.group=fedavg_cnn",
    "train.fraction=0.05",
    "train.lr=0.05",
    "train.momentum=0",
    "train.batch_size=10",
    "train.local_epochs=1",
    "eval.clients=selected",
    "checkpoint_every=0",
]
ALGORITHM_RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (  # check 8: (row, config, overrides)
    ("8a FedProto", "configs/fedproto.yaml", ()),  # first: the one the first GPU run found failing
    ("8b FedSC", "configs/fedsc.yaml", ()),
    ("8c FedL2G", "configs/fedl2g.yaml", ("fedl2g.warmup_rounds=0",)),
)
SWEEP_SPACE = f"""\
search: grid
scheduler: none
metric: {Metrics.ACC_GLOBAL}
params:
  fedprox.mu: {{grid: [0.0, 0.1]}}
"""

RUN_ID = re.compile(r"MLflow run id: (\w+)")
PARENT_RUN_ID = re.compile(r"MLflow parent run: (\w+)")
COLUMNS = ("check", "result", "GPU processes", "GPU util mean/max %", "per-round s", "acc", "notes")

STARTED = time.monotonic()


def progress(message: str) -> None:
    """One progress line, with the seconds since the script started."""
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


# --------------------------------------------------------------------------------------------- nvidia-smi


def parse_pids(text: str) -> set[int]:
    """``nvidia-smi --query-compute-apps=pid --format=csv,noheader``: one pid a line (or a message)."""
    return {int(line.strip()) for line in text.splitlines() if line.strip().isdigit()}


def parse_utilization(text: str) -> float | None:
    """``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits``: one percentage per
    GPU; the busiest GPU's, or None when no line is a number (``[N/A]``)."""
    values = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            values.append(float(line.strip()))
    return max(values) if values else None


def smi(query: str) -> str | None:
    """One ``nvidia-smi`` query's output, or None when it cannot answer."""
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpu_pids() -> set[int]:
    return parse_pids(smi("--query-compute-apps=pid") or "")


def gpu_utilization() -> float | None:
    return parse_utilization(smi("--query-gpu=utilization.gpu") or "")


def classify_gpu_pids(
    pids: set[int], tree: set[int], before: set[int], exists: Callable[[int], bool]
) -> dict[int, str]:
    """Which GPU processes belong to the command: ``tree`` (a descendant of it) or ``host`` (a pid
    that does not exist in this pid namespace and was not on the GPU before the command started:
    nvidia-smi in a container reports host pids). Processes of this machine outside the command's
    tree are someone else's and left out."""
    out = {}
    for pid in pids - before:
        if pid in tree:
            out[pid] = "tree"
        elif not exists(pid):
            out[pid] = "host"
    return out


class Point(NamedTuple):
    step: int
    value: float
    ms: int  # MLflow's timestamp, milliseconds since the epoch


def rounds_window(round_times: list[Point]) -> tuple[float, float] | None:
    """(start, end) of a run's rounds in epoch seconds, from ``time/round_s``: a round's metrics are
    logged when it ends, so rounds 1..k started at the latest ``logged_k - sum(round_s 1..k)``; the
    earliest such bound is the start (round 1's metrics may wait for the MLflow run to exist)."""
    if not round_times:
        return None
    starts, total = [], 0.0
    for point in sorted(round_times):
        total += point.value
        starts.append(point.ms / 1000 - total)
    return min(starts), max(p.ms for p in round_times) / 1000


def utilization(
    samples: list[tuple[float, float]], windows: list[tuple[float, float]]
) -> tuple[float, float] | None:
    """(mean, max) of the utilisation samples taken inside any of the windows."""
    inside = [value for t, value in samples if any(start <= t <= end for start, end in windows)]
    return (statistics.fmean(inside), max(inside)) if inside else None


# --------------------------------------------------------------------------------------------- commands


@dataclass
class Watched:
    """What was sampled while a command ran."""

    gpu: dict[int, str] = field(default_factory=dict)  # the command's GPU processes: pid -> tree | host
    titles: dict[int, str] = field(default_factory=dict)  # what each GPU process was: ray::ClientActor
    util: list[tuple[float, float]] = field(default_factory=list)  # (epoch s, % of the busiest GPU)
    tree: dict[int, psutil.Process] = field(default_factory=dict)  # every descendant seen


class Sampler(threading.Thread):
    """Samples the command's process tree and, with ``smi``, nvidia-smi, every ``SAMPLE_S``."""

    def __init__(self, pid: int, smi_on: bool, before: set[int]) -> None:
        super().__init__(daemon=True)
        self.pid, self.smi_on, self.before = pid, smi_on, before
        self.seen = Watched()
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            self.sample()
            if self.done.wait(SAMPLE_S):
                return

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            self.seen.tree.update((p.pid, p) for p in [root, *root.children(recursive=True)])
        if not self.smi_on:
            return
        found = classify_gpu_pids(gpu_pids(), set(self.seen.tree), self.before, psutil.pid_exists)
        self.seen.gpu.update(found)
        for pid in found.keys() - self.seen.titles.keys():
            with contextlib.suppress(psutil.Error):
                self.seen.titles[pid] = process_title(psutil.Process(pid).cmdline())
        value = gpu_utilization()
        if value is not None:
            self.seen.util.append((time.time(), value))

    def stop(self) -> Watched:
        self.done.set()
        self.join()
        return self.seen


@dataclass
class Outcome:
    """One finished (or killed) command."""

    label: str
    shown: str  # the command line as a user would type it
    returncode: int
    seconds: float
    timed_out: bool
    stdout: str
    stderr: str
    watched: Watched

    def printed_id(self, pattern: re.Pattern = RUN_ID) -> str | None:
        found = pattern.search(self.stdout)
        return found.group(1) if found else None

    def problem(self) -> str | None:
        if self.timed_out:
            return f"{self.label}: killed after {self.seconds:.0f} s (time limit)"
        if self.returncode != 0:
            return f"{self.label}: exit status {self.returncode}: {last_line(self.stderr)}"
        return None


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def shown_command(argv: list[str], env_changes: dict[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES= fedray run ...``: the command as a user types it."""
    names = {FEDRAY: "fedray", sys.executable: "python"}
    words = [names.get(word, word) for word in argv]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_changes.items())
    return f"{prefix} {shlex.join(words)}".strip()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (fedray stops as on Ctrl-C), SIGKILL if it lingers."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def is_alive(proc: psutil.Process) -> bool:
    """Running, and the same process as when it was seen (a pid can be reused); a zombie is dead."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_leftovers(tree: dict[int, psutil.Process]) -> int:
    """Kill the command's descendants that outlived it (a Ray it did not shut down) and wait for
    them to go; returns how many there were."""
    alive = [proc for proc in tree.values() if is_alive(proc)]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(is_alive(proc) for proc in alive) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(alive)


# --------------------------------------------------------------------------------------------- context


@dataclass
class Context:
    """What every check shares: the temporary folder, the mode, and the runs checks reuse."""

    tmp: Path
    pretend: bool  # --pretend-gpu: the same commands on a CPU machine, GPU expectations not checked
    smi_on: bool  # nvidia-smi is there and sampled
    data: str | None
    rounds: int
    gpu_share: float = GPU_SHARE
    commands: list[Outcome] = field(default_factory=list)
    shared: dict[str, Run] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"

    @property
    def storage(self) -> str:
        return f"storage_path={self.tmp / 'storage'}"

    @property
    def share(self) -> str:
        """The GPU slice of the GPU checks (none when pretending: this machine's Ray has no GPU)."""
        return f"ray.num_gpus_per_client={0 if self.pretend else self.gpu_share:g}"

    @property
    def at(self) -> str:
        """How the GPU checks' rows name their slice: "at 0.25 GPU"."""
        return f"at {self.gpu_share:g} GPU"

    @property
    def workers_on_one_gpu(self) -> int:
        """ClientActors that share the one GPU at this slice (on a node with a CPU for each)."""
        return math.floor(1 / self.gpu_share + 1e-9)

    @property
    def gpu_unchecked(self) -> str | None:
        """Why a device expectation cannot be checked (None: it can)."""
        return "pretend" if self.pretend else None

    @property
    def smi_unchecked(self) -> str | None:
        """Why an nvidia-smi expectation cannot be checked (None: it can)."""
        if self.pretend:
            return "pretend"
        return None if self.smi_on else "nvidia-smi not found"

    def env(self, **changes: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray each time
        return {**env, "MLFLOW_TRACKING_URI": self.uri, **changes}

    def run_command(
        self,
        label: str,
        argv: list[str],
        *,
        env_changes: dict[str, str] | None = None,
        timeout: float = RUN_TIMEOUT_S,
    ) -> Outcome:
        """Run one command in a session of its own, sampling its process tree and the GPU until it
        ends; past ``timeout`` its process group is stopped (and any descendant that left it)."""
        changes = env_changes or {}
        shown = shown_command(argv, changes)
        progress(f"  $ {shown}")
        logs = self.tmp / "logs"
        logs.mkdir(exist_ok=True)
        name = f"{len(self.commands) + 1:02d}-{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}"
        out_path, err_path = logs / f"{name}.out", logs / f"{name}.err"
        before = gpu_pids() if self.smi_on else set()
        start = time.monotonic()
        with out_path.open("w") as out, err_path.open("w") as err:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env(**changes), stdout=out, stderr=err, start_new_session=True
            )
            sampler = Sampler(proc.pid, self.smi_on, before)
            sampler.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                stop_group(proc)
            except BaseException:  # Ctrl-C: the command, in a session of its own, does not get it
                stop_group(proc)
                end_leftovers(sampler.stop().tree)
                raise
            watched = sampler.stop()
        seconds = time.monotonic() - start
        leftovers = end_leftovers(watched.tree)
        outcome = Outcome(
            label,
            shown,
            proc.returncode,
            seconds,
            timed_out,
            out_path.read_text(),
            err_path.read_text(),
            watched,
        )
        self.commands.append(outcome)
        status = "TIMED OUT" if timed_out else f"exit {proc.returncode}"
        extra = f", ended {leftovers} leftover processes" if leftovers else ""
        progress(f"    {status} after {seconds:.1f} s{extra}")
        return outcome

    def fedray(self, label: str, *args: str, **kwargs: Any) -> Run:
        """``fedray <args>`` and the MLflow run it printed, read back."""
        outcome = self.run_command(label, [FEDRAY, *args], **kwargs)
        run_id = outcome.printed_id()
        return Run(outcome, read_run(self.uri, run_id) if run_id else None)


# --------------------------------------------------------------------------------------------- MLflow


@dataclass
class RunRecord:
    """An MLflow run read back: status, tags, and every metric's history (system metrics aside)."""

    run_id: str
    status: str
    tags: dict[str, str]
    history: dict[str, list[Point]]
    system_metrics: list[str] = field(default_factory=list)  # names only (MLflow's system/*)

    def values(self, key: str) -> list[float]:
        return [p.value for p in sorted(self.history.get(key, []))]

    def final(self, key: str) -> float | None:
        values = self.values(key)
        return values[-1] if values else None

    def median(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.median(values) if values else None

    def failed_clients(self) -> float:
        return sum(self.values(Metrics.CLIENTS_FAILED))

    def headline_acc(self) -> tuple[str, float] | None:
        """The final accuracy a run is read by: the global model's, else the personalised mean."""
        for key in HEADLINE_ACC:
            value = self.final(key)
            if value is not None:
                return key, value
        return None

    def window(self) -> tuple[float, float] | None:
        return rounds_window(self.history.get(Metrics.TIME_ROUND_S, []))

    def steady_windows(self) -> list[tuple[float, float]]:
        """(start, end) in epoch seconds of each round after the first without evaluation: from the
        time its metrics were logged back by its ``time/round_s`` (the logging's lag shifts them)."""
        evaluated = {p.step for key, points in self.history.items() if key.startswith("acc/") for p in points}
        return [
            (p.ms / 1000 - p.value, p.ms / 1000)
            for p in self.history.get(Metrics.TIME_ROUND_S, [])
            if p.step > 1 and p.step not in evaluated
        ]


def read_run(uri: str, run_id: str) -> RunRecord:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    history = {
        key: [Point(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
        if not key.startswith(Metrics.SYSTEM_PREFIX)
    }
    system = sorted(key for key in run.data.metrics if key.startswith(Metrics.SYSTEM_PREFIX))
    return RunRecord(run_id, run.info.status, dict(run.data.tags), history, system)


def child_runs(uri: str, parent_id: str) -> list[RunRecord]:
    """A sweep's trial runs (tag ``mlflow.parentRunId``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    found = client.search_runs(
        [parent.info.experiment_id], filter_string=tag_filter(Tags.PARENT_RUN_ID, parent_id)
    )
    return [read_run(uri, run.info.run_id) for run in found]


@dataclass
class Run:
    outcome: Outcome
    record: RunRecord | None

    def problem(self, status: str = "FINISHED") -> str | None:
        """Why the run did not end as expected (``status`` in MLflow), or None."""
        if self.outcome.problem():
            return self.outcome.problem()
        if self.record is None:
            return f"{self.outcome.label}: no MLflow run id in its output"
        if self.record.status != status:
            return f"{self.outcome.label}: MLflow run is {self.record.status}, expected {status}"
        return None


def same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def metric_differences(
    first: dict[str, list[Point]],
    second: dict[str, list[Point]],
    ignore: tuple[str, ...] = IGNORED_PREFIXES,
    last_step: int | None = None,
) -> list[str]:
    """Where two runs' metrics differ (exactly, step by step, up to ``last_step``), metrics whose
    name starts with an ``ignore`` prefix aside; one line per differing metric."""

    def by_step(points: list[Point]) -> dict[int, float]:
        return {p.step: p.value for p in points if last_step is None or p.step <= last_step}

    out = []
    for key in sorted(set(first) | set(second)):
        if key.startswith(ignore):
            continue
        a, b = by_step(first.get(key, [])), by_step(second.get(key, []))
        if a.keys() != b.keys():
            out.append(f"{key}: steps {sorted(a)} vs {sorted(b)}")
            continue
        step = next((s for s in sorted(a) if not same_value(a[s], b[s])), None)
        if step is not None:
            out.append(f"{key} at step {step}: {a[step]!r} vs {b[step]!r}")
    return out


# --------------------------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One line of the table, and what was found wrong or left unchecked."""

    check: str
    result: str = "ok"
    gpu_procs: str = "-"
    util: str = "-"
    round_s: str = "-"
    acc: str = "-"
    notes: list[str] = field(default_factory=list)
    unchecked: dict[str, list[str]] = field(default_factory=dict)  # why -> expectations not checked

    @property
    def passed(self) -> bool:
        return self.result == "ok"

    def require(self, ok: bool, problem: str) -> bool:
        """Fail the row with ``problem`` unless ``ok``."""
        if not ok:
            self.result = "FAIL"
            self.notes.append(f"FAIL: {problem}")
        return ok

    def no_problem(self, problem: str | None) -> bool:
        """Fail the row with ``problem`` unless it is None."""
        return self.require(problem is None, problem or "")

    def expect(self, ok: bool, expectation: str, got: str | None, unchecked: str | None) -> None:
        """A GPU expectation: checked as ``require`` does, or listed as not checked (and why)."""
        seen = "" if got is None else f" (got {got})"
        if unchecked:
            self.unchecked.setdefault(unchecked, []).append(f"{expectation}{seen}")
        else:
            self.require(ok, f"expected {expectation}{seen}")

    def skip(self, why: str) -> None:
        """Mark the row skipped (a failure found before stays the result)."""
        if self.passed:
            self.result = f"skipped: {why}"
        else:
            self.notes.append(f"skipped: {why}")

    def cells(self) -> list[str]:
        unchecked = [f"not checked ({why}): {', '.join(items)}" for why, items in self.unchecked.items()]
        notes = "; ".join([*self.notes, *unchecked])
        return [self.check, self.result, self.gpu_procs, self.util, self.round_s, self.acc, notes]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def acc_cell(record: RunRecord) -> str:
    """The run's final accuracy, named when it is not the global model's."""
    headline = record.headline_acc()
    if headline is None:
        return "-"
    key, value = headline
    return f"{value:.4f}" if key == Metrics.ACC_GLOBAL else f"{value:.4f} ({key.split('/', 1)[1]})"


def judge_run(row: Row, ctx: Context, run: Run, device: str) -> RunRecord | None:
    """What every run is checked for: it finished, no client failed, and it trained on ``device``
    (``cuda``: a GPU expectation; ``cpu``: always checked). Fills the per-round and accuracy cells;
    returns the MLflow run, or None when there is none to read."""
    row.no_problem(run.problem())
    record = run.record
    if record is None:
        return None
    row.require(record.failed_clients() == 0, f"{record.failed_clients():g} failed clients")
    tag = record.tags.get(Tags.DEVICE, "(none)")
    if device == "cuda":
        row.expect(tag.startswith("cuda"), "device tag cuda...", repr(tag), ctx.gpu_unchecked)
    else:
        row.require(tag == "cpu", f"device tag {tag!r}, expected 'cpu'")
    row.round_s = fmt(record.median(Metrics.TIME_ROUND_S))
    row.acc = acc_cell(record)
    row.notes.append(f"device {tag}, {record.tags.get(Tags.WORKERS, '?')} workers")
    return record


def show_gpu_use(row: Row, ctx: Context, outcome: Outcome, records: list[RunRecord], busy: bool) -> None:
    """The GPU cells from what nvidia-smi showed while ``outcome`` ran: its GPU processes (expected
    some when ``busy``, none otherwise) and the utilisation during the runs' rounds."""
    if ctx.smi_unchecked:
        row.gpu_procs = row.util = f"n/a ({ctx.smi_unchecked})"
    else:
        procs = outcome.watched.gpu
        row.gpu_procs = str(len(procs))
        if "host" in procs.values():
            row.notes.append("nvidia-smi reports host pids (a container): counted the new ones")
        workers = sum(int(r.tags.get(Tags.WORKERS, "0")) for r in records)
        if busy and len(procs) != workers:
            row.notes.append(f"{len(procs)} GPU processes for {workers} workers")
        if procs:
            titles = collections.Counter(outcome.watched.titles.get(pid, "?") for pid in procs)
            row.notes.append("GPU processes: " + ", ".join(f"{n} {t}" for t, n in sorted(titles.items())))
        windows = [w for w in (r.window() for r in records) if w is not None]
        seen = utilization(outcome.watched.util, windows)
        row.util = "-" if seen is None else f"{seen[0]:.0f} / {seen[1]:.0f}"
    n = len(outcome.watched.gpu)
    got = None if ctx.smi_unchecked else str(n)
    if busy:
        row.expect(n > 0, "GPU processes during the run", got, ctx.smi_unchecked)
    else:
        row.expect(n == 0, "no GPU process of the run", got, ctx.smi_unchecked)


# --------------------------------------------------------------------------------------------- checks


def quickstart_on_gpu(ctx: Context) -> Run:
    """Check 1's run, made once: checks 2, 4 and 7 compare with it."""
    if "quickstart" not in ctx.shared:
        ctx.shared["quickstart"] = ctx.fedray(
            f"quickstart {ctx.at}", "run", QUICKSTART, ctx.share, ctx.storage
        )
    return ctx.shared["quickstart"]


def check_quickstart_gpu(ctx: Context) -> list[Row]:
    """1: the quickstart on four ClientActors sharing the GPU."""
    row = Row(f"1 quickstart, {ctx.workers_on_one_gpu} workers {ctx.at}")
    run = quickstart_on_gpu(ctx)
    record = judge_run(row, ctx, run, "cuda")
    if record is not None:
        show_gpu_use(row, ctx, run.outcome, [record], busy=True)
        workers = record.tags.get(Tags.WORKERS)
        expected = str(ctx.workers_on_one_gpu)
        row.expect(workers == expected, f"{expected} workers", workers, ctx.gpu_unchecked)
        gpu_series = [key for key in record.system_metrics if key.startswith(f"{Metrics.SYSTEM_PREFIX}gpu")]
        row.expect(bool(gpu_series), "GPU system metrics in MLflow", f"{len(gpu_series)}", ctx.gpu_unchecked)
    return [row]


def check_cpu_baseline(ctx: Context) -> list[Row]:
    """2: the quickstart with CUDA hidden and no GPU asked for; final accuracy near check 1's."""
    row = Row("2 quickstart on the CPU (CUDA hidden)")
    gpu = quickstart_on_gpu(ctx).record
    cpu = ctx.fedray(
        "quickstart on the CPU",
        "run",
        QUICKSTART,
        "ray.num_gpus_per_client=0",
        ctx.storage,
        env_changes={"CUDA_VISIBLE_DEVICES": ""},
    )
    record = judge_run(row, ctx, cpu, "cpu")
    if record is None:
        return [row]
    ours, theirs = record.final(Metrics.ACC_GLOBAL), None if gpu is None else gpu.final(Metrics.ACC_GLOBAL)
    if ours is None or theirs is None:
        row.skip(f"check 1's run or this one has no {Metrics.ACC_GLOBAL} to compare")
        return [row]
    row.require(
        abs(ours - theirs) <= ACC_TOLERANCE,
        f"final {Metrics.ACC_GLOBAL} {ours:.4f}, check 1's {theirs:.4f}: more than {ACC_TOLERANCE} apart",
    )
    row.notes.append(f"check 1's {Metrics.ACC_GLOBAL} {theirs:.4f}")
    return [row]


def check_default_config(ctx: Context) -> list[Row]:
    """3: a run that asks for no GPU leaves the GPU alone."""
    row = Row(f"3 default config (no GPU asked for), {DEFAULT_CONFIG_ROUNDS} rounds")
    run = ctx.fedray("default config on the GPU node", "run", f"rounds={DEFAULT_CONFIG_ROUNDS}", ctx.storage)
    record = judge_run(row, ctx, run, "cpu")
    if record is not None:
        show_gpu_use(row, ctx, run.outcome, [record], busy=False)
    return [row]


def check_rerun(ctx: Context) -> list[Row]:
    """4: check 1 again repeats every metric of every round."""
    row = Row(f"4 quickstart {ctx.at} again")
    first = quickstart_on_gpu(ctx).record
    again = ctx.fedray(f"quickstart {ctx.at}, again", "run", QUICKSTART, ctx.share, ctx.storage)
    record = judge_run(row, ctx, again, "cuda")
    if record is None:
        return [row]
    if first is None:
        row.skip("check 1's run failed: nothing to compare with")
        return [row]
    show_gpu_use(row, ctx, again.outcome, [record], busy=True)
    diffs = metric_differences(first.history, record.history)
    row.require(not diffs, f"{len(diffs)} metrics differ from check 1's: {'; '.join(diffs[:3])}")
    if not diffs:
        row.notes.append(
            f"every round identical to check 1's ({', '.join(p + '*' for p in IGNORED_PREFIXES)} aside)"
        )
    return [row]


@dataclass
class DataSource:
    overrides: list[str]
    label: str


class DataMissing(Exception):
    """``--data`` names nothing usable."""


def imagefolder(root: Path, label: str) -> DataSource:
    return DataSource(["data.dataset=imagefolder", f"data.root={root}"], label)


def unpacked(archive: Path) -> Path:
    """The archive's JPEG tree, unpacked once into ~/.cache/fedray (never the repository)."""
    from fedray.platform.data.archive import unpack_image_archive

    progress(f"  CIFAR-10: {archive} (unpacked once into {UNPACKED})")
    return unpack_image_archive(archive, UNPACKED)


def cross_device_data(arg: str | None, archives: tuple[Path, ...] = ARCHIVES) -> DataSource:
    """Check 5's data: ``--data`` (a JPEG tree, the archive, or ``synthetic``), else the first archive
    found, else the synthetic set at CIFAR's size (1 channel)."""
    synthetic_note = "synthetic 32x32 stand-in (1 channel, not CIFAR-10)"
    if arg == "synthetic":
        return DataSource(SYNTHETIC, f"{synthetic_note}: --data synthetic")
    if arg:
        path = Path(arg).expanduser()
        if path.is_dir():
            return imagefolder(path, f"CIFAR-10 JPEGs in {path}")
        if path.is_file():
            return imagefolder(unpacked(path), f"CIFAR-10 JPEGs from {path}")
        raise DataMissing(f"--data {arg}: no such folder or archive")
    for archive in archives:
        if archive.is_file():
            return imagefolder(unpacked(archive), f"CIFAR-10 JPEGs from {archive}")
    looked = " or ".join(str(a) for a in archives)
    return DataSource(SYNTHETIC, f"{synthetic_note}: no {looked}")


def check_cross_device(ctx: Context) -> list[Row]:
    """5: CIFAR-10 in the cross-device shape at 0.25 GPU per worker."""
    row = Row(f"5 cross-device, 1,000 clients x 50 images, {ctx.rounds} rounds {ctx.at}")
    try:
        data = cross_device_data(ctx.data)
    except DataMissing as err:
        row.require(False, str(err))
        return [row]
    schedule = [f"rounds={ctx.rounds}", f"eval_every={min(CROSS_DEVICE_EVAL_EVERY, ctx.rounds)}"]
    run = ctx.fedray("cross-device", "run", *CROSS_DEVICE, *data.overrides, *schedule, ctx.share, ctx.storage)
    row.notes.append(data.label)
    record = judge_run(row, ctx, run, "cuda")
    if record is not None:
        show_gpu_use(row, ctx, run.outcome, [record], busy=True)
        steady = None if ctx.smi_unchecked else utilization(run.outcome.watched.util, record.steady_windows())
        if steady is not None:
            row.notes.append(f"GPU busy {steady[0]:.0f} % in rounds 2+ without evaluation")
        medians = ", ".join(
            f"{key} {fmt(record.median(key), 3)}"
            # literals: the installed build may predate these names (ab.sh checks older commits)
            for key in (Metrics.TIME_CLIENT_S, "time/train_s", "time/aggregate_s")
            if record.median(key) is not None
        )
        row.notes.append(f"median {medians}")
    return [row]


def check_sweep(ctx: Context) -> list[Row]:
    """6: a two-trial sweep, each trial on two GPU workers."""
    row = Row(f"6 sweep, 2 trials x {SWEEP_WORKERS} workers {ctx.at}")
    space = ctx.tmp / "space.yaml"
    space.write_text(SWEEP_SPACE)
    argv = [FEDRAY, "sweep", "--algo", "fedprox", "--space", str(space), "--config", QUICKSTART]
    overrides = ["rounds=3", f"ray.max_actors={SWEEP_WORKERS}", ctx.share, ctx.storage]
    outcome = ctx.run_command("sweep", argv + overrides)
    row.no_problem(outcome.problem())
    parent = outcome.printed_id(PARENT_RUN_ID)
    if parent is None:
        row.require(False, "no MLflow parent run in the sweep's output")
        return [row]
    trials = child_runs(ctx.uri, parent)
    finished = [t for t in trials if t.status == "FINISHED"]
    row.require(len(trials) == 2 and len(finished) == 2, f"{len(finished)} of {len(trials)} trials finished")
    for trial in trials:
        workers, tag = trial.tags.get(Tags.WORKERS), trial.tags.get(Tags.DEVICE, "(none)")
        row.require(workers == str(SWEEP_WORKERS), f"trial {trial.run_id[:8]}: {workers} workers")
        trial_device = f"trial {trial.run_id[:8]} device tag cuda..."
        row.expect(tag.startswith("cuda"), trial_device, repr(tag), ctx.gpu_unchecked)
    show_gpu_use(row, ctx, outcome, trials, busy=True)
    times = [v for t in trials for v in t.values(Metrics.TIME_ROUND_S)]
    row.round_s = fmt(statistics.median(times) if times else None)
    row.acc = " / ".join(acc_cell(t) for t in trials) or "-"
    shown = [f"{t.tags.get(Tags.DEVICE, '?')} on {t.tags.get(Tags.WORKERS, '?')} workers" for t in trials]
    row.notes.append(f"trials: {', '.join(shown)}")
    return [row]


def tensors_in(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor in a loaded checkpoint: nested mappings, sequences and objects' attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from tensors_in(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from tensors_in(vars(obj), seen)


def load_checkpoints(directory: str) -> dict[str, Any]:
    """Check 7's child, in a process that sees no GPU: load every ``*.pt`` under ``directory`` with
    ``storage.load_torch`` (every tensor must be on the CPU), and once more with a plain
    ``torch.load`` (which needs a GPU for any tensor saved on one)."""
    from fedray.platform.runtime import storage

    files = sorted(str(p) for p in Path(directory).rglob("*.pt"))
    report: dict[str, Any] = {"cuda": torch.cuda.is_available(), "files": len(files), "tensors": 0}
    report["client_states"] = sum(Path(path).parent.name == STATES_DIR for path in files)
    report.update(off_cpu=[], saved_on_gpu=[], errors=[])
    for path in files:
        name = str(Path(path).relative_to(directory))
        try:
            tensors = list(tensors_in(storage.load_torch(path)))
        except Exception as err:
            report["errors"].append(f"{name}: {last_line(str(err))}")
            continue
        report["tensors"] += len(tensors)
        if any(t.device.type != "cpu" for t in tensors):
            report["off_cpu"].append(name)
        try:
            torch.load(io.BytesIO(storage.read_bytes(path)), weights_only=True)
        except Exception as err:
            report["saved_on_gpu"].append(f"{name}: {last_line(str(err))}")
    return report


def uninterrupted_reference(ctx: Context) -> tuple[RunRecord | None, str]:
    """The run a resumed run must repeat: check 1's (its first rounds are the same run's) when it
    ran, else an uninterrupted run of the same config."""
    first = ctx.shared.get("quickstart")
    if first is not None and first.record is not None:
        return first.record, f"check 1's rounds 1-{RESUMED_ROUNDS}"
    run = ctx.fedray(
        "uninterrupted",
        "run",
        QUICKSTART,
        ctx.share,
        f"rounds={RESUMED_ROUNDS}",
        "checkpoint_every=1",
        ctx.storage,
    )
    return run.record, "an uninterrupted run"


def check_checkpoints(ctx: Context, row: Row, checkpoint_dir: str, client_states: bool = False) -> None:
    """Checks 7 and 8: every checkpoint file loads in a process that sees no GPU; with
    ``client_states``, the run's clients wrote theirs (an algorithm whose clients keep state)."""
    load = ctx.run_command(
        "load checkpoints without a GPU",
        [sys.executable, str(SCRIPT.relative_to(ROOT)), "--load-checkpoints", checkpoint_dir],
        env_changes={"CUDA_VISIBLE_DEVICES": ""},
        timeout=LOAD_TIMEOUT_S,
    )
    if not row.no_problem(load.problem()):
        return
    report = json.loads(load.stdout.strip().splitlines()[-1])
    row.require(not report["cuda"], "the loading process saw a GPU")
    row.require(report["files"] > 0, f"no checkpoint file under {checkpoint_dir}")
    row.require(not report["errors"], f"could not load: {'; '.join(report['errors'])}")
    row.require(not report["off_cpu"], f"tensors off the CPU in {', '.join(report['off_cpu'])}")
    row.require(not report["saved_on_gpu"], f"saved on a GPU: {'; '.join(report['saved_on_gpu'])}")
    if client_states:
        row.require(report["client_states"] > 0, f"no client state under {checkpoint_dir}/{STATES_DIR}")
    row.notes.append(
        f"{report['files']} checkpoint files ({report['client_states']} client states), "
        f"{report['tensors']} tensors loaded on the CPU"
    )


def check_resume(ctx: Context) -> list[Row]:
    """7: stop after round 2, resume on the GPU, load the checkpoints without one, compare."""
    row = Row(f"7 stop at {STOP_AFTER}, resume, load without GPU")
    schedule = [
        f"rounds={RESUMED_ROUNDS}",
        "checkpoint_every=1",
        ctx.storage,
        "--stop-after",
        str(STOP_AFTER),
    ]
    stopped = ctx.fedray("stopped run", "run", QUICKSTART, ctx.share, *schedule)  # options after overrides
    if not row.no_problem(stopped.problem(status="KILLED")) or stopped.record is None:
        return [row]
    steps = len(stopped.record.values(Metrics.TIME_ROUND_S))
    row.require(steps == STOP_AFTER, f"stopped run logged {steps} rounds, expected {STOP_AFTER}")
    resumed = ctx.fedray("resumed run", "run", "--resume", stopped.record.run_id)
    record = judge_run(row, ctx, resumed, "cuda")
    if record is None:
        return [row]
    show_gpu_use(row, ctx, resumed.outcome, [record], busy=True)
    check_checkpoints(ctx, row, record.tags.get(Tags.CHECKPOINT_DIR, ""))
    reference, label = uninterrupted_reference(ctx)
    if reference is None:
        row.require(False, f"{label} failed: nothing to compare with")
        return [row]
    ignore = IGNORED_PREFIXES + END_OF_RUN_PREFIXES
    diffs = metric_differences(reference.history, record.history, ignore, last_step=RESUMED_ROUNDS)
    row.require(not diffs, f"{len(diffs)} metrics differ from {label}: {'; '.join(diffs[:3])}")
    if not diffs:
        row.notes.append(f"rounds 1-{RESUMED_ROUNDS} identical to {label}")
    return [row]


def writes_client_states(config: str, overrides: tuple[str, ...]) -> bool:
    """Whether a run of ``config`` with ``overrides`` writes client states, by the platform's own rule
    (``commits_state``): FedProto's and FedL2G's clients keep their models, FedSC's keep nothing."""
    cfg = load_config(str(ROOT / config), list(overrides))
    return commits_state(get_algorithm(cfg.algorithm).client_cls, cfg)


def check_algorithms(ctx: Context) -> list[Row]:
    """8: two rounds of FedSC, FedL2G and FedProto on the GPU, one row each."""
    rows = []
    for name, config, extra in ALGORITHM_RUNS:
        row = Row(f"{name}, 2 rounds {ctx.at}")
        run = ctx.fedray(name, "run", config, "rounds=2", *extra, ctx.share, ctx.storage)
        record = judge_run(row, ctx, run, "cuda")
        if record is not None:
            show_gpu_use(row, ctx, run.outcome, [record], busy=True)
            states = writes_client_states(config, extra)
            check_checkpoints(ctx, row, record.tags.get(Tags.CHECKPOINT_DIR, ""), client_states=states)
        rows.append(row)
    return rows


def fail_fast_problems(returncode: int, stderr: str, seconds: float, timed_out: bool) -> list[str]:
    """What check 9 found wrong with a GPU run started where no GPU is visible (nothing: it failed
    as it should, fast, with exit status 2 and one line naming the key)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    problems = []
    if timed_out or seconds >= FAIL_FAST_S:
        problems.append(f"took {seconds:.0f} s (limit {FAIL_FAST_S} s)")
    if returncode != 2:
        problems.append(f"exit status {returncode}, expected 2")
    if len(lines) != 1 or "ray.num_gpus_per_client" not in lines[0]:
        problems.append(f"{len(lines)} lines on stderr, expected one naming ray.num_gpus_per_client")
    return problems


def check_fail_fast(ctx: Context) -> list[Row]:
    """9: GPUs asked for with none visible fail at once, in one line."""
    row = Row("9 GPU asked for, none visible")
    outcome = ctx.run_command(
        "GPU asked for, none visible",
        [FEDRAY, "run", "rounds=1", f"ray.num_gpus_per_client={GPU_SHARE:g}", ctx.storage],
        env_changes={"CUDA_VISIBLE_DEVICES": ""},
        timeout=FAIL_FAST_S,
    )
    for problem in fail_fast_problems(outcome.returncode, outcome.stderr, outcome.seconds, outcome.timed_out):
        row.require(False, problem)
    row.notes.append(f"exit {outcome.returncode} after {outcome.seconds:.1f} s: {last_line(outcome.stderr)}")
    return [row]


CHECKS: dict[int, Callable[[Context], list[Row]]] = {
    1: check_quickstart_gpu,
    2: check_cpu_baseline,
    3: check_default_config,
    4: check_rerun,
    5: check_cross_device,
    6: check_sweep,
    7: check_resume,
    8: check_algorithms,
    9: check_fail_fast,
}


def run_check(ctx: Context, number: int) -> list[Row]:
    """One check; an error of the script's own is that check's failure, not the end of the others."""
    title = (CHECKS[number].__doc__ or str(number)).splitlines()[0]
    progress(f"check {title}")
    started = time.monotonic()
    try:
        rows = CHECKS[number](ctx)
    except Exception as err:
        row = Row(title.split(":")[0])
        row.require(False, f"{type(err).__name__}: {last_line(str(err))}")
        rows = [row]
    for row in rows:
        progress(f"check {row.check}: {row.result} ({time.monotonic() - started:.0f} s)")
    return rows


# --------------------------------------------------------------------------------------------- report


def render_text(rows: list[Row]) -> str:
    """The table for a terminal: padded columns, notes last and whole."""
    table = [list(COLUMNS), *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in table
    )


def render_markdown(rows: list[Row], header: list[str], commands: list[Outcome]) -> str:
    """The report to paste into an issue: what ran where, the table, and every command run."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["# fedray gpu-check", "", *(f"- {line}" for line in header), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(c) for c in row.cells()) + " |" for row in rows]
    lines += ["", "## Commands", ""]
    for c in commands:
        lines.append(
            f"- `{c.shown}`: exit {c.returncode}, {c.seconds:.1f} s" + (" (timed out)" if c.timed_out else "")
        )
    if not commands:
        lines.append("(none)")
    return "\n".join(lines) + "\n"


def machine_header(ctx: Context, rows: list[Row], elapsed: float) -> list[str]:
    """The lines above the table: when, on what, in what mode, how long, how many passed."""
    from importlib.metadata import version

    gpu = (
        "none (--pretend-gpu: GPU expectations not checked)" if ctx.pretend else torch.cuda.get_device_name(0)
    )
    passed = sum(row.passed for row in rows)
    return [
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, GPU: {gpu}",
        f"torch {torch.__version__}, ray {version('ray')}, nvidia-smi {'sampled' if ctx.smi_on else 'not sampled'}",
        f"{passed} of {len(rows)} rows passed in {elapsed:.0f} s",
    ]


def no_gpu_reason() -> str | None:
    """Why this machine has nothing to check (None: torch sees a GPU)."""
    if not torch.cuda.is_available():
        return "no GPU visible to torch (torch.cuda.is_available() is False)"
    if torch.cuda.device_count() == 0:
        return "no GPU visible to torch (torch.cuda.device_count() is 0)"
    return None


def parse_only(text: str) -> list[int]:
    """``--only 9,3,1``: the checks to run, in the order given (on a lease, the ones that matter first;
    check 7 compares with check 1's run when 1 comes before it), each once."""
    try:
        numbers = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected check numbers such as 1,4") from None
    unknown = [n for n in numbers if n not in CHECKS]
    if unknown or not numbers:
        raise argparse.ArgumentTypeError(f"{text!r}: checks are numbered 1-{len(CHECKS)}")
    return numbers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--only", type=parse_only, default=sorted(CHECKS), help="checks to run, in this order, e.g. 9,3,1"
    )
    parser.add_argument("--data", help="check 5: a CIFAR-10 JPEG tree, cifar10-jpeg.tar.gz, or 'synthetic'")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=CROSS_DEVICE_ROUNDS, help="check 5's rounds")
    parser.add_argument(
        "--share",
        type=float,
        default=GPU_SHARE,
        help="ray.num_gpus_per_client of the GPU checks (%(default)s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, MLflow store)")
    # developer's: the same commands on a CPU machine, GPU expectations noted as not checked
    parser.add_argument("--pretend-gpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-checkpoints", metavar="DIR", help=argparse.SUPPRESS)  # check 7's child
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if not 0 < args.share <= 1:
        parser.error(f"--share {args.share:g}: a GPU slice in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_checkpoints:
        print(json.dumps(load_checkpoints(args.load_checkpoints)))
        return 0
    reason = no_gpu_reason()
    if reason and not args.pretend_gpu:
        print(f"gpu-check: {reason}: nothing to check", flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fedray-gpu-check-"))
    smi_on = not args.pretend_gpu and shutil.which("nvidia-smi") is not None
    ctx = Context(tmp, args.pretend_gpu, smi_on, args.data, args.rounds, args.share)
    progress(f"gpu-check: checks {','.join(map(str, args.only))}, work in {tmp}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for number in args.only:
        rows += run_check(ctx, number)
        # rewritten after every check: a run cut short (a lease's time limit, Ctrl-C) keeps its rows
        elapsed = time.monotonic() - STARTED
        header = machine_header(ctx, rows, elapsed)
        args.out.write_text(render_markdown(rows, header, ctx.commands))
    print("\n" + "\n".join(header) + "\n\n" + render_text(rows), flush=True)
    passed = all(row.passed for row in rows)
    if args.keep or not passed:
        print(f"logs and MLflow store kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"report: {args.out}   total {elapsed:.0f} s", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
