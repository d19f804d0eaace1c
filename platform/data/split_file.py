"""Split files: a federation's partition as JSON, to re-run any run elsewhere on the identical split.

Sample ids (the order :func:`~fedray.platform.data.sources.load_dataset` produces, deterministic):
id ``i < len(train)`` is official-train sample ``i``; id ``len(train) + j`` is official-test sample
``j``. For ``digits`` and ``synthetic`` the "official" splits are their fixed 80/20 splits; an image
folder lists ``train/`` then ``test/``, class folders and file names sorted.

Format ``fedray-split-1`` (what :func:`write_split` writes; every key but ``clients`` is optional when
reading, and unknown top-level keys are ignored)::

    {
      "format": "fedray-split-1",
      "dataset": "cifar10",                 # checked against data.dataset when present
      "index_order": "train then test (official splits)",
      "num_train": 50000, "num_test": 10000,  # checked against the dataset when ids are sample ids
      "provenance": {...},                  # how the split was made (informational)
      "clients": {
        "0": {"train": [...], "val": [...], "test": [...]},   # "val" and "test" may be left out
        ...
      },
      "global_test": [...],                 # default: the official test set
      "subset_paths": ["train/cat/0001.jpg", ...]           # image folders only
    }

How an entry resolves to a sample:

- a string is a path relative to ``data.root`` (``"train/cat/0001.jpg"``), image folders only;
- an integer is a sample id, unless the file has ``subset_paths``: then it is a position in
  ``subset_paths``, whose string names the sample. The writer does this for image folders
  (``subset_paths`` = the paths of every sample used, in id order), so the file stays valid when
  images are added to or removed from the folder.

Rules, each broken one a one-line :class:`ConfigError` naming the client and the entry: client keys
are ``"0".."N-1"``; every client has a non-empty ``train`` list; ``val``/``test`` lists are optional
(empty); no sample appears twice among all clients' lists; the global test (when given) repeats no
sample and holds no client training sample. The file defines the clients: ``data.num_clients`` must
equal their number (:func:`split_file_num_clients` reads it), and ``data.split``,
``data.train_subset`` and ``data.partition.long_tail_rho`` do not apply.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle
from fedray.platform.data.sources import source_of
from fedray.platform.errors import ConfigError

if TYPE_CHECKING:  # the federation is built from this module's splits; here it is an annotation
    from fedray.platform.data.federation import Federation

FORMAT = "fedray-split-1"
INDEX_ORDER = "train then test (official splits)"
PARTS = ("train", "val", "test")
_EXAMPLE = '{"clients": {"0": {"train": [...], "test": [...]}, ...}}'


# ------------------------------------------------------------------------------------------ writing


def federation_to_split(fed: Federation) -> dict[str, Any]:
    """The federation's partition in the ``fedray-split-1`` format (see the module docstring)."""
    missing = [s.client_id for s in fed.shards if any(getattr(s, f"{p}_ids") is None for p in PARTS)]
    if missing or fed.global_test_ids is None:
        raise ValueError(
            f"the federation has no sample ids (clients {missing[:5]}): it was not built from data"
        )
    if [s.client_id for s in fed.shards] != list(range(fed.num_clients)):
        raise ValueError("client ids must be 0..N-1 in order to write a split file")
    out: dict[str, Any] = {
        "format": FORMAT,
        "dataset": fed.dataset,
        "index_order": INDEX_ORDER,
        "num_train": fed.num_train,
        "num_test": fed.num_test,
    }
    if fed.provenance:
        out["provenance"] = dict(fed.provenance)
    lists = [getattr(s, f"{p}_ids") for s in fed.shards for p in PARTS] + [fed.global_test_ids]
    if fed.sample_paths is not None:
        used = np.unique(np.concatenate([np.asarray(a, dtype=np.int64) for a in lists]))

        def encode(ids: np.ndarray) -> list[int]:
            return np.searchsorted(used, ids).tolist()

    else:

        def encode(ids: np.ndarray) -> list[int]:
            return np.asarray(ids, dtype=np.int64).tolist()

    out["clients"] = {
        str(s.client_id): {p: encode(getattr(s, f"{p}_ids")) for p in PARTS} for s in fed.shards
    }
    out["global_test"] = encode(fed.global_test_ids)
    if fed.sample_paths is not None:
        out["subset_paths"] = [fed.sample_paths[i] for i in used]
    return out


