"""The algorithm contract: a server half and a client half that only exchange payloads.

A payload is a mapping of names to CPU tensors, plain numbers, or nested mappings of those. The
Coordinator measures the bytes each way from the payloads themselves (:func:`payload_nbytes`).

Round indices ``rnd`` are 0-based (``t = 0 .. T-1`` as in the papers' pseudo-code); displays and
MLflow steps show ``rnd + 1``, the number of rounds completed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedray.platform.algorithm_config import AlgorithmConfig
from fedray.platform.augment import crop_flip
from fedray.platform.config import ExperimentConfig
from fedray.platform.data import ArrayDataset
from fedray.platform.models import FedModel

Payload = dict[str, Any]


# --------------------------------------------------------------------------------------------- payloads


def payload_nbytes(payload: Any) -> int:
    """Bytes a payload occupies on the wire: tensor storage plus 8 bytes per plain number."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, np.ndarray):
        return payload.nbytes
    if isinstance(payload, Mapping):
        return sum(payload_nbytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_nbytes(v) for v in payload)
    if isinstance(payload, (int, float, bool)):
        return 8
    if payload is None:
        return 0
    if isinstance(payload, str):
        return len(payload.encode())
    raise TypeError(f"payload entries must be tensors, numbers or mappings, got {type(payload).__name__}")


