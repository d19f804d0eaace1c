"""Partition statistics and plots.

:func:`majority_baseline` is the trivial reference every personalised accuracy must be read against:
under strong label skew, predicting each client's most frequent training label already scores high.

The heatmap is drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot, no global
backend switch, so it is safe in headless workers and never opens a window.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fedray.platform.data.federation import Federation

_MAX_TICKS = 40  # beyond this many clients or classes, label every k-th one
_MAX_ANNOTATED_CELLS = 400  # write the count inside each cell only on small grids


def _ticks(n: int) -> np.ndarray:
    return np.arange(0, n, max(1, int(np.ceil(n / _MAX_TICKS))))


def histogram_heatmap(fed: Federation, path: str | Path) -> None:
    """Save a clients x classes heatmap of train counts (with a colorbar) as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = fed.train_histogram()
    n_clients, n_classes = hist.shape
    width = min(24.0, 3.0 + 0.35 * n_classes)
    height = min(24.0, 2.0 + 0.3 * n_clients)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(hist, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="train samples")

    xt, yt = _ticks(n_classes), _ticks(n_clients)
    ax.set_xticks(xt, [str(fed.class_names[i]) for i in xt], rotation=90 if n_classes > 10 else 0)
    ax.set_yticks(yt, [str(fed.shards[i].client_id) for i in yt])
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"train samples per client and class ({n_clients} clients, {int(hist.sum())} samples)")

    if hist.size <= _MAX_ANNOTATED_CELLS:
        threshold = hist.max() / 2 if hist.size else 0
        for (i, j), value in np.ndenumerate(hist):
            if value:
                color = "black" if value > threshold else "white"
                ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color=color)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)


def majority_baseline(fed: Federation) -> tuple[float, float, np.ndarray]:
    """Accuracy of each client predicting its most frequent training label (ties: the smallest label).

    Returns ``(plain, weighted, per_client)``: ``per_client[k]`` is client ``k``'s accuracy on its own
    test split (NaN when it has none); ``plain`` the mean over clients with test data (FedSSA's
    metric); ``weighted`` total correct over total test samples (PFLlib's / FedL2G's). Both are NaN
    when no client has test data.
    """
    per_client = np.full(fed.num_clients, np.nan)
    correct = total = 0
    for k, shard in enumerate(fed.shards):
        test_y = shard.test.y.numpy()
        if len(test_y) == 0:
            continue
        majority = int(np.argmax(np.bincount(shard.train.y.numpy(), minlength=fed.num_classes)))
        hits = int((test_y == majority).sum())
        per_client[k] = hits / len(test_y)
        correct, total = correct + hits, total + len(test_y)
    has_test = ~np.isnan(per_client)
    plain = float(per_client[has_test].mean()) if has_test.any() else float("nan")
    weighted = correct / total if total else float("nan")
    return plain, weighted, per_client
