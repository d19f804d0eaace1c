"""The author API: everything an algorithm module imports from fedray, in one place.

    from fedray.platform.api import AlgorithmConfig, ClientModule, Payload, Server, register

An algorithm is a :class:`Server` (in the Coordinator) and a :class:`ClientModule` (a LightningModule
trained in a worker) that exchange payloads, plus an :class:`AlgorithmConfig` registered under its
name. The helpers are the tensor functions several algorithms share, written once; an algorithm's own
random draws come from streams it declares by name (:func:`stream`, :mod:`fedray.platform.seeds`), and
:class:`Metrics` names what the platform records (an algorithm's training loss is ``Metrics.LOSS_TRAIN``).
The rules of the contract are checked by the platform (:mod:`.contract`), each failure a one-line
:class:`ContractError`.
"""

from fedray.platform.api.algorithm import (
    ClientContext,
    ClientModule,
    Payload,
    Server,
    ServerContext,
    batch_loader,
    client_optimizer,
    cpu_state,
)
from fedray.platform.api.averaging import RunningMean, unweighted_models, weighted_average, weighted_models
from fedray.platform.api.frozen import flat_state, frozen_call
from fedray.platform.api.header import header_rows, load_header_rows
from fedray.platform.api.prototypes import class_prototypes, eval_pass, masked_mean, scatter_rows
from fedray.platform.api.registry import register
from fedray.platform.api.views import check_views_fit, crop_flip_views
from fedray.platform.config import (
    AlgorithmConfig,
    ExperimentConfig,
    client_count,
    clients_per_round,
    round_count,
)
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError, ContractError
from fedray.platform.models import FedModel
from fedray.platform.seeds import numpy_rng, seed_of, stream, torch_generator
from fedray.platform.tracking.names import Metrics

__all__ = [
    "AlgorithmConfig",
    "ArrayDataset",
    "ClientContext",
    "ClientModule",
    "ConfigError",
    "ContractError",
    "ExperimentConfig",
    "FedModel",
    "Metrics",
    "Payload",
    "RunningMean",
    "Server",
    "ServerContext",
    "batch_loader",
    "check_views_fit",
    "class_prototypes",
    "client_count",
    "client_optimizer",
    "clients_per_round",
    "cpu_state",
    "crop_flip_views",
    "eval_pass",
    "flat_state",
    "frozen_call",
    "header_rows",
    "load_header_rows",
    "masked_mean",
    "numpy_rng",
    "register",
    "round_count",
    "scatter_rows",
    "seed_of",
    "stream",
    "torch_generator",
    "unweighted_models",
    "weighted_average",
    "weighted_models",
]
