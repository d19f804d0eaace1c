"""From one dataset to N client shards: the federation a run trains on.

Convention (the same for every algorithm, so results compare):

1. The train pool is ``bundle.train``. If ``data.partition.long_tail_rho`` is set it is first thinned
   to the long-tail profile (FedSC's LT setting; the test sets stay balanced).
2. The pool is partitioned among ``data.num_clients`` clients with ``data.partition``.
3. Each client's share of ``n`` samples is split by ``data.split`` into local train / val / test,
   stratified by class inside the client: test gets ``round(n * test)``, val its share of the rest
   (within one of ``n * val``), train the remainder. So a client's local test set follows its own train
   distribution, as the personalised-FL papers evaluate (FedSSA 8:1:1, FedL2G 0.75/0.25).
4. The global test set (for algorithms with a global model) is the dataset's official test split.

Everything is a pure function of (dataset, config, seed): the partition and each client's split use
their own random streams derived from the seed, so the same seed builds the same federation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedray.platform.config import ConfigError, DataConfig
from fedray.platform.data.datasets import ArrayDataset, DatasetBundle
from fedray.platform.data.partition import (
    SPLIT_STREAM,
    SUBSET_STREAM,
    partition,
    stratified_split,
    stream_rng,
)

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class ClientShard:
    """One client's data: local train, val (may be empty) and test splits."""

    client_id: int
    train: ArrayDataset
    val: ArrayDataset
    test: ArrayDataset


@dataclass
class Federation:
    """All client shards plus what models and evaluation need to know about the data."""

    shards: list[ClientShard]
    global_test: ArrayDataset  # the dataset's official test split, for global models
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str]

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def train_histogram(self) -> np.ndarray:
        """``[num_clients, num_classes]`` counts of each class in each client's train split."""
        return np.stack([np.bincount(s.train.y.numpy(), minlength=self.num_classes) for s in self.shards])

    def histogram_table(self) -> pd.DataFrame:
        """One row per client: client, n_train, n_val, n_test, then train counts per class name."""
        import pandas as pd

        table = pd.DataFrame(
            {
                "client": [s.client_id for s in self.shards],
                "n_train": [len(s.train) for s in self.shards],
                "n_val": [len(s.val) for s in self.shards],
                "n_test": [len(s.test) for s in self.shards],
            }
        )
        counts = pd.DataFrame(self.train_histogram(), columns=list(self.class_names))
        return pd.concat([table, counts], axis=1)


def build_federation(bundle: DatasetBundle, cfg: DataConfig, seed: int) -> Federation:
    """Partition ``bundle.train`` among clients and split each share (see the module docstring)."""
    pool = bundle.train
    if cfg.train_subset is not None and cfg.train_subset < len(pool):
        # a stratified random subset of the training pool (e.g. the 10k-image benchmark)
        fraction = cfg.train_subset / len(pool)
        keep, _ = stratified_split(pool.y.numpy(), (fraction, 1 - fraction), stream_rng(seed, SUBSET_STREAM))
        pool = pool.subset(np.sort(keep))
    labels = pool.y.numpy()
    parts = partition(labels, cfg.partition, cfg.num_clients, bundle.num_classes, seed)
    ratios = (cfg.split.train, cfg.split.val, cfg.split.test)
    shards = []
    for client_id, idx in enumerate(parts):
        train, val, test = stratified_split(labels[idx], ratios, stream_rng(seed, SPLIT_STREAM, client_id))
        if len(train) == 0:
            raise ConfigError(
                f"client {client_id} has no training samples ({len(idx)} samples after "
                f"data.partition.kind={cfg.partition.kind} and data.split.train={cfg.split.train}); "
                "use fewer clients, a larger data.partition.min_samples or a larger data.split.train"
            )
        shards.append(
            ClientShard(
                client_id=client_id,
                train=pool.subset(idx[train]),
                val=pool.subset(idx[val]),
                test=pool.subset(idx[test]),
            )
        )
    return Federation(
        shards=shards,
        global_test=bundle.test,
        num_classes=bundle.num_classes,
        in_channels=bundle.in_channels,
        image_size=bundle.image_size,
        mean=bundle.mean,
        std=bundle.std,
        class_names=list(bundle.class_names),
    )
