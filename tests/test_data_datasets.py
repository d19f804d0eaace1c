"""Dataset loaders, the decode cache and the pre-flight check, on tiny files made in tmp_path."""

from __future__ import annotations

import os
import pickle
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from fedray.platform.config import DataConfig, PartitionConfig
from fedray.platform.data import check_data, image_files
from fedray.platform.data.bundle import ArrayDataset, channel_stats, normalize
from fedray.platform.data.sources import SourceInfo, dataset_info, known_datasets, load_dataset
from fedray.platform.data.sources import digits as digits_source
from fedray.platform.data.sources.torchvision_sets import TorchvisionSet
from fedray.platform.errors import ConfigError

pytestmark = pytest.mark.usefixtures("isolated_home")  # from conftest


# ------------------------------------------------------------------------------------------ file makers


def write_idx(path: Path, array: np.ndarray) -> None:
    """MNIST's big-endian idx format: magic (type 0x08 = ubyte, ndim), then each dim, then the bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def make_mnist(root: Path, folder: str = "MNIST", n_train: int = 30, n_test: int = 10) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / folder / "raw" / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / folder / "raw" / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)


def make_cifar(root: Path, hundred: bool = False, per_batch: int = 6) -> None:
    """Pickled dicts as in the official python release (str keys, as Python 2 pickles decode)."""
    rng = np.random.default_rng(1)
    num_classes = 100 if hundred else 10
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    label_key = "fine_labels" if hundred else "labels"
    batches = ["train", "test"] if hundred else [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    for b, name in enumerate(batches):
        data = rng.integers(0, 256, (per_batch, 3 * 32 * 32), dtype=np.uint8)
        labels = [(b * per_batch + i) % num_classes for i in range(per_batch)]
        (folder / name).write_bytes(pickle.dumps({"data": data, label_key: labels}))
    meta_name, meta_key = ("meta", "fine_label_names") if hundred else ("batches.meta", "label_names")
    (folder / meta_name).write_bytes(pickle.dumps({meta_key: [f"class{c}" for c in range(num_classes)]}))


@pytest.fixture
def skip_cifar_md5(monkeypatch):
    """Our fake CIFAR files cannot match the official md5s: bypass torchvision's check in tests only."""
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)


COLORS = {"ant": (255, 0, 0), "bee": (0, 255, 0), "cow": (0, 0, 255)}


def make_imagefolder(root: Path, n_train: int = 3, n_test: int = 2, size: int = 6) -> None:
    """PNG files of a solid colour per class, plus a grayscale, an off-size and a JPEG image."""
    for split, n in (("train", n_train), ("test", n_test)):
        for cls, color in COLORS.items():
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (size, size), color).save(folder / f"{i:03d}.png")
    Image.new("L", (size, size), 128).save(root / "train" / "ant" / "gray.png")
    Image.new("RGB", (2 * size, 2 * size), COLORS["bee"]).save(root / "train" / "bee" / "big.png")
    Image.new("RGB", (size, size), COLORS["cow"]).save(root / "test" / "cow" / "photo.jpg", quality=95)
    (root / "train" / "cow" / "notes.txt").write_text("not an image")


# ------------------------------------------------------------------------------------------ embedded sets


def test_known_datasets():
    assert known_datasets() == [
        "cifar10",
        "cifar100",
        "digits",
        "fashion_mnist",
        "femnist",
        "flowers102",
        "imagefolder",
        "mnist",
        "sent140",
        "shakespeare",
        "synthetic",
        "tiny_imagenet",
    ]


def test_digits_reader_gives_scikit_learns_digits():
    """Checked against values of ``sklearn.datasets.load_digits()`` (importing it here costs seconds)."""
    images, labels = digits_source.digits_arrays()
    assert images.shape == (1797, 8, 8) and images.min() == 0 and images.max() == 16
    assert images.sum() == 561718
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert labels[:10].tolist() == list(range(10))
    assert images[0, 1].tolist() == [0, 0, 13, 15, 10, 15, 5, 0]


def test_digits_shapes_and_fixed_stratified_split():
    a, b = load_dataset(DataConfig(dataset="digits")), load_dataset(DataConfig(dataset="digits"))
    assert a.train.x.shape[1:] == (1, 8, 8) and a.train.x.dtype == torch.uint8
    assert a.train.y.dtype == torch.int64
    assert len(a.train) + len(a.test) == 1797
    assert len(a.test) == round(1797 * 0.2)
    assert (a.num_classes, a.in_channels, a.image_size) == (10, 1, 8)
    assert dataset_info(DataConfig()) == SourceInfo(10, in_channels=1, image_size=8)
    assert int(a.train.x.max()) == 255
    torch.testing.assert_close(a.test.x, b.test.x)  # the global test set never moves
    torch.testing.assert_close(a.train.y, b.train.y)
    test_share = np.bincount(a.test.y.numpy()) / np.bincount(np.concatenate([a.train.y, a.test.y]))
    assert np.abs(test_share - 0.2).max() < 0.02  # stratified


