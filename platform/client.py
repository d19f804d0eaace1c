"""ClientActor: a worker process that trains and evaluates whichever client it is handed.

A client is its shard and its committed state (:mod:`fedray.platform.store`); a worker loads them
into the algorithm's ClientModule, runs ``lightning.Trainer.fit`` (on its GPU slice when it has one)
and hands back the uplink and the new state. It caches recently used clients, so a client that
comes back to the same worker loads nothing.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch

from fedray.platform.algorithm import (
    ClientContext,
    ClientModule,
    Payload,
    batch_loader,
    derive_seed,
    tests_with_global_model,
)
from fedray.platform.config import ExperimentConfig
from fedray.platform.data import ArrayDataset, ClientShard, normalize
from fedray.platform.memory import retain_freed_memory
from fedray.platform.models import arch_for_client, build_model
from fedray.platform.registry import get as get_algorithm
from fedray.platform.store import ClientTask
from fedray.platform.transport import use_fast_tensor_transport

# the global test set is split across actors in chunks this size: its sums never depend on the pool size
EVAL_CHUNK = 1024
EVAL_BATCH = 128  # forward passes this size stay in cache; 1024-image batches are about 1.7x slower on a CPU
DATA_CACHE_CLIENTS = 256  # normalised shards a worker keeps (small: a few MB each for CIFAR clients)
GLOBAL_CHUNK_CACHE = 16  # chunks of the global test set a worker keeps


def quiet_lightning() -> None:
    """Lightning prints banners and data-loader hints on every fit; a federation fits thousands of times."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def scan_lightning_plugins_once() -> None:
    """Every ``Trainer()`` reads every installed package's entry points looking for callback
    factories: about 6 ms of its 7 ms, paid on each client's fit. The installed packages do not
    change while a process lives, so the scan's result is kept (the factories still run per Trainer)."""
    from lightning.fabric.utilities import registry

    scan = getattr(registry, "entry_points", None)  # None: a Lightning that finds its callbacks otherwise
    if scan is not None and not hasattr(scan, "cache_info"):  # not cached yet
        registry.entry_points = functools.cache(scan)  # type: ignore[assignment]  # same call, cached


def make_client_model(cfg: ExperimentConfig, client_id: int, meta: dict[str, Any]):
    """The client's architecture, initialised from (seed, client id) so every run starts identically."""
    torch.manual_seed(derive_seed(cfg.seed, client_id, 0))
    arch = arch_for_client(cfg.model.group, client_id)
    return build_model(arch, meta["in_channels"], meta["image_size"], meta["num_classes"])


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: str,
    batch: int = EVAL_BATCH,
    scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """(correct, total, summed CE loss) of ``model`` on a normalised tensor dataset; ``scores`` (a
    client's ``eval_logits``) replaces the plain forward pass."""
    was_training = model.training
    model.eval().to(device)
    forward = scores or model
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        logits = forward(xb)
        correct += int((logits.argmax(1) == yb).sum())
        loss += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
    model.train(was_training)
    return correct, len(y), loss


