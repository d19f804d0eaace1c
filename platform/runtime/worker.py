"""ClientActor: a long-lived worker process that trains and evaluates whichever clients it is handed.

A client is its shard and its committed state (:mod:`fedray.platform.runtime.state_store`). A worker keeps what a
client does not need rebuilt: its device and its training loop (:mod:`fedray.platform.runtime.local_training`,
built once), the modules of recently used clients (a returning client loads nothing), the models of
evicted clients (a new client is loaded into one in place), one model per architecture for
algorithms whose clients keep nothing between rounds (every such client trains on it, and nothing
is committed), shards normalised once and kept on the device, and each round's downlinks (read once
per worker, not once per client). One call trains several clients and hands back their uplinks
together; the new state of a client that keeps one is written to its file before the call returns.
"""

from __future__ import annotations

import functools
import gc
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
import torch

from fedray.platform.api.algorithm import (
    ClientContext,
    ClientModule,
    Payload,
    commits_state,
    copy_to_cpu,
    seed_torch,
    tests_with_global_model,
)
from fedray.platform.api.contract import (
    ReadKeys,
    check_downlink_read,
    check_held_tensors,
    check_parameters_apart,
    check_tested_model,
    storages,
)
from fedray.platform.api.registry import get as get_algorithm
from fedray.platform.config import ExperimentConfig
from fedray.platform.data import ArrayDataset, ClientShard, normalize
from fedray.platform.errors import ConfigError, ContractError, first_line
from fedray.platform.models import FedModel, arch_for_client, build_for, first_client_of_arch, model_group
from fedray.platform.runtime import storage
from fedray.platform.runtime.devices import (
    DeviceError,
    configure_device,
    image_memory_format,
    is_device_error,
    is_out_of_memory,
    laid_out,
    worker_device,
)
from fedray.platform.runtime.failures import ClientCodeError, Failure, algorithm_files, failure_of
from fedray.platform.runtime.local_training import LocalTraining
from fedray.platform.runtime.page_cache import PageReleaser
from fedray.platform.runtime.process_roles import set_up_worker, set_worker_threads
from fedray.platform.runtime.state_store import ClientTask
from fedray.platform.seeds import seed_global_draws, seed_of, torch_generator
from fedray.platform.tracking.names import Metrics

T = TypeVar("T")

# the global test set is split across actors in chunks this size: its sums never depend on the pool size
EVAL_CHUNK = 1024
EVAL_BATCH = 128  # forward passes this size stay in cache; 1024-image batches are about 1.7x slower on a CPU
DATA_CACHE_BYTES = 2**30  # normalised shards a worker keeps, in bytes (1,700 clients of 50 CIFAR images)
GLOBAL_CHUNK_CACHE = 16  # chunks of the global test set a worker keeps
# models of evicted clients a worker keeps per architecture to load the next client into; one is
# taken per client it takes up, so a few cover a call, and more would only hold memory
SPARE_MODELS = 4


def make_client_model(
    cfg: ExperimentConfig, client_id: int, meta: dict[str, Any], init: str | None = None
) -> FedModel:
    """The client's architecture with its initial weights: with ``model.init`` (or ``init``) shared,
    the draw of the first client of that architecture, so all its clients start alike; per_client,
    a draw of its own. Either way a function of (seed, client id): every run starts identically."""
    init = init or cfg.model.init
    draw = first_client_of_arch(cfg.model.group, client_id) if init == "shared" else client_id
    seed_torch(seed_of("model/init", cfg.seed, draw))  # initial weights are drawn on the CPU
    return model_of_arch(arch_for_client(cfg.model.group, client_id), meta)


def member_model(cfg: ExperimentConfig, arch: str, meta: dict[str, Any]) -> FedModel:
    """A fresh model of ``arch``, a member of the run's model group: the initial model of the first
    client that has it (a function of the seed and the architecture)."""
    members = model_group(cfg.model.group)
    if arch not in members:
        raise ContractError(
            f"model {arch!r} is not in model.group={cfg.model.group!r} ({', '.join(members)})"
        )
    return make_client_model(cfg, members.index(arch), meta)


