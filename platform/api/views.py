"""Augmented views an algorithm draws itself: FedClassAvg's two views of every training image, for its
supervised contrastive loss. The platform's own augmentation (``data.augment``) is one view per batch,
drawn by the worker before ``training_step``; an algorithm that needs several draws them here, from its
own seeded stream, and asks for ``data.augment=none`` so no image is augmented twice."""

from __future__ import annotations

import torch
from torch import Tensor

from fedray.platform.config import ExperimentConfig
from fedray.platform.data.augment import crop_flip
from fedray.platform.data.sources import source_of
from fedray.platform.errors import ConfigError


def crop_flip_views(x: Tensor, gen: torch.Generator, views: int = 2, flip: bool = True) -> list[Tensor]:
    """``views`` independent ``crop_flip`` draws of the batch ``x [B, C, H, W]``, in order, from ``gen``,
    padded by an eighth of the image's side (CIFAR's 4 pixels of 32; 1 pixel of the 8x8 digits, which
    a 4-pixel shift would push half out of the frame); mirrored half the time with ``flip``, never
    without (digits: a mirrored 2 is no 2)."""
    pad = max(1, min(x.shape[-2:]) // 8)
    return [crop_flip(x, gen, pad, 0.5 if flip else 0.0) for _ in range(views)]


def check_views_fit(cfg: ExperimentConfig) -> None:
    """One-line ConfigError unless the run's data are images the algorithm may crop and flip itself:
    an image dataset, and no augmentation by the worker (each view would be cropped twice)."""
    algorithm, data = cfg.algorithm, cfg.data
    modality = source_of(data).modality
    if modality != "image":
        raise ConfigError(
            f"algorithm {algorithm!r} draws cropped and flipped views of its images, and {data.dataset} is "
            f"{modality}: use an image dataset"
        )
    if data.augment != "none":
        raise ConfigError(
            f"data.augment={data.augment}: algorithm {algorithm!r} crops and flips its own views of every "
            "image; use data.augment=none"
        )
