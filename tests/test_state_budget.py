"""``ray.client_states_mb``: committed client states that a landed checkpoint holds leave memory past
the budget (oldest first) and are read back from their files when needed; a run under any budget
gives the same numbers as one that keeps every state in memory."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_overrides, without_timing

from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.checkpoint import LoopRecord, load_checkpoint, take_checkpoint, write_checkpoint
from fedray.platform.runtime.driver import run_experiment
from fedray.platform.runtime.state_store import StateStore

MB = 2**20


class NoServer:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def state(value: float) -> dict:
    return {"module": {"w": torch.full((MB // 4,), value)}, "optimizer": None}  # 1 MB


def commit(store: StateStore, ray_session, client: int, value: float) -> None:
    store.commit(client, ray_session.put(state(value)), (0, 0), MB)


def checkpoint(store: StateStore, directory: str, done: int):
    taken = take_checkpoint(directory, done, NoServer(), store, LoopRecord())
    write_checkpoint(taken)
    return taken


def read_back(store: StateStore, ray_session, client: int) -> float:
    (ref,) = store.task(client, None).state
    return float(ray_session.get(ref)["module"]["w"][0])


def test_past_the_budget_the_oldest_states_a_landed_checkpoint_holds_leave_memory(tmp_path, ray_session):
    # Prepare: three clients of 1 MB committed in the order 1, 2, 3; a budget of 1 MB
    store, directory = StateStore(memory_mb=1), str(tmp_path)
    for client in (1, 2, 3):
        commit(store, ray_session, client, float(client))
    taken = checkpoint(store, directory, 1)
    assert sorted(store.refs) == [1, 2, 3]  # written, but not yet known to have landed: all kept
    # Act: the checkpoint lands
    store.landed(taken.states)
    # Assert: the two oldest left memory; every state still reads as committed (from its file)
    assert sorted(store.refs) == [3] and store.clients() == [1, 2, 3] and len(store) == 3
    assert {c: float(s["module"]["w"][0]) for c, s in store.states([1, 2, 3]).items()} == {1: 1, 2: 2, 3: 3}
    assert [read_back(store, ray_session, c) for c in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert sorted(store.refs) == [3]  # a state read back for a call is the call's: it stays out


def test_a_state_committed_after_its_checkpoint_was_taken_stays_until_its_own_lands(tmp_path, ray_session):
    store, directory = StateStore(memory_mb=0), str(tmp_path)
    commit(store, ray_session, 1, 1.0)
    commit(store, ray_session, 2, 2.0)
    taken = checkpoint(store, directory, 1)
    commit(store, ray_session, 1, 10.0)  # client 1 trains again while that checkpoint is written
    store.landed(taken.states)
    # client 2's only state is on disk: it leaves; client 1's new state is nowhere else: it stays
    assert sorted(store.refs) == [1]
    assert read_back(store, ray_session, 1) == 10.0 and store.version[1] == 2
    second = checkpoint(store, directory, 2)  # writes client 1's version 2, retires its version 1
    store.landed(second.states)
    assert store.refs == {} and (tmp_path / "states" / "1-v2.pt").is_file()
    assert not (tmp_path / "states" / "1-v1.pt").exists()
    assert read_back(store, ray_session, 1) == 10.0 and read_back(store, ray_session, 2) == 2.0


def test_without_a_budget_every_state_stays_and_a_resumed_store_reads_states_when_asked(
    tmp_path, ray_session
):
    store, directory = StateStore(), str(tmp_path)
    commit(store, ray_session, 4, 4.0)
    store.landed(checkpoint(store, directory, 1).states)
    assert sorted(store.refs) == [4]
    resumed = StateStore()
    done, _ = load_checkpoint(directory, NoServer(), resumed)
    assert done == 1 and resumed.refs == {} and resumed.version == {4: 1}
    assert read_back(resumed, ray_session, 4) == 4.0 and resumed.task(5, None).state == []


def test_the_budget_is_1000_mb_unless_set_and_a_negative_one_is_one_line():
    assert load_config(None, []).ray.client_states_mb == 1000
    assert load_config(None, ["ray.client_states_mb=null"]).ray.client_states_mb is None
    with pytest.raises(ConfigError, match=r"^ray.client_states_mb=-1: must be >= 0 or null"):
        load_config(None, ["ray.client_states_mb=-1"])


@pytest.mark.usefixtures("ray_session")
def test_a_run_whose_states_leave_memory_repeats_the_run_that_keeps_them_and_resumes_to_it(mlflow_store):
    # FedSSA: every client keeps its model; 2 of 4 clients a round, each worker caching one module,
    # so clients come back to, and every evaluation tests, states that a budget of 0 MB has sent to
    # disk (a checkpoint after every round)
    overrides = tiny_overrides(
        rounds=5,
        checkpoint_every=1,
        algorithm="fedssa",
        **{"train.fraction": 0.5, "train.local_epochs": 1, "ray.cache_clients": 1},
    )
    kept = run_experiment(load_config(None, [*overrides, "ray.client_states_mb=null"]))
    on_disk = load_config(None, [*overrides, "ray.client_states_mb=0"])
    whole = run_experiment(on_disk)
    stopped = run_experiment(on_disk, stop_after_round=2)
    resumed = run_experiment(on_disk, resume_run_id=stopped.run_id)
    for run in (whole, resumed):
        assert without_timing(run.history) == without_timing(kept.history)
        assert run.client_acc == kept.client_acc
    assert len(kept.client_acc) == 4  # every client tested, dropped or not
