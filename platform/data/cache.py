"""The decoded-dataset cache: a source's arrays saved once, keyed by a fingerprint of its files.

Files go to ``<root>/.fedray_cache/<key>-<fingerprint>.pt`` (or ``~/.cache/fedray/<root-hash>/`` when
the root is read-only). The fingerprint hashes the source files' relative paths, sizes and modification
times, so editing, adding or removing a file invalidates the cache. The key is the source's
(:meth:`~fedray.platform.data.sources.base.Source.cache_key`): its name, plus any option that changes
what is decoded (an image size, a user filter).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedray.platform.data.bundle import ArrayDataset, DatasetBundle, make_bundle

CACHE_VERSION = 1  # bump when the cache layout changes: old files are then ignored


def fingerprint(root: Path, files: Sequence[str | Path]) -> str:
    """Hash of the files' relative paths, sizes and mtimes: changes whenever the contents change.

    Plain strings and ``os.stat``: pathlib costs seconds on 60k files.
    """
    h = hashlib.sha1(f"fedray-cache-v{CACHE_VERSION}\n".encode())
    for path in sorted(map(str, files)):
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, root)}\t{st.st_size}\t{int(st.st_mtime)}\n".encode())
    return h.hexdigest()[:16]


def cache_candidates(root: Path, key: str, digest: str) -> list[Path]:
    """Preferred cache file under the root, then the per-user fallback for read-only roots."""
    filename = f"{key}-{digest}.pt"
    root_key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    return [
        root / ".fedray_cache" / filename,
        Path.home() / ".cache" / "fedray" / root_key / filename,
    ]


def read_cache(paths: Sequence[Path]) -> dict[str, Any] | None:
    for path in paths:
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception as err:  # a truncated or foreign file: decode again and overwrite it
                warnings.warn(f"ignoring unreadable dataset cache {path}: {err}", stacklevel=2)
    return None


def write_cache(paths: Sequence[Path], payload: dict[str, Any]) -> Path | None:
    """Write atomically (temp file + rename) to the first writable location."""
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    torch.save(payload, fh)
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; others may read the same dataset root
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return path
        except OSError:
            continue
    warnings.warn(f"could not write a dataset cache to any of {[str(p) for p in paths]}", stacklevel=2)
    return None


def cached(
    root: Path, key: str, files: Sequence[str | Path], decode: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Return the cached arrays for these source files, decoding (and caching) them on a miss."""
    candidates = cache_candidates(root, key, fingerprint(root, files))
    payload = read_cache(candidates)
    if payload is None:
        payload = decode()
        write_cache(candidates, payload)
    return payload


def bundle_from_payload(name: str, payload: dict[str, Any], paths: list[str] | None = None) -> DatasetBundle:
    """The bundle of a decoded (or cached) payload: ``train_x``, ``train_y``, ``test_x``, ``test_y``,
    ``class_names`` and, optionally, ``train_paths``/``test_paths`` (``paths`` is the fallback for
    caches written without them) and ``vocab_size`` (text)."""
    train = ArrayDataset(payload["train_x"], payload["train_y"])
    test = ArrayDataset(payload["test_x"], payload["test_y"])
    bundle = make_bundle(
        name, train, test, list(payload["class_names"]), vocab_size=int(payload.get("vocab_size", 0))
    )
    if "train_paths" in payload:
        paths = [*payload["train_paths"], *payload["test_paths"]]
    if paths is not None and len(paths) != bundle.num_samples:
        raise ValueError(f"{len(paths)} sample paths for {bundle.num_samples} samples")
    bundle.paths = paths
    return bundle
