"""Typed experiment config: YAML file + dotted ``key=value`` overrides, validated before anything starts.

The config is a tree of dataclasses. Algorithm hyperparameters live in a section named after the
algorithm (``fedprox.mu=0.1``); the section's dataclass is declared next to the algorithm. This
module imports no dataset, model or algorithm (nor torch): what validation needs of them is handed
in (:mod:`fedray.platform.config.loading`).

Every problem is raised as :class:`ConfigError` with a one-line message naming the key, the value
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.errors import ConfigError

# --------------------------------------------------------------------------------------------- sections


@dataclass
class PartitionConfig:
    # natural: the dataset's own clients (LEAF's writers, roles, users); the others split the pooled samples
    kind: Literal["iid", "dirichlet", "shards", "shamsian", "file", "natural"] = "dirichlet"
    alpha: float = 0.5  # Dirichlet concentration
    classes_per_client: int = 2  # shards / shamsian
    min_samples: int = 10  # Dirichlet: re-draw until every client has this many samples
    long_tail_rho: float | None = None  # imbalance ratio max/min applied to the train pool first
    # kind=file: a split JSON (fedray-split-1, see fedray.platform.data.split_file) made elsewhere or
    # written by another run; it defines the clients, their samples and the global test set
    path: str | None = None


@dataclass
class LeafConfig:
    """LEAF's options (its ``preprocess.sh``) for ``femnist``, ``shakespeare`` and ``sent140``.

    With ``data.partition.kind=natural`` the run keeps ``data.num_clients`` of the dataset's users,
    drawn from the seed among those with at least ``min_samples`` samples (LEAF's ``-k``).
    """

    min_samples: int = 0  # LEAF -k: users with fewer samples are left out
    # LEAF -t sample --tf: each user's train share when the files are LEAF's unsplit all_data/
    # (fixed seed, so every run tests on the same held-out samples); ignored for train/ + test/ files
    train_fraction: float = 0.9
    glove: str | None = None  # sent140: a GloVe text file (LEAF: glove.6B.300d.txt); None = learned
    vocab_size: int = 10000  # sent140 without GloVe: the most frequent training words kept (others: unknown)


@dataclass
class SplitConfig:
    """Per-client split of each client's share, by ratio (FedSSA 8:1:1, FedL2G 0.75/0.25).

    ``convention`` picks the pool and where client tests come from (fedray.platform.data.federation):
    ``per_client`` partitions the official train set and splits each share by the ratios (FedSSA
    paper); ``merged`` partitions official train + test merged, then splits by ratio (PFLlib, FedL2G);
    ``official_test`` partitions the train set, splits each share train/val by ratio (test must be 0)
    and draws each client's test from the official test set with its class proportions (FedSSA code).
    """

    train: float = 0.75
    val: float = 0.0
    test: float = 0.25
    convention: Literal["per_client", "merged", "official_test"] = "per_client"


@dataclass
class DataConfig:
    dataset: str = "digits"
    root: str | None = None  # where torchvision / image-folder datasets live
    download: bool = False  # torchvision sets: download only when the user asks
    num_clients: int = 10
    train_subset: int | None = None  # use a stratified random subset of the training pool (benchmarks)
    normalize: str = "dataset"  # per-channel statistics of the pool, or "<mean>,<std>" (PFLlib: 0.5,0.5)
    augment: Literal["none", "crop_flip"] = "none"  # on clients' training batches: 4-px crop + flip
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    leaf: LeafConfig = field(default_factory=LeafConfig)
    image_size: int | None = None  # resize every image to this side (Flowers102 / Tiny-ImageNet: 64)
    # synthetic set only: how big and how hard
    synthetic_samples: int = 2000
    synthetic_classes: int = 10
    synthetic_image_size: int = 8


@dataclass
class ModelConfig:
    # a single architecture name from the zoo, or a group name (fedssa_cnns, htfe2, ...)
    group: str = "cnn_small"
    # shared: every client of one architecture starts from the same weights, drawn from (seed,
    # architecture), as PFLlib and HtFLlib start theirs; per_client: each from (seed, client id)
    init: Literal["shared", "per_client"] = "shared"


@dataclass
class TrainConfig:
    fraction: float = 1.0  # participation C: share of clients selected each round
    local_epochs: int = 1
    batch_size: int = 32
    # drop each epoch's last, partial batch: floor(n / batch_size) steps an epoch, as PFLlib and HtFLlib
    # train (the FedL2G paper's setting); false trains on every sample
    drop_last: bool = False
    lr: float = 0.05
    # the clients' lr at round t is lr * lr_decay^t (1 = constant); the reference codes of FedGen and
    # FedNH decay it by 0.99 a round, FedRCL's by 0.998
    lr_decay: float = 1.0
    # the clients' optimizer: sgd (every paper's), adam or adamw (weight decay decoupled); adam and
    # adamw take momentum as beta1, beta2 0.999 (torch's defaults)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_clip: float | None = None  # max global grad norm; None = no clipping
    keep_optimizer_state: bool = False  # carry the optimizer's state (momentum, Adam's moments) across rounds
    # on a GPU: "32" (full float32), "bf16-mixed" or "16-mixed" (autocast; 16-mixed scales the loss)
    precision: Literal["32", "bf16-mixed", "16-mixed"] = "32"
    tf32: bool = False  # let CUDA matmuls and convolutions round to TF32 (faster, not float32-exact)
    deterministic: bool = True  # on a GPU: deterministic cuDNN / CUDA kernels, so a rerun repeats itself
    # how a worker lays out images of more than one channel: auto = channels_last on a CPU (oneDNN's
    # convolutions run faster on it), contiguous (NCHW) on a GPU; the model's parameters stay NCHW
    memory_format: Literal["auto", "channels_last", "contiguous"] = "auto"


MIN_OBJECT_STORE_MB = 75  # Ray refuses a smaller object store


@dataclass
class RayConfig:
    address: str | None = None  # join a cluster; RAY_ADDRESS wins when set
    num_cpus_per_client: float = 1.0  # resources of one ClientActor
    num_gpus_per_client: float = 0.0  # fractions share a GPU between actors
    max_actors: int | None = None  # cap on the ClientActor pool (default: what the resources allow)
    num_cpus: int | None = None  # CPUs for a local Ray (default: the machine's)
    # a local Ray's shared-memory object store, MB (default: Ray's, 30% of memory): the shards,
    # downlinks and uplinks travel there (client states go to files under storage_path)
    object_store_mb: int | None = None
    cache_clients: int = 32  # client modules a worker keeps between calls (a returning client loads nothing)
    # a Coordinator that dies is started again from the last checkpoint this many times (its rounds
    # since then recomputed to the same numbers); past that the run stops with the --resume line
    max_coordinator_restarts: int = 3
    # once one ClientActor is up, how long (s) the run's set-up waits for the others it started with
    # (at least; twice what that one took, if longer) before it starts without them: Ray sizes the
    # pool from summed free resources, so one may have no node with room; each joins once placed
    pool_wait_s: float = 60.0

    def cluster_address(self) -> str:
        """The cluster a run joins: ``RAY_ADDRESS``, else ``address``; "" for a local Ray."""
        return os.environ.get("RAY_ADDRESS") or self.address or ""

    def cluster_address_source(self) -> str:
        """Where :meth:`cluster_address` comes from, named as a user sets it."""
        return "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "ray.address"


@dataclass
class EvalConfig:
    """Which clients the personalised evaluation covers each evaluation round.

    ``all`` (default) tests every client, so a round costs time in the number of clients that exist
    (at 10,000 clients, a model built and run per client); ``selected`` tests the round's trained
    clients; ``sample`` a seeded random ``sample_size`` of all clients. With a policy other than
    ``all`` the personalised metrics are logged under a name that says so (``acc/personal_mean_selected``).
    """

    clients: Literal["all", "selected", "sample"] = "all"
    sample_size: int = 100


@dataclass
class TrackingConfig:
    uri: str | None = None  # MLflow tracking URI; MLFLOW_TRACKING_URI wins, then sqlite in the cwd
    experiment: str | None = None  # default: the config's name
    log_client_models: int = 100  # personalised client models logged at the end; above this, none
    system_metrics_s: float = 10.0  # MLflow system metrics (CPU, memory, GPU) sampling interval; 0 = off
    # how long a run waits out a tracking server that does not answer (its rounds go on meanwhile)
    # before it stops as Ctrl-C does
    max_outage_s: float = 900.0


@dataclass
class ExperimentConfig:
    name: str = "quickstart"
    algorithm: str = "fedavg"
    seed: int = 0
    rounds: int = 20
    eval_every: int = 1
    checkpoint_every: int = 5
    # checkpoints and committed client states: a directory, or a pyarrow.fs URI (s3://...) on a cluster
    storage_path: str = ".fedray"
    progress: bool = True
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # the chosen algorithm's hyperparameters, its own dataclass: built from the section under its name
    # (`fedprox: {mu: 0.1}`), not a key of its own
    algo: AlgorithmConfig | None = field(default=None, metadata={"not_a_key": True})

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict; the algorithm section appears under the algorithm's name."""
        out = dataclasses.asdict(dataclasses.replace(self, algo=None))
        out.pop("algo")
        if self.algo is not None:
            out[self.algorithm] = dataclasses.asdict(self.algo)
        return out


# --------------------------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the declared field type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        for arg in args:
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {' or '.join(_type_name(a) for a in args)} or null")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed and not isinstance(value, bool) and str(value) in allowed:
            return str(value)  # precision: 32 in YAML is the number; the choice is the string "32"
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, allowed))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, float):  # 2.0 is 2; 1.5 is no integer, not 1
            if value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: expected an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
        if not math.isfinite(number):  # inf passes every "> 0" check and then breaks the run
            raise ConfigError(f"{key}={value!r}: expected a finite number")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, prefix=key)
    return value


