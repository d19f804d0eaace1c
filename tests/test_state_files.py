"""Write-through client states: a worker writes a client's new state to its file before its call
returns, the store commits it when the uplink is in, and a version's file goes once nothing needs it
(not current, not listed by the last landed checkpoint nor by the one on its way); a run gives the
same numbers with a checkpoint after every round, with none, and stopped and resumed."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides, without_timing

from fedray.platform.catalog import load_config
from fedray.platform.runtime import storage
from fedray.platform.runtime.checkpoint import LoopRecord, load_checkpoint, take_checkpoint, write_checkpoint
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.runtime.failures import Failure
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.tracking.mlflow_run import recorded_checkpoint_dir


class NoServer:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def trains(store: StateStore, client: int, value: float) -> None:
    """What a worker does for a client, then the Coordinator: the new state to the task's file, committed."""
    task = store.task(client, None)
    storage.save_torch({"module": {"w": torch.full((4,), value)}, "optimizer": None}, task.commit_file)
    store.commit(client, (0, 0))


def files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "states").iterdir())


def checkpoint(store: StateStore, directory: str, done: int):
    return take_checkpoint(directory, done, NoServer(), store, LoopRecord())


def test_without_checkpoints_only_the_current_version_of_each_client_stays(tmp_path):
    store = StateStore()
    store.directory = str(tmp_path)
    trains(store, 1, 1.0)
    trains(store, 2, 2.0)
    trains(store, 1, 3.0)
    assert files(tmp_path) == ["1-v2.pt", "2-v1.pt"]
    task = store.task(1, "shard")
    assert task.state_file == str(tmp_path / "states" / "1-v2.pt") and task.version == 2
    assert task.commit_file == str(tmp_path / "states" / "1-v3.pt")
    assert store.task(3, "shard").state_file is None  # never trained: its initial model
    assert float(store.states([1])[1]["module"]["w"][0]) == 3.0


def test_a_version_a_checkpoint_lists_stays_until_a_later_checkpoint_has_landed(tmp_path):
    store, directory = StateStore(), str(tmp_path)
    store.directory = directory
    trains(store, 1, 1.0)
    first = checkpoint(store, directory, 1)  # lists 1-v1
    trains(store, 1, 2.0)
    trains(store, 1, 3.0)  # 1-v2 was never listed: it goes at once; 1-v1 is on its way
    assert files(tmp_path) == ["1-v1.pt", "1-v3.pt"]
    write_checkpoint(first)
    store.landed()
    trains(store, 1, 4.0)  # 1-v1 is the landed checkpoint's
    assert files(tmp_path) == ["1-v1.pt", "1-v4.pt"]
    second = checkpoint(store, directory, 2)  # lists 1-v4
    trains(store, 1, 5.0)
    write_checkpoint(second)
    store.landed()  # 1-v1 goes; 1-v4 is the landed checkpoint's now
    assert files(tmp_path) == ["1-v4.pt", "1-v5.pt"]

    resumed = StateStore()
    done, _ = load_checkpoint(directory, NoServer(), resumed)
    assert done == 2 and resumed.version == {1: 4}
    assert float(resumed.states([1])[1]["module"]["w"][0]) == 4.0
    trains(resumed, 1, 6.0)  # the resumed run writes v5 again (the interrupted run's is overwritten)
    assert files(tmp_path) == ["1-v4.pt", "1-v5.pt"]
    assert float(resumed.states([1])[1]["module"]["w"][0]) == 6.0


