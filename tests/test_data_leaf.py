"""LEAF's FEMNIST, Shakespeare and Sent140 sources, on small LEAF trees written by ``leaf_files``.

Expected values are computed here from the JSON files themselves (LEAF's own rules re-written in the
test: its alphabet, ``split_line``, its per-user split sizes), not through the sources' code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from leaf_files import (
    femnist_users,
    read_folder,
    write_femnist,
    write_glove,
    write_json,
    write_sent140,
    write_shakespeare,
    write_tree,
)

from fedray.platform.config import DataConfig, LeafConfig, PartitionConfig, SplitConfig
from fedray.platform.data import build_federation, check_data
from fedray.platform.data.sources import (
    check_source,
    dataset_info,
    known_datasets,
    load_dataset,
    official_sizes,
    source_of,
)
from fedray.platform.data.sources import leaf as leaf_source
from fedray.platform.data.sources.femnist import FEMNIST
from fedray.platform.data.sources.shakespeare import Shakespeare
from fedray.platform.errors import ConfigError

pytestmark = pytest.mark.usefixtures("isolated_home")  # from conftest

# LEAF's models/utils/language_utils.py, copied here so the test does not read the source's copy
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def leaf_split_line(line: str) -> list[str]:
    return re.findall(r"[\w']+|[.,!?;]", line)  # LEAF's split_line


def leaf_sizes(n: int, fraction: float, gap: int = 0) -> tuple[int, int]:
    """LEAF's split_data.py --by_sample: train and held-out counts, (0, 0) for a dropped user."""
    if n < 2:
        return 0, 0
    n_train = 1 if n == 2 else max(1, int(fraction * n))
    test = len(range(n_train + gap, n))
    return (n_train, test) if test else (0, 0)


def cfg_for(dataset: str, root: Path, **kw) -> DataConfig:
    return DataConfig(dataset=dataset, root=str(root), **kw)


def natural_cfg(dataset: str, root: Path, num_clients: int, split=None, **leaf) -> DataConfig:
    return cfg_for(
        dataset,
        root,
        num_clients=num_clients,
        partition=PartitionConfig(kind="natural"),
        split=split or SplitConfig(),
        leaf=LeafConfig(**leaf),
    )


def one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, msg
    return msg


def touch_later(path: Path) -> None:
    """Move a file's mtime on, so the cache's fingerprint (size + whole-second mtime) sees an edit."""
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 5))


@pytest.fixture(scope="module")
def femnist_split(tmp_path_factory):
    return write_femnist(tmp_path_factory.mktemp("leaf"), users=6, per_user=(20, 40))


# ------------------------------------------------------------------------------------------ registry


def test_registered_natural_with_their_shapes(tmp_path):
    assert {"femnist", "shakespeare", "sent140"} <= set(known_datasets())
    for name in ("femnist", "shakespeare", "sent140"):
        source = source_of(DataConfig(dataset=name))
        assert source.natural and source.doc and "\n" not in source.doc
    info = dataset_info(DataConfig(dataset="femnist"))
    assert (info.num_classes, info.in_channels, info.image_size, info.modality) == (62, 1, 28, "image")
    info = dataset_info(DataConfig(dataset="shakespeare"))
    assert (info.num_classes, info.modality, info.seq_len, info.vocab_size) == (80, "text", 80, 82)
    info = dataset_info(DataConfig(dataset="sent140", leaf=LeafConfig(vocab_size=300)))
    assert (info.num_classes, info.modality, info.seq_len, info.vocab_size) == (2, "text", 25, 302)


# ------------------------------------------------------------------------------------------ FEMNIST


