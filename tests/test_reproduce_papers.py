"""``benchmarks/reproduce_papers.py``: every paper's comparison expands into valid configs at both
scales, ``--only`` picks entries by label, and the results table averages over seeds. No run starts."""

from types import SimpleNamespace

import pytest
from repro_script import repro

from fedray.platform.api.registry import available
from fedray.platform.errors import ConfigError

CPU_FEDCROSS = repro.scale_overrides(repro.PAPERS["fedcross"], "cpu")


def dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("paper", sorted(repro.PAPERS))
@pytest.mark.parametrize("scale", ["cpu", "full"])
def test_every_comparison_expands_to_valid_configs(paper, scale, tmp_path):
    scaled = repro.scale_overrides(repro.PAPERS[paper], scale)
    entries = repro.paper_entries(paper, scaled, str(tmp_path), "0,1", "exp")
    labels = [e.label for e in entries]
    assert set(labels) == set(repro.PAPERS[paper].paper_numbers)  # every row has the paper's number beside it
    assert all(labels.count(label) == 2 for label in labels)  # one run per seed
    for entry in entries:
        assert entry.config.data.root == str(tmp_path) and entry.config.checkpoint_every == 0
        for key, value in repro.PAPERS[paper].cpu.items() if scale == "cpu" else []:
            section = key.split(".")[0]
            if section in available() and section != entry.config.algorithm:
                continue  # another algorithm's section (fedl2g.warmup_rounds on FedProto's run)
            assert dotted(entry.config.to_dict(), key) == value


def test_only_runs_the_named_entries(tmp_path):
    entries = repro.paper_entries(
        "fedcross", [*CPU_FEDCROSS, "rounds=400"], str(tmp_path), "0,1", "exp", ["fedcross"]
    )
    assert [(e.label, e.config.seed, e.config.rounds) for e in entries] == [
        ("fedcross", 0, 400),
        ("fedcross", 1, 400),
    ]
    assert all(dotted(e.config.to_dict(), "fedcross.dynamic_alpha_rounds") == 0 for e in entries)


def test_only_with_an_unknown_label_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"no entry labelled nope \(have fedavg, fedcross, fedcross-da\)"):
        repro.paper_entries("fedcross", CPU_FEDCROSS, str(tmp_path), "0", "exp", ["nope"])


def test_results_table_is_mean_and_population_std_over_seeds():
    def run(last, best, wall):
        return SimpleNamespace(last=lambda m: last, best=lambda m: best, wall_time_s=wall, extra={})

    table = repro.results_table(
        repro.PAPERS["fedcross"], {"fedavg": [run(0.40, 0.50, 10), run(0.50, 0.52, 20)]}
    )
    assert "| fedavg | 2 | 45.00 ± 5.00 | 51.00 ± 1.00 | 46.12 ± 2.35 | 15 |" in table.splitlines()


@pytest.mark.parametrize("paper", ["fedcross_femnist", "fedcross_shakespeare"])
def test_a_leaf_comparison_without_its_files_says_where_to_get_them(paper, capsys):
    assert repro.main([paper]) == 2
    err = capsys.readouterr().err
    task = repro.PAPERS[paper].leaf_task
    assert f"--data <LEAF's data/{task}/data folder>" in err
    assert "github.com/TalwalkarLab/leaf" in err and "./preprocess.sh -s niid" in err
