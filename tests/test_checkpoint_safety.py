"""Checkpoints load no code: tensors and plain values only, written and read that way.

A storage path may be a shared directory or a bucket; whoever can write there must not be able to
run code in the driver or the Coordinator on ``--resume``."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import store_in, tiny_overrides
from filelock import FileLock, Timeout
from mlflow.tracking import MlflowClient

from fedray.platform.api import registry
from fedray.platform.api.algorithm import Server, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.errors import CheckpointError, ConfigError, ContractError
from fedray.platform.runtime import checkpoint as checkpoint_module
from fedray.platform.runtime import storage
from fedray.platform.runtime.checkpoint import (
    CheckpointWriter,
    LoopRecord,
    load_checkpoint,
    take_checkpoint,
    write_checkpoint,
)
from fedray.platform.runtime.coordinator import RoundLoop
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.runtime.events import CheckpointSaved
from fedray.platform.runtime.run_folder import LOCK_FILE
from fedray.platform.runtime.state_store import StateStore

FEDRAY = str(Path(sys.executable).with_name("fedray"))


class Payload:
    """A pickled object that runs code when it is loaded: it makes a directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_file_carrying_an_object_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "state.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="refused to load") as info:
        storage.load_torch(str(path))
    assert "\n" not in str(info.value) and "it would call posix.mkdir" in str(info.value)
    assert not marker.exists()


def whole_checkpoint() -> bytes:
    return storage.torch_bytes({"server": {"model": {"w": torch.ones(64, 64)}}, "round": 3})


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        (lambda: b"", "(empty)"),
        (lambda: b"hello\n", "(6 bytes, "),  # a text file put in its place
        (lambda: whole_checkpoint()[:5000], "(5,000 bytes, "),  # a copy cut short
        (lambda: whole_checkpoint()[:-100], " bytes, "),  # its zip index cut off
    ],
)
def test_a_damaged_checkpoint_is_one_line_naming_the_file_not_a_traceback(tmp_path, content, detail):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content())
    with pytest.raises(CheckpointError) as info:
        storage.load_torch(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a file torch can read (") and detail in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "is empty: it was cut short or overwritten"),  # not the defaults: a different run
        (b"rounds: [\n", "line 2, column 1: not valid YAML"),
        (b"- 1\n- 2\n", "top level must be a mapping"),
        (b"\xff\xfe", "not UTF-8 text"),
        (None, "is gone; the run cannot resume without it"),
    ],
)
def test_a_damaged_saved_config_is_one_line_naming_the_file(tmp_path, content, needle):
    if content is not None:
        (tmp_path / checkpoint_module.CONFIG_FILE).write_bytes(content)
    with pytest.raises(ConfigError) as info:
        checkpoint_module.saved_config_mapping(str(tmp_path))
    message = str(info.value)
    assert f"the run's saved config '{tmp_path / 'config.yaml'}'" in message and needle in message
    assert "\n" not in message


def test_tensors_and_plain_values_round_trip(tmp_path):
    state = {"w": torch.arange(3.0), "round": 4, "history": [{"acc": 0.5}], "name": "x", "none": None}
    storage.save_torch(state, str(tmp_path / "c.pt"))
    back = storage.load_torch(str(tmp_path / "c.pt"))
    assert torch.equal(back["w"], state["w"]) and back["history"] == state["history"]


class ServerWithModel(Server):
    STATE = ("model", "optimizer", "counts")

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.counts = torch.zeros(2)


def test_a_server_saves_its_modules_and_optimizers_as_state_dicts_and_loads_them_in_place(tmp_path):
    ctx = ServerContext(load_config(None, []), 2, 2, ["a", "a"], lambda cid: None)  # type: ignore[arg-type]
    server = ServerWithModel(ctx)
    server.model(torch.ones(1, 3)).sum().backward()
    server.optimizer.step()  # momentum buffers exist
    server.counts += 1
    storage.save_torch(server.state_dict(), str(tmp_path / "s.pt"))

    fresh = ServerWithModel(ctx)
    model, optimizer = fresh.model, fresh.optimizer
    fresh.load_state_dict(storage.load_torch(str(tmp_path / "s.pt")))
    assert fresh.model is model and fresh.optimizer is optimizer  # the objects built in __init__
    assert torch.equal(fresh.model.weight, server.model.weight)
    assert torch.equal(fresh.counts, server.counts)
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(momentum, server.optimizer.state[server.model.weight]["momentum_buffer"])


