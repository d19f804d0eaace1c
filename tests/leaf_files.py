"""Small but realistic LEAF trees for tests: FEMNIST, Shakespeare and Sent140 as LEAF's ``preprocess.sh``
leaves them, written into a temporary folder (nothing is downloaded).

Each ``write_<task>(root, ...)`` returns the task's ``data/`` folder (``<root>/<task>/data``), the one to
pass as ``data.root``::

    from leaf_files import write_femnist
    root = write_femnist(tmp_path, users=6, per_user=(20, 40), layout="split")
    cfg = DataConfig(dataset="femnist", root=str(root), num_clients=6, partition=PartitionConfig(kind="natural"))

Layouts:

``"split"``
    ``train/`` and ``test/``, two files each (the users halved between them), each user's samples split
    as LEAF's ``split_data.py --by_sample`` (``-t sample --tf train_fraction``) splits them, quirks
    included: a user too small to hold a sample out is dropped, Shakespeare's held-out windows start 79
    windows after its train windows, and its ``test/`` ``num_samples`` overstate them by those 79.
``"all_data"`` (or ``"sampled_data"``, ``"rem_user_data"``)
    the unsplit files, two of them, in that folder.

Users are named the way LEAF's are (writer ids, ``PLAY_ROLE`` names, Twitter handles) and listed in an
order that is not alphabetical, their sizes drawn from ``per_user`` and their labels non-IID. The
defaults make a few hundred samples (Shakespeare: a few thousand short windows) and write in well
under a second. ``read_folder`` reads a folder back for tests' independent checks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

Samples = dict[str, tuple[list[Any], list[Any]]]  # user -> (x list, y list), in file order

LAYOUTS = ("split", "all_data", "sampled_data", "rem_user_data")
SEQ_LEN = 80  # Shakespeare's windows


# ------------------------------------------------------------------------------------------ writing


def write_json(path: Path, users: Samples, num_samples: list[int] | None = None, **extra: Any) -> Path:
    """One LEAF file: ``users``, ``num_samples`` (default: the true counts), ``user_data``, ``extra`` keys
    (LEAF's ``hierarchies``) between them as LEAF orders them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"users": list(users), **extra}
    data["num_samples"] = num_samples if num_samples is not None else [len(y) for _, y in users.values()]
    data["user_data"] = {u: {"x": x, "y": y} for u, (x, y) in users.items()}
    path.write_text(json.dumps(data))
    return path


def leaf_split(
    users: Samples, train_fraction: float, seed: int, gap: int
) -> tuple[Samples, Samples, list[int], list[int]]:
    """LEAF's ``split_data.py --by_sample`` on each user: train and test samples (file order kept) and
    the ``num_samples`` LEAF writes (test: ``n - n_train``, which overstates Shakespeare's by ``gap``)."""
    rng = random.Random(seed)
    train: Samples = {}
    test: Samples = {}
    n_train_list: list[int] = []
    n_test_list: list[int] = []
    for user, (xs, ys) in users.items():
        n = len(ys)
        if n < 2:
            continue
        n_train = 1 if n == 2 else max(1, int(train_fraction * n))
        if gap:
            train_idx, test_idx = list(range(n_train)), list(range(n_train + gap, n))
        else:
            train_idx = sorted(rng.sample(range(n), n_train))
            chosen = set(train_idx)
            test_idx = [i for i in range(n) if i not in chosen]
        if not train_idx or not test_idx:
            continue
        train[user] = ([xs[i] for i in train_idx], [ys[i] for i in train_idx])
        test[user] = ([xs[i] for i in test_idx], [ys[i] for i in test_idx])
        n_train_list.append(n_train)
        n_test_list.append(n - n_train)
    return train, test, n_train_list, n_test_list


def halves(users: Samples) -> list[Samples]:
    names = list(users)
    cut = (len(names) + 1) // 2
    return [{u: users[u] for u in names[:cut]}, {u: users[u] for u in names[cut:]}]


def write_tree(
    root: Path,
    task: str,
    users: Samples,
    layout: str = "split",
    train_fraction: float = 0.9,
    seed: int = 0,
    hierarchies: dict[str, str] | None = None,
) -> Path:
    """Lay ``users`` out under ``<root>/<task>/data`` as LEAF does (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {LAYOUTS}")
    data = Path(root) / task / "data"

    def extra(part: Samples) -> dict[str, Any]:
        return {"hierarchies": [hierarchies[u] for u in part]} if hierarchies else {}

    if layout != "split":
        for k, part in enumerate(halves(users)):
            write_json(data / layout / f"all_data_{k}.json", part, **extra(part))
        return data
    gap = SEQ_LEN - 1 if task == "shakespeare" else 0
    train, test, n_train, n_test = leaf_split(users, train_fraction, seed, gap)
    label = str(train_fraction)[2:]
    offset = 0
    for k, part in enumerate(halves(train)):
        counts = slice(offset, offset + len(part))
        offset += len(part)
        test_part = {u: test[u] for u in part}
        name = f"all_data_{k}_niid_05_keep_0"
        write_json(data / "train" / f"{name}_train_{label}.json", part, n_train[counts], **extra(part))
        write_json(data / "test" / f"{name}_test_{label}.json", test_part, n_test[counts], **extra(part))
    return data


def sizes(rng: np.random.Generator, users: int, per_user: tuple[int, int]) -> list[int]:
    low, high = per_user
    return [int(n) for n in rng.integers(low, high + 1, size=users)]


def unsorted(names: list[str], rng: np.random.Generator) -> list[str]:
    """The names in an order that is not alphabetical (so file order and sorted order differ)."""
    order = [names[i] for i in rng.permutation(len(names))]
    if len(order) > 1 and order == sorted(order):
        order[0], order[-1] = order[-1], order[0]
    return order


# ------------------------------------------------------------------------------------------ FEMNIST


def femnist_users(users: int = 6, per_user: tuple[int, int] = (20, 40), seed: int = 0) -> Samples:
    """Writers with 784 grey levels in [0, 1] per sample (white background 1.0, dark strokes: LEAF's
    colours, values k/255 as LEAF's ``vec / 255``) and labels 0..61 drawn from a few classes each."""
    rng = np.random.default_rng(seed)
    prototypes = rng.random((62, 28, 28)) < 0.12  # each class's strokes
    writers = rng.choice(4100, size=users, replace=False)
    names = unsorted([f"f{w:04d}_{int(rng.integers(0, 100)):02d}" for w in writers], rng)
    out: Samples = {}
    for name, n in zip(names, sizes(rng, users, per_user)):
        classes = rng.choice(62, size=5, replace=False)
        weights = rng.dirichlet(np.full(5, 0.5))
        labels = rng.choice(classes, size=n, p=weights)
        xs = []
        for label in labels:
            ink = prototypes[label] ^ (rng.random((28, 28)) < 0.03)
            grey = np.where(ink, rng.integers(0, 90, (28, 28)), 255)
            xs.append((grey.ravel() / 255).tolist())
        out[name] = (xs, [int(v) for v in labels])
    return out


def write_femnist(
    root: Path,
    users: int = 6,
    per_user: tuple[int, int] = (20, 40),
    layout: str = "split",
    seed: int = 0,
    train_fraction: float = 0.9,
) -> Path:
    """FEMNIST's ``data/`` folder (see :func:`femnist_users`)."""
    return write_tree(root, "femnist", femnist_users(users, per_user, seed), layout, train_fraction, seed)


# ------------------------------------------------------------------------------------------ Shakespeare

PLAYS = ["THE_TEMPEST", "HAMLET", "MACBETH", "KING_LEAR", "OTHELLO", "TWELFTH_NIGHT"]
ROLES = ["PROSPERO", "MIRANDA", "HORATIO", "LADY_MACBETH", "FOOL", "IAGO", "VIOLA", "FIRST_WITCH"]
WORDS = [
    "the",
    "and",
    "to",
    "of",
    "my",
    "I",
    "you",
    "that",
    "is",
    "in",
    "thou",
    "not",
    "with",
    "it",
    "me",
    "his",
    "be",
    "your",
    "this",
    "but",
    "he",
    "have",
    "thee",
    "lord",
    "king",
    "love",
    "good",
    "sir",
    "what",
    "shall",
    "so",
    "will",
    "O",
    "heaven",
    "night",
    "death",
    "sweet",
    "fair",
    "well",
    "come",
    "Come",
]
PUNCT = [",", ".", ";", ":", "!", "?", "'", "-"]


def role_text(rng: np.random.Generator, n_chars: int) -> str:
    """A role's lines (newlines already spaces, as LEAF leaves them): its own word preferences."""
    prefs = rng.dirichlet(np.full(len(WORDS), 0.3))
    pieces: list[str] = []
    length = 0
    while length <= n_chars:
        word = WORDS[rng.choice(len(WORDS), p=prefs)]
        if rng.random() < 0.15:
            word += PUNCT[rng.integers(len(PUNCT))]
        pieces.append(word)
        length += len(word) + 1
    return " ".join(pieces)[:n_chars]


def shakespeare_users(users: int = 4, per_user: tuple[int, int] = (850, 1100), seed: int = 0) -> Samples:
    """Roles whose samples are LEAF's windows of their text: ``x`` 80 characters, ``y`` the next one."""
    rng = np.random.default_rng(seed)
    names = unsorted([f"{PLAYS[i % len(PLAYS)]}_{ROLES[i % len(ROLES)]}" for i in range(users)], rng)
    out: Samples = {}
    for name, n in zip(names, sizes(rng, users, per_user)):
        text = role_text(rng, n + SEQ_LEN)
        out[name] = ([text[i : i + SEQ_LEN] for i in range(n)], [text[i + SEQ_LEN] for i in range(n)])
    return out


def write_shakespeare(
    root: Path,
    users: int = 4,
    per_user: tuple[int, int] = (850, 1100),
    layout: str = "split",
    seed: int = 0,
    train_fraction: float = 0.9,
) -> Path:
    """Shakespeare's ``data/`` folder (see :func:`shakespeare_users`). With ``--tf 0.9`` LEAF keeps a
    role only if it has more than about 800 windows (79 are dropped between train and test): hence
    the default sizes."""
    samples = shakespeare_users(users, per_user, seed)
    plays = {u: u.rsplit("_", 1)[0] for u in samples}
    return write_tree(root, "shakespeare", samples, layout, train_fraction, seed, hierarchies=plays)


# ------------------------------------------------------------------------------------------ Sent140

POSITIVE = ["love", "great", "happy", "awesome", "good", "fun", "thanks", "Yay"]
NEGATIVE = ["hate", "sad", "bad", "awful", "tired", "sick", "miss", "Ugh"]
NEUTRAL = [
    "the",
    "I",
    "today",
    "work",
    "going",
    "to",
    "is",
    "so",
    "my",
    "day",
    "don't",
    "can't",
    "it's",
    "a",
    "at",
    "in",
    "for",
    "with",
    "@friend",
    "http://t.co/x",
    "Today",
    "just",
    "now",
    "lol",
    "im",
    "of",
    "and",
    "new",
]


def tweet(rng: np.random.Generator, label: int) -> str:
    """A tweet of 3 to 34 words (some past LEAF's 25-word cap) with punctuation and mixed case."""
    mood = POSITIVE if label else NEGATIVE
    words = []
    for _ in range(int(rng.integers(3, 35))):
        pool = mood if rng.random() < 0.3 else NEUTRAL
        word = pool[rng.integers(len(pool))]
        if rng.random() < 0.15:
            word += [".", "!", "?", ",", "!!", ";"][rng.integers(6)]
        words.append(word)
    return " ".join(words)


def sent140_users(users: int = 6, per_user: tuple[int, int] = (10, 30), seed: int = 0) -> Samples:
    """Twitter users with LEAF's tweet records ``[id, date, query, user, text, "training"]`` and 0/1
    labels, each user with its own share of positive tweets."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz_0123456789")
    handles = ["".join(rng.choice(letters, size=int(rng.integers(5, 12)))) for _ in range(users)]
    names = unsorted([f"{h}{i}" for i, h in enumerate(handles)], rng)  # distinct
    out: Samples = {}
    tweet_id = 1467810369
    for name, n in zip(names, sizes(rng, users, per_user)):
        positive = float(rng.choice([0.1, 0.3, 0.5, 0.7, 0.9]))
        xs, ys = [], []
        for _ in range(n):
            label = int(rng.random() < positive)
            tweet_id += int(rng.integers(1, 500))
            date = f"Mon Apr 06 22:{int(rng.integers(60)):02d}:{int(rng.integers(60)):02d} PDT 2009"
            xs.append([str(tweet_id), date, "NO_QUERY", name, tweet(rng, label), "training"])
            ys.append(label)
        out[name] = (xs, ys)
    return out


def write_sent140(
    root: Path,
    users: int = 6,
    per_user: tuple[int, int] = (10, 30),
    layout: str = "split",
    seed: int = 0,
    train_fraction: float = 0.9,
) -> Path:
    """Sent140's ``data/`` folder (see :func:`sent140_users`)."""
    return write_tree(root, "sent140", sent140_users(users, per_user, seed), layout, train_fraction, seed)


def write_glove(path: Path, words: Iterable[str], dim: int = 6, seed: int = 0) -> Path:
    """A GloVe text file (``word v1 ... vdim`` a line) holding ``words`` in that order, plus words no
    tweet has, with random vectors."""
    rng = np.random.default_rng(seed)
    lines = [
        f"{w} " + " ".join(f"{v:.5f}" for v in rng.normal(size=dim)) for w in [*words, "zyzzyva", "quixotic"]
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ reading back


def read_folder(folder: Path) -> Samples:
    """Every user's ``(x, y)`` of a folder's JSON files, sorted files, users in file order."""
    out: Samples = {}
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        for user in data["users"]:
            out[user] = (data["user_data"][user]["x"], data["user_data"][user]["y"])
    return out