def test_femnist_split_files_read_user_by_user(femnist_split):
    cfg = cfg_for("femnist", femnist_split)
    bundle = load_dataset(cfg)
    train_json, test_json = read_folder(femnist_split / "train"), read_folder(femnist_split / "test")
    assert bundle.train.x.dtype == torch.uint8 and bundle.train.x.shape[1:] == (1, 28, 28)
    assert bundle.test.x.shape[1:] == (1, 28, 28)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (62, 1, 28)
    assert bundle.class_names[:11] == [*"0123456789", "A"] and bundle.class_names[36] == "a"
    assert len(bundle.class_names) == 62
    # the users, in the files' order (sorted file names, users in file order), not alphabetical
    assert [c.name for c in bundle.clients] == list(train_json) == list(test_json)
    assert list(train_json) != sorted(train_json)
    assert official_sizes(cfg) == (len(bundle.train), len(bundle.test))
    assert len(bundle.train) == sum(len(y) for _, y in train_json.values())
    n_train = len(bundle.train)
    for client in bundle.clients:
        xs, ys = train_json[client.name]
        assert bundle.take(client.train_ids).y.tolist() == ys
        pixels = [round(v * 255) for v in xs[-1]]  # LEAF's x is grey / 255
        assert bundle.take(client.train_ids[-1:]).x.flatten().tolist() == pixels
        xs, ys = test_json[client.name]
        assert (client.test_ids >= n_train).all()
        assert bundle.take(client.test_ids).y.tolist() == ys
        assert bundle.take(client.test_ids[:1]).x.flatten().tolist() == [round(v * 255) for v in xs[0]]
    ids = np.concatenate([np.concatenate([c.train_ids, c.test_ids]) for c in bundle.clients])
    assert sorted(ids.tolist()) == list(range(bundle.num_samples))  # disjoint, covering
    assert int(bundle.train.x.float().mean()) > 200  # LEAF's colours: white background


def test_all_data_is_split_per_user_with_leafs_sizes_from_a_fixed_seed(tmp_path):
    users = femnist_users(users=5, per_user=(20, 40), seed=3)
    sizes = [1, 2, 3, 25, 40]
    users = {u: (x[:n], y[:n]) for (u, (x, y)), n in zip(users.items(), sizes)}
    root = write_tree(tmp_path, "femnist", users, layout="all_data")
    raw = read_folder(root / "all_data")
    for fraction in (0.9, 0.5):
        cfg = cfg_for("femnist", root, leaf=LeafConfig(train_fraction=fraction))
        bundle = load_dataset(cfg)
        kept = [
            (u, leaf_sizes(len(y), fraction)) for u, (_, y) in raw.items() if leaf_sizes(len(y), fraction)[0]
        ]
        assert [c.name for c in bundle.clients] == [u for u, _ in kept]  # the 1-sample user is dropped
        assert [(len(c.train_ids), len(c.test_ids)) for c in bundle.clients] == [s for _, s in kept]
        assert official_sizes(cfg) == (len(bundle.train), len(bundle.test))
        for client in bundle.clients:
            xs, ys = raw[client.name]
            flat = [[round(v * 255) for v in x] for x in xs]
            # each sample is one of the user's, train and held-out disjoint, file order kept in each
            found = {}
            for part, ids in (("train", client.train_ids), ("test", client.test_ids)):
                rows = bundle.take(ids).x.flatten(1).tolist()
                found[part] = [flat.index(r) for r in rows]
                assert found[part] == sorted(found[part])
                assert bundle.take(ids).y.tolist() == [ys[i] for i in found[part]]
            assert sorted(found["train"] + found["test"]) == list(range(len(ys)))
        # the same held-out samples on every load, whatever the experiment seed
        for cache in (root / ".fedray_cache").glob(f"femnist-tf{fraction:g}-*.pt"):
            cache.unlink()  # decoded afresh
        again = load_dataset(cfg)
        torch.testing.assert_close(again.test.x, bundle.test.x)
        torch.testing.assert_close(again.train.y, bundle.train.y)
        tests = [
            [
                s.test_ids.tolist()
                for s in build_federation(
                    again,
                    natural_cfg(
                        "femnist", root, 4, SplitConfig(0.8, 0.2, 0, "official_test"), train_fraction=fraction
                    ),
                    seed,
                ).shards
            ]
            for seed in (0, 1)
        ]
        assert tests[0] == tests[1] == [c.test_ids.tolist() for c in again.clients]
    # each train fraction has its own cache file
    assert len(list((root / ".fedray_cache").glob("femnist-tf*.pt"))) == 2


def test_latest_unsplit_stage_wins(tmp_path):
    root = write_femnist(tmp_path, users=6, layout="all_data")
    write_femnist(tmp_path, users=3, layout="sampled_data", seed=1)  # LEAF's -s niid --sf output
    bundle = load_dataset(cfg_for("femnist", root))
    assert [c.name for c in bundle.clients] == list(read_folder(root / "sampled_data"))


