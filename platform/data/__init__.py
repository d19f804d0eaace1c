"""Data layer: datasets, partitioners, per-client splits and partition statistics.

Pure functions of (dataset, config, seed); no Ray and no Lightning here.
"""

from fedray.platform.data.datasets import (
    ArrayDataset,
    DatasetBundle,
    channel_stats,
    check_data,
    dataset_info,
    known_datasets,
    load_dataset,
    normalize,
)
from fedray.platform.data.federation import ClientShard, Federation, build_federation
from fedray.platform.data.partition import (
    apply_plan,
    dirichlet,
    iid,
    long_tail,
    partition,
    shamsian,
    shamsian_plan,
    shards,
    stratified_split,
)
from fedray.platform.data.stats import histogram_heatmap

__all__ = [
    "ArrayDataset",
    "ClientShard",
    "DatasetBundle",
    "Federation",
    "apply_plan",
    "build_federation",
    "channel_stats",
    "check_data",
    "dataset_info",
    "dirichlet",
    "histogram_heatmap",
    "iid",
    "known_datasets",
    "load_dataset",
    "long_tail",
    "normalize",
    "partition",
    "shamsian",
    "shamsian_plan",
    "shards",
    "stratified_split",
]
