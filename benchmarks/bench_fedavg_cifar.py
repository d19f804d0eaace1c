"""fedray against a plain single-process PyTorch loop doing the same FedAvg training.

Real CIFAR-10 (the JPEGs in ../shared/data), 10,000 training images, 20 clients, Dirichlet(0.5),
the FedAvg CNN, 1 local epoch, batch 50, 10 rounds, every client every round. Both sides train on the
identical partition with the same optimizer; the plain loop uses all cores in one process, fedray
uses one ClientActor per core. Prints wall times, the ratio fedray/plain, peak memory and the final
global accuracies.

What each clock covers: both start in a process that has imported its libraries (torch for the
plain loop; ray, Lightning, and MLflow with its sqlite store for fedray), and fedray's starts with
Ray up and its worker processes booted and importing done (Ray's prestarted workers and the spare
Coordinator of ``ensure_ray``). fedray's clock covers everything a run does: loading the data,
starting the actors, creating the MLflow run and logging to it, the rounds, the final artifacts
and tearing the actors down. Each side waits for an idle machine before its clock starts, and the
two sides alternate ``--repeats`` times (a fresh Ray for every fedray repeat): a shared VM's speed
drifts by 10-20 % over minutes, so the ratio is taken between the medians.

    make bench                      # or: python benchmarks/bench_fedavg_cifar.py --rounds 3 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# MLflow and its sqlite store (1-2 s of imports) are loaded before the clocks start, like torch;
# fedray imports them lazily, on a run's first use
import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
import psutil
import torch
import torch.nn.functional as F

from fedray.algorithms.fedavg import weighted_average
from fedray.platform.algorithm import batch_loader
from fedray.platform.client import evaluate_model
from fedray.platform.config import load_config
from fedray.platform.data import ArrayDataset, normalize
from fedray.platform.data.archive import unpack_image_archive
from fedray.platform.memory import retain_freed_memory
from fedray.platform.models import build_model
from fedray.platform.run import Result, ensure_ray, prepare_federation, run_experiment

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"


def cifar_root(path: str | None) -> Path:
    """The unpacked JPEG tree; the shared archive is unpacked once into ~/.cache/fedray (never the repo)."""
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


def process_label(proc: psutil.Process) -> str:
    """``ray::ClientActor``, ``raylet``, ``fedray``: what a process is, in a word."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if cmd and cmd[0].startswith("ray::"):  # ray::ClientActor, or ray::ClientActor.train while it runs one
        return cmd[0].split()[0].split(".")[0]
    name = proc.name()
    if name.startswith("python"):  # the script it runs: fedray, log_monitor.py, ...
        script = next((arg for arg in cmd[1:] if not arg.startswith("-")), None)
        return Path(script).name if script else name
    return name


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

    ensure_ray(cfg)  # a fresh Ray per repeat: warm prestarted workers each time
    try:
        return timed(run_experiment, cfg, include_ray=True)
    finally:
        ray.shutdown()


def plain_fedavg(cfg, on_round=None) -> float:
    """The same FedAvg, written as the single-process loop a researcher would write by hand, from
    the same cached tensors and the same partition. ``on_round(rnd)`` is called after each round."""
    torch.set_num_threads(os.cpu_count() or 1)
    fed = prepare_federation(cfg)
    meta = (fed.in_channels, fed.image_size, fed.num_classes)
    torch.manual_seed(cfg.seed)
    global_model = build_model(cfg.model.group, *meta)
    local = build_model(cfg.model.group, *meta)
    shards = [(normalize(s.train.x, fed.mean, fed.std), s.train.y) for s in fed.shards]
    t = cfg.train
    for rnd in range(cfg.rounds):
        states, weights = [], []
        for cid, (x, y) in enumerate(shards):
            local.load_state_dict(global_model.state_dict())
            opt = torch.optim.SGD(
                local.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
            )
            data = ArrayDataset(x, y)
            for _ in range(t.local_epochs):
                for xb, yb in batch_loader(data, t.batch_size, shuffle=True, seed=rnd * 1000 + cid):
                    opt.zero_grad()
                    F.cross_entropy(local(xb), yb).backward()
                    opt.step()
            states.append({k: v.clone() for k, v in local.state_dict().items()})
            weights.append(len(y))
        global_model.load_state_dict(weighted_average(states, weights))
        if on_round is not None:
            on_round(rnd + 1)
    x_test = normalize(fed.global_test.x, fed.mean, fed.std)
    correct, total, _ = evaluate_model(global_model, x_test, fed.global_test.y, "cpu")
    return correct / total


# ------------------------------------------------------------------------------------------- cold


