"""ClientActor: a Ray actor hosting one or more clients across the whole run.

A client is its data shard plus its algorithm's ClientModule; both stay on the actor between rounds,
so only payloads travel. Local training is ``lightning.Trainer.fit`` on the module; on an actor
with a GPU slice it trains on that GPU.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any

import ray
import torch

from fedray.platform.algorithm import ClientContext, ClientModule, Payload, batch_loader, derive_seed
from fedray.platform.config import ExperimentConfig
from fedray.platform.data import ArrayDataset, ClientShard, normalize
from fedray.platform.memory import retain_freed_memory
from fedray.platform.models import arch_for_client, build_model
from fedray.platform.registry import get as get_algorithm
from fedray.platform.transport import use_fast_tensor_transport

# the global test set is split across actors in chunks this size: its sums never depend on the pool size
EVAL_CHUNK = 1024
EVAL_BATCH = 128  # forward passes this size stay in cache; 1024-image batches are about 1.7x slower on a CPU


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
        registry.entry_points = functools.cache(scan)


def make_client_model(cfg: ExperimentConfig, client_id: int, meta: dict[str, Any]):
    """The client's architecture, initialised from (seed, client id) so every run starts identically."""
    torch.manual_seed(derive_seed(cfg.seed, client_id, 0))
    arch = arch_for_client(cfg.model.group, client_id)
    return build_model(arch, meta["in_channels"], meta["image_size"], meta["num_classes"])


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: str, batch: int = EVAL_BATCH
):
    """(correct, total, summed CE loss) of ``model`` on a normalised tensor dataset."""
    was_training = model.training
    model.eval().to(device)
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        logits = model(xb)
        correct += int((logits.argmax(1) == yb).sum())
        loss += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
    model.train(was_training)
    return correct, len(y), loss


class ClientHost:
    """The actor's body, kept free of Ray so it can be driven directly (tests, benchmarks)."""

    def __init__(self, cfg: ExperimentConfig, meta: dict[str, Any], num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))
        quiet_lightning()
        scan_lightning_plugins_once()
        self.cfg = cfg
        self.meta = meta
        self.spec = get_algorithm(cfg.algorithm)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.modules: dict[int, ClientModule] = {}
        self.tests: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.global_test: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._global_model = None

    def add_client(self, shard: ClientShard) -> None:
        mean, std = self.meta["mean"], self.meta["std"]
        train = ArrayDataset(normalize(shard.train.x, mean, std), shard.train.y)
        counts = torch.bincount(shard.train.y, minlength=self.meta["num_classes"])
        ctx = ClientContext(shard.client_id, self.cfg, self.meta["num_classes"], train, counts)
        model = make_client_model(self.cfg, shard.client_id, self.meta)
        self.modules[shard.client_id] = self.spec.client_cls(model, ctx)
        self.tests[shard.client_id] = (normalize(shard.test.x, mean, std), shard.test.y)

    def train(self, cid: int, rnd: int, payload: Payload) -> tuple[int, Payload, dict[str, float]]:
        import lightning as L

        start = time.perf_counter()
        module = self.modules[cid]
        module.receive(rnd, payload)
        epochs = module.local_epochs(rnd)
        if epochs > 0:
            torch.manual_seed(derive_seed(self.cfg.seed, rnd, cid, 2))
            trainer = L.Trainer(
                max_epochs=epochs,
                accelerator="gpu" if self.device == "cuda" else "cpu",
                devices=1,
                barebones=True,  # no loggers, checkpoints, progress bars or summaries: raw speed
                gradient_clip_val=self.cfg.train.grad_clip,
                num_sanity_val_steps=0,
            )
            trainer.fit(module)
        uplink = module.upload()
        stats = module.pop_stats()
        stats["time/client_s"] = time.perf_counter() - start
        return cid, uplink, stats

    def evaluate(self, cids: list[int], payload: Payload | None) -> list[tuple[int, int, int, float]]:
        out = []
        for cid in cids:
            module = self.modules[cid]
            if payload is not None:
                module.load_for_eval(payload)
            x, y = self.tests[cid]
            out.append((cid, *evaluate_model(module.model, x, y, self.device)))
            module.to("cpu")
        return out

    def set_global_test(self, chunks: dict[int, ArrayDataset]) -> None:
        """This actor's chunks of the global test set: global evaluation runs on every actor at once."""
        mean, std = self.meta["mean"], self.meta["std"]
        self.global_test = {i: (normalize(c.x, mean, std), c.y) for i, c in chunks.items()}

    def evaluate_global(self, arch: str, state: dict[str, torch.Tensor]) -> list[tuple[int, int, int, float]]:
        """(chunk, correct, total, summed loss) per chunk; the caller sums them in chunk order."""
        if self._global_model is None or self._global_model.arch != arch:
            meta = self.meta
            self._global_model = build_model(
                arch, meta["in_channels"], meta["image_size"], meta["num_classes"]
            )
        self._global_model.load_state_dict(state)
        return [
            (i, *evaluate_model(self._global_model, x, y, self.device))
            for i, (x, y) in self.global_test.items()
        ]

    def get_state(self, cids: list[int]) -> dict[int, dict[str, Any]]:
        return {
            cid: {
                "module": {k: v.detach().cpu().clone() for k, v in self.modules[cid].state_dict().items()},
                "optimizer": getattr(self.modules[cid], "_optimizer_state", None),
            }
            for cid in cids
        }

    def set_state(self, states: dict[int, dict[str, Any]]) -> None:
        for cid, state in states.items():
            self.modules[cid].load_state_dict(state["module"])
            if state.get("optimizer") is not None:
                self.modules[cid]._optimizer_state = state["optimizer"]

    def models(self, cids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        return {
            cid: {k: v.detach().cpu().clone() for k, v in self.modules[cid].model.state_dict().items()}
            for cid in cids
        }


@ray.remote
class ClientActor(ClientHost):
    """ClientHost as a Ray actor. Shards arrive as ObjectRefs (from the driver's object store)."""

    def __init__(self, cfg: ExperimentConfig, meta: dict[str, Any], num_threads: int) -> None:
        use_fast_tensor_transport()  # uplinks leave as raw bytes
        retain_freed_memory()  # a training step reuses the last step's buffers instead of faulting in new pages
        super().__init__(cfg, meta, num_threads)

    def add_clients(self, shard_refs: list) -> int:
        for shard in ray.get(shard_refs):
            self.add_client(shard)
        return len(self.modules)


__all__ = ["ClientActor", "ClientHost", "batch_loader", "evaluate_model", "make_client_model"]
