"""``benchmarks/gpu_check.py`` (``make gpu-check``) without a GPU: it says so in one line and exits 0;
its pieces on hand-made inputs (nvidia-smi's output, which GPU processes are a run's, the rounds'
window, metric comparison, the table, check 9's verdict, the time limit). No GPU, no Ray."""

import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # its helpers beside it, as when run as a script
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert spec and spec.loader
gpu_check = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_check  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)
P = gpu_check.Point
Row = gpu_check.Row


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the no-GPU path even on a machine with one
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0
    assert len(lines) == 1 and "no GPU" in lines[0] and lines[0].startswith("gpu-check: ")


def test_nvidia_smi_output_is_parsed():
    assert gpu_check.parse_pids("1234\n 5678 \nNo running processes found\n") == {1234, 5678}
    assert gpu_check.parse_pids("") == set()
    assert gpu_check.parse_utilization("37\n") == 37.0
    assert gpu_check.parse_utilization("12\n80\n") == 80.0  # two GPUs: the busiest
    assert gpu_check.parse_utilization("[N/A]\n") is None


def test_a_runs_gpu_processes_are_its_tree_or_new_pids_from_outside_this_namespace():
    here = {10, 11, 12, 99}  # pids that exist in this pid namespace
    found = gpu_check.classify_gpu_pids(
        {11, 12, 99, 50_001, 50_002}, tree={10, 11, 12}, before={50_002}, exists=here.__contains__
    )
    # 99: another process of this machine; 50_002: on the GPU before the command started
    assert found == {11: "tree", 12: "tree", 50_001: "host"}


def test_a_gpu_process_is_named_by_its_ray_title_or_the_program_python_runs():
    assert gpu_check.process_title(["ray::ClientActor.train_many", "", ""]) == "ray::ClientActor"
    assert gpu_check.process_title(["ray::Coordinator"]) == "ray::Coordinator"
    assert gpu_check.process_title(["/opt/venv/bin/python3", "/opt/venv/bin/fedray", "run"]) == "fedray"
    assert gpu_check.process_title(["python", "-u", "benchmarks/gpu_check.py"]) == "gpu_check.py"
    assert gpu_check.process_title(["/usr/bin/raylet", "--node"]) == "raylet"
    assert gpu_check.process_title([]) == "?"


def test_utilisation_is_taken_over_the_rounds_only():
    # rounds 1 and 2 logged together at 100 s (round 1's metrics waited for the MLflow run), round 3 at 101 s
    points = [P(2, 1.0, 100_000), P(1, 2.0, 100_000), P(3, 1.0, 101_000)]
    window = gpu_check.rounds_window(points)
    assert window == (97.0, 101.0)
    samples = [(96.0, 0.0), (98.0, 40.0), (100.5, 60.0), (102.0, 5.0)]
    assert gpu_check.utilization(samples, [window]) == (50.0, 60.0)
    assert gpu_check.utilization(samples, []) is None
    assert gpu_check.rounds_window([]) is None


def test_steady_rounds_leave_out_round_1_and_the_evaluation_rounds():
    rounds = [P(1, 2.0, 102_000), P(2, 0.5, 102_600), P(3, 0.5, 103_200), P(4, 0.8, 104_100)]
    record = gpu_check.RunRecord("r", "FINISHED", {}, {
        "time/round_s": rounds,
        "acc/global": [P(4, 0.3, 104_100)],
        "acc/majority_baseline": [P(0, 0.1, 100_000)],  # once, at step 0: not an evaluation round
    })  # fmt: skip
    assert record.steady_windows() == [pytest.approx((102.1, 102.6)), pytest.approx((102.7, 103.2))]
    samples = [(101.0, 10.0), (102.3, 80.0), (102.65, 0.0), (103.0, 90.0), (104.0, 100.0)]
    assert gpu_check.utilization(samples, record.steady_windows()) == (85.0, 90.0)


def history(**metrics):
    """``acc_global=[0.5, 0.6]`` -> MLflow-like history, steps from 1 (``/`` written as ``_``)."""
    return {
        key.replace("_", "/", 1): [P(step, value, 0) for step, value in enumerate(values, start=1)]
        for key, values in metrics.items()
    }


