"""Unpack a dataset archive once, outside the repository (the CIFAR-10 JPEGs ship as a .tar.gz)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
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
    The archive is unpacked beside ``target`` and renamed into place whole, so an unpacking stopped
    part way (Ctrl-C, a full disk) never leaves a tree that reads as done with images missing, and
    two commands unpacking at once both end with the one tree.
    """
    archive, target = Path(archive), Path(target).expanduser()
    found = _tree_root(target)
    if found is not None:
        return found
    if not archive.is_file():
        raise ConfigError(f"image archive {str(archive)!r} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.unpacking."))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        if _tree_root(staging) is None:
            raise ConfigError(f"{archive}: no train/ and test/ folders inside")
        with contextlib.suppress(OSError):  # another command's tree got there first
            staging.rename(target)  # onto an empty folder too; never onto a non-empty one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    found = _tree_root(target)
    if found is None:
        raise ConfigError(f"{target} holds something other than an unpacked image archive; move it away")
    return found


def _tree_root(folder: Path) -> Path | None:
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        return folder
    if folder.is_dir():
        for child in sorted(folder.iterdir()):
            if (child / "train").is_dir() and (child / "test").is_dir():
                return child
    return None
