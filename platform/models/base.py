"""The model contract shared by every zoo architecture: a feature extractor plus a linear head.

Every model is ``head(features(x))`` with ``head = Linear(feature_dim, num_classes)``. Algorithms that
share or personalise only the classifier (FedSSA's "header", LG-FedAvg, FedGH, FedL2G) address it through
:func:`head_param_names`; prototype algorithms (FedProto, FedSC, FedL2G-feat) use
:meth:`FedModel.forward_with_features` to get logits and the d-dim representation in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedray.platform.models.inputs import InputShape


def declare_levels(module: nn.Module, names: Sequence[str]) -> None:
    """Name the submodules of an extractor whose outputs are its representations before their ReLU,
    from shallow to deep, the deepest the one ``z`` is made from (FedRCL's multi-level loss reads them,
    as its authors' code reads a ResNet's stem and stages)."""
    for name in names:
        module.get_submodule(name)  # an AttributeError that names a level the module lacks
    module.__dict__["level_names"] = tuple(names)  # a plain attribute: no parameter, no state entry


class PreActivation(nn.Identity):
    """Where a residual block's sum passes before its last ReLU: an identity whose output a forward
    hook can read as a level (:func:`declare_levels`); no parameter, no state entry."""


class FeaturePool(nn.Module):
    """``nn.AdaptiveAvgPool1d(k)`` over a flat ``[B, D]`` feature vector -> ``[B, k]``.

    FedL2G (paper §4, "Model heterogeneity settings"; docs/algorithms/fedl2g.md, Pooling features to K = 512)
    brings every heterogeneous extractor to K = 512 this way:
    average pooling over the channel axis, no parameters. For ``D = m * k`` it is the mean of each run of
    ``m`` consecutive values; for ``D == k`` the identity; for ``k = m * D`` each value repeated ``m`` times.
    Those two cases are computed directly (deterministic on GPU, unlike the adaptive-pool backward).
    """

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        d = x.shape[1]
        if d == self.k:
            return x
        if d % self.k == 0:
            return x.reshape(x.shape[0], self.k, d // self.k).mean(-1)
        if self.k % d == 0:
            return x.repeat_interleave(self.k // d, dim=1)
        return F.adaptive_avg_pool1d(x.unsqueeze(1), self.k).squeeze(1)

    def extra_repr(self) -> str:
        return f"k={self.k}"


class FedModel(nn.Module):
    """A zoo model: ``features`` (x -> ``[B, feature_dim]``) followed by ``head = Linear(feature_dim, C)``.

    ``arch`` is the zoo name it was built from (e.g. ``"fedssa_cnn1"`` or ``"resnet50:imagenet@512"``);
    ``inputs`` (what it reads) and ``num_classes`` are kept so a peer model can be rebuilt. Image models
    also answer ``in_channels`` and ``image_size``; pass either ``inputs`` or those two.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        *,
        arch: str,
        inputs: InputShape | None = None,
        in_channels: int | None = None,
        image_size: int | None = None,
    ) -> None:
        super().__init__()
        if inputs is None:
            if in_channels is None or image_size is None:
                raise TypeError("FedModel needs inputs=InputShape(...), or in_channels and image_size")
            inputs = InputShape.image(in_channels, image_size)
        elif in_channels is not None or image_size is not None:
            raise TypeError("FedModel takes inputs= or in_channels/image_size, not both")
        self.features = features
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.arch = arch
        self.inputs = inputs

    @property
    def in_channels(self) -> int:
        return self._image_field("channels")

    @property
    def image_size(self) -> int:
        return self._image_field("size")

    def _image_field(self, name: str) -> int:
        if self.inputs.modality != "image":
            raise AttributeError(f"model {self.arch!r} reads {self.inputs}, not images")
        return getattr(self.inputs, name)

    def example_input(self, batch: int = 2) -> Tensor:
        """A zero batch the model reads (:meth:`InputShape.example`), on the device of its parameters."""
        param = next(self.parameters(), None)
        return self.inputs.example(batch, device=param.device if param is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))

    def forward_features(self, x: Tensor) -> Tensor:
        return self.features(x)

    def feature_levels(self) -> list[nn.Module]:
        """The submodules of ``features`` whose outputs are its representations before their ReLU,
        from shallow to deep, as its extractor declares them (:func:`declare_levels`); ``[]`` where it
        declares none. A ReLU may overwrite such an output in place: read it as the module returns it."""
        for module in self.features.modules():
            names = getattr(module, "level_names", None)
            if names:
                return [module.get_submodule(name) for name in names]
        return []

    def forward_with_features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits and representation from a single pass (same dropout mask / BN batch for both)."""
        z = self.features(x)
        return self.head(z), z

    def extra_repr(self) -> str:
        return (
            f"arch={self.arch!r}, inputs={self.inputs}, feature_dim={self.feature_dim}, "
            f"num_classes={self.num_classes}"
        )


def head_param_names(model: FedModel) -> list[str]:
    """The ``state_dict`` keys of the model's head: ``["head.weight", "head.bias"]``."""
    return [f"head.{name}" for name, _ in model.head.named_parameters()]


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (all, or only those with ``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial size after a conv / pool layer (floor mode)."""
    return (size + 2 * padding - kernel) // stride + 1


@torch.no_grad()
def init_like_torchvision_resnet(module: nn.Module) -> None:
    """Kaiming-normal (fan_out) convs, BN weight 1 / bias 0 — torchvision's ResNet init."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