def test_metric_comparison_ignores_timings_and_names_the_first_difference():
    first = history(acc_global=[0.5, 0.6], time_round_s=[1.0, 1.1], acc_majority=[math.nan])
    same = history(acc_global=[0.5, 0.6], time_round_s=[3.0, 0.2], acc_majority=[math.nan])
    assert gpu_check.metric_differences(first, same) == []
    changed = history(
        acc_global=[0.5, 0.7], time_round_s=[1.0, 1.1], acc_majority=[math.nan], loss_prox=[0.1]
    )
    assert gpu_check.metric_differences(first, changed) == [
        "acc/global at step 2: 0.6 vs 0.7",
        "loss/prox: steps [] vs [1]",
    ]


def test_a_resumed_run_is_compared_with_the_first_rounds_of_a_longer_one():
    longer = history(acc_global=[0.5, 0.6, 0.7, 0.8, 0.9], final_global=[0.0, 0.0, 0.0, 0.0, 0.9])
    resumed = history(acc_global=[0.5, 0.6, 0.7, 0.8], final_global=[0.0, 0.0, 0.0, 0.8])
    ignore = gpu_check.IGNORED_PREFIXES + gpu_check.END_OF_RUN_PREFIXES
    assert gpu_check.metric_differences(longer, resumed, ignore, last_step=4) == []
    assert gpu_check.metric_differences(longer, resumed, ignore) == [
        "acc/global: steps [1, 2, 3, 4, 5] vs [1, 2, 3, 4]"
    ]


def test_check_9_wants_exit_2_and_one_line_naming_the_key_in_under_a_minute():
    line = "fedray: error: ray.num_gpus_per_client=0.25: the Ray cluster has 0 GPUs; set ...\n"
    assert gpu_check.fail_fast_problems(2, line, 12.0, timed_out=False) == []
    problems = gpu_check.fail_fast_problems(1, "Traceback\n  ...\nRuntimeError: x\n", 60.0, timed_out=True)
    assert len(problems) == 3
    assert problems[1] == "exit status 1, expected 2"


def test_a_row_fails_on_a_requirement_and_lists_gpu_expectations_it_could_not_check():
    row = Row("1 quickstart")
    row.expect(False, "device tag cuda...", "'cpu'", "pretend")
    assert row.passed  # not checked is not failed
    row.expect(False, "4 workers", "2", None)
    assert not row.passed and row.result == "FAIL"
    assert (
        row.cells()[-1]
        == "FAIL: expected 4 workers (got 2); not checked (pretend): device tag cuda... (got 'cpu')"
    )
    skipped = Row("2 baseline")
    skipped.skip("check 1's run failed")
    assert not skipped.passed and skipped.result == "skipped: check 1's run failed"


def test_the_table_renders_as_text_and_as_markdown():
    ok = Row(
        "1 quickstart", gpu_procs="4", util="37 / 80", round_s="0.41", acc="0.9777", notes=["device cuda"]
    )
    bad = Row("9 GPU asked for, none visible")
    bad.require(False, "exit status 1 | expected 2")
    text = gpu_check.render_text([ok, bad]).splitlines()
    assert len(text) == 3 and text[0].startswith("check")
    assert text[1].index("ok") == text[0].index("result") == text[2].index("FAIL")  # columns line up
    md = gpu_check.render_markdown([ok, bad], ["2026-11-24, 16 CPUs"], [])
    assert "- 2026-11-24, 16 CPUs" in md
    assert "| 1 quickstart | ok | 4 | 37 / 80 | 0.41 | 0.9777 | device cuda |" in md
    assert "FAIL: exit status 1 \\| expected 2" in md  # a pipe inside a cell does not split it


