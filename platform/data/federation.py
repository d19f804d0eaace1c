"""From one dataset to N client shards: the federation a run trains on.

Every sample has an id (:mod:`fedray.platform.data.bundle`: official train ``0..n_train-1``, then
official test); each shard keeps the ids of its samples, so :func:`~.split_file.write_split` can save
the partition and ``data.partition.kind=file`` can rebuild it anywhere.

Convention (``data.split.convention``; the same for every algorithm, so results compare):

``per_client`` (default; the FedSSA paper's 8:1:1, or any ratios)
    1. The pool is the official train set. ``data.train_subset`` keeps a stratified random subset of
       it; ``data.partition.long_tail_rho`` then thins it to the long-tail profile (FedSC's LT setting;
       the test sets stay balanced).
    2. The pool is partitioned among ``data.num_clients`` clients with ``data.partition``.
    3. Each client's share of ``n`` samples is split by ``data.split`` into local train / val / test,
       stratified by class inside the client: test gets ``round(n * test)``, val its share of the rest
       (within one of ``n * val``), train the remainder. So a client's local test set follows its own
       train distribution, as the personalised-FL papers evaluate.
    4. The global test set (for algorithms with a global model) is the official test split.

``merged`` (PFLlib and FedL2G: train and test merged, each client split ``0.75/0.25``)
    As ``per_client``, but the pool is the official train and test sets merged (ids ``0..N-1``), and
    the official test set is thereby merged away: the global test set is the union of the clients'
    test splits (ids ascending). ``data.split.test`` must be > 0. (PFLlib's ``train_test_split`` is not
    stratified; ours is, the totals are the same.)

``official_test`` (FedSSA's code: partition the train set, test on the official test set)
    Steps 1-2 as ``per_client``; each client's share is split into train / val by the ratios
    (``data.split.test`` must be 0). Each client then gets a test set drawn without replacement from
    the official test set with its share's class proportions: of class ``c``, client ``k`` receives
    ``share[k, c] / n_train[c]`` of the official test samples of ``c``, where ``share[k, c]`` counts its
    train + val samples of ``c`` and ``n_train[c]`` the official train samples of ``c``. Per class the
    total is rounded half up and divided among clients by largest remainder, so the sizes follow
    ``n_test[k] ≈ n_share[k] * len(test) / len(train)`` on class-balanced sets (FedSSA's code splits
    each pool with the same class map: 40k train, 10k val, 10k test on CIFAR). The shares of a class
    never exceed the class, so the client test sets are always disjoint. The global test set is the
    whole official test set (it therefore overlaps the client tests).

``data.partition.kind=natural`` (LEAF's datasets: one client per writer, speaking role or user)
    The dataset's own clients, ``data.num_clients`` of them (see :func:`natural`); the convention says
    whether a client tests on its own held-out samples (``official_test``) or on a split of its share.
    ``data.train_subset`` and ``long_tail_rho`` do not apply. Any other partitioner on such a dataset
    splits the pooled samples of all users as usual.

``data.partition.kind=file``
    The split file (:mod:`fedray.platform.data.split_file`) defines the clients, each one's train /
    val / test samples in the file's order, and the global test set (default: the official test). The
    convention, ``data.split``, ``data.train_subset`` and ``long_tail_rho`` do not apply, and
    ``data.num_clients`` must equal the file's number of clients.

Everything is a pure function of (dataset, config, seed): the partition and each client's split use
their own random streams derived from the seed, so the same seed builds the same federation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import ArrayDataset, DatasetBundle, Modality, NaturalClient
from fedray.platform.data.partition import (
    _assign_by_counts,
    apportion,
    partition,
    stratified_split,
)
from fedray.platform.data.sources import SourceInfo, check_source, official_sizes
from fedray.platform.data.split_file import (
    SampleSpace,
    check_num_clients,
    check_split_file,
    read_split_file,
    resolve_split,
    split_path,
)
from fedray.platform.errors import ConfigError
from fedray.platform.seeds import numpy_rng

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class ClientShard:
    """One client's data: local train, val (may be empty) and test splits."""

    client_id: int
    train: ArrayDataset
    val: ArrayDataset
    test: ArrayDataset
    # sample ids (see fedray.platform.data.bundle) of each split, in the same order; None when the
    # shard was made by hand
    train_ids: np.ndarray | None = None
    val_ids: np.ndarray | None = None
    test_ids: np.ndarray | None = None