def dumps_split(split: dict[str, Any]) -> str:
    """JSON text with one line per top-level key and per client (compact lists)."""

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    items = []
    for key, value in split.items():
        if key == "clients" and isinstance(value, dict):
            inner = ",\n".join(f"    {json.dumps(k)}: {compact(v)}" for k, v in value.items())
            items.append(f'  "clients": {{\n{inner}\n  }}')
        else:
            items.append(f"  {json.dumps(key)}: {compact(value)}")
    return "{\n" + ",\n".join(items) + "\n}\n"


def write_split(fed: Federation, path: str | Path) -> Path:
    """Write :func:`federation_to_split` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_split(federation_to_split(fed)))
    return path


# ------------------------------------------------------------------------------------------ reading


def _show(entry: Any) -> str:
    """An entry as it appears in the file (strings quoted), cut short if long."""
    text = json.dumps(entry)
    return text if len(text) <= 80 else text[:77] + "..."


def read_split_file(path: str | Path) -> dict[str, Any]:
    """Read a split file and check its shape (not its ids); raises a one-line ConfigError."""
    src = str(path)
    if not Path(path).is_file():
        raise ConfigError(f"data.partition.kind=file: data.partition.path={src!r} does not exist")
    try:
        split = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{src}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{src}: cannot read the split file ({err})") from None
    check_split_shape(split, src)
    return split


def check_split_shape(split: Any, src: str = "split.json") -> None:
    """The JSON structure of a split (see the module docstring); ``src`` names it in messages."""
    if not isinstance(split, dict):
        raise ConfigError(f"{src}: expected a JSON object {_EXAMPLE}")
    fmt = split.get("format", FORMAT)
    if fmt != FORMAT:
        raise ConfigError(f"{src}: format {_show(fmt)} is not supported (this version reads {FORMAT!r})")
    clients = split.get("clients")
    if not isinstance(clients, dict) or not clients:
        what = "no" if clients is None else "an empty" if clients == {} else "a malformed"
        raise ConfigError(f'{src}: {what} "clients" mapping; expected {_EXAMPLE}')
    numbers = []
    for key in clients:
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            raise ConfigError(f'{src}: client key {_show(key)} is not a client number ("0".."N-1")')
        numbers.append(int(key))
    missing = sorted(set(range(len(clients))) - set(numbers))
    if missing:
        raise ConfigError(
            f"{src}: clients must be numbered 0..{len(clients) - 1}; client {missing[0]} is missing"
        )
    for key, client in clients.items():
        if not isinstance(client, dict):
            raise ConfigError(f"{src}: client {key} must be an object with train/val/test lists")
        for part in client:
            if part not in PARTS:
                raise ConfigError(
                    f"{src}: client {key} has unknown key {_show(part)} (allowed: train, val, test)"
                )
        if "train" not in client:
            raise ConfigError(f"{src}: client {key} has no train list")
        for part in PARTS:
            _check_entries(client.get(part, []), f"client {key} {part}", src)
        if not client["train"]:
            raise ConfigError(f"{src}: client {key} has an empty train list")
    if "global_test" in split:
        _check_entries(split["global_test"], "global_test", src)
        if not split["global_test"]:
            raise ConfigError(f"{src}: global_test is empty; leave it out to use the official test set")
    if "subset_paths" in split:
        paths = split["subset_paths"]
        if not isinstance(paths, list):
            raise ConfigError(f"{src}: subset_paths must be a list of relative paths")
        for i, entry in enumerate(paths):
            if not isinstance(entry, str):
                raise ConfigError(
                    f"{src}: subset_paths[{i}] = {_show(entry)} is not a relative path (a string)"
                )
    for key in ("num_train", "num_test"):
        value = split.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ConfigError(f"{src}: {key} = {_show(value)} must be a non-negative integer")
    if not isinstance(split.get("dataset", ""), str):
        raise ConfigError(f"{src}: dataset = {_show(split['dataset'])} must be a dataset name")


def _check_entries(entries: Any, where: str, src: str) -> None:
    if not isinstance(entries, list):
        raise ConfigError(f"{src}: {where} must be a list of sample ids or relative paths")
    for i, entry in enumerate(entries):
        if isinstance(entry, bool) or not isinstance(entry, (int, str)):
            raise ConfigError(
                f"{src}: {where}[{i}] = {_show(entry)} is not a sample id (an integer) or a relative path "
                "(a string)"
            )


def split_file_num_clients(path: str | Path) -> int:
    """The number of clients a split file defines (it wins over ``data.num_clients``)."""
    return len(read_split_file(path)["clients"])


# ------------------------------------------------------------------------------------------ resolving


@dataclass
class SampleSpace:
    """What a split's entries resolve against: the dataset's id space (and paths, image folders)."""

    dataset: str
    num_train: int
    num_test: int
    paths: list[str] | None = None  # relative paths in id order (image folders)
    root: str | None = None  # data.root, for messages

    @property
    def size(self) -> int:
        return self.num_train + self.num_test

    @classmethod
    def of_bundle(cls, bundle: DatasetBundle, root: str | None = None) -> SampleSpace:
        return cls(bundle.name, len(bundle.train), len(bundle.test), bundle.paths, root)

    @classmethod
    def of_config(cls, cfg: DataConfig) -> SampleSpace:
        """From metadata only: official sizes, and the folder listing for image folders (no decode)."""
        source = source_of(cfg)
        n_train, n_test = source.sizes(cfg)
        return cls(cfg.dataset, n_train, n_test, source.sample_paths(cfg), cfg.root)


@dataclass
class ResolvedSplit:
    """A split's entries as sample ids: ``clients[k][part]`` and the global test (None = official)."""

    clients: list[dict[str, np.ndarray]]
    global_test: np.ndarray | None


