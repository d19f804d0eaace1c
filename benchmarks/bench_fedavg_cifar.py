"""fedray against a plain single-process PyTorch loop doing the same FedAvg training, on two workloads.

Real CIFAR-10 (the JPEG archive at $FEDRAY_CIFAR10_ARCHIVE, else .data/cifar10-jpeg.tar.gz), FedAvg with
the FedAvg CNN, both sides on the identical partition, the same clients each round and the same optimizer:

- ``w1``: 10,000 training images, 20 clients, Dirichlet(0.5), 1 local epoch, batch 50, 10 rounds,
  every client every round: the model's compute dominates.
- ``cross-device``: pfl-research's benchmark shape scaled to a CPU: the 50,000 training images split
  IID into 1,000 clients of 50, 50 clients per round, 1 local epoch, batch 10 (5 SGD steps a
  client), SGD lr 0.05, 20 rounds, the global model tested after rounds 10 and 20: what a framework
  spends per client dominates.

The plain loop uses every core in one process (one model reused, the global state copied in and
each client's state copied out), its images NCHW as a hand-written loop has them
(``--plain-memory-format channels_last`` lays them out as fedray's CPU workers do, so the ratio is
fedray's own overhead); fedray uses one ClientActor per core. Its one-thread time per client is
measured on both layouts.

``--mode cold`` (the default) times each side as one fresh command, as a user runs it (``fedray
run`` starting its own Ray; the plain loop as its own ``python`` process), interleaved ``--cold-repeats``
times per workload, and reports for each workload the whole command and the rounds without
evaluation (fedray's ``time/round_s`` from MLflow against the plain loop's own round clock), each as
a ratio of medians with the pairwise spread, fedray's ``time/client_s`` against the plain loop's
one-thread time per client (measured after its rounds, one thread, the same clients), when each side
finished round 1, and the peak PSS of each side's process tree (Ray's daemons, workers and object
store included). ``--mode warm`` keeps the older W1 figure: both clocks start in one process that
has imported everything, with Ray already up.

A shared VM's speed drifts by 10-30 % over minutes, so the two sides alternate and ratios are taken
between medians.

    make bench                      # or: python benchmarks/bench_fedavg_cifar.py --workload cross-device --cold-repeats 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# MLflow and its sqlite store (1-2 s of imports) are loaded before the clocks start, like torch;
# fedray imports them lazily, on a run's first use
import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
import psutil
import torch
import torch.nn.functional as F
from process_names import process_label

from fedray.platform.api import weighted_average
from fedray.platform.api.algorithm import batch_loader, sample_clients
from fedray.platform.catalog import load_config
from fedray.platform.config import clients_per_round
from fedray.platform.data import ArrayDataset, normalize
from fedray.platform.data.archive import cifar10_jpeg_archive, unpack_image_archive
from fedray.platform.models import build_model
from fedray.platform.runtime.driver import Result, ensure_ray, prepare_federation, run_experiment
from fedray.platform.runtime.memory import retain_freed_memory
from fedray.platform.runtime.worker import evaluate_model
from fedray.platform.tracking.names import Metrics

NCHW = torch.contiguous_format  # how a hand-written loop has its images

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = cifar10_jpeg_archive(ROOT)


def cifar_root(path: str | None) -> Path:
    """The unpacked JPEG tree; the archive is unpacked once into ~/.cache/fedray (never the repo)."""
    if path:
        return Path(path).expanduser()
    return unpack_image_archive(ARCHIVE, Path.home() / ".cache" / "fedray" / "cifar10-jpeg")


class PeakMemory:
    """Samples the resident memory of this process plus every Ray worker process (``ray::*``).

    Finding the Ray processes means reading every process's command line (about 5 ms here), so the
    list is refreshed once a second and the 0.2 s samples read only the known processes: a scan
    at every sample would itself take 2-3 % of a core away from fedray's actors.
    """

    def __init__(self, include_ray: bool) -> None:
        self.include_ray = include_ray
        self.peak = 0
        self._stop = threading.Event()
        self._ray: list[psutil.Process] = []

    def _find_ray_processes(self) -> None:
        found = []
        for proc in psutil.process_iter(["name", "cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if cmd.startswith("ray::") or (proc.info["name"] or "").startswith("ray::"):
                found.append(proc)
        self._ray = found

    def _sample(self) -> int:
        total = psutil.Process().memory_info().rss
        for proc in self._ray:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total

    def __enter__(self) -> PeakMemory:
        def loop() -> None:
            tick = 0
            while not self._stop.wait(0.2):
                if self.include_ray and tick % 5 == 0:
                    self._find_ray_processes()
                tick += 1
                self.peak = max(self.peak, self._sample())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class TreePss(PeakMemory):
    """PeakMemory over one command's process tree, summing PSS instead of RSS.

    The tree is the command's process and all its descendants: a local Ray's GCS, raylet, agents
    and worker processes (Coordinator, ClientActors) all descend from the driver. It is re-listed
    once a second, as PeakMemory re-lists Ray's processes; PSS splits shared pages (torch's
    libraries, Ray's object store) between the processes that map them, so the sum counts them once.

    Reading PSS makes the kernel walk each process's page tables: about 0.1 s of CPU for a run's
    dozen processes here, so sampling at PeakMemory's 0.2 s would take a third of a core from the
    run being measured. A sample is therefore taken every ``interval`` seconds (the ticks between
    return 0, which leaves the peak alone).
    """

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(include_ray=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self._due = 0.0
        self.at_peak: list[tuple[str, int]] = []  # (process, PSS) of the peak sample, largest first
        self.seen: dict[int, psutil.Process] = {}  # every descendant ever listed

    def _find_ray_processes(self) -> None:
        try:
            self._ray = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the command has exited
            self._ray = []
        self.seen.update((p.pid, p) for p in self._ray[1:])

    def leftovers(self) -> list[psutil.Process]:
        """Descendants still alive after the command exited (a Ray it did not shut down)."""
        alive = []
        for proc in self.seen.values():
            try:  # is_running() also checks the pid was not reused
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        return alive

    def _sample(self) -> int:
        now = time.monotonic()
        if now < self._due:
            return 0
        self._due = now + self.interval
        parts = []
        for proc in self._ray:
            try:
                parts.append((proc, proc.memory_full_info().pss))
            except psutil.Error:
                continue
        total = sum(pss for _, pss in parts)
        if total > self.peak:
            self.at_peak = sorted(((process_label(p), pss) for p, pss in parts), key=lambda x: -x[1])
        return total


def wait_until_idle(limit_s: float = 60.0) -> None:
    """Block until the CPUs are idle (Ray's workers finish importing; earlier runs' processes exit)."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while time.monotonic() < deadline and quiet < 2:
        quiet = quiet + 1 if psutil.cpu_percent(interval=0.5) < 15 else 0


