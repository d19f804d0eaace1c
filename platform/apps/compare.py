"""``fedray compare COMPARE.yaml``: several algorithms on the same partition and seeds, one table.

A compare file names a base experiment, the seeds, and one entry per algorithm with its own
overrides (heterogeneous algorithms need a heterogeneous model group, say)::

    name: compare_digits
    base: quickstart.yaml          # relative to this file
    seeds: [0, 1]
    overrides: {rounds: 20}        # for every entry
    runs:
      - algorithm: fedavg
      - {algorithm: fedssa, model.group: small_hetero, label: fedssa-hetero}

Every run lands in one MLflow experiment (the compare file's ``name``), tagged with its ``label``.
The data partition depends only on the data config and the seed, so entries that share them train
on identical client shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedray.platform.catalog import build_config
from fedray.platform.config import ExperimentConfig
from fedray.platform.config.comparison import comparison_raws
from fedray.platform.data import check_data
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.driver import personal_column, require_before_ray, run_experiment
from fedray.platform.runtime.processes import sharing_processes
from fedray.platform.runtime.progress import mb
from fedray.platform.tracking.names import Metrics, Tags


@dataclass
class CompareEntry:
    label: str
    config: ExperimentConfig


def load_comparison(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    name: str | None = None,
    seeds: list[int] | None = None,
) -> list[CompareEntry]:
    """Expand a compare file into one validated config per (entry, seed), before anything runs;
    ``name`` (the MLflow experiment) and ``seeds`` replace the file's."""
    raws = comparison_raws(path, overrides, name=name, seeds=seeds)
    return [CompareEntry(label, build_config(raw)) for label, raw in raws]


def run_comparison(path: str | Path, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every entry and return one summary row per label (mean ± std over seeds). Every entry's
    config is validated before the first run starts."""
    entries = load_comparison(path, overrides)
    for entry in entries:  # an entry that cannot run fails now, not after the others ran
        try:
            require_before_ray(entry.config)
            check_data(entry.config.data)
        except ConfigError as err:
            raise ConfigError(f"{entry.label} (seed {entry.config.seed}): {err}") from None
    results: dict[str, list] = {}
    with sharing_processes():  # each entry starts on the last one's Coordinator and ClientActors
        for entry in entries:
            print(f"== {entry.label} (seed {entry.config.seed})", flush=True)
            result = run_experiment(entry.config, tags={Tags.LABEL: entry.label})
            results.setdefault(entry.label, []).append(result)
    return [summarize(label, rs) for label, rs in results.items()]


def _mean_std(values: list[float | None]) -> str | None:
    vals = [100 * v for v in values if v is not None]
    if not vals:
        return None
    if len(vals) == 1:  # one seed: no spread to show
        return f"{vals[0]:.2f}"
    return f"{np.mean(vals):.2f} ± {np.std(vals):.2f}"


def summarize(label: str, results: list) -> dict[str, Any]:
    """Personalised accuracy: mean over seeds of the across-client mean, ± its std across clients
    (one seed) or across seeds (several); global accuracy mean ± std over seeds."""
    column = personal_column(results[0].config.eval.clients)
    if len(results) == 1:
        pers = results[0].summary_row()[column]
    else:
        pers = _mean_std([r.final[Metrics.ACC_PERSONAL_MEAN] for r in results])
    return {
        "algorithm": label,
        "seeds": len(results),
        column: pers,
        "global acc %": _mean_std([r.final[Metrics.ACC_GLOBAL] for r in results]),
        "MB up": round(float(np.mean([mb(r.last(Metrics.COMM_UP_BYTES_CUM) or 0) for r in results])), 3),
        "MB down": round(float(np.mean([mb(r.last(Metrics.COMM_DOWN_BYTES_CUM) or 0) for r in results])), 3),
        "wall s": round(float(np.mean([r.wall_time_s for r in results])), 1),
    }