# ------------------------------------------------------------------------------------------ Shakespeare


def test_shakespeare_split_files_and_leafs_num_samples_quirk(tmp_path):
    root = write_shakespeare(tmp_path, users=4)
    cfg = cfg_for("shakespeare", root)
    bundle = load_dataset(cfg)
    train_json, test_json = read_folder(root / "train"), read_folder(root / "test")
    # LEAF's test/ num_samples count the 79 dropped windows: the reader counts y instead
    head = json.loads(sorted((root / "test").glob("*.json"))[0].read_text())
    assert head["num_samples"][0] == len(head["user_data"][head["users"][0]]["y"]) + 79
    assert official_sizes(cfg) == (len(bundle.train), len(bundle.test))
    assert bundle.modality == "text" and bundle.train.x.dtype == torch.int64
    assert bundle.train.x.shape[1] == 80 == bundle.seq_len and bundle.vocab_size == 82
    assert bundle.num_classes == 80 and bundle.class_names[:3] == ["\\n", "space", "!"]
    assert bundle.embeddings is None
    for client in bundle.clients:
        for ids, (xs, ys) in (
            (client.train_ids, train_json[client.name]),
            (client.test_ids, test_json[client.name]),
        ):
            got = bundle.take(ids)
            assert got.y.tolist() == [LEAF_LETTERS.find(c) for c in ys]
            assert got.x[0].tolist() == [LEAF_LETTERS.find(c) + 2 for c in xs[0]]


def test_shakespeare_all_data_split_is_contiguous_with_leafs_gap(tmp_path):
    root = write_shakespeare(tmp_path, users=3, per_user=(700, 1000), layout="all_data")
    raw = read_folder(root / "all_data")
    bundle = load_dataset(cfg_for("shakespeare", root))
    kept = {u: leaf_sizes(len(y), 0.9, gap=79) for u, (_, y) in raw.items()}
    assert [c.name for c in bundle.clients] == [u for u, s in kept.items() if s[0]]
    for client in bundle.clients:
        xs, ys = raw[client.name]
        n_train, n_test = kept[client.name]
        assert (len(client.train_ids), len(client.test_ids)) == (n_train, n_test)
        first_test = n_train + 79  # LEAF: range(num_train + 80 - 1, n)
        assert bundle.take(client.train_ids).y.tolist() == [LEAF_LETTERS.find(c) for c in ys[:n_train]]
        assert bundle.take(client.test_ids).y.tolist() == [LEAF_LETTERS.find(c) for c in ys[first_test:]]
        first = bundle.take(np.array([client.train_ids[0], client.test_ids[0]])).x.tolist()
        assert first == [[LEAF_LETTERS.find(c) + 2 for c in xs[i]] for i in (0, first_test)]


def test_shakespeare_tokens_follow_leafs_alphabet(tmp_path):
    windows = [
        "To be, or not to be: that is the question! [Aside] 'Tis 3 times; > & } end." + " " * 4,
        "caf\u00e9 ~ $tilde and dollar are outside the alphabet; so are tabs\tand \u00e9 accents....",
    ]
    windows = [w[:80].ljust(80, ".") for w in windows]
    user = {"HAMLET_HAMLET": (windows * 2, ["q", "$", "}", "\n"])}
    root = tmp_path / "shakespeare" / "data"
    write_json(root / "train" / "a.json", user)
    write_json(root / "test" / "a.json", user)
    bundle = load_dataset(cfg_for("shakespeare", root))
    for row, window in zip(bundle.train.x.tolist(), windows * 2):
        leaf = [LEAF_LETTERS.find(c) for c in window]  # LEAF's word_to_indices
        assert row == [1 if i < 0 else i + 2 for i in leaf]
    assert 1 in bundle.train.x[1].tolist()  # the out-of-alphabet characters
    assert bundle.train.y.tolist() == [LEAF_LETTERS.find("q"), 79, 79, 0]  # '$' is LEAF's -1: the last class


