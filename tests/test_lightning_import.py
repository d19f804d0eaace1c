"""Lightning is imported without the whole of torchmetrics, and torchmetrics still works in full.

Each check runs in a fresh process: which modules a process has loaded is what is being tested."""

from __future__ import annotations

from conftest import run_fresh_python


def run(script: str, tmp_path) -> str:
    done = run_fresh_python(script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_algorithm_api_loads_lightning_without_every_metric_and_any_other_name_loads_the_rest(tmp_path):
    out = run(
        """
        import importlib.metadata, sys, torch
        from fedray.platform.api import ClientModule
        import lightning, torchmetrics

        assert issubclass(ClientModule, lightning.LightningModule)
        assert torchmetrics.Metric.__module__ == "torchmetrics.metric"
        assert torchmetrics.__version__ == importlib.metadata.version("torchmetrics")
        print(sorted(m for m in ("torchmetrics.functional", "scipy.signal", "scipy.stats", "torchvision")
                     if m in sys.modules))

        # then, in the same process, a name the light import did not load: the whole package
        metric = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        assert isinstance(metric, torchmetrics.Metric)  # one Metric class, loaded once
        print(float(metric(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))))
        print("torchmetrics.functional" in sys.modules, hasattr(torchmetrics, "no_such_name"))
        from torchmetrics.classification import MulticlassF1Score
        print(type(MulticlassF1Score(num_classes=3)).__name__)
        """,
        tmp_path,
    )
    assert out.split() == ["[]", "0.75", "True", "False", "MulticlassF1Score"], out


def test_threads_asking_for_names_while_the_package_init_runs_all_get_them(tmp_path):
    out = run(
        """
        import threading
        import fedray.platform.api
        import torchmetrics

        names = ["Accuracy", "F1Score", "Precision", "Recall", "AUROC", "MeanSquaredError", "Metric"]
        start, found, errors = threading.Barrier(len(names)), {}, []

        def ask(name):
            start.wait()
            try:
                found[name] = getattr(torchmetrics, name).__name__
            except Exception as err:
                errors.append(repr(err))

        threads = [threading.Thread(target=ask, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(errors == [] and sorted(found.values()) == sorted(names), errors)
        """,
        tmp_path,
    )
    assert out.split()[0] == "True", out


def test_a_package_init_that_failed_is_run_again_on_the_next_name(tmp_path):
    out = run(
        """
        import sys
        import fedray.platform.api
        import torchmetrics

        sys.modules["torchmetrics.functional"] = None  # its import fails once
        try:
            torchmetrics.Accuracy
        except ImportError:
            print("failed")
        del sys.modules["torchmetrics.functional"]
        print(torchmetrics.Accuracy.__name__)
        """,
        tmp_path,
    )
    assert out.split() == ["failed", "Accuracy"], out


def test_a_torchmetrics_the_light_import_does_not_fit_is_imported_whole(tmp_path):
    # a package whose modules load in another order: the light set-up fails, is forgotten, and
    # torchmetrics and Lightning are imported once each, as Lightning would import them on its own
    out = run(
        """
        import logging, sys, types
        broken = sys.modules["torchmetrics.utilities"] = types.ModuleType("torchmetrics.utilities")
        from fedray.platform.api import ClientModule
        import lightning, torchmetrics

        assert issubclass(ClientModule, lightning.LightningModule)
        assert sys.modules["torchmetrics.utilities"] is not broken
        handlers = [len(logging.getLogger(n).handlers) for n in ("torchmetrics", "lightning.pytorch")]
        print("torchmetrics.functional" in sys.modules, torchmetrics.Accuracy.__name__, handlers)
        """,
        tmp_path,
    )
    assert out.split() == ["True", "Accuracy", "[1,", "1]"], out