def timed(run, cfg, *, include_ray: bool):
    """(wall seconds, peak memory, what ``run(cfg)`` returns), on a machine left idle first."""
    wait_until_idle()
    with PeakMemory(include_ray) as mem:
        t0 = time.perf_counter()
        out = run(cfg)
        seconds = time.perf_counter() - t0
    return seconds, mem.peak, out


def timed_fedray(cfg) -> tuple[float, int, Result]:
    import ray

    # a fresh Ray per repeat whose workers start (and import) before the clock: the warm figure. A
    # run's own local Ray starts a worker per actor instead, when the run creates them
    ensure_ray(cfg, prestart=True)
    try:
        return timed(run_experiment, cfg, include_ray=True)
    finally:
        ray.shutdown()


def is_eval_round(cfg, rnd: int) -> bool:
    """Whether fedray tests the global model after round ``rnd`` (1-based), as the Coordinator decides."""
    return rnd % cfg.eval_every == 0 or rnd == cfg.rounds


def plain_fedavg(
    cfg, on_round=None, client_times: list[float] | None = None, layout: torch.memory_format = NCHW
) -> float:
    """The same FedAvg, written as the single-process loop a researcher would write by hand, from
    the same cached tensors and the same partition: the clients fedray samples each round, one model
    reused, the global model tested when fedray tests it. ``on_round(rnd, seconds, evaluated)`` is
    called after each round; ``client_times`` collects each client's seconds; ``layout``: the
    images' memory format (NCHW, as a hand-written loop has them)."""
    torch.set_num_threads(os.cpu_count() or 1)
    fed = prepare_federation(cfg)
    meta = (fed.in_channels, fed.image_size, fed.num_classes)
    torch.manual_seed(cfg.seed)
    global_model = build_model(cfg.model.group, *meta)
    local = build_model(cfg.model.group, *meta)
    x_test = normalize(fed.global_test.x, fed.mean, fed.std).contiguous(memory_format=layout)
    k = clients_per_round(cfg)
    acc = float("nan")
    for rnd in range(cfg.rounds):
        start = time.perf_counter()
        states, weights = [], []
        for cid in sample_clients(cfg.seed, rnd, cfg.data.num_clients, k):
            client_start = time.perf_counter()
            states.append(train_plain_client(cfg, fed, local, global_model.state_dict(), cid, rnd, layout))
            weights.append(len(fed.shards[cid].train))
            if client_times is not None:
                client_times.append(time.perf_counter() - client_start)
        global_model.load_state_dict(weighted_average(states, weights))
        evaluated = is_eval_round(cfg, rnd + 1)
        if evaluated:
            correct, total, _ = evaluate_model(global_model, x_test, fed.global_test.y, "cpu")
            acc = correct / total
        if on_round is not None:
            on_round(rnd + 1, time.perf_counter() - start, evaluated)
    return acc


