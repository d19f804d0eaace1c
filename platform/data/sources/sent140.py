"""``sent140``: LEAF's Sentiment140, the sentiment of tweets (2 classes), one client per Twitter user.

The files are LEAF's (``leaf/data/sent140``, read by :mod:`.leaf`): each sample's ``x`` is the tweet's
record ``[id, date, query, user, text, "training"|"test"]`` (LEAF's ``data_to_json.py`` keeps the CSV
row after its polarity) and ``y`` is ``0`` (negative) or ``1`` (positive; LEAF maps Sentiment140's
polarity ``4`` to 1 and everything else to 0). Labels ``"0"``/``"1"`` as strings are read too.

Tokens, as LEAF's ``line_to_indices``: the text (index 4) is split by ``split_line``
(``re.findall(r"[\\w']+|[.,!?;]", text)``: words with their apostrophes, and ``. , ! ? ;`` as words of
their own; case kept, as LEAF keeps it) and cut to its first 25 words. Token ids, ``x`` int64
``[N, 25]``: ``0`` pads the tweet's end, ``1`` is a word outside the vocabulary, the vocabulary's
words are ``2, 3, ...``. (LEAF pads with its unknown id, ``len(vocab)``; the ids here differ, the
words known and unknown are the same.)

The vocabulary:

- without GloVe (the default): the ``data.leaf.vocab_size`` most frequent words of the TRAIN samples'
  tokens (ties alphabetical), so ``vocab_size + 2`` ids, the embeddings learned by the model
  (``bundle.embeddings`` is None). Ids past the words the data has stay unused.
- ``data.leaf.glove=<file>`` (GloVe's text format, ``word v1 v2 ...`` a line, e.g.
  ``glove.6B.300d.txt``): GloVe's words that occur in the data (train or test; a word the file lists
  twice keeps its first vector), in the file's order, and ``bundle.embeddings`` = float32
  ``[vocab_size, dim]``, rows 0 and 1 zeros, row ``i + 2`` the file's vector of word ``i``. The same words
  are known as in LEAF, whose vocabulary is the whole GloVe file. GloVe 6B is lower case and LEAF does
  not lower-case tweets, so there capitalised words are unknown: fedray keeps that.

Which LEAF and FedCross use: LEAF's paper and its Sent140 tutorial describe the reference model
(``models/sent140/stacked_lstm.py``, a 2-layer LSTM) as using pretrained 300-d GloVe
(``glove.6B.300d.txt``, fetched by ``models/sent140/get_embs.sh``); its code takes GloVe's vocabulary
and trains a fresh 100-d embedding table (the vectors it loads never enter the graph). The FedCross
paper (Hu et al.) does not say. fedray defaults to learned embeddings because GloVe is an ~800 MB
download (``glove.6B.zip``) that nothing may fetch at run time; with ``data.leaf.glove`` the vectors are
there for a model to use (frozen or as a start). A missing GloVe file is a one-line error.

Cost: with GloVe, :meth:`Sent140.info` loads the dataset (from the cache after the first time), since
the vocabulary is the data's words found in the file.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.config import DataConfig
from fedray.platform.data.sources.base import SourceInfo, register_source
from fedray.platform.data.sources.leaf import Arrays, LeafSource, SampleError, int_labels
from fedray.platform.errors import ConfigError

MAX_WORDS = 25  # LEAF's line_to_indices max_words (MODEL_PARAMS sent140.stacked_lstm seq_len)
TEXT = 4  # the tweet's text in LEAF's x record
PAD, UNKNOWN = 0, 1
RESERVED = 2  # ids before the vocabulary's words
WORD_RE = re.compile(r"[\w']+|[.,!?;]")  # LEAF's split_line


def split_line(line: str) -> list[str]:
    """LEAF's ``split_line``: words (with apostrophes) and ``. , ! ? ;``."""
    return WORD_RE.findall(line)


def top_words(tweets: Iterable[list[str]], size: int) -> list[str]:
    """The ``size`` most frequent words, ties broken alphabetically."""
    counts = Counter(w for words in tweets for w in words)
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def token_ids(tweets: Iterable[list[str]], index: dict[str, int]) -> np.ndarray:
    """``[N, 25]`` ids: each tweet's words through ``index`` (unknown: 1), padded with 0."""
    rows = list(tweets)
    out = np.full((len(rows), MAX_WORDS), PAD, dtype=np.int64)
    for r, words in enumerate(rows):
        out[r, : len(words)] = [index.get(w, UNKNOWN) for w in words]
    return out


def glove_path(cfg: DataConfig) -> Path | None:
    return Path(cfg.leaf.glove).expanduser() if cfg.leaf.glove else None


