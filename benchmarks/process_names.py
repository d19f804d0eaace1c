"""What a process is, in a word (``ray::ClientActor``, ``raylet``, ``fedray``), for the benchmarks'
and the GPU check's per-process tables."""

from __future__ import annotations

from pathlib import Path

import psutil


def process_title(cmdline: list[str]) -> str:
    """What a process is, from its command line: a Ray worker's title (``ray::ClientActor.train``
    gives ``ray::ClientActor``), else the program a Python interpreter runs (``fedray``), else the
    program's name."""
    if not cmdline:
        return "?"
    first = cmdline[0].split()[0] if cmdline[0].strip() else "?"
    if first.startswith("ray::"):
        return first.split(".")[0]
    name = Path(first).name
    if name.startswith("python") and len(cmdline) > 1:
        script = next((word for word in cmdline[1:] if not word.startswith("-")), "")
        return Path(script).name or name
    return name


def process_label(proc: psutil.Process) -> str:
    """:func:`process_title` of a live process (its name where its command line is empty)."""
    try:
        cmdline = proc.cmdline()
        return process_title(cmdline) if cmdline else proc.name()
    except psutil.Error:
        return "?"
