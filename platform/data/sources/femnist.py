"""``femnist``: LEAF's FEMNIST, handwritten 28x28 characters of 62 classes, one client per writer.

The files are LEAF's (``leaf/data/femnist``, read by :mod:`.leaf`): each sample's ``x`` is the 784 pixels
of a 28x28 grey image, row by row, as floats in [0, 1] (LEAF's ``data_to_json.py``: the NIST scan shrunk
to 28x28, divided by 255), and ``y`` its class: ``0``-``9`` the digits, ``10``-``35`` ``A``-``Z``,
``36``-``61`` ``a``-``z`` (LEAF's ``relabel_class``), which are the class names here.

Stored as uint8 ``[N, 1, 28, 28]`` = ``round(x * 255)``, LEAF's grey levels back. Colours are LEAF's,
not inverted: NIST's forms are dark ink on white paper, so the background is 1.0 (255) and the strokes
are near 0, the reverse of MNIST. LEAF's reference CNN reads them that way.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.sources.base import SourceInfo, register_source
from fedray.platform.data.sources.leaf import Arrays, LeafSource, SampleError, int_labels

SIDE = 28
CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)  # LEAF's 62, in label order


class FEMNIST(LeafSource):
    name = "femnist"
    task = "femnist"
    doc = "LEAF's FEMNIST: 28x28 handwritten digits and letters (62 classes), one client per writer; data.root=leaf/data/femnist/data"

    def info(self, cfg: DataConfig) -> SourceInfo:
        return SourceInfo(len(CLASSES), in_channels=1, image_size=SIDE)

    def class_names(self) -> list[str]:
        return list(CLASSES)

    def convert(self, xs: list[Any], ys: list[Any]) -> Arrays:
        y = int_labels(ys, len(CLASSES), "FEMNIST's classes 0..61")
        if not xs:
            return np.zeros((0, 1, SIDE, SIDE), dtype=np.uint8), y
        try:
            pixels = np.asarray(xs, dtype=np.float64)
        except (ValueError, TypeError):
            pixels = None
        if pixels is None or pixels.shape != (len(xs), SIDE * SIDE):
            raise SampleError(f"x is not {SIDE * SIDE} numbers per sample (LEAF's 28x28 pixels, row by row)")
        low, high = float(pixels.min()), float(pixels.max())
        if low < 0 or high > 1:
            raise SampleError(f"pixel values span [{low:g}, {high:g}], LEAF's lie in [0, 1]")
        return np.rint(pixels * 255).astype(np.uint8).reshape(-1, 1, SIDE, SIDE), y


register_source(FEMNIST())
