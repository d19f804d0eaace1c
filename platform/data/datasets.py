"""Dataset registry: load any supported dataset as uint8 image tensors plus int64 labels.

Every dataset comes back as a :class:`DatasetBundle` with the same shape of data, so the partitioners,
the federation builder and the models never care where images came from:

- ``digits``: scikit-learn's embedded 8x8 digits (1797 images, no download). It has no official test
  split, so a fixed stratified 80/20 split (seed 0, independent of the experiment seed) makes one; the
  global test set is then the same for every run.
- ``synthetic``: class prototypes plus Gaussian noise, 1 channel, built from a fixed seed. Tiny, fast
  and learnable in a few epochs: the fixture of the platform's tests.
- ``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: torchvision's own dataset classes, read once
  and converted array-to-tensor (no per-image PIL transform).
- ``imagefolder``: ``root/train/<class>/*.jpg|png`` and ``root/test/<class>/...``; images are decoded
  with PIL to RGB (always 3 channels) in sorted order, in a process pool when there are many.
  Every image is resized to the size of the first training image when it differs (bilinear).

Decoded torchvision and image-folder datasets are cached with ``torch.save`` under
``<root>/.fedray_cache/<name>-<fingerprint>.pt`` (or ``~/.cache/fedray/<root-hash>/`` when the root is
read-only). The fingerprint hashes the source files' relative paths, sizes and modification times, so
editing, adding or removing a file invalidates the cache.

Sample ids. Every sample of a dataset has a fixed integer id, the order :func:`load_dataset` produces
(deterministic): id ``i < len(bundle.train)`` is official-train sample ``i``, id ``len(bundle.train) + j``
is official-test sample ``j``. Image folders list each split class by class (classes and file names
sorted), and their bundle also carries ``paths``: the relative path (``train/<class>/<file>``, ``/``
separated) of every sample in id order. Split files (:mod:`fedray.platform.data.split_file`) and the
federation's shards refer to samples by these ids.

Images stay uint8 everywhere (a quarter of the memory of float32, cheap to ship through Ray);
:func:`normalize` turns a batch into float32 with the bundle's per-channel mean and std.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.config import DataConfig
from fedray.platform.data.partition import stratified_split
from fedray.platform.errors import ConfigError, first_line

CACHE_VERSION = 1  # bump when the cache layout changes: old files are then ignored
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_TEST_FRACTION = 0.2
SYNTHETIC_SEED = 20240611  # fixed: the synthetic set is the same for every experiment seed
SYNTHETIC_NOISE_STD = 48.0  # pixel noise around the class prototype (0..255 scale)
_PARALLEL_MIN_FILES = 4096  # below this many images, threads cost more than they save


# ------------------------------------------------------------------------------------------ containers


@dataclass
class ArrayDataset:
    """Images and labels held in memory: ``x`` ``[N, C, H, W]``, ``y`` int64 ``[N]``.

    The loaders always store ``x`` as uint8; a client holds float32 images once :func:`normalize`d.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dim() != 4 or not (self.x.dtype == torch.uint8 or self.x.is_floating_point()):
            raise ValueError(
                f"x must be uint8 or float [N, C, H, W], got {self.x.dtype} {tuple(self.x.shape)}"
            )
        if self.y.dtype != torch.int64 or self.y.dim() != 1 or len(self.y) != len(self.x):
            raise ValueError(f"y must be int64 [N={len(self.x)}], got {self.y.dtype} {tuple(self.y.shape)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray | Sequence[int] | torch.Tensor) -> ArrayDataset:
        """A copy holding the samples at ``idx`` (in that order)."""
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ArrayDataset(self.x[index], self.y[index])


@dataclass
class DatasetBundle:
    """A dataset ready to partition: the train pool, the official test split and its metadata."""

    name: str
    train: ArrayDataset
    test: ArrayDataset  # the official test split: the global test pool
    num_classes: int
    in_channels: int
    image_size: int  # H == W
    mean: tuple[float, ...]  # per channel, in [0, 1] units
    std: tuple[float, ...]
    class_names: list[str] = field(default_factory=list)
    # image folders: each sample's path relative to data.root, train then test (the sample-id order)
    paths: list[str] | None = None

    @property
    def num_samples(self) -> int:
        """Train plus test: the size of the sample-id space."""
        return len(self.train) + len(self.test)

    def labels(self) -> np.ndarray:
        """Labels of all samples in id order (train then test)."""
        return np.concatenate([self.train.y.numpy(), self.test.y.numpy()])

    def take(self, ids: np.ndarray | Sequence[int]) -> ArrayDataset:
        """The samples with these ids (train then test, see the module docstring), in that order."""
        ids = np.asarray(ids, dtype=np.int64)
        n_train = len(self.train)
        in_test = ids >= n_train
        if not in_test.any():
            return self.train.subset(ids)
        if in_test.all():
            return self.test.subset(ids - n_train)
        x = torch.empty((len(ids), *self.train.x.shape[1:]), dtype=self.train.x.dtype)
        y = torch.empty(len(ids), dtype=torch.int64)
        for mask, part, offset in ((~in_test, self.train, 0), (in_test, self.test, n_train)):
            where = torch.from_numpy(np.flatnonzero(mask))
            index = torch.from_numpy(ids[mask] - offset)
            x[where], y[where] = part.x[index], part.y[index]
        return ArrayDataset(x, y)


# ------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class _TorchvisionSpec:
    cls_name: str  # class in torchvision.datasets
    num_classes: int
    in_channels: int
    image_size: int
    train_size: int  # official sizes, for the cheap pre-flight check
    test_size: int


_TORCHVISION = {
    "mnist": _TorchvisionSpec("MNIST", 10, 1, 28, 60000, 10000),
    "fashion_mnist": _TorchvisionSpec("FashionMNIST", 10, 1, 28, 60000, 10000),
    "cifar10": _TorchvisionSpec("CIFAR10", 10, 3, 32, 50000, 10000),
    "cifar100": _TorchvisionSpec("CIFAR100", 100, 3, 32, 50000, 10000),
}
_DIGITS_SIZE = 1797


def known_datasets() -> list[str]:
    return ["digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "imagefolder"]


def default_root() -> Path:
    """Where torchvision sets live when ``data.root`` is not set."""
    return Path.home() / ".cache" / "fedray" / "data"


def _root(cfg: DataConfig) -> Path:
    return Path(cfg.root).expanduser() if cfg.root else default_root()


def _split_size(n: int, fraction: float) -> int:
    """Samples a split of ``fraction`` gets out of ``n`` (round half up, as the splitter does)."""
    return int(np.floor(n * fraction + 0.5))


def dataset_info(cfg: DataConfig) -> tuple[int, int, int]:
    """``(num_classes, in_channels, image_size)`` without loading any data."""
    if cfg.dataset == "digits":
        return 10, 1, 8
    if cfg.dataset == "synthetic":
        return cfg.synthetic_classes, 1, cfg.synthetic_image_size
    if cfg.dataset in _TORCHVISION:
        spec = _TORCHVISION[cfg.dataset]
        return spec.num_classes, spec.in_channels, spec.image_size
    if cfg.dataset == "imagefolder":
        train_dir = _imagefolder_dirs(cfg)[0]
        classes = _class_dirs(train_dir)
        return len(classes), 3, _imagefolder_image_size(train_dir, classes)
    raise unknown_dataset(cfg.dataset)


# ------------------------------------------------------------------------------------------ pre-flight


def unknown_dataset(name: str) -> ConfigError:
    return ConfigError(f"data.dataset={name!r}: unknown dataset; known: {', '.join(known_datasets())}")


def _check_source(cfg: DataConfig) -> None:
    """The dataset is known and its files are where the config says (or will be downloaded)."""
    if cfg.dataset not in known_datasets():
        raise unknown_dataset(cfg.dataset)
    if cfg.dataset == "synthetic":
        if cfg.synthetic_classes < 1:
            raise ConfigError(f"data.synthetic_classes={cfg.synthetic_classes}: must be >= 1")
        if cfg.synthetic_image_size < 1:
            raise ConfigError(f"data.synthetic_image_size={cfg.synthetic_image_size}: must be >= 1")
        if cfg.synthetic_samples < 2 * cfg.synthetic_classes:
            raise ConfigError(
                f"data.synthetic_samples={cfg.synthetic_samples}: need at least 2 per class "
                f"(data.synthetic_classes={cfg.synthetic_classes})"
            )
    elif cfg.dataset in _TORCHVISION and not cfg.download and _torchvision_files(cfg) is None:
        root = _root(cfg)
        where = f"data.root={cfg.root!r}" if cfg.root else f"data.root is not set (looked in {root})"
        raise ConfigError(
            f"{where}: the {cfg.dataset} files are not there; set data.root=<dir holding them> "
            "or data.download=true"
        )
    elif cfg.dataset == "imagefolder":
        train_dir, test_dir = _imagefolder_dirs(cfg)
        train_classes, test_classes = _class_dirs(train_dir), _class_dirs(test_dir)
        extra = sorted(set(test_classes) - set(train_classes))
        if extra:
            raise ConfigError(
                f"data.root={cfg.root!r}: test/ has classes that train/ lacks: {', '.join(extra[:5])}"
            )


def official_sizes(cfg: DataConfig) -> tuple[int, int]:
    """``(train, test)`` sizes from metadata only (official sizes for torchvision sets)."""
    if cfg.dataset == "digits":
        test = _split_size(_DIGITS_SIZE, DIGITS_TEST_FRACTION)
        return _DIGITS_SIZE - test, test
    if cfg.dataset == "synthetic":
        test = _split_size(cfg.synthetic_samples, SYNTHETIC_TEST_FRACTION)
        return cfg.synthetic_samples - test, test
    if cfg.dataset in _TORCHVISION:
        spec = _TORCHVISION[cfg.dataset]
        return spec.train_size, spec.test_size
    train_dir, test_dir = _imagefolder_dirs(cfg)
    n_train, n_test = (
        sum(len(_image_files(str(d / c))) for c in _class_dirs(d)) for d in (train_dir, test_dir)
    )
    return n_train, n_test


def _pool_size(cfg: DataConfig) -> int:
    """Size of the pool the partitioner splits: the train set, or train + test for ``merged``."""
    n_train, n_test = official_sizes(cfg)
    return n_train + n_test if cfg.split.convention == "merged" else n_train


def check_source_and_partition(cfg: DataConfig) -> None:
    """Cheap pre-flight of the dataset and fedray's own partitioners (no image is decoded); a split
    file is checked by :func:`fedray.platform.data.federation.check_data`."""
    _check_source(cfg)
    p = cfg.partition
    if p.kind == "file":
        return
    num_classes = dataset_info(cfg)[0]
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
    n_pool = _pool_size(cfg)
    pool = "train + test samples" if cfg.split.convention == "merged" else "training samples"
    if cfg.num_clients > n_pool:
        raise ConfigError(
            f"data.num_clients={cfg.num_clients}: more clients than the {n_pool} {pool} of {cfg.dataset}"
        )
    if p.kind == "dirichlet" and p.min_samples * cfg.num_clients > n_pool:
        raise ConfigError(
            f"data.partition.min_samples={p.min_samples}: {cfg.num_clients} clients x {p.min_samples} "
            f"exceeds the {n_pool} {pool} of {cfg.dataset}"
        )


# ------------------------------------------------------------------------------------------ loading


def load_dataset(cfg: DataConfig) -> DatasetBundle:
    """Load (or read from cache) the dataset named by ``cfg.dataset``."""
    _check_source(cfg)
    if cfg.dataset == "digits":
        return _load_digits()
    if cfg.dataset == "synthetic":
        return _load_synthetic(cfg.synthetic_samples, cfg.synthetic_classes, cfg.synthetic_image_size)
    if cfg.dataset in _TORCHVISION:
        return _load_torchvision(cfg)
    return _load_imagefolder(cfg)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 images ``[..., C, H, W]`` -> float32 ``(x / 255 - mean) / std`` per channel."""
    m = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (x.to(torch.float32) / 255.0 - m) / s


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std in [0, 1] units of uint8 images ``[N, C, H, W]``.

    Works from a 256-bin histogram per channel, so it is exact in float64 without materialising a
    float copy of the dataset (150M values for CIFAR).
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = torch.bincount(x[:, c].reshape(-1), minlength=256).numpy().astype(np.float64)
        total = max(hist.sum(), 1.0)
        mean = float(hist @ values / total)
        var = float(hist @ (values - mean) ** 2 / total)
        means.append(mean)
        stds.append(float(np.sqrt(var)) if var > 0 else 1.0)  # a constant channel: leave it unscaled
    return tuple(means), tuple(stds)


def _bundle(
    name: str,
    train: ArrayDataset,
    test: ArrayDataset,
    num_classes: int,
    class_names: list[str],
) -> DatasetBundle:
    mean, std = channel_stats(train.x)
    return DatasetBundle(
        name=name,
        train=train,
        test=test,
        num_classes=num_classes,
        in_channels=train.x.shape[1],
        image_size=train.x.shape[2],
        mean=mean,
        std=std,
        class_names=class_names,
    )


def _fixed_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[ArrayDataset, ...]:
    """Stratified train/test split with its own fixed seed (not the experiment's)."""

    train_idx, test_idx = stratified_split(y, (1 - test_fraction, test_fraction), np.random.default_rng(seed))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    return ArrayDataset(xt[train_idx], yt[train_idx]), ArrayDataset(xt[test_idx], yt[test_idx])


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(images [1797, 8, 8] in 0..16, labels)``.

    Reads the CSV that ships inside scikit-learn directly: ``import sklearn.datasets`` pulls in SciPy and
    costs seconds, the file takes milliseconds. Falls back to ``load_digits`` if the file moved.
    """
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec else []
    csv = [Path(loc) / "datasets" / "data" / "digits.csv.gz" for loc in locations]
    if csv and csv[0].is_file():
        table = np.loadtxt(csv[0], delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def _load_digits() -> DatasetBundle:
    images, labels = _digits_arrays()
    # pixel values are 0..16: stretch them to the usual 0..255 range
    x = np.rint(images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    train, test = _fixed_split(x, labels, DIGITS_TEST_FRACTION, seed=0)
    return _bundle("digits", train, test, 10, [str(d) for d in range(10)])


def synthetic_arrays(num_samples: int, num_classes: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced labels and images = class prototype (uniform noise image) + N(0, 48^2), clipped to uint8."""
    rng = np.random.default_rng(SYNTHETIC_SEED)
    prototypes = rng.uniform(0, 255, size=(num_classes, 1, image_size, image_size))
    y = rng.permutation(np.arange(num_samples) % num_classes)
    noise = rng.normal(0.0, SYNTHETIC_NOISE_STD, size=(num_samples, 1, image_size, image_size))
    x = np.clip(np.rint(prototypes[y] + noise), 0, 255).astype(np.uint8)
    return x, y.astype(np.int64)


def _load_synthetic(num_samples: int, num_classes: int, image_size: int) -> DatasetBundle:
    x, y = synthetic_arrays(num_samples, num_classes, image_size)
    train, test = _fixed_split(x, y, SYNTHETIC_TEST_FRACTION, seed=SYNTHETIC_SEED)
    return _bundle("synthetic", train, test, num_classes, [f"class_{c}" for c in range(num_classes)])


# ------------------------------------------------------------------------------------------ cache


def _fingerprint(root: Path, files: Sequence[str | Path]) -> str:
    """Hash of the files' relative paths, sizes and mtimes: changes whenever the contents change.

    Plain strings and ``os.stat``: pathlib costs seconds on 60k files.
    """
    h = hashlib.sha1(f"fedray-cache-v{CACHE_VERSION}\n".encode())
    for path in sorted(map(str, files)):
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, root)}\t{st.st_size}\t{int(st.st_mtime)}\n".encode())
    return h.hexdigest()[:16]


def _cache_candidates(root: Path, name: str, fingerprint: str) -> list[Path]:
    """Preferred cache file under the root, then the per-user fallback for read-only roots."""
    filename = f"{name}-{fingerprint}.pt"
    root_key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    return [
        root / ".fedray_cache" / filename,
        Path.home() / ".cache" / "fedray" / root_key / filename,
    ]


def _read_cache(paths: Sequence[Path]) -> dict[str, Any] | None:
    for path in paths:
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception as err:  # a truncated or foreign file: decode again and overwrite it
                warnings.warn(f"ignoring unreadable dataset cache {path}: {err}", stacklevel=2)
    return None


def _write_cache(paths: Sequence[Path], payload: dict[str, Any]) -> Path | None:
    """Write atomically (temp file + rename) to the first writable location."""
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    torch.save(payload, fh)
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; others may read the same dataset root
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return path
        except OSError:
            continue
    warnings.warn(f"could not write a dataset cache to any of {[str(p) for p in paths]}", stacklevel=2)
    return None


def _cached(
    root: Path, name: str, files: Sequence[str | Path], decode: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Return the cached arrays for these source files, decoding (and caching) them on a miss."""
    candidates = _cache_candidates(root, name, _fingerprint(root, files))
    payload = _read_cache(candidates)
    if payload is None:
        payload = decode()
        _write_cache(candidates, payload)
    return payload


def _bundle_from_payload(name: str, payload: dict[str, Any], paths: list[str] | None = None) -> DatasetBundle:
    """The bundle of a decoded (or cached) payload; ``paths`` is the fallback for caches without them."""
    train = ArrayDataset(payload["train_x"], payload["train_y"])
    test = ArrayDataset(payload["test_x"], payload["test_y"])
    class_names = list(payload["class_names"])
    bundle = _bundle(name, train, test, len(class_names), class_names)
    if "train_paths" in payload:
        paths = [*payload["train_paths"], *payload["test_paths"]]
    if paths is not None and len(paths) != bundle.num_samples:
        raise ValueError(f"{len(paths)} sample paths for {bundle.num_samples} samples")
    bundle.paths = paths
    return bundle


# ------------------------------------------------------------------------------------------ torchvision


def _torchvision_files(cfg: DataConfig) -> list[Path] | None:
    """The files torchvision would read for this dataset under the root, or None if any is missing."""
    import torchvision.datasets as tvd

    root = _root(cfg)
    cls = getattr(tvd, _TORCHVISION[cfg.dataset].cls_name)
    if issubclass(cls, tvd.CIFAR10):
        folder = root / cls.base_folder
        names = [n for n, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        candidates = [[folder / n for n in names]]
    else:  # MNIST family: torchvision's legacy processed tensors win over the raw idx files
        base = root / cls.__name__
        legacy = [base / "processed" / cls.training_file, base / "processed" / cls.test_file]
        raw = [base / "raw" / Path(url).stem for url, _ in cls.resources]
        candidates = [legacy, raw]
    for files in candidates:
        if all(f.is_file() for f in files):
            return files
    return None


def _torchvision_decode(cfg: DataConfig) -> dict[str, Any]:
    import torchvision.datasets as tvd

    cls = getattr(tvd, _TORCHVISION[cfg.dataset].cls_name)
    out: dict[str, Any] = {}
    for split, train in (("train", True), ("test", False)):
        try:
            ds = cls(root=str(_root(cfg)), train=train, download=cfg.download)
        except (RuntimeError, OSError) as err:  # corrupt files, or a failed download
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"data.root={cfg.root!r}: torchvision could not read {cfg.dataset} ({message}); "
                "fix the files or set data.download=true"
            ) from err
        x = torch.as_tensor(np.asarray(ds.data))
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # MNIST [N,H,W]; CIFAR [N,H,W,C]
        out[f"{split}_x"] = x.to(torch.uint8).contiguous()
        out[f"{split}_y"] = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
        out["class_names"] = [str(c) for c in ds.classes]
    return out


def _load_torchvision(cfg: DataConfig) -> DatasetBundle:
    root = _root(cfg)
    files = _torchvision_files(cfg)
    fresh = None
    if files is None:  # download=true (checked): torchvision fetches the files, then we fingerprint them
        fresh = _torchvision_decode(cfg)
        files = _torchvision_files(cfg)
        if files is None:
            raise ConfigError(f"data.root={cfg.root!r}: {cfg.dataset} download left no readable files")
    payload = _cached(root, cfg.dataset, files, lambda: fresh or _torchvision_decode(cfg))
    return _bundle_from_payload(cfg.dataset, payload)


# ------------------------------------------------------------------------------------------ image folder


def _imagefolder_dirs(cfg: DataConfig) -> tuple[Path, Path]:
    if not cfg.root:
        raise ConfigError(
            "data.root is not set: data.dataset=imagefolder needs data.root=<dir with train/ and test/>"
        )
    root = Path(cfg.root).expanduser()
    train_dir, test_dir = root / "train", root / "test"
    for d in (train_dir, test_dir):
        if not d.is_dir() or not _class_dirs(d):
            raise ConfigError(
                f"data.root={cfg.root!r}: imagefolder needs {d.name}/<class>/<images> under the root "
                f"({d} has no class folders)"
            )
    return train_dir, test_dir


def _class_dirs(split_dir: Path) -> list[str]:
    """Sorted class folder names (hidden folders skipped): the class index is the position here."""
    if not split_dir.is_dir():
        return []
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def _image_files(class_dir: str) -> list[str]:
    """Sorted image file paths of one class folder (hidden files and other extensions skipped)."""
    names = sorted(
        e.name
        for e in os.scandir(class_dir)
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.name.startswith(".")
    )
    return [os.path.join(class_dir, n) for n in names]


def _imagefolder_image_size(train_dir: Path, classes: Sequence[str]) -> int:
    """Side length of the first training image (PIL reads only the header)."""
    from PIL import Image

    for c in classes:
        files = _image_files(str(train_dir / c))
        if files:
            with Image.open(files[0]) as im:
                return int(im.size[0])
    raise ConfigError(f"data.root={str(train_dir.parent)!r}: train/ holds no images")


def _decode_files(paths: Sequence[str], size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode images to RGB uint8 ``[n, size, size, 3]``, resizing any that differ. A file that will
    not decode is a ConfigError naming it."""
    from PIL import Image

    out = np.empty((len(paths), size, size, 3), dtype=np.uint8) if out is None else out
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                rgb = im.convert("RGB")
                if rgb.size != (size, size):
                    rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
                out[i] = np.asarray(rgb)
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for a truncated or foreign file
            raise ConfigError(f"{path}: not a readable image ({first_line(e)})") from e
    return out


def _decode_parallel(paths: Sequence[str], size: int) -> np.ndarray:
    """Decode on a few threads, each filling its own slice of one array. Threads, not processes: PIL
    releases the GIL while it decodes and resizes, and a forked process pool can deadlock in a process
    that already runs threads (torch's, Ray's, MLflow's)."""
    workers = min(8, os.cpu_count() or 1)
    if len(paths) < _PARALLEL_MIN_FILES or workers < 2:
        return _decode_files(paths, size)
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    bounds = np.linspace(0, len(paths), workers * 4 + 1).astype(int)
    with ThreadPoolExecutor(workers, thread_name_prefix="fedray-decode") as pool:
        jobs = [
            pool.submit(_decode_files, paths[a:b], size, out[a:b])
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        for job in jobs:  # the first failure, in file order; the pool's exit waits for the others
            job.result()
    return out


def _imagefolder_listing(split_dir: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Image paths of a split in decode (and cache) order, sorted by class then name, and their labels."""
    index = {c: i for i, c in enumerate(classes)}
    paths: list[str] = []
    labels: list[int] = []
    for c in _class_dirs(split_dir):
        files = _image_files(str(split_dir / c))
        paths += files
        labels += [index[c]] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def _relative_paths(paths: Sequence[str], root: Path) -> list[str]:
    """``/``-separated paths relative to ``root`` (``train/<class>/<file>``): the samples' names."""
    return [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]


def _imagefolder_decode(
    listing: dict[str, tuple[list[str], np.ndarray]], classes: list[str], size: int, root: Path
) -> dict[str, Any]:
    out: dict[str, Any] = {"class_names": classes}
    for split, (paths, labels) in listing.items():
        x = _decode_parallel(paths, size)
        out[f"{split}_x"] = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
        out[f"{split}_y"] = torch.from_numpy(labels)
        out[f"{split}_paths"] = _relative_paths(paths, root)
    return out


def imagefolder_paths(cfg: DataConfig) -> list[str]:
    """Relative paths of an image folder's samples in id order (train then test), from the listing only."""
    train_dir, test_dir = _imagefolder_dirs(cfg)
    classes = _class_dirs(train_dir)
    files = _imagefolder_listing(train_dir, classes)[0] + _imagefolder_listing(test_dir, classes)[0]
    return _relative_paths(files, train_dir.parent)


def _load_imagefolder(cfg: DataConfig) -> DatasetBundle:
    train_dir, test_dir = _imagefolder_dirs(cfg)
    classes = _class_dirs(train_dir)
    listing = {
        "train": _imagefolder_listing(train_dir, classes),
        "test": _imagefolder_listing(test_dir, classes),
    }
    if not listing["train"][0]:
        raise ConfigError(f"data.root={cfg.root!r}: train/ holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    size = _imagefolder_image_size(train_dir, classes)
    files = listing["train"][0] + listing["test"][0]
    root = train_dir.parent
    payload = _cached(root, "imagefolder", files, lambda: _imagefolder_decode(listing, classes, size, root))
    # caches written before paths were stored get them from the listing (the same files, same order)
    return _bundle_from_payload("imagefolder", payload, _relative_paths(files, root))