class LRU(OrderedDict):
    """A mapping that forgets its least recently used entries beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def take(self, key):
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value

    def keep(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


def fetch(boxed: Any) -> Any:
    """The object in a boxed ObjectRef (``[ref]``), or the object itself when driven without Ray."""
    value = boxed[0]
    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


@dataclass
class ClientData:
    train: ArrayDataset  # normalised
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_counts: torch.Tensor


class ClientHost:
    """A worker: trains and evaluates whichever client it is handed. Free of Ray's decorator so it
    can be driven directly (tests, benchmarks).

    It keeps the modules of recently used clients (``ray.cache_clients``), each tagged with the
    version of the committed state it holds, and their normalised shards; a task whose version
    matches skips loading the state. A module whose training raised is dropped: it may be half-updated.
    """

    def __init__(self, cfg: ExperimentConfig, num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))
        quiet_lightning()
        scan_lightning_plugins_once()
        self.cfg = cfg
        self.spec = get_algorithm(cfg.algorithm)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.modules: LRU = LRU(cfg.ray.cache_clients)  # client -> (version, ClientModule)
        self.data: LRU = LRU(max(cfg.ray.cache_clients, DATA_CACHE_CLIENTS))  # client -> ClientData
        self.global_chunks: LRU = LRU(GLOBAL_CHUNK_CACHE)  # chunk index -> (x, y) normalised
        self.global_models: dict[str, torch.nn.Module] = {}
        self.meta: dict[str, Any] = {}

    def setup(self, meta: dict[str, Any]) -> None:
        """What the data says (classes, channels, normalisation), known once the driver has loaded it."""
        self.meta = meta

    # ---- a client's data and module
    def client_data(self, task: ClientTask) -> ClientData:
        data = self.data.take(task.client)
        if data is None:
            shard: ClientShard = fetch(task.shard)
            mean, std = self.meta["mean"], self.meta["std"]
            data = ClientData(
                ArrayDataset(normalize(shard.train.x, mean, std), shard.train.y),
                normalize(shard.test.x, mean, std),
                shard.test.y,
                torch.bincount(shard.train.y, minlength=self.meta["num_classes"]),
            )
            self.data.keep(task.client, data)
        return data

    def module(self, task: ClientTask) -> ClientModule:
        """The client's module at its committed state: from the cache, else built and loaded."""
        cached = self.modules.take(task.client)
        if cached is not None and cached[0] == task.version:
            return cached[1]
        data = self.client_data(task)
        ctx = ClientContext(task.client, self.cfg, self.meta["num_classes"], data.train, data.class_counts)
        module = self.spec.client_cls(make_client_model(self.cfg, task.client, self.meta), ctx)
        if task.state:
            load_client_state(module, fetch(task.state))
        self.modules.keep(task.client, (task.version, module))
        return module

    # ---- the work
    def train(self, task: ClientTask, rnd: int, payload: Payload) -> tuple[tuple[Payload, dict], dict]:
        """Receive, fit, upload. Returns ((uplink, stats), new state): two Ray objects, so the
        Coordinator reads the uplink and keeps only a reference to the state."""
        import lightning as L

        start = time.perf_counter()
        module = self.module(task)
        try:
            # seeded before receive: every draw a client makes depends on (seed, round, client) only,
            # never on which worker runs it or what that worker ran before
            torch.manual_seed(derive_seed(self.cfg.seed, rnd, task.client, 2))
            module.begin_round(rnd, payload)
            epochs = module.local_epochs(rnd)
            if epochs > 0:
                trainer = L.Trainer(
                    max_epochs=epochs,
                    accelerator="gpu" if self.device == "cuda" else "cpu",
                    devices=1,
                    barebones=True,  # no loggers, checkpoints, progress bars or summaries: raw speed
                    gradient_clip_val=self.cfg.train.grad_clip,
                    num_sanity_val_steps=0,
                )
                trainer.fit(module)
            # Lightning's teardown leaves the module on the CPU: upload (FedSC's prototype pass, FedL2G's
            # double backward) runs where training ran
            uplink = module.to(self.device).upload()
            module.to("cpu")  # cached modules wait in host memory, not on the GPU
        except BaseException:
            self.modules.pop(task.client, None)  # half-trained: the committed state stays the truth
            raise
        stats = module.pop_stats()
        stats["time/client_s"] = time.perf_counter() - start
        self.modules.keep(task.client, (task.version + 1, module))
        return (uplink, stats), client_state(module)

    def evaluate(self, tasks: list[ClientTask], payload: Payload | None) -> list[tuple[int, int, int, float]]:
        """(client, correct, total, summed loss) of each client on its own test split.

        With a server payload and the default ``load_for_eval`` (a global model), the one model is
        evaluated on each client's data and no client module is built; otherwise each client's
        module is evaluated, after ``load_for_eval`` when there is a payload, and restored after.
        """
        shared = None
        if payload is not None and tests_with_global_model(self.spec.client_cls, payload):
            shared = self.global_model(
                arch_for_client(self.cfg.model.group, tasks[0].client), payload["model"]
            )
        out = []
        for task in tasks:
            data = self.client_data(task)
            if shared is not None:
                out.append((task.client, *evaluate_model(shared, data.test_x, data.test_y, self.device)))
                continue
            module = self.module(task)
            saved = None if payload is None else {k: v.clone() for k, v in module.state_dict().items()}
            if payload is not None:
                module.load_for_eval(payload)
            scored = evaluate_model(module, data.test_x, data.test_y, self.device, scores=module.eval_logits)
            out.append((task.client, *scored))
            if saved is not None:
                module.load_state_dict(saved)  # evaluation never changes a committed state
            module.to("cpu")
        return out

    def global_model(self, arch: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = self.global_models.get(arch)
        if model is None:
            meta = self.meta
            model = build_model(arch, meta["in_channels"], meta["image_size"], meta["num_classes"])
            self.global_models[arch] = model
        model.load_state_dict(state)
        return model

    def evaluate_global(
        self, arch: str, state: dict[str, torch.Tensor], chunks: dict[int, list]
    ) -> list[tuple[int, int, int, float]]:
        """(chunk, correct, total, summed loss) per chunk of the global test set; the caller sums them
        in chunk order, so the numbers never depend on how chunks were spread over workers."""
        model = self.global_model(arch, state)
        out = []
        for index, boxed in chunks.items():
            chunk = self.global_chunks.take(index)
            if chunk is None:
                raw: ArrayDataset = fetch(boxed)
                chunk = (normalize(raw.x, self.meta["mean"], self.meta["std"]), raw.y)
                self.global_chunks.keep(index, chunk)
            x, y = chunk
            out.append((index, *evaluate_model(model, x, y, self.device)))
        return out


def client_state(module: ClientModule) -> dict[str, Any]:
    """Everything a client keeps between rounds: its module's state_dict (parameters and registered
    buffers) and, with ``train.keep_optimizer_state``, its optimizer state."""
    return {
        "module": {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()},
        "optimizer": module._optimizer_state,
    }


def load_client_state(module: ClientModule, state: dict[str, Any]) -> None:
    module.load_state_dict(state["module"])
    module._optimizer_state = state.get("optimizer")


def client_model_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model part of a client state (what ``models/client_models.pt`` holds)."""
    return {k.removeprefix("model."): v for k, v in state["module"].items() if k.startswith("model.")}


@ray.remote
class ClientActor(ClientHost):
    """ClientHost as a Ray actor: a worker process of the pool."""

    def __init__(self, cfg: ExperimentConfig, num_threads: int) -> None:
        use_fast_tensor_transport()  # uplinks and states leave as raw bytes
        retain_freed_memory()  # a training step reuses the last step's buffers instead of faulting in new pages
        super().__init__(cfg, num_threads)


__all__ = ["ClientActor", "ClientHost", "batch_loader", "evaluate_model", "make_client_model"]
