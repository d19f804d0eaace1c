"""Named random streams (fedray.platform.seeds): one registry, no two streams alike, today's numbers
pinned against the formula they were written with. No Ray."""

from __future__ import annotations

import zlib
from itertools import product

import numpy as np
import pytest
import torch

from fedray.platform import seeds
from fedray.platform.api import registry
from fedray.platform.seeds import numpy_rng, seed_of, stream, torch_generator

SEEDS = (0, 1, 42)
GRID = {"rnd": range(21), "client": range(51)}  # the values each kind of part takes below


def old_derive_seed(*parts: int) -> int:
    """derive_seed as it was written before named streams."""
    return zlib.crc32(np.asarray(parts, dtype=np.int64).tobytes()) & 0x7FFFFFFF


@pytest.fixture(scope="module", autouse=True)
def every_stream():
    """Every algorithm module imported, so the streams they declare are in the registry."""
    registry.available()


@pytest.fixture
def scratch(monkeypatch):
    """A copy of the registry that a test may declare into, dropped afterwards."""
    monkeypatch.setattr(seeds, "_STREAMS", dict(seeds._STREAMS))


def points(s: seeds.Stream):
    return product(SEEDS, *(GRID[p] for p in s.parts))


def rng_state(rng: np.random.Generator) -> int:
    return rng.bit_generator.state["state"]["state"]


def test_the_platform_and_algorithm_streams_are_declared_and_no_two_share_a_tag():
    found = seeds.streams()
    assert {"model/init", "client/train", "coordinator/sample", "data/split", "fedcross/shuffle",
            "fedl2g/quiz", "lgfedavg/header"} <= set(found)  # fmt: skip
    for a, b in product(found.values(), repeat=2):
        if a.name < b.name:
            assert not a.meets(b), f"{a.describe()} ({a.name}) and {b.describe()} ({b.name})"
    keys = [(s.derivation, len(s.parts), s.tag) for s in found.values()]
    assert len(keys) == len(set(keys))


def test_no_two_streams_give_the_same_seed_or_generator_over_a_grid():
    owner: dict[int, str] = {}  # derive_seed streams: the int seed
    state: dict[int, str] = {}  # every stream: the numpy generator it seeds
    for s in seeds.streams().values():
        for seed, *parts in points(s):
            if s.derivation == "derive_seed":
                value = seed_of(s.name, seed, *parts)
                assert owner.setdefault(value, s.name) == s.name, f"{s.name} at {seed, *parts}"
            st = rng_state(numpy_rng(s.name, seed, *parts))
            assert state.setdefault(st, s.name) == s.name, f"{s.name} at {seed, *parts}"
    assert len(owner) > 10_000 and len(state) > 10_000


def test_todays_streams_keep_their_numbers():
    for seed, rnd, client in product((0, 7, 2**31 - 1), (0, 3, 19), (0, 5, 49)):
        pinned = {
            seed_of("model/init", seed, client): old_derive_seed(seed, client, 0),
            seed_of("client/data_order", seed, rnd, client): old_derive_seed(seed, rnd, client, 1),
            seed_of("client/train", seed, rnd, client): old_derive_seed(seed, rnd, client, 2),
            seed_of("client/augment", seed, rnd, client): old_derive_seed(seed, rnd, client, 3),
            seed_of("coordinator/sample", seed, rnd): old_derive_seed(seed, rnd, 3),
            seed_of("coordinator/server_init", seed): old_derive_seed(seed, 4),
            seed_of("coordinator/eval_sample", seed, rnd): old_derive_seed(seed, rnd, 5),
            seed_of("lgfedavg/header", seed): old_derive_seed(seed, 4, 1),
            seed_of("fedl2g/guide_init", seed): old_derive_seed(seed, 11),
            seed_of("fedl2g/quiz", seed, client): old_derive_seed(seed, client, 13),
            seed_of("fedl2g/study_batch", seed, rnd, client): old_derive_seed(seed, rnd, client, 7),
        }
        for new, old in pinned.items():
            assert new == old
        # the coordinator samples with numpy from the int; the data layer with SeedSequence words
        assert rng_state(numpy_rng("coordinator/sample", seed, rnd)) == rng_state(
            np.random.default_rng(old_derive_seed(seed, rnd, 3))
        )
        for name, words in [("data/partition", [seed, 1]), ("data/long_tail", [seed, 2]),
                            ("data/split", [seed, 3, client]), ("data/subset", [seed, 4]),
                            ("data/official_test", [seed, 5])]:  # fmt: skip
            parts = (client,) if name == "data/split" else ()
            assert rng_state(numpy_rng(name, seed, *parts)) == rng_state(np.random.default_rng(words))
        gen = torch_generator("fedl2g/quiz", seed, client)
        assert torch.equal(
            torch.randperm(30, generator=gen),
            torch.randperm(30, generator=torch.Generator().manual_seed(old_derive_seed(seed, client, 13))),
        )


