"""Lightning, imported without the whole of torchmetrics.

Lightning needs two classes of torchmetrics (``Metric`` and ``MetricCollection``), but asks for the
package, and torchmetrics' package init imports every metric it has, ``scipy.signal``, ``scipy.stats``
and torchvision's models with them: about 1.5 s of CPU in every process that imports Lightning, and
a run starts one per ClientActor beside the driver and the Coordinator. So, before Lightning is
imported, ``torchmetrics`` is put in ``sys.modules`` as its package not yet initialised: the two
classes load from their own modules, and any other name a user's code asks of the package runs the
real package init first (``torchmetrics.Accuracy`` works as it always does). Where that cannot be
set up (another torchmetrics layout), the package is imported whole, as before.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType

# what Lightning imports from the package, and the module each is defined in
_LIGHT_NAMES = {"Metric": "torchmetrics.metric", "MetricCollection": "torchmetrics.collections"}


def _torchmetrics_not_yet_initialised() -> ModuleType | None:
    spec = importlib.util.find_spec("torchmetrics")
    if spec is None or spec.loader is None or spec.origin is None:
        return None
    package = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    root = os.path.dirname(spec.origin)
    # what torchmetrics' own modules read from the package while they load
    package.__dict__.update(
        __version__=importlib.metadata.version("torchmetrics"),
        _logger=logging.getLogger("torchmetrics"),
        _PACKAGE_ROOT=root,
        _PROJECT_ROOT=os.path.dirname(root),
    )
    lock, whole = threading.RLock(), [False]

    def __getattr__(name: str) -> object:
        with lock:
            if whole[0]:
                raise AttributeError(f"module 'torchmetrics' has no attribute {name!r}")
            if name in _LIGHT_NAMES:
                importlib.import_module("torchmetrics.utilities")  # first, as the package init would
                return getattr(importlib.import_module(_LIGHT_NAMES[name]), name)
            whole[0] = True
            spec.loader.exec_module(package)  # type: ignore[union-attr]
            return getattr(package, name)

    package.__dict__["__getattr__"] = __getattr__
    return package


def _forget(packages: tuple[str, ...]) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] in packages]:
        del sys.modules[name]


if "torchmetrics" not in sys.modules and "lightning" not in sys.modules:
    try:
        _package = _torchmetrics_not_yet_initialised()
    except Exception:  # its metadata unreadable, say: it is imported whole
        _package = None
    if _package is not None:
        sys.modules["torchmetrics"] = _package

try:
    import lightning
except Exception:  # a torchmetrics this does not fit: forget what it loaded, and import it whole
    _forget(("torchmetrics", "lightning"))
    import lightning

__all__ = ["lightning"]