@dataclass
class Federation:
    """All client shards plus what models and evaluation need to know about the data."""

    shards: list[ClientShard]
    global_test: ArrayDataset  # for global models: the official test split (see the conventions)
    num_classes: int
    in_channels: int  # images; 0 for text
    image_size: int  # images; 0 for text
    mean: tuple[float, ...]  # images; () for text
    std: tuple[float, ...]
    class_names: list[str]
    modality: Modality = "image"
    seq_len: int = 0  # text
    vocab_size: int = 0  # text
    embeddings: Any = None  # text: pretrained word vectors [vocab_size, dim] (a tensor), or None
    # where the samples come from, for split files: the id space and the global test's ids
    dataset: str = ""
    num_train: int = 0  # official train size: ids below it are train samples, the rest test
    num_test: int = 0
    global_test_ids: np.ndarray | None = None
    sample_paths: list[str] | None = None  # image folders: relative path of every id
    provenance: dict[str, Any] = field(default_factory=dict)  # how it was built (written to split files)

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def info(self) -> SourceInfo:
        """The federation's classes, modality and sample shape."""
        return SourceInfo(
            self.num_classes, self.modality, self.in_channels, self.image_size, self.seq_len, self.vocab_size
        )

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape: ``(C, H, W)`` for images, ``(L,)`` for token ids."""
        if self.modality == "text":
            return (self.seq_len,)
        return (self.in_channels, self.image_size, self.image_size)

    def train_histogram(self) -> np.ndarray:
        """``[num_clients, num_classes]`` counts of each class in each client's train split."""
        return np.stack([np.bincount(s.train.y.numpy(), minlength=self.num_classes) for s in self.shards])

    def histogram_table(self) -> pd.DataFrame:
        """One row per client: client, n_train, n_val, n_test, then train counts per class name."""
        import pandas as pd

        table = pd.DataFrame(
            {
                "client": [s.client_id for s in self.shards],
                "n_train": [len(s.train) for s in self.shards],
                "n_val": [len(s.val) for s in self.shards],
                "n_test": [len(s.test) for s in self.shards],
            }
        )
        counts = pd.DataFrame(self.train_histogram(), columns=list(self.class_names))
        return pd.concat([table, counts], axis=1)


def sample_pool(cfg: DataConfig) -> tuple[int, str]:
    """How many samples a split partition draws its clients from, and what they are, in words."""
    n_train, n_test = official_sizes(cfg)
    if cfg.split.convention == "merged":
        return n_train + n_test, "train + test samples"
    return n_train, "training samples"


