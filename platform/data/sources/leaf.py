"""LEAF's federated datasets (Caldas et al. 2018, github.com/TalwalkarLab/leaf): the reader they share.

``femnist``, ``shakespeare`` and ``sent140`` (one module each) are LEAF's JSON files read by this code;
each task only says how to turn one user's raw ``x`` and ``y`` lists into arrays.

Where the files go. ``data.root`` is a LEAF task's ``data/`` folder after its ``preprocess.sh``
(``leaf/data/femnist/data``):

- ``train/*.json`` and ``test/*.json``: LEAF's per-user split is made (``-t sample``); used as it is.
- otherwise the last unsplit stage, picked as LEAF's ``split_data.py`` picks it: ``rem_user_data/``
  (after ``-k``), else ``sampled_data/`` (after ``-s``/``--sf``), else ``all_data/``. Each user's samples
  are then split here as ``split_data.py --by_sample`` splits them (below), with
  ``data.leaf.train_fraction`` (LEAF's ``--tf``).

The files. Each holds ``users`` (ids), ``num_samples`` and ``user_data`` (``{user: {"x": [...], "y":
[...]}}``); a task may be spread over several files. Files are read in sorted name order, users in
file order; a user's samples are counted from its ``y`` list, never from ``num_samples`` (LEAF's own
Shakespeare ``test/`` files overstate it by the 79 windows its split drops).

Sample ids and clients. Official train = every user's train samples, user after user in that order;
official test = their held-out samples in the same user order. Each user becomes a
:class:`~fedray.platform.data.bundle.NaturalClient` with its ids in that space (test ids from
``len(train)`` on); ``data.partition.kind=natural`` builds the federation from them. A user listed in
``train/`` but not in ``test/`` (or the reverse) is an error: LEAF's ``-t sample`` lists every kept user
in both, its ``-t user`` split (users, not samples, held out) has no per-user test and is not supported.

Splitting unsplit files, as LEAF's ``split_data.py --by_sample``: a user with ``n`` samples gets
``max(1, int(train_fraction * n))`` train samples (1 when ``n == 2``) and the rest are held out; a user
with fewer than 2 samples, or with no held-out sample left, is dropped. FEMNIST and Sent140 draw each
user's train samples at random, keeping file order, from a FIXED seed (``SPLIT_SEED`` and a CRC of the
user's id; LEAF draws from ``--spltseed`` or the clock), so every run and every experiment seed tests on
the same samples. Shakespeare's train samples are the user's first windows and its held-out ones start
79 windows later (LEAF's rule: no held-out window shares its input text with a training window).

Cost. :meth:`LeafSource.check` lists folders. :meth:`LeafSource.sizes` needs each user's sample count:
the first call parses every JSON file (no tensor is built), later calls read a small index cached with
the files' fingerprint, which :meth:`LeafSource.load` also writes. ``load`` decodes once and then
reads the decoded arrays from the cache (:mod:`fedray.platform.data.cache`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle, NaturalClient
from fedray.platform.data.cache import bundle_from_payload, cached
from fedray.platform.data.sources.base import Source, required_root
from fedray.platform.errors import ConfigError

UNSPLIT = ("rem_user_data", "sampled_data", "all_data")  # LEAF's stages, the latest first
SPLIT_SEED = 20181203  # unsplit files: the fixed seed of each user's train/test draw (LEAF's arXiv date)


class SampleError(ValueError):
    """A task's complaint about one user's samples; the reader adds the file and the user."""


@dataclass(frozen=True)
class Layout:
    """The JSON files a LEAF ``data/`` folder holds: ``train/`` + ``test/``, or one unsplit folder."""

    root: Path
    folder: str  # "train" (split files) or the unsplit folder's name
    train: list[Path]  # split: train/*.json; unsplit: the folder's files
    test: list[Path]  # split: test/*.json; unsplit: empty

    @property
    def split(self) -> bool:
        return self.folder == "train"

    @property
    def files(self) -> list[Path]:
        return self.train + self.test


def json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []


def find_layout(cfg: DataConfig, task: str) -> Layout:
    """The JSON files under ``data.root``; a one-line ConfigError naming the missing folder otherwise."""
    where = f"leaf/data/{task}/data after LEAF's ./preprocess.sh"
    root = required_root(cfg, f"{where}: train/ + test/ or all_data/")
    train_dir, test_dir = root / "train", root / "test"
    if train_dir.is_dir() or test_dir.is_dir():
        for d in (train_dir, test_dir):
            if not d.is_dir():
                raise ConfigError(
                    f"data.root={cfg.root!r}: {d} is missing ({task} needs LEAF's train/ and test/ side by "
                    "side, or only an unsplit all_data/)"
                )
            if not json_files(d):
                raise ConfigError(f"data.root={cfg.root!r}: {d} has no .json files ({where})")
        return Layout(root, "train", json_files(train_dir), json_files(test_dir))
    for name in UNSPLIT:
        files = json_files(root / name)
        if files:
            return Layout(root, name, files, [])
    hint = f"; did you mean {root / 'data'}?" if (root / "data").is_dir() else ""
    raise ConfigError(
        f"data.root={cfg.root!r}: no LEAF files there: neither train/ + test/ nor all_data/ holds .json "
        f"files (data.root is {where}){hint}"
    )


# ------------------------------------------------------------------------------------------ the JSON files


def bad_file(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path}: {problem}")


def parse_file(path: Path) -> dict[str, Any]:
    """One LEAF JSON file, its structure checked: each listed user has ``x`` and ``y`` lists of one length."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as err:
        raise bad_file(
            path, f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno}; truncated?)"
        ) from None
    except UnicodeDecodeError:
        raise bad_file(path, "not UTF-8 text") from None
    except OSError as err:
        raise bad_file(path, f"cannot be read ({err.strerror})") from None
    if not isinstance(data, dict):
        raise bad_file(path, "not a JSON object with users, num_samples and user_data")
    users, user_data = data.get("users"), data.get("user_data")
    if not isinstance(users, list):
        raise bad_file(path, "has no 'users' list")
    if not isinstance(user_data, dict):
        raise bad_file(path, "has no 'user_data' object")
    seen: set[str] = set()
    for user in users:
        if not isinstance(user, str):
            raise bad_file(path, f"'users' holds {user!r}, not a string id")
        if user in seen:
            raise bad_file(path, f"user {user!r} is listed twice")
        seen.add(user)
        record = user_data.get(user)
        if not isinstance(record, dict):
            raise bad_file(path, f"user {user!r} is listed in 'users' but has no entry in 'user_data'")
        x, y = record.get("x"), record.get("y")
        if not isinstance(x, list) or not isinstance(y, list):
            raise bad_file(path, f"user {user!r} has no 'x' and 'y' lists")
        if len(x) != len(y):
            raise bad_file(path, f"user {user!r} has {len(x)} x but {len(y)} y")
    return data


