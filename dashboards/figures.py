"""The report's figures, drawn with matplotlib's object API on the Agg canvas.

No pyplot: figures are plain objects that never touch a display or global state, so a report can
be built in a headless process (CI, a Ray worker) and in tests side by side.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedray.dashboards.summary import is_numeric, sorted_values, sweep_points

DPI = 110
_MARKER_LIMIT = 40  # draw a marker per point only while curves are short enough to read them


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def group_colors(groups: list[str]) -> dict[str, tuple]:
    """One stable colour per algorithm, shared by every figure of the report."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    return {g: cmap(i % cmap.N) for i, g in enumerate(sorted(groups))}


def save_png(fig: Figure, path: Path) -> bytes:
    """Write the PNG to ``path`` and return its bytes (the page embeds them)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _band(ax, curve: pd.DataFrame, color, label: str) -> None:
    """Mean over seeds as a line, mean ± std as a band (absent with one seed)."""
    x, mean, std = curve["x"].to_numpy(), 100 * curve["mean"].to_numpy(), 100 * curve["std"].to_numpy()
    marker = "o" if len(x) <= _MARKER_LIMIT else None
    seeds = int(curve["n"].max())
    ax.plot(x, mean, color=color, marker=marker, markersize=3.5, lw=1.8, label=f"{label} (n={seeds})")
    if seeds > 1:
        ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, lw=0)


def accuracy_vs_round(
    personal: dict[str, pd.DataFrame],
    global_: dict[str, pd.DataFrame],
    colors: dict[str, tuple],
    majority: float | None = None,
) -> Figure:
    """Personalised (and, for algorithms with one, global-model) accuracy per round; ``majority``
    (each client predicting its most frequent training label) is drawn under the personalised curves,
    the floor they must be read against."""
    panels = [("personalised accuracy (mean over clients)", personal)] if personal else []
    if global_:
        panels.append(("global model accuracy (global test set)", global_))
    fig, axes = _figure(6.0 * len(panels), 4.2, len(panels))
    for ax, (title, curves) in zip(axes, panels):
        for group, curve in curves.items():
            _band(ax, curve, colors[group], group)
        if curves is personal and majority is not None and math.isfinite(majority):
            ax.axhline(100 * majority, color="0.4", ls="--", lw=1.2, label="majority class")
        ax.set_title(title, fontsize=11)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy, %")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("accuracy against round: mean over seeds, band = ± std", fontsize=11)
    return fig


def accuracy_vs_comm(
    curves: dict[str, pd.DataFrame], colors: dict[str, tuple], label: str = "personalised accuracy"
) -> Figure:
    """Accuracy against cumulative traffic: what each algorithm pays in bytes for its accuracy."""
    fig, (ax,) = _figure(7.5, 4.4)
    for group, curve in curves.items():
        _band(ax, curve, colors[group], group)
        ax.plot(curve["x"].iloc[-1], 100 * curve["mean"].iloc[-1], "s", color=colors[group], markersize=7)
    ax.set_xlabel("cumulative communication, MB (uplink + downlink, all clients)")
    ax.set_ylabel(f"{label}, %")
    ax.set_title("accuracy against communication (square: last round)", fontsize=11)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def client_accuracy_box(per_group: dict[str, np.ndarray], colors: dict[str, tuple]) -> Figure:
    """Distribution of final per-client accuracy per algorithm (all seeds pooled), with the points."""
    groups = list(per_group)
    fig, (ax,) = _figure(max(5.0, 1.3 * len(groups) + 2.5), 4.4)
    data = [100 * per_group[g] for g in groups]
    box = ax.boxplot(data, patch_artist=True, widths=0.55, showmeans=True, medianprops={"color": "black"})
    ax.set_xticks(range(1, len(groups) + 1), groups, rotation=20 if len(groups) > 5 else 0)
    for patch, group in zip(box["boxes"], groups):
        patch.set_facecolor(colors[group])
        patch.set_alpha(0.45)
    rng = np.random.default_rng(0)
    for i, values in enumerate(data, start=1):
        ax.scatter(
            i + rng.uniform(-0.15, 0.15, len(values)), values, s=10, color="black", alpha=0.6, zorder=3
        )
    ax.set_ylabel("client test accuracy, %")
    ax.set_title("final per-client accuracy (triangle: mean)", fontsize=11)
    return fig


def sweep_lines(group: str, runs: pd.DataFrame, params: list[str], metric: str, color) -> Figure:
    """Each swept hyperparameter against the final metric: every trial as a point, the mean as a line."""
    fig, axes = _figure(4.2 * len(params), 3.6, len(params))
    for ax, param in zip(axes, params):
        points = sweep_points(runs, param, metric)
        order = sorted_values(points["value"])
        numeric = is_numeric(points["value"])
        if numeric:
            x = points["value"].astype(float)
            positions = {v: float(v) for v in order}
            values = [float(v) for v in order]
            if min(values) > 0 and max(values) / min(values) >= 50:
                ax.set_xscale("log")
            if len(order) <= 8:  # a grid: tick exactly the values that were tried
                ax.set_xticks(values, order, minor=False)
                ax.minorticks_off()
        else:
            positions = {v: i for i, v in enumerate(order)}
            x = points["value"].map(positions)
            ax.set_xticks(range(len(order)), order, rotation=20 if len(order) > 4 else 0)
        ax.scatter(x, 100 * points["metric"], s=16, color=color, alpha=0.55, label="trial")
        means = points.groupby("value")["metric"].mean().reindex(order)
        ax.plot([positions[v] for v in order], 100 * means.to_numpy(), color=color, lw=1.8, label="mean")
        ax.set_xlabel(param)
        ax.set_ylabel(f"final {metric}, %")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{group}: hyperparameters against final {metric}", fontsize=11)
    return fig


def sweep_heatmap(group: str, grid: pd.DataFrame, metric: str) -> Figure:
    """A two-parameter grid: mean final metric per cell, the best cell outlined."""
    p1, p2 = grid.index.name, grid.columns.name
    values = 100 * grid.to_numpy(dtype=float)
    fig, (ax,) = _figure(max(4.5, 0.9 * values.shape[1] + 3), max(3.2, 0.6 * values.shape[0] + 1.8))
    ax.grid(False)
    image = ax.imshow(values, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label=f"final {metric}, %")
    ax.set_xticks(range(values.shape[1]), list(grid.columns))
    ax.set_yticks(range(values.shape[0]), list(grid.index))
    ax.set_xlabel(p2)
    ax.set_ylabel(p1)
    finite = values[np.isfinite(values)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0
    for (i, j), v in np.ndenumerate(values):
        if math.isfinite(v):
            ax.text(
                j, i, f"{v:.1f}", ha="center", va="center", fontsize=8, color="black" if v > mid else "white"
            )
    if finite.size:
        i, j = np.unravel_index(np.nanargmax(values), values.shape)
        ax.add_patch(_outline(int(j), int(i)))
    ax.set_title(f"{group}\n{p1} × {p2}, mean over seeds", fontsize=10)
    return fig


def _outline(x: int, y: int):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", lw=2)


def trial_curves(curves: dict[str, pd.DataFrame], metric: str, title: str) -> Figure:
    """A sweep's trials against the round, one line per trial, labelled by its swept values and trial
    id. ``curves``: label -> frame of step, value."""
    fig, (ax,) = _figure(8.0, 4.6)
    colors = group_colors(list(curves))
    for label, curve in sorted(curves.items()):
        ax.plot(curve["step"], 100 * curve["value"], color=colors[label], lw=1.6, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric}, %")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return fig
