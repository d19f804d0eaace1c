"""The algorithm contract: a server half and a client half that only exchange payloads.

A payload is a mapping of names to CPU tensors, plain numbers, or nested mappings of those. The
Coordinator measures the bytes each way from the payloads themselves (:func:`payload_nbytes`).

Round indices ``rnd`` are 0-based (``t = 0 .. T-1`` as in the papers' pseudo-code); displays and
MLflow steps show ``rnd + 1``, the number of rounds completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedray.platform.api.averaging import RunningMean
from fedray.platform.api.contract import check_client_class
from fedray.platform.api.lightning_import import lightning as L
from fedray.platform.config import ExperimentConfig, TrainConfig
from fedray.platform.config.algorithm_config import AlgorithmConfig
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import CheckpointError, ContractError
from fedray.platform.models import FedModel
from fedray.platform.seeds import numpy_rng, seed_of
from fedray.platform.tracking.names import Metrics

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
    """A detached CPU copy of a state dict, safe to ship and to keep while training goes on. A GPU
    state's tensors come back as views of one CPU buffer (:func:`copy_to_cpu`): clone one to keep it
    on its own, or ``torch.save`` it alone, without the rest."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return dict(zip(state, copy_to_cpu(list(state.values()), copy=True), strict=True))


def copy_to_cpu(tensors: list[torch.Tensor], copy: bool) -> list[torch.Tensor]:
    """``tensors`` detached and on the CPU, in order; with ``copy``, in memory the caller's tensors do
    not share even where they already were on the CPU. Tensors on a GPU cross in one transfer per
    device and dtype: a copy to the CPU waits for the device, and tensor by tensor a client's upload
    waited ten times (2.7 ms of a 16.5 ms FedAvg-CNN client on an H200). Those come back as views of
    one buffer, each its own region; CPU tensors are copied one by one, as before."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    on_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.device.type == "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            out[i] = tensor.detach().to("cpu", copy=copy)
        else:
            on_device.setdefault((tensor.device, tensor.dtype), []).append(i)
    for group in on_device.values():
        for i, part in zip(group, gathered_to_cpu([tensors[i] for i in group]), strict=True):
            out[i] = part
    return out  # type: ignore[return-value]


def gathered_to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Same-dtype tensors concatenated where they are, copied to the CPU at once, split back into
    their shapes (any device: the CPU's too, which is how the tests check it). The concatenation
    needs their size again on the device: where that is not there, one copy per tensor."""
    if len(tensors) == 1:
        return [tensors[0].detach().to("cpu", copy=True)]
    try:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to("cpu", copy=True)
    except torch.cuda.OutOfMemoryError:
        return [t.detach().to("cpu", copy=True) for t in tensors]
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]


def seed_torch(seed: int, device: torch.device | None = None) -> None:
    """``torch.manual_seed`` for the CPU's generator and, on a GPU, that device's: the same draws.
    ``torch.manual_seed`` itself also queues a seeding of every accelerator torch was built for, with
    a stack trace each time, about 0.7 ms on a CPU-only worker, paid for every client."""
    torch.random.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(seed)


# what a server's state_dict saves by its own state_dict(): a module's weights, an optimizer's state
STATEFUL = (nn.Module, torch.optim.Optimizer)


# --------------------------------------------------------------------------------------------- contexts


@dataclass
class ServerContext:
    cfg: ExperimentConfig
    num_clients: int
    num_classes: int
    client_archs: list[str]
    make_model: Callable[[int], FedModel]  # client id -> its initial model, as ``model.init`` says
    # client id -> a model drawn from (seed, id) whatever ``model.init`` says: independent draws
    make_distinct_model: Callable[[int], FedModel] | None = None
    # the model group's member with the fewest parameters (found when first asked), and a fresh model
    # of a member: the model an algorithm shares between clients of a heterogeneous group (FML's and
    # FedKD's small model)
    find_smallest: Callable[[], str] | None = None
    make_arch: Callable[[str], FedModel] | None = None
    train_sizes: list[int] = field(default_factory=list)  # client id -> its train samples (n_k)

    @property
    def smallest_arch(self) -> str:
        return smallest_found_by(self.find_smallest, "ServerContext")

    def model_of_arch(self, arch: str) -> FedModel:
        """A fresh model of ``arch``, a member of the run's model group (its first client's initial draw)."""
        return model_built_by(self.make_arch, arch, "ServerContext")

    def distinct_model(self, i: int) -> FedModel:
        """Model ``i`` of several that must start from different weights (FedCross's K middleware
        models with ``same_init: false``), even where clients share their initialisation."""
        return (self.make_distinct_model or self.make_model)(i)

    @property
    def homogeneous(self) -> bool:
        return len(set(self.client_archs)) == 1

    @property
    def feature_dim(self) -> int:
        """The representation size ``d`` every client's model shares. Config validation checked the
        group has one, for an algorithm that declares it needs it (``needs_shared_features``)."""
        algo = self.cfg.algo
        if algo is None or not algo.needs_shared_features():
            raise ContractError(
                f"algorithm {self.cfg.algorithm!r} reads ServerContext.feature_dim without declaring it: set "
                "SHARED_FEATURES = True on its config (or override needs_shared_features)"
            )
        with torch.device("meta"):  # no memory, no init cost
            return self.make_model(0).feature_dim