def read_counts(files: Sequence[Path]) -> tuple[list[str], list[int]]:
    """Users (in load order) and their sample counts, from the parsed files."""
    users: list[str] = []
    counts: list[int] = []
    where: dict[str, Path] = {}
    for path in files:
        data = parse_file(path)
        for user in data["users"]:
            no_repeat(user, path, where)
            users.append(user)
            counts.append(len(data["user_data"][user]["y"]))
    return users, counts


def no_repeat(user: str, path: Path, where: dict[str, Path]) -> None:
    if user in where:
        raise bad_file(path, f"user {user!r} is in {where[user].name} too")
    where[user] = path


def match_users(layout: Layout, train: Sequence[str], test: Sequence[str]) -> None:
    """Split files list the same users in train/ and test/ (LEAF's ``-t sample``)."""
    train_set, test_set = set(train), set(test)
    if train_set == test_set:
        return
    only_train = [u for u in train if u not in test_set]
    if only_train:
        raise ConfigError(
            f"data.root={str(layout.root)!r}: train/ lists user {only_train[0]!r} that test/ lacks "
            f"({len(only_train)} such users; fedray needs LEAF's -t sample split, each user in both)"
        )
    only_test = [u for u in test if u not in train_set]
    raise ConfigError(
        f"data.root={str(layout.root)!r}: test/ lists user {only_test[0]!r} that train/ lacks "
        f"({len(only_test)} such users; fedray needs LEAF's -t sample split, each user in both)"
    )


def split_counts(n: int, fraction: float, gap: int = 0) -> tuple[int, int]:
    """LEAF's ``split_data.py --by_sample``: ``(train, held-out)`` samples of a user with ``n``;
    ``(0, 0)`` drops the user. ``gap`` windows between them are dropped (Shakespeare: 79)."""
    if n < 2:
        return 0, 0
    n_train = 1 if n == 2 else max(1, int(fraction * n))
    n_test = n - n_train - gap
    return (n_train, n_test) if n_test >= 1 else (0, 0)