def build_dataclass(cls: type, values: Any, prefix: str = "") -> Any:
    """Build ``cls`` from a mapping, checking every key and converting every value."""
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("not_a_key")}
    if values is None:
        values = {}
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        skip = {f.name for f in dataclasses.fields(values) if f.metadata.get("not_a_key")}
        values = {k: v for k, v in dataclasses.asdict(values).items() if k not in skip}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ConfigError(f"unknown config key {dotted!r}; known keys here: {', '.join(fields)}")
        kwargs[key] = _coerce(dotted, value, hints[key])
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------- checks


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ExperimentConfig, checks: Sequence[Callable[[ExperimentConfig], None]] = ()) -> None:
    """:func:`check_fields`, then ``checks`` (those that need the dataset, model and algorithm
    registries, handed in by the caller: :class:`~fedray.platform.config.loading.Catalog`), then the
    algorithm's own. Data-dependent checks live in the data module."""
    check_fields(cfg)
    for check in checks:
        check(cfg)
    if cfg.algo is not None:
        cfg.algo.validate(cfg)


def check_fields(cfg: ExperimentConfig) -> None:
    """The platform sections' values: cheap checks that need no registry, no data and no Ray."""
    d, p, s, t = cfg.data, cfg.data.partition, cfg.data.split, cfg.train
    _check(bool(cfg.name.strip()), "name: must not be empty (it names the MLflow experiment and the run)")
    _check(0 <= cfg.seed < 2**63, f"seed={cfg.seed}: must be >= 0 and < 2**63 (a 64-bit integer)")
    _check(bool(cfg.storage_path.strip()), "storage_path: must not be empty (default .fedray)")
    _check(cfg.rounds >= 1, f"rounds={cfg.rounds}: must be >= 1")
    _check(cfg.eval_every >= 1, f"eval_every={cfg.eval_every}: must be >= 1")
    _check(cfg.checkpoint_every >= 0, f"checkpoint_every={cfg.checkpoint_every}: must be >= 0 (0 = never)")
    _check(d.num_clients >= 1, f"data.num_clients={d.num_clients}: must be >= 1")
    _check(
        d.train_subset is None or d.train_subset >= d.num_clients,
        f"data.train_subset={d.train_subset}: must be >= data.num_clients or null",
    )
    _check(p.alpha > 0, f"data.partition.alpha={p.alpha}: the Dirichlet concentration must be > 0")
    _check(
        p.classes_per_client >= 1, f"data.partition.classes_per_client={p.classes_per_client}: must be >= 1"
    )
    _check(p.min_samples >= 0, f"data.partition.min_samples={p.min_samples}: must be >= 0")
    _check(
        p.long_tail_rho is None or p.long_tail_rho >= 1,
        f"data.partition.long_tail_rho={p.long_tail_rho}: the imbalance ratio max/min must be >= 1",
    )
    _check(
        p.kind != "file" or bool(p.path), "data.partition.kind=file needs data.partition.path=<split.json>"
    )
    for name in ("train", "val", "test"):
        ratio = getattr(s, name)
        _check(0 <= ratio <= 1, f"data.split.{name}={ratio}: a ratio must lie in [0, 1]")
    _check(s.train > 0, f"data.split.train={s.train}: clients need training data")
    _check(
        abs(s.train + s.val + s.test - 1) < 1e-6,
        f"data.split: train+val+test = {s.train + s.val + s.test:g}, must be 1",
    )
    _check(
        s.convention != "merged" or s.test > 0,
        f"data.split.test={s.test}: data.split.convention=merged merges the official test set into the "
        "pool, so client tests are the only test data; set data.split.test > 0 (PFLlib: 0.25)",
    )
    _check(
        s.convention != "official_test" or s.test == 0,
        f"data.split.test={s.test}: data.split.convention=official_test draws client tests from the "
        "official test set, so the ratios split train/val only; set data.split.test=0 (e.g. 0.8/0.2/0)",
    )
    leaf = d.leaf
    _check(leaf.min_samples >= 0, f"data.leaf.min_samples={leaf.min_samples}: must be >= 0")
    _check(
        0 < leaf.train_fraction < 1,
        f"data.leaf.train_fraction={leaf.train_fraction}: each user's train share must be in (0, 1)",
    )
    _check(leaf.vocab_size >= 2, f"data.leaf.vocab_size={leaf.vocab_size}: must be >= 2")
    _check(d.image_size is None or d.image_size >= 1, f"data.image_size={d.image_size}: must be >= 1 or null")
    _check(d.synthetic_classes >= 1, f"data.synthetic_classes={d.synthetic_classes}: must be >= 1")
    _check(d.synthetic_image_size >= 1, f"data.synthetic_image_size={d.synthetic_image_size}: must be >= 1")
    _check(0 < t.fraction <= 1, f"train.fraction={t.fraction}: the participation fraction must be in (0, 1]")
    _check(t.local_epochs >= 0, f"train.local_epochs={t.local_epochs}: must be >= 0")
    _check(t.batch_size >= 1, f"train.batch_size={t.batch_size}: must be >= 1")
    _check(t.lr > 0, f"train.lr={t.lr}: must be > 0")
    _check(0 < t.lr_decay <= 1, f"train.lr_decay={t.lr_decay}: the per-round factor must be in (0, 1]")
    _check(0 <= t.momentum < 1, f"train.momentum={t.momentum}: must be in [0, 1) (Adam's beta1 too)")
    _check(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay}: must be >= 0")
    _check(t.grad_clip is None or t.grad_clip > 0, f"train.grad_clip={t.grad_clip}: must be > 0 or null")
    _check(
        t.precision != "16-mixed" or cfg.ray.num_gpus_per_client > 0,
        "train.precision=16-mixed: float16 autocast needs a GPU (ray.num_gpus_per_client > 0); "
        "on CPU use 32 or bf16-mixed",
    )
    r = cfg.ray
    _check(r.num_cpus_per_client > 0, f"ray.num_cpus_per_client={r.num_cpus_per_client}: must be > 0")
    _check(r.num_gpus_per_client >= 0, f"ray.num_gpus_per_client={r.num_gpus_per_client}: must be >= 0")
    _check(r.max_actors is None or r.max_actors >= 1, f"ray.max_actors={r.max_actors}: must be >= 1")
    _check(r.num_cpus is None or r.num_cpus >= 1, f"ray.num_cpus={r.num_cpus}: must be >= 1 or null (all)")
    _check(not r.address or address_ok(r.address), bad_address("ray.address", r.address or ""))
    _check(r.cache_clients >= 1, f"ray.cache_clients={r.cache_clients}: must be >= 1")
    _check(r.pool_wait_s >= 0, f"ray.pool_wait_s={r.pool_wait_s}: must be >= 0")
    _check(
        r.object_store_mb is None or r.object_store_mb >= MIN_OBJECT_STORE_MB,
        f"ray.object_store_mb={r.object_store_mb}: must be >= {MIN_OBJECT_STORE_MB} (Ray's smallest store)",
    )
    _check(
        r.max_coordinator_restarts >= 0,
        f"ray.max_coordinator_restarts={r.max_coordinator_restarts}: must be >= 0 (0 = stop at the first death)",
    )
    _check(cfg.eval.sample_size >= 1, f"eval.sample_size={cfg.eval.sample_size}: must be >= 1")
    _check(
        cfg.tracking.system_metrics_s >= 0,
        f"tracking.system_metrics_s={cfg.tracking.system_metrics_s}: must be >= 0 (seconds; 0 = off)",
    )
    _check(
        cfg.tracking.max_outage_s >= 0,
        f"tracking.max_outage_s={cfg.tracking.max_outage_s}: must be >= 0 (seconds)",
    )
    _check(
        cfg.tracking.log_client_models >= 0,
        f"tracking.log_client_models={cfg.tracking.log_client_models}: must be >= 0 (0 = never)",
    )