def test_a_checkpoint_reaches_the_disk_after_the_states_it_lists(tmp_path, monkeypatch):
    # a rename is atomic against a killed process, not against the host's crash: the states a
    # checkpoint lists are flushed (files, then their folder) before it is, and it (its temporary
    # file, then its folder: the rename) before the run deletes what only the last one listed
    synced = []
    flush = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}")).relative_to(tmp_path).as_posix()
        synced.append((re.sub(r"\.[0-9a-f]{8}\.tmp$", ".tmp", path), (tmp_path / "checkpoint.pt").exists()))
        flush(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store, directory = StateStore(), str(tmp_path)
    store.directory = directory
    trains(store, 1, 1.0)
    trains(store, 2, 2.0)
    assert synced == []  # a worker's write of a state is not flushed: its checkpoint does that
    write_checkpoint(checkpoint(store, directory, 1))
    store.landed()
    assert synced == [
        ("states/1-v1.pt", False),
        ("states/2-v1.pt", False),
        ("states", False),
        ("checkpoint.pt.tmp", False),
        (".", True),
    ]
    synced.clear()
    trains(store, 1, 3.0)
    write_checkpoint(checkpoint(store, directory, 2))  # 2-v1 is on the disk since the first
    assert [path for path, _ in synced] == ["states/1-v2.pt", "states", "checkpoint.pt.tmp", "."]


def test_a_filesystem_that_cannot_flush_is_written_as_before_and_a_file_uri_is_flushed(tmp_path, monkeypatch):
    flushed, flush = [], os.fsync

    def fsync(fd, refuse=errno.EINVAL):  # some FUSE and network mounts refuse to flush a folder
        if os.path.isdir(f"/proc/self/fd/{fd}") or refuse == errno.EIO:
            raise OSError(refuse, os.strerror(refuse))
        flushed.append(fd)
        flush(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage.write_bytes(f"file://{tmp_path}/checkpoint.pt", b"x", durable=True)
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"x" and len(flushed) == 1  # the file, via file://
    monkeypatch.setattr(os, "fsync", lambda fd: fsync(fd, errno.EIO))  # a disk that fails: the write does
    with pytest.raises(OSError, match="Input/output error"):
        storage.write_bytes(str(tmp_path / "checkpoint.pt"), b"y", durable=True)
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"x"


def test_a_resumed_run_starts_by_deleting_what_its_interrupted_run_left_that_nothing_needs(tmp_path):
    store, directory = StateStore(), str(tmp_path)
    store.directory = directory
    trains(store, 1, 1.0)
    first = checkpoint(store, directory, 1)  # lists 1-v1
    write_checkpoint(first)
    trains(store, 1, 2.0)
    trains(store, 2, 3.0)  # client 2's first state, after the checkpoint
    second = checkpoint(store, directory, 2)  # lists 1-v2 and 2-v1; the run dies as it lands,
    write_checkpoint(second)  # before its store hears of it: 1-v1 stays
    trains(store, 1, 4.0)  # after the last checkpoint: 1-v3
    (tmp_path / "states" / "1-v4.pt.0123abcd.tmp").write_bytes(b"cut short by a SIGKILL")
    (tmp_path / "states" / "notes.txt").write_text("not the store's")
    assert files(tmp_path) == [
        "1-v1.pt",
        "1-v2.pt",
        "1-v3.pt",
        "1-v4.pt.0123abcd.tmp",
        "2-v1.pt",
        "notes.txt",
    ]

    resumed = StateStore()
    load_checkpoint(directory, NoServer(), resumed)
    resumed.sweep()
    assert files(tmp_path) == ["1-v2.pt", "2-v1.pt", "notes.txt"]
    assert float(resumed.states([1])[1]["module"]["w"][0]) == 2.0


def test_a_failed_calls_state_is_deleted_and_the_committed_one_kept(tmp_path):
    from types import SimpleNamespace

    from fedray.platform.runtime.dispatch import accept_uplinks
    from fedray.platform.runtime.worker import ClientResult

    store = StateStore()
    store.directory = str(tmp_path)
    trains(store, 1, 1.0)
    trains(store, 2, 2.0)
    for client in (1, 2, 3):  # each call wrote the version it trained to; 1's code then raised in upload
        storage.save_torch({"w": torch.zeros(1)}, store.task(client, None).commit_file)
    trained = SimpleNamespace(
        results={
            (0,): ([ClientResult(1, None, {}, Failure("ValueError: boom")), ClientResult(2, {}, {})], (0, 0))
        },
        failed={(3,): Failure("worker died")},  # 3's worker died after writing, and its retries too
    )
    uplinks, _, failed = accept_uplinks(trained, store, commits=True)
    assert list(uplinks) == [2] and sorted(failed) == [1, 3]
    assert files(tmp_path) == ["1-v1.pt", "2-v2.pt"]
    assert store.version == {1: 1, 2: 2}


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken" / "x").mkdir(parents=True)  # a folder where the file should go: the rename fails
    with pytest.raises(OSError):
        storage.write_bytes(str(tmp_path / "taken"), b"a state")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.usefixtures("ray_session")
def test_a_run_repeats_itself_with_or_without_checkpoints_and_resumed_and_leaves_its_current_states(
    mlflow_store,
):
    # FedSSA: every client keeps its model; 2 of 4 clients a round, each worker caching one module,
    # so clients come back to, and every evaluation tests, states read from their files
    overrides = tiny_overrides(
        rounds=5,
        algorithm="fedssa",
        **{"train.fraction": 0.5, "train.local_epochs": 1, "ray.cache_clients": 1},
    )
    plain = run_experiment(load_config(None, [*overrides, "checkpoint_every=0"]))
    every = load_config(None, [*overrides, "checkpoint_every=1"])
    whole = run_experiment(every)
    stopped = run_experiment(every, stop_after_round=2)
    left = Path(recorded_checkpoint_dir(stopped.run_id)) / "states"  # as a run killed mid-round leaves it:
    (left / "0-v9.pt").write_bytes(b"a version after the checkpoint")
    (left / "0-v10.pt.0123abcd.tmp").write_bytes(b"a write cut short")
    (left.parent / "checkpoint.pt.0123abcd.tmp").write_bytes(b"a checkpoint cut short")
    resumed = run_experiment(every, resume_run_id=stopped.run_id)
    # a stop asked for (--stop-after, a job's time limit) is a checkpoint of its own, whatever
    # checkpoint_every says; a resume asked to stop where the run already is trains nothing
    sparse = load_config(None, [*overrides, "checkpoint_every=3"])
    stopped = run_experiment(sparse, stop_after_round=2)
    again = run_experiment(sparse, resume_run_id=stopped.run_id, stop_after_round=1)
    assert not again.finished and len(again.history) == 2
    resumed_sparse = run_experiment(sparse, resume_run_id=stopped.run_id)
    for run in (whole, resumed, resumed_sparse):
        assert without_timing(run.history) == without_timing(plain.history)
        assert run.client_acc == plain.client_acc
    assert len(plain.client_acc) == 4  # every client tested
    for run in (plain, whole, resumed):  # a finished run's folder: each client's current state only,
        # what the interrupted run left deleted as the resumed one started
        directory = Path(recorded_checkpoint_dir(run.run_id))
        names = sorted(p.name for p in (directory / "states").iterdir())
        assert len(names) == 4 and len({n.split("-v")[0] for n in names}) == 4, names
        if run is not plain:
            listed = storage.load_torch(str(directory / "checkpoint.pt"))["states"]
            assert sorted(listed.values()) == names
            assert not list(directory.glob("*.tmp"))


def test_a_worker_whose_node_does_not_see_the_runs_folder_or_does_not_answer_stops_the_run_in_one_line(
    monkeypatch, tmp_path
):
    from fedray.platform.errors import ConfigError
    from fedray.platform.runtime import coordinator

    class Worker:  # an actor handle's shape: .sees.remote(path), its value through ray.get
        def __init__(self, node: str, root):
            self.node, self.root = node, root
            self.sees = self

        def remote(self, path: str):
            return (path.startswith(str(self.root)) and storage.exists(path), self.node)

    class Hangs(Worker):  # a node whose mount hangs: its answer never comes
        def remote(self, path: str):
            return None

    def get(refs, timeout=None):  # ray.get's shape: a hanging answer times out, or waits forever
        if any(ref is None for ref in refs):
            assert timeout is not None, "checked with no timeout: a hung mount hangs the run"
            raise coordinator.ray.exceptions.GetTimeoutError("timed out")
        return refs

    monkeypatch.setattr(coordinator.ray, "get", get)
    with pytest.raises(ConfigError, match=r"^storage_path: a ClientActor did not say in \d+ s whether"):
        coordinator.check_workers_see(
            [Worker("10.0.0.1", tmp_path), Hangs("10.0.0.3", tmp_path)], str(tmp_path)
        )
    (tmp_path / "config.yaml").write_text("seed: 0")
    coordinator.check_workers_see([Worker("10.0.0.1", tmp_path)], str(tmp_path))  # it sees: nothing said
    with pytest.raises(ConfigError) as err:
        coordinator.check_workers_see(
            [Worker("10.0.0.1", tmp_path), Worker("10.0.0.2", "/elsewhere")], str(tmp_path)
        )
    assert "\n" not in str(err.value) and "node 10.0.0.2" in str(err.value)
    assert str(err.value).startswith("storage_path: the run's folder")


def test_a_state_its_worker_cannot_write_fails_its_client_and_a_folder_the_node_misses_stops_the_run(
    tmp_path,
):
    from in_process import client_task

    from fedray.platform.errors import ConfigError
    from fedray.platform.runtime.driver import federation_meta, prepare_federation
    from fedray.platform.runtime.worker import ClientHost

    cfg = load_config(None, tiny_overrides(algorithm="local", **{"train.local_epochs": 1}))
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    (tmp_path / "blocked").write_text("a file where the run's folder should be")
    task = client_task(0, fed.shards[0], str(tmp_path / "blocked"), make_folder=False)
    (result,) = host.train(0, [task], [[{}]])
    assert (
        "Not a directory" in result.error.line and "\n" not in result.error.line
    )  # its client failed, in one line
    assert 0 not in host.modules  # and no module is cached as a version no file holds

    missing = client_task(0, fed.shards[0], str(tmp_path / "not-on-this-node"), make_folder=False)
    with pytest.raises(ConfigError, match=r"^storage_path: client 0's state .* is not reachable from node"):
        host.train(0, [missing], [[{}]])


def resident_pages(path: str) -> int:
    """How many of the file's pages the kernel holds in memory (``mincore`` of a mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    int_, size_t = ctypes.c_int, ctypes.c_size_t
    libc.mmap.argtypes = [ctypes.c_void_p, size_t, int_, int_, int_, ctypes.c_long]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0
        finally:
            libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector)


# posix_fadvise and mincore: Linux (and the BSDs); elsewhere the files stay in the page cache
needs_fadvise = pytest.mark.skipif(not hasattr(os, "POSIX_FADV_DONTNEED"), reason="no posix_fadvise here")


@needs_fadvise
def test_a_state_file_leaves_the_page_cache_once_the_worker_has_flushed_it_and_reads_back_whole(tmp_path):
    from in_process import client_task

    from fedray.platform.runtime.driver import federation_meta, prepare_federation
    from fedray.platform.runtime.state_store import state_file
    from fedray.platform.runtime.worker import ClientHost

    cfg = load_config(None, tiny_overrides(algorithm="local"))  # its clients keep their models
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    (result,) = host.train(0, [client_task(0, fed.shards[0], str(tmp_path))], [[{}]])
    assert result.error is None
    assert host.pages.done(timeout=60)
    written = state_file(str(tmp_path), 0, 1)
    assert resident_pages(written) == 0  # on the disk only: written, flushed, dropped
    version, cached = host.modules.take(0)  # the worker's own copy of the state: its cached module
    assert version == 1
    state = storage.load_torch(written)["module"]
    assert state.keys() == cached.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in cached.state_dict().items())
    assert resident_pages(written) > 0  # read back: the check itself sees pages again


@needs_fadvise
def test_a_file_deleted_before_its_turn_is_passed_over_a_file_uri_is_released_and_an_object_stores_is_never_queued(
    tmp_path,
):
    from fedray.platform.runtime.page_cache import PageReleaser

    releaser = PageReleaser()
    kept = tmp_path / "kept.pt"
    kept.write_bytes(os.urandom(1 << 20))
    releaser.release(str(tmp_path / "superseded.pt"))  # a version deleted before its turn
    releaser.release(str(kept))  # the thread goes on past it
    by_uri = tmp_path / "by-uri.pt"  # a storage_path given as file:///... is local too
    by_uri.write_bytes(os.urandom(1 << 20))
    releaser.release(by_uri.as_uri())
    assert releaser.done(timeout=60)
    assert resident_pages(str(kept)) == 0
    assert resident_pages(str(by_uri)) == 0
    remote = PageReleaser()
    remote.release("s3://bucket/fedray/states/1-v1.pt")  # not in this machine's memory
    assert remote.thread is None


@needs_fadvise
def test_a_file_whose_pages_cannot_be_dropped_leaves_the_thread_going(tmp_path, monkeypatch):
    from fedray.platform.runtime import page_cache

    real, kept = page_cache.drop_pages, tmp_path / "kept.pt"
    kept.write_bytes(os.urandom(1 << 20))

    def drop(path: str) -> None:
        if path.endswith("broken.pt"):
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(page_cache, "drop_pages", drop)
    releaser = page_cache.PageReleaser()
    releaser.release(str(tmp_path / "broken.pt"))
    releaser.release(str(kept))
    assert releaser.done(timeout=60)
    assert resident_pages(str(kept)) == 0
