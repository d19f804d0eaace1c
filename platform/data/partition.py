"""Partitioners: split a label array's sample indices among federated clients.

Each partitioner returns ``list[np.ndarray]``: one sorted int64 index array per client, pointing into
the label array it was given. Guarantees:

- ``iid``, ``dirichlet``, ``shards``: every sample goes to exactly one client.
- ``shamsian`` / ``apply_plan``: every sample of a class that some client holds goes to exactly one
  client. When ``num_clients * classes_per_client < num_classes`` some classes are held by nobody and
  their samples are left out. (pFedHN floors each client's share and drops the remainders; we hand the
  remainders out by largest remainder instead, so nothing else is lost.)
- ``long_tail`` returns the indices it keeps, not a partition.

Randomness comes only from the ``rng`` argument (a ``np.random.Generator`` or an int seed), so the same
seed gives the same partition. :func:`partition` draws from the experiment seed's named streams
``data/long_tail`` and ``data/partition`` (:mod:`fedray.platform.seeds`): changing the partitioner does
not change which samples the long-tail step keeps, and neither collides with other users of the seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedray.platform.config import PartitionConfig
from fedray.platform.errors import ConfigError
from fedray.platform.seeds import numpy_rng

RngLike = np.random.Generator | int


# ------------------------------------------------------------------------------------------ helpers


class TooFewSamples(ConfigError):
    """The pool holds fewer samples than the clients' minimum asks for (a long tail may have thinned it)."""


def _class_order(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices grouped by class (classes ascending, random order inside a class).

    Returns ``(order, rank, class_of)``: ``order`` the sample indices, ``rank[i]`` the position of
    ``order[i]`` inside its class block and ``class_of[i]`` its class position in ``np.unique(labels)``.
    """
    _, inverse = np.unique(labels, return_inverse=True)
    order = np.lexsort((rng.random(len(labels)), inverse))
    class_of = inverse[order]
    counts = np.bincount(class_of)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(len(labels)) - starts[class_of]
    return order, rank, class_of


def _group(indices: np.ndarray, owners: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Split ``indices`` by owner (0..num_clients-1; any other owner drops the sample); each sorted."""
    keep = (owners >= 0) & (owners < num_clients)
    indices, owners = indices[keep], owners[keep]
    by_owner = np.argsort(owners, kind="stable")
    sizes = np.bincount(owners, minlength=num_clients)
    parts = np.split(indices[by_owner], np.cumsum(sizes)[:-1])
    return [np.sort(p).astype(np.int64) for p in parts]


def _assign_by_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Deal each class's shuffled samples out to clients: ``counts[k, i]`` samples of class ``k`` to ``i``.

    ``counts`` has one row per class in ``np.unique(labels)``; a row may sum to less than the class size,
    and the samples left over are dropped.
    """
    num_classes, num_clients = counts.shape
    class_sizes = np.bincount(np.unique(labels, return_inverse=True)[1], minlength=num_classes)
    leftover = class_sizes - counts.sum(axis=1)
    if (leftover < 0).any():
        raise ValueError("counts exceed the class sizes")
    with_dropped = np.concatenate([counts, leftover[:, None]], axis=1)  # column num_clients = nobody
    owners_in_order = np.repeat(np.tile(np.arange(num_clients + 1), num_classes), with_dropped.ravel())
    order, _, _ = _class_order(labels, rng)
    return _group(order, owners_in_order, num_clients)


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` that sum to ``total`` (largest-remainder method)."""
    weights = np.asarray(weights, dtype=np.float64)
    quotas = weights / weights.sum() * total
    out = np.floor(quotas).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(quotas - out), kind="stable")[:short]] += 1
    return out


def _spread_pick(n: int, fraction: float) -> np.ndarray:
    """Boolean mask picking ``round(n * fraction)`` of ``n`` positions, evenly spread (Bresenham).

    Any contiguous block of length L gets ``L * fraction`` picks, give or take one: applied to samples
    ordered class by class, this is a stratified pick with an exact total.
    """
    steps = np.floor(np.arange(n + 1) * fraction + 0.5)
    return np.diff(steps) > 0


def stratified_split(labels: np.ndarray, fractions: Sequence[float], rng: RngLike) -> list[np.ndarray]:
    """Split sample indices into parts of the given fractions, stratified by class.

    Totals are deterministic: the last part gets exactly ``round(n * f_last)`` samples, each middle part
    its share of what the later parts left (within one of ``n * f_j``), and part 0 (the train part, by
    convention) the rest. Within a class each part gets its share give or take one (two for a middle
    part). Classes are visited in a random order, so the rounding favours no class id.
    """
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    fr = np.asarray(fractions, dtype=np.float64)
    if (fr < 0).any() or fr.sum() <= 0:
        raise ValueError(f"fractions must be >= 0 and not all 0, got {list(fractions)}")
    fr = fr / fr.sum()
    # samples grouped by class in a random class order, shuffled inside each class
    classes, inverse = np.unique(labels, return_inverse=True)
    class_rank = rng.permutation(len(classes))
    remaining = np.lexsort((rng.random(len(labels)), class_rank[inverse]))
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(fr)
    for j in range(len(fr) - 1, 0, -1):  # last part first, each from what the later ones left
        share = fr[j] / fr[: j + 1].sum()
        picked = _spread_pick(len(remaining), share)
        parts[j] = np.sort(remaining[picked]).astype(np.int64)
        remaining = remaining[~picked]
    parts[0] = np.sort(remaining).astype(np.int64)
    return parts