def test_a_server_holding_another_kind_of_value_is_a_contract_error_naming_it(tmp_path):
    ctx = ServerContext(load_config(None, []), 2, 2, ["a", "a"], lambda cid: None)  # type: ignore[arg-type]
    server = type("ProtoServer", (Server,), {"STATE": ("prototypes",)})(ctx)
    server.prototypes = {3: np.zeros(4)}  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match=r"checkpoint\.server\.prototypes\.3 is a numpy\.ndarray") as info:
        storage.save_torch({"server": server.state_dict()}, str(tmp_path / "c.pt"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("value", [np.float64(0.5), np.int64(3), np.float32(1.5)])
def test_a_numpy_number_in_a_servers_state_is_named_before_a_checkpoint_that_could_not_load(tmp_path, value):
    # np.float64 is a Python float, so it would pass as a plain number, yet torch.load(weights_only=True)
    # refuses it: the run would checkpoint happily and fail on resume
    torch.load(io.BytesIO(storage.torch_bytes({"ok": float(value)})), weights_only=True)
    with pytest.raises(
        ContractError, match=rf"checkpoint\.server\.losses\[0\] is a numpy\.{type(value).__name__}, which"
    ):
        storage.save_torch({"server": {"losses": [value]}}, str(tmp_path / "c.pt"))
    assert not (tmp_path / "c.pt").exists()


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [FEDRAY, "run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MLFLOW_TRACKING_URI": store_in(tmp_path)},
    )


@pytest.mark.usefixtures("ray_session")
def test_resume_refuses_an_altered_checkpoint_before_anything_runs(tmp_path, mlflow_store):
    # a run stopped after round 1, in this process (its Ray is up): the checkpoint is what matters
    cfg = load_config(None, tiny_overrides(rounds=3, checkpoint_every=1))
    stopped = run_experiment(cfg, stop_after_round=1)
    assert not stopped.finished
    run = MlflowClient(mlflow_store).get_run(stopped.run_id)
    (checkpoint,) = (tmp_path / ".fedray").rglob("checkpoint.pt")

    marker = tmp_path / "ran"
    whole = checkpoint.read_bytes()
    state = torch.load(checkpoint, weights_only=True)
    state["history"].append(Payload(marker))
    torch.save(state, checkpoint)

    resumed = run_cli(tmp_path, "--resume", run.info.run_id)
    assert resumed.returncode == 2
    lines = resumed.stderr.strip().splitlines()
    assert lines[-1].startswith("fedray: error: ") and "refused to load" in lines[-1], resumed.stderr[-2000:]
    assert str(checkpoint) in lines[-1]
    assert not marker.exists()
    assert "Ray" not in resumed.stdout + resumed.stderr.replace(
        lines[-1], ""
    )  # it stopped before Ray started

    # the checkpoint whole again, its saved config emptied: one line too, never a run of the defaults
    checkpoint.write_bytes(whole)
    (checkpoint.parent / "config.yaml").write_text("")
    resumed = run_cli(tmp_path, "--resume", run.info.run_id)
    assert resumed.returncode == 2
    assert resumed.stderr.strip().splitlines()[-1].endswith("is empty: it was cut short or overwritten")


@pytest.mark.usefixtures("ray_session")
def test_resume_refuses_a_server_state_saved_under_other_names_before_anything_runs(tmp_path, mlflow_store):
    # FedAvg's server keeps "model"; a checkpoint whose server holds another name (an attribute renamed
    # since it was written) would resume with a fresh value: refused in one line, before Ray
    cfg = load_config(None, tiny_overrides(rounds=3, checkpoint_every=1))
    stopped = run_experiment(cfg, stop_after_round=1)
    (checkpoint,) = (tmp_path / ".fedray").rglob("checkpoint.pt")
    state = torch.load(checkpoint, weights_only=True)
    state["server"] = {"global_model": state["server"]["model"]}
    torch.save(state, checkpoint)

    resumed = run_cli(tmp_path, "--resume", stopped.run_id)
    assert resumed.returncode == 2
    assert resumed.stderr.strip().splitlines()[-1] == (
        "fedray: error: the checkpoint's server state has no 'model', which FedAvgServer.STATE declares (it "
        "was saved by another version of the algorithm)"
    )
    assert MlflowClient(mlflow_store).get_run(stopped.run_id).info.status == "KILLED"  # not reopened


@pytest.mark.usefixtures("ray_session")
def test_a_run_is_resumed_by_one_command_at_a_time_and_its_own_driver_holds_it_while_it_goes(
    tmp_path, mlflow_store
):
    """A resume while another command is still on the run (the run itself, or a resume launched
    twice) would have two Coordinators write one checkpoint and one states folder: refused in one
    line, before Ray; the lock is the driver's, so a killed run frees it."""
    cfg = load_config(None, tiny_overrides(rounds=3, checkpoint_every=1))
    held_while_running = []

    def probe(rnd, metrics):  # the run's own folder, while its rounds go on
        (folder,) = run_folders(tmp_path)
        held_while_running.append(folder_is_held(folder))

    stopped = run_experiment(cfg, stop_after_round=1, on_round=probe)
    assert held_while_running == [True]
    (folder,) = run_folders(tmp_path)
    assert not folder_is_held(folder)  # released as the run returned

    with FileLock(folder / LOCK_FILE):  # another command on the run
        resumed = run_cli(tmp_path, "--resume", stopped.run_id)
    assert resumed.returncode == 2
    last = resumed.stderr.strip().splitlines()[-1]
    assert last == (
        f"fedray: error: --resume {stopped.run_id}: the run is going on in another command (its folder "
        f"{folder} is in use); stop that one first, or wait for it to end"
    ), resumed.stderr[-2000:]
    assert "Ray" not in resumed.stdout + resumed.stderr.replace(last, "")  # it stopped before Ray started
    assert MlflowClient(mlflow_store).get_run(stopped.run_id).info.status == "KILLED"  # not reopened


def run_folders(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / ".fedray").iterdir() if (p / "config.yaml").is_file()]


