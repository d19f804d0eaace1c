"""Algorithm registry: the platform finds algorithms by name and never imports one directly.

An algorithm module in ``algorithms/`` registers itself with the ``@register`` decorator on its
config dataclass::

    @register("fedprox", server=FedAvgServer, client=FedProxClient)
    @dataclass
    class FedProxConfig(AlgorithmConfig):
        mu: float = 0.01

``get(name)`` imports the algorithm modules on first use, so ``algorithm=fedprox`` on the command
line is all a user types. Third-party packages can register under the ``fedray.algorithms``
entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from importlib import metadata

from fedray.platform.api.algorithm import ClientModule, Server
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.errors import ConfigError, ContractError


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    server_cls: type[Server]
    client_cls: type[ClientModule]
    config_cls: type
    module: str


_REGISTRY: dict[str, AlgorithmSpec] = {}
_LOADED = False
_CHECKED: set[str] = set()


def register(name: str, *, server: type, client: type):
    """Class decorator for an algorithm's config dataclass; binds name -> (server, client, config)."""

    def wrap(config_cls: type) -> type:
        if not issubclass(config_cls, AlgorithmConfig):
            raise TypeError(f"algorithm {name!r}: {config_cls.__name__} must derive from AlgorithmConfig")
        key = name.lower()
        existing = _REGISTRY.get(key)
        if existing is not None and existing.module != config_cls.__module__:
            raise ValueError(
                f"algorithm {key!r} registered twice ({existing.module}, {config_cls.__module__})"
            )
        _REGISTRY[key] = AlgorithmSpec(key, server, client, config_cls, config_cls.__module__)
        return config_cls

    return wrap


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    algorithms = importlib.import_module("fedray.algorithms")
    for info in pkgutil.iter_modules(algorithms.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"fedray.algorithms.{info.name}")
    for ep in metadata.entry_points(group="fedray.algorithms"):
        ep.load()
    _LOADED = True


def available() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def registered_by(package: str) -> list[str]:
    """The algorithms registered by modules of ``package`` (``"fedray.algorithms"``: the shipped ones),
    listed without checking their contract (a listing, not a use)."""
    _load_all()
    return sorted(k for k, spec in _REGISTRY.items() if spec.module.startswith(f"{package}."))


def get(name: str) -> AlgorithmSpec:
    key = name.lower()
    if key not in _REGISTRY:
        _load_all()
    if key not in _REGISTRY:
        raise ConfigError(f"algorithm={name!r}: unknown algorithm; available: {', '.join(available())}")
    spec = _REGISTRY[key]
    if key not in _CHECKED:  # the contract rules a client class shows in its code, once per process
        check = getattr(spec.client_cls, "check_contract", None)
        if check is None:
            raise ContractError(
                f"algorithm {key!r}: its client {spec.client_cls.__name__} must derive from "
                "fedray.platform.api.algorithm.ClientModule"
            )
        check(key)
        _CHECKED.add(key)
    return spec