_SMALLEST: dict[tuple[str, str, int], str] = {}


def smallest_arch(cfg: ExperimentConfig, meta: dict[str, Any]) -> str:
    """The member of the run's model group with the fewest parameters (the first of equals), counted on
    models built on the meta device (no memory, no init)."""
    key = (cfg.model.group, repr(meta["inputs"]), meta["num_classes"])
    if key not in _SMALLEST:
        sizes = {}
        for arch in dict.fromkeys(model_group(cfg.model.group)):
            with torch.device("meta"):
                sizes[arch] = sum(p.numel() for p in model_of_arch(arch, meta).parameters())
        _SMALLEST[key] = min(sizes, key=lambda a: sizes[a])
    return _SMALLEST[key]


def model_of_arch(arch: str, meta: dict[str, Any]) -> FedModel:
    """A fresh zoo model of ``arch`` for the federation ``meta`` describes (its inputs and classes)."""
    return build_for(arch, meta["inputs"], meta["num_classes"], embeddings=meta["embeddings"])


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: str | torch.device,
    batch: int = EVAL_BATCH,
    scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """(correct, total, summed CE loss) of ``model`` on a normalised tensor dataset; ``scores`` (a
    client's ``eval_logits``) replaces the plain forward pass. Sums stay on the device until the end."""
    # the training loop leaves modes as it finds them (as Lightning does): each submodule gets its
    # own back, so a part the algorithm keeps in eval mode stays there, whatever happens here
    modes = [(m, m.training) for m in model.modules()]
    model.eval().to(device)
    try:
        forward = scores or model
        correct = torch.zeros((), dtype=torch.int64, device=device)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(0, len(y), batch):
            xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
            logits = forward(xb)
            correct += (logits.argmax(1) == yb).sum()
            loss += torch.nn.functional.cross_entropy(logits, yb, reduction="sum").double()
    finally:
        for submodule, mode in modes:
            submodule.training = mode
    return int(correct), len(y), float(loss)


