"""The run's storage path: checkpoints live where any node of a cluster can read them back.

A storage path is a local directory (the default, ``.fedray``), a shared directory, or a
``pyarrow.fs`` URI such as ``s3://bucket/fedray`` or ``gs://...``, as Ray Tune's ``storage_path``.
The driver resolves a relative local path against its own working directory before the path
travels, so the Coordinator writes to the same place on whatever node it lands.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pickle
import posixpath
import re
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.errors import CheckpointError, ContractError, first_line

logger = logging.getLogger(__name__)


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


def local_path(uri: str) -> str | None:
    """The path on this machine's filesystem of a local ``uri`` (a plain path, ``file://`` or
    ``local://``), or None for an object store's (without asking it: s3's may look up a region)."""
    if "://" not in uri:
        return uri
    if not uri.startswith(("file://", "local://")):
        return None
    return _filesystem(uri)[1]  # pyarrow's reading of the URI's path (its LocalFileSystem)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if "://" in base else str(Path(base, *parts))


def make_dirs(uri: str) -> None:
    filesystem, path = _filesystem(uri)
    filesystem.create_dir(path, recursive=True)


def exists(uri: str) -> bool:
    from pyarrow import fs

    filesystem, path = _filesystem(uri)
    return filesystem.get_file_info(path).type != fs.FileType.NotFound


PARTIAL = ".tmp"  # a write's temporary name ends so: one still there was cut short (its process killed)


def write_bytes(uri: str, data: bytes | memoryview, parents: bool = True, durable: bool = False) -> None:
    """Write atomically: to a temporary name first, then renamed over ``uri`` (object stores write
    whole objects, so the rename there is a copy of a complete file). ``durable``: on the disk, not
    only in the page cache, when this returns (:func:`flush_to_disk`), the file before its rename."""
    from pyarrow import fs

    filesystem, path = _filesystem(uri)
    if parents:
        filesystem.create_dir(posixpath.dirname(path) or ".", recursive=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}{PARTIAL}"  # its own: two writers of one file never share a name
    flush = durable and isinstance(filesystem, fs.LocalFileSystem)  # an upload is durable as it returns
    try:
        with filesystem.open_output_stream(tmp) as out:
            out.write(data)
        if flush:
            _fsync(tmp)
        filesystem.move(tmp, path)
    except BaseException:  # a full disk, a refused upload: no half-written file left behind
        with contextlib.suppress(Exception):
            filesystem.delete_file(tmp)
        raise
    if flush:
        _fsync(os.path.dirname(path))  # the rename


def flush_to_disk(uris: Iterable[str], files: bool = True, folders: bool = True) -> None:
    """Local files and the folders that hold them forced to the disk (``fsync``): a rename makes a
    write atomic against a killed process, not against the host's crash, after which a file renamed
    but not yet flushed may be found empty, or missing. An object store's upload is durable once it
    returns: only a local filesystem's paths (``file://`` too) are flushed."""
    local = [path for path in map(local_path, uris) if path is not None]
    for path in (local if files else []) + sorted({os.path.dirname(p) for p in local} if folders else []):
        _fsync(path)


# what a filesystem that cannot flush (some FUSE and network mounts, a folder on Windows) answers:
# it gives no more durability than it has, and a checkpoint is not failed for it
CANNOT_FLUSH = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR}


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)  # a folder too: its fsync makes the renames into it last
    except OSError as err:
        if err.errno in CANNOT_FLUSH:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in CANNOT_FLUSH:
            raise
    finally:
        os.close(fd)


def names_in(uri: str) -> list[str]:
    """The names of the files directly in the folder ``uri`` (none if it is not there)."""
    from pyarrow import fs

    filesystem, path = _filesystem(uri)
    infos = filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
    return [info.base_name for info in infos if info.type == fs.FileType.File]


