"""What a model reads: square images ``[B, C, S, S]`` (float) or token ids ``[B, L]`` (int64).

    InputShape.image(channels=1, size=28)     # FEMNIST
    InputShape.text(vocab=80, length=80)      # Shakespeare: 80 characters, 80-character windows

The zoo builds a model for an :class:`InputShape` (:func:`~fedray.platform.models.registry.build_for`)
and refuses one whose modality the architecture does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fedray.platform.errors import ConfigError

Modality = Literal["image", "text"]
MODALITIES: tuple[Modality, ...] = ("image", "text")
# how an error line names what a model reads / what the data holds
DESCRIBE: dict[str, str] = {"image": "images", "text": "text (token ids)"}


def _positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class InputShape:
    """One sample's shape: ``channels`` x ``size`` x ``size`` images, or ``size`` token ids in
    ``[0, vocab)`` (id 0 may be padding; the data decides). Unused fields stay 0."""

    modality: Modality
    channels: int = 0  # images: colour channels
    size: int = 0  # images: the side in pixels; text: the sequence length
    vocab: int = 0  # text: the number of token ids

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ConfigError(f"input modality must be one of {', '.join(MODALITIES)}, got {self.modality!r}")
        used = ("channels", "size") if self.modality == "image" else ("vocab", "size")
        for name in ("channels", "size", "vocab"):
            value = getattr(self, name)
            what = "sequence length" if name == "size" and self.modality == "text" else name
            if name in used:
                _positive(f"{self.modality} input: {what}", value)
            elif value != 0:
                raise ConfigError(f"{self.modality} input: {name} is not used, got {value!r}")

    @classmethod
    def image(cls, channels: int, size: int) -> InputShape:
        return cls("image", channels=channels, size=size)

    @classmethod
    def text(cls, vocab: int, length: int) -> InputShape:
        return cls("text", size=length, vocab=vocab)

    @property
    def length(self) -> int:
        """The sequence length of text (``size``)."""
        return self.size

    def example(self, batch: int = 2, device: torch.device | str | None = None) -> Tensor:
        """A zero batch of this shape: float32 ``[B, C, S, S]`` or int64 ``[B, L]`` (id 0), for probing."""
        _positive("example batch", batch)
        if self.modality == "image":
            return torch.zeros(batch, self.channels, self.size, self.size, dtype=torch.float32, device=device)
        return torch.zeros(batch, self.size, dtype=torch.int64, device=device)

    def __str__(self) -> str:
        if self.modality == "image":
            return f"{self.channels}x{self.size}x{self.size} images"
        return f"text of {self.size} token ids from a vocabulary of {self.vocab}"
