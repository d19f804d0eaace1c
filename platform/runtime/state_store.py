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
    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}  # client -> ObjectRef of its committed state
        self.version: dict[int, int] = {}
        self.holder: dict[int, tuple[int, int]] = {}  # client -> (worker slot, worker generation)
        self.written: dict[int, int] = {}  # client -> version in the checkpoint directory (or on its way)

    def task(self, client: int, shard_ref) -> ClientTask:
        ref = self.refs.get(client)
        return ClientTask(client, [shard_ref], [] if ref is None else [ref], self.version.get(client, 0))

    def commit(self, client: int, state_ref, holder: tuple[int, int]) -> None:
        self.refs[client] = state_ref
        self.version[client] = self.version.get(client, 0) + 1
        self.holder[client] = holder

    def __len__(self) -> int:
        return len(self.refs)

    # ---- checkpoints
    def claim_unwritten(self, directory: str) -> tuple[list[tuple[int, str, Any]], list[str]]:
        """What the next checkpoint must write: (client, file, ObjectRef) of each state committed since the
        last call, and the files of the versions they replace (deleted once that checkpoint has
        landed). From here on they count as written: the next call leaves them out."""
        new, superseded = [], []
        for client in self.refs:
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
        return {c: self.file_name(c) for c in sorted(self.refs)}

    def file_name(self, client: int, version: int | None = None) -> str:
        """The file of a client's state: its current version's, or ``version``'s."""
        return f"{client}-v{self.version[client] if version is None else version}.pt"

    def read(self, directory: str, manifest: dict[int, str]) -> None:
        """Load the states a checkpoint lists back into the object store."""
        for client, name in manifest.items():
            state = storage.load_torch(storage.join(directory, "states", name))
            self.refs[client] = ray.put(state)
            self.version[client] = int(name.rsplit("-v", 1)[1].removesuffix(".pt"))
            self.written[client] = self.version[client]
        self.holder.clear()  # a resumed run's workers cache nothing yet

    def states(self, clients: list[int]) -> dict[int, Any]:
        return dict(zip(clients, ray.get([self.refs[c] for c in clients])))