def test_synthetic_is_deterministic_and_learnable():
    cfg = DataConfig(dataset="synthetic", synthetic_samples=300, synthetic_classes=3, synthetic_image_size=5)
    a, b = load_dataset(cfg), load_dataset(cfg)
    assert a.train.x.shape == (240, 1, 5, 5) and a.test.x.shape == (60, 1, 5, 5)
    assert (a.num_classes, a.in_channels, a.image_size) == (3, 1, 5)
    assert dataset_info(cfg) == SourceInfo(3, in_channels=1, image_size=5)
    torch.testing.assert_close(a.train.x, b.train.x)
    torch.testing.assert_close(a.test.y, b.test.y)
    # nearest class mean already separates the classes: a small CNN will
    xtr, xte = a.train.x.flatten(1).float(), a.test.x.flatten(1).float()
    means = torch.stack([xtr[a.train.y == c].mean(0) for c in range(3)])
    accuracy = (torch.cdist(xte, means).argmin(1) == a.test.y).float().mean()
    assert accuracy > 0.9


def test_normalize_and_channel_stats():
    x = torch.tensor([0, 255, 255, 0], dtype=torch.uint8).view(1, 1, 2, 2).repeat(3, 2, 1, 1)
    mean, std = channel_stats(x)
    assert mean == pytest.approx((0.5, 0.5)) and std == pytest.approx((0.5, 0.5))
    out = normalize(x, mean, std)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() / 255 * 2 - 1)


def test_array_dataset_checks_types_and_subsets():
    ds = ArrayDataset(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.arange(4))
    assert len(ds.subset(np.array([3, 1]))) == 2
    assert ds.subset([3, 1]).y.tolist() == [3, 1]
    assert ArrayDataset(torch.zeros(4, 1, 2, 2), torch.arange(4)).x.dtype == torch.float32  # normalised
    with pytest.raises(ValueError, match="uint8 or float"):
        ArrayDataset(torch.zeros(4, 1, 2, 2, dtype=torch.int32), torch.arange(4))
    with pytest.raises(ValueError, match="int64"):
        ArrayDataset(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.arange(3))


# ------------------------------------------------------------------------------------------ torchvision


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_family_from_raw_idx_files(tmp_path, name, folder):
    make_mnist(tmp_path, folder)
    bundle = load_dataset(DataConfig(dataset=name, root=str(tmp_path)))
    assert bundle.train.x.shape == (30, 1, 28, 28) and bundle.test.x.shape == (10, 1, 28, 28)
    assert bundle.train.x.dtype == torch.uint8 and bundle.train.y.tolist() == [i % 10 for i in range(30)]
    raw = np.frombuffer((tmp_path / folder / "raw" / "train-images-idx3-ubyte").read_bytes()[16:], np.uint8)
    np.testing.assert_array_equal(bundle.train.x.numpy().ravel(), raw)
    assert len(bundle.class_names) == 10 == bundle.num_classes


def test_download_true_lets_torchvision_fetch_then_caches(tmp_path, monkeypatch):
    fetched = []

    def fake_download(self):  # stands in for the network: writes the files torchvision would fetch
        if not fetched:
            make_mnist(Path(self.root))
        fetched.append(self.root)

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fake_download)
    cfg = DataConfig(dataset="mnist", root=str(tmp_path), download=True)
    check_data(cfg)
    bundle = load_dataset(cfg)
    assert fetched and len(bundle.train) == 30
    assert len(list((tmp_path / ".fedray_cache").glob("mnist-*.pt"))) == 1


def test_runs_started_together_download_once_and_read_the_same_files(tmp_path, monkeypatch):
    """A sweep's trials load the data at the same moment: one fetches, the others wait for it and
    read its files, instead of fetching into the same files at once (torchvision truncates them)."""
    started = []
    second = threading.Event()

    def slow_download(self):  # the network: slow enough that a second fetch would start meanwhile
        if (Path(self.root) / "MNIST" / "raw").is_dir():
            return  # torchvision's own check: the files are there (the test split's constructor)
        started.append(self.root)
        if len(started) > 1:
            second.set()
        second.wait(timeout=3)
        make_mnist(Path(self.root))

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", slow_download)
    cfg = DataConfig(dataset="mnist", root=str(tmp_path), download=True)
    with ThreadPoolExecutor(3) as pool:
        bundles = list(pool.map(lambda _: load_dataset(cfg), range(3)))
    assert len(started) == 1  # one fetch; the later loads found its files
    assert all(torch.equal(b.train.x, bundles[0].train.x) for b in bundles) and len(bundles[0].train) == 30


