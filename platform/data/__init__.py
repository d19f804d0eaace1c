"""Data layer: dataset sources (one module each), partitioners, per-client splits, split files and partition statistics.

Pure functions of (dataset, config, seed); no Ray and no Lightning here.
"""

from fedray.platform.data.bundle import (
    ArrayDataset,
    DatasetBundle,
    NaturalClient,
    channel_stats,
    normalize,
)
from fedray.platform.data.federation import (
    ClientShard,
    Federation,
    build_federation,
    check_data,
    federation_from_file,
    federation_from_split,
)
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
from fedray.platform.data.sources import dataset_info, known_datasets, load_dataset
from fedray.platform.data.split_file import (
    federation_to_split,
    read_split_file,
    split_file_num_clients,
    write_split,
)
from fedray.platform.data.stats import histogram_heatmap, majority_baseline

__all__ = [
    "ArrayDataset",
    "ClientShard",
    "DatasetBundle",
    "Federation",
    "NaturalClient",
    "apply_plan",
    "build_federation",
    "channel_stats",
    "check_data",
    "dataset_info",
    "dirichlet",
    "federation_from_file",
    "federation_from_split",
    "federation_to_split",
    "histogram_heatmap",
    "iid",
    "known_datasets",
    "load_dataset",
    "long_tail",
    "majority_baseline",
    "normalize",
    "partition",
    "read_split_file",
    "shamsian",
    "shamsian_plan",
    "shards",
    "split_file_num_clients",
    "stratified_split",
    "write_split",
]
