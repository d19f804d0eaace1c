"""Plain CNNs: the quickstart CNNs, FedSSA's CNN-1..CNN-5 and the FedAvg / PFLlib 4-layer CNN.

Flatten sizes are computed from ``image_size`` by arithmetic, so every size >= the registered minimum works.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from fedray.platform.models.base import conv_out, declare_levels
from fedray.platform.models.registry import register_model

# ------------------------------------------------------------------------------------ quickstart CNNs


def _small_cnn(in_channels: int, convs: list[int], fc: int) -> tuple[nn.Module, int]:
    """conv3x3(pad 1)+ReLU layers; a 2x2 max-pool after the second; AdaptiveAvgPool2d(4); FC+ReLU.

    The adaptive pool keeps the FC size independent of the image size (identity at 8x8 digits).
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    prev = in_channels
    for i, width in enumerate(convs, start=1):
        layers[f"conv{i}"] = nn.Conv2d(prev, width, 3, padding=1)
        layers[f"relu{i}"] = nn.ReLU(inplace=True)
        if i == 2:
            layers["pool"] = nn.MaxPool2d(2)
        prev = width
    layers["avgpool"] = nn.AdaptiveAvgPool2d(4)
    layers["flatten"] = nn.Flatten()
    layers["fc"] = nn.Linear(prev * 16, fc)
    layers["relu_fc"] = nn.ReLU(inplace=True)
    net = nn.Sequential(layers)
    declare_levels(net, [*(f"conv{i}" for i in range(1, len(convs) + 1)), "fc"])  # before each ReLU
    return net, fc


@register_model("cnn_small", min_size=2)
def cnn_small(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """Quickstart CNN for 8x8 digits / tiny synthetic images: conv16, conv32, pool, FC128 (d=128)."""
    return _small_cnn(in_channels, [16, 32], 128)


@register_model("cnn_small_wide", min_size=2)
def cnn_small_wide(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """Wider quickstart CNN: conv32, conv64, pool, FC256 (d=256); member of ``small_hetero``."""
    return _small_cnn(in_channels, [32, 64], 256)


@register_model("cnn_small_deep", min_size=2)
def cnn_small_deep(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """Deeper, narrower quickstart CNN: conv16, conv32, pool, conv32, FC64 (d=64); in ``small_hetero``."""
    return _small_cnn(in_channels, [16, 32, 32], 64)


# ------------------------------------------------------------------------------ LeNet-style 5x5 CNNs


def _lenet_trunk(in_channels: int, image_size: int, c1: int, c2: int) -> tuple[OrderedDict, int]:
    """conv5x5(c1) ReLU maxpool2, conv5x5(c2) ReLU maxpool2, flatten (no padding)."""
    s = conv_out(conv_out(image_size, 5), 2, 2)
    s = conv_out(conv_out(s, 5), 2, 2)
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(in_channels, c1, 5),
        relu1=nn.ReLU(inplace=True),
        pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(c1, c2, 5),
        relu2=nn.ReLU(inplace=True),
        pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
    )
    return layers, c2 * s * s


# FedSSA Table 3 (paper Appendix E): (Conv2 channels, FC1 width); Conv1 = 5x5x16, FC2 (rep) = 500.
FEDSSA_CNNS: dict[int, tuple[int, int]] = {
    1: (32, 2000),
    2: (16, 2000),
    3: (32, 1000),
    4: (32, 800),
    5: (32, 500),
}


def _fedssa_cnn(in_channels: int, image_size: int, c2: int, fc1: int) -> tuple[nn.Module, int]:
    layers, flat = _lenet_trunk(in_channels, image_size, 16, c2)
    layers["fc1"] = nn.Linear(flat, fc1)
    layers["relu3"] = nn.ReLU(inplace=True)
    layers["fc2"] = nn.Linear(fc1, 500)
    layers["relu4"] = nn.ReLU(inplace=True)
    return nn.Sequential(layers), 500


def _register_fedssa(k: int) -> None:
    c2, fc1 = FEDSSA_CNNS[k]

    def build(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        return _fedssa_cnn(in_channels, image_size, c2, fc1)

    build.__doc__ = (
        f"FedSSA CNN-{k} (Table 3): conv5x5x16, pool, conv5x5x{c2}, pool, FC{fc1}, FC500 = rep (d=500); "
        "head = FC3."
    )
    build.__name__ = f"fedssa_cnn{k}"
    register_model(f"fedssa_cnn{k}", min_size=16)(build)


for _k in FEDSSA_CNNS:
    _register_fedssa(_k)


@register_model("fedavg_cnn", min_size=16)
def fedavg_cnn(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """FedAvg / PFLlib ``FedAvgCNN``: conv5x5x32, pool, conv5x5x64, pool, FC512 (d=512).

    Flatten dim 1600 at 32x32, 1024 at 28x28, 10816 at 64x64
    (docs/algorithms/fedl2g.md, The 4-layer CNN; docs/algorithms/fedcross.md, Model architectures).
    """
    layers, flat = _lenet_trunk(in_channels, image_size, 32, 64)
    layers["fc1"] = nn.Linear(flat, 512)
    layers["relu3"] = nn.ReLU(inplace=True)
    return nn.Sequential(layers), 512
