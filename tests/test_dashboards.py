"""``fedray report``: from a real MLflow store filled by tiny real runs to an HTML page a browser renders.

The two runs (FedAvg and Local, 3 rounds on the synthetic set) happen once for the module; every
number in the report's table is checked against what the store holds, and the page is opened in a
real headless Chromium when one is installed (skipped, with the reason, when not).
"""

from __future__ import annotations

import argparse
import io
import math
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from conftest import store_in, tiny_overrides
from mlflow.tracking import MlflowClient
from ui_helpers import browser_or_skip

from fedray.dashboards import load
from fedray.dashboards import summary as sm
from fedray.dashboards.build import make_report
from fedray.dashboards.report import add_report_parser, build_report
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.tracking.names import (
    Metrics,
    Params,
    RunKind,
    Tags,
    best_of,
    metric_column,
    param_column,
    tag_filter,
)

EXP = "dash_compare"
SECTIONS = ["summary", "accuracy-round", "accuracy-comm", "client-accuracy", "sweep", "partition", "runs"]
MIB = 2**20


# --------------------------------------------------------------------------------------------- helpers


class PageParser(HTMLParser):
    """Section ids, images, and the summary table's cells (text and data-* attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[str] = []
        self.rows: list[list[dict]] = []
        self._section = ""
        self._in_tbody = False
        self._cell: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs.get("id", "")
            self.sections.append(self._section)
        elif tag == "img":
            self.images.append(attrs.get("src", ""))
        elif self._section == "summary" and tag == "tbody":
            self._in_tbody = True
        elif self._in_tbody and tag == "tr":
            self.rows.append([])
        elif self._in_tbody and tag == "td":
            self._cell = {**attrs, "text": ""}

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_tbody = False
        elif tag == "td" and self._cell is not None:
            self.rows[-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data


def parse(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


# --------------------------------------------------------------------------------------------- the store


@pytest.fixture(scope="module")
def store(tmp_path_factory, ray_session):
    """A temporary sqlite MLflow store with two tiny real runs: fedavg and local."""
    from fedray.platform.runtime.driver import run_experiment

    root = tmp_path_factory.mktemp("dash")
    uri = store_in(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(root)
        results = {
            algo: run_experiment(load_config(None, tiny_overrides(algorithm=algo, name=EXP)))
            for algo in ("fedavg", "local")
        }
    return uri, root, results


@pytest.fixture(scope="module")
def report(store):
    uri, root, _ = store
    return build_report(EXP, root / "report", tracking_uri=uri, target=0.3)


def test_report_has_every_section_and_the_stores_numbers(store, report):
    uri, _, results = store
    client = MlflowClient(uri)
    page = parse(report)

    assert page.sections == SECTIONS
    files = {p.name for p in (report.parent / "figures").glob("*.png")}
    assert {
        "accuracy_vs_round.png",
        "accuracy_vs_comm.png",
        "client_accuracy_box.png",
        "partition_0.png",
    } <= files
    assert len(page.images) == 4  # both runs share one partition (same data config and seed)
    assert all(src.startswith("data:image/png;base64,iVBORw0KGgo") for src in page.images)  # embedded PNGs
    text = report.read_text()
    for r in results.values():
        assert r.run_id in text  # the report says which runs it read

    # one table row per algorithm; every number equals the store's
    assert [row[0]["text"] for row in page.rows] == ["fedavg", "local"]
    for row, algo in zip(page.rows, ["fedavg", "local"]):
        run = client.get_run(results[algo].run_id)
        metrics = run.data.metrics
        (_, seeds, pers, pers_best, glob, glob_best, rounds, up, down, wall) = row
        assert seeds["text"] == "0"
        assert float(pers["data-value"]) == metrics[Metrics.ACC_PERSONAL_MEAN]
        assert pers["text"] == f"{100 * metrics[Metrics.ACC_PERSONAL_MEAN]:.2f}"
        assert float(pers_best["data-value"]) == metrics[best_of(Metrics.ACC_PERSONAL_MEAN)]
        history = [
            m.value
            for m in sorted(
                client.get_metric_history(run.info.run_id, Metrics.ACC_PERSONAL_MEAN), key=lambda m: m.step
            )
        ]
        assert metrics[best_of(Metrics.ACC_PERSONAL_MEAN)] == max(history)
        if algo == "fedavg":
            assert float(glob["data-value"]) == metrics[Metrics.ACC_GLOBAL]
            assert float(glob_best["data-value"]) == metrics[best_of(Metrics.ACC_GLOBAL)]
        else:  # no global model: no number, and no comm
            assert glob["text"] == glob_best["text"] == "—" and "data-value" not in glob
            assert metrics[Metrics.COMM_UP_BYTES_CUM] == 0
        first = next((i + 1 for i, v in enumerate(history) if v >= 0.3), None)
        assert rounds["text"] == ("not reached" if first is None else f"{first:.1f}")
        assert float(up["data-value"]) == pytest.approx(metrics[Metrics.COMM_UP_BYTES_CUM] / MIB)
        assert float(down["data-value"]) == pytest.approx(metrics[Metrics.COMM_DOWN_BYTES_CUM] / MIB)
        # the wall time the CLI printed, which the run's span (the UI's Duration) agrees with
        assert float(wall["data-value"]) == metrics[Metrics.TIME_WALL_S]
        span_s = (run.info.end_time - run.info.start_time) / 1000  # ends once the wall time is logged
        assert -0.01 <= span_s - metrics[Metrics.TIME_WALL_S] < 10.0, (span_s, metrics[Metrics.TIME_WALL_S])

    # the same numbers, unrounded, in summary.csv
    import pandas as pd

    csv = pd.read_csv(report.parent / "summary.csv").set_index("group")
    fedavg = client.get_run(results["fedavg"].run_id).data.metrics
    assert csv.loc["fedavg", "personal_final_mean"] == pytest.approx(fedavg[Metrics.ACC_PERSONAL_MEAN], abs=0)
    assert csv.loc["fedavg", "global_final_mean"] == pytest.approx(fedavg[Metrics.ACC_GLOBAL], abs=0)


def test_report_is_logged_to_a_report_run_and_not_read_back(store, report):
    uri, root, results = store
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXP)
    reports = client.search_runs([exp.experiment_id], tag_filter(Tags.KIND, RunKind.REPORT))
    assert len(reports) == 1 and reports[0].info.run_name == "report"
    assert reports[0].info.status == "FINISHED"
    logged = {a.path for a in client.list_artifacts(reports[0].info.run_id, "report")}
    assert {"report/report.html", "report/figures", "report/summary.csv", "report/runs.csv"} <= logged
    assert reports[0].info.run_id in report.read_text()  # the page says where it is logged

    # a second report reads the same two runs, not the report run
    again = build_report(EXP, root / "again", tracking_uri=uri, log=False)
    runs = pd_read(again.parent / "runs.csv")
    assert sorted(runs["run_id"]) == sorted(r.run_id for r in results.values())


def pd_read(path: Path):
    import pandas as pd

    return pd.read_csv(path)


# --------------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser() -> str:
    """Debian's chromium (or a Chrome) on PATH; else skip, saying why, before any run is made."""
    return browser_or_skip()


