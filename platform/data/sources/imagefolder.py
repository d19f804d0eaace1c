"""``imagefolder``: ``root/train/<class>/*.jpg|png`` and ``root/test/<class>/...``.

Classes are the sorted folder names of ``train/``; each split is listed class by class (file names
sorted), which is the sample-id order, and the bundle carries every sample's relative path
(``train/<class>/<file>``) so split files can name samples by file. Every image is resized (bilinear)
to ``data.image_size`` when that is set, else to the size of the first training image when it differs.
The cache key is ``imagefolder`` when ``data.image_size`` is unset (the files of earlier versions stay
valid), ``imagefolder-<side>`` when it is set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle
from fedray.platform.data.cache import bundle_from_payload, cached
from fedray.platform.data.image_files import (
    IMAGE_EXTENSIONS,
    Listing,
    class_dirs,
    decode_splits,
    image_files,
    image_side,
    relative_paths,
)
from fedray.platform.data.sources.base import Source, SourceInfo, register_source
from fedray.platform.errors import ConfigError


def split_dirs(cfg: DataConfig) -> tuple[Path, Path]:
    if not cfg.root:
        raise ConfigError(
            "data.root is not set: data.dataset=imagefolder needs data.root=<dir with train/ and test/>"
        )
    root = Path(cfg.root).expanduser()
    train_dir, test_dir = root / "train", root / "test"
    for d in (train_dir, test_dir):
        if not d.is_dir() or not class_dirs(d):
            raise ConfigError(
                f"data.root={cfg.root!r}: imagefolder needs {d.name}/<class>/<images> under the root "
                f"({d} has no class folders)"
            )
    return train_dir, test_dir


def listing(split_dir: Path, classes: list[str]) -> Listing:
    """Image paths of a split in decode (and cache) order, sorted by class then name, and their labels."""
    index = {c: i for i, c in enumerate(classes)}
    paths: list[str] = []
    labels: list[int] = []
    for c in class_dirs(split_dir):
        files = image_files(str(split_dir / c))
        paths += files
        labels += [index[c]] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def first_image_side(train_dir: Path, classes: list[str]) -> int:
    for c in classes:
        files = image_files(str(train_dir / c))
        if files:
            return image_side(files[0])
    raise ConfigError(f"data.root={str(train_dir.parent)!r}: train/ holds no images")


class ImageFolder(Source):
    name = "imagefolder"
    doc = "data.root/train/<class>/<images> and test/<class>/<images> (JPEG, PNG, ...)"

    def check(self, cfg: DataConfig) -> None:
        train_dir, test_dir = split_dirs(cfg)
        extra = sorted(set(class_dirs(test_dir)) - set(class_dirs(train_dir)))
        if extra:
            raise ConfigError(
                f"data.root={cfg.root!r}: test/ has classes that train/ lacks: {', '.join(extra[:5])}"
            )

    def info(self, cfg: DataConfig) -> SourceInfo:
        train_dir = split_dirs(cfg)[0]
        classes = class_dirs(train_dir)
        return SourceInfo(len(classes), in_channels=3, image_size=self.side(cfg, train_dir, classes))

    def side(self, cfg: DataConfig, train_dir: Path, classes: list[str]) -> int:
        """``data.image_size``, else the first training image's side (read from its header)."""
        return cfg.image_size or first_image_side(train_dir, classes)

    def cache_key(self, cfg: DataConfig) -> str:
        return self.name if cfg.image_size is None else f"{self.name}-{cfg.image_size}"

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        train_dir, test_dir = split_dirs(cfg)
        n_train, n_test = (
            sum(len(image_files(str(d / c))) for c in class_dirs(d)) for d in (train_dir, test_dir)
        )
        return n_train, n_test

    def listings(self, cfg: DataConfig) -> tuple[dict[str, Listing], list[str]]:
        train_dir, test_dir = split_dirs(cfg)
        classes = class_dirs(train_dir)
        return {"train": listing(train_dir, classes), "test": listing(test_dir, classes)}, classes

    def sample_paths(self, cfg: DataConfig) -> list[str]:
        listings, _ = self.listings(cfg)
        files = listings["train"][0] + listings["test"][0]
        return relative_paths(files, Path(cfg.root or "").expanduser())

    def load(self, cfg: DataConfig) -> DatasetBundle:
        listings, classes = self.listings(cfg)
        if not listings["train"][0]:
            raise ConfigError(
                f"data.root={cfg.root!r}: train/ holds no images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        root = Path(cfg.root or "").expanduser()
        size = self.side(cfg, root / "train", classes)
        files = listings["train"][0] + listings["test"][0]
        payload = cached(
            root, self.cache_key(cfg), files, lambda: decode_splits(listings, classes, size, root)
        )
        # caches written before paths were stored get them from the listing (the same files, same order)
        return bundle_from_payload(self.name, payload, relative_paths(files, root))


register_source(ImageFolder())