def folder_is_held(folder: Path) -> bool:
    lock = FileLock(folder / LOCK_FILE, timeout=0)  # its own file descriptor: as another command's
    try:
        lock.acquire()
    except Timeout:
        return True
    lock.release()
    return False


@pytest.mark.skipif(not hasattr(torch.serialization, "set_crc32_options"), reason="torch < 2.6 always sums")
def test_states_are_saved_without_the_checksum_torch_load_never_checks(tmp_path):
    state = {"module": {"w": torch.randn(300, 7), "n": torch.tensor(3)}, "optimizer": None}
    path = tmp_path / "s.pt"
    storage.save_torch(state, str(path))
    assert {info.CRC for info in zipfile.ZipFile(path).infolist()} == {0}  # nothing summed
    assert torch.serialization.get_crc32_options()  # the process's own saves still sum
    loaded = storage.load_torch(str(path))
    assert torch.equal(loaded["module"]["w"], state["module"]["w"]) and loaded["module"]["n"] == 3


class LiveServer:
    """A server whose state_dict hands out its live tensors, as a module's does."""

    def __init__(self) -> None:
        self.w = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]

    def select(self, rnd: int, k: int) -> list[int]:
        return list(range(k))

    def global_model(self) -> None:
        return None


def test_a_checkpoint_holds_the_round_it_was_taken_after_whatever_the_next_rounds_change(tmp_path):
    server, record = LiveServer(), LoopRecord()
    record.history.append({"loss": 1.0})
    taken = take_checkpoint(str(tmp_path), 1, server, StateStore(), record)
    server.w += 5  # round 2 runs before round 1's checkpoint is written
    record.history.append({"loss": 0.5})
    state = storage.load_torch(write_checkpoint(taken))
    assert state["round"] == 1 and state["history"] == [{"loss": 1.0}]
    assert torch.equal(state["server"]["w"], torch.zeros(3))