def _normpath(path: str) -> str:
    return posixpath.normpath(path.replace("\\", "/")).lstrip("/")


class _Resolver:
    """Turns entries (ids, positions in subset_paths, paths) into sample ids, with named errors."""

    def __init__(self, split: dict[str, Any], space: SampleSpace, src: str) -> None:
        self.space, self.src = space, src
        self.index = {p: i for i, p in enumerate(space.paths)} if space.paths is not None else None
        self.subset: np.ndarray | None = None
        if "subset_paths" in split:
            if self.index is None:
                raise ConfigError(
                    f'{src}: "subset_paths" is given, but data.dataset={space.dataset} has no files (only '
                    "imagefolder does); use sample ids"
                )
            self.subset = np.asarray(
                [self._path(p, f"subset_paths[{i}]") for i, p in enumerate(split["subset_paths"])],
                dtype=np.int64,
            )
            first = _first_repeat(self.subset)
            if first is not None:
                i, j = first
                raise ConfigError(
                    f"{src}: subset_paths[{j}] = {_show(split['subset_paths'][j])} repeats subset_paths[{i}]"
                )

    def _path(self, entry: str, where: str) -> int:
        if self.index is None:
            raise ConfigError(
                f"{self.src}: {where} = {_show(entry)} is a path, but data.dataset={self.space.dataset} has "
                "no files (only imagefolder does); use sample ids"
            )
        sample = self.index.get(_normpath(entry))
        if sample is None:
            root = Path(self.space.root or ".").expanduser()
            if (root / _normpath(entry)).exists():
                why = (
                    "is not an image of the dataset (not in train/ or test/<class>/, hidden, or not an image)"
                )
            else:
                why = f"does not exist under data.root={self.space.root!r}"
            raise ConfigError(f"{self.src}: {where} = {_show(entry)} {why}")
        return sample

    def _out_of_range(self, value: int, where: str) -> ConfigError:
        if self.subset is not None:
            limits = f"subset_paths has {len(self.subset)} entries"
        else:
            n, t = self.space.size, self.space.num_train
            limits = f"dataset has {n} samples: ids 0..{t - 1} train, {t}..{n - 1} test"
        return ConfigError(f"{self.src}: {where} = {value} is out of range ({limits})")

    def ids(self, entries: list[Any], where: str) -> np.ndarray:
        limit = len(self.subset) if self.subset is not None else self.space.size
        if all(type(e) is int and -(2**62) < e < 2**62 for e in entries):  # the common case, vectorised
            values = np.asarray(entries, dtype=np.int64)
            bad = np.flatnonzero((values < 0) | (values >= limit))
            if len(bad):
                raise self._out_of_range(int(values[bad[0]]), f"{where}[{bad[0]}]")
            return self.subset[values] if self.subset is not None else values
        out = np.empty(len(entries), dtype=np.int64)
        for i, entry in enumerate(entries):
            if isinstance(entry, str):
                out[i] = self._path(entry, f"{where}[{i}]")
            elif not 0 <= entry < limit:
                raise self._out_of_range(entry, f"{where}[{i}]")
            else:
                out[i] = self.subset[entry] if self.subset is not None else entry
        return out

    def describe(self, sample: int) -> str:
        if self.space.paths is not None:
            return f"{sample} ({_show(self.space.paths[sample])})"
        return str(sample)


