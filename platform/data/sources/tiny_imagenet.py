"""``tiny_imagenet``: Tiny-ImageNet-200 as Stanford's ``tiny-imagenet-200.zip`` unpacks.

Layout (``data.root`` is the folder holding ``tiny-imagenet-200/``, or that folder itself)::

    tiny-imagenet-200/wnids.txt                  the 200 WordNet ids, one a line
    tiny-imagenet-200/words.txt                  optional: "<wnid>\\t<names>", the class names
    tiny-imagenet-200/train/<wnid>/images/*.JPEG 500 a class
    tiny-imagenet-200/val/images/*.JPEG          10000
    tiny-imagenet-200/val/val_annotations.txt    "<file>\\t<wnid>\\t<x0>\\t<y0>\\t<x1>\\t<y1>" a line

Classes are the wnids sorted, the order torchvision's ``ImageFolder`` gives ``train/`` (which PFLlib's and
HtFLlib's ``generate_TinyImagenet.py`` read; torchvision has no Tiny-ImageNet class of its own). The
order of ``wnids.txt`` itself is not sorted, and is not used. Names come from ``words.txt`` when it is
there, else they are the wnids.

Splits. The official train set is ``train/`` (class by class, file names sorted: 100000 images), the
official test set is ``val/`` in ``val_annotations.txt``'s order (10000). ``test/`` has no labels and is
not read. The images are 64x64; ``data.image_size`` decodes them to another side (bilinear). The
decoded arrays are cached under ``tiny_imagenet-<side>``, fingerprinted by the images, ``wnids.txt``,
``val_annotations.txt`` and ``words.txt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle
from fedray.platform.data.cache import bundle_from_payload, cached
from fedray.platform.data.image_files import class_dirs, decode_splits, image_files
from fedray.platform.data.sources.base import (
    Source,
    SourceInfo,
    missing_file,
    nested_root,
    register_source,
)
from fedray.platform.errors import ConfigError

FOLDER = "tiny-imagenet-200"
WNIDS = "wnids.txt"
WORDS = "words.txt"
ANNOTATIONS = "val/val_annotations.txt"
NATIVE_SIZE = 64
LAYOUT = "dir holding tiny-imagenet-200/ (or that folder itself) with wnids.txt, train/ and val/"
NEEDS = "wnids.txt, train/<wnid>/images/ and val/images/ with val/val_annotations.txt"


def base_dir(cfg: DataConfig) -> Path:
    return nested_root(cfg, FOLDER, LAYOUT)


def read_classes(cfg: DataConfig, base: Path) -> list[str]:
    """The wnids of ``wnids.txt``, sorted: the class index is the position here."""
    path = base / WNIDS
    if not path.is_file():
        raise missing_file(cfg, path, NEEDS)
    wnids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not wnids:
        raise ConfigError(f"{path}: lists no wnid")
    seen: set[str] = set()
    for wnid in wnids:
        if wnid in seen:
            raise ConfigError(f"{path}: {wnid} is listed twice")
        seen.add(wnid)
    return sorted(wnids)


def read_names(base: Path, classes: list[str]) -> list[str]:
    """Each class's names from ``words.txt`` ("<wnid>\\t<names>"), the wnid where it has none."""
    path = base / WORDS
    words: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            wnid, _, names = line.partition("\t")
            if names.strip():
                words[wnid.strip()] = names.strip()
    return [words.get(wnid, wnid) for wnid in classes]


def train_folders(cfg: DataConfig, base: Path, classes: list[str]) -> list[Path]:
    """``train/<wnid>/images`` of every class, in class order; a missing or unlisted one is an error."""
    train = base / "train"
    if not train.is_dir():
        raise missing_file(cfg, train, NEEDS)
    unlisted = sorted(set(class_dirs(train)) - set(classes))
    if unlisted:
        raise ConfigError(f"{train / unlisted[0]}: a class folder that {base / WNIDS} does not list")
    folders = [train / wnid / "images" for wnid in classes]
    for wnid, folder in zip(classes, folders):
        if not folder.is_dir():
            raise ConfigError(f"{folder} is missing ({WNIDS} lists {wnid}; {cfg.dataset} needs {NEEDS})")
    return folders


