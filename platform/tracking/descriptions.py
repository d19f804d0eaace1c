"""One paragraph that says what a run (or a sweep) was: MLflow shows it as the run's description
(tag ``mlflow.note.content``), above the params, so a run can be read without opening its config."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedray.platform.config import ExperimentConfig, TrainConfig, clients_per_round
from fedray.platform.config.algorithm_config import AlgorithmConfig


def _values(algo: AlgorithmConfig | None) -> str:
    fields = dataclasses.asdict(algo) if algo is not None else {}
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "no hyperparameters"


def partition_names(cfg: ExperimentConfig) -> tuple[str, str]:
    """The partition as a short label (run names, the dataset entity) and as a phrase (descriptions)."""
    p = cfg.data.partition
    label, text = {
        "iid": ("iid", "IID"),
        "dirichlet": (f"dir{p.alpha:g}", f"Dirichlet(alpha={p.alpha:g}) label skew"),
        "shards": (f"shards{p.classes_per_client}", f"{p.classes_per_client} label shards per client"),
        "shamsian": (
            f"pat{p.classes_per_client}",
            f"pathological, {p.classes_per_client} classes per client",
        ),
        "file": ("file", f"the split file {p.path}"),
        "natural": ("natural", f"the dataset's own clients ({cfg.data.dataset}'s users)"),
    }[p.kind]
    if p.long_tail_rho:
        return f"lt{p.long_tail_rho:g}-{label}", f"long-tailed (rho={p.long_tail_rho:g}), {text}"
    return label, text


def _partition(cfg: ExperimentConfig) -> str:
    return partition_names(cfg)[1]


def _init(cfg: ExperimentConfig) -> str:
    if cfg.model.init == "shared":
        return "clients of one architecture start from the same weights"
    return "each client starts from weights of its own"


def _optimizer(t: TrainConfig) -> str:
    name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[t.optimizer]
    lr_decay = f" x {t.lr_decay:g}^round" if t.lr_decay != 1 else ""
    momentum = "momentum" if t.optimizer == "sgd" else "beta1"
    weight_decay = f" weight decay {t.weight_decay:g}" if t.weight_decay else ""
    return f"{name} lr {t.lr:g}{lr_decay} {momentum} {t.momentum:g}{weight_decay}"


def run_description(cfg: ExperimentConfig) -> str:
    t, s = cfg.train, cfg.data.split
    return (
        f"{cfg.algorithm} ({_values(cfg.algo)}) on {cfg.data.dataset}"
        f"{f' ({cfg.data.train_subset} training images)' if cfg.data.train_subset else ''}, "
        f"{cfg.data.num_clients} clients, {_partition(cfg)}, each client's data split "
        f"{s.train:g}/{s.val:g}/{s.test:g} ({s.convention}); model group {cfg.model.group} "
        f"({_init(cfg)}); "
        f"{cfg.rounds} rounds with {clients_per_round(cfg)} clients per round, {t.local_epochs} local "
        f"epoch(s) of batch {t.batch_size}, {_optimizer(t)}; seed {cfg.seed}; "
        f"evaluated every {cfg.eval_every} round(s) on {cfg.eval.clients} clients."
    )


def sweep_description(
    algorithm: str,
    space: Any,
    base: ExperimentConfig,
    best: dict[str, Any] | None = None,
    chart_url: str | None = None,
) -> str:
    """The space and search of a sweep, and (once it ended) its best trial and its chart view."""
    params = "; ".join(f"{p.key} {p.kind} {p.values}" for p in space.params)
    text = (
        f"Ray Tune sweep of {algorithm} on {base.data.dataset} ({base.data.num_clients} clients, "
        f"{_partition(base)}, {base.rounds} rounds): {space.search} search over {params}; "
        f"{space.num_trials()} trials, scheduler {space.scheduler}, {space.mode}imising {space.metric}."
    )
    if best:
        values = ", ".join(f"{k}={v}" for k, v in best["params"].items())
        text += f" Best trial: {values} with {space.metric} = {best['value']:.4f} (run {best['run_id']})."
    if chart_url:
        text += f" Trials' curves grouped by the swept values (make ui): {chart_url}"
    return text
