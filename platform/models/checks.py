"""What an algorithm can require of the model group, checked in config validation before Ray starts:
one architecture (whole-model averaging) or one representation size across the group (prototypes,
guides, shared headers)."""

from __future__ import annotations

import torch

from fedray.platform.errors import ConfigError
from fedray.platform.models.inputs import InputShape
from fedray.platform.models.registry import build_for, model_group


def require_homogeneous(algorithm: str, group: str) -> None:
    """ConfigError unless every client of ``group`` runs the same architecture."""
    if len(set(model_group(group))) > 1:
        raise ConfigError(
            f"algorithm={algorithm} averages whole models, so model.group={group!r} "
            "(heterogeneous) cannot be used; pick a single architecture"
        )


def shared_feature_dim(algorithm: str, group: str, shape: InputShape, num_classes: int) -> int:
    """The representation size ``d`` every architecture of ``group`` shares; ConfigError when they differ.

    Models are built on the meta device (no memory, no init cost), one per distinct architecture.
    """
    with torch.device("meta"):
        dims = {
            arch: build_for(arch, shape, num_classes).feature_dim
            for arch in dict.fromkeys(model_group(group))
        }
    if len(set(dims.values())) > 1:
        found = ", ".join(f"{a}: {d}" for a, d in dims.items())
        raise ConfigError(
            f"model.group={group!r}: algorithm={algorithm} needs one feature size "
            f"across the group, got {found}; pool the members to one size (name@K)"
        )
    return next(iter(dims.values()))
