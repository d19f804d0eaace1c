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
from dataclasses import dataclass
from importlib import metadata

from fedray.platform.api.algorithm import ClientModule, Server
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.config.algorithm_names import (
    ENTRY_POINT_GROUP,
    SHIPPED_PACKAGE,
    note_registered,
    shipped_modules,
)
from fedray.platform.errors import ContractError, unknown_algorithm


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
    """Class decorator for an algorithm's config dataclass; binds name -> (server, client, config).
    A registration that breaks a rule raises :class:`ContractError` as its module is imported: one
    line from the CLI, not a traceback through the registry's imports."""

    def wrap(config_cls: type) -> type:
        if not issubclass(config_cls, AlgorithmConfig):
            raise ContractError(f"algorithm {name!r}: {config_cls.__name__} must derive from AlgorithmConfig")
        key = name.lower()
        module = config_cls.__module__
        if module.startswith(f"{SHIPPED_PACKAGE}.") and module != f"{SHIPPED_PACKAGE}.{key}":
            # configs are checked against the shipped modules' names before any algorithm loads
            raise ContractError(
                f"algorithm {key!r} is registered in {module}: a shipped algorithm lives in "
                f"algorithms/{key}.py, the module named after it"
            )
        existing = _REGISTRY.get(key)
        if existing is not None and existing.module != module:
            raise ContractError(f"algorithm {key!r} registered twice ({existing.module}, {module})")
        _REGISTRY[key] = AlgorithmSpec(key, server, client, config_cls, module)
        note_registered(key)
        return config_cls

    return wrap


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    for name in shipped_modules():
        importlib.import_module(f"{SHIPPED_PACKAGE}.{name}")
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
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
        raise unknown_algorithm(name, available())
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