def test_a_checkpoint_that_could_not_be_written_fails_the_run_at_the_next_one(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the run's folder should be")
    written = []
    writer = CheckpointWriter(lambda done, path: written.append(done))
    checkpoint = take_checkpoint(str(blocked), 1, LiveServer(), StateStore(), LoopRecord())
    writer.submit(1, checkpoint)
    with pytest.raises(OSError):
        writer.submit(2, checkpoint)  # one at a time: the next waits for the last, and hears how it went
    writer.wait()  # said once
    assert written == []


def test_a_checkpoint_cut_short_leaves_the_last_one_whole(tmp_path, monkeypatch):
    directory, server, store, record = str(tmp_path), LiveServer(), StateStore(), LoopRecord()
    store.directory = directory

    def trains(value: float) -> None:  # a worker writes client 7's new state, the Coordinator commits it
        storage.save_torch(
            {"module": {"w": torch.full((2,), value)}, "optimizer": None}, store.task(7, None).commit_file
        )
        store.commit(7, (0, 0))

    trains(1.0)
    write_checkpoint(take_checkpoint(directory, 1, server, store, record))
    store.landed()
    trains(0.0)
    second = take_checkpoint(directory, 2, server, store, record)

    def refuse_the_checkpoint_file(uri, data, *args, write=storage.write_bytes, **kwargs):
        if uri.endswith("checkpoint.pt"):
            raise OSError("disk full")
        write(uri, data, *args, **kwargs)

    monkeypatch.setattr(storage, "write_bytes", refuse_the_checkpoint_file)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(second)  # client 7's new state is on disk, the checkpoint file is not
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["7-v1.pt", "7-v2.pt"]
    resumed = StateStore()
    done, _ = load_checkpoint(directory, LiveServer(), resumed)
    assert done == 1 and resumed.version == {7: 1}
    assert torch.equal(resumed.states([7])[7]["module"]["w"], torch.ones(2))


def test_a_run_starting_on_its_folder_deletes_a_checkpoint_a_killed_writer_cut_short(tmp_path):
    from fedray.platform.runtime.checkpoint import drop_partial_writes

    for name in ("checkpoint.pt", "checkpoint.pt.0123abcd.tmp", "config.yaml", "notes.tmp"):
        (tmp_path / name).write_bytes(b"x")
    drop_partial_writes(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "config.yaml", "notes.tmp"]
    drop_partial_writes(str(tmp_path / "not-there"))  # nothing to list: nothing said


def test_a_run_returns_once_its_last_checkpoint_has_landed(tmp_path, monkeypatch):
    def slow_write(checkpoint, write=checkpoint_module.write_checkpoint):
        time.sleep(1.0)  # a write still on its way when the last round ends
        return write(checkpoint)

    monkeypatch.setattr(checkpoint_module, "write_checkpoint", slow_write)
    loop = RoundLoop()
    loop.cfg = load_config(None, tiny_overrides(rounds=2, checkpoint_every=1))
    loop.server, loop.store, loop.record = LiveServer(), StateStore(), LoopRecord()
    loop.start_round, loop.halting, loop.commits = 0, False, False
    loop.spec = registry.get("fedavg")  # whose server code the loop would name, were select to fail
    loop.run_round = lambda rnd, selected: {"loss": float(rnd)}
    loop.run(str(tmp_path))
    assert storage.load_torch(str(tmp_path / "checkpoint.pt"))["round"] == 2
    saved = [e for e in loop.events.poll(0) if isinstance(e, CheckpointSaved)]
    assert [e.round for e in saved] == [1, 2]