def test_text_sources_refuse_image_options(tmp_path):
    root = write_shakespeare(tmp_path, users=2)
    with pytest.raises(ConfigError) as err:
        check_source(cfg_for("shakespeare", root, augment="crop_flip"))
    one_line(err, "data.augment=crop_flip", "shakespeare is text")
    with pytest.raises(ConfigError) as err:
        check_source(cfg_for("shakespeare", root, normalize="0.5,0.5"))
    one_line(err, "data.normalize='0.5,0.5'", "token ids")
    check_source(cfg_for("shakespeare", root))


# ------------------------------------------------------------------------------------------ Sent140


def sent140_tree(tmp_path: Path) -> tuple[Path, list[str], list[str]]:
    def record(text: str) -> list[str]:
        return ["1", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "someone", text, "training"]

    long = " ".join(f"w{i}" for i in range(30))
    train_texts = ["I love it!!! don't stop, ok?", long, "", "love love hate bad . bad"]
    test_texts = ["onlyintest love I", "Love hate"]
    root = tmp_path / "sent140" / "data"
    write_json(root / "train" / "a.json", {"ann": ([record(t) for t in train_texts], [1, 0, 0, "0"])})
    write_json(root / "test" / "a.json", {"ann": ([record(t) for t in test_texts], [1, "1"])})
    return root, train_texts, test_texts


def test_sent140_tokens_padding_unknown_and_the_25_word_cap(tmp_path):
    root, train_texts, test_texts = sent140_tree(tmp_path)
    assert leaf_split_line(train_texts[0]) == [
        "I",
        "love",
        "it",
        "!",
        "!",
        "!",
        "don't",
        "stop",
        ",",
        "ok",
        "?",
    ]
    cfg = cfg_for("sent140", root, leaf=LeafConfig(vocab_size=4))
    bundle = load_dataset(cfg)
    # vocabulary: the 4 most frequent train words (first 25 of each tweet), ties alphabetical
    counts: dict[str, int] = {}
    for text in train_texts:
        for w in leaf_split_line(text)[:25]:
            counts[w] = counts.get(w, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))[:4]
    assert words == ["!", "love", "bad", ","]
    ids = {w: i + 2 for i, w in enumerate(words)}
    assert bundle.vocab_size == 6 == dataset_info(cfg).vocab_size and bundle.seq_len == 25
    assert bundle.num_classes == 2 and bundle.class_names == ["negative", "positive"]
    assert bundle.embeddings is None
    for x, text in zip([*bundle.train.x.tolist(), *bundle.test.x.tolist()], train_texts + test_texts):
        tokens = [ids.get(w, 1) for w in leaf_split_line(text)[:25]]
        assert x == tokens + [0] * (25 - len(tokens))
    assert bundle.train.x[1].tolist() == [1] * 25  # 30 words, cut to 25, none known
    assert bundle.train.x[2].tolist() == [0] * 25  # empty tweet: all padding
    assert bundle.test.x[1].tolist()[:2] == [1, 1]  # case kept, as LEAF: "Love" is not "love"
    assert bundle.train.y.tolist() == [1, 0, 0, 0] and bundle.test.y.tolist() == [1, 1]
    # the vocabulary size is in the cache key
    other = load_dataset(cfg_for("sent140", root, leaf=LeafConfig(vocab_size=1)))
    assert other.vocab_size == 3 and other.train.x[0].tolist()[3:6] == [2, 2, 2]
    assert len(list((root / ".fedray_cache").glob("sent140-vocab*.pt"))) == 2


def test_sent140_glove_vocabulary_and_embeddings(tmp_path):
    root, _, _ = sent140_tree(tmp_path)
    glove = write_glove(tmp_path / "glove.txt", ["the", "love", "stop", "onlyintest", "I", "love"], dim=6)
    vectors = {}
    for line in glove.read_text().splitlines():
        word, *values = line.split(" ")
        vectors.setdefault(word, [float(v) for v in values])  # the first vector of a word
    cfg = cfg_for("sent140", root, leaf=LeafConfig(glove=str(glove)))
    bundle = load_dataset(cfg)
    # GloVe's words that occur in the data, in the file's order
    words = ["love", "stop", "onlyintest", "I"]
    assert bundle.vocab_size == 2 + len(words) == dataset_info(cfg).vocab_size
    emb = bundle.embeddings
    assert emb is not None and emb.dtype == torch.float32 and emb.shape == (6, 6)
    assert emb[:2].abs().sum() == 0
    for i, w in enumerate(words):
        torch.testing.assert_close(emb[i + 2], torch.tensor(vectors[w]))
    assert bundle.train.x[0].tolist()[:8] == [5, 2, 1, 1, 1, 1, 1, 3]  # I love it ! ! ! don't stop
    assert bundle.test.x[0].tolist()[:3] == [4, 2, 5]
    # editing the GloVe file invalidates the cache
    glove.write_text(glove.read_text().replace("stop ", "stoq "))
    touch_later(glove)
    assert load_dataset(cfg).vocab_size == 5


