"""Unpack a dataset archive once, outside the repository (the CIFAR-10 JPEGs ship as a .tar.gz)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from fedray.platform.errors import ConfigError

ARCHIVE_ENV = "FEDRAY_CIFAR10_ARCHIVE"


def cifar10_jpeg_archive(checkout: Path) -> Path:
    """Where the benchmarks and the slow tests look for the CIFAR-10 JPEG archive
    (``cifar10-jpeg.tar.gz``: ``train/<class>/*.jpg`` and ``test/<class>/*.jpg``):
    ``$FEDRAY_CIFAR10_ARCHIVE``, else ``.data/`` in the checkout (git-ignored)."""
    return Path(os.environ.get(ARCHIVE_ENV) or checkout / ".data" / "cifar10-jpeg.tar.gz").expanduser()


def unpack_image_archive(archive: str | Path, target: str | Path) -> Path:
    """Extract ``archive`` into ``target`` unless already done; return the folder holding ``train/``.

    Archives that wrap everything in one top folder are handled: the returned path is the folder
    that contains ``train/`` and ``test/``, ready for ``data.dataset=imagefolder data.root=...``.
    """
    archive, target = Path(archive), Path(target).expanduser()
    found = _tree_root(target)
    if found is not None:
        return found
    if not archive.is_file():
        raise ConfigError(f"image archive {str(archive)!r} does not exist")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    found = _tree_root(target)
    if found is None:
        raise ConfigError(f"{archive}: no train/ and test/ folders inside")
    return found


def _tree_root(folder: Path) -> Path | None:
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        return folder
    if folder.is_dir():
        for child in sorted(folder.iterdir()):
            if (child / "train").is_dir() and (child / "test").is_dir():
                return child
    return None
