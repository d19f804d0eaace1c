"""Loading an experiment config: YAML, dotted ``key=value`` overrides, and the registries' checks.

The registries (algorithms, datasets, models) live above this layer, so what validation needs of
them is handed in as a :class:`Catalog`; :mod:`fedray.platform.catalog` builds fedray's own.
Loading the registries imports torch and Lightning (about 6 s on a 2-core machine), so the command
line first reads a config with :func:`read_config`, which checks everything but the algorithm's
section, the dataset and the model without them: a misspelt key or a bad value is one line at once.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.config.algorithm_names import known_algorithm_names
from fedray.platform.config.schema import ExperimentConfig, build_dataclass, check_fields, validate
from fedray.platform.errors import ConfigError, unknown_algorithm


@dataclass(frozen=True)
class Catalog:
    """What config validation needs from the registries above the config layer."""

    algorithm_config: Callable[
        [str], type[AlgorithmConfig]
    ]  # name -> its config class; ConfigError if unknown
    algorithm_names: Callable[[], list[str]]  # every registered algorithm (their sections are skipped)
    split_file_clients: Callable[[str], int]  # a split file's number of clients
    checks: tuple[Callable[[ExperimentConfig], None], ...]  # dataset, model, what the algorithm requires


# keys whose value is text, never YAML: an IPv6 address such as [::1]:6379 would read as a flow list
VERBATIM_KEYS = {"ray.address"}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict with YAML-parsed values (``VERBATIM_KEYS`` as written)."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. rounds=30")
        key, raw = item.split("=", 1)
        try:
            if key.strip() in VERBATIM_KEYS:
                value = None if raw.strip() in ("null", "~") else unquoted(raw.strip())
            else:
                value = yaml.safe_load(raw) if raw != "" else ""
            put_dotted(tree, key, value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: {yaml_problem(err)}") from None
        except ConfigError as err:
            raise ConfigError(f"override {item!r}: {err}") from None
    return tree


def unquoted(text: str) -> str:
    """``text`` without one pair of surrounding quotes (the form YAML needed before)."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def dotted_tree(mapping: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"fedprox.mu": 0.1}`` (a YAML file's dotted keys) -> ``{"fedprox": {"mu": 0.1}}``, each value as
    the file gave it: ``"007"`` stays text and ``null`` None, as they would not through ``key=value``."""
    tree: dict[str, Any] = {}
    for key, value in mapping.items():
        try:
            put_dotted(tree, str(key), copy.deepcopy(value))  # the file's own mapping is left as it was
        except ConfigError as err:
            raise ConfigError(f"{where}: {key}: {err}") from None
    return tree


def put_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{part!r} is not a section")
    last = parts[-1]
    both = isinstance(value, dict) and isinstance(node.get(last), dict)  # fedprox: {...} and fedprox.mu
    node[last] = merge(node[last], value) if both else value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML parse error as one line: what is wrong and where (1-based line and column)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}not valid YAML ({problem})"


def load_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML mapping from ``path``; anything else one line that names the file as ``what``."""
    path = Path(path)
    name = f"{what} {str(path)!r}"
    if path.is_dir():
        raise ConfigError(f"{name} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"{name} does not exist")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{name}: cannot be read ({err.strerror or err})") from None
    return yaml_mapping(data, name)


def yaml_mapping(data: bytes, name: str, empty: str | None = None) -> dict[str, Any]:
    """``data`` read as a YAML mapping, an error naming ``name`` if it is not one. An empty file is
    an empty mapping, unless ``empty`` says why that would be wrong."""
    try:
        raw = yaml.safe_load(data.decode("utf-8"))  # whole: a decoding error's offset is the file's
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}: {yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{name}: not UTF-8 text (byte {err.object[err.start]:#04x} at {err.start})"
        ) from None
    if raw is None and empty is not None:
        raise ConfigError(f"{name} is empty: {empty}")
    if not isinstance(raw, dict | None):
        raise ConfigError(f"{name}: top level must be a mapping")
    return raw or {}


def check_platform_sections(raw: dict[str, Any], algorithms: frozenset[str] | None) -> None:
    """Every key of ``raw`` outside the algorithms' sections, its type and its range, and the algorithm's
    name when ``algorithms`` lists them all (``None``: any mapping may be an algorithm's section)."""
    algorithm = str(raw.get("algorithm", ExperimentConfig.algorithm)).lower()
    if algorithms is not None and algorithm not in algorithms:
        raise unknown_algorithm(algorithm, sorted(algorithms))
    fields = [f.name for f in dataclasses.fields(ExperimentConfig) if not f.metadata.get("not_a_key")]

    def algorithm_section(key: str, value: Any) -> bool:
        if algorithms is not None:
            return key in algorithms
        return key == algorithm or value is None or isinstance(value, dict)

    platform = {k: v for k, v in raw.items() if k in fields or not algorithm_section(k, v)}
    unknown = [k for k in platform if k not in fields]
    if unknown:
        listed = f" ({', '.join(sorted(algorithms))})" if algorithms else ""
        raise ConfigError(
            f"unknown config key {unknown[0]!r}; known keys here: {', '.join(fields)}; "
            f"or an algorithm's section, under its lower-case name{listed}"
        )
    platform["algorithm"] = algorithm
    cfg = build_dataclass(ExperimentConfig, platform)
    if cfg.data.partition.kind == "file":  # the split file sets the clients, read with the catalog
        cfg.data.num_clients, cfg.data.train_subset = 1, None
    check_fields(cfg)


def raw_config(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """A YAML file (or none: the defaults) plus ``key=value`` overrides, as a nested dict, unchecked."""
    raw = load_yaml(path) if path else {}
    return merge(raw, parse_overrides(overrides or []))


def read_config(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """:func:`raw_config` with its platform sections checked without the registries (no torch), for the
    command line before it loads them: :func:`build_config` does the rest."""
    raw = raw_config(path, overrides)
    check_platform_sections(raw, known_algorithm_names())
    return raw


def build_config(raw: dict[str, Any], catalog: Catalog) -> ExperimentConfig:
    """Turn a nested dict into a validated :class:`ExperimentConfig`."""
    raw = dict(raw)
    # again, with the registry's names: a caller in Python comes here without read_config, and with
    # an algorithm package installed read_config could not tell a misspelt section from the package's
    check_platform_sections(raw, frozenset(catalog.algorithm_names()))
    algorithm = str(raw.get("algorithm", ExperimentConfig.algorithm)).lower()
    raw["algorithm"] = algorithm
    config_cls = catalog.algorithm_config(algorithm)  # raises ConfigError for an unknown name
    # sections named after other algorithms are allowed in a YAML (compare configs) and not used, but
    # checked as their algorithm would check them: a misspelt key there is a mistake all the same
    algo_values = raw.pop(algorithm, None)
    for name in catalog.algorithm_names():
        values = raw.pop(name, None)
        if values is not None and name != algorithm:
            build_dataclass(catalog.algorithm_config(name), values, prefix=name)
    cfg = build_dataclass(ExperimentConfig, raw)
    cfg.algo = build_dataclass(config_cls, algo_values, prefix=algorithm)
    if cfg.data.partition.kind == "file" and cfg.data.partition.path:
        # a split made elsewhere defines the clients; data.num_clients follows it
        cfg.data.num_clients = catalog.split_file_clients(cfg.data.partition.path)
    validate(cfg, catalog.checks)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None, catalog: Catalog) -> ExperimentConfig:
    return build_config(raw_config(path, overrides), catalog)
