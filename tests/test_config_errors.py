"""Bad input fails with one clear line, before any Ray or training starts."""

import json

import pytest
from conftest import run_fresh_python

from fedray.platform.apps.cli import main
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError, ContractError


@pytest.fixture(autouse=True)
def no_proxy_for_loopback(monkeypatch):
    """The tracking-server probes below go to 127.0.0.1: never through a proxy the machine may set
    (fresh processes inherit this too)."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1,localhost")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algorithm=fedmagic"], "algorithm='fedmagic': unknown algorithm"),
        (["data.partition.alpha=0"], "data.partition.alpha=0"),
        (["data.partition.alpha=-1"], "must be > 0"),
        (["train.fraction=1.5"], "train.fraction=1.5"),
        (["rounds=0"], "rounds=0"),
        (["data.dataset=imagenet22k"], "data.dataset='imagenet22k': unknown dataset"),
        (["model.group=transformer9000"], "model.group='transformer9000'"),
        (["train.lr=abc"], "train.lr='abc': expected a number"),
        (["data.partition.kind=random"], "data.partition.kind='random': allowed values"),
        (["fedprox.mu=-1", "algorithm=fedprox"], "fedprox.mu=-1.0"),
        (["trian.lr=0.1"], "unknown config key 'trian'"),
        (["algo.mu=0.1"], "unknown config key 'algo'"),  # the algorithm's section is under its name
        (["algorithm=fedprox", "FedProx.mu=0.1"], "unknown config key 'FedProx'"),  # ... lower-case
        (["fedprx.mu=0.1"], "known keys here: name, algorithm, seed, rounds, eval_every, checkpoint_every"),
        (["fedprx.mu=0.1"], "tracking; or an algorithm's section, under its lower-case name ("),
        (["algorithm=fedavg", "model.group=fedssa_cnns"], "heterogeneous"),
        (["data.split.test=0.5"], "data.split: train+val+test"),
        (["ray.object_store_mb=50"], "ray.object_store_mb=50: must be >= 75 (Ray's smallest store)"),
        (["ray.pool_wait_s=-1"], "ray.pool_wait_s=-1.0: must be >= 0"),
        (["seed=1.5"], "seed=1.5: expected an integer"),  # not seed 1
        (["seed=-1"], "seed=-1: must be >= 0"),
        (["seed=99999999999999999999999"], "must be >= 0 and < 2**63"),  # the seeds' int64 arithmetic
        (["fedprox.nope=1"], "unknown config key 'fedprox.nope'"),  # another algorithm's section too
        (["fedprox.mu=abc"], "fedprox.mu='abc': expected a number"),
        (["train.lr=inf"], "train.lr='inf': expected a finite number"),  # inf > 0 would pass
        (["train.lr_decay=0"], "train.lr_decay=0.0: the per-round factor must be in (0, 1]"),
        (["train.lr_decay=1.01"], "train.lr_decay=1.01: the per-round factor must be in (0, 1]"),
        (["data.partition.alpha=nan"], "data.partition.alpha='nan': expected a finite number"),
        (["name="], "name: must not be empty"),
        (["storage_path="], "storage_path: must not be empty"),
        # checked with the config, before the model would see an image of 0x0 pixels
        (
            ["data.dataset=synthetic", "data.synthetic_image_size=0"],
            "data.synthetic_image_size=0: must be >= 1",
        ),
        (["data.synthetic_classes=0"], "data.synthetic_classes=0: must be >= 1"),
        (["ray.num_cpus=0"], "ray.num_cpus=0: must be >= 1 or null"),  # not "all of them"
        (["ray.address=garbage"], "ray.address='garbage': not a Ray address"),
        (["ray.address=10.0.0.1:99999"], "not a Ray address"),
        (["ray.address=foo://bar"], "not a Ray address (ray.init would import a module 'foo' for that"),
        (["ray.address=http://10.0.0.1:8265"], "not a Ray address (that is a web address)"),  # the dashboard
        (["tracking.system_metrics_s=-1"], "tracking.system_metrics_s=-1.0: must be >= 0"),
        (["data.image_size=1"], "model 'cnn_small' needs images of at least 2x2 pixels, the data has 1x1"),
    ],
)
def test_bad_config_value_is_one_line_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


CLI_CASES = [
    (["data.partition.kind=shards", "data.partition.classes_per_client=11"], "classes_per_client=11"),
    (["data.dataset=cifar10", "data.root=/nonexistent/cifar"], "data.root"),
    (["data.dataset=cifar10"], "data.root"),
    (["data.dataset=imagefolder", "data.root=/nonexistent/tree"], "data.root"),
    (["algorithm=nope"], "unknown algorithm"),
    (["train.fraction=2"], "train.fraction=2"),
    (["--stop-after", "1", "train.fraction=2"], "train.fraction=2"),  # an override after an option
    (["ray.num_gpus_per_client=0.25"], "ray.num_gpus_per_client=0.25: "),  # no GPU here
    (["data.train_subset=100000"], "data.train_subset=100000: more than the 1438 training samples"),
    (["storage_path=/proc/fedray"], "storage_path=/proc/fedray: cannot make the folder"),
    (["storage_path=file:///proc/fedray"], "storage_path=file:///proc/fedray: cannot make the folder"),
    (["storage_path=foo://bar/x"], "storage_path=foo://bar/x: Unrecognized filesystem type"),
    (["storage_path=file://relative/x"], "a file:// URI is absolute (file:///home/...)"),
    (["storage_path=hdfs://nn:8020/x"], "storage_path=hdfs://nn:8020/x: cannot be reached"),  # no Java here
    # no client could take a step: the run would train nothing (checked on the partition, before Ray)
    (["train.drop_last=true", "train.batch_size=100000"], "no client has that many training samples"),
]


@pytest.mark.parametrize(("overrides", "needle"), CLI_CASES)
def test_cli_reports_one_line(overrides, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "mlflow.db").exists()  # nothing heavy started, not even the store


def test_a_run_that_cannot_go_on_is_one_line_and_exit_status_1(capsys, monkeypatch):
    """A run aborted mid-way (its Coordinator died past its restarts, a round in which every client
    failed) ends the command with its one line, which says how to resume, and no traceback."""
    from fedray.platform.runtime import driver
    from fedray.platform.runtime.session import RunAborted

    def aborted(cfg, **kwargs):
        raise RunAborted("the Coordinator process died (killed); resume from the last checkpoint with  x")

    monkeypatch.setattr(driver, "run_experiment", aborted)
    assert main(["run", "rounds=2"]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err == "fedray: error: the Coordinator process died (killed); resume from the last checkpoint with  x"
    )


# checked in a fresh process only: in the tests' own process a Ray may already be up, and a run joins it
FRESH_CLI_CASES = [
    (["ray.address=127.0.0.1:1"], "ray.address=127.0.0.1:1: nothing answers there"),  # no cluster there
    (["ray.address=ray://127.0.0.1:1"], "ray.address=ray://127.0.0.1:1: nothing answers there"),  # Ray Client
    # more than this machine's Ray has: the set-up would wait for room that never comes
    (["ray.num_cpus_per_client=64"], "ray.num_cpus_per_client=64: a ClientActor needs that many CPUs"),
    (["ray.num_cpus=2", "ray.num_cpus_per_client=3"], "ray.num_cpus is 2"),
    (
        ["ray.object_store_mb=100000000"],
        "ray.object_store_mb=100000000: more than this machine's free memory",
    ),
]

# answered from the platform's own sections, before the registries load torch and Lightning
TYPOS = [
    ["run", "trian.lr=0.1"],
    ["run", "rouns=3"],
    ["run", "train.lr=-1"],
    ["run", "algorithm=nope"],
    ["run", "configs/does-not-exist.yaml"],
    ["sweep", "--algo", "fedcross", "ray.max_actors=0"],
    ["sweep", "--algo", "fedcrossx"],
]


def test_bad_input_starts_no_ray_and_a_typo_loads_no_torch(tmp_path):
    """In a fresh process (this one's Ray may already run for other tests): a typo's line comes
    before torch is imported, a GPU this machine lacks before Lightning; after every bad command, Ray
    is not initialised and the process has started no other process."""
    script = """
        import json, sys
        from fedray.platform.apps.cli import main
        for args in json.loads(sys.argv[2]):
            assert main(args) == 2, args
            assert "torch" not in sys.modules, args
        assert main(["run", "ray.num_gpus_per_client=0.25"]) == 2  # GPUs this machine lacks:
        assert "lightning" not in sys.modules  # known from torch alone, before the algorithms load
        import psutil, ray
        for overrides, _ in json.loads(sys.argv[1]):
            assert main(["run", *overrides]) == 2, overrides
            assert not ray.is_initialized(), overrides
            assert psutil.Process().children(recursive=True) == [], overrides
        print("no Ray")
    """
    compare = tmp_path / "compare.yaml"
    compare.write_text("runs: [fedavg, fedprox]\noverrides: {eval_evry: 2}\n")
    typos = [*TYPOS, ["compare", str(compare)]]
    done = run_fresh_python(
        script,
        json.dumps(CLI_CASES + FRESH_CLI_CASES),
        json.dumps(typos),
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["no", "Ray"], done.stderr[-2000:]
    errors = done.stderr.splitlines()
    for needle in ("'trian'", "'rouns'", "train.lr=-1.0", "'nope': unknown algorithm", "does not exist",
                   "ray.max_actors=0", "'fedcrossx': unknown algorithm", "'eval_evry'",
                   *(needle for _, needle in FRESH_CLI_CASES)):  # fmt: skip
        assert any(needle in line and line.startswith("fedray: error: ") for line in errors), needle
    assert not (tmp_path / "mlflow.db").exists()


def test_a_shipped_algorithm_is_its_module_so_configs_are_checked_without_importing_it():
    from dataclasses import dataclass

    from fedray.platform.api.algorithm import ClientModule, Server
    from fedray.platform.api.registry import register, registered_by
    from fedray.platform.config import AlgorithmConfig
    from fedray.platform.config.algorithm_names import known_algorithm_names, shipped_modules

    assert shipped_modules() == registered_by("fedray.algorithms")
    assert known_algorithm_names() >= set(shipped_modules())
    misnamed = dataclass(
        type("MisnamedConfig", (AlgorithmConfig,), {"__module__": "fedray.algorithms.fedavg"})
    )
    # a ContractError: the CLI's one line, where a ValueError was a traceback through the imports
    with pytest.raises(
        ContractError, match=r"'fedavg2' is registered in fedray.algorithms.fedavg: .*algorithms/fedavg2.py"
    ):
        register("fedavg2", server=Server, client=ClientModule)(misnamed)
    elsewhere = dataclass(type("ElsewhereConfig", (AlgorithmConfig,), {"__module__": "their_package.algos"}))
    with pytest.raises(
        ContractError,
        match=r"^algorithm 'fedavg' registered twice \(fedray.algorithms.fedavg, their_package.algos\)$",
    ):
        register("fedavg", server=Server, client=ClientModule)(elsewhere)


def test_with_an_algorithm_package_installed_any_mapping_may_be_its_section(monkeypatch):
    """An entry point registers names only loading it shows: the first check leaves every mapping
    it does not know to the registry, and still names a misspelt scalar key."""
    from fedray.platform.config import algorithm_names, read_config

    monkeypatch.setattr(algorithm_names.metadata, "entry_points", lambda **select: ["theirs = their.module"])
    assert algorithm_names.known_algorithm_names() is None
    assert read_config(None, ["algorithm=theirs", "theirs.k=1"])["theirs"] == {"k": 1}
    with pytest.raises(ConfigError, match="unknown config key 'rouns'"):
        read_config(None, ["algorithm=theirs", "rouns=3"])
    with pytest.raises(ConfigError, match=r"train\.lr=0\.0: must be > 0"):
        read_config(None, ["algorithm=theirs", "train.lr=0"])
    read_config(None, ["algorithm=theirs", "theirs=3"])  # its own section's value: the registry's to judge


def test_missing_config_file_is_clear(capsys):
    assert main(["run", "configs/does-not-exist.yaml"]) == 2
    assert "does-not-exist.yaml' does not exist" in capsys.readouterr().err


def test_malformed_yaml_is_one_line_naming_file_line_and_column(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nrounds: [1, 2\nalgorithm: fedavg\n")  # the bracket never closes
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"config file '{bad}': line 3, column 10: not valid YAML" in err, err
    assert main(["run", "rounds=[1,"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "override 'rounds=[1,': line 1" in err, err


def test_algorithm_section_and_override_reach_the_algorithm_config():
    cfg = load_config("configs/quickstart.yaml", ["algorithm=fedprox", "fedprox.mu=0.25", "rounds=3"])
    assert cfg.algo.mu == 0.25 and cfg.rounds == 3
    assert cfg.to_dict()["fedprox"] == {"mu": 0.25}


def test_an_algorithm_config_must_derive_from_the_typed_base():
    from dataclasses import dataclass

    from fedray.platform.api.algorithm import ClientModule, Server
    from fedray.platform.api.registry import register

    with pytest.raises(ContractError, match="must derive from AlgorithmConfig"):

        @register("untyped", server=Server, client=ClientModule)
        @dataclass
        class Untyped:
            lr: float = 0.1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--resume", ""], "--resume: give the id of the run to resume"),  # not a new run
        (
            ["run", "--resume", "abc", "--scale", "0.1"],
            "--resume RUN_ID takes no config, overrides or --scale",
        ),
        (["sweep", "--algo", "fedavg", "--samples", "0"], "--samples 0: must be >= 1"),
        (["sweep", "--algo", "fedavg", "--stop-after-trials", "-1"], "--stop-after-trials -1: must be >= 1"),
        (["sweep", "--algo", "fedavg", "--name", ""], "--name: must not be empty"),
        (["sweep", "--algo", "fedavg", "--restart-errored"], "--restart-errored: only with --resume"),
        # no store here: said before MLflow makes an empty one
        (["run", "--resume", "abc"], "--resume abc: no MLflow store at sqlite:///"),
        (
            ["report", "quickstart", "--tracking-uri", "http://127.0.0.1:1"],
            "no tracking server answers there",
        ),
        (
            ["run", "tracking.uri=http://127.0.0.1:1"],
            "tracking.uri=http://127.0.0.1:1: no tracking server answers",
        ),
        (["ui", "--port", "99999"], "--port 99999: a TCP port is 1-65535"),
        (["report", "quickstart", "--tracking-uri", "foo://bar"], "--tracking-uri=foo://bar: MLflow has no"),
        (
            ["run", "tracking.uri=foo://bar", "rounds=1"],
            "tracking.uri=foo://bar: MLflow has no tracking store",
        ),
        (["run", "tracking.uri=runs_folder", "rounds=1"], "MLflow's old file store, which it refuses unless"),
        (["report", "quickstart", "--tracking-uri", "file:///x/y"], "MLFLOW_ALLOW_FILE_STORE=true"),
        (
            ["run", "tracking.uri=sqlite:////proc/nope/x.db", "rounds=1"],
            "tracking.uri=sqlite:////proc/nope/x.db: cannot make the folder /proc/nope",
        ),
        (  # no MySQL driver here; the password is not shown
            ["run", "tracking.uri=mysql://u:secret@127.0.0.1:1/db", "rounds=1"],
            "tracking.uri=mysql://u:***@127.0.0.1:1/db: its database driver MySQLdb is not installed",
        ),
    ],
)
def test_a_bad_command_line_is_one_line_and_starts_nothing(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # tracking.uri is read only without it
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no store, no storage folder, no report


def test_the_tracking_uri_from_the_environment_is_named_as_such(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://bar")
    assert main(["run", "rounds=1"]) == 2
    assert "MLFLOW_TRACKING_URI=foo://bar: MLflow has no tracking store" in capsys.readouterr().err
    # a server where nothing answers: at once, where MLflow would retry each request for minutes
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    for args in (["run", "rounds=1"], ["ui"], ["run", "--resume", "abc"]):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("fedray: error: MLFLOW_TRACKING_URI=http://127.0.0.1:1: no tracking server"), (
            err
        )
        assert len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_ui_address_it_cannot_listen_on_is_one_line_before_the_server_starts(capsys, tmp_path, monkeypatch):
    # uvicorn logs either and exits 0: a script would take it for a UI that ran and was stopped
    import socket

    from mlflow.tracking import MlflowClient

    from fedray.platform.apps import ui

    def server_started(*args):
        raise AssertionError("the MLflow UI server was started")

    monkeypatch.setattr(ui.os, "execv", server_started)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()  # the store exists
    capsys.readouterr()  # MLflow's lines as it made the store
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use = str(taken.getsockname()[1])
        for host, port, needle in [
            ("999.1.1.1", "5000", "999.1.1.1 --port 5000: the UI cannot listen there"),
            ("127.0.0.1", in_use, f"--port {in_use}: the UI cannot listen there (Address"),
        ]:
            assert main(["ui", "--host", host, "--port", port]) == 2
            err = capsys.readouterr().err.strip()
            assert needle in err and len(err.splitlines()) == 1, err


def test_a_mistyped_command_line_is_one_line(capsys):
    for args, needle in (
        (["run", "--bogus"], "fedray: error: unrecognized arguments: --bogus (see fedray --help)"),
        (["compare"], "fedray compare: error: the following arguments are required: config (see"),
        (["run", "--scale", "abc"], "fedray run: error: argument --scale: invalid float value: 'abc'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.startswith(needle) and len(err.splitlines()) == 1, err


def test_a_config_file_that_is_no_yaml_text_is_one_line(capsys, tmp_path):
    (tmp_path / "binary.yaml").write_bytes(b"seed: 1\n" + b"# padding\n" * 5000 + b"\xff\xfe rounds\n")
    (tmp_path / "folder.yaml").mkdir()
    for name, needle in (
        ("binary.yaml", "not UTF-8 text (byte 0xff at 50008)"),
        ("folder.yaml", "is a folder"),
    ):
        assert main(["run", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"config file '{tmp_path / name}' " in err or f"config file '{tmp_path / name}':" in err, err
        assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("runs: fedavg\n", "'runs' must list at least one algorithm, e.g. runs: [fedavg, fedprox]"),
        ("runs: [fedavg]\nseeds: abc\n", "'seeds' must be a list"),
        # every entry's data is checked before the first one runs, not once it has finished
        (
            "runs: [fedavg, {algorithm: fedprox, data.num_clients: 5000}]\n",
            "fedprox (seed 0): data.num_clients=5000: more clients than the 1438 training samples",
        ),
        ("runs: [1]\n", "runs[0] is 1; give an algorithm's name or a mapping"),
        ("runs: [[fedavg, fedprox]]\n", "runs[0] is ['fedavg', 'fedprox']"),
        ("runs: [fedavg]\noverrides: [rounds=1]\n", "'overrides' must map keys to values"),
        # every entry's storage, tracking store and resources too
        (
            "runs: [fedavg, {algorithm: fedprox, storage_path: /proc/fedray}]\n",
            "fedprox (seed 0): storage_path=/proc/fedray: cannot make the folder",
        ),
    ],
)
def test_a_compare_file_is_checked_whole_before_its_first_run(body, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(body)
    assert main(["compare", "c.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "mlflow.db").exists()


def test_resuming_a_sweeps_or_a_reports_run_says_what_it_is(capsys, mlflow_store):
    from mlflow.tracking import MlflowClient

    from fedray.platform.tracking.names import RunKind, Tags

    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment("sweeps")
    for kind, needle in ((RunKind.SWEEP, "that is a sweep's parent run"), (RunKind.REPORT, "a report's run")):
        run = client.create_run(experiment, tags={Tags.KIND: kind}).info.run_id
        assert main(["run", "--resume", run]) == 2
        assert needle in capsys.readouterr().err
        assert client.get_run(run).info.status == "RUNNING"  # as it was


def test_resuming_a_run_whose_object_store_cannot_be_reached_is_one_line(capsys, mlflow_store):
    """The run's folder is looked for in its object store once, with the wait of a run's start."""
    from mlflow.tracking import MlflowClient

    from fedray.platform.tracking.names import Tags

    client = MlflowClient(mlflow_store)
    folder = "hdfs://nn:8020/fedray/quickstart-1"  # no Java here: HDFS cannot be reached
    run = client.create_run(client.create_experiment("remote"), tags={Tags.CHECKPOINT_DIR: folder})
    assert main(["run", "--resume", run.info.run_id]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after MLflow's log of the store's making
    assert err.startswith(f"fedray: error: the run's folder {folder}: cannot be reached (")


def test_valid_cluster_addresses_pass_and_a_cluster_is_not_asked_for_cpus_it_may_get_later():
    from fedray.platform.runtime.driver import require_cpus

    # a module's own scheme, where that module is installed (ray.init imports it by the scheme's name)
    for address in ("", "auto", "local", "ray://head:10001", "yaml://cluster", "head:6379"):
        load_config(None, [f"ray.address={address}"])  # "": a local Ray, as before
    for ipv6 in ("[::1]:6379", '"[::1]:6379"', "'[::1]:6379'"):  # bare (not a YAML list) or quoted
        assert load_config(None, [f"ray.address={ipv6}"]).ray.address == "[::1]:6379"
    assert load_config(None, ["ray.address=null"]).ray.address is None
    cfg = load_config(None, ["ray.address=10.0.0.1:6379", "ray.num_cpus_per_client=64"])
    require_cpus(cfg, before_ray=True)  # a cluster's nodes may join later (an autoscaler)
    require_cpus(cfg)


def test_a_run_saved_with_values_refused_since_resumes_as_it_meant_them():
    """Values an older fedray accepted keep their meaning on --resume: the run's config cannot be
    changed there, so refusing them would strand the run."""
    import yaml

    from fedray.platform.runtime.driver import saved_config

    raw = load_config(None, ["algorithm=fedprox", "fedprox.mu=0.5"]).to_dict()
    raw["ray"]["num_cpus"], raw["storage_path"], raw["tracking"]["system_metrics_s"] = 0, "", -1
    raw["data"]["train_subset"] = 100000  # more than digits' 1438: it kept all of them
    cfg = saved_config(yaml.safe_load(yaml.safe_dump(raw)))
    assert (cfg.ray.num_cpus, cfg.storage_path, cfg.tracking.system_metrics_s) == (None, ".", 0)
    assert cfg.data.train_subset is None and cfg.algo.mu == 0.5
    raw["data"]["train_subset"] = 500  # a real subset stays
    assert saved_config(yaml.safe_load(yaml.safe_dump(raw))).data.train_subset == 500


def test_a_tracking_server_behind_a_proxy_is_left_to_mlflow(monkeypatch):
    """MLflow reaches a server through HTTP(S)_PROXY, which a direct connection would not: the probe
    is skipped where the proxy applies, and made where NO_PROXY exempts the host."""
    from fedray.platform.tracking.mlflow_run import require_server_answer

    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "example.org")
    monkeypatch.delenv("no_proxy")
    require_server_answer("http://127.0.0.1:1", "tracking.uri")  # through the proxy: not asked here
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"tracking.uri=http://127.0.0.1:1: no tracking server answers"):
        require_server_answer("http://127.0.0.1:1", "tracking.uri")


def test_a_database_store_where_nothing_answers_is_one_line_without_its_password(monkeypatch):
    """With its driver installed (faked here: none is), a database store is asked for a connection
    before Ray starts, and the line does not show the password."""
    from sqlalchemy.engine.url import URL

    from fedray.platform.tracking.mlflow_run import require_database

    class InstalledDriver:
        @staticmethod
        def import_dbapi():
            return object()

    monkeypatch.setattr(URL, "get_dialect", lambda self, **kwargs: InstalledDriver)
    with pytest.raises(ConfigError) as err:
        require_database("postgresql://u:secret@127.0.0.1:1/db", "tracking.uri")
    assert str(err.value).startswith("tracking.uri=postgresql://u:***@127.0.0.1:1/db: no database answers")
    assert "secret" not in str(err.value) and "\n" not in str(err.value)
    require_database("sqlite:///x.db", "tracking.uri")  # not a server database: nothing to ask


def test_an_object_store_that_never_answers_is_one_line_after_the_wait(monkeypatch):
    """GCS without credentials waits minutes for a metadata server: the look is given up on."""
    import threading

    from fedray.platform.runtime import checkpoint
    from fedray.platform.runtime.checkpoint import require_remote_answer

    never = threading.Event()
    monkeypatch.setattr(checkpoint.storage, "exists", lambda uri: never.wait(30))
    monkeypatch.setattr(checkpoint, "REMOTE_ANSWER_TIMEOUT_S", 0.2)
    with pytest.raises(ConfigError, match=r"^storage_path=gs://b/x: no answer from the object store in 0 s"):
        require_remote_answer("storage_path=gs://b/x", "gs://b/x")
    never.set()

    def refused(uri):
        raise OSError("When getting information for bucket 'b': AWS Error ACCESS_DENIED")

    monkeypatch.setattr(checkpoint.storage, "exists", refused)
    with pytest.raises(
        ConfigError, match=r"^storage_path=s3://b/x: cannot be reached \(When getting .*DENIED\)$"
    ):
        require_remote_answer("storage_path=s3://b/x", "s3://b/x")
    monkeypatch.setattr(checkpoint.storage, "exists", lambda uri: False)
    require_remote_answer(
        "storage_path=s3://b/x", "s3://b/x"
    )  # answered: the folder is made at the first write


def test_a_pool_larger_than_the_free_memory_is_one_line_before_ray(monkeypatch):
    """One ClientActor per CPU of ray.num_cpus, each a process of at least WORKER_MEMORY_MB: a pool
    that cannot fit is refused with the ray.max_actors that would (here with 2 GB free)."""
    from types import SimpleNamespace

    import psutil

    from fedray.platform.runtime import driver

    monkeypatch.setattr(driver, "local_ray", lambda cfg: True)  # as a fresh command would start one
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2048 * 2**20))
    with pytest.raises(ConfigError) as err:
        driver.require_memory_for_pool(load_config(None, ["ray.num_cpus=8"]))
    assert str(err.value) == (
        "ray.num_cpus=8: a pool of 8 ClientActors, each a process of at least 400 MB, needs more than "
        "this machine's free 2.0 GB; set ray.max_actors=4 or lower"
    )
    with pytest.raises(ConfigError, match=r"^ray.max_actors=5: a pool of 5 ClientActors"):
        driver.require_memory_for_pool(load_config(None, ["ray.num_cpus=8", "ray.max_actors=5"]))
    driver.require_memory_for_pool(
        load_config(None, ["ray.num_cpus=8", "ray.max_actors=4"])
    )  # and the Coordinator
    driver.require_memory_for_pool(
        load_config(None, ["ray.num_cpus=64", "data.num_clients=4"])
    )  # one per client
