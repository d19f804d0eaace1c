"""One command at a time on a run's folder.

A run resumed while it is still going (or resumed twice at once: a command launched twice) would
have two Coordinators write the same checkpoint and state files, each deleting the state versions
the other's checkpoint needs as it starts, and MLflow would get every metric twice. The driver of a
run holds a lock on its folder from the moment the folder is known until the run ends; a second
command finds it held and stops in one line, before Ray starts. The lock goes with the process that
held it, however that ends (SIGKILL included), so a killed run is resumable at once. A folder in an
object store (``s3://``, ``gs://``) has no such lock: one command at a time is then the user's to keep.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from fedray.platform.errors import ConfigError
from fedray.platform.runtime import storage

LOCK_FILE = ".driver.lock"


@contextlib.contextmanager
def held(directory: str, command: str = "this run") -> Iterator[None]:
    """Hold ``directory``'s lock, or say in one line that another command does (``command`` names
    what was asked, e.g. ``--resume <run id>``)."""
    path = storage.local_path(directory)
    if path is None:
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(os.path.join(path, LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(
            f"{command}: the run is going on in another command (its folder {path} is in use); "
            "stop that one first, or wait for it to end"
        ) from None
    try:
        yield
    finally:
        lock.release()
