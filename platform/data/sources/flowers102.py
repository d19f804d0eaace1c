"""``flowers102``: the Oxford 102 Flowers files, laid out as torchvision keeps them (``flowers-102/``).

Layout (``data.root`` is the folder holding ``flowers-102/``, torchvision's root, or ``flowers-102/``
itself)::

    flowers-102/jpg/image_00001.jpg ... image_08189.jpg   102flowers.tgz, unpacked
    flowers-102/imagelabels.mat   labels: each image's class (1..102), in image-id order
    flowers-102/setid.mat         trnid, valid, tstid: the 1-based image ids of the three splits

Splits. The official train set is ``trnid`` then ``valid`` (1020 + 1020 images in the official files),
the official test set ``tstid`` (6149), each in its file's order (torchvision's order within a split):
that is the sample-id order. Labels are ``labels - 1`` (0-based, as torchvision's); the classes are
those the labels file uses (0..max), named with torchvision's ``Flowers102.classes`` when the installed
torchvision has them, else ``"0"``, ``"1"``, ...

FedL2G (paper §4; PFLlib/HtFLlib's ``generate_Flowers102.py``) merges train, val and test and resizes
every image to 64x64: ``data.split.convention=merged`` merges the pool, and ``data.image_size`` is the
side every image is decoded to (default 64 for this source), bilinear and without keeping the aspect,
as torchvision's ``Resize((64, 64))`` on a PIL image. The decoded arrays are cached under
``flowers102-<side>``, fingerprinted by the images and both ``.mat`` files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.io import loadmat

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle
from fedray.platform.data.cache import bundle_from_payload, cached
from fedray.platform.data.image_files import decode_splits
from fedray.platform.data.sources.base import (
    Source,
    SourceInfo,
    missing_file,
    nested_root,
    register_source,
)
from fedray.platform.errors import ConfigError, first_line

FOLDER = "flowers-102"  # torchvision's folder under its root
LABELS = "imagelabels.mat"
SETID = "setid.mat"
IMAGES = "jpg"
SPLIT_KEYS = ("trnid", "valid", "tstid")  # torchvision's train, val, test
DEFAULT_SIZE = 64  # FedL2G / PFLlib: Resize((64, 64))
LAYOUT = "dir holding flowers-102/ (or flowers-102/ itself) with jpg/, imagelabels.mat and setid.mat"
NEEDS = "jpg/image_NNNNN.jpg, imagelabels.mat and setid.mat (torchvision's flowers-102/ layout)"


def image_name(image_id: int) -> str:
    """torchvision's file name of a 1-based image id."""
    return f"image_{image_id:05d}.jpg"


@dataclass(frozen=True)
class Meta:
    """What the two ``.mat`` files say."""

    labels: np.ndarray  # 0-based class of image id i + 1
    train_ids: np.ndarray  # 1-based image ids of the official train set: trnid, then valid
    test_ids: np.ndarray  # tstid

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1


def base_dir(cfg: DataConfig) -> Path:
    return nested_root(cfg, FOLDER, LAYOUT)


