"""The client state store: which version of each client's state is current, and its file.

A client is its state and its shard, not a process. A worker that trains a client which keeps state
writes the new state to ``states/<cid>-v<version>.pt`` under the run's checkpoint directory before its
call returns (write-through), so a state is on disk before it is committed, and a worker that dies
loses nothing committed. The store keeps, per client that has ever committed, its version (the
number of commits) and which worker produced it, so dispatch can send the client back to a worker
that still caches its module. A client never selected has no entry: its initial model is a function
of (seed, client id).

A state is committed only when its uplink is accepted: a client whose worker died or whose code
raised keeps its previous state, and a retry starts from it (and writes the same file again).

A checkpoint is the list of each client's current version (:meth:`StateStore.manifest`): nothing
is copied when it is taken. A version's file goes once nothing needs it: not current, and listed
neither by the last checkpoint that landed nor by the one on its way. A resumed run finds the files
of versions newer than its checkpoint that the interrupted run wrote; it writes each again before
committing it, so it never reads one; it deletes them as it starts (:meth:`StateStore.sweep`), with
what calls that failed wrote and temporary files a killed worker left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fedray.platform.runtime import storage

STATES_DIR = "states"


def state_name(client: int, version: int) -> str:
    return f"{client}-v{version}.pt"


STATE_NAME = re.compile(r"(\d+)-v(\d+)\.pt")


def state_file(directory: str, client: int, version: int) -> str:
    """The file of version ``version`` of a client's state, under the run's checkpoint directory."""
    return storage.join(directory, STATES_DIR, state_name(client, version))


@dataclass
class ClientTask:
    """What a worker needs to take up one client: its shard (an ObjectRef boxed in a list, so Ray
    hands it over unresolved: the worker fetches it only when it does not hold the client's data),
    its committed state's file (None: never committed, the initial model) and, for clients that keep
    state, the file the state it trains to goes to."""

    client: int
    shard: list
    state_file: str | None = None
    version: int = 0
    commit_file: str | None = None


class StateStore:
    def __init__(self) -> None:
        self.directory: str | None = None  # the run's checkpoint directory, once the run has one
        self.version: dict[int, int] = {}  # client -> commits so far: every client that ever committed
        self.holder: dict[int, tuple[int, int]] = {}  # client -> (worker slot, worker generation)
        self.landed_manifest: dict[int, int] = {}  # client -> version the last landed checkpoint lists
        self.pending_manifest: dict[int, int] = {}  # the same, of the checkpoint on its way

    def task(self, client: int, shard_ref, commits: bool = True) -> ClientTask:
        version = self.version.get(client, 0)
        current = self.file(client, version) if version else None
        after = self.file(client, version + 1) if commits else None
        return ClientTask(client, [shard_ref], current, version, after)

    def tasks(self, clients: list[int], shard_refs: list, commits: bool = True) -> list[ClientTask]:
        return [self.task(c, shard_refs[c], commits) for c in clients]

    def run_directory(self) -> str:
        if self.directory is None:
            raise RuntimeError("the state store has no directory yet: the run has not started")
        return self.directory

    def file(self, client: int, version: int) -> str:
        return state_file(self.run_directory(), client, version)

    def commit(self, client: int, holder: tuple[int, int]) -> None:
        """The client's uplink is in: the state its worker wrote is the truth now; the version it
        replaces goes unless a checkpoint lists it."""
        old = self.version.get(client, 0)
        self.version[client] = old + 1
        self.holder[client] = holder
        if old:
            self.forget_unneeded(client, old)

    def needed(self, client: int, version: int) -> bool:
        return version in (
            self.version.get(client),
            self.landed_manifest.get(client),
            self.pending_manifest.get(client),
        )

    def forget_unneeded(self, client: int, version: int) -> None:
        if not self.needed(client, version):
            storage.delete_if_there(self.file(client, version))

    def drop_uncommitted(self, client: int) -> None:
        """The client's call failed: the version it trained to, if its worker wrote it, is never read
        (a later call that trains it writes that name again)."""
        storage.delete_if_there(self.file(client, self.version.get(client, 0) + 1))

    def sweep(self) -> None:
        """As a run starts on its folder: delete the state files nothing needs. A resumed run finds
        the versions its interrupted run wrote after the checkpoint (and those of an earlier
        checkpoint it had not yet dropped), and temporary files of writes a killed worker cut short.
        Best effort (:func:`storage.clean_up`): a process of the interrupted run that is still alive
        may write after it."""
        storage.clean_up(
            storage.join(self.run_directory(), STATES_DIR),
            self.unneeded,
            "state files of an interrupted run were",
        )

    def unneeded(self, name: str) -> bool:
        """Whether a file of the states folder can go: a version nothing needs, or a write cut short
        (anything else in the folder is not the store's)."""
        match = STATE_NAME.fullmatch(name)
        if match:
            return not self.needed(int(match[1]), int(match[2]))
        return name.endswith(storage.PARTIAL)

    def clients(self) -> list[int]:
        """Every client that has committed a state, in order."""
        return sorted(self.version)

    def __len__(self) -> int:
        return len(self.version)

    # ---- checkpoints
    def manifest(self) -> dict[int, str]:
        """The checkpoint's list: client -> the file name of its current state. Taking it pins those
        versions until a later checkpoint has landed."""
        self.pending_manifest = dict(self.version)
        return {c: state_name(c, v) for c, v in sorted(self.version.items())}

    def unlanded_files(self) -> list[str]:
        """The files of the current versions that the last landed checkpoint does not list: what a
        checkpoint taken now must flush to the disk before it lands."""
        return [self.file(c, v) for c, v in sorted(self.version.items()) if self.landed_manifest.get(c) != v]

    def landed(self) -> None:
        """The checkpoint on its way has landed: the versions only the one before it listed go."""
        before, self.landed_manifest, self.pending_manifest = self.landed_manifest, self.pending_manifest, {}
        for client, version in before.items():
            self.forget_unneeded(client, version)

    def read(self, directory: str, manifest: dict[int, str]) -> None:
        """Take over the states a checkpoint lists (read from their files when needed)."""
        self.directory = directory
        self.version = {c: int(name.rsplit("-v", 1)[1].removesuffix(".pt")) for c, name in manifest.items()}
        self.landed_manifest, self.pending_manifest = dict(self.version), {}
        self.holder.clear()  # a resumed run's workers cache nothing yet

    def states(self, clients: list[int]) -> dict[int, Any]:
        """The committed states of ``clients``, read from their files."""
        return {c: storage.load_torch(self.file(c, self.version[c])) for c in clients}