def test_cross_device_data_comes_from_data_an_archive_or_the_synthetic_stand_in(tmp_path):
    tree = tmp_path / "cifar"
    (tree / "train").mkdir(parents=True)
    (tree / "test").mkdir()
    assert gpu_check.cross_device_data(str(tree)).overrides == [
        "data.dataset=imagefolder",
        f"data.root={tree}",
    ]
    assert gpu_check.cross_device_data("synthetic").overrides == gpu_check.SYNTHETIC
    fallback = gpu_check.cross_device_data(None, archives=(tmp_path / "missing.tar.gz",))
    assert fallback.overrides == gpu_check.SYNTHETIC and "1 channel" in fallback.label
    with pytest.raises(gpu_check.DataMissing):
        gpu_check.cross_device_data(str(tmp_path / "nowhere"))


def test_every_checkpoint_file_is_loaded_and_its_tensors_found(tmp_path):
    state = {
        "server": {"w": torch.zeros(2)},
        "rows": [torch.ones(3), (torch.ones(1),)],
        "obj": SimpleNamespace(t=torch.zeros(4)),
    }
    assert sorted(t.numel() for t in gpu_check.tensors_in(state)) == [1, 2, 3, 4]
    (tmp_path / "states").mkdir()
    # a checkpoint holds tensors and plain values only (one carrying an object is refused on loading)
    torch.save({k: v for k, v in state.items() if k != "obj"}, tmp_path / "checkpoint.pt")
    torch.save({"module": {"b": torch.zeros(5)}}, tmp_path / "states" / "0-v1.pt")
    (tmp_path / "config.yaml").write_text("rounds: 4\n")
    report = gpu_check.load_checkpoints(str(tmp_path))
    assert report["files"] == 2 and report["tensors"] == 4 and report["client_states"] == 1
    assert report["off_cpu"] == report["saved_on_gpu"] == report["errors"] == []


def test_only_takes_check_numbers():
    assert gpu_check.parse_only("4,1,4") == [4, 1]
    for bad in ("0", "10", "x", ""):
        with pytest.raises(Exception, match="check"):
            gpu_check.parse_only(bad)


def test_share_sets_the_slice_of_the_gpu_checks_and_the_workers_they_expect(tmp_path, capsys):
    # Prepare / Act: the default and an eighth of the GPU, as parsed from the command line
    default = gpu_check.parse_args([])
    eighth = gpu_check.parse_args(["--share", "0.125"])
    ctx = gpu_check.Context(
        tmp_path, pretend=False, smi_on=False, data=None, rounds=1, gpu_share=eighth.share
    )
    # Assert: 0.25 by default; at 0.125 the runs ask for it and expect eight workers on the GPU
    assert default.share == 0.25
    assert ctx.share == "ray.num_gpus_per_client=0.125" and ctx.workers_on_one_gpu == 8
    assert ctx.at == "at 0.125 GPU"
    assert gpu_check.Context(tmp_path, False, False, None, 1, 1 / 3).workers_on_one_gpu == 3
    for bad in ("0", "1.5", "-0.25"):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--share", bad])
        assert "--share" in capsys.readouterr().err


def test_a_command_past_its_time_limit_is_killed_with_what_it_started(tmp_path):
    ctx = gpu_check.Context(tmp_path, pretend=True, smi_on=False, data=None, rounds=1)
    # a child that leaves the process group, as a daemon might: ended by pid afterwards
    # a shell, not Python: it starts its child in milliseconds, well inside the limit on a loaded
    # machine (a Python command was once killed at 2 s before its child existed)
    started = time.monotonic()
    outcome = ctx.run_command("sleeper", ["sh", "-c", "setsid sleep 60 & exec sleep 60"], timeout=5)
    assert time.monotonic() - started < 55  # killed at its limit, not waited out
    assert outcome.timed_out and "time limit" in (outcome.problem() or "")
    assert len(outcome.watched.tree) == 2  # the command and its child, both seen
    assert not any(gpu_check.is_alive(proc) for proc in outcome.watched.tree.values())
    assert ctx.commands == [outcome]


def test_check_8_expects_client_states_only_where_the_algorithms_clients_keep_them():
    """FedSC's clients keep nothing between rounds (they write no state); the pretended run of
    2026-11-30 failed check 8b for expecting some."""
    expected = {"8a FedProto": True, "8b FedSC": False, "8c FedL2G": True}
    assert {
        name: gpu_check.writes_client_states(config, extra)
        for name, config, extra in gpu_check.ALGORITHM_RUNS
    } == expected
