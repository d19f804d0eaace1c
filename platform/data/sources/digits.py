"""``digits``: scikit-learn's embedded 8x8 digits (1797 images, no download).

It has no official test split, so a fixed stratified 80/20 split (seed 0, independent of the
experiment seed) makes one; the global test set is then the same for every run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle, fixed_split, make_bundle, split_size
from fedray.platform.data.sources.base import Source, SourceInfo, register_source

TEST_FRACTION = 0.2
SIZE = 1797


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(images [1797, 8, 8] in 0..16, labels)``.

    Reads the CSV that ships inside scikit-learn directly: ``import sklearn.datasets`` pulls in SciPy and
    costs seconds, the file takes milliseconds. Falls back to ``load_digits`` if the file moved.
    """
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec else []
    csv = [Path(loc) / "datasets" / "data" / "digits.csv.gz" for loc in locations]
    if csv and csv[0].is_file():
        table = np.loadtxt(csv[0], delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


class Digits(Source):
    name = "digits"
    doc = "scikit-learn's 8x8 digits, embedded (no download); fixed 80/20 split"

    def info(self, cfg: DataConfig) -> SourceInfo:
        return SourceInfo(10, in_channels=1, image_size=8)

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        test = split_size(SIZE, TEST_FRACTION)
        return SIZE - test, test

    def load(self, cfg: DataConfig) -> DatasetBundle:
        images, labels = digits_arrays()
        # pixel values are 0..16: stretch them to the usual 0..255 range
        x = np.rint(images * (255.0 / 16.0)).astype(np.uint8)[:, None]
        train, test = fixed_split(x, labels, TEST_FRACTION, seed=0)
        return make_bundle(self.name, train, test, [str(d) for d in range(10)])


register_source(Digits())