def test_the_fedcross_shuffle_no_longer_shares_the_evaluation_samples_seed():
    tag = zlib.crc32(b"fedcross/shuffle") & 0x7FFFFFFF  # a new stream's tag comes from its name
    for seed, rnd in product(SEEDS, GRID["rnd"]):
        shuffle = seed_of("fedcross/shuffle", seed, rnd)
        assert shuffle == old_derive_seed(seed, rnd, tag)
        assert shuffle != old_derive_seed(seed, rnd, 5) == seed_of("coordinator/eval_sample", seed, rnd)
        assert shuffle != seed_of("coordinator/sample", seed, rnd)


def test_declaring_a_name_twice_raises_naming_both(scratch):
    stream("test/once", "rnd")
    stream("test/once", "rnd")  # the same module declaring it again: a re-import
    with pytest.raises(ValueError, match=r"'test/once' declared twice") as err:
        stream("test/once", "rnd", "client")
    assert "in test_seeds" in str(err.value)  # the declaring module
    with pytest.raises(ValueError, match=r"declared twice.*in elsewhere$") as err:
        exec('stream("test/once", "rnd")', {"__name__": "elsewhere", "stream": stream})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("declare", "other"),
    [
        (lambda: stream("test/shuffle", "rnd", tag=5), "coordinator/eval_sample"),  # FedCross's old tag
        (lambda: stream("test/header", "rnd", tag=1), "lgfedavg/header"),  # rnd = 4 gives (seed, 4, 1)
        (lambda: stream("test/init", "client", tag=0), "model/init"),
        (lambda: stream("test/data", tag=3, seed_sequence=True), "data/split"),  # [s, 3] is [s, 3, 0]
    ],
)
def test_a_stream_that_would_draw_like_another_raises_naming_both(scratch, declare, other):
    with pytest.raises(ValueError, match=rf"collides with '{other}'") as err:
        declare()
    assert "'test/" in str(err.value) and "\n" not in str(err.value)


def test_a_stream_on_another_derivation_or_another_length_does_not_collide(scratch):
    stream("test/numpy", tag=16, seed_sequence=True)
    stream("test/four", "rnd", "client", tag=5)  # (seed, rnd, client, 5) never has coordinator's length


def test_malformed_declarations_raise():
    with pytest.raises(ValueError, match="owner/purpose"):
        stream("Shuffle")
    with pytest.raises(ValueError, match="non-zero"):
        stream("test/zero", tag=0, seed_sequence=True)


def test_an_undeclared_name_or_a_wrong_call_raises_one_line():
    with pytest.raises(ValueError, match=r"'nobody/declared' is not declared"):
        seed_of("nobody/declared", 0, 1)
    with pytest.raises(ValueError, match=r"takes seed, rnd, client; got 1 part"):
        torch_generator("client/train", 0, 1)
    with pytest.raises(ValueError, match="use numpy_rng"):
        seed_of("data/split", 0, 1)
