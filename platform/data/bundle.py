"""What every dataset source produces: samples in memory, the dataset's metadata, and its own clients.

Sample ids. Every sample of a dataset has a fixed integer id, the order its source loads them in
(deterministic): id ``i < len(bundle.train)`` is official-train sample ``i``, id ``len(bundle.train) + j``
is official-test sample ``j``. Split files (:mod:`fedray.platform.data.split_file`) and the federation's
shards refer to samples by these ids.

Two modalities:

- ``image``: ``x`` uint8 ``[N, C, H, W]`` (a quarter of the memory of float32, cheap to ship through
  Ray); :func:`normalize` turns a batch into float32 with the bundle's per-channel mean and std.
- ``text``: ``x`` int64 token ids ``[N, L]`` (``0`` pads), read by the sequence models of the zoo;
  ``vocab_size`` ids in all. There is nothing to normalise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedray.platform.data.partition import stratified_split

Modality = Literal["image", "text"]


@dataclass
class ArrayDataset:
    """Samples and labels held in memory: ``x`` images ``[N, C, H, W]`` (uint8, or float32 once
    :func:`normalize`d) or token ids ``[N, L]`` (int64); ``y`` int64 ``[N]``."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        image = self.x.dim() == 4 and (self.x.dtype == torch.uint8 or self.x.is_floating_point())
        tokens = self.x.dim() == 2 and self.x.dtype == torch.int64
        if not (image or tokens):
            raise ValueError(
                "x must be uint8 or float images [N, C, H, W] or int64 token ids [N, L], got "
                f"{self.x.dtype} {tuple(self.x.shape)}"
            )
        if self.y.dtype != torch.int64 or self.y.dim() != 1 or len(self.y) != len(self.x):
            raise ValueError(f"y must be int64 [N={len(self.x)}], got {self.y.dtype} {tuple(self.y.shape)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray | Sequence[int] | torch.Tensor) -> ArrayDataset:
        """A copy holding the samples at ``idx`` (in that order)."""
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ArrayDataset(self.x[index], self.y[index])


@dataclass
class NaturalClient:
    """One of a dataset's own clients (a LEAF writer, speaking role or user): its sample ids."""

    name: str
    train_ids: np.ndarray  # official-train ids
    # its own held-out samples, as sample ids (official test: from len(train) on); empty when it has none
    test_ids: np.ndarray
    num_samples: int  # the user's samples as LEAF counts them before its split (what its -k filters on)


@dataclass
class DatasetBundle:
    """A dataset ready to partition: the train pool, the official test split and its metadata."""

    name: str
    train: ArrayDataset
    test: ArrayDataset  # the official test split: the global test pool
    num_classes: int
    in_channels: int  # images; 0 for text
    image_size: int  # H == W; 0 for text
    mean: tuple[float, ...]  # per channel, in [0, 1] units; () for text
    std: tuple[float, ...]
    class_names: list[str] = field(default_factory=list)
    # image folders: each sample's path relative to data.root, train then test (the sample-id order)
    paths: list[str] | None = None
    modality: Modality = "image"
    seq_len: int = 0  # text: tokens per sample
    vocab_size: int = 0  # text: token ids 0..vocab_size-1 (0 pads)
    embeddings: torch.Tensor | None = None  # text: pretrained vectors [vocab_size, dim] (GloVe), or None
    clients: list[NaturalClient] | None = None  # the dataset's own federation (data.partition.kind=natural)

    @property
    def num_samples(self) -> int:
        """Train plus test: the size of the sample-id space."""
        return len(self.train) + len(self.test)

    def labels(self) -> np.ndarray:
        """Labels of all samples in id order (train then test)."""
        return np.concatenate([self.train.y.numpy(), self.test.y.numpy()])

    def take(self, ids: np.ndarray | Sequence[int]) -> ArrayDataset:
        """The samples with these ids (train then test, see the module docstring), in that order."""
        ids = np.asarray(ids, dtype=np.int64)
        n_train = len(self.train)
        in_test = ids >= n_train
        if not in_test.any():
            return self.train.subset(ids)
        if in_test.all():
            return self.test.subset(ids - n_train)
        x = torch.empty((len(ids), *self.train.x.shape[1:]), dtype=self.train.x.dtype)
        y = torch.empty(len(ids), dtype=torch.int64)
        for mask, part, offset in ((~in_test, self.train, 0), (in_test, self.test, n_train)):
            where = torch.from_numpy(np.flatnonzero(mask))
            index = torch.from_numpy(ids[mask] - offset)
            x[where], y[where] = part.x[index], part.y[index]
        return ArrayDataset(x, y)


def make_bundle(
    name: str,
    train: ArrayDataset,
    test: ArrayDataset,
    class_names: list[str],
    *,
    vocab_size: int = 0,
) -> DatasetBundle:
    """The bundle of decoded samples: shape and (images) per-channel statistics read off ``train``."""
    if train.x.dim() == 2:
        return DatasetBundle(
            name=name,
            train=train,
            test=test,
            num_classes=len(class_names),
            in_channels=0,
            image_size=0,
            mean=(),
            std=(),
            class_names=class_names,
            modality="text",
            seq_len=train.x.shape[1],
            vocab_size=vocab_size,
        )
    mean, std = channel_stats(train.x)
    return DatasetBundle(
        name=name,
        train=train,
        test=test,
        num_classes=len(class_names),
        in_channels=train.x.shape[1],
        image_size=train.x.shape[2],
        mean=mean,
        std=std,
        class_names=class_names,
    )


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 images ``[..., C, H, W]`` -> float32 ``(x / 255 - mean) / std`` per channel; token ids
    (int64) come back as they are."""
    if x.dtype == torch.int64:
        return x
    m = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (x.to(torch.float32) / 255.0 - m) / s


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std in [0, 1] units of uint8 images ``[N, C, H, W]``.

    Works from a 256-bin histogram per channel, so it is exact in float64 without materialising a
    float copy of the dataset (150M values for CIFAR).
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = torch.bincount(x[:, c].reshape(-1), minlength=256).numpy().astype(np.float64)
        total = max(hist.sum(), 1.0)
        mean = float(hist @ values / total)
        var = float(hist @ (values - mean) ** 2 / total)
        means.append(mean)
        stds.append(float(np.sqrt(var)) if var > 0 else 1.0)  # a constant channel: leave it unscaled
    return tuple(means), tuple(stds)


RESIZE_CHUNK = 2048  # images resized per step: bounds the float copy (CIFAR at 64x64: 100 MB a step)


def resize_images(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 images ``[N, C, H, W]`` -> uint8 ``[N, C, size, size]``: bilinear (``align_corners=False``,
    antialiased when shrinking, as PIL's resize of the file sources), rounded to the nearest integer.
    The input comes back as it is when it already has that side."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    out = torch.empty((len(x), x.shape[1], size, size), dtype=torch.uint8)
    for start in range(0, len(x), RESIZE_CHUNK):
        part = x[start : start + RESIZE_CHUNK].to(torch.float32)
        part = F.interpolate(part, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out[start : start + RESIZE_CHUNK] = part.round_().clamp_(0, 255).to(torch.uint8)
    return out


def at_image_size(bundle: DatasetBundle, size: int | None) -> DatasetBundle:
    """The bundle with its images resized to ``size`` (``data.image_size``) and its per-channel
    statistics recomputed; the bundle itself when ``size`` is None, it already has that side, or it is
    text. Sources that decode files decode straight to the size; this serves the array sources."""
    if size is None or bundle.modality != "image" or tuple(bundle.train.x.shape[-2:]) == (size, size):
        return bundle
    train = ArrayDataset(resize_images(bundle.train.x, size), bundle.train.y)
    test = ArrayDataset(resize_images(bundle.test.x, size), bundle.test.y)
    mean, std = channel_stats(train.x)
    return replace(bundle, train=train, test=test, image_size=size, mean=mean, std=std)


def split_size(n: int, fraction: float) -> int:
    """Samples a split of ``fraction`` gets out of ``n`` (round half up, as the splitter does)."""
    return int(np.floor(n * fraction + 0.5))


def fixed_split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """A stratified train/test split from a fixed seed (not the experiment's): for sources without an
    official test split, whose global test set must then be the same for every run."""
    train_idx, test_idx = stratified_split(y, (1 - test_fraction, test_fraction), np.random.default_rng(seed))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    return ArrayDataset(xt[train_idx], yt[train_idx]), ArrayDataset(xt[test_idx], yt[test_idx])