def check_data(cfg: DataConfig) -> None:
    """Cheap pre-flight of the data section (no sample is decoded); raises a one-line ConfigError.

    With ``data.partition.kind=file`` the split file is checked here from metadata alone: its JSON
    shape, the client count, and every entry against the official sizes (or the image folder's
    listing); :func:`build_federation` checks again on the loaded data.
    """
    source = check_source(cfg)
    p = cfg.partition
    if p.kind == "file":
        check_split_file(cfg)
        return
    if p.kind == "natural":
        if not source.natural:
            raise ConfigError(
                f"data.partition.kind=natural: {cfg.dataset} has no clients of its own (LEAF's femnist, "
                "shakespeare and sent140 do); use iid, dirichlet, shards or shamsian"
            )
        qualify = sum(n >= cfg.leaf.min_samples for n in source.user_sizes(cfg))
        if cfg.num_clients > qualify:
            raise too_few_users(cfg, qualify)
        return
    num_classes = source.num_classes(cfg)
    if p.kind in ("shards", "shamsian") and p.classes_per_client > num_classes:
        raise ConfigError(
            f"data.partition.classes_per_client={p.classes_per_client}: more than the "
            f"{num_classes} classes of {cfg.dataset}"
        )
    if p.kind == "shards" and p.classes_per_client * cfg.num_clients < num_classes:
        raise ConfigError(
            f"data.partition.classes_per_client={p.classes_per_client}: shards needs "
            f"classes_per_client * data.num_clients >= {num_classes} classes (got "
            f"{p.classes_per_client * cfg.num_clients}); use kind=shamsian to leave classes out"
        )
    n_pool, pool = sample_pool(cfg)
    if cfg.num_clients > n_pool:
        raise ConfigError(
            f"data.num_clients={cfg.num_clients}: more clients than the {n_pool} {pool} of {cfg.dataset}"
        )
    if cfg.train_subset is not None and cfg.train_subset > n_pool:  # it would keep the whole pool
        raise ConfigError(
            f"data.train_subset={cfg.train_subset}: more than the {n_pool} {pool} of {cfg.dataset}; "
            "leave it null for all of them"
        )
    if p.kind == "dirichlet" and p.min_samples * cfg.num_clients > n_pool:
        raise ConfigError(
            f"data.partition.min_samples={p.min_samples}: {cfg.num_clients} clients x {p.min_samples} "
            f"exceeds the {n_pool} {pool} of {cfg.dataset}"
        )


def _empty() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def _assemble(
    bundle: DatasetBundle,
    client_ids: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    global_test_ids: np.ndarray | None,
    provenance: dict[str, Any],
) -> Federation:
    """Shards from per-client ``(train, val, test)`` id arrays; ``None`` global test = the official one."""
    shards = [
        ClientShard(
            client_id=k,
            train=bundle.take(tr),
            val=bundle.take(va),
            test=bundle.take(te),
            train_ids=tr,
            val_ids=va,
            test_ids=te,
        )
        for k, (tr, va, te) in enumerate(client_ids)
    ]
    official = np.arange(len(bundle.train), bundle.num_samples, dtype=np.int64)
    if global_test_ids is None or np.array_equal(global_test_ids, official):
        global_test_ids, global_test = official, bundle.test
    else:
        global_test = bundle.take(global_test_ids)
    return Federation(
        shards=shards,
        global_test=global_test,
        num_classes=bundle.num_classes,
        in_channels=bundle.in_channels,
        image_size=bundle.image_size,
        mean=bundle.mean,
        std=bundle.std,
        class_names=list(bundle.class_names),
        modality=bundle.modality,
        seq_len=bundle.seq_len,
        vocab_size=bundle.vocab_size,
        embeddings=bundle.embeddings,
        dataset=bundle.name,
        num_train=len(bundle.train),
        num_test=len(bundle.test),
        global_test_ids=global_test_ids,
        sample_paths=bundle.paths,
        provenance=provenance,
    )