def test_sent140_missing_glove_file(tmp_path):
    root = write_sent140(tmp_path, users=2)
    cfg = cfg_for("sent140", root, leaf=LeafConfig(glove=str(tmp_path / "glove.6B.300d.txt")))
    for call in (check_source, load_dataset):
        with pytest.raises(ConfigError) as err:
            call(cfg)
        one_line(err, "data.leaf.glove=", "glove.6B.300d.txt", "no such file")


def test_sent140_generated_tree_reads(tmp_path):
    root = write_sent140(tmp_path, users=5, layout="all_data")
    bundle = load_dataset(cfg_for("sent140", root))
    raw = read_folder(root / "all_data")
    assert [c.name for c in bundle.clients] == list(raw)
    assert bundle.train.x.shape[1] == 25 and bundle.vocab_size == 10002
    assert set(bundle.labels().tolist()) == {0, 1}


# ------------------------------------------------------------------------------------------ federations


def user_ids(client) -> list[int]:
    return sorted(np.concatenate([client.train_ids, client.test_ids]).tolist())


@pytest.mark.parametrize(
    "split",
    [
        SplitConfig(0.8, 0.2, 0.0, "official_test"),
        SplitConfig(0.75, 0.0, 0.25),
        SplitConfig(0.6, 0.1, 0.3, "merged"),
    ],
    ids=lambda s: s.convention,
)
def test_natural_federation_gives_client_k_user_ks_samples(femnist_split, split):
    bundle = load_dataset(cfg_for("femnist", femnist_split))
    fed = build_federation(bundle, natural_cfg("femnist", femnist_split, 6, split), seed=0)
    assert fed.num_clients == 6 and fed.provenance["partition"] == "natural"
    for shard, user in zip(fed.shards, bundle.clients):
        train_val = sorted(np.concatenate([shard.train_ids, shard.val_ids]).tolist())
        everything = sorted(np.concatenate([shard.train_ids, shard.val_ids, shard.test_ids]).tolist())
        assert len(shard.train) > 0
        if split.convention == "official_test":
            assert train_val == sorted(user.train_ids.tolist())
            assert shard.test_ids.tolist() == user.test_ids.tolist()
        elif split.convention == "per_client":
            assert everything == sorted(user.train_ids.tolist())
        else:
            assert everything == user_ids(user)
        assert len(set(everything)) == len(everything)
        torch.testing.assert_close(shard.train.y, bundle.take(shard.train_ids).y)
    held_out = (
        np.concatenate([s.test_ids for s in fed.shards])
        if split.convention == "merged"
        else np.concatenate([u.test_ids for u in bundle.clients])
    )
    assert fed.global_test_ids.tolist() == sorted(held_out.tolist())


def test_fewer_clients_than_users_are_drawn_from_the_seed(femnist_split):
    bundle = load_dataset(cfg_for("femnist", femnist_split))
    by_ids = {tuple(u.test_ids.tolist()): k for k, u in enumerate(bundle.clients)}
    cfg = natural_cfg("femnist", femnist_split, 3, SplitConfig(0.8, 0.2, 0.0, "official_test"))

    def picked(seed: int) -> list[int]:
        return [by_ids[tuple(s.test_ids.tolist())] for s in build_federation(bundle, cfg, seed).shards]

    draws = [picked(seed) for seed in range(6)]
    assert all(len(d) == 3 and d == sorted(d) for d in draws)  # in the dataset's order
    assert picked(0) == draws[0]
    assert len({tuple(d) for d in draws}) > 1
    with pytest.raises(ConfigError) as err:
        build_federation(bundle, natural_cfg("femnist", femnist_split, 7), seed=0)
    one_line(err, "data.num_clients=7", "6 users", "at most 6")


