"""Decoding image files into uint8 arrays: the code every file-based image source shares.

Images are decoded with PIL to RGB (always 3 channels) in the order given, resized (bilinear) to a
square side when they differ, on a few threads when there are many.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.errors import ConfigError, first_line

Listing = tuple[list[str], np.ndarray]  # image paths in id order, and their labels
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")
PARALLEL_MIN_FILES = 4096  # below this many images, threads cost more than they save


def class_dirs(split_dir: Path) -> list[str]:
    """Sorted class folder names (hidden folders skipped): the class index is the position here."""
    if not split_dir.is_dir():
        return []
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def image_files(folder: str) -> list[str]:
    """Sorted image file paths of one folder (hidden files and other extensions skipped)."""
    names = sorted(
        e.name
        for e in os.scandir(folder)
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.name.startswith(".")
    )
    return [os.path.join(folder, n) for n in names]


def image_side(path: str) -> int:
    """Width of an image (PIL reads only the header)."""
    from PIL import Image

    with Image.open(path) as im:
        return int(im.size[0])


def decode_files(paths: Sequence[str], size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode images to RGB uint8 ``[n, size, size, 3]``, resizing any that differ. A file that will
    not decode is a ConfigError naming it."""
    from PIL import Image

    out = np.empty((len(paths), size, size, 3), dtype=np.uint8) if out is None else out
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                rgb = im.convert("RGB")
                if rgb.size != (size, size):
                    rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
                out[i] = np.asarray(rgb)
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for a truncated or foreign file
            raise ConfigError(f"{path}: not a readable image ({first_line(e)})") from e
    return out


def decode_parallel(paths: Sequence[str], size: int) -> np.ndarray:
    """Decode on a few threads, each filling its own slice of one array. Threads, not processes: PIL
    releases the GIL while it decodes and resizes, and a forked process pool can deadlock in a process
    that already runs threads (torch's, Ray's, MLflow's)."""
    workers = min(8, os.cpu_count() or 1)
    if len(paths) < PARALLEL_MIN_FILES or workers < 2:
        return decode_files(paths, size)
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    bounds = np.linspace(0, len(paths), workers * 4 + 1).astype(int)
    with ThreadPoolExecutor(workers, thread_name_prefix="fedray-decode") as pool:
        jobs = [
            pool.submit(decode_files, paths[a:b], size, out[a:b])
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        for job in jobs:  # the first failure, in file order; the pool's exit waits for the others
            job.result()
    return out


def decode_to_tensor(paths: Sequence[str], size: int) -> torch.Tensor:
    """``[n, 3, size, size]`` uint8, channels first as the bundle keeps images."""
    return torch.from_numpy(decode_parallel(paths, size)).permute(0, 3, 1, 2).contiguous()


def relative_paths(paths: Sequence[str], root: Path) -> list[str]:
    """``/``-separated paths relative to ``root`` (``train/<class>/<file>``): the samples' names."""
    return [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]


def decode_splits(
    listings: dict[str, Listing], class_names: list[str], size: int, root: Path | None = None
) -> dict[str, Any]:
    """The cache payload of listed image files: per split the images at ``size`` and the labels, and,
    given ``root``, each sample's path relative to it (for split files that name samples by path)."""
    out: dict[str, Any] = {"class_names": class_names}
    for split, (paths, labels) in listings.items():
        out[f"{split}_x"] = decode_to_tensor(paths, size)
        out[f"{split}_y"] = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        if root is not None:
            out[f"{split}_paths"] = relative_paths(paths, root)
    return out
