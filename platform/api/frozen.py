"""A module run with other weights than its own, frozen: what a client computes with the round's global
model or a model it kept from an earlier round (MOON's ``z_glob`` and ``z_prev``, FedNTD's teacher
logits) without holding a second copy of the model.

The weights travel as one flat vector of the module's floating state (its parameters and BatchNorm
statistics, :func:`flat_state`), which a client can :meth:`~ClientModule.hold` for a round or keep in a
persistent buffer across rounds; :func:`frozen_call` runs the module on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call


def float_entries(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The floating entries of a module's state (weights, BatchNorm statistics), in state order."""
    return [(k, v) for k, v in module.state_dict().items() if v.is_floating_point()]


def flat_state(module: nn.Module) -> Tensor:
    """The module's floating state as one detached vector (a copy), on the module's device."""
    return torch.cat([v.detach().reshape(-1) for _, v in float_entries(module)])


def state_views(flat: Tensor, module: nn.Module) -> dict[str, Tensor]:
    """``flat`` (a :func:`flat_state` of a module of this shape) as the module's state entries."""
    entries = float_entries(module)
    parts = flat.split([v.numel() for _, v in entries])
    return {k: part.view(v.shape) for (k, v), part in zip(entries, parts, strict=True)}


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode for the block, each back in its own mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def frozen_call(module: nn.Module, flat: Tensor, x: Tensor) -> Tensor:
    """``module(x)`` with the weights in ``flat`` instead of its own, in eval mode (BatchNorm's stored
    statistics, which it leaves unchanged; no dropout), without gradient: a function of those weights
    and ``x`` alone. The module's own weights and modes are as they were after."""
    with torch.no_grad(), eval_mode(module):
        return functional_call(module, state_views(flat, module), (x,))