def timed_command(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(whole command s, s to the end of round 1, peak tree PSS) of one command, as a user runs it:
    a fresh process (and, for fedray, a fresh Ray). Round 1 ends when its progress line is printed."""
    wait_until_idle()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first_round, tail = None, []
    with TreePss(proc.pid, interval=2.0) as mem:
        for line in proc.stdout:
            tail = [*tail[-20:], line]
            if first_round is None and line.startswith("round") and line.split()[1].startswith("1/"):
                first_round = time.perf_counter() - t0
        proc.wait()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{''.join(tail)}")
    return seconds, first_round if first_round is not None else seconds, mem.peak


def cold_pairs(overrides: list[str], repeats: int, tmp: Path) -> None:
    """``fedray run`` as one cold command against the plain loop in a fresh process, interleaved."""
    fedray = str(Path(sys.executable).with_name("fedray"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    fed_argv = [fedray, "run", *[o for o in overrides if not o.startswith("progress")], f"storage_path={tmp}"]
    plain_argv = [sys.executable, __file__, "--plain-child", *overrides]
    fed_runs, plain_runs = [], []
    for rep in range(1, repeats + 1):
        fed_runs.append(timed_command(fed_argv, env))
        plain_runs.append(timed_command(plain_argv, env))
        f, p = fed_runs[-1], plain_runs[-1]
        print(
            f"cold pair {rep}: fedray {f[0]:.1f}s (round 1 at {f[1]:.1f}s), plain {p[0]:.1f}s (round 1 at {p[1]:.1f}s)",
            flush=True,
        )
    gib = 2**30
    med = statistics.median
    print(f"\n{'cold':<10}{'median s':>10}{'round 1 at s':>14}{'peak PSS GiB':>14}   all runs s")
    for name, runs in (("fedray", fed_runs), ("plain", plain_runs)):
        every = " ".join(f"{r[0]:.1f}" for r in runs)
        print(
            f"{name:<10}{med(r[0] for r in runs):>10.1f}{med(r[1] for r in runs):>14.1f}"
            f"{max(r[2] for r in runs) / gib:>14.2f}   {every}"
        )
    ratios = sorted(f[0] / p[0] for f, p in zip(fed_runs, plain_runs))
    print(
        f"cold ratio fedray/plain = {med(r[0] for r in fed_runs) / med(r[0] for r in plain_runs):.2f} "
        f"(medians; pairwise {ratios[0]:.2f}-{ratios[-1]:.2f}); round 1 ends "
        f"{med(r[1] for r in fed_runs) - med(r[1] for r in plain_runs):+.1f}s after the plain loop's"
    )


def plain_child(overrides: list[str]) -> None:
    """The plain loop as its own process: prints a line per round, as ``fedray run`` does."""
    cfg = load_config(None, overrides)
    acc = plain_fedavg(cfg, on_round=lambda rnd: print(f"round {rnd}/{cfg.rounds}", flush=True))
    print(f"plain global accuracy {100 * acc:.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="unpacked CIFAR-10 JPEG tree (train/<class>, test/<class>)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--train-samples", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side")
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
        default="both",
        help="cold: each side as one fresh command, as a user runs it (fedray run starts its own Ray); "
        "warm: both clocks inside this process, Ray up before fedray's starts",
    )
    parser.add_argument("--cold-repeats", type=int, default=5, help="alternating cold pairs")
    parser.add_argument("--plain-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child is not None:
        return plain_child(args.plain_child)
    if args.plain_retains_memory and not retain_freed_memory():
        parser.error("--plain-retains-memory: this C library has no mallopt, or MALLOC_*_THRESHOLD_ is set")

    root = cifar_root(args.data)
    overrides = [
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
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    fed = prepare_federation(cfg)  # decodes once; both timed runs then load the same tensor cache
    print(
        f"data: {sum(len(s.train) for s in fed.shards)} training images over {len(fed.shards)} clients, "
        f"{len(fed.global_test)} test images (prepared in {time.perf_counter() - t0:.1f}s)"
    )

    if args.mode in ("cold", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            cold_pairs(overrides, args.cold_repeats, Path(tmp))
        if args.mode == "cold":
            return
        print()

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
        ("fedray", fedray_runs, result.final["acc/global"]),
        ("plain", plain_runs, plain_runs[0][2]),
    ):
        median = statistics.median(r[0] for r in runs)
        every = " ".join(f"{r[0]:.1f}" for r in runs)
        peak = max(r[1] for r in runs) / gib
        print(f"{name:<10}{median:>10.1f}{every:>22}{peak:>15.2f}{100 * acc:>15.2f}")
    print(f"ratio fedray/plain = {fedray_s / plain_s:.2f}   (medians; MLflow run {result.run_id})")
    if args.plain_retains_memory:
        print("the plain loop ran with fedray's allocator setting (--plain-retains-memory)")
    rounds_s = sum(m["time/round_s"] for m in result.history)
    print(
        f"fedray breakdown (median run): {rounds_s:.1f}s in the {len(result.history)} rounds "
        f"(ratio {rounds_s / plain_s:.2f} of the plain loop), {chosen_s - rounds_s:.1f}s around them: "
        "loading the data, starting the actors, MLflow set-up not hidden by round 1, final artifacts, teardown"
    )


if __name__ == "__main__":
    main()
