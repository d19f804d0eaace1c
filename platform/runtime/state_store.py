"""The client state store: every client's last committed state, owned by the run.

A client is its state and its shard, not a process. The store keeps, per client that has ever
committed, an ObjectRef to its state in Ray's object store (which spills to disk when states outgrow
memory) plus a version (the number of commits), and which worker produced it, so dispatch can send
the client back to a worker that still caches its module. A client never selected has no entry: its
initial model is a function of (seed, client id).

A state is committed only when its uplink is accepted: a client whose worker died or whose code
raised keeps its previous state, and a retry starts from it.

Checkpoints are incremental: each committed state is written once, as ``states/<cid>-v<version>.pt``
under the checkpoint directory, and the checkpoint file lists which version of each client is
current, so a checkpoint of 1,000 clients rewrites only the clients that trained since the last one.

With a memory budget (``ray.client_states_mb``), a state that a landed checkpoint holds may leave
the object store: past the budget the oldest such states are dropped, and a dropped client's state is
read back from its file when it is selected again. A resumed run reads the states it needs that way
too, instead of loading every state the checkpoint lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from fedray.platform.runtime import storage


@dataclass
class ClientTask:
    """What a worker needs to take up one client: its shard and its committed state.

    Both are ObjectRefs boxed in a list (``[ref]``) so that Ray hands them to the worker unresolved:
    the worker fetches them only when its cache does not already hold this version of the client.
    """

    client: int
    shard: list
    state: list = field(default_factory=list)  # [] = never committed: the initial model
    version: int = 0


class StateStore:
    def __init__(self, memory_mb: int | None = None) -> None:
        self.refs: dict[int, Any] = {}  # client -> ObjectRef of its committed state, while in memory
        self.version: dict[int, int] = {}  # client -> commits so far: every client that ever committed
        self.holder: dict[int, tuple[int, int]] = {}  # client -> (worker slot, worker generation)
        self.written: dict[int, int] = {}  # client -> version in the checkpoint directory (or on its way)
        self.files: dict[int, str] = {}  # client -> its current state's file, in a checkpoint that landed
        self.resident: dict[int, int] = {}  # client -> bytes of its state in memory, oldest first
        self.budget = None if memory_mb is None else memory_mb * 2**20

    def task(self, client: int, shard_ref) -> ClientTask:
        return ClientTask(client, [shard_ref], self.state_ref(client), self.version.get(client, 0))

    def tasks(self, clients: list[int], shard_refs: list) -> list[ClientTask]:
        """One call's clients as tasks, made as the call is sent (a dropped state is read back then)."""
        return [self.task(c, shard_refs[c]) for c in clients]

    def state_ref(self, client: int) -> list:
        """``[ref]`` of a client's committed state (``[]``: never committed). A state the budget
        dropped from memory is read back from its file into an object of the call's own, gone once
        the call is (a client that trains commits a new state anyway)."""
        if client not in self.version:
            return []
        if client not in self.refs:
            return [ray.put(storage.load_torch(self.files[client]))]
        return [self.refs[client]]

    def commit(self, client: int, state_ref, holder: tuple[int, int], nbytes: int = 0) -> None:
        self.refs[client] = state_ref
        self.version[client] = self.version.get(client, 0) + 1
        self.holder[client] = holder
        self.files.pop(client, None)  # the file a checkpoint holds is an older version's now
        self.resident.pop(client, None)
        self.resident[client] = nbytes  # the newest last

    def clients(self) -> list[int]:
        """Every client that has committed a state, in order."""
        return sorted(self.version)

    def __len__(self) -> int:
        return len(self.version)

    # ---- checkpoints
    def claim_unwritten(self, directory: str) -> tuple[list[tuple[int, str, Any]], list[str]]:
        """What the next checkpoint must write: (client, file, ObjectRef) of each state committed since the
        last call, and the files of the versions they replace (deleted once that checkpoint has
        landed). From here on they count as written: the next call leaves them out."""
        new, superseded = [], []
        for client in self.version:
            if self.written.get(client) == self.version[client]:
                continue
            if client in self.written:
                superseded.append(
                    storage.join(directory, "states", self.file_name(client, self.written[client]))
                )
            new.append((client, storage.join(directory, "states", self.file_name(client)), self.refs[client]))
            self.written[client] = self.version[client]
        return new, superseded

    def manifest(self) -> dict[int, str]:
        """The checkpoint's list: client -> the file of its current state."""
        return {c: self.file_name(c) for c in self.clients()}

    def file_name(self, client: int, version: int | None = None) -> str:
        """The file of a client's state: its current version's, or ``version``'s."""
        return f"{client}-v{self.version[client] if version is None else version}.pt"

    def landed(self, written: list[tuple[int, str, Any]]) -> None:
        """A checkpoint that wrote these (client, file, ObjectRef) has landed: a state still current is
        safe on disk, and may leave memory (:meth:`drop_past_budget`)."""
        for client, path, ref in written:
            if self.refs.get(client) is ref:
                self.files[client] = path
        self.drop_past_budget()

    def drop_past_budget(self) -> None:
        """Over the budget, drop from memory the oldest states that a landed checkpoint holds (called
        between rounds: no call in flight still needs a dropped ref)."""
        if self.budget is None:
            return
        total = sum(self.resident.values())
        for client in [c for c in self.resident if c in self.files]:
            if total <= self.budget:
                break
            total -= self.resident.pop(client)
            del self.refs[client]

    def read(self, directory: str, manifest: dict[int, str]) -> None:
        """Take over the states a checkpoint lists: each is read from its file when needed."""
        for client, name in manifest.items():
            self.files[client] = storage.join(directory, "states", name)
            self.version[client] = int(name.rsplit("-v", 1)[1].removesuffix(".pt"))
            self.written[client] = self.version[client]
        self.holder.clear()  # a resumed run's workers cache nothing yet

    def states(self, clients: list[int]) -> dict[int, Any]:
        """The committed states of ``clients``: from memory, or read from their files."""
        held = [c for c in clients if c in self.refs]
        got = dict(zip(held, ray.get([self.refs[c] for c in held])))
        return {c: got[c] if c in got else storage.load_torch(self.files[c]) for c in clients}