def _first_repeat(ids: np.ndarray) -> tuple[int, int] | None:
    """Positions ``(i, j)``, ``i < j``, of the first value (by ``j``) that repeats an earlier one."""
    if len(ids) < 2:
        return None
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1]) + 1
    if not len(dup):
        return None
    j = int(order[dup].min())
    return int(np.flatnonzero(ids == ids[j])[0]), j


def resolve_split(split: dict[str, Any], space: SampleSpace, src: str = "split.json") -> ResolvedSplit:
    """Check a (shape-checked) split against a dataset and return its sample ids; one-line ConfigErrors."""
    check_split_shape(split, src)
    name = split.get("dataset")
    if name and name != space.dataset:
        raise ConfigError(f'{src}: made for dataset "{name}", but data.dataset={space.dataset}')
    if "subset_paths" not in split:
        sizes = (split.get("num_train"), split.get("num_test"))
        if None not in sizes and sizes != (space.num_train, space.num_test):
            raise ConfigError(
                f"{src}: written for {sizes[0]} train + {sizes[1]} test samples, but data.dataset="
                f"{space.dataset} has {space.num_train} + {space.num_test}: its ids would name other samples"
            )
    resolver = _Resolver(split, space, src)
    clients = split["clients"]
    resolved = [
        {p: resolver.ids(clients[str(k)].get(p, []), f"client {k} {p}") for p in PARTS}
        for k in range(len(clients))
    ]
    # every (client, part) list laid end to end: a repeated id is a sample in two places
    labels = [(k, p) for k in range(len(clients)) for p in PARTS]
    lists = [resolved[k][p] for k, p in labels]
    flat = np.concatenate(lists)
    starts = np.cumsum([0] + [len(a) for a in lists])

    def where(pos: int) -> str:
        slot = int(np.searchsorted(starts, pos, side="right")) - 1
        k, p = labels[slot]
        return f"client {k} {p}[{pos - starts[slot]}]"

    repeat = _first_repeat(flat)
    if repeat is not None:
        i, j = repeat
        raise ConfigError(f"{src}: sample {resolver.describe(int(flat[j]))} is in {where(i)} and {where(j)}")
    global_test = None
    if "global_test" in split:
        global_test = resolver.ids(split["global_test"], "global_test")
        repeat = _first_repeat(global_test)
        if repeat is not None:
            i, j = repeat
            sample = resolver.describe(int(global_test[j]))
            raise ConfigError(f"{src}: sample {sample} is in global_test[{i}] and global_test[{j}]")
        train_pos = np.concatenate(
            [np.arange(starts[s], starts[s + 1]) for s, (_, p) in enumerate(labels) if p == "train"]
        )
        hit = np.flatnonzero(np.isin(global_test, flat[train_pos]))
        if len(hit):
            shared = int(global_test[hit[0]])
            pos = int(train_pos[np.flatnonzero(flat[train_pos] == shared)[0]])
            raise ConfigError(
                f"{src}: sample {resolver.describe(shared)} is in {where(pos)} and global_test[{hit[0]}]; "
                "the global test set must hold no training sample"
            )
    return ResolvedSplit(resolved, global_test)


def check_num_clients(cfg: DataConfig, found: int, src: str) -> None:
    """``data.num_clients`` must equal the file's count (set it from :func:`split_file_num_clients`)."""
    if cfg.num_clients != found:
        raise ConfigError(
            f"data.num_clients={cfg.num_clients}, but {src} defines {found} clients; set "
            f"data.num_clients={found} (the split file defines the clients)"
        )


def check_split_file(cfg: DataConfig) -> None:
    """Pre-flight of ``data.partition.kind=file`` from metadata alone: shape, client count and ids."""
    src = split_path(cfg)
    split = read_split_file(src)
    check_num_clients(cfg, len(split["clients"]), src)
    resolve_split(split, SampleSpace.of_config(cfg), src)


def split_path(cfg: DataConfig) -> str:
    """``data.partition.path``, which ``kind=file`` needs."""
    if not cfg.partition.path:
        raise ConfigError("data.partition.kind=file needs data.partition.path=<split.json>")
    return str(cfg.partition.path)
