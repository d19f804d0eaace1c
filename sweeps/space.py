"""Search spaces: one readable YAML per algorithm, checked before Tune starts.

A space file::

    search: grid            # grid | random | optuna
    samples: 1              # grid: repeats of the grid; random: trials per grid point; optuna: trials
    metric: acc/global      # what the sweep maximises (or minimises, with mode: min)
    mode: max
    scheduler: asha         # asha | none: ASHA stops weak trials early on the round axis
    grace_rounds: 3         # ASHA: every trial runs at least this many rounds
    params:                 # any dotted config key -> one distribution
      fedcross.alpha: {grid: [0.9, 0.95, 0.99]}
      fedcross.selection: {choice: [in_order, lowest_similarity]}
      train.lr: {loguniform: [0.01, 0.1]}
      train.local_epochs: {randint: [1, 3]}     # inclusive bounds

Distributions: ``grid`` (every value, with grid search), ``choice``, ``uniform``, ``loguniform``,
``randint`` (inclusive), ``quniform`` ([low, high, step]).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedray.platform.catalog import CATALOG, build_config
from fedray.platform.config import dotted_tree, load_yaml, merge
from fedray.platform.config.schema import _coerce as coerce
from fedray.platform.errors import ConfigError
from fedray.platform.tracking.names import PERSONAL_METRICS, Metrics, personal_on

SPACES_DIR = Path(__file__).resolve().parent / "spaces"
KINDS = ("grid", "choice", "uniform", "loguniform", "randint", "quniform")


@dataclass
class Param:
    key: str
    kind: str
    values: list[Any]

    def sample(self, rng: random.Random) -> Any:
        """One value drawn as Tune would draw it (used to check points without Ray)."""
        if self.kind in ("grid", "choice"):
            return rng.choice(self.values)
        low, high = self.values[0], self.values[1]
        if self.kind == "uniform":
            return rng.uniform(low, high)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low), math.log(high)))
        if self.kind == "randint":
            return rng.randint(low, high)
        step = self.values[2]
        return round(rng.uniform(low, high) / step) * step

    def corners(self) -> list[Any]:
        """The values a check must try: every listed value, or a range's two ends (a config's limits are
        thresholds, so a range that breaks one breaks it at an end)."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        if self.kind == "quniform":
            step = self.values[2]
            return [round(end / step) * step for end in self.values[:2]]
        low, high = self.values[:2]
        if self.kind in ("uniform", "loguniform"):  # Tune draws from [low, high): not high itself
            return [low, math.nextafter(high, low)]
        return [low, high]

    def tune_domain(self, search: str) -> Any:
        from ray import tune

        if self.kind == "grid":
            # Optuna cannot enumerate a grid; it samples the same values instead
            return tune.choice(self.values) if search == "optuna" else tune.grid_search(self.values)
        if self.kind == "choice":
            return tune.choice(self.values)
        if self.kind == "uniform":
            return tune.uniform(*self.values)
        if self.kind == "loguniform":
            return tune.loguniform(*self.values)
        if self.kind == "randint":
            return tune.randint(self.values[0], self.values[1] + 1)  # Tune's upper bound is exclusive
        return tune.quniform(*self.values)


