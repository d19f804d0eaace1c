"""``synthetic``: class prototypes plus Gaussian noise, 1 channel, built from a fixed seed.

Tiny, fast and learnable in a few epochs: the fixture of the platform's tests. ``data.synthetic_*``
set how big and how hard.
"""

from __future__ import annotations

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle, fixed_split, make_bundle, split_size
from fedray.platform.data.sources.base import Source, SourceInfo, register_source
from fedray.platform.errors import ConfigError

TEST_FRACTION = 0.2
SEED = 20240611  # fixed: the synthetic set is the same for every experiment seed
NOISE_STD = 48.0  # pixel noise around the class prototype (0..255 scale)


def synthetic_arrays(num_samples: int, num_classes: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced labels and images = class prototype (uniform noise image) + N(0, 48^2), clipped to uint8."""
    rng = np.random.default_rng(SEED)
    prototypes = rng.uniform(0, 255, size=(num_classes, 1, image_size, image_size))
    y = rng.permutation(np.arange(num_samples) % num_classes)
    noise = rng.normal(0.0, NOISE_STD, size=(num_samples, 1, image_size, image_size))
    x = np.clip(np.rint(prototypes[y] + noise), 0, 255).astype(np.uint8)
    return x, y.astype(np.int64)


class Synthetic(Source):
    name = "synthetic"
    doc = "class prototypes plus noise from a fixed seed (data.synthetic_*): the tests' fixture"

    def check(self, cfg: DataConfig) -> None:
        if cfg.synthetic_samples < 2 * cfg.synthetic_classes:
            raise ConfigError(
                f"data.synthetic_samples={cfg.synthetic_samples}: need at least 2 per class "
                f"(data.synthetic_classes={cfg.synthetic_classes})"
            )

    def info(self, cfg: DataConfig) -> SourceInfo:
        return SourceInfo(cfg.synthetic_classes, in_channels=1, image_size=cfg.synthetic_image_size)

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        test = split_size(cfg.synthetic_samples, TEST_FRACTION)
        return cfg.synthetic_samples - test, test

    def load(self, cfg: DataConfig) -> DatasetBundle:
        n = cfg.synthetic_classes
        x, y = synthetic_arrays(cfg.synthetic_samples, n, cfg.synthetic_image_size)
        train, test = fixed_split(x, y, TEST_FRACTION, seed=SEED)
        return make_bundle(self.name, train, test, [f"class_{c}" for c in range(n)])


register_source(Synthetic())