class LRU(OrderedDict):
    """A mapping that forgets its least recently used entries beyond ``capacity``: a number of
    entries, or with ``weigh`` a total weight (bytes). Use ``take``, ``keep`` and ``pop``."""

    def __init__(self, capacity: int, weigh: Callable[[Any], int] | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.weigh = weigh or (lambda value: 1)
        self.weight = 0

    def take(self, key):
        """The entry for ``key`` (None if absent), now the most recently used."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def pop(self, key, default=None):
        if key not in self:
            return default
        value = super().pop(key)
        self.weight -= self.weigh(value)
        return value

    def keep(self, key, value) -> list:
        """Store ``value`` as the most recent entry; returns the values it pushed out (the newest
        entry itself stays, however heavy)."""
        self.pop(key)
        super().__setitem__(key, value)
        self.weight += self.weigh(value)
        evicted = []
        while self.weight > self.capacity and len(self) > 1:
            evicted.append(self.pop(next(iter(self))))
        return evicted


def fetch(boxed: Any) -> Any:
    """The object in a boxed ObjectRef (``[ref]``), or the object itself when driven without Ray."""
    value = boxed[0]
    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


@dataclass
class ClientData:
    train: ArrayDataset  # normalised, on the worker's device
    test_x: torch.Tensor  # normalised, on the worker's device
    test_y: torch.Tensor
    class_counts: torch.Tensor  # [C] train samples per class, on the CPU

    def nbytes(self) -> int:
        tensors = (self.train.x, self.train.y, self.test_x, self.test_y)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ClientResult:
    """What one client's training gave: its uplink and statistics, or what its code raised."""

    client: int
    uplink: Payload | None
    stats: dict[str, float]
    error: Failure | None = None


def tensor_versions(tree: Any) -> list[int]:
    """The in-place modification counters of every tensor in a payload (nested mappings and lists)."""
    if torch.is_tensor(tree):
        return [tree._version]
    if isinstance(tree, dict):
        return [v for value in tree.values() for v in tensor_versions(value)]
    if isinstance(tree, (list, tuple)):
        return [v for value in tree for v in tensor_versions(value)]
    return []


def to_cpu(tree: Any, copy: bool = False) -> Any:
    """A payload with every tensor on the CPU (payloads, states and checkpoints are CPU tensors);
    with ``copy``, in memory of its own even where it already was on the CPU. The tensors a GPU
    holds cross together (:func:`copy_to_cpu`)."""
    found: list[torch.Tensor] = []
    tensors_of(tree, found)
    return with_tensors(tree, iter(copy_to_cpu(found, copy)))


def tensors_of(tree: Any, found: list[torch.Tensor]) -> None:
    """Every tensor in a payload (nested mappings and lists), in :func:`with_tensors`'s order."""
    if torch.is_tensor(tree):
        found.append(tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            tensors_of(value, found)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            tensors_of(value, found)


def with_tensors(tree: Any, replacements: Iterator[torch.Tensor]) -> Any:
    """``tree`` rebuilt with its tensors taken from ``replacements``, in :func:`tensors_of`'s order."""
    if torch.is_tensor(tree):
        return next(replacements)
    if isinstance(tree, dict):
        return {k: with_tensors(v, replacements) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(with_tensors(v, replacements) for v in tree)
    return tree


class ClientHost:
    """A worker: trains and evaluates whichever clients it is handed. Free of Ray's decorator so it
    can be driven directly (tests, benchmarks).

    Algorithms whose clients keep state (``ClientModule.keeps_state``) get a module per client, kept
    for ``ray.cache_clients`` clients and tagged with the version of the committed state it holds (a
    task whose version matches loads nothing); a module whose training raised is dropped, as it
    may be half-updated. Algorithms whose clients keep nothing train every client on one model per
    architecture, which each downlink overwrites.
    """

    def __init__(self, cfg: ExperimentConfig, num_threads: int) -> None:
        set_worker_threads(num_threads)
        self.pages = PageReleaser()  # the state files it writes leave memory once on the disk
        self.configure(cfg)

    def configure(self, cfg: ExperimentConfig) -> None:
        """Everything one run sets: a worker kept for the driver's next run starts it here, holding
        nothing of the last one (no module, data or payload)."""
        self.cfg = cfg
        self.spec = get_algorithm(cfg.algorithm)
        # where the algorithm's code lives: a client's error is reported at its innermost frame there
        self.own_code = algorithm_files(self.spec.server_cls, self.spec.client_cls, self.spec.config_cls)
        self.device, self.device_info = worker_device(cfg)
        configure_device(self.device, cfg.train, cfg.ray.num_gpus_per_client)
        self.memory_format = image_memory_format(cfg.train, self.device)  # of the images it keeps
        self.training = LocalTraining(cfg.train, self.device)
        self.keeps_state = commits_state(self.spec.client_cls, cfg)
        self.modules: LRU = LRU(cfg.ray.cache_clients)  # client -> (version, ClientModule)
        self.spare: dict[str, list[FedModel]] = {}  # models of evicted clients, loaded in place next
        # model.init=shared: per architecture, its initial weights on the device and the CPU generator's
        # state after drawing them, so a new client is a copy into a spare model, not a fresh draw
        self.initial: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
        self.arch_models: dict[str, FedModel] = {}  # one per architecture: stateless clients, global model
        self.data: LRU = LRU(DATA_CACHE_BYTES, weigh=ClientData.nbytes)  # client -> ClientData
        self.global_chunks: LRU = LRU(GLOBAL_CHUNK_CACHE)  # chunk index -> (x, y) normalised
        self.payloads: dict[Any, Payload] = {}  # this round's downlinks, read once per worker
        self.payload_round = -1
        self.meta: dict[str, Any] = {}
        # the contract's checks of a running client, once per worker for each set of downlink keys
        self.checked_downlinks: set[frozenset] = set()

    def setup(self, meta: dict[str, Any], cfg: ExperimentConfig | None = None) -> dict[str, Any]:
        """What the data says (classes, channels, normalisation), known once the driver has loaded it;
        ``cfg``: the run's config, for a worker kept from an earlier run of the driver (a fresh
        worker was built with it). Returns what this worker trains on, for the run's record."""
        if cfg is not None and cfg != self.cfg:
            self.configure(cfg)
        self.meta = meta
        info = self.device_info
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"device": info.describe(), "kind": info.kind, "node": node}

    def sees(self, path: str) -> tuple[bool, str]:
        """Whether this worker's node sees ``path`` (the run's folder, where it writes client states),
        and the node's address, to name it."""
        return storage.exists(path), ray.util.get_node_ip_address() if ray.is_initialized() else "here"

    def clear(self) -> None:
        """The run is over and the worker waits for the driver's next one: what it held goes."""
        self.configure(self.cfg)

    # ---- a client's data, model and module
    def client_data(self, task: ClientTask) -> ClientData:
        data = self.data.take(task.client)
        if data is None:
            shard: ClientShard = fetch(task.shard)
            data = ClientData(
                ArrayDataset(self.on_device(shard.train.x), shard.train.y.to(self.device)),
                self.on_device(shard.test.x),
                shard.test.y.to(self.device),
                torch.bincount(shard.train.y, minlength=self.meta["num_classes"]),
            )
            self.data.keep(task.client, data)
        return data

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """Raw inputs normalised, on the worker's device, in its memory format (images)."""
        x = normalize(x, self.meta["mean"], self.meta["std"]).to(self.device)
        return laid_out(x, self.memory_format)

    def arch_model(self, arch: str) -> FedModel:
        """The model every client of ``arch`` shares when clients keep nothing (and the global model
        evaluation's): built once, overwritten by whatever is loaded into it next."""
        model = self.arch_models.get(arch)
        if model is None:
            model = model_of_arch(arch, self.meta)
            self.arch_models[arch] = model.to(self.device)
        return model

    def module(self, task: ClientTask) -> ClientModule:
        """The client's module at its committed state: from the cache, else loaded into a spare model
        in place, else at its initial weights (:meth:`initial_model`)."""
        data = self.client_data(task)
        ctx = ClientContext(
            task.client,
            self.cfg,
            self.meta["num_classes"],
            data.train,
            data.class_counts,
            find_smallest=lambda: smallest_arch(self.cfg, self.meta),
            make_arch=lambda arch: member_model(self.cfg, arch, self.meta),
        )
        if not self.keeps_state:
            model = self.arch_model(arch_for_client(self.cfg.model.group, task.client))
            module = self.spec.client_cls(model.train(), ctx)  # as a fresh build: the author sets modes
            # on a GPU with what its construction holds besides the model, as below (on the CPU it is
            # there already: 0.1 ms a client saved)
            return module.to(self.device) if self.device.type != "cpu" else module
        cached = self.modules.take(task.client)
        if cached is not None and cached[0] == task.version:
            return cached[1]
        if cached is not None:  # a state committed since elsewhere: its model takes the new one in place
            self.drop(task.client)
        model = self.reused_model(task.client) if task.state_file else self.initial_model(task.client)
        # in train mode as a fresh build (a reused model is as its last client left it), what its
        # construction holds on the device
        module = self.spec.client_cls(model.train(), ctx).to(self.device)
        if task.state_file:
            load_client_state(module, read_state(task.client, task.state_file))
        self.cache(task.client, task.version, module)
        return module

    def reused_model(self, client: int) -> FedModel:
        """A model of the client's architecture on the device, its weights about to be overwritten: an
        evicted client's, else a fresh one."""
        arch = arch_for_client(self.cfg.model.group, client)
        spares = self.spare.get(arch)
        return spares.pop() if spares else model_of_arch(arch, self.meta).to(self.device)

    def initial_model(self, client: int) -> FedModel:
        """The client's model at its initial weights (``model.init``: a function of (seed, client id)),
        on the device. With shared, every client of an architecture starts from one draw: made once per
        worker, then copied into a reused model, and the CPU generator left as the draw leaves it, so
        what the client's construction draws is what it drew after a fresh build."""
        if self.cfg.model.init != "shared":
            return make_client_model(self.cfg, client, self.meta).to(self.device)
        arch = arch_for_client(self.cfg.model.group, client)
        if arch not in self.initial:
            model = make_client_model(self.cfg, client, self.meta).to(self.device)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.initial[arch] = (state, torch.random.get_rng_state())
            return model
        state, generator = self.initial[arch]
        model = self.reused_model(client)
        model.load_state_dict(state)
        torch.random.set_rng_state(generator)
        return model

    def cache(self, client: int, version: int, module: ClientModule) -> None:
        for _, evicted in self.modules.keep(client, (version, module)):
            self.keep_spare(evicted.model)

    def drop(self, client: int) -> None:
        """Forget a client's module (it may be half-trained); its model is still good to load into."""
        cached = self.modules.pop(client, None)
        if cached is not None:
            self.keep_spare(cached[1].model)

    def keep_spare(self, model: FedModel) -> None:
        """Keep an evicted client's model to load the next client into (up to ``SPARE_MODELS`` per
        architecture; past that it is freed), without its gradients: the next fit sets them anew."""
        spares = self.spare.setdefault(model.arch, [])
        if len(spares) < SPARE_MODELS:
            model.zero_grad(set_to_none=True)
            spares.append(model)

    def payload(self, boxed: list, rnd: int) -> Payload:
        """A downlink: one in the object store (shared by several clients) is read once per worker and
        round; a client's own came with the call."""
        if not isinstance(boxed[0], ray.ObjectRef):
            return boxed[0]
        if rnd != self.payload_round:
            self.payloads, self.payload_round = {}, rnd
        if boxed[0] not in self.payloads:
            self.payloads[boxed[0]] = fetch(boxed)
        return self.payloads[boxed[0]]

    # ---- the work
    def train(self, rnd: int, tasks: list[ClientTask], payloads: list[list]) -> list[ClientResult]:
        """Receive, fit and upload each client in turn; a client that keeps state has its new state
        written to its task's ``commit_file`` before the call returns (committed once the
        Coordinator accepts its uplink)."""
        try:
            return [
                self.train_one(task, rnd, self.payload(boxed, rnd))
                for task, boxed in zip(tasks, payloads, strict=True)
            ]
        except BaseException:  # the whole call fails, so none of its clients commits: the modules
            for task in tasks:  # of those that trained are at versions the Coordinator never takes
                self.drop(task.client)
            raise

    def train_one(self, task: ClientTask, rnd: int, payload: Payload) -> ClientResult:
        """One client, its errors sorted by :meth:`faults_sorted`: the client's own is its result."""
        try:
            uplink, stats = self.faults_sorted(
                f"client {task.client}", lambda: self.fit_client(task, rnd, payload), [task.client]
            )
        except ClientCodeError as err:
            return ClientResult(task.client, None, {}, err.failure)
        return ClientResult(task.client, uplink, stats)

    def failure(self, err: Exception) -> Failure:
        """A client's own error as it is reported; a ``.view`` that fails on the worker's
        channels_last images says why and what to do."""
        hint = ""
        if self.memory_format == torch.channels_last and "view size is not compatible" in str(err):
            hint = (
                " (this worker keeps colour images channels_last, train.memory_format: use .reshape, "
                "or set train.memory_format=contiguous)"
            )
        return failure_of(err, hint, self.own_code)

    def faults_sorted(self, job: str, work: Callable[[], T], clients: list[int], passes: tuple = ()) -> T:
        """``work()``, with the device's faults sorted from the job's own: out of memory frees the
        cache and tries once more; any other device error breaks the worker (:class:`DeviceError`:
        the pool replaces it and runs the job elsewhere); a broken rule (and ``passes``) goes up as
        it is; anything else is the job's own (:class:`ClientCodeError`: reported, not retried). On
        any error the ``clients``' cached modules go: half-trained, or holding an evaluation's weights."""
        for attempt in (1, 2):
            try:
                return work()
            except (ConfigError, DeviceError, *passes):
                for client in clients:
                    self.drop(client)
                raise
            except Exception as err:
                for client in clients:
                    self.drop(client)
                if not (is_out_of_memory(err) and attempt == 1):
                    if is_out_of_memory(err) or is_device_error(err):
                        raise DeviceError(f"{job}: {first_line(err)}") from None
                    raise ClientCodeError(self.failure(err)) from err
            # out of memory, first try: freed here, not in the handler, where the error's traceback
            # still held the failed step's tensors (its batch, activations and graph)
            if self.device.type == "cuda":
                gc.collect()  # frames and errors in reference cycles
                torch.cuda.empty_cache()
        raise AssertionError("unreachable")

    def fit_client(self, task: ClientTask, rnd: int, payload: Payload) -> tuple[Payload, dict]:
        start = time.perf_counter()
        seed = seed_of("client/train", self.cfg.seed, rnd, task.client)
        seed_global_draws(seed)  # numpy's and Python's, from the module's construction on
        module = self.module(task)
        sent = tensor_versions(payload)
        written = None if self.keeps_state else unwritten_marks(module)
        # seeded before receive: every draw a client makes depends on (seed, round, client) only,
        # never on which worker runs it or what that worker ran before
        seed_torch(seed, self.device)
        keys = frozenset(payload)
        first = keys not in self.checked_downlinks
        downlink = payload  # as sent: the checks below read it without counting a key as read
        if first:
            payload = ReadKeys(payload)
        module.begin_round(rnd, payload)
        # the downlink is on the CPU: a GPU worker's parameters cannot share its memory and train
        downlink_memory = storages(downlink) if self.device.type == "cpu" else set()
        check_parameters_apart(self.spec.name, module, downlink_memory, "after receive")
        if isinstance(payload, ReadKeys):  # the first client with these keys (narrows the type too)
            check_downlink_read(self.spec.name, module, payload)
        if written is not None:
            require_overwritten(self.spec.name, module, written)
        epochs = module.local_epochs(rnd)
        if epochs > 0:
            self.training.fit(module, epochs, self.augment_generator(rnd, task.client))
        uplink = to_cpu(module.upload())
        check_parameters_apart(self.spec.name, module, downlink_memory, "after training")  # a hook's doing
        if tensor_versions(payload) != sent:
            raise ContractError(
                f"algorithm {self.spec.name!r}: client {task.client} changed a tensor of its downlink in "
                "place; the downlink is shared by the worker's clients (copy it before changing it)"
            )
        stats = module.pop_stats()
        if first:
            check_held_tensors(self.spec.name, module)
            check_tested_model(self.spec.name, module)
            self.checked_downlinks.add(keys)
        stats[Metrics.TIME_CLIENT_S] = time.perf_counter() - start
        if self.keeps_state:  # on disk first: a module cached as a version no file holds could be used later
            self.pages.release(write_state(task, module))
            self.cache(task.client, task.version + 1, module)
        return uplink, stats

    def augment_generator(self, rnd: int, client: int) -> torch.Generator | None:
        """``data.augment``'s draws for one client's round: a function of (seed, round, client)."""
        if self.cfg.data.augment != "crop_flip":
            return None
        return torch_generator("client/augment", self.cfg.seed, rnd, client)

    def evaluate(self, tasks: list[ClientTask], payload: Payload | None) -> list[tuple[int, int, int, float]]:
        """(client, correct, total, summed loss) of each client on its own test split.

        With a server payload and ``eval_mode == "global"``, the server's one model is
        evaluated on each client's data and no client module is built; otherwise each client's
        module is evaluated, after ``load_for_eval`` when there is a payload, and restored after.
        """
        clients = [task.client for task in tasks]
        return self.faults_sorted(
            f"evaluation from client {clients[0]}",
            lambda: self.evaluate_clients(tasks, payload),
            clients,
            passes=(ray.exceptions.RayError,),  # Ray losing an object: the pool runs the job again
        )

    def evaluate_clients(
        self, tasks: list[ClientTask], payload: Payload | None
    ) -> list[tuple[int, int, int, float]]:
        shared = None
        if payload is not None and tests_with_global_model(self.spec.client_cls, payload):
            shared = self.global_model(
                arch_for_client(self.cfg.model.group, tasks[0].client), payload["model"]
            )
        out = []
        for task in tasks:
            data = self.client_data(task)
            if shared is not None:
                scored = evaluate_model(
                    shared, data.test_x, data.test_y, self.device, scores=self.scores_of(shared)
                )
                out.append((task.client, *scored))
                continue
            module = self.module(task)
            saved = None if payload is None else {k: v.clone() for k, v in module.state_dict().items()}
            module.restore_held()  # as a module built for this evaluation holds
            if payload is not None:
                module.load_for_eval(payload)
            scored = evaluate_model(module, data.test_x, data.test_y, self.device, scores=module.eval_logits)
            out.append((task.client, *scored))
            if saved is not None:
                module.load_state_dict(saved)  # evaluation never changes a committed state
        return out

    def global_model(self, arch: str, state: dict[str, torch.Tensor]) -> FedModel:
        model = self.arch_model(arch)
        model.load_state_dict(state)
        return model

    def evaluate_global(
        self, arch: str, state: dict[str, torch.Tensor], chunks: dict[int, list]
    ) -> list[tuple[int, int, int, float]]:
        """(chunk, correct, total, summed loss) per chunk of the global test set; the caller sums them
        in chunk order, so the numbers never depend on how chunks were spread over workers."""
        job = f"global test chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, chunks))}"
        return self.faults_sorted(
            job, lambda: self.evaluate_chunks(arch, state, chunks), [], passes=(ray.exceptions.RayError,)
        )

    def evaluate_chunks(
        self, arch: str, state: dict[str, torch.Tensor], chunks: dict[int, list]
    ) -> list[tuple[int, int, int, float]]:
        model = self.global_model(arch, state)
        out = []
        for index, boxed in chunks.items():
            chunk = self.global_chunks.take(index)
            if chunk is None:
                raw: ArrayDataset = fetch(boxed)
                chunk = (self.on_device(raw.x), raw.y.to(self.device))
                self.global_chunks.keep(index, chunk)
            x, y = chunk
            out.append((index, *evaluate_model(model, x, y, self.device, scores=self.scores_of(model))))
        return out

    def scores_of(self, model: FedModel) -> Callable[[torch.Tensor], torch.Tensor]:
        """The class scores the algorithm gives a model it did not train here (the server's global one)."""
        return functools.partial(self.spec.client_cls.model_scores, model)


def unwritten_marks(module: ClientModule) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """Before ``receive``, for :func:`require_overwritten`: the versions of the worker's shared model's
    entries, and the entries outside it that copy it as its last client left it (a personal model
    deep-copied in ``__init__``), each with its storage and version."""
    model = module.model.state_dict()
    copies = {}
    for name, tensor in module.state_dict().items():
        ref = None if name.startswith("model.") else model.get(name.split(".", 1)[-1])
        if (
            ref is not None
            and ref.shape == tensor.shape
            and ref.dtype == tensor.dtype
            and torch.equal(ref, tensor)
        ):
            copies[name] = (tensor.data_ptr(), tensor._version)
    return [t._version for t in model.values()], copies


def require_overwritten(algorithm: str, module: ClientModule, before: tuple[list[int], dict]) -> None:
    """A client that keeps nothing must load its whole model in ``receive``: it trains on a model the
    worker shares, and whatever it did not overwrite is another client's. So is a copy of that model
    made before ``receive`` (a personal model deep-copied in ``__init__``) that it left as it was."""
    versions, copies = before
    for (name, tensor), version in zip(module.model.state_dict().items(), versions, strict=True):
        if tensor._version == version:
            raise ContractError(
                f"algorithm {algorithm!r}: {type(module).__name__} declares keeps_state = False, but "
                f"receive() left model.{name} as it was; load the whole model from the downlink, or "
                "keep keeps_state = True"
            )
    state = module.state_dict() if copies else {}
    for name, mark in copies.items():
        tensor = state.get(name)
        if tensor is not None and (tensor.data_ptr(), tensor._version) == mark:
            raise ContractError(
                f"algorithm {algorithm!r}: {type(module).__name__} declares keeps_state = False, but "
                f"{name} copies the worker's shared model as its previous client left it, and receive() "
                "left it so; a model a client keeps of its own needs keeps_state = True"
            )


def client_state(module: ClientModule) -> dict[str, Any]:
    """Everything a client keeps between rounds: its module's state_dict (parameters and registered
    buffers) and, with ``train.keep_optimizer_state``, its optimizer state, as CPU tensors (the
    module's own where it trains on the CPU: saved at once, never kept)."""
    return {"module": to_cpu(module.state_dict()), "optimizer": to_cpu(module._optimizer_state)}


def write_state(task: ClientTask, module: ClientModule) -> str:
    """The client's new state to the file its task names, before its call returns: on disk before it
    is committed, so a worker that dies after it loses nothing (write-through). Returns the file."""
    if task.commit_file is None:
        raise RuntimeError(f"client {task.client} keeps state but its task names no file for it")
    try:  # into the folder the Coordinator made: a node that does not see it writes nowhere else
        storage.save_torch(
            client_state(module), task.commit_file, f"client {task.client}'s state", parents=False
        )
    except FileNotFoundError:
        raise ConfigError(not_shared(task.client, task.commit_file)) from None
    return task.commit_file


def read_state(client: int, path: str) -> dict[str, Any]:
    try:
        return storage.load_torch(path)
    except FileNotFoundError:
        raise ConfigError(not_shared(client, path)) from None


def not_shared(client: int, path: str) -> str:
    node = ray.util.get_node_ip_address() if ray.is_initialized() else "this node"
    return (
        f"storage_path: client {client}'s state {path} is not reachable from node {node}: every node "
        "must see the run's folder (a directory they all share, or a pyarrow.fs URI such as s3://bucket/fedray)"
    )


def load_client_state(module: ClientModule, state: dict[str, Any]) -> None:
    module.load_state_dict(state["module"])
    module._optimizer_state = state.get("optimizer")


def client_model_state(state: dict[str, Any], tested_model: str = "model") -> dict[str, torch.Tensor]:
    """The model a client is tested with, from its state (``ClientModule.tested_model``: what
    ``models/client_models.pt`` holds and the run logs as ``client_<k>``)."""
    prefix = f"{tested_model}."
    return {k.removeprefix(prefix): v for k, v in state["module"].items() if k.startswith(prefix)}


@ray.remote
class ClientActor(ClientHost):
    """ClientHost as a Ray actor: a worker process of the pool."""

    def __init__(self, cfg: ExperimentConfig, num_threads: int) -> None:
        set_up_worker()
        super().__init__(cfg, num_threads)


__all__ = ["ClientActor", "ClientHost", "evaluate_model", "make_client_model"]