def clean_up(uri: str, doomed: Callable[[str], bool], what: str) -> None:
    """Delete the files directly in the folder ``uri`` whose names ``doomed`` picks. Best effort: a
    folder that cannot be listed (an object store without the right to list) is a warning naming
    ``what`` was left."""
    try:
        names = names_in(uri)
    except Exception as err:
        logger.warning("%s not cleaned up: %s", what, first_line(err))
        return
    for name in names:
        if doomed(name):
            delete_if_there(join(uri, name))


def delete(uri: str) -> None:
    filesystem, path = _filesystem(uri)
    filesystem.delete_file(path)


def delete_if_there(uri: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        delete(uri)


def read_bytes(uri: str) -> bytes:
    filesystem, path = _filesystem(uri)
    with filesystem.open_input_stream(path) as src:
        return src.read()


# what a checkpoint may hold: torch.load(weights_only=True) rebuilds these and runs no other code
PLAIN = (torch.Tensor, int, float, str, bool, bytes, type(None), torch.Size, torch.dtype, torch.device)


def check_plain(obj: Any, where: str) -> None:
    """ContractError naming the first value in ``obj`` that is not a tensor or a plain value."""
    if isinstance(obj, np.generic):  # np.float64 is a float, yet a weights_only load refuses it
        raise ContractError(
            f"{where} is a numpy.{type(obj).__name__}, which a checkpoint cannot load back: store float() or int() of it"
        )
    if isinstance(obj, PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise ContractError(f"{where} has a key of type {type(k).__name__}; {HOLDS}")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise ContractError(f"{where} is a {kind}; {HOLDS}")


HOLDS = (
    "a checkpoint holds tensors, numbers, strings and lists/dicts of them only "
    "(override the server's state_dict and load_state_dict to convert it)"
)


def save_torch(obj: Any, uri: str, what: str = "checkpoint", parents: bool = True) -> None:
    """``parents=False``: the folder must be there (a FileNotFoundError where it is not)."""
    write_bytes(uri, torch_bytes(obj, what), parents)


def torch_bytes(obj: Any, what: str = "checkpoint") -> memoryview:
    """What :func:`save_torch` writes: ``obj`` checked to hold plain values only, saved by torch."""
    check_plain(obj, what)
    buffer = io.BytesIO()
    with no_crc32():
        torch.save(obj, buffer)
    return buffer.getbuffer()


@contextlib.contextmanager
def no_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of every record: two thirds of the time it takes to save a
    3.35 MB client state on a CPU (2.9 ms against 1.0), for a checksum ``torch.load`` never checks.
    A file lands whole or not at all (:func:`write_bytes`) either way."""
    serialization = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):  # torch < 2.6 computes it regardless
        yield
        return
    before = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        yield
    finally:
        serialization.set_crc32_options(before)


def load_torch(uri: str) -> Any:
    """Tensors and plain values only (``weights_only``): a file under a shared storage path that
    carries a pickled object is refused in one line, and nothing in it runs."""
    data = read_bytes(uri)
    try:
        # map_location: a checkpoint written next to a GPU loads on a machine without one
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))  # the callable the file names
        if found is None:
            raise CheckpointError(damaged(uri, data, err)) from None
        raise CheckpointError(
            f"{uri}: refused to load, it holds more than tensors and plain values (it would call "
            f"{found.group(1)}); it was not written by fedray or has been altered"
        ) from None
    # what torch raises on an empty, cut short or overwritten file, which it reads as a zip or a pickle
    except (EOFError, KeyError, ValueError, RuntimeError, zipfile.BadZipFile) as err:
        raise CheckpointError(damaged(uri, data, err)) from None


def damaged(uri: str, data: bytes, err: BaseException) -> str:
    detail = "empty" if not data else f"{len(data):,} bytes, {type(err).__name__}: {first_line(err)}"
    return (
        f"{uri}: not a file torch can read ({detail}); it was cut short, overwritten or not written by fedray"
    )
