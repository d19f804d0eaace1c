"""platform/ must never shadow the standard library for a process started at the repository root."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_python_started_at_root_imports_torch_and_stdlib_platform():
    code = "import platform, torch; print(platform.system(), torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] in {"Linux", "Darwin", "Windows"}


def test_top_level_code_folders_have_no_init():
    for folder in ("platform", "algorithms", "sweeps", "dashboards"):
        assert not (ROOT / folder / "__init__.py").exists(), folder


def test_package_maps_the_folders():
    import fedray.algorithms
    import fedray.platform.config

    assert Path(fedray.platform.config.__file__).parent.parent == ROOT / "platform"
    assert ROOT / "algorithms" in {Path(p) for p in fedray.algorithms.__path__}


def test_the_cli_finds_the_checkouts_quickstart_config():
    from fedray.platform.apps import cli

    assert cli.DEFAULT_CONFIG == ROOT / "configs" / "quickstart.yaml"
    assert cli.DEFAULT_CONFIG.is_file()


def test_the_declared_packages_cover_every_module_and_data_file():
    """A non-editable install (a wheel, ``pip install .``) holds only what pyproject.toml declares:
    a subpackage or data file left out imports in the checkout and fails once installed. Every
    folder is a package, one of data files too (Python imports it as a namespace package, and
    setuptools warns at every install about one left out), and holds its own data files."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared, data = set(setuptools["packages"]), setuptools.get("package-data", {})
    for top, path in setuptools["package-dir"].items():
        for directory in [ROOT / path, *(ROOT / path).rglob("*")]:
            if not directory.is_dir() or directory.name == "__pycache__":
                continue
            package = ".".join([top, *directory.relative_to(ROOT / path).parts])
            assert package in declared, f"{package} ({directory}) is not in [tool.setuptools] packages"
            for f in directory.iterdir():
                if f.is_file() and f.suffix not in (".py", ".pyc"):
                    assert f"*{f.suffix}" in data.get(package, []), (
                        f"{f.relative_to(ROOT)} is not in [tool.setuptools.package-data] {package!r}"
                    )
