"""Pure pandas on the frames of ``load``: sweep axes, the chosen configuration per algorithm, the
summary table and the seed-averaged curves. No MLflow and no matplotlib here, so it is tested alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from fedray.platform.runtime.progress import mb
from fedray.platform.tracking.names import (
    PARAMS_COLUMN_PREFIX,
    Metrics,
    Params,
    best_of,
    metric_column,
    param_column,
)

# Params that differ between runs without being a hyperparameter of the algorithm: the repeat
# axis (seed), the grouping (algorithm), naming, bookkeeping and placement.
NOT_HYPERPARAMETERS = {
    Params.SEED,
    Params.ALGORITHM,
    Params.NAME,
    Params.STORAGE_PATH,
    Params.PROGRESS,
    Params.CHECKPOINT_EVERY,
}
NOT_HYPERPARAMETER_PREFIXES = (Params.TRACKING_PREFIX, Params.RAY_PREFIX)


def hyperparameters(runs: pd.DataFrame) -> dict[str, list[str]]:
    """Per group, the params that vary across its runs: the axes of a sweep (empty: not a sweep)."""
    out: dict[str, list[str]] = {}
    params = [c for c in runs.columns if c.startswith(PARAMS_COLUMN_PREFIX)]
    for group, frame in runs.groupby("group", sort=True):
        varying = []
        for col in params:
            name = col.removeprefix(PARAMS_COLUMN_PREFIX)
            if name in NOT_HYPERPARAMETERS or name.startswith(NOT_HYPERPARAMETER_PREFIXES):
                continue
            if frame[col].fillna("<unset>").nunique() > 1:
                varying.append(name)
        out[str(group)] = varying
    return out


def is_numeric(values: pd.Series) -> bool:
    return pd.to_numeric(values, errors="coerce").notna().all()


def sorted_values(values: pd.Series) -> list[str]:
    """Distinct param values in their natural order (numbers by value, the rest as text)."""
    distinct = list(pd.unique(values.fillna("None").astype(str)))
    if is_numeric(pd.Series(distinct)):
        return sorted(distinct, key=float)
    return sorted(distinct)


def with_configs(runs: pd.DataFrame, hparams: dict[str, list[str]]) -> pd.DataFrame:
    """Add a ``config`` column: the group's swept values of each run, e.g. ``fedprox.mu=0.1``."""
    runs = runs.copy()

    def label(row: pd.Series) -> str:
        return ", ".join(f"{p}={row.get(param_column(p))}" for p in hparams.get(row["group"], []))

    runs["config"] = runs.apply(label, axis=1) if len(runs) else []
    return runs