def test_min_samples_drops_small_users(femnist_split):
    bundle = load_dataset(cfg_for("femnist", femnist_split))
    totals = [len(user_ids(u)) for u in bundle.clients]
    threshold = sorted(totals)[2]  # at least the two smallest fall below it
    big = [k for k, n in enumerate(totals) if n >= threshold]
    cfg = natural_cfg(
        "femnist", femnist_split, len(big), SplitConfig(0.8, 0.2, 0.0, "official_test"), min_samples=threshold
    )
    fed = build_federation(bundle, cfg, seed=0)
    assert [s.test_ids.tolist() for s in fed.shards] == [bundle.clients[k].test_ids.tolist() for k in big]
    with pytest.raises(ConfigError) as err:
        build_federation(
            bundle, natural_cfg("femnist", femnist_split, len(big) + 1, min_samples=threshold), seed=0
        )
    one_line(err, f"data.leaf.min_samples={threshold}")


def test_min_samples_counts_as_leafs_k_before_the_split(tmp_path):
    """LEAF's -k filters on a user's count before its split; Shakespeare's split drops 79 windows."""
    root = write_shakespeare(tmp_path, users=4)
    bundle = load_dataset(cfg_for("shakespeare", root))
    listed = {u: len(y) for u, (_, y) in read_folder(root / "train").items()}  # LEAF's train counts
    listed_test = {u: len(y) for u, (_, y) in read_folder(root / "test").items()}
    leaf_counts = [listed[u.name] + listed_test[u.name] + 79 for u in bundle.clients]
    assert [u.num_samples for u in bundle.clients] == leaf_counts
    smallest = min(leaf_counts)  # a user with exactly min_samples is kept, as LEAF's -k keeps it
    fed = build_federation(bundle, natural_cfg("shakespeare", root, 4, min_samples=smallest), seed=0)
    assert fed.num_clients == 4
    with pytest.raises(ConfigError) as err:
        build_federation(bundle, natural_cfg("shakespeare", root, 4, min_samples=smallest + 1), seed=0)
    one_line(err, "has 3 users with at least data.leaf.min_samples=")


@pytest.mark.parametrize(("task", "layout"), [("shakespeare", "split"), ("femnist", "all_data")])
def test_too_few_qualifying_users_is_found_before_any_sample_is_decoded(tmp_path, monkeypatch, task, layout):
    write = {"shakespeare": write_shakespeare, "femnist": write_femnist}[task]
    root = write(tmp_path, users=4, layout=layout)
    clients = load_dataset(cfg_for(task, root)).clients
    source = source_of(cfg_for(task, root))
    assert sorted(source.user_sizes(cfg_for(task, root))) == sorted(u.num_samples for u in clients)

    def no_decode(*_args):
        raise AssertionError("the pre-flight decoded the data")

    monkeypatch.setattr(leaf_source.LeafSource, "decode", no_decode)
    shutil.rmtree(root / ".fedray_cache")  # only the count index may be rebuilt, from the JSON
    threshold = sorted(u.num_samples for u in clients)[1]  # the smallest user falls below it
    check_data(natural_cfg(task, root, 3, min_samples=threshold))
    with pytest.raises(ConfigError) as err:
        check_data(natural_cfg(task, root, 4, min_samples=threshold))
    one_line(err, "data.num_clients=4", f"has 3 users with at least data.leaf.min_samples={threshold}")


def test_a_natural_client_left_without_training_samples_is_a_one_line_error(tmp_path):
    root = write_sent140(tmp_path, users=8, per_user=(2, 4))
    bundle = load_dataset(cfg_for("sent140", root))
    assert min(len(u.train_ids) for u in bundle.clients) == 1
    cfg = natural_cfg("sent140", root, len(bundle.clients), SplitConfig(0.5, 0.5, 0.0, "official_test"))
    with pytest.raises(ConfigError) as err:
        build_federation(bundle, cfg, seed=0)
    one_line(err, "has no training samples", "user '", "data.leaf.min_samples")


