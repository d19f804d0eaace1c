"""fedray's catalog: the algorithms, datasets and models that exist, handed to config validation.

The config layer imports none of them (:class:`~fedray.platform.config.Catalog`); this module,
above the registries, assembles them, and :func:`build_config` / :func:`load_config` are what a
caller uses to turn a YAML and overrides into a validated :class:`ExperimentConfig`.
"""

from __future__ import annotations

from pathlib import Path

from fedray.platform.api import registry
from fedray.platform.config import Catalog, ExperimentConfig, loading
from fedray.platform.data import known_datasets, split_file_num_clients
from fedray.platform.data.federation import parse_normalize
from fedray.platform.data.sources import SourceInfo, dataset_info, source_of, unknown_dataset
from fedray.platform.errors import ConfigError
from fedray.platform.models import (
    DESCRIBE,
    InputShape,
    is_known_model,
    model_group,
    model_modality,
    models_reading,
    require_embeddings,
    require_image_size,
)
from fedray.platform.models.checks import require_homogeneous, shared_feature_dim


def check_dataset(cfg: ExperimentConfig) -> None:
    if cfg.data.dataset not in known_datasets():
        raise unknown_dataset(cfg.data.dataset)
    parse_normalize(cfg.data.normalize)


def check_model(cfg: ExperimentConfig) -> None:
    if not is_known_model(cfg.model.group):
        raise ConfigError(
            f"model.group={cfg.model.group!r}: unknown model or group; see README 'Configuration' for the zoo"
        )


def check_model_reads_the_data(cfg: ExperimentConfig) -> None:
    """Image models on image data, sequence models on token ids: one line naming the models that fit."""
    data = source_of(cfg.data).modality
    model = model_modality(cfg.model.group)
    if model != data:
        raise ConfigError(
            f"model.group={cfg.model.group!r} reads {model}, data.dataset={cfg.data.dataset} is "
            f"{DESCRIBE[data]}; "
            f"{data} models: {', '.join(models_reading(data))}"
        )


def check_pretrained_embeddings(cfg: ExperimentConfig) -> None:
    """Word vectors from the data (Sent140 with ``data.leaf.glove``) need a model that takes them."""
    if source_of(cfg.data).provides_embeddings(cfg.data):
        try:
            require_embeddings(cfg.model.group)
        except ConfigError as err:
            raise ConfigError(f"data.leaf.glove={cfg.data.leaf.glove!r}: {err}") from None


def check_model_fits_the_images(cfg: ExperimentConfig) -> None:
    """Each model of the group takes the data's image size (``data.image_size`` included)."""
    if source_of(cfg.data).modality != "image":
        return
    try:
        size = dataset_info(cfg.data).image_size
    except ConfigError:  # data not there yet: the data section's own check names what is missing
        return
    for arch in dict.fromkeys(model_group(cfg.model.group)):
        require_image_size(arch, size)  # what building the model would say, before Ray


def model_inputs(info: SourceInfo) -> InputShape:
    """What the zoo's models read on a dataset of this shape."""
    if info.modality == "text":
        return InputShape.text(info.vocab_size, info.seq_len)
    return InputShape.image(info.in_channels, info.image_size)


def check_model_needs(cfg: ExperimentConfig) -> None:
    """What the algorithm declares it needs of the model group (``WHOLE_MODEL``, shared features)."""
    algo = cfg.algo
    if algo is None:
        return
    if algo.WHOLE_MODEL:
        require_homogeneous(cfg.algorithm, cfg.model.group)
    if algo.needs_shared_features() and len(set(model_group(cfg.model.group))) > 1:
        try:
            info = dataset_info(cfg.data)
        except ConfigError:  # data not there yet: the data section's own check names what is missing
            return
        shared_feature_dim(cfg.algorithm, cfg.model.group, model_inputs(info), info.num_classes)


CATALOG = Catalog(
    algorithm_config=lambda name: registry.get(name).config_cls,
    algorithm_names=registry.available,
    split_file_clients=split_file_num_clients,
    checks=(
        check_dataset,
        check_model,
        check_model_reads_the_data,
        check_pretrained_embeddings,
        check_model_needs,
        check_model_fits_the_images,
    ),
)


def build_config(raw: dict) -> ExperimentConfig:
    """A nested dict -> a validated :class:`ExperimentConfig`, against fedray's registries."""
    return loading.build_config(raw, CATALOG)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """A YAML file (or none: the defaults) plus ``key=value`` overrides -> a validated config."""
    return loading.load_config(path, overrides, CATALOG)
