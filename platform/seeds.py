"""Named random streams: every seeded draw in fedray comes from a stream declared once, by name.

One registry and one naming scheme for the platform, the data layer and the algorithms. A stream is
declared at module level by its owner: its name (``owner/purpose``), the parts that vary along it,
and, for a stream older than this registry, the tag it was written with::

    stream("fedcross/shuffle", "rnd")                     # algorithms/fedcross.py: a new stream
    stream("fedl2g/quiz", "client", tag=13)               # algorithms/fedl2g.py: an older one

A call site names the stream and passes the experiment seed and the parts, never a number::

    seed_of("coordinator/sample", cfg.seed, rnd)          # an int, for torch.manual_seed and the like
    torch_generator("fedl2g/quiz", cfg.seed, client)      # a seeded torch.Generator
    numpy_rng("data/split", seed, client)                 # a seeded numpy Generator

How a name maps to its numbers. A stream has a tag (a few ints) and one of two derivations:

- ``derive_seed`` (the default): :func:`derive_seed` of ``(seed, *parts, *tag)``, crc32 of their int64
  bytes, 31 bits; :func:`numpy_rng` seeds ``default_rng`` with that int.
- ``seed_sequence`` (the data layer's): ``default_rng([seed, *tag, *parts])``, numpy's SeedSequence;
  it has no int seed, only :func:`numpy_rng`.

A new stream's tag is crc32 of its name, so the name alone fixes its numbers. The streams written
before the registry keep their hand-picked tags (``tag=``), in the place they had: the same inputs
give the same bits, so partitions, initial weights, sampled clients and data orders are what they were
for every seed, and results logged before stay reproducible. The exception was a collision: FedCross's
shuffle used the evaluation sample's tag (5), so it now has a name-derived tag and new numbers.

Two streams collide when some parts give them the same inputs under one seed: the same derivation,
the same number of inputs, every fixed input equal. SeedSequence reads ``[s, t]`` as ``[s, t, 0]``,
so ``seed_sequence`` inputs are compared padded with zeros. The two derivations do not meet: numpy
reads a ``derive_seed`` stream's int ``x`` as ``[x, 0, ...]``, a ``seed_sequence`` stream's second
word is its tag, which therefore starts non-zero (``[s, 0]`` would also be ``default_rng(s)``).
Declaring a colliding stream, or a name another module already declared, raises at import time;
naming an undeclared stream raises at the call.
"""

from __future__ import annotations

import random
import re
import sys
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

NAME = re.compile(r"[a-z0-9_]+(/[a-z0-9_]+)+")  # owner/purpose, lower case
Derivation = Literal["derive_seed", "seed_sequence"]


def derive_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers: the arithmetic of the ``derive_seed`` streams."""
    return zlib.crc32(np.asarray(parts, dtype=np.int64).tobytes()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Stream:
    name: str
    parts: tuple[str, ...]  # what varies along the stream, in call order: "rnd", "client"...
    tag: tuple[int, ...]
    derivation: Derivation
    owner: str  # the declaring module

    def inputs(self) -> tuple[int | None, ...]:
        """What follows the seed in the derivation, a part as None."""
        free = (None,) * len(self.parts)
        return (*self.tag, *free) if self.derivation == "seed_sequence" else (*free, *self.tag)

    def meets(self, other: Stream) -> bool:
        """Whether some parts give both streams the same inputs under one seed."""
        if self.derivation != other.derivation:
            return False
        a, b = self.inputs(), other.inputs()
        if self.derivation == "seed_sequence":  # trailing zeros are invisible to SeedSequence
            n = max(len(a), len(b))
            a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
        return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))

    def describe(self) -> str:
        """The derivation written out, e.g. ``derive_seed(seed, rnd, 5)``."""
        names = iter(self.parts)
        inputs = ", ".join(["seed", *(next(names) if x is None else str(x) for x in self.inputs())])
        return f"derive_seed({inputs})" if self.derivation == "derive_seed" else f"default_rng([{inputs}])"


_STREAMS: dict[str, Stream] = {}


def stream(
    name: str, *parts: str, tag: int | tuple[int, ...] | None = None, seed_sequence: bool = False
) -> Stream:
    """Declare the stream ``name``, varying along ``parts``. ``tag`` only for a stream older than
    the registry (its numbers are pinned); ``seed_sequence=True`` for the data layer's SeedSequence form."""
    if not NAME.fullmatch(name):
        raise ValueError(f"stream {name!r}: a name is owner/purpose in lower case, e.g. 'client/train'")
    if tag is None:  # a new stream: its name picks its tag
        tag = zlib.crc32(name.encode()) & 0x7FFFFFFF
    tags = tag if isinstance(tag, tuple) else (tag,)
    derivation: Derivation = "seed_sequence" if seed_sequence else "derive_seed"
    if seed_sequence and tags[0] == 0:
        raise ValueError(
            f"stream {name!r}: a numpy stream's tag starts non-zero ([seed, 0] is default_rng(seed))"
        )
    # the caller's module: the same module declaring again is a re-import, another module a duplicate
    owner = sys._getframe(1).f_globals.get("__name__", "?")
    new = Stream(name, parts, tags, derivation, owner)
    old = _STREAMS.get(name)
    if old is not None:
        if old == new:
            return old
        raise ValueError(
            f"stream {name!r} declared twice: {old.describe()} in {old.owner}, {new.describe()} in {owner}"
        )
    for other in _STREAMS.values():
        if new.meets(other):
            raise ValueError(
                f"stream {name!r} ({owner}) collides with {other.name!r} ({other.owner}): "
                f"{new.describe()} and {other.describe()} can draw alike: rename one, or change its tag"
            )
    _STREAMS[name] = new
    return new


