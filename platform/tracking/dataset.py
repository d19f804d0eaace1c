"""The data a run trained on, as an MLflow dataset input (the runs table's Dataset column).

Name: ``<dataset>-<partition>-<N>c`` (``cifar10-dir0.1-100c``). Digest: a hash of the split itself
(every client's train/val/test sample ids, the global test set, the image paths of a subset and the
input normalisation), so two runs on the same split show the same digest whatever algorithm or
config produced them, and any change to who holds which sample changes it. Source: the folder the
data was read from, or the loader of an embedded dataset. Profile: the partition in numbers.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mlflow.data.dataset import Dataset
from mlflow.data.dataset_source import DatasetSource
from mlflow.types import Schema, TensorSpec

from fedray.platform.data.split_file import federation_to_split
from fedray.platform.tracking.mlflow_run import partition_label
from fedray.platform.tracking.names import Tags

if TYPE_CHECKING:
    from fedray.platform.config import ExperimentConfig
    from fedray.platform.data import Federation


class FederationDataset(Dataset):
    """A federation (client shards + global test set) described by its split, not its pixels."""

    def __init__(
        self, source: DatasetSource, name: str, digest: str, profile: dict[str, Any], schema: Schema
    ) -> None:
        self._profile = profile
        self._schema = schema
        super().__init__(source=source, name=name, digest=digest)

    def _compute_digest(self) -> str:  # always given
        raise NotImplementedError

    @property
    def profile(self) -> dict[str, Any]:
        return self._profile

    @property
    def schema(self) -> Schema:
        return self._schema

    def to_dict(self) -> dict[str, str]:
        out = super().to_dict()
        out["profile"] = json.dumps(self._profile)
        out["schema"] = json.dumps({"mlflow_tensorspec": self._schema.to_json()})
        return out


def split_digest(fed: Federation, split: dict[str, Any] | None = None) -> str:
    """12 hex digits of SHA-256 over the split's sample assignment and the input normalisation;
    ``split``: ``federation_to_split(fed)`` when the caller has it already."""
    split = federation_to_split(fed) if split is None else split
    identity = {
        k: split.get(k)
        for k in ("dataset", "num_train", "num_test", "clients", "global_test", "subset_paths")
    }
    identity["normalize"] = fed.provenance.get("normalize")
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def dataset_source(cfg: ExperimentConfig) -> DatasetSource:
    """The folder the data came from (``data.root``), else the embedded dataset's loader."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    if cfg.data.root:
        with warnings.catch_warnings():  # MLflow registers its local-folder source twice, then warns that
            warnings.filterwarnings("ignore", "The specified dataset source can be interpreted")  # both match
            return resolve_dataset_source(str(Path(cfg.data.root).expanduser().resolve()))
    return CodeDatasetSource(
        {Tags.SOURCE_DATASET: cfg.data.dataset, Tags.SOURCE_LOADER: "built in, no download"}
    )


def _spread(counts: np.ndarray) -> dict[str, float]:
    return {"min": int(counts.min()), "median": float(np.median(counts)), "max": int(counts.max())}


def federation_profile(fed: Federation, cfg: ExperimentConfig) -> dict[str, Any]:
    train = np.array([len(s.train) for s in fed.shards])
    test = np.array([len(s.test) for s in fed.shards])
    classes = (fed.train_histogram() > 0).sum(1)
    p = cfg.data.partition
    return {
        "partition": p.kind,
        **({"alpha": p.alpha} if p.kind == "dirichlet" else {}),
        **({"classes_per_client": p.classes_per_client} if p.kind in ("shards", "shamsian") else {}),
        "clients": fed.num_clients,
        "classes": fed.num_classes,
        fed.modality: list(fed.sample_shape),  # "image": [C, H, W], or "text": [tokens]
        "train_samples": int(train.sum()),
        "train_per_client": _spread(train),
        "test_per_client": _spread(test),
        "classes_per_client_seen": {"min": int(classes.min()), "max": int(classes.max())},
        "global_test_samples": len(fed.global_test),
        "split": [cfg.data.split.train, cfg.data.split.val, cfg.data.split.test],
        "convention": cfg.data.split.convention,
        "normalize": cfg.data.normalize,
    }


def federation_dataset(
    fed: Federation, cfg: ExperimentConfig, split: dict[str, Any] | None = None
) -> FederationDataset:
    dtype = np.dtype(np.int64) if fed.modality == "text" else np.dtype(np.uint8)
    schema = Schema(
        [
            TensorSpec(dtype, (-1, *fed.sample_shape), fed.modality),
            TensorSpec(np.dtype(np.int64), (-1,), "label"),
        ]
    )
    name = f"{cfg.data.dataset}-{partition_label(cfg)}-{fed.num_clients}c"
    return FederationDataset(
        dataset_source(cfg), name, split_digest(fed, split), federation_profile(fed, cfg), schema
    )