def _browse(browser: str, page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        *extra,
        page.resolve().as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def test_page_renders_in_headless_chromium(browser, report, tmp_path):
    dom = _browse(browser, report, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-render-check="ok"' in dom.stdout, dom.stdout[-3000:]
    assert "4 figures and 2 table rows rendered" in dom.stdout
    assert _console_errors(dom.stderr) == []

    shot = tmp_path / "screenshot.png"
    done = _browse(
        browser,
        report,
        tmp_path / "profile",
        "--hide-scrollbars",
        "--window-size=1280,3600",
        f"--screenshot={shot}",
    )
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    from PIL import Image

    with Image.open(io.BytesIO(shot.read_bytes())) as image:
        lo, hi = image.convert("L").getextrema()
    assert hi - lo > 100  # a page with figures and text, not a blank canvas
    shutil.copy(shot, report.parent / "screenshot.png")  # kept beside the report for a person to look at


def test_render_check_catches_a_broken_figure(browser, report, tmp_path):
    """The in-page check is not vacuous: a figure that cannot decode turns the verdict to error."""
    broken = tmp_path / "broken.html"
    broken.write_text(report.read_text().replace("base64,iVBORw0KGgo", "base64,AAAA", 1))
    dom = _browse(browser, broken, tmp_path / "profile", "--dump-dom")
    assert 'data-render-check="error"' in dom.stdout
    assert "1 figure(s) did not decode" in dom.stdout


# --------------------------------------------------------------------------------------------- errors


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedray")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_missing_experiment_fails_with_a_clear_message(store, tmp_path):
    uri, _, _ = store
    with pytest.raises(
        ConfigError, match=r"no MLflow experiment named 'nope' in .*experiments there: .*'dash_compare'"
    ):
        _cli(["report", "nope", "--tracking-uri", uri, "--out", str(tmp_path)])


def test_empty_experiment_and_missing_store_fail_with_clear_messages(tmp_path):
    uri = store_in(tmp_path)
    client = MlflowClient(uri)
    client.create_experiment("empty")
    with pytest.raises(
        ConfigError, match=r"experiment 'empty' .* has no finished fedray runs to report .*it is empty"
    ):
        build_report("empty", tmp_path / "out", tracking_uri=uri)

    failed = client.create_experiment("failed")
    run = client.create_run(failed, tags={Tags.ALGORITHM: "fedavg"})
    client.set_terminated(run.info.run_id, "FAILED")
    with pytest.raises(ConfigError, match=r"1 runs there, none usable: 1 with status FAILED"):
        build_report("failed", tmp_path / "out", tracking_uri=uri)

    missing = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(ConfigError, match="no MLflow store at"):
        build_report("x", tmp_path / "out", tracking_uri=f"sqlite:///{missing}")
    assert not missing.exists()  # reading never creates a store

    with pytest.raises(ConfigError, match="--target 90: give the accuracy as a fraction"):
        _cli(["report", "empty", "--tracking-uri", uri, "--target", "90"])


# --------------------------------------------------------------------------------------------- sweeps


def _tiny_png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (8, 6), (30, 120, 200)).save(path)
    return path


def _log_trial(client, exp_id, parent, label, params, seed, final, tmp: Path) -> str:
    """A finished run shaped like fedray's (tags, params, per-round metrics, artifacts), no training."""
    tags = {
        Tags.ALGORITHM: "fedcross",
        Tags.LABEL: label,
        Tags.DATASET: "synthetic",
        Tags.PARTITION: "dir1",
        Tags.MODEL_GROUP: "cnn_small",
        Tags.SEED: str(seed),
        Tags.SWEEP_ID: "sw1",
        Tags.PARENT_RUN_ID: parent,
    }
    run = client.create_run(exp_id, run_name=f"{label}-s{seed}", tags=tags)
    rid = run.info.run_id
    for k, v in {**params, Params.SEED: seed, Params.NUM_CLIENTS: 4, "data.dataset": "synthetic"}.items():
        client.log_param(rid, k, v)
    for step in (1, 2, 3):
        client.log_metric(rid, Metrics.ACC_PERSONAL_MEAN, final * step / 3, step=step)
        client.log_metric(rid, Metrics.COMM_UP_BYTES_CUM, step * MIB, step=step)
        client.log_metric(rid, Metrics.COMM_DOWN_BYTES_CUM, step * MIB, step=step)
    (tmp / rid).mkdir()
    (tmp / rid / "client_accuracy.csv").write_text(f"client,accuracy\n0,{final - 0.05}\n1,{final + 0.05}\n")
    client.log_artifact(rid, str(tmp / rid / "client_accuracy.csv"))
    client.log_artifact(rid, str(_tiny_png(tmp / rid / "partition.png")))
    client.set_terminated(rid)
    return rid


def test_sweep_report_draws_hyperparameters_and_logs_to_the_parent(tmp_path):
    uri = store_in(tmp_path)
    client = MlflowClient(uri)
    exp_id = client.create_experiment("sweep", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp_id, run_name="sweep-fedcross").info.run_id
    grid = {(0.9, "lowest"): 0.6, (0.9, "random"): 0.5, (0.99, "lowest"): 0.8, (0.99, "random"): 0.7}
    for (alpha, selection), acc in grid.items():
        for seed in (0, 1):
            params = {"fedcross.alpha": alpha, "fedcross.selection": selection}
            _log_trial(client, exp_id, parent, "fedcross", params, seed, acc + 0.01 * seed, tmp_path)
    _log_trial(client, exp_id, parent, "fedcross-f", {"fedcross.alpha": 0.9}, 0, 0.4, tmp_path)

    report = build_report("sweep", tmp_path / "out", tracking_uri=uri, target=0.5)
    page = parse(report)
    assert page.sections == SECTIONS
    figures = {p.name for p in (report.parent / "figures").glob("*.png")}
    assert {"sweep_fedcross.png", "sweep_fedcross_fedcross_alpha_x_fedcross_selection.png"} <= figures

    # the label tag splits one algorithm in two; the sweep's row is its best configuration
    assert [row[0]["text"] for row in page.rows] == ["fedcross", "fedcross-f"]
    best = page.rows[0]
    assert best[1]["text"] == "fedcross.alpha=0.99, fedcross.selection=lowest"
    assert float(best[3]["data-value"]) == pytest.approx(0.805)  # mean of 0.80 and 0.81 over seeds
    assert float(best[3]["data-std"]) == pytest.approx(0.005)
    assert best[8]["text"] == "3.000"  # MB up after 3 rounds of 1 MiB
    assert best[4]["text"] == "80.50 ± 0.50"  # no best/ metric logged: the best round of the history

    # logged to the sweep's parent, and no separate report run made
    assert "report/report.html" in {a.path for a in client.list_artifacts(parent, "report")}
    assert not client.search_runs([exp_id], tag_filter(Tags.KIND, RunKind.REPORT))


# --------------------------------------------------------------------------------------------- pure parts


def test_rounds_to_target_auto_target_and_hyperparameters():
    import pandas as pd

    history = pd.DataFrame(
        {"run_id": ["a"] * 3 + ["b"] * 3, "step": [1, 2, 3] * 2, "acc": [0.2, 0.5, 0.6, 0.1, 0.2, 0.3]}
    )
    reached = sm.rounds_to_target(history, 0.5, "acc")
    assert reached["a"] == 2 and math.isnan(reached["b"])

    runs = pd.DataFrame(
        {
            "run_id": ["a", "b", "c"],
            "group": ["x", "x", "y"],
            param_column(Params.SEED): ["0", "1", "0"],
            param_column("train.lr"): ["0.1", "0.1", "0.1"],
            param_column("fedprox.mu"): ["0.01", "0.1", None],
            param_column("tracking.uri"): ["u1", "u2", "u3"],
            metric_column(Metrics.ACC_PERSONAL_MEAN): [0.5, 0.7, 0.634],
        }
    )
    assert sm.hyperparameters(runs) == {"x": ["fedprox.mu"], "y": []}  # seed and tracking.* are not swept
    assert sm.auto_target(runs, Metrics.ACC_PERSONAL_MEAN) == 0.6  # min over groups of the mean, floored


def test_accuracy_figure_draws_the_majority_class_floor_under_personalised_curves():
    import pandas as pd

    from fedray.dashboards import figures as figs

    curve = pd.DataFrame({"x": [1, 2], "mean": [0.6, 0.7], "std": [0.0, 0.0], "n": [2, 2]})
    fig = figs.accuracy_vs_round({"fedssa": curve}, {}, figs.group_colors(["fedssa"]), majority=0.525)
    floor = [line for line in fig.axes[0].lines if line.get_label() == "majority class"]
    assert len(floor) == 1 and list(floor[0].get_ydata()) == [pytest.approx(52.5)] * 2
    no_floor = figs.accuracy_vs_round({"fedssa": curve}, {}, figs.group_colors(["fedssa"]))
    assert all(line.get_label() != "majority class" for line in no_floor.axes[0].lines)


def test_report_of_runs_without_client_test_data_ranks_by_global_accuracy(tmp_path):
    """FedCross and FedSC train on every client sample: their runs log acc/global only. The report
    then ranks, targets and draws by global accuracy instead of refusing the experiment."""
    uri = store_in(tmp_path)
    client = MlflowClient(uri)
    eid = client.create_experiment("global_only", artifact_location=(tmp_path / "art").as_uri())
    finals = {}
    for algo, seed, accs in [
        ("fedavg", 0, [0.3, 0.4]),
        ("fedavg", 1, [0.32, 0.44]),
        ("fedsc", 0, [0.35, 0.5]),
    ]:
        tags = {Tags.ALGORITHM: algo, Tags.SEED: str(seed), Tags.DATASET: "cifar10", Tags.PARTITION: "dir0.2"}
        run = client.create_run(eid, tags=tags, run_name=f"{algo}-s{seed}")
        for step, acc in enumerate(accs, start=1):
            client.log_metric(run.info.run_id, Metrics.ACC_GLOBAL, acc, step=step)
            client.log_metric(run.info.run_id, Metrics.COMM_UP_BYTES_CUM, step * 2**20, step=step)
            client.log_metric(run.info.run_id, Metrics.COMM_DOWN_BYTES_CUM, step * 2**20, step=step)
        client.log_metric(run.info.run_id, Metrics.TIME_WALL_S, 12.5)
        client.set_terminated(run.info.run_id, "FINISHED")
        finals.setdefault(algo, []).append(accs[-1])

    info = make_report("global_only", tmp_path / "out", uri, log=False)
    summary = {row["group"]: row for _, row in pd.read_csv(info.path.parent / "summary.csv").iterrows()}
    assert set(summary) == {"fedavg", "fedsc"}  # no run skipped for lacking personalised accuracy
    assert summary["fedavg"]["global_final_mean"] == pytest.approx(sum(finals["fedavg"]) / 2)
    assert summary["fedsc"]["global_final_mean"] == pytest.approx(0.5)
    assert summary["fedavg"]["wall_s"] == pytest.approx(12.5)
    # the automatic target is the best whole percent both reach in global accuracy: fedavg's mean 42 %
    assert "rounds to 42% global" in info.path.read_text()
    assert (info.path.parent / "figures" / "accuracy_vs_round.png").is_file()


def test_report_of_runs_evaluated_on_selected_clients_reads_their_metric_names(tmp_path):
    """``eval.clients=selected`` names the personalised metrics ``acc/personal_mean_selected`` (and
    ``best/personal_mean_selected`` at the end): the report ranks, targets and draws by them and says
    whom they cover, instead of skipping every run for lacking ``acc/personal_mean``."""
    uri = store_in(tmp_path)
    client = MlflowClient(uri)
    eid = client.create_experiment("selected", artifact_location=(tmp_path / "art").as_uri())
    for algo, seed, accs in [
        ("fedavg", 0, [0.3, 0.5]),
        ("fedavg", 1, [0.4, 0.45]),
        ("fedssa", 0, [0.6, 0.55]),
    ]:
        tags = {Tags.ALGORITHM: algo, Tags.SEED: str(seed), Tags.DATASET: "cifar10", Tags.PARTITION: "iid"}
        run_id = client.create_run(eid, tags=tags, run_name=f"{algo}-s{seed}").info.run_id
        for step, acc in enumerate(accs, start=1):
            client.log_metric(run_id, "acc/personal_mean_selected", acc, step=step)
            client.log_metric(run_id, "acc/personal_std_selected", 0.1, step=step)
            client.log_metric(run_id, Metrics.COMM_UP_BYTES_CUM, step * MIB, step=step)
        client.log_metric(run_id, "best/personal_mean_selected", max(accs), step=len(accs))
        client.log_metric(run_id, Metrics.TIME_WALL_S, 10.0)
        client.set_terminated(run_id, "FINISHED")

    info = make_report("selected", tmp_path / "out", uri, log=False)
    summary = {row["group"]: row for _, row in pd.read_csv(info.path.parent / "summary.csv").iterrows()}
    assert set(summary) == {"fedavg", "fedssa"}
    assert summary["fedavg"]["personal_final_mean"] == pytest.approx((0.5 + 0.45) / 2)
    assert summary["fedssa"]["personal_final_mean"] == pytest.approx(0.55)
    assert summary["fedssa"]["personal_best_mean"] == pytest.approx(0.6)  # the logged best, not the last
    html = info.path.read_text()
    assert "rounds to 47% personalised" in html  # fedavg's mean best, 47.5 %, is the lower
    # a finished run evaluated on all clients: preferred, and the others left out saying why
    tags = {Tags.ALGORITHM: "fedavg", Tags.SEED: "2", Tags.DATASET: "cifar10", Tags.PARTITION: "iid"}
    run_id = client.create_run(eid, tags=tags, run_name="fedavg-s2").info.run_id
    client.log_metric(run_id, Metrics.ACC_PERSONAL_MEAN, 0.7, step=1)
    client.set_terminated(run_id, "FINISHED")
    ex = load.load_runs("selected", uri)
    assert ex.metric == Metrics.ACC_PERSONAL_MEAN and list(ex.runs["run_id"]) == [run_id]
    assert set(ex.skipped["reason"]) == {"no acc/personal_mean metric (evaluated with eval.clients=selected)"}
    # a killed run has no say: the finished runs are reported under their own name
    client.set_terminated(run_id, "KILLED")
    assert load.load_runs("selected", uri).metric == "acc/personal_mean_selected"
    assert "each evaluation round&#x27;s selected clients" in html  # the note under the table, escaped