def test_glove_needs_a_model_that_takes_it_before_anything_loads(tmp_path, monkeypatch):
    from fedray.platform.catalog import load_config

    root = write_sent140(tmp_path, users=3)
    glove = write_glove(tmp_path / "glove.txt", ["the", "love"], dim=4)
    base = ["data.dataset=sent140", f"data.root={root}", f"data.leaf.glove={glove}"]

    def no_decode(*_args):
        raise AssertionError("config validation decoded the data")

    monkeypatch.setattr(leaf_source.LeafSource, "decode", no_decode)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "model.group=leaf_lstm"])
    one_line(err, "data.leaf.glove=", "model 'leaf_lstm' takes no pretrained embeddings", "sent140_lstm")
    cfg = load_config(
        None, [*base, "model.group=sent140_lstm", "data.num_clients=2", "data.partition.min_samples=2"]
    )
    check_data(cfg.data)  # the partition's pre-flight needs the classes, not the GloVe vocabulary


def test_natural_shakespeare_federation(tmp_path):
    root = write_shakespeare(tmp_path, users=3)
    bundle = load_dataset(cfg_for("shakespeare", root))
    fed = build_federation(bundle, natural_cfg("shakespeare", root, 3), seed=0)
    assert fed.modality == "text" and fed.vocab_size == 82 and fed.seq_len == 80
    for shard, user in zip(fed.shards, bundle.clients):
        assert set(shard.train_ids.tolist()) <= set(user.train_ids.tolist())


@pytest.mark.parametrize("kind", ["iid", "dirichlet"])
def test_other_partitioners_split_the_pooled_samples(femnist_split, kind):
    cfg = cfg_for(
        "femnist",
        femnist_split,
        num_clients=3,
        partition=PartitionConfig(kind=kind, alpha=1.0, min_samples=5),
    )
    check_data(cfg)
    bundle = load_dataset(cfg)
    fed = build_federation(bundle, cfg, seed=0)
    pooled = np.concatenate([np.concatenate([s.train_ids, s.val_ids, s.test_ids]) for s in fed.shards])
    assert sorted(pooled.tolist()) == list(range(len(bundle.train)))
    assert fed.global_test_ids.tolist() == list(range(len(bundle.train), bundle.num_samples))


def test_check_data_natural_needs_a_natural_dataset(femnist_split):
    with pytest.raises(ConfigError) as err:
        check_data(DataConfig(dataset="digits", partition=PartitionConfig(kind="natural")))
    one_line(err, "data.partition.kind=natural", "digits has no clients of its own")
    check_data(natural_cfg("femnist", femnist_split, 6))


# ------------------------------------------------------------------------------------------ the cache


def test_second_load_reads_the_cache_and_an_edit_invalidates_it(tmp_path, monkeypatch):
    root = write_femnist(tmp_path, users=4)
    cfg = cfg_for("femnist", root)
    first = load_dataset(cfg)

    def boom(self, xs, ys):
        raise AssertionError("decoded again")

    monkeypatch.setattr(FEMNIST, "convert", boom)
    again = load_dataset(cfg)
    torch.testing.assert_close(again.train.x, first.train.x)
    assert [c.name for c in again.clients] == [c.name for c in first.clients]
    for a, b in zip(again.clients, first.clients):
        assert a.train_ids.tolist() == b.train_ids.tolist() and a.test_ids.tolist() == b.test_ids.tolist()
    assert official_sizes(cfg) == (len(first.train), len(first.test))
    # edit one label of a train file
    path = sorted((root / "train").glob("*.json"))[0]
    data = json.loads(path.read_text())
    user = data["users"][0]
    data["user_data"][user]["y"][0] = 61
    path.write_text(json.dumps(data))
    touch_later(path)
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset(cfg)
    monkeypatch.undo()
    assert int(load_dataset(cfg).train.y[0]) == 61


def test_sizes_parse_without_decoding_then_read_the_index(tmp_path, monkeypatch):
    root = write_shakespeare(tmp_path, users=3, layout="all_data")
    cfg = cfg_for("shakespeare", root)

    def boom(self, xs, ys):
        raise AssertionError("decoded")

    monkeypatch.setattr(Shakespeare, "convert", boom)
    sizes = official_sizes(cfg)  # parses the files, converts nothing
    monkeypatch.setattr(leaf_source, "parse_file", lambda path: pytest.fail("parsed again"))
    assert official_sizes(cfg) == sizes  # the cached index
    monkeypatch.undo()
    bundle = load_dataset(cfg)
    assert sizes == (len(bundle.train), len(bundle.test))
    assert official_sizes(cfg_for("shakespeare", root, leaf=LeafConfig(train_fraction=0.95))) != sizes


