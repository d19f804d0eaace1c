"""The import contract: fedray's folders are its layers, and a module imports only layers below its own.

Read from the source with ``ast`` (nothing is imported). ARCHITECTURE.md draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"platform": "fedray.platform", "algorithms": "fedray.algorithms", "sweeps": "fedray.sweeps",
           "dashboards": "fedray.dashboards"}  # fmt: skip

# Bottom to top. A module may import its own package, and packages of a lower layer; packages that
# share a layer are siblings and never import each other. A module belongs to the longest package
# that contains it.
LAYERS: list[tuple[str, ...]] = [
    # the names MLflow records under: the author API writes one (ClientModule's "loss/train") below the
    # tracking layer that holds them, so this one module sits at the bottom and imports nothing of fedray
    ("fedray.platform.tracking.names",),
    # seeds: named random streams, numpy and torch; interrupts: Ctrl-C held past a tracking write;
    # environ: environment variables put back after a library's call; network: is anything at an address
    (
        "fedray.platform.errors",
        "fedray.platform.seeds",
        "fedray.platform.interrupts",
        "fedray.platform.environ",
        "fedray.platform.network",
    ),
    ("fedray.platform.config",),
    ("fedray.platform.data", "fedray.platform.models"),
    ("fedray.platform.api",),
    ("fedray.algorithms",),
    ("fedray.platform.catalog",),
    ("fedray.platform.tracking",),
    ("fedray.platform.runtime",),
    ("fedray.dashboards",),
    ("fedray.sweeps",),  # a sweep's summary draws its trials with the dashboards' figures
    ("fedray.platform.apps",),
]
# An algorithm imports the author API (and other algorithms it builds on), nothing else of fedray;
# the platform finds algorithms through the registry and never imports one.
ALGORITHMS_MAY_IMPORT = ("fedray.platform.api", "fedray.algorithms")

# Imports inside a function, each with its reason. Anything else is imported at the top of its module.
LAZY_IMPORTS = {
    # `fedray --help` and a mistyped command answer in a second: the commands' modules import torch,
    # Ray and MLflow, so the CLI imports each one when its command runs.
    ("fedray.platform.apps.cli", "fedray.platform.apps.tables"),
    ("fedray.platform.apps.cli", "fedray.platform.runtime.driver"),
    ("fedray.platform.apps.cli", "fedray.platform.runtime.session"),  # RunAborted, for a failed run's line
    ("fedray.platform.apps.cli", "fedray.platform.apps.compare"),
    ("fedray.platform.apps.cli", "fedray.sweeps.tune_sweep"),
    ("fedray.platform.apps.cli", "fedray.dashboards.report"),
    ("fedray.platform.apps.cli", "fedray.platform.apps.ui"),
    ("fedray.platform.apps.cli", "fedray.platform.catalog"),
    ("fedray.platform.apps.cli", "fedray.platform.runtime.devices"),  # torch, for GPUs asked for only
    # the same for the two commands whose parsers `fedray --help` builds: MLflow and the report's
    # plotting stack load when `fedray ui` or `fedray report` runs
    ("fedray.platform.apps.ui", "fedray.platform.tracking.mlflow_run"),
    ("fedray.dashboards.report", "fedray.dashboards.build"),
    # every Tune trial process imports the sweep module (its trial function): matplotlib loads only
    # on the sweep's driver, when it draws the trials' curves at the end
    ("fedray.sweeps.tune_sweep", "fedray.dashboards.figures"),
    # the block twins subclass torchvision's: torchvision loads only when a torchvision model is built
    # (it costs every process that imports the model zoo a third of a second)
    ("fedray.platform.models.torchvision_adapters", "fedray.platform.models.torchvision_levels"),
    # the registry imports the algorithm modules on first use, by name (it cannot name them statically)
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    name = ".".join([FOLDERS[rel.parts[0]], *rel.parts[1:]])
    return name.removesuffix(".__init__")


def read_sources() -> dict[str, str]:
    return {
        module_name(p): p.read_text() for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
    }


def imports(module: str, source: str, known: set[str], typing: bool = True) -> list[tuple[str, bool, int]]:
    """(imported fedray module, inside a function?, line) for every import of ``module``; with
    ``typing=False``, without those under ``if TYPE_CHECKING:`` (annotations: no runtime edge)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing and isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # fedray's imports are absolute, so the check can read them
                    raise AssertionError(f"{module}:{child.lineno}: a relative import; write it absolute")
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append((target if target in known else base, in_function, child.lineno))
            visit(child, nested)

    visit(ast.parse(source), False)
    return [(m, f, line) for m, f, line in found if m.startswith("fedray.")]


