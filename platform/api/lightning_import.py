"""Lightning, imported without the whole of torchmetrics.

Lightning needs two classes of torchmetrics (``Metric`` and ``MetricCollection``), but asks for the
package, and torchmetrics' package init imports every metric it has, ``scipy.signal``, ``scipy.stats``
and torchvision's models with them: about 1.5 s of CPU in every process that imports Lightning, and
a run starts one per ClientActor beside the driver and the Coordinator. So, before Lightning is
imported, ``torchmetrics`` is put in ``sys.modules`` as its package not yet initialised, with the two
classes loaded from their own modules; any other name a user's code asks of the package runs the
real package init first (``torchmetrics.Accuracy`` works as it always does). Where the two classes
do not load that way (another torchmetrics layout), the package is forgotten and imported whole.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType

# what Lightning imports from the package, and the module each is defined in
LIGHT_NAMES = {"Metric": "torchmetrics.metric", "MetricCollection": "torchmetrics.collections"}


class PackageInit:
    """The package's ``__getattr__``: the first name it lacks runs its real init, once, whatever
    the thread; a failed init raises its error and is tried again on the next name."""

    def __init__(self, package: ModuleType, spec: ModuleSpec, handler: logging.Handler) -> None:
        self.package, self.spec, self.handler = package, spec, handler
        self.lock = threading.RLock()  # the init's own modules ask the package for names too
        self.started = False  # the real init has run, or is running in the thread holding the lock

    def __call__(self, name: str) -> object:
        with self.lock:
            if not self.started and name not in self.package.__dict__:
                logging.getLogger("torchmetrics").removeHandler(self.handler)  # the init adds its own
                self.started = True
                try:
                    self.spec.loader.exec_module(self.package)  # type: ignore[union-attr]
                except BaseException:
                    self.started = False  # tried again on the next name
                    raise
        try:
            return self.package.__dict__[name]  # there now, or set by another thread's init
        except KeyError:
            raise AttributeError(f"module 'torchmetrics' has no attribute {name!r}") from None


def light_torchmetrics() -> None:
    """Put torchmetrics in ``sys.modules`` with only what Lightning uses loaded; where that fails,
    nothing is left behind (Lightning then imports the whole package)."""
    spec = importlib.util.find_spec("torchmetrics")
    if spec is None or spec.loader is None or spec.origin is None:
        return
    package = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    sys.modules["torchmetrics"] = package
    log, handler = logging.getLogger("torchmetrics"), logging.StreamHandler()
    try:
        # what the package init sets before it imports a metric, and what its modules read back
        about = importlib.import_module("torchmetrics.__about__")
        package.__dict__.update({name: getattr(about, name) for name in about.__all__})
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        package.__dict__["_logger"] = log
        # torchmetrics.utilities first, as the package init imports it: torchmetrics.metric and
        # torchmetrics.utilities import each other, and only that order completes
        importlib.import_module("torchmetrics.utilities")
        for name, module in LIGHT_NAMES.items():
            package.__dict__[name] = getattr(importlib.import_module(module), name)
    except Exception:  # a torchmetrics this does not fit: forget what it loaded
        for name in [n for n in sys.modules if n == "torchmetrics" or n.startswith("torchmetrics.")]:
            del sys.modules[name]
        log.removeHandler(handler)
        return
    package.__dict__["__getattr__"] = PackageInit(package, spec, handler)


if "torchmetrics" not in sys.modules and "lightning" not in sys.modules:
    light_torchmetrics()

import lightning  # noqa: E402  (after torchmetrics is in place)

__all__ = ["lightning"]