@dataclass
class ClientContext:
    client_id: int
    cfg: ExperimentConfig
    num_classes: int
    train: ArrayDataset  # normalised float images
    class_counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [C] train samples per class
    # as on ServerContext: the group's smallest member, and a fresh model of a member
    find_smallest: Callable[[], str] | None = None
    make_arch: Callable[[str], FedModel] | None = None

    @property
    def smallest_arch(self) -> str:
        return smallest_found_by(self.find_smallest, "ClientContext")

    def model_of_arch(self, arch: str) -> FedModel:
        """A fresh model of ``arch``, a member of the run's model group (its first client's initial draw)."""
        return model_built_by(self.make_arch, arch, "ClientContext")

    @property
    def num_train(self) -> int:
        return len(self.train)


def smallest_found_by(find_smallest: Callable[[], str] | None, where: str) -> str:
    if find_smallest is None:
        raise ContractError(f"{where}.smallest_arch: this context was built without find_smallest")
    return find_smallest()


def model_built_by(make_arch: Callable[[str], FedModel] | None, arch: str, where: str) -> FedModel:
    if make_arch is None:
        raise ContractError(f"{where}.model_of_arch({arch!r}): this context was built without make_arch")
    return make_arch(arch)


# --------------------------------------------------------------------------------------------- halves


def sample_clients(seed: int, rnd: int, num_clients: int, k: int) -> list[int]:
    """K distinct clients, a pure function of (seed, round) so a resumed run samples the same ones."""
    rng = numpy_rng("coordinator/sample", seed, rnd)
    return sorted(rng.choice(num_clients, size=k, replace=False).tolist())