# ------------------------------------------------------------------------------------------ partitioners


def iid(labels: np.ndarray, num_clients: int, rng: RngLike) -> list[np.ndarray]:
    """Uniformly random, equal-size split (sizes differ by at most one)."""
    rng = np.random.default_rng(rng)
    perm = rng.permutation(len(labels))
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    min_samples: int,
    rng: RngLike,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label skew by Dirichlet proportions (Hsu et al. 2019; used by FedCross, FedL2G and MOON).

    For each class ``c`` draw ``p_c ~ Dir(alpha * 1_N)`` and split the class's shuffled samples among the
    N clients by ``p_c``. Redraw everything until every client holds ``>= min_samples`` samples; a
    smaller ``alpha`` gives more skew (and more quantity skew too).
    """
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    class_sizes = np.unique(labels, return_counts=True)[1]
    if min_samples * num_clients > len(labels):
        raise TooFewSamples(
            f"data.partition.min_samples={min_samples}: {num_clients} clients x {min_samples} exceeds the "
            f"{len(labels)} samples"
        )
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(num_clients, alpha), size=len(class_sizes))  # [K, N]
        if not np.isfinite(props).all():
            continue
        cuts = np.floor(np.cumsum(props, axis=1) * class_sizes[:, None]).astype(np.int64)
        cuts[:, -1] = class_sizes
        counts = np.diff(cuts, axis=1, prepend=0)  # [K, N] samples of class k for client i
        if counts.sum(axis=0).min() >= min_samples:
            return _assign_by_counts(labels, counts, rng)
    raise ConfigError(
        f"data.partition.min_samples={min_samples}: no Dirichlet draw with data.partition.alpha={alpha} "
        f"gave each of data.num_clients={num_clients} clients that many samples in {max_tries} tries; "
        "lower min_samples, raise alpha or use fewer clients"
    )


def shards(labels: np.ndarray, num_clients: int, classes_per_client: int, rng: RngLike) -> list[np.ndarray]:
    """Pathological split of FedAvg (McMahan et al. 2017): each client gets ``classes_per_client`` shards.

    The samples are cut into ``num_clients * classes_per_client`` shards and the shards dealt out at
    random. Unlike FedAvg's sort-and-cut, shards never straddle two classes: each class gets a number of
    shards proportional to its size (at least one), so a client sees at most ``classes_per_client``
    classes. Two shards of the same class may land on one client, which then sees fewer classes (as in
    FedAvg). Shard sizes differ a little when class sizes do.
    """
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    num_shards = num_clients * classes_per_client
    class_sizes = np.unique(labels, return_counts=True)[1]
    if num_shards < len(class_sizes):
        raise ConfigError(
            f"data.partition.classes_per_client={classes_per_client}: shards needs classes_per_client * "
            f"data.num_clients >= {len(class_sizes)} classes (got {num_shards})"
        )
    per_class = 1 + apportion(class_sizes, num_shards - len(class_sizes))  # shards of each class
    first_shard = np.concatenate(([0], np.cumsum(per_class)[:-1]))
    order, rank, class_of = _class_order(labels, rng)
    shard_of = first_shard[class_of] + rank * per_class[class_of] // class_sizes[class_of]
    owner_of_shard = rng.permutation(num_shards) // classes_per_client
    return _group(order, owner_of_shard[shard_of], num_clients)


def shamsian_plan(
    num_classes: int,
    num_clients: int,
    classes_per_client: int,
    rng: RngLike,
    low: float = 0.4,
    high: float = 0.6,
) -> np.ndarray:
    """Class-to-client proportions of pFedHN (Shamsian et al. 2021), used by FedSSA (its paper, Sec. 6.1).

    The ``num_clients * classes_per_client`` (client, class) slots are spread over the classes as evenly
    as possible; each client in turn takes ``classes_per_client`` distinct classes among those with the
    most slots left (ties at random). Every slot gets a weight ``~ U(low, high)``, normalised over the
    clients holding that class. Returns ``plan[num_clients, num_classes]``: column ``c`` holds the share
    of class ``c`` each client gets (sums to 1 for a held class, all zeros for a class nobody holds).
    Apply it to any pool with :func:`apply_plan`, so train and test pools share class sets and shares.
    """
    rng = np.random.default_rng(rng)
    if classes_per_client > num_classes:
        raise ConfigError(
            f"data.partition.classes_per_client={classes_per_client}: more than the {num_classes} classes"
        )
    base, extra = divmod(num_clients * classes_per_client, num_classes)
    slots_left = np.full(num_classes, base)
    slots_left[rng.choice(num_classes, size=extra, replace=False)] += 1
    plan = np.zeros((num_clients, num_classes))
    for client in range(num_clients):  # greedy and sequential by nature; loops over clients only
        chosen = np.lexsort((rng.random(num_classes), -slots_left))[:classes_per_client]
        # the greedy keeps slot counts within one of each other, so the top classes always have slots
        assert (slots_left[chosen] > 0).all()
        slots_left[chosen] -= 1
        plan[client, chosen] = rng.uniform(low, high, size=classes_per_client)
    held = plan.sum(axis=0)
    plan[:, held > 0] /= held[held > 0]
    return plan


def apply_plan(labels: np.ndarray, plan: np.ndarray, rng: RngLike) -> list[np.ndarray]:
    """Split each class's shuffled samples among its holders by the plan's shares (largest remainder).

    Samples of classes that no client holds (all-zero column) are left out.
    """
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    classes, class_sizes = np.unique(labels, return_counts=True)
    if len(classes) and (classes.min() < 0 or classes.max() >= plan.shape[1]):
        raise ValueError(f"labels must lie in [0, {plan.shape[1]}) for this plan")
    counts = np.zeros((len(classes), plan.shape[0]), dtype=np.int64)
    for k, (c, n) in enumerate(zip(classes, class_sizes)):
        if plan[:, c].sum() > 0:
            counts[k] = apportion(plan[:, c], n)
    return _assign_by_counts(labels, counts, rng)


def shamsian(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: RngLike,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """pFedHN / FedSSA pathological split: :func:`shamsian_plan` applied to ``labels``."""
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    return apply_plan(labels, shamsian_plan(num_classes, num_clients, classes_per_client, rng), rng)


def long_tail(labels: np.ndarray, rho: float, rng: RngLike) -> np.ndarray:
    """Indices kept for an exponential long-tail profile (Cao et al. 2019; docs/algorithms/fedsc.md,
    Long-tailed profile).

    Class ``c`` (the ``c``-th class id in ascending order, of ``C``) keeps
    ``floor(n_max * rho^(-c / (C - 1)))`` random samples, so ``n_0 / n_{C-1} = rho``. ``n_max`` is the
    largest head size every class can afford (the class size itself on a balanced set). ``rho = 1``
    keeps everything.
    """
    rng = np.random.default_rng(rng)
    labels = np.asarray(labels)
    class_sizes = np.unique(labels, return_counts=True)[1]
    if rho == 1 or len(class_sizes) < 2:
        return np.arange(len(labels), dtype=np.int64)
    decay = float(rho) ** (-np.arange(len(class_sizes)) / (len(class_sizes) - 1))
    n_max = np.floor(np.min(class_sizes / decay) + 1e-9)
    keep = np.maximum(1, np.floor(n_max * decay + 1e-9)).astype(np.int64)
    order, rank, class_of = _class_order(labels, rng)
    return np.sort(order[rank < keep[class_of]]).astype(np.int64)


# ------------------------------------------------------------------------------------------ dispatch


def partition(
    labels: np.ndarray,
    cfg: PartitionConfig,
    num_clients: int,
    num_classes: int,
    seed: int,
) -> list[np.ndarray]:
    """Partition ``labels`` as ``cfg`` says; indices point into ``labels``.

    When ``cfg.long_tail_rho`` is set the pool is first thinned to the long-tail profile and only the
    kept samples are partitioned.
    """
    labels = np.asarray(labels)
    pool = np.arange(len(labels), dtype=np.int64)
    if cfg.long_tail_rho is not None:
        pool = long_tail(labels, cfg.long_tail_rho, numpy_rng("data/long_tail", seed))
    try:
        parts = partition_pool(labels[pool], cfg, num_clients, num_classes, numpy_rng("data/partition", seed))
    except TooFewSamples as err:  # too few samples for the clients: say what thinned the pool
        if len(pool) == len(labels):
            raise
        raise ConfigError(
            f"{err}, which data.partition.long_tail_rho={cfg.long_tail_rho:g} left of {len(labels)}"
        ) from None
    return [pool[p] for p in parts]


def partition_pool(
    sub: np.ndarray, cfg: PartitionConfig, num_clients: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if cfg.kind == "iid":
        parts = iid(sub, num_clients, rng)
    elif cfg.kind == "dirichlet":
        parts = dirichlet(sub, num_clients, cfg.alpha, cfg.min_samples, rng)
    elif cfg.kind == "shards":
        parts = shards(sub, num_clients, cfg.classes_per_client, rng)
    elif cfg.kind == "shamsian":
        parts = shamsian(sub, num_clients, cfg.classes_per_client, rng, num_classes=num_classes)
    elif cfg.kind == "file":
        raise ConfigError(
            "data.partition.kind=file is not a partitioner: build_federation reads the split file "
            "(data.partition.path)"
        )
    else:
        raise ConfigError(
            f"data.partition.kind={cfg.kind!r}: allowed values are iid, dirichlet, shards, shamsian, file"
        )
    return parts
