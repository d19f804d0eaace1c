"""Tiny on-disk copies of image datasets' formats, for tests: real .mat files (scipy), real JPEGs (PIL),
real annotation text. Each writer's record (labels, splits, colours) comes from the pure functions
beside it, so a test checks what a source read against what was written, not against the files.

- :func:`write_flowers102`: torchvision's ``flowers-102/`` (``jpg/``, ``imagelabels.mat``, ``setid.mat``)
- :func:`write_tiny_imagenet`: ``tiny-imagenet-200/`` (``wnids.txt``, ``words.txt``, ``train/``, ``val/``)
- :func:`write_mnist`: torchvision's ``MNIST/raw/`` idx files
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import scipy.io
from PIL import Image


def class_colour(label: int) -> tuple[int, int, int]:
    """A solid RGB colour per class, far apart for the first few (a JPEG keeps it within a few units)."""
    return ((37 + 97 * label) % 256, (211 + 59 * label) % 256, (23 + 151 * label) % 256)


def solid_jpeg(path: Path, colour: tuple[int, int, int], size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=95)


# ------------------------------------------------------------------------------------------ Flowers102


def flowers102_labels(classes: int = 4, per_class: int = 5) -> np.ndarray:
    """``imagelabels.mat``'s ``labels``: the 1-based class of image id ``i + 1``, shuffled (fixed seed)
    so that image ids are not grouped by class."""
    labels = np.repeat(np.arange(1, classes + 1), per_class)
    return np.random.default_rng(102).permutation(labels).astype(np.uint8)


def flowers102_splits(classes: int = 4, per_class: int = 5) -> dict[str, np.ndarray]:
    """``setid.mat``: of each class, the first image id goes to ``trnid``, the second to ``valid``, the
    rest to ``tstid`` (as the official files: train and val 10 a class, test the rest); each list
    written highest id first, so reading them sorted would show."""
    labels = flowers102_labels(classes, per_class)
    trn, val, tst = [], [], []
    for c in range(1, classes + 1):
        ids = np.flatnonzero(labels == c) + 1
        trn.append(ids[:1])
        val.append(ids[1:2])
        tst.append(ids[2:])
    lists = {"trnid": trn, "valid": val, "tstid": tst}
    return {k: np.sort(np.concatenate(v))[::-1].astype(np.uint16) for k, v in lists.items()}


def write_flowers102(
    root: Path, classes: int = 4, per_class: int = 5, *, image_size: tuple[int, int] = (40, 30)
) -> Path:
    """``root/flowers-102/``: ``jpg/image_00001.jpg ...`` (each a solid :func:`class_colour`, width x
    height ``image_size``), ``imagelabels.mat`` and ``setid.mat``. Returns the ``flowers-102`` folder."""
    if per_class < 3:
        raise ValueError("per_class >= 3: one train, one val and at least one test image a class")
    base = Path(root) / "flowers-102"
    labels = flowers102_labels(classes, per_class)
    for image_id, label in enumerate(labels, 1):
        solid_jpeg(base / "jpg" / f"image_{image_id:05d}.jpg", class_colour(int(label) - 1), image_size)
    scipy.io.savemat(base / "imagelabels.mat", {"labels": labels[None, :]})  # 1 x N, as the official file
    scipy.io.savemat(
        base / "setid.mat", {k: v[None, :] for k, v in flowers102_splits(classes, per_class).items()}
    )
    return base


# ------------------------------------------------------------------------------------------ Tiny-ImageNet


def tiny_imagenet_wnids(classes: int = 3) -> list[str]:
    """``wnids.txt`` in its own order: not sorted (the source sorts them)."""
    return [f"n{9_000_000 - 1111 * c:08d}" for c in range(classes)]


def tiny_imagenet_val(classes: int = 3, val_per_class: int = 2) -> list[tuple[str, str]]:
    """``val_annotations.txt``'s ``(file, wnid)`` rows in file order: classes interleaved, the file
    names numbered in row order (``val_0.JPEG``, ...)."""
    wnids = tiny_imagenet_wnids(classes)
    rows = [wnids[i % classes] for i in range(classes * val_per_class)]
    return [(f"val_{i}.JPEG", wnid) for i, wnid in enumerate(rows)]


def write_tiny_imagenet(
    root: Path,
    classes: int = 3,
    train_per_class: int = 4,
    val_per_class: int = 2,
    *,
    image_size: int = 64,
    words: bool = True,
) -> Path:
    """``root/tiny-imagenet-200/``: ``wnids.txt``, ``words.txt`` (when ``words``; with an unrelated wnid
    too, as the real file lists all of WordNet), ``train/<wnid>/images/<wnid>_<i>.JPEG`` and its
    ``<wnid>_boxes.txt``, ``val/images/val_<i>.JPEG`` with ``val/val_annotations.txt``, and an unlabelled
    ``test/images/``. Every image is a solid colour: :func:`class_colour` of its class's position in
    the sorted wnids. Returns the ``tiny-imagenet-200`` folder."""
    base = Path(root) / "tiny-imagenet-200"
    base.mkdir(parents=True)
    wnids = tiny_imagenet_wnids(classes)
    label = {w: i for i, w in enumerate(sorted(wnids))}
    side = (image_size, image_size)
    (base / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids))
    if words:
        lines = ["n00001740\tentity", *(f"{w}\tthing {w[-4:]}, object" for w in wnids)]
        (base / "words.txt").write_text("\n".join(lines) + "\n")
    for w in wnids:
        folder = base / "train" / w
        for i in range(train_per_class):
            solid_jpeg(folder / "images" / f"{w}_{i}.JPEG", class_colour(label[w]), side)
        (folder / f"{w}_boxes.txt").write_text(
            "".join(f"{w}_{i}.JPEG\t0\t0\t63\t63\n" for i in range(train_per_class))
        )
    rows = tiny_imagenet_val(classes, val_per_class)
    for file, w in rows:
        solid_jpeg(base / "val" / "images" / file, class_colour(label[w]), side)
    (base / "val" / "val_annotations.txt").write_text("".join(f"{f}\t{w}\t1\t2\t60\t61\n" for f, w in rows))
    solid_jpeg(base / "test" / "images" / "test_0.JPEG", (0, 0, 0), side)
    return base


# ------------------------------------------------------------------------------------------ MNIST


def write_idx(path: Path, array: np.ndarray) -> None:
    """MNIST's big-endian idx format: magic (type 0x08 = ubyte, ndim), then each dim, then the bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path, n_train: int = 30, n_test: int = 10, folder: str = "MNIST") -> Path:
    """torchvision's ``<root>/MNIST/raw/`` idx files: random 28x28 images, labels ``i % 10``. Returns
    the ``raw`` folder."""
    rng = np.random.default_rng(0)
    raw = Path(root) / folder / "raw"
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    return raw