def cpu_state(module_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a state dict, safe to ship and to keep while training goes on."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def derive_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers (experiment seed, round, client id...)."""
    return zlib.crc32(np.asarray(parts, dtype=np.int64).tobytes()) & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------- contexts


@dataclass
class ServerContext:
    cfg: ExperimentConfig
    num_clients: int
    num_classes: int
    client_archs: list[str]
    make_model: Callable[[int], FedModel]  # client id -> freshly initialised model of its architecture

    @property
    def homogeneous(self) -> bool:
        return len(set(self.client_archs)) == 1


@dataclass
class ClientContext:
    client_id: int
    cfg: ExperimentConfig
    num_classes: int
    train: ArrayDataset  # normalised float images
    class_counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [C] train samples per class

    @property
    def num_train(self) -> int:
        return len(self.train)


# --------------------------------------------------------------------------------------------- halves


class Server:
    """Server half. Lives in the Coordinator; holds whatever the algorithm keeps between rounds.

    Checkpointing saves every attribute but ``ctx`` and ``hp``; keep server state in attributes.
    """

    hp: AlgorithmConfig  # the algorithm's own config section; a subclass names its own type

    def __init__(self, ctx: ServerContext) -> None:
        assert ctx.cfg.algo is not None, "a ServerContext is built from a resolved config"
        self.ctx = ctx
        self.hp = ctx.cfg.algo

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        """Downlink per selected client; :meth:`broadcast` when every client gets the same one."""
        return self.broadcast(selected, {})

    @staticmethod
    def broadcast(selected: list[int], payload: Payload) -> dict[int, Payload]:
        """The same downlink for every selected client: Ray's object store holds it once (its bytes
        are still counted per client)."""
        return dict.fromkeys(selected, payload)

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        """Fold this round's uplinks (sorted by client id) into the server state."""

    def global_model(self) -> nn.Module | None:
        """The model evaluated on the global test set, for algorithms that have one."""
        return None

    def eval_payload(self) -> Payload | None:
        """What every client loads before evaluation on its own test split; None = its own model."""
        model = self.global_model()
        return None if model is None else {"model": cpu_state(model)}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("ctx", "hp")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class ClientModule(L.LightningModule):
    """Client half: a LightningModule that lives in a ClientActor across rounds.

    Subclasses override ``receive``, ``training_step`` and ``upload``; the default is plain
    cross-entropy training of the whole model with SGD from ``cfg.train``. State that must survive
    a checkpoint belongs in ``state_dict()`` (parameters and registered buffers).
    """

    hp: AlgorithmConfig  # the algorithm's own config section; a subclass names its own type

    def __init__(self, model: FedModel, ctx: ClientContext) -> None:
        assert ctx.cfg.algo is not None, "a ClientContext is built from a resolved config"
        super().__init__()
        self.model = model
        self.ctx = ctx
        self.hp = ctx.cfg.algo
        self.rnd = 0
        self._stats: dict[str, list[float]] = {}
        self._optimizer_state: dict[str, Any] | None = None  # kept only with train.keep_optimizer_state

    # ---- the contract
    def begin_round(self, rnd: int, payload: Payload) -> None:
        """What the platform calls (not to override): sets ``self.rnd``, on which the client's data
        order and seeded draws depend, then ``receive``."""
        self.rnd = rnd
        self.receive(rnd, payload)

    def receive(self, rnd: int, payload: Payload) -> None:
        """Load / fuse what came down (``self.rnd`` is already ``rnd``). Default: a full model state
        under ``"model"``."""
        if "model" in payload:
            self.model.load_state_dict(payload["model"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.record("loss/train", loss)
        return loss

    def upload(self) -> Payload:
        """What goes up. Default: the whole model and the sample count FedAvg weights by."""
        return {"model": cpu_state(self.model), "num_samples": self.ctx.num_train}

    def load_for_eval(self, payload: Payload) -> None:
        """Load the server's evaluation payload (global-model algorithms) before a local test."""
        self.model.load_state_dict(payload["model"])

    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores ``[B, C]`` for the platform's evaluation: accuracy is their argmax, the loss
        their cross-entropy. Default: the model's head."""
        return self.model(x)

    def local_epochs(self, rnd: int) -> int:
        """Epochs of local training this round (0 skips ``Trainer.fit``, e.g. FedL2G's warm-up)."""
        return self.ctx.cfg.train.local_epochs

    # ---- Lightning hooks
    def configure_optimizers(self) -> torch.optim.Optimizer:
        t = self.ctx.cfg.train
        return torch.optim.SGD(self.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def on_train_start(self) -> None:
        # Lightning builds a fresh optimizer in every fit(); carry the old state over when asked to
        if self.ctx.cfg.train.keep_optimizer_state and self._optimizer_state is not None:
            self.trainer.optimizers[0].load_state_dict(self._optimizer_state)
        self._augment_gen = torch.Generator().manual_seed(
            derive_seed(self.ctx.cfg.seed, self.rnd, self.ctx.client_id, 3)
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """``data.augment``: training batches only, on the training device."""
        if self.ctx.cfg.data.augment == "crop_flip" and self.trainer.training:
            x, y = batch
            batch = (crop_flip(x, self._augment_gen), y)
        return batch

    def on_train_end(self) -> None:
        if self.ctx.cfg.train.keep_optimizer_state:
            self._optimizer_state = self.trainer.optimizers[0].state_dict()

    def train_dataloader(self):
        return batch_loader(
            self.training_data(), self.ctx.cfg.train.batch_size, shuffle=True, seed=self.data_seed()
        )

    def training_data(self) -> ArrayDataset:
        """The samples local training iterates over (FedL2G holds a quiz batch out)."""
        return self.ctx.train

    def data_seed(self) -> int:
        return derive_seed(self.ctx.cfg.seed, self.rnd, self.ctx.client_id, 1)

    # ---- tensors kept between calls
    def hold(self, name: str, value: torch.Tensor | None) -> None:
        """Keep ``value`` as ``self.<name>`` between calls: a non-persistent buffer, cast to the model's
        device and floating dtype now and moved with the module later (``.to``, Lightning's device
        placement, ``.double()``), which a plain tensor attribute is not. Not checkpointed: for what
        a client receives or derives each round."""
        if value is not None:
            ref = next(self.model.parameters())
            value = value.to(ref.device, ref.dtype if value.is_floating_point() else None)
        self.register_buffer(name, value, persistent=False)  # replaces a buffer of that name

    # ---- per-fit statistics (cheaper than self.log, and they travel back with the uplink)
    def record(self, name: str, value: torch.Tensor | float) -> None:
        self._stats.setdefault(name, []).append(
            float(value.detach()) if torch.is_tensor(value) else float(value)
        )

    def pop_stats(self) -> dict[str, float]:
        out = {k: float(np.mean(v)) for k, v in self._stats.items() if v}
        self._stats = {}
        return out


def tests_with_global_model(client_cls: type[ClientModule], eval_payload: Payload | None) -> bool:
    """Whether every client is tested with the one global model (the default ``load_for_eval`` of
    a server payload) rather than with a module of its own."""
    return eval_payload is not None and client_cls.load_for_eval is ClientModule.load_for_eval


# --------------------------------------------------------------------------------------------- data


class _Batches(torch.utils.data.Dataset):
    """Index a whole batch at once: one tensor gather per batch instead of a Python collate."""

    def __init__(self, data: ArrayDataset) -> None:
        self.x, self.y = data.x, data.y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


def batch_loader(
    data: ArrayDataset, batch_size: int, *, shuffle: bool, seed: int = 0, drop_last: bool = False
):
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    ds = _Batches(data)
    base = (
        RandomSampler(ds, generator=torch.Generator().manual_seed(seed)) if shuffle else SequentialSampler(ds)
    )
    sampler = BatchSampler(base, batch_size=batch_size, drop_last=drop_last)
    return DataLoader(ds, sampler=sampler, batch_size=None)