@dataclass(frozen=True)
class Annotation:
    line: int  # in val_annotations.txt, 1-based
    file: str  # under val/images/
    label: int


def read_annotations(cfg: DataConfig, base: Path, classes: list[str]) -> list[Annotation]:
    """``val/val_annotations.txt`` in its order: each val image and its class. Names the line of a
    malformed entry, an unknown wnid or a repeated file."""
    path = base / ANNOTATIONS
    if not path.is_file():
        raise missing_file(cfg, path, NEEDS)
    index = {wnid: i for i, wnid in enumerate(classes)}
    out: list[Annotation] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip():
            raise ConfigError(f"{path}:{number}: expected '<file>\\t<wnid>\\t<bbox>', got {line[:60]!r}")
        file, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise ConfigError(f"{path}:{number}: {file} is labelled {wnid}, which {WNIDS} does not list")
        if file in seen:
            raise ConfigError(f"{path}:{number}: {file} is annotated twice")
        seen.add(file)
        out.append(Annotation(number, file, index[wnid]))
    if not out:
        raise ConfigError(f"{path}: annotates no image")
    return out


class TinyImageNet(Source):
    name = "tiny_imagenet"
    doc = (
        "Tiny-ImageNet-200 (tiny-imagenet-200/: wnids.txt, train/, val/) under data.root; "
        "train / val; 64x64, data.image_size resizes"
    )

    def side(self, cfg: DataConfig) -> int:
        return cfg.image_size or NATIVE_SIZE

    def check(self, cfg: DataConfig) -> None:
        base = base_dir(cfg)
        classes = read_classes(cfg, base)
        train_folders(cfg, base, classes)
        annotations = read_annotations(cfg, base, classes)
        images = base / "val" / "images"
        if not images.is_dir():
            raise missing_file(cfg, images, NEEDS)
        present = {Path(p).name for p in image_files(str(images))}
        for a in annotations:
            if a.file not in present:
                raise ConfigError(
                    f"{base / ANNOTATIONS}:{a.line}: {images / a.file} does not exist (or is not an image)"
                )

    def info(self, cfg: DataConfig) -> SourceInfo:
        classes = read_classes(cfg, base_dir(cfg))
        return SourceInfo(len(classes), in_channels=3, image_size=self.side(cfg))

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        base = base_dir(cfg)
        classes = read_classes(cfg, base)
        n_train = sum(len(image_files(str(f))) for f in train_folders(cfg, base, classes))
        return n_train, len(read_annotations(cfg, base, classes))

    def cache_key(self, cfg: DataConfig) -> str:
        return f"{self.name}-{self.side(cfg)}"

    def load(self, cfg: DataConfig) -> DatasetBundle:
        base = base_dir(cfg)
        classes = read_classes(cfg, base)
        train_paths: list[str] = []
        train_labels: list[int] = []
        for label, folder in enumerate(train_folders(cfg, base, classes)):
            files = image_files(str(folder))
            train_paths += files
            train_labels += [label] * len(files)
        if not train_paths:
            raise ConfigError(f"data.root={cfg.root!r}: {base / 'train'} holds no images")
        annotations = read_annotations(cfg, base, classes)
        test_paths = [str(base / "val" / "images" / a.file) for a in annotations]
        listings = {
            "train": (train_paths, np.asarray(train_labels, dtype=np.int64)),
            "test": (test_paths, np.asarray([a.label for a in annotations], dtype=np.int64)),
        }
        names, size = read_names(base, classes), self.side(cfg)

        metadata = [base / WNIDS, base / ANNOTATIONS, base / WORDS]
        files = [*train_paths, *test_paths, *(str(p) for p in metadata if p.is_file())]
        payload = cached(base, self.cache_key(cfg), files, lambda: decode_splits(listings, names, size))
        return bundle_from_payload(self.name, payload)


register_source(TinyImageNet())
