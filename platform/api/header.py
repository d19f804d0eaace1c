"""A model's linear header as class rows ``[W_c | b_c]``: what LG-FedAvg and FedSSA exchange."""

from __future__ import annotations

import torch
from torch import Tensor

from fedray.platform.models.base import FedModel


def header_rows(model: FedModel) -> Tensor:
    """The model's header as rows ``[W | b]``: a detached copy on the model's device (the client's
    held indices are there too; the platform moves an uplink to the CPU), shape ``[C, d+1]``."""
    head = model.head
    return torch.cat([head.weight, head.bias[:, None]], dim=1).detach()


@torch.no_grad()
def load_header_rows(model: FedModel, rows: Tensor) -> None:
    """Write rows ``[C, d+1]`` into ``model.head`` (weight ``[C, d]``, bias ``[C]``), in place."""
    d = model.head.in_features
    if tuple(rows.shape) != (model.head.out_features, d + 1):
        raise ValueError(
            f"header of shape {tuple(rows.shape)} does not fit head Linear({d}, {model.head.out_features}): "
            "every architecture of the model group must share feature_dim"
        )
    model.head.weight.copy_(rows[:, :d])
    model.head.bias.copy_(rows[:, d])