def best_configs(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per group, the runs of the configuration with the highest mean final ``metric`` over seeds.

    A sweep's curves and table rows must come from one configuration: averaging different
    hyperparameters together would draw an algorithm nobody ran.
    """
    col = metric_column(metric)
    chosen = []
    for _, frame in runs.groupby("group", sort=True):
        means = frame.groupby("config", sort=False)[col].mean()
        chosen.append(frame[frame["config"] == means.idxmax()])
    return pd.concat(chosen, ignore_index=True)


def rounds_to_target(history: pd.DataFrame, target: float, key: str) -> dict[str, float]:
    """Per run, the first round whose ``key`` reached ``target`` (NaN: never reached)."""
    out: dict[str, float] = {}
    for run_id, frame in history.groupby("run_id", sort=False):
        hit = frame[frame[key] >= target]
        out[str(run_id)] = float(hit["step"].min()) if len(hit) else math.nan
    return out


def auto_target(runs: pd.DataFrame, metric: str) -> float:
    """The highest whole percent that every algorithm's mean best accuracy reaches, so the
    rounds-to-target column compares speed rather than reporting "not reached"."""
    best = runs.groupby("group")[_best_col(runs, metric)].mean().min()
    return max(0.01, math.floor(round(100 * best, 6)) / 100) if pd.notna(best) else 0.5


def _best_col(runs: pd.DataFrame, metric: str) -> str:
    """``best/personal_mean`` is logged at the end of a run; runs without it use the final value."""
    best = metric_column(best_of(metric))
    return best if best in runs else metric_column(metric)


def mean_std(values: pd.Series) -> tuple[float, float]:
    """Mean and population std (ddof=0, as ``fedray compare`` prints) over seeds, NaNs dropped."""
    values = values.dropna().astype(float)
    if values.empty:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=0))


def _best(runs: pd.DataFrame, history: pd.DataFrame, metric: str) -> pd.Series:
    """Best-round value per run: the logged ``best/...`` metric, else the max of the history."""
    col = metric_column(best_of(metric))
    logged = runs.set_index("run_id")[col] if col in runs else pd.Series(np.nan, index=runs["run_id"])
    from_history = history.groupby("run_id")[metric].max() if len(history) else pd.Series(dtype=float)
    return logged.fillna(from_history.reindex(logged.index))


def summary_table(
    selected: pd.DataFrame,
    history: pd.DataFrame,
    target: float,
    metric: str,
    personal: str = Metrics.ACC_PERSONAL_MEAN,
) -> list[dict[str, Any]]:
    """One row per group with raw numbers (fractions, MB, seconds); the page formats them.
    ``personal``: the personalised accuracy as the runs name it (``ExperimentRuns.personal``)."""
    reached = rounds_to_target(history, target, metric)
    best_personal = _best(selected, history, personal)
    best_global = _best(selected, history, Metrics.ACC_GLOBAL)
    rows = []
    for group, frame in selected.groupby("group", sort=True):
        ids = list(frame["run_id"])
        rounds = pd.Series([reached.get(i, math.nan) for i in ids], dtype=float)

        def final(key: str, frame: pd.DataFrame = frame) -> tuple[float, float]:
            col = metric_column(key)
            return mean_std(frame[col]) if col in frame else (math.nan, math.nan)

        def mean_mb(key: str, frame: pd.DataFrame = frame) -> float:
            return mean_std(frame.get(metric_column(key), pd.Series(0.0)).map(mb))[0]

        rows.append(
            {
                "group": str(group),
                "algorithm": ", ".join(sorted(frame["algorithm"].unique())),
                "config": frame["config"].iloc[0] if "config" in frame else "",
                "runs": len(ids),
                "seeds": ", ".join(frame["seed"].astype(str)),
                "run_ids": ids,
                "personal_final": final(personal),
                "personal_best": mean_std(best_personal.reindex(ids)),
                "global_final": final(Metrics.ACC_GLOBAL),
                "global_best": mean_std(best_global.reindex(ids)),
                "rounds_to_target": float(rounds.mean()) if rounds.notna().any() else math.nan,
                "reached": int(rounds.notna().sum()),
                "mb_up": mean_mb(Metrics.COMM_UP_BYTES_CUM),
                "mb_down": mean_mb(Metrics.COMM_DOWN_BYTES_CUM),
                "wall_s": mean_std(frame["wall_s"])[0],
            }
        )
    return rows


def summary_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The table as a flat CSV-ready frame (mean and std in their own columns)."""
    flat = []
    for row in rows:
        out: dict[str, Any] = {}
        for key, value in row.items():
            if isinstance(value, tuple):
                out[f"{key}_mean"], out[f"{key}_std"] = value
            elif isinstance(value, list):
                out[key] = " ".join(value)
            else:
                out[key] = value
        flat.append(out)
    return pd.DataFrame(flat)


def curves(selected: pd.DataFrame, history: pd.DataFrame, y: str, x: str = "step") -> dict[str, pd.DataFrame]:
    """Per group, ``y`` against ``x`` averaged over seeds: columns x, mean, std, n.

    ``x`` is the round (``step``) or a per-round column such as cumulative MB; rounds where a
    metric was not logged (``eval_every``) are dropped before averaging.
    """
    out: dict[str, pd.DataFrame] = {}
    for group, frame in selected.groupby("group", sort=True):
        rows = history[history["run_id"].isin(frame["run_id"])].dropna(subset=[y, x])
        if rows.empty:
            continue
        rows = rows.assign(_x=rows[x])
        agg = rows.groupby("step").agg(
            x=("_x", "mean"), mean=(y, "mean"), std=(y, lambda v: v.std(ddof=0)), n=(y, "size")
        )
        out[str(group)] = agg.reset_index().rename(columns={"step": "round"})
    return out


def sweep_points(runs: pd.DataFrame, param: str, metric: str) -> pd.DataFrame:
    """One row per run of a group: the param's value (text) and the final metric."""
    return pd.DataFrame(
        {
            "value": runs[param_column(param)].fillna("None").astype(str).to_numpy(),
            "metric": runs[metric_column(metric)].astype(float).to_numpy(),
        }
    )


def sweep_grid(runs: pd.DataFrame, p1: str, p2: str, metric: str) -> pd.DataFrame:
    """Mean final metric over seeds (and any other swept param) on the p1 x p2 grid."""
    frame = pd.DataFrame(
        {
            p1: runs[param_column(p1)].fillna("None").astype(str),
            p2: runs[param_column(p2)].fillna("None").astype(str),
            "metric": runs[metric_column(metric)].astype(float),
        }
    )
    grid = frame.pivot_table(index=p1, columns=p2, values="metric", aggfunc="mean")
    return grid.reindex(index=sorted_values(frame[p1]), columns=sorted_values(frame[p2]))