def read_glove(path: Path, wanted: set[str]) -> tuple[list[str], np.ndarray]:
    """The words of a GloVe text file that are in ``wanted`` (file order, first occurrence) and their
    vectors ``[W, dim]`` float32. Only those lines are parsed; a first line of two integers (word2vec's
    header) is skipped; lines whose word holds spaces (glove.840B has a few) are skipped."""
    words: list[str] = []
    vectors: list[np.ndarray] = []
    found: set[str] = set()
    dim = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not dim:
                parts = line.split()
                if lineno == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                    continue
                dim = len(parts) - 1
                if dim < 1:
                    raise ConfigError(f"data.leaf.glove={str(path)!r}: line {lineno} is not 'word v1 v2 ...'")
            word, _, rest = line.rstrip("\n").partition(" ")
            if word not in wanted or word in found:
                continue  # not a data word, or listed again: its first vector wins
            values = rest.split()
            if len(values) > dim:
                continue  # a word with spaces whose first piece is a data word
            if len(values) < dim:
                raise ConfigError(
                    f"data.leaf.glove={str(path)!r}: line {lineno} has {len(values)} values, the first "
                    f"vector {dim}"
                )
            try:
                vectors.append(np.asarray(values, dtype=np.float32))
            except ValueError:
                raise ConfigError(
                    f"data.leaf.glove={str(path)!r}: line {lineno} holds a non-number"
                ) from None
            words.append(word)
            found.add(word)
    if not dim:
        raise ConfigError(f"data.leaf.glove={str(path)!r}: the file holds no vectors")
    return words, np.stack(vectors) if vectors else np.zeros((0, dim), dtype=np.float32)


class Sent140(LeafSource):
    name = "sent140"
    task = "sent140"
    doc = "LEAF's Sentiment140: tweet sentiment (2 classes), one client per user; data.root=leaf/data/sent140/data, data.leaf.glove optional"
    modality = "text"

    def check(self, cfg: DataConfig) -> None:
        super().check(cfg)
        path = glove_path(cfg)
        if path is not None and not path.is_file():
            raise ConfigError(
                f"data.leaf.glove={cfg.leaf.glove!r}: no such file (GloVe's text format, e.g. glove.6B.300d.txt "
                "from nlp.stanford.edu/projects/glove; leave data.leaf.glove unset for learned embeddings)"
            )

    def num_classes(self, cfg: DataConfig) -> int:
        return len(self.class_names())

    def info(self, cfg: DataConfig) -> SourceInfo:
        """With GloVe the vocabulary is the GloVe words found in the data: known once it is decoded."""
        vocab_size = self.load(cfg).vocab_size if cfg.leaf.glove else RESERVED + cfg.leaf.vocab_size
        return SourceInfo(self.num_classes(cfg), modality="text", seq_len=MAX_WORDS, vocab_size=vocab_size)

    def provides_embeddings(self, cfg: DataConfig) -> bool:
        return cfg.leaf.glove is not None

    def class_names(self) -> list[str]:
        return ["negative", "positive"]

    def token_key(self, cfg: DataConfig) -> str:
        path = glove_path(cfg)
        if path is None:
            return f"-vocab{cfg.leaf.vocab_size}"
        # the file's size and time are in the cache's fingerprint (extra_files)
        return "-glove" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]

    def extra_files(self, cfg: DataConfig) -> list[Path]:
        path = glove_path(cfg)
        return [path] if path is not None else []

    def convert(self, xs: list[Any], ys: list[Any]) -> Arrays:
        y = int_labels(ys, 2, "LEAF's sentiment labels 0 (negative) and 1 (positive)")
        tweets = np.empty(len(xs), dtype=object)  # each sample's words, up to 25
        for i, record in enumerate(xs):
            if not isinstance(record, list) or len(record) <= TEXT or not isinstance(record[TEXT], str):
                raise SampleError(f"sample {i}: x is not LEAF's tweet record (its text at index {TEXT})")
            tweets[i] = split_line(record[TEXT])[:MAX_WORDS]
        return tweets, y

    def encode(
        self, cfg: DataConfig, train_x: list[np.ndarray], test_x: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        train = [words for part in train_x for words in part]
        test = [words for part in test_x for words in part]
        extra: dict[str, Any] = {}
        path = glove_path(cfg)
        if path is None:
            words = top_words(train, cfg.leaf.vocab_size)
            extra["vocab_size"] = RESERVED + cfg.leaf.vocab_size
        else:
            seen = {w for tweet in train + test for w in tweet}
            words, vectors = read_glove(path, seen)
            reserved = np.zeros((RESERVED, vectors.shape[1]), dtype=np.float32)
            extra["embeddings"] = torch.from_numpy(np.concatenate([reserved, vectors]))
            extra["vocab_size"] = RESERVED + len(words)
        extra["words"] = words  # id i + 2 is words[i]
        index = {w: RESERVED + i for i, w in enumerate(words)}
        return torch.from_numpy(token_ids(train, index)), torch.from_numpy(token_ids(test, index)), extra


register_source(Sent140())