def official_test_shares(
    bundle: DatasetBundle, shares: list[np.ndarray], rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client's test ids drawn from the official test set (the ``official_test`` convention).

    ``shares[k]`` are client ``k``'s train + val ids (official-train ids). Of class ``c`` client ``k``
    gets ``share[k, c] / n_train[c]`` of the official test samples of ``c``: per class the total is
    rounded half up and split by largest remainder, the samples dealt out shuffled, disjointly.
    """
    n_train, n_classes = len(bundle.train), bundle.num_classes
    train_y, test_y = bundle.train.y.numpy(), bundle.test.y.numpy()
    share = np.stack([np.bincount(train_y[ids], minlength=n_classes) for ids in shares], axis=1)  # [C, K]
    class_train = np.bincount(train_y, minlength=n_classes)
    class_test = np.bincount(test_y, minlength=n_classes)
    counts = np.zeros_like(share)  # [C, K] test samples of each class for each client
    for cls in np.flatnonzero((share.sum(axis=1) > 0) & (class_train > 0)):
        total = int(np.floor(class_test[cls] * share[cls].sum() / class_train[cls] + 0.5))
        counts[cls] = apportion(share[cls], total)
    present = np.unique(test_y)
    tests = _assign_by_counts(test_y, counts[present], rng) if len(present) else [_empty() for _ in shares]
    return [n_train + t.astype(np.int64) for t in tests]


def parse_normalize(spec: str) -> tuple[float, float] | None:
    """``data.normalize``: ``dataset`` (None: the training pool's per-channel statistics) or
    ``<mean>,<std>`` for every channel (PFLlib and HtFLlib: ``0.5,0.5``)."""
    if spec == "dataset":
        return None
    try:
        mean, std = (float(v) for v in str(spec).split(","))
    except ValueError:
        raise ConfigError(
            f"data.normalize={spec!r}: expected dataset or <mean>,<std>, e.g. 0.5,0.5"
        ) from None
    if std <= 0:
        raise ConfigError(f"data.normalize={spec!r}: the std must be > 0")
    return mean, std


def build_federation(bundle: DatasetBundle, cfg: DataConfig, seed: int) -> Federation:
    """Partition the pool among clients and split each share (see the module docstring), and set
    the input normalisation ``data.normalize`` asks for (recorded in the split file's provenance)."""
    if cfg.partition.kind == "file":
        fed = federation_from_file(bundle, cfg)
    elif cfg.partition.kind == "natural":
        fed = natural(bundle, cfg, seed)
    else:
        fed = partitioned(bundle, cfg, seed)
    fixed = parse_normalize(cfg.normalize)
    if fixed is not None:
        fed.mean, fed.std = (fixed[0],) * fed.in_channels, (fixed[1],) * fed.in_channels
    fed.provenance["normalize"] = {"mode": cfg.normalize, "mean": list(fed.mean), "std": list(fed.std)}
    return fed


def require_training_samples(
    client_id: int, train: np.ndarray, share: str, cfg: DataConfig, fix: str
) -> None:
    """A client the split left without a training sample cannot train: a one-line ConfigError."""
    if len(train) == 0:
        raise ConfigError(
            f"client {client_id} has no training samples ({share} and data.split.train="
            f"{cfg.split.train}); {fix}"
        )


def partitioned(bundle: DatasetBundle, cfg: DataConfig, seed: int) -> Federation:
    s = cfg.split
    merged = s.convention == "merged"
    if s.convention == "official_test" and s.test != 0:
        raise ConfigError(
            f"data.split.test={s.test}: data.split.convention=official_test needs data.split.test=0"
        )
    pool_ids = np.arange(bundle.num_samples if merged else len(bundle.train), dtype=np.int64)
    all_labels = bundle.labels()
    if cfg.train_subset is not None and cfg.train_subset < len(pool_ids):
        # a stratified random subset of the pool (e.g. the 10k-image benchmark)
        fraction = cfg.train_subset / len(pool_ids)
        keep, _ = stratified_split(
            all_labels[pool_ids], (fraction, 1 - fraction), numpy_rng("data/subset", seed)
        )
        pool_ids = pool_ids[np.sort(keep)]
    labels = all_labels[pool_ids]
    parts = partition(labels, cfg.partition, cfg.num_clients, bundle.num_classes, seed)
    ratios = (s.train, s.val) if s.convention == "official_test" else (s.train, s.val, s.test)
    client_ids = []
    for client_id, idx in enumerate(parts):
        pieces = stratified_split(labels[idx], ratios, numpy_rng("data/split", seed, client_id))
        train, val, *rest = (pool_ids[idx[piece]] for piece in pieces)
        test = rest[0] if rest else _empty()  # official_test: drawn below
        require_training_samples(
            client_id,
            train,
            f"{len(idx)} samples after data.partition.kind={cfg.partition.kind}",
            cfg,
            "use fewer clients, a larger data.partition.min_samples or a larger data.split.train",
        )
        client_ids.append((train, val, test))
    if s.convention == "official_test":
        shares = [np.concatenate([tr, va]) for tr, va, _ in client_ids]
        tests = official_test_shares(bundle, shares, numpy_rng("data/official_test", seed))
        client_ids = [(tr, va, te) for (tr, va, _), te in zip(client_ids, tests)]
    global_test = np.sort(np.concatenate([te for *_, te in client_ids])) if merged else None
    provenance = {
        "partition": cfg.partition.kind,
        "convention": s.convention,
        "split": [s.train, s.val, s.test],
        "seed": seed,
    }
    return _assemble(bundle, client_ids, global_test, provenance)


def too_few_users(cfg: DataConfig, qualify: int) -> ConfigError:
    return ConfigError(
        f"data.num_clients={cfg.num_clients}: {cfg.dataset} has {qualify} users with at least "
        f"data.leaf.min_samples={cfg.leaf.min_samples} samples; ask for at most {qualify}"
    )


def kept_users(bundle: DatasetBundle, cfg: DataConfig, seed: int) -> list[NaturalClient]:
    """The dataset's users a ``natural`` federation keeps: those with at least ``data.leaf.min_samples``
    samples as LEAF's ``-k`` counts them (before its train/test split), and one to train on;
    ``data.num_clients`` of them drawn from the seed, in the dataset's order."""
    users = [
        u for u in bundle.clients or [] if len(u.train_ids) > 0 and u.num_samples >= cfg.leaf.min_samples
    ]
    if cfg.num_clients > len(users):
        raise too_few_users(cfg, len(users))
    if cfg.num_clients < len(users):
        picked = numpy_rng("data/natural_users", seed).choice(len(users), cfg.num_clients, replace=False)
        users = [users[i] for i in np.sort(picked)]
    return users


def natural(bundle: DatasetBundle, cfg: DataConfig, seed: int) -> Federation:
    """``data.partition.kind=natural``: one client per kept user of the dataset (:func:`kept_users`).

    ``data.split.convention`` says what each client's share is: ``official_test`` keeps the user's own
    held-out samples as its test set and splits its train samples train/val by the ratios; ``per_client``
    splits the user's train samples by the ratios; ``merged`` splits its train and held-out samples
    together. The global test set is the union of the kept users' held-out samples (``merged``: of the
    clients' test splits), so users left out do not test the model.
    """
    s = cfg.split
    labels = bundle.labels()
    ratios = (s.train, s.val) if s.convention == "official_test" else (s.train, s.val, s.test)
    client_ids, held_out = [], []
    for k, user in enumerate(kept_users(bundle, cfg, seed)):
        own_test = np.asarray(user.test_ids, dtype=np.int64)
        pool = np.asarray(user.train_ids, dtype=np.int64)
        if s.convention == "merged":
            pool = np.concatenate([pool, own_test])
        pieces = stratified_split(labels[pool], ratios, numpy_rng("data/split", seed, k))
        train, val, *rest = (pool[p] for p in pieces)
        require_training_samples(
            k,
            train,
            f"user {user.name!r}'s {len(pool)} samples",
            cfg,
            "keep users with more samples (a larger data.leaf.min_samples) or a larger data.split.train",
        )
        test = rest[0] if rest else own_test
        client_ids.append((train, val, test))
        held_out.append(test if s.convention == "merged" else own_test)
    global_test = np.sort(np.concatenate(held_out))
    provenance = {
        "partition": "natural",
        "convention": s.convention,
        "split": [s.train, s.val, s.test],
        "seed": seed,
    }
    return _assemble(bundle, client_ids, global_test, provenance)


def federation_from_split(
    bundle: DatasetBundle, split: dict[str, Any], src: str = "split.json", root: str | None = None
) -> Federation:
    """The federation a split (a parsed split file) describes, checked against ``bundle``."""
    resolved = resolve_split(split, SampleSpace.of_bundle(bundle, root), src)
    client_ids = [(c["train"], c["val"], c["test"]) for c in resolved.clients]
    return _assemble(bundle, client_ids, resolved.global_test, {"partition": "file", "source": src})


def federation_from_file(bundle: DatasetBundle, cfg: DataConfig) -> Federation:
    """``data.partition.kind=file``: read ``data.partition.path`` and build the clients it lists."""
    src = split_path(cfg)
    split = read_split_file(src)
    check_num_clients(cfg, len(split["clients"]), src)
    return federation_from_split(bundle, split, src, cfg.root)