def read_mat(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named arrays of a ``.mat`` file as 1-D int64 arrays of positive integers; one-line errors."""
    try:
        mat = loadmat(path, squeeze_me=True)
    except Exception as err:  # scipy raises ValueError, MatReadError, OSError, ... for a foreign file
        raise ConfigError(f"{path}: not a readable .mat file ({first_line(err)})") from err
    out = {}
    for key in keys:
        if key not in mat:
            raise ConfigError(f"{path}: no {key!r} array (Flowers102's {path.name} holds {', '.join(keys)})")
        values = np.atleast_1d(np.asarray(mat[key])).ravel()
        if (
            values.dtype.kind not in "iuf"
            or not len(values)
            or not np.array_equal(values, np.round(values))
            or values.min() < 1
        ):
            raise ConfigError(f"{path}: {key!r} must be positive integers (1-based), got {values[:5]!r}")
        out[key] = values.astype(np.int64)
    return out


def read_meta(cfg: DataConfig, base: Path) -> Meta:
    """Labels and splits from the two ``.mat`` files only (no image is listed or decoded)."""
    for name in (LABELS, SETID):
        if not (base / name).is_file():
            raise missing_file(cfg, base / name, NEEDS)
    labels = read_mat(base / LABELS, ("labels",))["labels"]
    ids = read_mat(base / SETID, SPLIT_KEYS)
    for key in SPLIT_KEYS:
        beyond = ids[key][ids[key] > len(labels)]
        if len(beyond):
            raise ConfigError(
                f"{base / SETID}: {key} names image {beyond[0]}, but {LABELS} labels {len(labels)} images"
            )
    train_ids = np.concatenate([ids["trnid"], ids["valid"]])
    every = np.concatenate([train_ids, ids["tstid"]])
    unique, counts = np.unique(every, return_counts=True)
    if (counts > 1).any():
        raise ConfigError(f"{base / SETID}: image {unique[counts > 1][0]} is listed more than once")
    return Meta(labels - 1, train_ids, ids["tstid"])


def class_names(num_classes: int) -> list[str]:
    """torchvision's flower names when the installed version has them (no download), else numbers."""
    import torchvision.datasets as tvd

    names = getattr(tvd.Flowers102, "classes", None)
    if isinstance(names, (list, tuple)) and len(names) >= num_classes:
        return [str(n) for n in names[:num_classes]]
    return [str(c) for c in range(num_classes)]


class Flowers102(Source):
    name = "flowers102"
    doc = (
        "Oxford 102 Flowers in torchvision's flowers-102/ (jpg/, imagelabels.mat, setid.mat) under "
        "data.root; train+val / test; data.image_size default 64"
    )

    def side(self, cfg: DataConfig) -> int:
        return cfg.image_size or DEFAULT_SIZE

    def check(self, cfg: DataConfig) -> None:
        base = base_dir(cfg)
        meta = read_meta(cfg, base)
        images = base / IMAGES
        if not images.is_dir():
            raise missing_file(cfg, images, NEEDS)
        present = {e.name for e in os.scandir(images) if e.is_file()}
        n_images = sum(1 for n in present if n.startswith("image_") and n.endswith(".jpg"))
        if n_images != len(meta.labels):
            raise ConfigError(
                f"{base / LABELS}: labels {len(meta.labels)} images, but {images} holds {n_images} "
                "image_NNNNN.jpg files"
            )
        for image_id in np.concatenate([meta.train_ids, meta.test_ids]):
            if image_name(image_id) not in present:
                raise ConfigError(
                    f"{images / image_name(image_id)} is missing ({SETID} lists image {image_id})"
                )

    def info(self, cfg: DataConfig) -> SourceInfo:
        meta = read_meta(cfg, base_dir(cfg))
        return SourceInfo(meta.num_classes, in_channels=3, image_size=self.side(cfg))

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        meta = read_meta(cfg, base_dir(cfg))
        return len(meta.train_ids), len(meta.test_ids)

    def cache_key(self, cfg: DataConfig) -> str:
        return f"{self.name}-{self.side(cfg)}"

    def load(self, cfg: DataConfig) -> DatasetBundle:
        base = base_dir(cfg)
        meta = read_meta(cfg, base)
        size = self.side(cfg)
        splits = {"train": meta.train_ids, "test": meta.test_ids}
        paths = {s: [str(base / IMAGES / image_name(i)) for i in ids] for s, ids in splits.items()}

        listings = {s: (paths[s], meta.labels[ids - 1]) for s, ids in splits.items()}
        names = class_names(meta.num_classes)

        files = [*paths["train"], *paths["test"], str(base / LABELS), str(base / SETID)]
        payload = cached(base, self.cache_key(cfg), files, lambda: decode_splits(listings, names, size))
        return bundle_from_payload(self.name, payload)


register_source(Flowers102())
