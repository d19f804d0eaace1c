"""Environment variables set for one block: libraries (Tune, MLflow) read some as a call starts and
write others, and a later run in the same process must not inherit either."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def environ_restored(keys: Iterable[str]) -> Iterator[None]:
    """The block may set or unset these variables; afterwards each is as it was (unset if it was)."""
    before = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
