"""fedray at research scale: FedSSA on the CIFAR-10 JPEGs with 100, 1,000 and 10,000 clients.

Each client count N is one ``fedray run`` command in a fresh process (a fresh local Ray each time),
with a throw-away MLflow sqlite store (``MLFLOW_TRACKING_URI``) and ``storage_path``: FedSSA, the
FedAvg CNN for every client, pathological shards of 2 classes per client, 1 local epoch, 10 clients
per round (``train.fraction = 10/N``). From N = ``--merged-from`` (10,000) on, the clients share the
merged train+test pool (``data.split.convention=merged``, split 0.75/0/0.25: about 6 images each),
since the 50,000 training images alone leave too little per client.

Evaluation runs every ``--eval-every`` rounds and always on the last one (default: only on the last
one), over ``--eval`` clients (``eval.clients``), so a run has rounds without evaluation to compare
with the ideal. The per-round numbers are read back from the MLflow store after each run.

What each column means (seconds unless said):

- ``setup``: from the command's start until round 1 starts (imports, data, Ray, actors). Round 1's
  start is the earliest, over rounds k, of the time round k's metrics were logged minus rounds 1..k's
  ``time/round_s`` (the metrics are logged after the round ends, so each is an upper bound).
- ``round``: mean ``time/round_s`` of the rounds without evaluation.
- ``ideal``: the same rounds' client training time spread perfectly over the worker pool: the sum of
  the round's clients' ``time/client_s`` (logged as their mean, times the clients that trained)
  divided by the workers, min(Ray CPUs / ray.num_cpus_per_client, ray.max_actors, N, clients per round).
- ``ratio``: round / ideal (1.0 = no overhead beyond the clients' own training).
- ``eval round``: mean ``time/round_s`` of the rounds with evaluation (training + evaluation).
- ``after``: wall - setup - all rounds: checkpoints, final artifacts, Ray and process teardown.
- ``peak PSS MB``: peak proportional set size of the command's whole process tree (driver, Ray's
  GCS, raylet, Coordinator and ClientActors), so memory shared between processes counts once;
  sampled every ``--mem-interval`` seconds (reading PSS costs CPU), the peak sample split by process
  on each N's line above the table.
- ``wall``: the whole command, process start to exit.

Before each N the machine is left to go idle (a warning says when it would not); processes of the
command that outlive it are named and ended. A failed run keeps its MLflow store, storage and log in
a temporary folder (named in the table); ``--keep`` keeps every run's.

    make bench-scale ARGS="--clients 100,1000 --rounds 3"
    python benchmarks/bench_scale.py --clients 100 --rounds 2 --out /tmp/scale.csv
    python benchmarks/bench_scale.py --clients 10000 --eval sample ray.cache_clients=64   # extra key=value
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# the existing benchmark's helpers: the CIFAR-10 archive unpacked once, the idle wait, the memory sampler
from bench_fedavg_cifar import TreePss, cifar_root, wait_until_idle
from process_names import process_label

from fedray.platform.config import DataConfig
from fedray.platform.data import load_dataset
from fedray.platform.tracking.names import Metrics

ROOT = Path(__file__).resolve().parents[1]
CLIENTS_PER_ROUND = 10
EVAL_PREFIXES = (Metrics.ACC_PERSONAL_PREFIX, Metrics.ACC_GLOBAL, Metrics.LOSS_PERSONAL, Metrics.LOSS_GLOBAL)
MB = 2**20


@dataclass
class Outcome:
    n: int
    command: list[str]
    wall_s: float
    returncode: int
    peak_bytes: int
    log: Path
    at_peak: list[tuple[str, int]] = field(default_factory=list)
    row: dict = field(default_factory=dict)
    rounds: list[tuple[float, bool]] = field(default_factory=list)  # (round_s, evaluated)
    error: str = ""


def overrides_for(args: argparse.Namespace, n: int, root: Path, work: Path) -> list[str]:
    merged = n >= args.merged_from
    eval_every = args.eval_every or args.rounds
    out = [
        f"name=bench-scale-n{n}",
        "algorithm=fedssa",
        "seed=0",
        f"rounds={args.rounds}",
        f"eval_every={eval_every}",
        "data.dataset=imagefolder",
        f"data.root={root}",
        f"data.num_clients={n}",
        f"data.partition.kind={args.partition}",
        "data.partition.classes_per_client=2",
        "data.split.train=0.75",
        "data.split.val=0",
        "data.split.test=0.25",
        f"data.split.convention={'merged' if merged else 'per_client'}",
        "model.group=fedavg_cnn",
        f"train.fraction={min(1.0, CLIENTS_PER_ROUND / n)!r}",
        "train.local_epochs=1",
        "train.batch_size=64",
        "train.lr=0.01",
        "train.momentum=0.9",
        f"eval.clients={args.eval}",
        f"eval.sample_size={args.eval_sample_size}",
        f"storage_path={work / 'storage'}",
        "progress=false",
    ]
    if args.checkpoint_every is not None:
        out.append(f"checkpoint_every={args.checkpoint_every}")
    return out + list(args.overrides)


def fedray_command() -> list[str]:
    exe = Path(sys.executable).with_name("fedray")
    return [str(exe), "run"] if exe.exists() else [sys.executable, "-m", "fedray.platform.apps.cli", "run"]


def run_command(args: argparse.Namespace, n: int, root: Path, work: Path) -> Outcome:
    """One ``fedray run`` in a fresh process (so a fresh Ray), timed and memory-sampled."""
    cmd = [*fedray_command(), *overrides_for(args, n, root, work)]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray, never a cluster this shell points at
    log = work / "fedray.log"
    wait_until_idle()  # gives up after a minute: say so when others' work will be in the timings
    busy = psutil.cpu_percent(interval=1.0)
    if busy > 15:
        print(f"  warning: the machine is busy before N={n} ({busy:.0f}% CPU): timings include others' work")
    with log.open("wb") as out:
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        mem = TreePss(proc.pid, args.mem_interval)
        try:
            with mem:
                try:
                    code = proc.wait(timeout=args.timeout or None)
                except subprocess.TimeoutExpired:
                    print(f"  N={n}: over --timeout {args.timeout:g}s, stopping it (SIGTERM)", flush=True)
                    proc.send_signal(signal.SIGTERM)  # fedray ends the run as KILLED, like Ctrl-C
                    try:
                        code = proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        code = proc.wait()
            wall = time.time() - start
        except BaseException:  # Ctrl-C here: stop our command and its Ray, then stop
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise
        finally:
            stop_leftovers(mem, n)
    outcome = Outcome(n, cmd, wall, code, mem.peak, log, mem.at_peak)
    read_metrics(outcome, start, work)
    return outcome


def stop_leftovers(mem: TreePss, n: int) -> None:
    """End the processes this command started that outlived it (only those, by pid), so the next
    N starts on an idle machine; a normal ``fedray run`` leaves none."""
    alive = mem.leftovers()
    if not alive:
        return
    names = ", ".join(sorted({process_label(p) for p in alive}))
    print(f"  N={n}: {len(alive)} processes outlived the command ({names}); ending them", flush=True)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, still = psutil.wait_procs(alive, timeout=10)
    for proc in still:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def read_metrics(o: Outcome, cmd_start: float, work: Path) -> None:
    """The run's per-round metrics from the throw-away MLflow store, folded into the table's row."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from fedray.platform.tracking.mlflow_run import quiet_mlflow

    if not (work / "mlflow.db").exists():  # the command stopped before it made its MLflow run
        o.error = "no MLflow run"
        return
    quiet_mlflow()
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(f"bench-scale-n{o.n}")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    if not runs:
        o.error = "no MLflow run"
        return
    run = runs[0]
    params = run.data.params

    def history(key: str) -> dict[int, Metric]:
        return {m.step: m for m in client.get_metric_history(run.info.run_id, key)}

    round_s, client_s = history(Metrics.TIME_ROUND_S), history(Metrics.TIME_CLIENT_S)
    selected, failed = history(Metrics.CLIENTS_SELECTED), history(Metrics.CLIENTS_FAILED)
    eval_steps = {step for key in run.data.metrics if key.startswith(EVAL_PREFIXES) for step in history(key)}
    steps = sorted(s for s in round_s if s >= 1)
    if not steps:
        o.error = f"no rounds logged (run {run.info.status})"
        return

    # round 1's start: round k's metrics are logged after it ends, so (logged time - rounds 1..k)
    # bounds it from above (the run's start time is the call's start, before data and Ray: no bound)
    cumulative, bounds = 0.0, []
    for step in steps:
        cumulative += round_s[step].value
        bounds.append(round_s[step].timestamp / 1000 - cumulative)
    setup = min(bounds) - cmd_start

    n_cpus = params.get("ray.num_cpus")
    cpus = int(n_cpus) if n_cpus not in (None, "None") else (os.cpu_count() or 1)
    fit = math.floor(cpus / float(params.get("ray.num_cpus_per_client", 1)) + 1e-9)
    max_actors = params.get("ray.max_actors")
    if max_actors not in (None, "None"):
        fit = min(fit, int(max_actors))
    k = max(round(selected[s].value) for s in steps)
    workers = max(1, min(fit, o.n, k))

    plain, evaluated, ideal = [], [], []
    for step in steps:
        is_eval = step in eval_steps
        o.rounds.append((round_s[step].value, is_eval))
        if is_eval:
            evaluated.append(round_s[step].value)
        else:
            plain.append(round_s[step].value)
            trained = selected[step].value - (failed[step].value if step in failed else 0)
            ideal.append(client_s[step].value * trained / workers if step in client_s else math.nan)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    o.row = {
        "clients": o.n,
        "per_round": k,
        "workers": workers,
        "rounds": len(steps),
        "status": run.info.status,
        "setup_s": setup,
        "round_s": mean(plain),
        "ideal_s": mean(ideal),
        "ratio": mean(plain) / mean(ideal) if plain else math.nan,
        "eval_round_s": mean(evaluated),
        "after_s": o.wall_s - setup - sum(v for v, _ in o.rounds),
        "peak_pss_mb": o.peak_bytes / MB,
        "wall_s": o.wall_s,
        "client_s": mean([client_s[s].value for s in steps if s in client_s]),
        "run_id": run.info.run_id,
    }