class Server:
    """Server half. Lives in the Coordinator; holds whatever the algorithm keeps between rounds.

    Two declarations, checked by the platform: ``UPLINK_KEYS``, the keys ``aggregate`` reads from
    every uplink (each round's uplinks must carry exactly these), and ``STATE``, the attributes a
    checkpoint keeps and a resumed run restores (every attribute but ``ctx`` and ``hp``; a checkpoint
    whose keys differ is refused on load).
    """

    hp: AlgorithmConfig  # the algorithm's own config section; a subclass names its own type
    UPLINK_KEYS: ClassVar[tuple[str, ...]] = ()
    STATE: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ServerContext) -> None:
        assert ctx.cfg.algo is not None, "a ServerContext is built from a resolved config"
        self.ctx = ctx
        self.hp = ctx.cfg.algo

    def select(self, rnd: int, k: int) -> list[int]:
        """The round's clients: ``k`` distinct ids of ``0 .. N-1`` (``train.fraction`` of N, or what
        the config's ``participants`` fixes). Default: uniformly without replacement, a function of
        (seed, round) alone (:func:`sample_clients`). A server that samples by its own state (CluSamp's
        clusters) draws from a stream of its own, so a resumed run draws the same clients; a client it
        draws twice is selected once and weighed twice in its ``aggregate``."""
        return sample_clients(self.ctx.cfg.seed, rnd, self.ctx.num_clients, k)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        """Downlink per selected client; :meth:`broadcast` when every client gets the same one."""
        return self.broadcast(selected, {})

    @staticmethod
    def broadcast(selected: list[int], payload: Payload) -> dict[int, Payload]:
        """The same downlink for every selected client: Ray's object store holds it once (its bytes
        are still counted per client)."""
        return dict.fromkeys(selected, payload)

    def uplinks_arrived(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        """Some of this round's uplinks, while other clients still train: the platform calls it with
        accepted uplinks, each at most once, in client-id order, before ``aggregate`` gets them all
        (the same objects: change none). A server may start its aggregate's work here (FedAvg sums
        them: :class:`RunningMean`); ``aggregate`` must give the same result when this was never
        called (tests call it alone). It runs on the loop that dispatches the calls: keep it short."""

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        """Fold this round's uplinks (sorted by client id) into the server state."""

    def record(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to this round's server statistic ``name`` (FedGen's generator losses, say):
        its mean over the round's calls is logged with the round's metrics, under ``name``. Call it
        from ``aggregate`` or ``uplinks_arrived``."""
        number = value.item() if torch.is_tensor(value) and value.numel() == 1 else value
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            shown = " ".join(repr(value).split())[:60]
            raise ContractError(f"{type(self).__name__}: statistic {name!r} must be one number, got {shown}")
        self.__dict__.setdefault("_stats", {}).setdefault(name, []).append(float(number))

    def pop_stats(self) -> dict[str, float]:
        """What the platform calls after ``aggregate``: each statistic's mean over the round's calls."""
        stats = self.__dict__.pop("_stats", {})
        return {name: float(np.mean(values)) for name, values in stats.items()}

    def uplink_keys(self) -> tuple[str, ...]:
        """The keys of every uplink: ``UPLINK_KEYS``, or an override where they follow a hyperparameter."""
        return self.UPLINK_KEYS

    def global_model(self) -> nn.Module | None:
        """The model evaluated on the global test set, for algorithms that have one."""
        return None

    def eval_payload(self) -> Payload | None:
        """What every client loads before evaluation on its own test split; None = its own model."""
        model = self.global_model()
        return None if model is None else {"model": cpu_state(model)}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the server: the ``STATE`` attributes, a module or optimizer as
        its own ``state_dict()``. A checkpoint holds tensors and plain values only (it is loaded with
        ``weights_only``), so an attribute of another kind needs these two methods overridden."""
        who = type(self).__name__
        algorithm = f"algorithm {self.ctx.cfg.algorithm!r}: "
        scratch = {k for k, v in vars(self).items() if isinstance(v, RunningMean)}  # a round's working memory
        for k in sorted(k for k in scratch if getattr(self, k).added):
            raise ContractError(
                f"{algorithm}{who}.{k} still holds a sum when a checkpoint is taken: a RunningMean is a round's working "
                "memory (mean() clears it); a sum kept across rounds belongs in STATE"
            )
        for k in sorted(vars(self).keys() - {"ctx", "hp", "_stats"} - scratch - set(self.STATE)):
            raise ContractError(
                f"{algorithm}{who}.{k} is not in {who}.STATE, the attributes a checkpoint keeps: a resumed run "
                "would start it afresh (add it to STATE)"
            )
        for k in self.STATE:
            if not hasattr(self, k):
                raise ContractError(f"{algorithm}{who}.STATE names {k!r}, which {who} does not have")
        state = {k: getattr(self, k) for k in self.STATE}
        return {k: v.state_dict() if isinstance(v, STATEFUL) else v for k, v in state.items()}

    @classmethod
    def check_saved(cls, state: Mapping[str, Any]) -> None:
        """A saved server state has exactly the ``STATE`` keys: an attribute renamed or added since
        would otherwise resume with a fresh value (checked before Ray starts on ``--resume``)."""
        if set(state) == set(cls.STATE):
            return
        missing, extra = sorted(set(cls.STATE) - set(state)), sorted(set(state) - set(cls.STATE))
        what = f"has no {missing[0]!r}, which" if missing else f"holds {extra[0]!r}, which"
        raise CheckpointError(
            f"the checkpoint's server state {what} {cls.__name__}.STATE {'declares' if missing else 'does not declare'} "
            "(it was saved by another version of the algorithm)"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_saved(state)
        for k, v in state.items():
            current = getattr(self, k, None)
            if isinstance(current, STATEFUL):
                current.load_state_dict(v)  # the module built in __init__ takes the saved weights
            else:
                setattr(self, k, v)


class FitProgress:
    """``current_epoch`` and ``global_step`` of a module the worker's loop drives, counted as a fresh
    ``Trainer`` per fit counts them: the epoch being trained (0-based; the number of epochs once the
    fit is over) and the optimizer steps taken so far in this fit."""

    _fit_epoch: int = 0
    _fit_step: int = 0

    @property
    def current_epoch(self) -> int:
        return self._fit_epoch

    @property
    def global_step(self) -> int:
        return self._fit_step


def client_optimizer(
    params: Iterable[torch.nn.Parameter], t: TrainConfig, lr: float
) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params`` at ``lr``: SGD with ``train.momentum``, or Adam / AdamW with it
    as beta1 (beta2 0.999); ``train.weight_decay`` either way (AdamW's decoupled from the gradient)."""
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    adam = torch.optim.Adam if t.optimizer == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, betas=(t.momentum, 0.999), weight_decay=t.weight_decay)


class ClientModule(FitProgress, L.LightningModule):
    """Client half: a LightningModule that lives in a ClientActor across rounds.

    Subclasses override ``receive``, ``training_step`` and ``upload``; the default is plain
    cross-entropy training of the whole model with the optimizer ``cfg.train`` names. State that must survive
    a checkpoint belongs in ``state_dict()`` (parameters and registered buffers).

    The worker drives the module with its own loop over Lightning's hooks
    (:mod:`fedray.platform.runtime.local_training`), not a ``Trainer``: ``self.trainer`` does not exist,
    ``self.log`` records a statistic as :meth:`record` does, ``self.current_epoch`` and
    ``self.global_step`` count within the round's fit (:class:`FitProgress`), every round starts with
    each submodule in the mode the module was built with (``receive`` may change it for the round),
    and hooks the loop does not call are refused when the run is configured.
    """

    hp: AlgorithmConfig  # the algorithm's own config section; a subclass names its own type
    # False: nothing of a client survives its round (its module is overwritten by every downlink).
    # The worker then trains every client on one module per architecture and no state is committed
    # or checkpointed; a receive() that leaves a parameter as it found it is refused in one line.
    keeps_state: ClassVar[bool] = True
    # How a client is tested on its own test split. "global": with a server evaluation payload, the
    # server's one model (the worker loads it; load_for_eval and eval_logits are not called), without
    # one the client's own module. "own": the client's module, after load_for_eval(payload) when the
    # server sends one (a personal extractor under a global header, say).
    eval_mode: ClassVar[Literal["global", "own"]] = "global"
    # The submodule a client is tested with under "own" (what eval_logits scores: a model of the
    # client's architecture). The run logs its weights as the client's model (models/, client_<k>);
    # a client that trains a personal model beside the shared one (Ditto) names it here.
    tested_model: ClassVar[str] = "model"

    @classmethod
    def check_contract(cls, algorithm: str) -> None:
        """Raise ContractError (one line) for a rule this class breaks that its code already shows."""
        check_client_class(algorithm, cls, ClientModule)

    def __init__(self, model: FedModel, ctx: ClientContext) -> None:
        assert ctx.cfg.algo is not None, "a ClientContext is built from a resolved config"
        super().__init__()
        self.model = model
        self.ctx = ctx
        self.hp = ctx.cfg.algo
        self.rnd = 0
        self._stats: dict[str, list[torch.Tensor | float]] = {}
        self._optimizer_state: dict[str, Any] | None = None  # kept only with train.keep_optimizer_state

    # ---- the contract
    def begin_round(self, rnd: int, payload: Payload) -> None:
        """What the platform calls (not to override): sets ``self.rnd``, on which the client's data
        order and seeded draws depend, puts every submodule in the mode it was built with and the fit
        counters at 0, then calls ``receive``. A module a worker cached and one built again elsewhere
        (evicted, another worker, a resumed run) so start every round alike: modes and counters are
        not part of a client's state."""
        self.rnd = rnd
        modules, built = list(self.modules()), self.__dict__.get("_built_modes")
        if built is None or len(built) != len(modules):  # its first round on this worker: as built
            self.__dict__["_built_modes"] = [m.training for m in modules]
        else:
            for module, mode in zip(modules, built, strict=True):
                module.training = mode
        self.__dict__.update(_fit_epoch=0, _fit_step=0)  # past nn.Module.__setattr__
        self.restore_held()
        self.receive(rnd, payload)

    def receive(self, rnd: int, payload: Payload) -> None:
        """Load / fuse what came down (``self.rnd`` is already ``rnd``). Default: a full model state
        under ``"model"``."""
        if "model" in payload:
            self.model.load_state_dict(payload["model"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.record(Metrics.LOSS_TRAIN, loss)
        return loss

    def upload(self) -> Payload:
        """What goes up. Default: the whole model and the sample count FedAvg weights by."""
        return {"model": cpu_state(self.model), "num_samples": self.ctx.num_train}

    def load_for_eval(self, payload: Payload) -> None:
        """Load the server's evaluation payload before a local test (``eval_mode = "own"`` only)."""
        self.model.load_state_dict(payload["model"])

    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores ``[B, C]`` for the platform's evaluation: accuracy is their argmax, the loss
        their cross-entropy. Default: :meth:`model_scores` of the client's model."""
        return self.model_scores(self.model, x)

    @staticmethod
    def model_scores(model: FedModel, x: torch.Tensor) -> torch.Tensor:
        """Class scores ``[B, C]`` of a model of this algorithm, however it came to be: a client's, or
        the server's global model that the worker rebuilds from its state to test on the global test
        set and, under ``eval_mode = "global"``, on each client's split. Default: its forward pass
        (``head(features(x))``); FedNH's scores are its head on unit-length features."""
        return model(x)

    def local_epochs(self, rnd: int) -> int:
        """Epochs of local training this round (0 skips training, e.g. FedL2G's warm-up)."""
        return self.ctx.cfg.train.local_epochs

    # ---- Lightning hooks the worker's loop calls
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return client_optimizer(self.parameters(), self.ctx.cfg.train, self.round_lr())

    def round_lr(self) -> float:
        """This round's client learning rate: ``train.lr * train.lr_decay ** rnd`` (what a client
        whose math reads the step size, SCAFFOLD's or FedL2G's, takes as it)."""
        t = self.ctx.cfg.train
        return t.lr * t.lr_decay**self.rnd

    def train_dataloader(self) -> ShuffledBatches:
        t = self.ctx.cfg.train
        return batch_loader(
            self.training_data(), t.batch_size, shuffle=True, seed=self.data_seed(), drop_last=t.drop_last
        )

    def training_data(self) -> ArrayDataset:
        """The samples local training iterates over (FedL2G holds a quiz batch out)."""
        return self.ctx.train

    def data_seed(self) -> int:
        return seed_of("client/data_order", self.ctx.cfg.seed, self.rnd, self.ctx.client_id)

    @property
    def trainer(self):  # type: ignore[override]
        raise ContractError(
            f"{type(self).__name__}.trainer: fedray trains clients with its own loop over the module's "
            "hooks, without a Lightning Trainer (record statistics with self.record or self.log)"
        )

    @trainer.setter
    def trainer(self, trainer) -> None:
        self.trainer  # noqa: B018  (raises: no Trainer is ever attached to a client)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Lightning's ``self.log`` in a client: the value is recorded as :meth:`record` does (a
        per-round mean in MLflow); Lightning's logging options do not apply."""
        self.record(name, value)

    # ---- tensors kept between calls
    def hold(self, name: str, value: torch.Tensor | None) -> None:
        """Keep ``value`` as ``self.<name>`` between calls of one round: a non-persistent buffer, cast
        to the model's device and floating dtype now and moved with the module later (``.to``,
        ``.double()``), which a plain tensor attribute is not. Not checkpointed, and back to what the
        module's construction held at the next round (:meth:`restore_held`): for what a client
        receives or derives each round."""
        if value is not None:
            ref = next(self.model.parameters())
            value = value.to(ref.device, ref.dtype if value.is_floating_point() else None)
        self.register_buffer(name, value, persistent=False)  # replaces a buffer of that name
        self.__dict__.setdefault("_held_names", set()).add(name)

    def restore_held(self) -> None:
        """What the platform calls before each round's ``receive`` and each evaluation (not to override):
        every held tensor back to what the module's construction held, and none held since. A module a
        worker cached and one built again (evicted, another worker, a resumed run) so start every call
        alike: a value held in one round never reaches a later one, where it would depend on which
        worker ran the client before. A tensor a client keeps across rounds is a persistent buffer
        (``self.register_buffer(name, tensor)``) of a client with ``keeps_state = True``."""
        held: set[str] = self.__dict__.setdefault("_held_names", set())
        built = self.__dict__.get("_built_held")
        if built is None:  # its first call: what construction held (or loading its state left)
            self.__dict__["_built_held"] = {
                name: (tensor, None if tensor is None else (tensor._version, tensor.detach().clone()))
                for name in held
                for tensor in [self._buffers.get(name)]
            }
            return
        for name in held - built.keys():  # (one the client deleted itself is gone already)
            self._buffers.pop(name, None)
            self._non_persistent_buffers_set.discard(name)
        held.intersection_update(built)
        for name, (current, kept) in built.items():
            now = self._buffers.get(name)
            if kept is None:
                if now is not None:
                    self.register_buffer(name, None, persistent=False)
            elif now is None or now is not current or now._version != kept[0]:  # replaced or changed since
                self.hold(name, kept[1].clone())
                restored = self._buffers[name]
                assert restored is not None
                built[name] = (restored, (restored._version, kept[1]))

    # ---- per-fit statistics (cheaper than Lightning's logging, and they travel back with the uplink)
    def record(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to this round's statistic ``name`` (its mean over the calls is logged). A
        tensor is kept as it is, on its device, and read once when the client's work is done: no
        host-device synchronisation per training step."""
        if torch.is_tensor(value):
            if value.numel() != 1:
                raise ContractError(
                    f"{type(self).__name__}: statistic {name!r} must be one number, got a tensor of shape "
                    f"{tuple(value.shape)}"
                )
            self._stats.setdefault(name, []).append(value.detach())
            return
        try:
            number = float(value)
        except (TypeError, ValueError):
            shown = " ".join(repr(value).split())[:60]  # one line, whatever the value's repr spans
            raise ContractError(
                f"{type(self).__name__}: statistic {name!r} must be one number, got {shown}"
            ) from None
        self._stats.setdefault(name, []).append(number)

    def pop_stats(self) -> dict[str, float]:
        """Each statistic's mean over this client's calls, read from the device in one transfer."""
        stats, self._stats = self._stats, {}
        tensors = [v for values in stats.values() for v in values if torch.is_tensor(v)]
        read = iter(())
        if tensors:
            device = tensors[0].device
            read = iter(torch.stack([t.double().reshape(()).to(device) for t in tensors]).tolist())
        return {
            name: float(np.mean([next(read) if torch.is_tensor(v) else v for v in values]))
            for name, values in stats.items()
            if values
        }


def commits_state(client_cls: type[ClientModule], cfg: ExperimentConfig) -> bool:
    """Whether a client's state must be committed after its round: it keeps something between rounds
    (``keeps_state``), or its optimizer state is carried (``train.keep_optimizer_state``)."""
    return client_cls.keeps_state or cfg.train.keep_optimizer_state


def tests_with_global_model(client_cls: type[ClientModule], eval_payload: Payload | None) -> bool:
    """Whether every client is tested with the server's one model (``eval_mode = "global"`` and an
    evaluation payload) rather than with a module of its own."""
    if eval_payload is None or client_cls.eval_mode != "global":
        return False
    if "model" not in eval_payload:
        raise ContractError(
            f"{client_cls.__name__}.eval_mode is 'global', but the server's eval_payload has no 'model' "
            f"(it has {sorted(eval_payload)}): set eval_mode = 'own' and override load_for_eval"
        )
    return True


# --------------------------------------------------------------------------------------------- data


class ShuffledBatches:
    """Mini-batches of an in-memory dataset, gathered with one index per batch on the data's device.

    With ``shuffle``, each pass over the data draws its order from ``generator`` exactly as a
    ``DataLoader(BatchSampler(RandomSampler(generator=...)))`` iterated by Lightning's Trainer did
    (fedray's loader before its own training loop): a permutation per epoch, plus the one the
    sampler draws for its remainder when the last batch is partial (its iterator then runs to the
    end; with full batches Lightning stops at the last one). Runs therefore repeat the numbers of
    earlier fedray versions, without the DataLoader's per-batch machinery.
    """

    def __init__(
        self, data: ArrayDataset, batch_size: int, *, shuffle: bool, seed: int = 0, drop_last: bool = False
    ) -> None:
        self.x, self.y = data.x, data.y
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.generator = torch.Generator().manual_seed(seed) if shuffle else None

    def __len__(self) -> int:
        n, b = len(self.y), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self):
        n = len(self.y)
        if self.generator is None:
            order = None
        else:
            order = torch.randperm(n, generator=self.generator)
            if n % self.batch_size and not self.drop_last:
                torch.randperm(n, generator=self.generator)  # RandomSampler's draw for its remainder
            order = order.to(self.x.device)
        for i in range(len(self)):
            if order is None:
                yield (
                    self.x[i * self.batch_size : (i + 1) * self.batch_size],
                    self.y[i * self.batch_size : (i + 1) * self.batch_size],
                )
            else:
                idx = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield self.x[idx], self.y[idx]


def batch_loader(
    data: ArrayDataset, batch_size: int, *, shuffle: bool, seed: int = 0, drop_last: bool = False
) -> ShuffledBatches:
    """The batches of ``data`` in a seeded order (see :class:`ShuffledBatches`)."""
    return ShuffledBatches(data, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
