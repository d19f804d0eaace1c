"""What an algorithm can require of the model group: one architecture (whole-model averaging) or
one representation size across the group (prototypes, guides, shared headers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedray.platform.errors import ConfigError
from fedray.platform.models.registry import model_group

if TYPE_CHECKING:
    from fedray.platform.api.algorithm import ServerContext
    from fedray.platform.config import ExperimentConfig


def require_homogeneous(cfg: ExperimentConfig) -> None:
    """ConfigError unless every client runs the same architecture."""
    if len(set(model_group(cfg.model.group))) > 1:
        raise ConfigError(
            f"algorithm={cfg.algorithm} averages whole models, so model.group={cfg.model.group!r} "
            "(heterogeneous) cannot be used; pick a single architecture"
        )


def shared_feature_dim(ctx: ServerContext) -> int:
    """The representation size ``d`` every client's model shares; ConfigError when they differ.

    Models are built on the meta device (no memory, no init cost), one per distinct architecture.
    """
    first = {arch: cid for cid, arch in reversed(list(enumerate(ctx.client_archs)))}
    with torch.device("meta"):
        dims = {arch: ctx.make_model(cid).feature_dim for arch, cid in first.items()}
    if len(set(dims.values())) > 1:
        found = ", ".join(f"{a}: {d}" for a, d in dims.items())
        raise ConfigError(
            f"model.group={ctx.cfg.model.group!r}: algorithm={ctx.cfg.algorithm} needs one feature size "
            f"across the group, got {found}; pool the members to one size (name@K)"
        )
    return next(iter(dims.values()))