def layer_of(module: str) -> tuple[int, str]:
    found = [
        (len(package), index, package)
        for index, packages in enumerate(LAYERS)
        for package in packages
        if module == package or module.startswith(package + ".")
    ]
    if not found:
        raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")
    _, index, package = max(found)
    return index, package


def violations(sources: dict[str, str]) -> list[str]:
    """Every import that breaks the contract, one line each."""
    known = set(sources)
    problems = []
    for module, source in sources.items():
        my_layer, my_package = layer_of(module)
        for target, in_function, line in imports(module, source, known):
            where = f"{module}:{line} imports {target}"
            their_layer, their_package = layer_of(target)
            if my_package == "fedray.algorithms" and not target.startswith(ALGORITHMS_MAY_IMPORT):
                problems.append(f"{where}: an algorithm imports fedray.platform.api only")
            elif their_package == "fedray.algorithms" and my_package != "fedray.algorithms":
                problems.append(f"{where}: algorithms are found through the registry, never imported")
            elif their_package != my_package and their_layer >= my_layer:
                kind = "a sibling" if their_layer == my_layer else "a layer above"
                problems.append(f"{where}: {kind} ({their_package})")
            if in_function and (module, target) not in LAZY_IMPORTS:
                problems.append(
                    f"{where} inside a function: import at the top, or name the reason in LAZY_IMPORTS"
                )
    return sorted(set(problems))


def cycles(sources: dict[str, str]) -> list[list[str]]:
    """Import cycles among top-level imports that run (Tarjan's strongly connected components)."""
    known = set(sources)
    graph = {
        m: {
            t if t in known else t.rsplit(".", 1)[0]
            for t, f, _ in imports(m, s, known, typing=False)
            if not f
        }
        & known
        for m, s in sources.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_every_import_goes_down_a_layer():
    assert violations(read_sources()) == []


def test_no_import_cycles():
    assert cycles(read_sources()) == []


def test_the_names_import_nothing_of_fedray():
    names = "fedray.platform.tracking.names"
    sources = read_sources()
    assert imports(names, sources[names], set(sources)) == []
    assert layer_of(names) == (0, names) and layer_of("fedray.platform.tracking.views")[1] != names


def test_the_check_catches_an_upward_import_a_sibling_and_a_lazy_import():
    sources = read_sources()
    planted = dict(sources)
    planted["fedray.platform.config.schema"] += "\nfrom fedray.platform.runtime import driver\n"
    planted["fedray.platform.data.stats"] += "\nfrom fedray.platform.models import registry\n"
    planted["fedray.algorithms.fedavg"] += "\nfrom fedray.platform.runtime import pool\n"
    planted["fedray.platform.runtime.pool"] += "\ndef f():\n    from fedray.platform.runtime import storage\n"
    planted["fedray.platform.api.algorithm"] += "\nfrom fedray.platform.tracking import mlflow_run\n"
    planted["fedray.platform.tracking.names"] += "\nfrom fedray.platform.errors import ConfigError\n"
    found = "\n".join(violations(planted))
    assert "fedray.platform.config.schema" in found and "a layer above" in found
    # the names sit below everything: the rest of the tracking layer stays above the author API
    assert "fedray.platform.api.algorithm:" in found and "fedray.platform.tracking.names:" in found
    assert "fedray.platform.data.stats" in found and "a sibling" in found
    assert "an algorithm imports fedray.platform.api only" in found
    assert "inside a function" in found
    planted = dict(sources)
    planted["fedray.platform.errors"] += "\nimport fedray.platform.errors\n"
    planted["fedray.platform.data.stats"] = "import fedray.platform.data.partition\n"
    planted["fedray.platform.data.partition"] += "\nimport fedray.platform.data.stats\n"
    assert ["fedray.platform.data.partition", "fedray.platform.data.stats"] in cycles(planted)