COLUMNS = (  # (row key, header, format)
    ("clients", "N", "{:>7d}"),
    ("per_round", "K", "{:>4d}"),
    ("workers", "wrk", "{:>4d}"),
    ("setup_s", "setup s", "{:>9.1f}"),
    ("round_s", "round s", "{:>9.2f}"),
    ("ideal_s", "ideal s", "{:>9.2f}"),
    ("ratio", "ratio", "{:>7.2f}"),
    ("eval_round_s", "eval round s", "{:>13.2f}"),
    ("after_s", "after s", "{:>9.1f}"),
    ("peak_pss_mb", "peak PSS MB", "{:>12.0f}"),
    ("wall_s", "wall s", "{:>9.1f}"),
)


def print_table(outcomes: list[Outcome]) -> None:
    widths = [
        len(fmt.format(0 if key in ("clients", "per_round", "workers") else 0.0)) for key, _, fmt in COLUMNS
    ]
    print("".join(f"{head:>{w}}" for (_, head, _), w in zip(COLUMNS, widths, strict=True)))
    for o in outcomes:
        cells = []
        for (key, _, fmt), width in zip(COLUMNS, widths, strict=True):
            value = {"clients": o.n, "wall_s": o.wall_s, "peak_pss_mb": o.peak_bytes / MB}.get(
                key, o.row.get(key)
            )
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append(f"{'-':>{width}}")
            else:
                cells.append(fmt.format(value))
        line = "".join(cells)
        if o.returncode != 0 or o.error:
            line += f"   FAILED (exit {o.returncode}{', ' + o.error if o.error else ''}; log {o.log})"
        print(line)


