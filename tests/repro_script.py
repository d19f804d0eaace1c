"""``benchmarks/reproduce_papers.py`` loaded as a module (``benchmarks/`` is not a package), once for
the tests that read its paper entries."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_papers.py"
spec = importlib.util.spec_from_file_location("reproduce_papers", SCRIPT)
assert spec and spec.loader
repro = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = repro  # its dataclasses look their module up
spec.loader.exec_module(repro)
