"""``shakespeare``: LEAF's Shakespeare, next-character prediction, one client per speaking role.

The files are LEAF's (``leaf/data/shakespeare``, read by :mod:`.leaf`): each sample's ``x`` is an
80-character window of a role's lines (newlines already turned into spaces by LEAF), ``y`` the
character that follows it.

Classes. LEAF's 80-symbol alphabet (``ALL_LETTERS`` in LEAF's ``models/utils/language_utils.py``), in
its order: class ``i`` is ``ALL_LETTERS[i]``, as LEAF's ``letter_to_vec`` numbers it; the class names
are the characters, with ``\\n`` and ``space`` spelled out. A target outside the alphabet is class 79
(``}``), which is what LEAF's ``letter_to_vec`` gives it (``find`` returns -1, the last class).

Token ids (``x``, int64 ``[N, 80]``): ``0`` pads (never used: every window is full), ``1`` is a character
outside the alphabet, and ``ALL_LETTERS[i]`` is ``i + 2``: the same reserved ids as ``sent140``, 82 ids
in all. (LEAF's ``word_to_indices`` gives out-of-alphabet characters -1, which its TensorFlow embedding
lookup rejects on CPU; LEAF's own files hold none.)

Unsplit files: a role's first windows train and its held-out windows start 79 windows later (see
:mod:`.leaf`), as LEAF's ``split_data.py`` does for Shakespeare.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedray.platform.config import DataConfig
from fedray.platform.data.sources.base import SourceInfo, register_source
from fedray.platform.data.sources.leaf import Arrays, LeafSource, SampleError

# LEAF's models/utils/language_utils.py, verbatim
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80  # LEAF's shake_utils: seq_length
PAD, UNKNOWN = 0, 1
RESERVED = 2  # ids before the alphabet's
VOCAB_SIZE = RESERVED + len(ALL_LETTERS)
OUT_OF_ALPHABET_CLASS = len(ALL_LETTERS) - 1  # LEAF: letter_to_vec(c) with find(c) == -1


def ascii_table(values: list[int], outside: int) -> np.ndarray:
    """Character code -> ``values[i]`` for ``ALL_LETTERS[i]`` (all ASCII), ``outside`` for the others."""
    table = np.full(128, outside, dtype=np.int64)
    table[[ord(c) for c in ALL_LETTERS]] = values
    return table


TOKEN_OF = ascii_table([RESERVED + i for i in range(len(ALL_LETTERS))], UNKNOWN)
CLASS_OF = ascii_table(list(range(len(ALL_LETTERS))), OUT_OF_ALPHABET_CLASS)


def class_name(c: str) -> str:
    return {"\n": "\\n", " ": "space"}.get(c, c)


def lookup(text: str, table: np.ndarray, outside: int) -> np.ndarray:
    """Each character of ``text`` through ``table`` (indexed by code point), ``outside`` past ASCII."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    out = np.full(len(codes), outside, dtype=np.int64)
    ascii_ = codes < len(table)
    out[ascii_] = table[codes[ascii_]]
    return out


def char_tokens(text: str) -> np.ndarray:
    """Token ids of a string (see the module docstring)."""
    return lookup(text, TOKEN_OF, UNKNOWN)


def char_classes(text: str) -> np.ndarray:
    """Classes of each character of a string (see the module docstring)."""
    return lookup(text, CLASS_OF, OUT_OF_ALPHABET_CLASS)


def lengths(values: list[Any], what: str) -> np.ndarray:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise SampleError(f"sample {i}: {what} is {type(v).__name__}, not a string")
    return np.fromiter(map(len, values), dtype=np.int64, count=len(values))


class Shakespeare(LeafSource):
    name = "shakespeare"
    task = "shakespeare"
    doc = "LEAF's Shakespeare: next character of 80-character windows (80 classes), one client per role; data.root=leaf/data/shakespeare/data"
    modality = "text"
    gap = SEQ_LEN - 1
    contiguous = True

    def info(self, cfg: DataConfig) -> SourceInfo:
        return SourceInfo(len(ALL_LETTERS), modality="text", seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)

    def class_names(self) -> list[str]:
        return [class_name(c) for c in ALL_LETTERS]

    def convert(self, xs: list[Any], ys: list[Any]) -> Arrays:
        x_len, y_len = lengths(xs, "x"), lengths(ys, "y")
        bad = np.flatnonzero(x_len != SEQ_LEN)
        if bad.size:
            i = int(bad[0])
            raise SampleError(f"sample {i}: x has {x_len[i]} characters, LEAF's windows have {SEQ_LEN}")
        bad = np.flatnonzero(y_len != 1)
        if bad.size:
            i = int(bad[0])
            raise SampleError(f"sample {i}: y is {ys[i]!r}, not one character")
        x = char_tokens("".join(xs)).reshape(len(xs), SEQ_LEN)
        return x, char_classes("".join(ys))

    def encode(
        self, cfg: DataConfig, train_x: list[np.ndarray], test_x: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        train, test, _ = super().encode(cfg, train_x, test_x)
        return train, test, {"vocab_size": VOCAB_SIZE}


register_source(Shakespeare())