# ------------------------------------------------------------------------------------------ errors


def test_missing_root_and_folders_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_source(DataConfig(dataset="femnist"))
    one_line(err, "data.root is not set", "femnist")
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("sent140", tmp_path / "nowhere"))
    one_line(err, "no such folder")
    task = tmp_path / "femnist"
    (task / "data").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        check_source(cfg_for("femnist", task))
    one_line(err, "no LEAF files", "did you mean", str(task / "data"))
    root = write_femnist(tmp_path, users=2)
    shutil.rmtree(root / "test")
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("femnist", root))
    one_line(err, str(root / "test"), "is missing")
    (root / "test").mkdir()
    with pytest.raises(ConfigError) as err:
        official_sizes(cfg_for("femnist", root))
    one_line(err, str(root / "test"), "has no .json files")


def corrupt(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "problem, edit, message",
    [
        ("truncated", None, "not valid JSON"),
        ("no user_data", lambda d: d.pop("user_data"), "has no 'user_data' object"),
        ("no x", lambda d: d["user_data"][d["users"][0]].pop("x"), "has no 'x' and 'y' lists"),
        ("x/y lengths", lambda d: d["user_data"][d["users"][0]]["y"].pop(), "x but"),
        ("unlisted", lambda d: d["users"].append("ghost"), "'ghost' is listed in 'users' but has no entry"),
        ("pixels", lambda d: d["user_data"][d["users"][0]]["x"][1].pop(), "784 numbers per sample"),
        (
            "0..255",
            lambda d: d["user_data"][d["users"][0]]["x"][0].__setitem__(0, 255),
            "LEAF's lie in [0, 1]",
        ),
        (
            "label",
            lambda d: d["user_data"][d["users"][0]]["y"].__setitem__(0, 62),
            "is not one of FEMNIST's classes",
        ),
    ],
)
def test_corrupt_json_is_a_one_line_error_naming_the_file(tmp_path, problem, edit, message):
    root = write_femnist(tmp_path, users=2)
    path = sorted((root / "train").glob("*.json"))[0]
    if edit is None:
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
    else:
        corrupt(path, edit)
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("femnist", root))
    one_line(err, str(path), message)


def test_users_must_match_between_train_and_test(tmp_path):
    root = write_femnist(tmp_path, users=4)
    path = sorted((root / "test").glob("*.json"))[0]
    gone = json.loads(path.read_text())["users"][0]

    def drop(d):
        d["users"].remove(gone)
        d["num_samples"].pop(0)

    corrupt(path, drop)
    for call in (load_dataset, official_sizes):
        with pytest.raises(ConfigError) as err:
            call(cfg_for("femnist", root))
        one_line(err, f"train/ lists user {gone!r} that test/ lacks", "-t sample")


def test_text_sample_errors(tmp_path):
    root = write_shakespeare(tmp_path, users=2)
    path = sorted((root / "train").glob("*.json"))[0]
    corrupt(path, lambda d: d["user_data"][d["users"][0]]["x"].__setitem__(3, "too short"))
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("shakespeare", root))
    one_line(err, str(path), "sample 3: x has 9 characters")
    root = write_sent140(tmp_path, users=2)
    path = sorted((root / "test").glob("*.json"))[0]
    corrupt(path, lambda d: d["user_data"][d["users"][0]]["y"].__setitem__(0, 4))
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("sent140", root))
    one_line(err, str(path), "label 4 is not one of LEAF's sentiment labels")

    def text_only(d):
        d["user_data"][d["users"][0]]["y"][0] = 0
        d["user_data"][d["users"][0]]["x"][0] = "just text"

    corrupt(path, text_only)
    with pytest.raises(ConfigError) as err:
        load_dataset(cfg_for("sent140", root))
    one_line(err, str(path), "not LEAF's tweet record")
