"""torchvision architectures (always ``weights=None``), with the classifier stripped to give features.

- ResNet-18/34/50/101/152: ``:imagenet`` is torchvision's model unchanged (FedL2G's HtFE groups use it
  as is at 32x32). ``:cifar`` (the automatic choice for images <= 64 px) swaps the 7x7/2 stem for a
  3x3/1 conv and drops the max-pool, the usual CIFAR adaptation (4x larger final maps, ~16x the FLOPs).
- GoogLeNet (``aux_logits=False``, ``init_weights=True``) and MobileNetV2: torchvision's models unchanged,
  as FedL2G / PFLlib run them at 32x32; the dropout before their classifier stays in ``features``.
- VGG-16: ``:cifar`` is the torchvision conv stack + a 512-wide classifier (Linear-ReLU-Dropout twice),
  ~15.2M params at 32x32; ``:imagenet`` is torchvision's 7x7 avg-pool + 4096-wide classifier (the
  ">130M params" the FedCross paper states in Sec. IV-C2; see docs/algorithms/fedcross.md, Model
  architectures), d=4096.

The first conv takes ``in_channels`` (re-initialised the model's way when replaced); with 3 channels and
``:imagenet`` the feature extractor is torchvision's model as constructed, and the new head gets the
original classifier's init scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fedray.platform.models.base import declare_levels
from fedray.platform.models.registry import register_model


def _conv_like(old: nn.Conv2d, in_channels: int, **overrides: int) -> nn.Conv2d:
    kw: dict[str, Any] = {
        "kernel_size": old.kernel_size,
        "stride": old.stride,
        "padding": old.padding,
        "bias": old.bias is not None,
    }
    kw.update(overrides)
    return nn.Conv2d(in_channels, old.out_channels, **kw)


def _normal_head(std: float, truncated: bool = False) -> Callable[[nn.Linear], None]:
    """The original classifier's init: N(0, std) and zero bias (VGG, MobileNetV2), or GoogLeNet's
    truncated normal on the weight only."""

    def init(head: nn.Linear) -> None:
        if truncated:
            nn.init.trunc_normal_(head.weight, mean=0.0, std=std, a=-2, b=2)
        else:
            nn.init.normal_(head.weight, 0.0, std)
            nn.init.zeros_(head.bias)

    return init


# -------------------------------------------------------------------------------------- ResNets


def _tv_resnet(depth: int, in_channels: int, style: str) -> tuple[nn.Module, int]:
    from torchvision import models

    net = getattr(models, f"resnet{depth}")(weights=None)
    if style == "cifar":
        net.conv1 = _conv_like(net.conv1, in_channels, kernel_size=3, stride=1, padding=1)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = _conv_like(net.conv1, in_channels)
    if net.conv1.in_channels != 3 or style == "cifar":
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    dim = net.fc.in_features
    net.fc = nn.Identity()
    from fedray.platform.models.torchvision_levels import expose_pre_activation

    stages = [net.layer1, net.layer2, net.layer3, net.layer4]
    for stage in stages:
        expose_pre_activation(stage[-1])
    # the stem and each stage's last block, before their ReLU (FedRCL's authors' five levels)
    declare_levels(net, ["bn1", *(f"layer{i}.{len(s) - 1}.pre_relu" for i, s in enumerate(stages, 1))])
    return net, dim


def _register_resnet(depth: int) -> None:
    def build(in_channels: int, image_size: int, style: str) -> tuple[nn.Module, int]:
        return _tv_resnet(depth, in_channels, style)

    dim = 512 if depth < 50 else 2048
    build.__doc__ = f"torchvision ResNet-{depth} (weights=None), classifier removed, d={dim}."
    build.__name__ = f"resnet{depth}"
    register_model(f"resnet{depth}", styles=("cifar", "imagenet"))(build)


for _depth in (18, 34, 50, 101, 152):
    _register_resnet(_depth)


# ----------------------------------------------------------------------------- GoogLeNet, MobileNetV2


@register_model("googlenet", min_size=15, head_init=_normal_head(0.01, truncated=True))
def googlenet(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision GoogLeNet (aux_logits=False, init_weights=True), fc removed, d=1024."""
    from torchvision import models

    net = models.googlenet(weights=None, aux_logits=False, init_weights=True)
    if in_channels != 3:
        net.conv1.conv = _conv_like(net.conv1.conv, in_channels)
        nn.init.trunc_normal_(net.conv1.conv.weight, mean=0.0, std=0.01, a=-2, b=2)
    net.fc = nn.Identity()
    return net, 1024


@register_model("mobilenet_v2", head_init=_normal_head(0.01))
def mobilenet_v2(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision MobileNetV2 (weights=None), final Linear removed (its dropout kept), d=1280."""
    from torchvision import models

    net = models.mobilenet_v2(weights=None)
    if in_channels != 3:
        first = net.features[0][0]
        net.features[0][0] = _conv_like(first, in_channels)
        nn.init.kaiming_normal_(net.features[0][0].weight, mode="fan_out")
    net.classifier[1] = nn.Identity()
    return net, 1280


# ------------------------------------------------------------------------------------------ VGG


def _vgg16(in_channels: int, image_size: int, style: str, batch_norm: bool) -> tuple[nn.Module, int]:
    from torchvision import models
    from torchvision.models.vgg import cfgs, make_layers

    if style == "imagenet":
        net = (models.vgg16_bn if batch_norm else models.vgg16)(weights=None)
        if in_channels != 3:
            net.features[0] = _conv_like(net.features[0], in_channels)
            _init_vgg(net.features[0])
        net.classifier[6] = nn.Identity()
        return net, 4096
    side = image_size // 32  # five 2x2 max-pools
    features = make_layers(cfgs["D"], batch_norm=batch_norm)
    if in_channels != 3:
        features[0] = _conv_like(features[0], in_channels)
    convs = nn.Sequential(
        features,
        nn.Flatten(),
        nn.Linear(512 * side * side, 512),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(512, 512),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
    )
    _init_vgg(convs)  # the CIFAR variant is not built through VGG.__init__
    return convs, 512


def _init_vgg(module: nn.Module) -> None:
    """torchvision's VGG init."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


@register_model("vgg16", min_size=32, styles=("cifar", "imagenet"), head_init=_normal_head(0.01))
def vgg16(in_channels: int, image_size: int, style: str) -> tuple[nn.Module, int]:
    """VGG-16 (torchvision conv stack); d=512 (:cifar, 512-wide classifier) or 4096 (:imagenet)."""
    return _vgg16(in_channels, image_size, style, batch_norm=False)


@register_model("vgg16_bn", min_size=32, styles=("cifar", "imagenet"), head_init=_normal_head(0.01))
def vgg16_bn(in_channels: int, image_size: int, style: str) -> tuple[nn.Module, int]:
    """VGG-16 with BatchNorm (torchvision conv stack); d=512 (:cifar) or 4096 (:imagenet)."""
    return _vgg16(in_channels, image_size, style, batch_norm=True)