def streams() -> dict[str, Stream]:
    """Every stream declared so far, by name (an algorithm's once its module is imported)."""
    return dict(_STREAMS)


def _get(name: str, parts: tuple[int, ...]) -> Stream:
    s = _STREAMS.get(name)
    if s is None:
        raise ValueError(
            f"stream {name!r} is not declared: declare it with stream({name!r}, ...) in its owner"
        )
    if len(parts) != len(s.parts):
        raise ValueError(
            f"stream {name!r} takes seed, {', '.join(s.parts) or 'nothing else'}; got {len(parts)} part(s)"
        )
    return s


def seed_of(name: str, seed: int, *parts: int) -> int:
    """The 31-bit seed of stream ``name`` at ``parts``, e.g. ``seed_of("client/train", seed, rnd, client)``."""
    s = _get(name, parts)
    if s.derivation != "derive_seed":
        raise ValueError(f"stream {name!r} is a numpy SeedSequence stream with no int seed: use numpy_rng")
    return derive_seed(seed, *parts, *s.tag)


def torch_generator(name: str, seed: int, *parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from stream ``name`` at ``parts``."""
    return torch.Generator().manual_seed(seed_of(name, seed, *parts))


def numpy_rng(name: str, seed: int, *parts: int) -> np.random.Generator:
    """A numpy ``Generator`` seeded from stream ``name`` at ``parts``."""
    s = _get(name, parts)
    if s.derivation == "seed_sequence":
        return np.random.default_rng([seed, *s.tag, *parts])
    return np.random.default_rng(derive_seed(seed, *parts, *s.tag))


def seed_global_draws(seed: int) -> None:
    """numpy's and Python's global generators from ``seed``: code that draws from them
    (``np.random.rand``, ``random.random``) instead of a named stream still draws the same numbers
    wherever and whenever its call runs (a worker's history, a restarted Coordinator, a resume)."""
    np.random.seed(derive_seed(seed, 1))  # not ``seed`` itself: torch's CPU generator is an MT19937 too,
    random.seed(derive_seed(seed, 2))  # and the same seed would give it the same words


# ---------------------------------------------------------------------------- the platform's streams
# All older than the registry: tags and input order as they were written, so their numbers stand.

stream("model/init", "client", tag=0)  # a client's initial weights (the client whose draw it shares)
stream("client/data_order", "rnd", "client", tag=1)  # the order of a client's training batches
stream("client/train", "rnd", "client", tag=2)  # torch's global generator for a client's round
stream("client/augment", "rnd", "client", tag=3)  # data.augment's crops and flips
stream("coordinator/sample", "rnd", tag=3)  # the clients trained in a round
stream("coordinator/server_init", tag=4)  # torch's global generator while the server half is built
stream("coordinator/eval_sample", "rnd", tag=5)  # eval.clients=sample: the clients tested in a round
stream("coordinator/global_draws", "rnd")  # numpy's and Python's global generators for a round's server
# the data layer's, in numpy's SeedSequence form: a partition is a function of the seed alone
stream("data/partition", tag=1, seed_sequence=True)  # the partitioner's draws
stream("data/long_tail", tag=2, seed_sequence=True)  # which samples the long-tail profile keeps
stream("data/split", "client", tag=3, seed_sequence=True)  # a client's train/val/test split
stream("data/subset", tag=4, seed_sequence=True)  # data.train_subset's stratified subset
stream("data/official_test", tag=5, seed_sequence=True)  # the official test set's shares (official_test)
stream("data/natural_users", tag=6, seed_sequence=True)  # partition.kind=natural: the users kept
