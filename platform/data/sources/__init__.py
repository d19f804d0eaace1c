"""Dataset sources: one module per dataset (or per family read by one code), behind a registry.

``data.dataset`` names a source; :func:`load_dataset` reads it into a
:class:`~fedray.platform.data.bundle.DatasetBundle`. Adding a dataset is a module here that registers a
:class:`~fedray.platform.data.sources.base.Source`, imported below, and a test.

``data.image_size`` (images only) is the side every image of the run has: sources that decode files
(image folders, Flowers102, Tiny-ImageNet) decode straight to it, under a cache key that names it;
:func:`load_dataset` resizes the others' arrays after loading
(:func:`~fedray.platform.data.bundle.at_image_size`), and :func:`dataset_info` reports it.
"""

from dataclasses import replace

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle, at_image_size
from fedray.platform.data.sources import (  # noqa: F401
    digits,
    femnist,
    flowers102,
    imagefolder,
    sent140,
    shakespeare,
    synthetic,
    tiny_imagenet,
    torchvision_sets,
)
from fedray.platform.data.sources.base import (
    Source,
    SourceInfo,
    default_root,
    known_datasets,
    register_source,
    source_of,
    unknown_dataset,
)
from fedray.platform.errors import ConfigError


def check_source(cfg: DataConfig) -> Source:
    """The dataset is known, its files are where the config says, and the options fit its modality."""
    source = source_of(cfg)
    source.check(cfg)
    if source.modality != "image":
        if cfg.image_size is not None:
            raise ConfigError(
                f"data.image_size={cfg.image_size}: {cfg.dataset} is {source.modality} (token ids), and "
                "data.image_size resizes images; leave it unset (null)"
            )
        if cfg.augment != "none":
            raise ConfigError(
                f"data.augment={cfg.augment}: {cfg.dataset} is {source.modality}, and augmentation crops "
                "and flips images; use data.augment=none"
            )
        if cfg.normalize != "dataset":
            raise ConfigError(
                f"data.normalize={cfg.normalize!r}: {cfg.dataset} is {source.modality} (token ids), "
                "which are not normalised; use data.normalize=dataset"
            )
    return source


def load_dataset(cfg: DataConfig) -> DatasetBundle:
    """Load (or read from cache) the dataset named by ``cfg.dataset``, its images at ``data.image_size``
    when that is set."""
    return at_image_size(check_source(cfg).load(cfg), cfg.image_size)


def dataset_info(cfg: DataConfig) -> SourceInfo:
    """The dataset's classes, modality and shape (the image side the run will see), without loading
    any data."""
    info = source_of(cfg).info(cfg)
    if cfg.image_size is not None and info.modality == "image":
        return replace(info, image_size=cfg.image_size)
    return info


def official_sizes(cfg: DataConfig) -> tuple[int, int]:
    """``(train, test)`` sizes from metadata only."""
    return source_of(cfg).sizes(cfg)


__all__ = [
    "Source",
    "SourceInfo",
    "check_source",
    "dataset_info",
    "default_root",
    "known_datasets",
    "load_dataset",
    "official_sizes",
    "register_source",
    "source_of",
    "unknown_dataset",
]