def train_plain_client(
    cfg, fed, local, global_state, cid: int, rnd: int, layout: torch.memory_format = NCHW
) -> dict:
    """One client of the plain loop: its shard normalised (in ``layout``), the global state loaded
    into the one reused model, a fresh SGD, its local epochs, its state copied out."""
    shard = fed.shards[cid]
    x = normalize(shard.train.x, fed.mean, fed.std).contiguous(memory_format=layout)
    data = ArrayDataset(x, shard.train.y)
    local.load_state_dict(global_state)
    t = cfg.train
    assert t.optimizer == "sgd", "the plain loop steps SGD, as the benchmark's configs train"
    opt = torch.optim.SGD(local.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    for _ in range(t.local_epochs):
        for xb, yb in batch_loader(data, t.batch_size, shuffle=True, seed=rnd * 1000 + cid):
            opt.zero_grad()
            F.cross_entropy(local(xb), yb).backward()
            opt.step()
    return {k: v.clone() for k, v in local.state_dict().items()}


def plain_one_thread_client_s(cfg, clients: int = 50, layout: torch.memory_format = NCHW) -> float:
    """The plain loop's median seconds per client on one thread (the yardstick for fedray's
    ``time/client_s``, which each one-thread ClientActor measures): round 0's clients, trained again,
    their images in ``layout``."""
    torch.set_num_threads(1)
    fed = prepare_federation(cfg)
    meta = (fed.in_channels, fed.image_size, fed.num_classes)
    torch.manual_seed(cfg.seed)
    global_model, local = build_model(cfg.model.group, *meta), build_model(cfg.model.group, *meta)
    times = []
    for cid in sample_clients(cfg.seed, 0, cfg.data.num_clients, clients_per_round(cfg))[:clients]:
        start = time.perf_counter()
        train_plain_client(cfg, fed, local, global_model.state_dict(), cid, 0, layout)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------- cold


PLAIN_DONE = "plain global accuracy"  # the plain child's last line of the workload itself
LAYOUTS = {"contiguous": NCHW, "channels_last": torch.channels_last}


@dataclass
class ColdRun:
    """One side's cold command: the whole command, its end of round 1, its rounds without evaluation
    and its time per client (fedray's ``time/client_s``; the plain loop's on one thread), peak PSS."""

    seconds: float
    first_round: float
    peak_pss: int
    rounds: list[float] = field(default_factory=list)  # seconds of each round without evaluation
    client_s: float | None = None
    client_cl_s: float | None = None  # the plain loop's one-thread client on channels_last images


def timed_command(
    argv: list[str], env: dict[str, str], done_marker: str | None = None
) -> tuple[float, float, int, list[str]]:
    """(whole command s, s to the end of round 1, peak tree PSS, its output lines) of one command, as
    a user runs it: a fresh process (and, for fedray, a fresh Ray). Round 1 ends when its progress
    line is printed; the command ends when it exits, or when it prints a line starting with
    ``done_marker`` (what it does after that is not the workload)."""
    wait_until_idle()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first_round, done, lines = None, None, []
    with TreePss(proc.pid, interval=2.0) as mem:
        for line in proc.stdout:
            lines.append(line)
            if first_round is None and line.startswith("round") and line.split()[1].startswith("1/"):
                first_round = time.perf_counter() - t0
            if done is None and done_marker is not None and line.startswith(done_marker):
                done = time.perf_counter() - t0
        proc.wait()
    seconds = time.perf_counter() - t0 if done is None else done
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{''.join(lines[-20:])}")
    return seconds, first_round if first_round is not None else seconds, mem.peak, lines


def fedray_cold(argv: list[str], env: dict[str, str], cfg) -> ColdRun:
    """``fedray run`` as one cold command; its rounds and clients read back from its MLflow run."""
    from mlflow.tracking import MlflowClient

    seconds, first, peak, lines = timed_command(argv, env)
    run_id = next(m.group(1) for line in lines if (m := re.search(r"MLflow run id: (\w+)", line)))
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    rounds = {m.step: m.value for m in client.get_metric_history(run_id, Metrics.TIME_ROUND_S)}
    clients = [m.value for m in client.get_metric_history(run_id, Metrics.TIME_CLIENT_S)]
    plain_rounds = [s for step, s in sorted(rounds.items()) if not is_eval_round(cfg, step)]
    return ColdRun(seconds, first, peak, plain_rounds, statistics.median(clients))


def plain_cold(argv: list[str], env: dict[str, str]) -> ColdRun:
    """The plain loop as one cold command: it prints each round's seconds, its accuracy (where the
    command's clock stops), then its one-thread time per client."""
    seconds, first, peak, lines = timed_command(argv, env, done_marker=PLAIN_DONE)
    rounds = [
        float(m.group(1)) for line in lines if (m := re.match(r"round \d+/\d+ ([\d.]+)s$", line.strip()))
    ]
    client, client_cl = (
        next(
            float(m.group(1)) for line in lines if (m := re.match(rf"one-thread client{tag} ([\d.]+)s", line))
        )
        for tag in ("", " channels_last")
    )
    return ColdRun(seconds, first, peak, rounds, client, client_cl)


def cold_pairs(name: str, overrides: list[str], repeats: int, tmp: Path, plain_layout: str) -> None:
    """``fedray run`` as one cold command against the plain loop in a fresh process, interleaved."""
    cfg = load_config(None, overrides)
    fedray = str(Path(sys.executable).with_name("fedray"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    fed_argv = [fedray, "run", *[o for o in overrides if not o.startswith("progress")], f"storage_path={tmp}"]
    plain_argv = [
        sys.executable,
        __file__,
        "--plain-memory-format",
        plain_layout,
        "--plain-child",
        *overrides,
    ]
    fed_runs: list[ColdRun] = []
    plain_runs: list[ColdRun] = []
    for rep in range(1, repeats + 1):
        fed_runs.append(fedray_cold(fed_argv, env, cfg))
        plain_runs.append(plain_cold(plain_argv, env))
        f, p = fed_runs[-1], plain_runs[-1]
        print(
            f"{name} cold pair {rep}: fedray {f.seconds:.1f}s (round 1 at {f.first_round:.1f}s, rounds "
            f"{statistics.median(f.rounds):.2f}s), plain {p.seconds:.1f}s (round 1 at {p.first_round:.1f}s, "
            f"rounds {statistics.median(p.rounds):.2f}s)",
            flush=True,
        )
    report_cold(name, fed_runs, plain_runs)


def ratio_line(what: str, fed: list[float], plain: list[float]) -> str:
    """``what: fedray/plain = r (medians; pairwise lo-hi)``."""
    pairwise = sorted(f / p for f, p in zip(fed, plain))
    med = statistics.median
    return (
        f"{what}: fedray {med(fed):.2f}s, plain {med(plain):.2f}s, ratio of medians {med(fed) / med(plain):.2f} "
        f"(pairwise {pairwise[0]:.2f}-{pairwise[-1]:.2f})"
    )


def report_cold(name: str, fed: list[ColdRun], plain: list[ColdRun]) -> None:
    med = statistics.median
    gib = 2**30
    print(f"\n{name}, cold, {len(fed)} interleaved pairs")
    print(f"{'':<8}{'command s':>11}{'round 1 at s':>14}{'round s':>9}{'client ms':>11}{'peak PSS GiB':>14}")
    for side, runs in (("fedray", fed), ("plain", plain)):
        print(
            f"{side:<8}{med(r.seconds for r in runs):>11.1f}{med(r.first_round for r in runs):>14.1f}"
            f"{med(med(r.rounds) for r in runs):>9.2f}{1000 * med(r.client_s for r in runs):>11.1f}"
            f"{max(r.peak_pss for r in runs) / gib:>14.2f}"
        )
    print(ratio_line("whole command", [r.seconds for r in fed], [r.seconds for r in plain]))
    print(
        ratio_line(
            "round without evaluation (median)",
            [med(r.rounds) for r in fed],
            [med(r.rounds) for r in plain],
        )
    )
    fed_client = med(r.client_s for r in fed)
    plain_client = med(r.client_s for r in plain)
    print(
        f"time per client: fedray's {Metrics.TIME_CLIENT_S} {1000 * fed_client:.1f} ms (median over runs of each run's "
        f"median) vs the plain loop's one-thread client {1000 * plain_client:.1f} ms: {fed_client / plain_client:.2f}x"
    )
    plain_cl = med(r.client_cl_s for r in plain)
    print(
        f"  the plain loop's one-thread client on channels_last images (as fedray's CPU workers keep them): "
        f"{1000 * plain_cl:.1f} ms, fedray {fed_client / plain_cl:.2f}x"
    )
    print(
        f"round 1 ends {med(r.first_round for r in fed) - med(r.first_round for r in plain):+.1f}s after the plain loop's"
    )


def plain_child(overrides: list[str], layout: torch.memory_format) -> None:
    """The plain loop as its own process: a line per round with its seconds, as ``fedray run`` prints
    one, then its one-thread time per client, on its own layout and on channels_last images."""
    cfg = load_config(None, overrides)

    def show(rnd: int, seconds: float, evaluated: bool) -> None:
        print(f"round {rnd}/{cfg.rounds} {seconds:.3f}s{' (evaluated)' if evaluated else ''}", flush=True)

    acc = plain_fedavg(cfg, on_round=show, layout=layout)
    print(f"{PLAIN_DONE} {100 * acc:.2f} %", flush=True)
    print(f"one-thread client {plain_one_thread_client_s(cfg, layout=layout):.4f}s", flush=True)
    cl = plain_one_thread_client_s(cfg, layout=torch.channels_last)
    print(f"one-thread client channels_last {cl:.4f}s", flush=True)


def w1_overrides(root: Path, args) -> list[str]:
    return [
        "name=bench",
        "data.dataset=imagefolder",
        f"data.root={root}",
        f"data.num_clients={args.clients}",
        f"data.train_subset={args.train_samples}",
        "data.partition.kind=dirichlet",
        "data.partition.alpha=0.5",
        "data.split.train=1.0",
        "data.split.test=0.0",
        "model.group=fedavg_cnn",
        f"rounds={args.rounds}",
        f"eval_every={args.rounds}",
        "checkpoint_every=0",
        "train.local_epochs=1",
        "train.batch_size=50",
        "train.lr=0.01",
        "train.momentum=0.9",
        "progress=false",
    ]


def cross_device_overrides(root: Path, args) -> list[str]:
    return [
        "name=bench-cross-device",
        "data.dataset=imagefolder",
        f"data.root={root}",
        "data.num_clients=1000",
        "data.partition.kind=iid",
        "data.split.train=1.0",
        "data.split.test=0.0",
        "model.group=fedavg_cnn",
        f"rounds={args.xd_rounds}",
        f"eval_every={max(1, args.xd_rounds // 2)}",
        "checkpoint_every=0",
        "train.fraction=0.05",
        "train.local_epochs=1",
        "train.batch_size=10",
        "train.lr=0.05",
        "train.momentum=0.0",
        "eval.clients=selected",
        "progress=false",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="unpacked CIFAR-10 JPEG tree (train/<class>, test/<class>)")
    parser.add_argument(
        "--workload",
        choices=["w1", "cross-device", "both"],
        default="both",
        help="which workload (cold mode)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="W1's rounds")
    parser.add_argument("--xd-rounds", type=int, default=20, help="the cross-device shape's rounds")
    parser.add_argument("--clients", type=int, default=20, help="W1's clients")
    parser.add_argument("--train-samples", type=int, default=10_000, help="W1's training images")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side (warm)")
    parser.add_argument(
        "--plain-retains-memory",
        action="store_true",
        help="give this process (the plain loop's, and fedray's driver) the allocator setting "
        "fedray's ClientActors use; a hand-written loop does not have it, so this shows how much "
        "of the ratio it explains",
    )
    parser.add_argument(
        "--mode",
        choices=["cold", "warm", "both"],
        default="cold",
        help="cold: each side as one fresh command, as a user runs it (fedray run starts its own Ray); "
        "warm: W1 with both clocks inside this process, Ray up before fedray's starts",
    )
    parser.add_argument("--cold-repeats", type=int, default=5, help="alternating cold pairs per workload")
    parser.add_argument(
        "--plain-memory-format",
        choices=list(LAYOUTS),
        default="contiguous",
        help="the plain loop's image layout: contiguous (NCHW, as a hand-written loop has them), or "
        "channels_last (as fedray's CPU workers keep them: the ratio is then fedray's own overhead)",
    )
    parser.add_argument("--plain-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child is not None:
        return plain_child(args.plain_child, LAYOUTS[args.plain_memory_format])
    if args.plain_retains_memory and not retain_freed_memory():
        parser.error("--plain-retains-memory: this C library has no mallopt, or MALLOC_*_THRESHOLD_ is set")

    root = cifar_root(args.data)
    workloads = {"w1": w1_overrides(root, args), "cross-device": cross_device_overrides(root, args)}
    chosen = list(workloads) if args.workload == "both" else [args.workload]
    for name in chosen:
        t0 = time.perf_counter()
        # decodes once; every run reads the cache
        fed = prepare_federation(load_config(None, workloads[name]))
        print(
            f"{name} data: {sum(len(s.train) for s in fed.shards)} training images over {len(fed.shards)} "
            f"clients, {len(fed.global_test)} test images (prepared in {time.perf_counter() - t0:.1f}s)"
        )

    if args.mode in ("cold", "both"):
        for name in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                cold_pairs(name, workloads[name], args.cold_repeats, Path(tmp), args.plain_memory_format)
            print()
        if args.mode == "cold":
            return

    cfg = load_config(None, workloads["w1"])
    fedray_runs, plain_runs = [], []
    for rep in range(1, args.repeats + 1):
        fedray_runs.append(timed_fedray(cfg))
        plain_runs.append(timed(plain_fedavg, cfg, include_ray=False))
        print(f"repeat {rep}: fedray {fedray_runs[-1][0]:.1f}s, plain {plain_runs[-1][0]:.1f}s", flush=True)

    fedray_s = statistics.median(r[0] for r in fedray_runs)
    plain_s = statistics.median(r[0] for r in plain_runs)
    chosen_s, _, result = min(fedray_runs, key=lambda r: abs(r[0] - fedray_s))  # the median run
    gib = 2**30
    print()
    print(f"{'':<10}{'median s':>10}{'all runs s':>22}{'peak mem GiB':>15}{'global acc %':>15}")
    for name, runs, acc in (
        ("fedray", fedray_runs, result.final[Metrics.ACC_GLOBAL]),
        ("plain", plain_runs, plain_runs[0][2]),
    ):
        median = statistics.median(r[0] for r in runs)
        every = " ".join(f"{r[0]:.1f}" for r in runs)
        peak = max(r[1] for r in runs) / gib
        print(f"{name:<10}{median:>10.1f}{every:>22}{peak:>15.2f}{100 * acc:>15.2f}")
    print(f"ratio fedray/plain = {fedray_s / plain_s:.2f}   (medians; MLflow run {result.run_id})")
    if args.plain_retains_memory:
        print("the plain loop ran with fedray's allocator setting (--plain-retains-memory)")
    rounds_s = sum(m[Metrics.TIME_ROUND_S] for m in result.history)
    print(
        f"fedray breakdown (median run): {rounds_s:.1f}s in the {len(result.history)} rounds "
        f"(ratio {rounds_s / plain_s:.2f} of the plain loop), {chosen_s - rounds_s:.1f}s around them: "
        "loading the data, starting the actors, MLflow set-up not hidden by round 1, final artifacts, teardown"
    )


if __name__ == "__main__":
    main()