def peak_breakdown(o: Outcome) -> str:
    """The peak sample by kind of process: ``2x ray::ClientActor 1630, fedray 710, ...`` (MB)."""
    kinds: dict[str, list[int]] = {}
    for label, pss in o.at_peak:
        kinds.setdefault(label, []).append(pss)
    ranked = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
    return ", ".join(
        f"{f'{len(v)}x ' if len(v) > 1 else ''}{label} {sum(v) / MB:.0f}"
        for label, v in ranked
        if sum(v) >= MB
    )


def write_csv(path: Path, outcomes: list[Outcome]) -> None:
    keys = [key for key, _, _ in COLUMNS] + ["rounds", "status", "client_s", "run_id", "exit", "round_times"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for o in outcomes:
            row = {key: o.row.get(key, "") for key in keys}
            row.update(
                clients=o.n,
                exit=o.returncode,
                wall_s=o.wall_s,
                peak_pss_mb=o.peak_bytes / MB,
                round_times=" ".join(f"{s:.3f}{'e' if e else ''}" for s, e in o.rounds),
            )
            writer.writerow(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,1000,10000", help="comma-separated client counts N")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--eval", choices=("selected", "all", "sample"), default="selected", help="eval.clients"
    )
    parser.add_argument("--eval-sample-size", type=int, default=100, help="eval.sample_size (--eval sample)")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="eval_every (default: the rounds, i.e. only the last round)"
    )
    parser.add_argument(
        "--partition", choices=("shards", "shamsian"), default="shards", help="2 classes per client"
    )
    parser.add_argument(
        "--merged-from", type=int, default=10_000, help="from this N on, partition the merged train+test pool"
    )
    parser.add_argument("--checkpoint-every", type=int, help="checkpoint_every (default: fedray's)")
    parser.add_argument(
        "--data",
        help="unpacked CIFAR-10 JPEG tree (default: $FEDRAY_CIFAR10_ARCHIVE or .data/cifar10-jpeg.tar.gz, unpacked once)",
    )
    parser.add_argument(
        "--timeout", type=float, default=0, help="stop a run after this many seconds (0: never)"
    )
    parser.add_argument(
        "--mem-interval", type=float, default=2.0, help="seconds between PSS samples (each costs ~0.1 s CPU)"
    )
    parser.add_argument("--out", type=Path, help="also write the table as CSV here")
    parser.add_argument("--keep", action="store_true", help="keep each run's MLflow store, storage and log")
    parser.add_argument("overrides", nargs="*", help="extra fedray key=value overrides for every run")
    args = parser.parse_args()
    try:
        counts = [int(c.replace("_", "")) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--clients {args.clients!r}: expected comma-separated integers")
    if not counts or min(counts) < 1 or args.rounds < 1 or args.eval_every < 0:
        parser.error("--clients, --rounds must be >= 1 and --eval-every >= 0")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value: {bad}")

    root = cifar_root(args.data)
    t0 = time.perf_counter()
    # decoded once, outside the clocks: every run then reads the same tensor cache
    bundle = load_dataset(DataConfig(dataset="imagefolder", root=str(root)))
    print(
        f"data: {root} ({bundle.num_samples} images, tensor cache ready in {time.perf_counter() - t0:.1f}s); "
        f"{psutil.cpu_count()} CPUs, FedSSA, fedavg_cnn, {args.partition} x2 classes, "
        f"{CLIENTS_PER_ROUND} clients/round, {args.rounds} rounds, eval.clients={args.eval} "
        f"every {args.eval_every or args.rounds} rounds",
        flush=True,
    )
    del bundle

    outcomes = []
    for n in counts:
        work = Path(tempfile.mkdtemp(prefix=f"fedray-scale-n{n}-"))
        outcome = None
        try:
            outcome = run_command(args, n, root, work)
        finally:  # a failed run's store, storage and log stay for a look
            if not args.keep and outcome is not None and not (outcome.returncode or outcome.error):
                shutil.rmtree(work, ignore_errors=True)
        outcomes.append(outcome)
        print(f"\nN={n}: {shlex.join(outcome.command)}", flush=True)
        if outcome.rounds:
            marks = " ".join(f"{s:.2f}{'e' if e else ''}" for s, e in outcome.rounds)
            print(f"  rounds (s, e = with evaluation): {marks}")
        if outcome.returncode or outcome.error:
            tail = outcome.log.read_text(errors="replace").splitlines()[-25:] if outcome.log.exists() else []
            print(f"  exit {outcome.returncode} {outcome.error}; last lines of {outcome.log}:")
            print("\n".join(f"  | {line}" for line in tail))
        print(
            f"  wall {outcome.wall_s:.1f}s, peak PSS {outcome.peak_bytes / MB:.0f} MB: {peak_breakdown(outcome)}"
        )

    print()
    print_table(outcomes)
    if args.out:
        write_csv(args.out, outcomes)
        print(f"CSV: {args.out}")


if __name__ == "__main__":
    main()
