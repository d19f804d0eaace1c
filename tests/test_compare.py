"""fedray compare: one validated config per (algorithm, seed) on one partition, one table."""

import pytest
import yaml
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient

from fedray.platform.apps.compare import load_comparison, run_comparison
from fedray.platform.errors import ConfigError
from fedray.platform.tracking.names import Tags


def _write(tmp_path, runs, seeds=(0,)):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"name": "ignored", "rounds": 5}))
    path = tmp_path / "cmp.yaml"
    spec = {
        "name": "cmp",
        "base": "base.yaml",
        "seeds": list(seeds),
        "overrides": {"rounds": 2},
        "runs": runs,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def test_entries_expand_per_seed_with_their_own_overrides(tmp_path):
    path = _write(
        tmp_path,
        ["fedavg", {"algorithm": "fedssa", "model.group": "small_hetero", "label": "fedssa-h"}],
        seeds=(0, 1),
    )
    entries = load_comparison(path)
    assert [(e.label, e.config.seed) for e in entries] == [
        ("fedavg", 0),
        ("fedavg", 1),
        ("fedssa-h", 0),
        ("fedssa-h", 1),
    ]
    assert all(e.config.name == "cmp" and e.config.rounds == 2 for e in entries)
    assert entries[2].config.model.group == "small_hetero" and entries[0].config.model.group == "cnn_small"
    # the partition depends only on the data config and the seed: identical for every entry of a seed
    assert entries[0].config.data == entries[2].config.data


def test_a_bad_entry_fails_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match=r"fedssa\.mu0=3\.0"):
        load_comparison(_write(tmp_path, ["fedavg", {"algorithm": "fedssa", "fedssa.mu0": 3}]))
    with pytest.raises(ConfigError, match="needs an 'algorithm'"):
        load_comparison(_write(tmp_path, [{"label": "x"}]))


def test_a_compare_files_values_are_taken_as_written(tmp_path):
    # quoted text stays text and null is None: neither goes through a key=value string and back
    runs = [
        {"algorithm": "fedavg", "tracking.experiment": "007", "data.train_subset": None},
        {"algorithm": "fedssa", "fedssa": {"mu0": 0.25}, "fedssa.t_stable": 3, "tracking.experiment": "a: b"},
    ]
    path = _write(tmp_path, runs)
    spec = yaml.safe_load(path.read_text())
    spec["overrides"]["data.train_subset"] = 500
    path.write_text(yaml.safe_dump(spec))
    plain, hetero = load_comparison(path)
    assert plain.config.tracking.experiment == "007" and plain.config.data.train_subset is None
    assert hetero.config.tracking.experiment == "a: b" and hetero.config.data.train_subset == 500
    assert (hetero.config.algo.mu0, hetero.config.algo.t_stable) == (0.25, 3)  # a section and a dotted key


@pytest.mark.parametrize("base", [5, ["base.yaml"]])
def test_a_base_that_is_not_a_path_is_one_line(tmp_path, base):
    path = _write(tmp_path, ["fedavg"])
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "base": base}))
    with pytest.raises(ConfigError, match=r"base=.*: the path of a config file, relative to this file"):
        load_comparison(path)


@pytest.mark.usefixtures("ray_session")
def test_compare_runs_every_entry_into_one_experiment(tmp_path, mlflow_store):
    path = _write(tmp_path, ["local", "fedavg"])
    overrides = [o for o in tiny_overrides() if not o.startswith("rounds=")]
    rows = run_comparison(path, overrides)
    assert [r["algorithm"] for r in rows] == ["local", "fedavg"]
    assert rows[0]["MB up"] == 0 and rows[1]["MB up"] > 0
    assert rows[0]["global acc %"] is None and rows[1]["global acc %"] is not None
    client = MlflowClient(mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("cmp").experiment_id])
    assert sorted(r.data.tags[Tags.LABEL] for r in runs) == ["fedavg", "local"]