def address_ok(address: str) -> bool:
    """A Ray cluster address as ``ray.init`` takes it: ``auto``, ``local``, ``<scheme>://...``
    (``ray://`` for Ray Client) or ``host:port`` (an IPv6 host in brackets)."""
    if address in ("auto", "local"):
        return True
    scheme, sep, rest = address.partition("://")
    if sep:  # ray:// (Ray Client), or a module that ray.init imports by the scheme's name
        return bool(rest) and (scheme == "ray" or module_exists(scheme)) and scheme not in ("http", "https")
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and "/" not in host


def module_exists(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is not there; an empty part
        return False


def bad_address(source: str, address: str) -> str:
    scheme, sep, rest = address.partition("://")
    if scheme in ("http", "https"):  # the dashboard's or the job server's URL
        why = " (that is a web address)"
    elif sep and rest and scheme != "ray":  # anyscale://... works where the anyscale package is
        why = f" (ray.init would import a module {scheme!r} for that scheme, and none is installed)"
    else:
        why = ""
    return (
        f"{source}={address!r}: not a Ray address{why}; give host:port (the head's, e.g. 10.0.0.1:6379), "
        "auto, or ray://host:port (Ray Client)"
    )


def clients_per_round(cfg: ExperimentConfig) -> int:
    """K = max(1, round(C * N)): the number of clients sampled each round, unless the algorithm's
    own hyperparameter fixes K (FedCross's ``num_middleware``, through ``participants()``)."""
    fixed = cfg.algo.participants() if cfg.algo is not None else None
    return fixed if fixed is not None else max(1, round(cfg.train.fraction * cfg.data.num_clients))


def config_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: MLflow params are flat."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def scaled_count(value: int, factor: float, floor: int = 1) -> int:
    """``value * factor`` rounded, kept at ``floor`` or more unless it was 0 (0 means off)."""
    return 0 if value == 0 else max(floor, round(value * factor))


def scale(cfg: ExperimentConfig, factor: float) -> ExperimentConfig:
    """Shrink a paper setting for a CPU: rounds, clients and the algorithm's round counts times ``factor``.

    The algorithm's round counts (e.g. FedL2G's ``warmup_rounds``, declared with ``round_count``) shrink too, so a warm-up keeps
    its share of the run; a round count stays >= 1 (0 stays 0: off). The participation fraction is
    kept, so K = C * N shrinks with N, but never below the algorithm's ``MIN_PARTICIPANTS`` (FedCross
    cross-aggregates 2 or more); its client counts (``client_count``: counts that fix K) shrink like N. Data size is
    untouched: add ``data.train_subset=N`` for that.
    """
    if not 0 < factor <= 1:
        raise ConfigError(f"--scale {factor}: must be in (0, 1]")
    algo = cfg.algo
    need = algo.MIN_PARTICIPANTS if algo is not None else 1
    out = dataclasses.replace(cfg)
    out.rounds = scaled_count(cfg.rounds, factor)
    n = max(2, need, round(cfg.data.num_clients * factor))
    out.data = dataclasses.replace(cfg.data, num_clients=n)
    out.eval_every = min(cfg.eval_every, out.rounds)
    if algo is not None:
        changes = {name: scaled_count(getattr(algo, name), factor) for name in algo.scaled_fields("rounds")}
        for name in algo.scaled_fields("clients"):
            if getattr(algo, name) is not None:
                changes[name] = min(n, scaled_count(getattr(algo, name), factor, floor=need))
        out.algo = dataclasses.replace(algo, **changes)
    if clients_per_round(out) < need:
        out.train = dataclasses.replace(cfg.train, fraction=min(1.0, need / n))
    validate(out)
    return out