def test_cifar10_from_pickled_batches_and_cached(tmp_path, skip_cifar_md5, monkeypatch):
    make_cifar(tmp_path)
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path))
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape == (30, 3, 32, 32) and bundle.test.x.shape == (6, 3, 32, 32)
    assert bundle.class_names[:2] == ["class0", "class1"]
    first = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes())
    np.testing.assert_array_equal(bundle.train.x[0].numpy().ravel(), first["data"][0])  # CHW order kept
    assert len(list((tmp_path / ".fedray_cache").glob("cifar10-*.pt"))) == 1

    def no_decode(*_args):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(TorchvisionSet, "decode", no_decode)
    again = load_dataset(cfg)
    torch.testing.assert_close(again.train.x, bundle.train.x)
    assert again.class_names == bundle.class_names


def test_cifar100_fine_labels(tmp_path, skip_cifar_md5):
    make_cifar(tmp_path, hundred=True)
    bundle = load_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)))
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (100, 3, 32)
    assert bundle.train.y.tolist() == list(range(6))


def test_corrupt_torchvision_files_give_a_config_error(tmp_path):
    make_cifar(tmp_path)  # md5s do not match and nothing bypasses the check here
    with pytest.raises(ConfigError, match=r"data\.root=.*cifar10"):
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)))


# ------------------------------------------------------------------------------------------ image folder


def test_imagefolder_decodes_sorted_rgb_and_hits_the_cache(tmp_path, monkeypatch):
    make_imagefolder(tmp_path)
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path))
    assert dataset_info(cfg) == SourceInfo(3, in_channels=3, image_size=6)
    bundle = load_dataset(cfg)
    assert bundle.class_names == ["ant", "bee", "cow"]
    assert bundle.train.x.shape == (11, 3, 6, 6) and bundle.test.x.shape == (7, 3, 6, 6)
    assert bundle.train.y.tolist() == [0] * 4 + [1] * 4 + [2] * 3
    # sorted order: ant/000..002, ant/gray; bee/000..002, bee/big (resized); cow/000..002
    assert bundle.train.x[0, :, 0, 0].tolist() == [255, 0, 0]
    assert bundle.train.x[3, :, 0, 0].tolist() == [128, 128, 128]  # grayscale -> RGB
    assert bundle.train.x[7, :, 0, 0].tolist() == [0, 255, 0]  # 12x12 resized to 6x6
    assert abs(int(bundle.test.x[-1, 2, 3, 3]) - 255) < 8  # the JPEG, lossy
    cache = list((tmp_path / ".fedray_cache").glob("imagefolder-*.pt"))
    assert len(cache) == 1

    def no_decode(*_args):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(image_files, "decode_files", no_decode)
    again = load_dataset(cfg)
    torch.testing.assert_close(again.train.x, bundle.train.x)
    torch.testing.assert_close(again.test.y, bundle.test.y)

    # a new file changes the fingerprint: the stale cache is not used
    Image.new("RGB", (6, 6), COLORS["ant"]).save(tmp_path / "train" / "ant" / "new.png")
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset(cfg)


def test_imagefolder_parallel_decode_matches_serial(tmp_path, monkeypatch):
    make_imagefolder(tmp_path, n_train=4)
    paths = sorted(str(p) for p in (tmp_path / "train").rglob("*.png"))
    serial = image_files.decode_files(paths, 6)
    monkeypatch.setattr(image_files, "PARALLEL_MIN_FILES", 0)
    monkeypatch.setattr(image_files.os, "cpu_count", lambda: 2)
    np.testing.assert_array_equal(image_files.decode_parallel(paths, 6), serial)