def split_user(
    user: str, n: int, fraction: float, gap: int, contiguous: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of one user's train and held-out samples in an unsplit file (see the module docstring)."""
    n_train, n_test = split_counts(n, fraction, gap)
    if contiguous:
        return np.arange(n_train), np.arange(n - n_test, n)
    rng = np.random.default_rng([SPLIT_SEED, zlib.crc32(user.encode())])
    train = np.sort(rng.choice(n, n_train, replace=False))
    held_out = np.setdiff1d(np.arange(n), train)
    return train, held_out


def natural_clients(
    users: Sequence[str], train_counts: np.ndarray, test_counts: np.ndarray, gap: int
) -> list[NaturalClient]:
    """Each user's ids: its train samples are contiguous in the train set, its held-out ones in the test
    set, whose ids start after the train set. Its ``num_samples`` is LEAF's count before the split: train
    and held-out plus the ``gap`` windows the split dropped (Shakespeare's 79)."""
    n_train = int(train_counts.sum())
    train_end, test_end = np.cumsum(train_counts), n_train + np.cumsum(test_counts)
    return [
        NaturalClient(
            user,
            np.arange(train_end[k] - train_counts[k], train_end[k], dtype=np.int64),
            np.arange(test_end[k] - test_counts[k], test_end[k], dtype=np.int64),
            int(train_counts[k] + test_counts[k]) + gap,
        )
        for k, user in enumerate(users)
    ]


# ------------------------------------------------------------------------------------------ the source


Arrays = tuple[np.ndarray, np.ndarray]  # one user's samples (task-specific x) and int64 labels


class LeafSource(Source):
    """A LEAF task: the reader above, plus the task's :meth:`convert` (and :meth:`encode`)."""

    natural = True
    task = ""  # LEAF's folder name (leaf/data/<task>), for messages
    gap = 0  # unsplit files: windows dropped between a user's train and held-out samples
    contiguous = False  # unsplit files: the user's first samples train (Shakespeare), else a random draw

    def class_names(self) -> list[str]:
        raise NotImplementedError

    def convert(self, xs: list[Any], ys: list[Any]) -> Arrays:
        """One user's raw ``x`` and ``y`` lists -> ``(x, y)`` arrays, ``y`` int64; raises SampleError."""
        raise NotImplementedError

    def encode(
        self, cfg: DataConfig, train_x: list[np.ndarray], test_x: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The users' converted ``x`` pieces -> the train and test tensors, plus anything else the cache
        payload carries (``vocab_size``, ``embeddings``). Default: concatenate."""
        return torch.from_numpy(np.concatenate(train_x)), torch.from_numpy(np.concatenate(test_x)), {}

    def token_key(self, cfg: DataConfig) -> str:
        """What besides the files changes the decoded arrays (Sent140: the vocabulary's source)."""
        return ""

    def extra_files(self, cfg: DataConfig) -> list[Path]:
        """Files besides the JSON whose edits must invalidate the cache (Sent140: the GloVe file)."""
        return []

    # -- Source ------------------------------------------------------------------------------------

    def layout(self, cfg: DataConfig) -> Layout:
        return find_layout(cfg, self.task)

    def check(self, cfg: DataConfig) -> None:
        self.layout(cfg)

    def cache_key(self, cfg: DataConfig) -> str:
        fraction = "" if self.layout(cfg).split else f"-tf{cfg.leaf.train_fraction:g}"
        return f"{self.name}{fraction}{self.token_key(cfg)}"

    def split_sizes(self, cfg: DataConfig) -> list[tuple[int, int]]:
        """Each user's ``(train, held-out)`` sample counts from the count index (see the module
        docstring's Cost); ``(0, 0)`` for a user an unsplit file's split would drop."""
        layout = self.layout(cfg)
        index = cached(layout.root, f"{self.name}-index", layout.files, lambda: self.count(layout))
        if layout.split:
            return list(zip(index["train"], index["test"]))
        return [split_counts(n, cfg.leaf.train_fraction, self.gap) for n in index["all"]]

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        """Official train and test sizes from the users' sample counts."""
        pairs = self.split_sizes(cfg)
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def user_sizes(self, cfg: DataConfig) -> list[int]:
        """The users with a sample to train on, each counted as LEAF's ``-k`` counts (before the split:
        train, held-out and the ``gap`` between them), as :class:`NaturalClient.num_samples` is."""
        return [train + test + self.gap for train, test in self.split_sizes(cfg) if train > 0]

    def count(self, layout: Layout) -> dict[str, Any]:
        """The index of sample counts: parses the files, converts nothing."""
        users, counts = read_counts(layout.train)
        if not layout.split:
            return {"users": users, "all": counts}
        test_users, test_counts = read_counts(layout.test)
        match_users(layout, users, test_users)
        by_user = dict(zip(test_users, test_counts))
        return {"users": users, "train": counts, "test": [by_user[u] for u in users]}

    def load(self, cfg: DataConfig) -> DatasetBundle:
        layout = self.layout(cfg)
        files = layout.files + self.extra_files(cfg)
        payload = cached(layout.root, self.cache_key(cfg), files, lambda: self.decode(cfg, layout))
        cached(layout.root, f"{self.name}-index", layout.files, lambda: payload["index"])
        bundle = bundle_from_payload(self.name, payload)
        bundle.clients = natural_clients(
            payload["users"], payload["train_counts"].numpy(), payload["test_counts"].numpy(), self.gap
        )
        bundle.embeddings = payload.get("embeddings")
        return bundle

    # -- decoding ----------------------------------------------------------------------------------

    def read_users(self, files: Sequence[Path]) -> dict[str, Arrays]:
        """Every user's converted samples, in load order (sorted files, users in file order)."""
        out: dict[str, Arrays] = {}
        where: dict[str, Path] = {}
        for path in files:
            data = parse_file(path)
            for user in data["users"]:
                no_repeat(user, path, where)
                record = data["user_data"][user]
                try:
                    x, y = self.convert(record["x"], record["y"])
                except SampleError as err:
                    raise bad_file(path, f"user {user!r}: {err}") from None
                out[user] = x, y
            del data  # one file's Python objects at a time
        return out

    def decode(self, cfg: DataConfig, layout: Layout) -> dict[str, Any]:
        """The cache payload: arrays, each user's counts, and the index :meth:`sizes` reads."""
        users: list[str] = []
        train: list[Arrays] = []
        test: list[Arrays] = []
        if layout.split:
            train_users = self.read_users(layout.train)
            test_users = self.read_users(layout.test)
            match_users(layout, list(train_users), list(test_users))
            users = list(train_users)
            train = [train_users[u] for u in users]
            test = [test_users[u] for u in users]
            index = {
                "users": users,
                "train": [len(s[1]) for s in train],
                "test": [len(s[1]) for s in test],
            }
        else:
            everyone = self.read_users(layout.train)
            index = {"users": list(everyone), "all": [len(y) for _, y in everyone.values()]}
            for user, (x, y) in everyone.items():
                if split_counts(len(y), cfg.leaf.train_fraction, self.gap)[0] == 0:
                    continue  # too few samples to hold one out: LEAF drops the user
                tr, te = split_user(user, len(y), cfg.leaf.train_fraction, self.gap, self.contiguous)
                users.append(user)
                train.append((x[tr], y[tr]))
                test.append((x[te], y[te]))
        if not users:
            raise ConfigError(
                f"data.root={str(layout.root)!r}: no user of {layout.folder}/ has samples to train and test on"
            )
        train_x, test_x, extra = self.encode(cfg, [x for x, _ in train], [x for x, _ in test])
        return {
            "class_names": self.class_names(),
            "train_x": train_x,
            "train_y": torch.from_numpy(np.concatenate([y for _, y in train]).astype(np.int64)),
            "test_x": test_x,
            "test_y": torch.from_numpy(np.concatenate([y for _, y in test]).astype(np.int64)),
            "users": users,
            "train_counts": torch.tensor([len(y) for _, y in train], dtype=torch.int64),
            "test_counts": torch.tensor([len(y) for _, y in test], dtype=torch.int64),
            "index": index,
            **extra,
        }


def int_labels(ys: list[Any], num_classes: int, what: str) -> np.ndarray:
    """Integer labels ``0..num_classes-1`` (ints, or strings of them) as int64; SampleError otherwise."""
    out = np.empty(len(ys), dtype=np.int64)
    for i, value in enumerate(ys):
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SampleError(f"sample {i}: label {value!r} is not an integer ({what})")
        try:
            label = int(value)
        except ValueError:
            raise SampleError(f"sample {i}: label {value!r} is not an integer ({what})") from None
        if not 0 <= label < num_classes:
            raise SampleError(f"sample {i}: label {value!r} is not one of {what}")
        out[i] = label
    return out
