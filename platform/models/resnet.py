"""Custom ResNets: CIFAR ResNet-20 (He et al. 2016) and the shallow ResNet-4/6/8/10 of FedL2G / FedSC."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fedray.platform.models.base import PreActivation, declare_levels, init_like_torchvision_resnet
from fedray.platform.models.registry import register_model

# ----------------------------------------------------------------------------------- CIFAR ResNet-20


class _ShortcutA(nn.Module):
    """He et al.'s option-A shortcut: stride-2 subsampling and zero-padded extra channels (no params)."""

    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.extra = out_planes - in_planes

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        lo = self.extra // 2
        return F.pad(x, (0, 0, 0, 0, lo, self.extra - lo))


class _CifarBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = _ShortcutA(in_planes, planes, stride)
        self.pre_relu = PreActivation()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(self.pre_relu(out + self.shortcut(x)))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for CIFAR: 3x3 stem (16), 3 stages of n BasicBlocks (16/32/64), global avg pool."""

    def __init__(self, in_channels: int, n: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        prev = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                blocks.append(_CifarBlock(prev, planes, stride if i == 0 else 1))
                prev = planes
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        # the stem and each stage's last block, before their ReLU
        declare_levels(self, ["bn1", *(f"layers.{n * (stage + 1) - 1}.pre_relu" for stage in range(3))])
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return self.avgpool(self.layers(x)).flatten(1)


@register_model("resnet20", min_size=1)
def resnet20(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """CIFAR ResNet-20 (He et al. 2016 §4.2, option-A shortcuts, 0.27M params), d=64.

    FedCross's ResNet-20: see docs/algorithms/fedcross.md, Model architectures.
    """
    return CifarResNet(in_channels, 3), 64


# -------------------------------------------------------------------------------- shallow ResNets


class _BasicBlock(nn.Module):
    """torchvision's ``BasicBlock`` (the same modules, names, order of construction and arithmetic), with
    its sum passing through ``pre_relu`` before the last ReLU, where a level is read."""

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.pre_relu = PreActivation()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(self.pre_relu(out))


class ShallowResNet(nn.Module):
    """torchvision-style ResNet with 1-4 stages of BasicBlocks (64/128/256/512 channels).

    ``style="imagenet"``: 7x7/2 stem + 3x3/2 max-pool (FedL2G's ``resnet.py``, with its AdaptiveAvgPool2g
    typo fixed); ``style="cifar"``: 3x3/1 stem and no max-pool (FedSC's ResNet-10).
    """

    def __init__(self, in_channels: int, layers: list[int], style: str) -> None:
        super().__init__()
        widths = [64, 128, 256, 512][: len(layers)]
        if style == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        stages: list[nn.Module] = []
        prev = 64
        for i, (width, n) in enumerate(zip(widths, layers)):
            stride = 1 if i == 0 else 2
            blocks: list[nn.Module] = []
            for j in range(n):
                down = None
                if j == 0 and (stride != 1 or prev != width):
                    down = nn.Sequential(nn.Conv2d(prev, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                blocks.append(_BasicBlock(prev, width, stride if j == 0 else 1, down))
                prev = width
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.out_dim = prev
        # the stem and each stage's last block, before their ReLU (FedRCL's authors' five levels)
        declare_levels(self, ["bn1", *(f"layers.{i}.{n - 1}.pre_relu" for i, n in enumerate(layers))])
        init_like_torchvision_resnet(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.avgpool(self.layers(x)).flatten(1)


def _register_shallow(name: str, layers: list[int], note: str) -> None:
    def build(in_channels: int, image_size: int, style: str) -> tuple[nn.Module, int]:
        net = ShallowResNet(in_channels, layers, style)
        return net, net.out_dim

    build.__doc__ = f"ResNet with BasicBlocks {layers} ({note}), d={64 * 2 ** (len(layers) - 1)}."
    build.__name__ = name
    register_model(name, styles=("cifar", "imagenet"))(build)


_register_shallow("resnet4", [1], "FedL2G HtFE9")
_register_shallow("resnet6", [1, 1], "FedL2G HtFE9")
_register_shallow("resnet8", [1, 1, 1], "FedL2G HtFE9")
_register_shallow("resnet10", [1, 1, 1, 1], "FedSC CIFAR model (:cifar); FedL2G HtFE3/9 (:imagenet)")
