"""torchvision's residual blocks with the sum before their last ReLU passing through a ``pre_relu``
identity, where FedRCL reads a level (``declare_levels``). Imported only by a torchvision ResNet's
builder: torchvision costs every process that imports it a third of a second."""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from fedray.platform.models.base import PreActivation


class LevelBasicBlock(BasicBlock):
    """``BasicBlock``'s forward, step for step, with ``pre_relu`` before the last ReLU."""

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(self.pre_relu(out))


class LevelBottleneck(Bottleneck):
    """``Bottleneck``'s forward, step for step, with ``pre_relu`` before the last ReLU."""

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(self.pre_relu(out))


def expose_pre_activation(block: nn.Module) -> None:
    """Turn a built torchvision block into its level-exposing twin in place: the same modules and
    weights (nothing is drawn again), one ``pre_relu`` identity more."""
    twins: dict[type, type[nn.Module]] = {BasicBlock: LevelBasicBlock, Bottleneck: LevelBottleneck}
    block.__class__ = twins[type(block)]
    block.pre_relu = PreActivation()
