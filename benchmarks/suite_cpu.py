"""Where the test suite's CPU goes, test by test: a pytest plugin and its summary.

The suite is CPU-bound on a 2-core machine, and most of its CPU is spent in processes that the tests
start: Ray's workers, `fedray` subprocesses and MLflow servers. pytest's `--durations` reports only
wall time, which depends on what the other pytest processes are running at the same moment. This
plugin samples the pytest process and every process under it 4 times a second, while each test
runs. It records each process's CPU, grouped by the name Ray gives it, or else by its command line.
It then writes one JSON line per test. Processes that live less than 0.25 s are missed.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -p suite_cpu -q -n 3 --dist loadfile \\
        --no-loadscope-reorder                      # writes .fedray/suite_cpu.jsonl (SUITE_CPU_OUT=...)
    .venv/bin/python benchmarks/suite_cpu.py [.fedray/suite_cpu.jsonl]   # the tables
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", ".fedray/suite_cpu.jsonl"))
SAMPLE_S = 0.25


class TreeCpu(threading.Thread):
    """The CPU seconds this process and its descendants spend from now until :meth:`finish`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.me = psutil.Process()
        self.start_cpu: dict[tuple[int, float], float] = {}  # 0 for a process started meanwhile
        self.existing: set[tuple[int, float]] = set()
        self.last_cpu: dict[tuple[int, float], float] = {}
        self.names: dict[tuple[int, float], str] = {}
        self.done = threading.Event()
        self.sample(first=True)

    def sample(self, first: bool = False) -> None:
        try:
            procs = [self.me, *self.me.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
                cmd = " ".join(proc.cmdline()[:3])[:60]
            except psutil.Error:
                continue
            if first:
                self.existing.add(key)
            self.start_cpu.setdefault(key, times.user + times.system if first else 0.0)
            self.last_cpu[key] = times.user + times.system
            if cmd and not self.names.get(key, "").startswith("ray::"):  # a Ray worker: the actor's name
                self.names[key] = "pytest" if proc.pid == self.me.pid else cmd

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.sample()

    def finish(self) -> tuple[dict[str, float], int]:
        """CPU seconds per kind of process, and how many processes started meanwhile."""
        self.done.set()
        self.join()
        self.sample()
        per_kind: Counter[str] = Counter()
        for key, cpu in self.last_cpu.items():
            name = self.names.get(key, "?")
            per_kind[name.split()[0] if name.startswith("ray::") else name] += cpu - self.start_cpu[key]
        started = len(self.start_cpu.keys() - self.existing)
        return {k: round(v, 2) for k, v in per_kind.items() if v >= 0.05}, started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    tree, began = TreeCpu(), time.time()
    tree.start()
    yield
    per_kind, started = tree.finish()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    row = {
        "test": item.nodeid,
        "wall_s": round(time.time() - began, 2),
        "cpu_s": round(sum(per_kind.values()), 2),
        "processes_started": started,
        "per_kind": per_kind,
    }
    with OUT.open("a") as f:  # one line per write: the pytest processes append side by side
        f.write(json.dumps(row) + "\n")


def summary(path: Path, top: int = 25) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    total = sum(r["cpu_s"] for r in rows)
    print(
        f"{len(rows)} tests, {total:.0f} CPU-s sampled, wall time summed {sum(r['wall_s'] for r in rows):.0f} s"
    )
    kinds: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for r in rows:
        kinds.update(r["per_kind"])
        files[r["test"].split("::")[0]] += r["cpu_s"]
    for title, counts in (("by kind of process", kinds), ("by test file", files)):
        print(f"\n{title}:")
        for name, cpu in counts.most_common(top):
            print(f"{cpu:8.1f}  {100 * cpu / total:4.1f} %  {name}")
    print("\nby test (CPU-s, wall s, processes started):")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:7.1f} {r['processes_started']:4d}  {r['test']}")


if __name__ == "__main__":
    summary(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