def noise_images(folder: Path, n: int, size: int = 6) -> list[str]:
    """Distinct random PNGs, so a decode that puts an image in the wrong row fails."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")
    return sorted(str(p) for p in folder.glob("*.png"))


def test_parallel_decode_forks_nothing_and_finishes_beside_busy_threads(tmp_path, monkeypatch):
    # a forked pool in a process that runs threads can deadlock on a lock a thread held at the fork
    paths = noise_images(tmp_path / "imgs", 37)
    serial = image_files.decode_files(paths, 6)
    monkeypatch.setattr(image_files, "PARALLEL_MIN_FILES", 0)
    monkeypatch.setattr(image_files.os, "cpu_count", lambda: 4)

    def no_fork():
        raise AssertionError("image decoding forked a process")

    monkeypatch.setattr(os, "fork", no_fork)
    stop = threading.Event()
    lock = threading.Lock()

    def busy():  # torch's intra-op threads and a lock taken over and over, as in a training process
        a = torch.randn(64, 64)
        while not stop.is_set():
            with lock:
                a = torch.tanh(a @ a)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with ThreadPoolExecutor(1) as runner:  # a hang fails the test instead of stopping the suite
            decoded = runner.submit(image_files.decode_parallel, paths, 6).result(timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join()
    np.testing.assert_array_equal(decoded, serial)


def test_an_unreadable_image_is_named(tmp_path, monkeypatch):
    paths = noise_images(tmp_path / "imgs", 12)
    Path(paths[7]).write_bytes(Path(paths[7]).read_bytes()[:40])  # truncated
    monkeypatch.setattr(image_files, "PARALLEL_MIN_FILES", 0)
    monkeypatch.setattr(image_files.os, "cpu_count", lambda: 2)
    for decode in (image_files.decode_files, image_files.decode_parallel):
        with pytest.raises(ConfigError, match=r"007\.png: not a readable image") as info:
            decode(paths, 6)
        assert "\n" not in str(info.value)


def test_cache_falls_back_to_home_when_root_cache_is_not_writable(tmp_path, isolated_home):
    make_imagefolder(tmp_path / "data")
    (tmp_path / "data" / ".fedray_cache").write_text("a file where the cache folder should be")
    load_dataset(DataConfig(dataset="imagefolder", root=str(tmp_path / "data")))
    assert len(list((isolated_home / ".cache" / "fedray").rglob("imagefolder-*.pt"))) == 1


# ------------------------------------------------------------------------------------------ pre-flight


def config_error(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_check_data_missing_torchvision_files(tmp_path):
    message = config_error(DataConfig(dataset="mnist"))  # no root, nothing in the default place
    assert "data.root" in message and "data.download=true" in message
    message = config_error(DataConfig(dataset="cifar10", root=str(tmp_path / "nowhere")))
    assert "data.root=" in message and "nowhere" in message
    check_data(DataConfig(dataset="cifar100", root=str(tmp_path), download=True))  # will download: fine


def test_check_data_passes_on_present_files_without_decoding(tmp_path, monkeypatch):
    make_mnist(tmp_path)
    make_imagefolder(tmp_path / "folder")

    def no_decode(*args, **kwargs):
        raise AssertionError("check_data must not decode images")

    monkeypatch.setattr(image_files, "decode_files", no_decode)
    monkeypatch.setattr(TorchvisionSet, "decode", no_decode)
    check_data(DataConfig(dataset="mnist", root=str(tmp_path), num_clients=5))
    iid = PartitionConfig(kind="iid")
    folder = str(tmp_path / "folder")
    check_data(DataConfig(dataset="imagefolder", root=folder, num_clients=11, partition=iid))
    message = config_error(DataConfig(dataset="imagefolder", root=folder, num_clients=12, partition=iid))
    assert "data.num_clients=12" in message and "11 training samples" in message


def test_check_data_classes_per_client_above_num_classes():
    for kind in ("shards", "shamsian"):
        cfg = DataConfig(partition=PartitionConfig(kind=kind, classes_per_client=11))
        assert "data.partition.classes_per_client=11" in config_error(cfg)
    check_data(DataConfig(partition=PartitionConfig(kind="dirichlet", classes_per_client=11)))  # unused there


def test_check_data_imagefolder_layout(tmp_path):
    assert "data.root" in config_error(DataConfig(dataset="imagefolder"))
    (tmp_path / "test" / "ant").mkdir(parents=True)
    assert "train/" in config_error(DataConfig(dataset="imagefolder", root=str(tmp_path)))


def test_check_data_other_errors():
    assert "data.dataset='nope'" in config_error(DataConfig(dataset="nope"))
    assert "data.num_clients=5000" in config_error(DataConfig(num_clients=5000))
    assert "data.partition.kind=file" in config_error(
        DataConfig(partition=PartitionConfig(kind="file", path="split.json"))
    )
    assert "data.partition.min_samples=200" in config_error(
        DataConfig(partition=PartitionConfig(kind="dirichlet", min_samples=200))
    )
