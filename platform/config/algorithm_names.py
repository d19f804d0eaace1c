"""The algorithm names a config may use, known without importing an algorithm (no torch, no Lightning).

The command line checks a config's platform sections against these names before it loads the
registry (about 6 s of imports on a 2-core machine), so a misspelt key or value is one line at once.
A shipped algorithm is the module ``fedray.algorithms.<name>`` (the registry refuses another name);
an algorithm registered in this process (a script that imports its own before calling the CLI) is
recorded here by the registry. A package's entry point runs code that only loading it shows, so
with one installed the names are not known before the registry loads (``None``).
"""

from __future__ import annotations

import importlib.util
import pkgutil
from importlib import metadata

SHIPPED_PACKAGE = "fedray.algorithms"
ENTRY_POINT_GROUP = "fedray.algorithms"

_registered_here: set[str] = set()


def note_registered(name: str) -> None:
    """Called by the registry for every algorithm it registers in this process."""
    _registered_here.add(name)


def shipped_modules() -> list[str]:
    """The modules of ``fedray.algorithms``, read from the folder (none is imported)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    paths = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(info.name for info in pkgutil.iter_modules(paths) if not info.name.startswith("_"))


def known_algorithm_names() -> frozenset[str] | None:
    """Every algorithm a config may name, or ``None`` when an installed package may register more."""
    if metadata.entry_points(group=ENTRY_POINT_GROUP):
        return None
    return frozenset(shipped_modules()) | frozenset(_registered_here)
