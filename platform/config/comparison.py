"""A compare file expanded into one raw config per (entry, seed): no registry, no torch, so the
command line names a compare file's typos before ``fedray compare`` imports anything heavy.

The file's format and the runs are :mod:`fedray.platform.apps.compare`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedray.platform.config.algorithm_names import known_algorithm_names
from fedray.platform.config.loading import (
    check_platform_sections,
    dotted_tree,
    load_yaml,
    merge,
    parse_overrides,
)
from fedray.platform.errors import ConfigError

COMPARE_KEYS = ("name", "base", "seeds", "overrides", "runs")


def comparison_raws(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    name: str | None = None,
    seeds: list[int] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(label, raw config) per entry and seed, in the file's order; ``name`` (the MLflow experiment)
    and ``seeds`` replace the file's."""
    path = Path(path)
    spec = load_yaml(path, "compare file")
    unknown = set(spec) - set(COMPARE_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown compare keys {sorted(unknown)}; allowed: {', '.join(COMPARE_KEYS)}"
        )
    runs = spec.get("runs") or []
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"{path}: 'runs' must list at least one algorithm, e.g. runs: [fedavg, fedprox]")
    if not isinstance(spec.get("base") or "", str):
        raise ConfigError(f"{path}: base={spec['base']!r}: the path of a config file, relative to this file")
    base = load_yaml(path.parent / spec["base"]) if spec.get("base") else {}
    if not isinstance(spec.get("overrides") or {}, dict):
        raise ConfigError(f"{path}: 'overrides' must map keys to values, e.g. overrides: {{rounds: 30}}")
    common = merge(
        dotted_tree(spec.get("overrides") or {}, f"{path}: overrides"), parse_overrides(overrides or [])
    )
    name = name or spec.get("name") or path.stem
    seeds = seeds or spec.get("seeds") or [base.get("seed", 0)]
    if not isinstance(seeds, list):
        raise ConfigError(f"{path}: 'seeds' must be a list, e.g. seeds: [0, 1, 2]")
    raws = []
    for i, run in enumerate(runs):
        if not isinstance(run, (str, dict)):
            raise ConfigError(
                f"{path}: runs[{i}] is {run!r}; give an algorithm's name or a mapping with an 'algorithm', "
                "e.g. {algorithm: fedprox, label: fedprox_mu0.1, fedprox: {mu: 0.1}}"
            )
        run = {"algorithm": run} if isinstance(run, str) else dict(run)
        if "algorithm" not in run:
            raise ConfigError(f"{path}: runs[{i}] needs an 'algorithm'")
        label = str(run.pop("label", run["algorithm"]))
        for seed in seeds:
            raw = merge(merge(base, common), dotted_tree(run, f"{path}: runs[{i}]"))
            raws.append((label, merge(raw, {"name": name, "seed": seed})))
    return raws


def read_comparison(path: str | Path, overrides: list[str] | None = None) -> None:
    """Every entry's platform sections checked without the registries (:func:`read_config`'s check)."""
    names = known_algorithm_names()
    for _, raw in comparison_raws(path, overrides):
        check_platform_sections(raw, names)