@dataclass
class SearchSpace:
    path: str
    params: list[Param]
    search: Literal["grid", "random", "optuna"] = "grid"
    samples: int = 1
    metric: str = Metrics.ACC_PERSONAL_MEAN
    mode: Literal["max", "min"] = "max"
    scheduler: Literal["asha", "none"] = "asha"
    grace_rounds: int = 3
    extra: dict[str, Any] = field(default_factory=dict)

    def grid_points(self) -> list[dict[str, Any]]:
        """Every grid combination (non-grid params left out): what grid search enumerates."""
        grid = [p for p in self.params if p.kind == "grid"]
        return [
            dict(zip([p.key for p in grid], combo)) for combo in itertools.product(*[p.values for p in grid])
        ]

    def corner_points(self, limit: int) -> list[dict[str, Any]]:
        """Every combination of the params' :meth:`Param.corners`, the first ``limit`` of them."""
        combos = itertools.product(*[p.corners() for p in self.params])
        return [dict(zip([p.key for p in self.params], c)) for c in itertools.islice(combos, limit)]

    def sample_points(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` points drawn from the space (grid params drawn too), for validation without Ray."""
        rng = random.Random(seed)
        return [{p.key: p.sample(rng) for p in self.params} for _ in range(n)]

    def largest(self, key: str, default: Any) -> Any:
        """The largest value a trial can give ``key`` (``default``, the base config's, if not swept)."""
        param = next((p for p in self.params if p.key == key), None)
        if param is None:
            return default
        return max(param.values) if param.kind in ("grid", "choice") else param.values[1]

    def num_trials(self) -> int:
        """Tune repeats the whole grid ``samples`` times; Optuna draws ``samples`` trials in all, its
        grid parameters sampled like choices (:meth:`Param.tune_domain`)."""
        if self.search == "optuna":
            return self.samples
        return max(1, len(self.grid_points())) * self.samples


def _parse_param(path: str, key: str, spec: Any) -> Param:
    where = f"{path}: params.{key}"
    if isinstance(spec, list):  # shorthand: a bare list is a grid
        spec = {"grid": spec}
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(
            f"{where}: expected one distribution, e.g. {{grid: [0.1, 0.5]}}; kinds: {', '.join(KINDS)}"
        )
    ((kind, values),) = spec.items()
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown distribution {kind!r}; kinds: {', '.join(KINDS)}")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: {kind} needs a non-empty list of values")
    if kind in RANGES:
        size, bounds = (3, "[low, high, step]") if kind == "quniform" else (2, "[low, high]")
        if len(values) != size or not all(is_number(v) for v in values):
            raise ConfigError(f"{where}: {kind} needs {bounds} as numbers, got {values}")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}: randint needs [low, high] as integers, got {values}")
        if values[0] > values[1]:
            raise ConfigError(f"{where}: {kind} needs low <= high, got {values}")
        if kind == "quniform" and values[2] <= 0:
            raise ConfigError(f"{where}: quniform needs a step > 0, got {values}")
    if kind == "loguniform" and values[0] <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {values}")
    return Param(key, kind, list(values))


RANGES = ("uniform", "loguniform", "randint", "quniform")


def is_number(value: Any) -> bool:
    """A finite int or float from YAML (true and false are no numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def whole(path: str | Path, key: str, value: Any) -> int:
    """An integer setting of the space file, converted as the config's are, or one line naming it."""
    try:
        return coerce(key, value, int)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def space_path(algorithm: str, path: str | Path | None = None) -> Path:
    if path is not None:
        return Path(path)
    found = SPACES_DIR / f"{algorithm}.yaml"
    if not found.is_file():
        known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        raise ConfigError(f"--algo {algorithm}: no search space {found}; write one or pick one of: {known}")
    return found


def load_space(path: str | Path) -> SearchSpace:
    raw = load_yaml(path, "search space")
    allowed = {"search", "samples", "metric", "mode", "scheduler", "grace_rounds", "params"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    params_raw = raw.get("params") or {}
    if not isinstance(params_raw, dict) or not params_raw:
        raise ConfigError(f"{path}: 'params' must map at least one config key to a distribution")
    space = SearchSpace(
        path=str(path),
        params=[_parse_param(str(path), key, spec) for key, spec in params_raw.items()],
        search=raw.get("search", "grid"),
        samples=whole(path, "samples", raw.get("samples", 1)),
        metric=raw.get("metric", Metrics.ACC_PERSONAL_MEAN),
        mode=raw.get("mode", "max"),
        scheduler=raw.get("scheduler", "asha"),
        grace_rounds=whole(path, "grace_rounds", raw.get("grace_rounds", 3)),
    )
    checks = [
        (
            space.search in ("grid", "random", "optuna"),
            f"search={space.search!r}: allowed grid, random, optuna",
        ),
        (
            isinstance(space.metric, str) and bool(space.metric.strip()),
            f"metric={space.metric!r}: a per-round metric's name, e.g. acc/global",
        ),
        (space.mode in ("max", "min"), f"mode={space.mode!r}: allowed max, min"),
        (space.scheduler in ("asha", "none"), f"scheduler={space.scheduler!r}: allowed asha, none"),
        (space.samples >= 1, f"samples={space.samples}: must be >= 1"),
        (space.grace_rounds >= 1, f"grace_rounds={space.grace_rounds}: must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"{path}: {message}")
    if space.search == "optuna" and importlib.util.find_spec("optuna") is None:
        raise ConfigError(
            f"{path}: search=optuna needs the optuna package, which fedray does not install (pip install optuna)"
        )
    return space


def trial_config(base: dict[str, Any], point: dict[str, Any]):
    """The experiment config of one trial: the base config with the sampled values on top."""
    # Tune may hand a numpy number (np.int64 is no int): each value as the plain Python one
    plain = {key: value.item() if isinstance(value, np.generic) else value for key, value in point.items()}
    return build_config(merge(base, dotted_tree(plain, "the trial's point")))


# How many combinations of the params' values and ends are checked before Tune starts (about 2 ms each):
# every one in any space a person writes, so a bad ninth grid point fails here and not as a failed trial.
CORNERS_CHECKED = 1000


def check_space(space: SearchSpace, base: dict[str, Any], n: int = 8) -> None:
    """Fail before Tune starts if a key is unknown or a value invalid for the experiment config, or if
    the metric is one of the platform's that the rounds do not report."""
    points = space.corner_points(CORNERS_CHECKED) + space.sample_points(n)
    for point in points:
        try:
            cfg = trial_config(base, point)
        except ConfigError as err:
            raise ConfigError(f"{space.path}: {err}") from None
    if space.search == "optuna" and cfg.seed >= 2**32:  # Optuna's sampler takes a 32-bit seed
        raise ConfigError(
            f"{space.path}: search=optuna: seed={cfg.seed} must be < 2**32 for Optuna's sampler"
        )
    others = set(CATALOG.algorithm_names()) - {cfg.algorithm}
    for param in space.params:
        section = param.key.split(".", 1)[0]
        if section in others:  # a valid key the trials' algorithm never reads: every trial the same
            raise ConfigError(
                f"{space.path}: params.{param.key}: the sweep runs {cfg.algorithm}, which does not read "
                f"{section}'s settings; sweep {cfg.algorithm}.* keys, or --algo {section}"
            )
    check_metric(space, cfg.eval.clients)


# The platform's metric families: a name in one of them is the platform's, so it can be checked here.
# "loss/" is shared with the algorithms' own (``self.record("loss/prox", ...)``), checked once the
# trials have reported (``tune_sweep.unreported_metric``).
PLATFORM_FAMILIES = ("acc", "comm", "clients", "time", "system", "run", "best", "best_round", "final")


def round_metrics(eval_clients: str) -> list[str]:
    """What every round reports of the platform's (evaluation metrics in the rounds that evaluate; the
    global model's only for algorithms that have one), the personalised ones under the name that
    ``eval.clients`` gives them."""
    return [personal_on(m, eval_clients) for m in PERSONAL_METRICS] + [
        Metrics.ACC_GLOBAL, Metrics.LOSS_GLOBAL, Metrics.LOSS_TRAIN, Metrics.COMM_UP_BYTES,
        Metrics.COMM_DOWN_BYTES, Metrics.COMM_UP_BYTES_CUM, Metrics.COMM_DOWN_BYTES_CUM,
        Metrics.CLIENTS_SELECTED, Metrics.CLIENTS_FAILED, Metrics.CLIENTS_RETRIED,
        Metrics.TIME_ROUND_S, Metrics.TIME_CLIENT_S, Metrics.TIME_TRAIN_S, Metrics.TIME_AGGREGATE_S,
    ]  # fmt: skip


def check_metric(space: SearchSpace, eval_clients: str) -> None:
    reported = round_metrics(eval_clients)
    platform = space.metric.split("/", 1)[0] in PLATFORM_FAMILIES or space.metric == Metrics.LOSS_PERSONAL
    if platform and space.metric not in reported:
        raise ConfigError(
            f"{space.path}: metric={space.metric!r}: the rounds do not report it "
            f"(eval.clients={eval_clients}); they report {', '.join(reported)} and the algorithm's own"
        )
