"""The run's storage path: checkpoints live where any node of a cluster can read them back.

A storage path is a local directory (the default, ``.fedray``), a shared directory, or a
``pyarrow.fs`` URI such as ``s3://bucket/fedray`` or ``gs://...``, as Ray Tune's ``storage_path``.
The driver resolves a relative local path against its own working directory before the path
travels, so the Coordinator writes to the same place on whatever node it lands.
"""

from __future__ import annotations

import io
import posixpath
from pathlib import Path
from typing import Any

import torch


def resolve(path: str) -> str:
    """An absolute local path or a URI unchanged: the form every node reads the same way."""
    if "://" in path:
        return path.rstrip("/")
    return str(Path(path).expanduser().resolve())


def _filesystem(uri: str):
    from pyarrow import fs

    if "://" not in uri:
        return fs.LocalFileSystem(), uri
    return fs.FileSystem.from_uri(uri)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if "://" in base else str(Path(base, *parts))


def make_dirs(uri: str) -> None:
    filesystem, path = _filesystem(uri)
    filesystem.create_dir(path, recursive=True)


def exists(uri: str) -> bool:
    from pyarrow import fs

    filesystem, path = _filesystem(uri)
    return filesystem.get_file_info(path).type != fs.FileType.NotFound


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: to a temporary name first, then renamed over ``uri`` (object stores write
    whole objects, so the rename there is a copy of a complete file)."""
    filesystem, path = _filesystem(uri)
    filesystem.create_dir(posixpath.dirname(path) or ".", recursive=True)
    tmp = f"{path}.tmp"
    with filesystem.open_output_stream(tmp) as out:
        out.write(data)
    filesystem.move(tmp, path)


def delete(uri: str) -> None:
    filesystem, path = _filesystem(uri)
    filesystem.delete_file(path)


def read_bytes(uri: str) -> bytes:
    filesystem, path = _filesystem(uri)
    with filesystem.open_input_stream(path) as src:
        return src.read()


def save_torch(obj: Any, uri: str) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(uri, buffer.getvalue())


def load_torch(uri: str) -> Any:
    # map_location: a checkpoint written next to a GPU loads on a machine without one
    return torch.load(io.BytesIO(read_bytes(uri)), map_location="cpu", weights_only=False)
