"""Flowers102, Tiny-ImageNet and data.image_size, on their on-disk formats generated in tmp_path
(tests/image_source_files.py: real .mat files, JPEGs and annotation text)."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
import torch.nn.functional as F
import torchvision
from image_source_files import (
    class_colour,
    flowers102_labels,
    flowers102_splits,
    solid_jpeg,
    tiny_imagenet_val,
    tiny_imagenet_wnids,
    write_flowers102,
    write_mnist,
    write_tiny_imagenet,
)
from PIL import Image

from fedray.platform.config import DataConfig, PartitionConfig, SplitConfig
from fedray.platform.data import build_federation, check_data, image_files
from fedray.platform.data import bundle as bundle_module
from fedray.platform.data.bundle import ArrayDataset, at_image_size, channel_stats, make_bundle, resize_images
from fedray.platform.data.sources import (
    Source,
    SourceInfo,
    check_source,
    dataset_info,
    load_dataset,
    official_sizes,
)
from fedray.platform.data.sources import base as sources_base
from fedray.platform.errors import ConfigError

pytestmark = pytest.mark.usefixtures("isolated_home")  # from conftest


def no_decode(*_args, **_kwargs):
    raise AssertionError("decoded again instead of reading the cache")


@pytest.fixture
def count_decodes(monkeypatch):
    """How many images were decoded since the fixture started (the real decoder still runs)."""
    decoded: list[int] = []
    real = image_files.decode_files

    def counting(paths, size, out=None):
        decoded.append(len(paths))
        return real(paths, size, out)

    monkeypatch.setattr(image_files, "decode_files", counting)
    return decoded


def config_error(cfg: DataConfig) -> str:
    """check_data's one-line ConfigError; load_dataset raises the same one."""
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    message = str(info.value)
    assert "\n" not in message
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_dataset(cfg)
    return message


def assert_colour(image: torch.Tensor, colour: tuple[int, int, int], tolerance: int = 8) -> None:
    """Every pixel of a solid-colour image (a JPEG: within a few units) is ``colour``."""
    diff = (image.to(torch.int64) - torch.tensor(colour).view(3, 1, 1)).abs()
    assert int(diff.max()) <= tolerance, (image[:, 0, 0].tolist(), colour)


def cache_files(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / ".fedray_cache").glob("*.pt"))


# ------------------------------------------------------------------------------------------ Flowers102


def flowers_cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(dataset="flowers102", root=str(root), **kw)


def test_flowers102_reads_labels_splits_and_pixels(tmp_path):
    base = write_flowers102(tmp_path, classes=4, per_class=5)
    labels, splits = flowers102_labels(4, 5), flowers102_splits(4, 5)
    cfg = flowers_cfg(tmp_path)  # the folder holding flowers-102/, as torchvision's root
    assert dataset_info(cfg) == SourceInfo(4, in_channels=3, image_size=64)  # FedL2G's 64 by default
    assert official_sizes(cfg) == (8, 12)  # train + val, test
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape == (8, 3, 64, 64) and bundle.test.x.shape == (12, 3, 64, 64)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (4, 3, 64)
    # official train = trnid then valid, test = tstid, each in the file's order; labels 1-based on disk
    train_ids = np.concatenate([splits["trnid"], splits["valid"]]).astype(int)
    assert bundle.train.y.tolist() == (labels[train_ids - 1].astype(int) - 1).tolist()
    assert bundle.test.y.tolist() == (labels[splits["tstid"].astype(int) - 1].astype(int) - 1).tolist()
    assert sorted(bundle.labels().tolist()) == sorted((labels.astype(int) - 1).tolist())
    # the first train sample is image trnid[0]: its pixels are its class's colour, 40x30 stretched
    for part in (bundle.train, bundle.test):
        for image, label in zip(part.x, part.y):
            assert_colour(image, class_colour(int(label)))
    names = getattr(torchvision.datasets.Flowers102, "classes", None)
    expected = list(names[:4]) if names else ["0", "1", "2", "3"]
    assert bundle.class_names == expected
    # data.root may name flowers-102/ itself: the same files, the same cache
    same = load_dataset(flowers_cfg(base))
    torch.testing.assert_close(same.train.x, bundle.train.x)
    assert [n.rsplit("-", 1)[0] for n in cache_files(base)] == ["flowers102-64"]


def test_flowers102_image_size_is_the_decoded_side_and_in_the_cache_key(tmp_path, count_decodes):
    base = write_flowers102(tmp_path, classes=3, per_class=4)
    load_dataset(flowers_cfg(tmp_path))
    cfg = flowers_cfg(tmp_path, image_size=16)
    assert dataset_info(cfg).image_size == 16
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape[1:] == (3, 16, 16) and bundle.image_size == 16
    assert_colour(bundle.test.x[0], class_colour(int(bundle.test.y[0])))
    assert sum(count_decodes) == 2 * 12  # each size decoded the 12 images once
    names = cache_files(base)
    assert [n.rsplit("-", 1)[0] for n in names] == ["flowers102-16", "flowers102-64"]


def test_flowers102_sizes_and_check_read_no_image(tmp_path, monkeypatch):
    base = write_flowers102(tmp_path, classes=4, per_class=6)
    monkeypatch.setattr(image_files, "decode_files", no_decode)
    cfg = flowers_cfg(tmp_path, num_clients=4, partition=PartitionConfig(kind="iid"))
    assert official_sizes(cfg) == (8, 16)
    assert dataset_info(cfg).num_classes == 4
    check_data(cfg)
    # sizes come from the .mat files alone: the images are not even listed
    for jpg in (base / "jpg").iterdir():
        jpg.unlink()
    (base / "jpg").rmdir()
    assert official_sizes(cfg) == (8, 16)


def test_flowers102_cache_hit_and_invalidation(tmp_path, monkeypatch):
    base = write_flowers102(tmp_path)
    cfg = flowers_cfg(tmp_path)
    bundle = load_dataset(cfg)
    monkeypatch.setattr(image_files, "decode_files", no_decode)
    again = load_dataset(cfg)  # decodes nothing
    torch.testing.assert_close(again.train.x, bundle.train.x)
    torch.testing.assert_close(again.test.y, bundle.test.y)
    assert again.class_names == bundle.class_names
    # a changed image (new size, new mtime) is a new fingerprint: decoded again
    image = base / "jpg" / "image_00003.jpg"
    solid_jpeg(image, (0, 0, 0), (41, 30))
    os.utime(image, (1, 1))
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset(cfg)
    # so is a changed split file
    monkeypatch.undo()
    load_dataset(cfg)
    monkeypatch.setattr(image_files, "decode_files", no_decode)
    splits = {k: v[None, :] for k, v in flowers102_splits().items()}
    splits["trnid"], splits["valid"] = splits["valid"], splits["trnid"]
    scipy.io.savemat(base / "setid.mat", splits)
    os.utime(base / "setid.mat", (2, 2))
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset(cfg)


def corrupt_flowers(base: Path, fault: str) -> str:
    """Break the files one way; returns the file name the error must name."""
    if fault in ("imagelabels.mat", "setid.mat"):
        (base / fault).unlink()
    elif fault == "jpg":
        for jpg in (base / "jpg").iterdir():
            jpg.unlink()
        (base / "jpg").rmdir()
    elif fault == "unreadable":
        (base / "imagelabels.mat").write_bytes(b"this is not a MATLAB file" * 10)
        return "imagelabels.mat"
    elif fault == "truncated":
        (base / "setid.mat").write_bytes((base / "setid.mat").read_bytes()[:150])
        return "setid.mat"
    elif fault == "no labels key":
        scipy.io.savemat(base / "imagelabels.mat", {"label": flowers102_labels()[None, :]})
        return "imagelabels.mat"
    elif fault == "no tstid key":
        splits = flowers102_splits()
        scipy.io.savemat(base / "setid.mat", {"trnid": splits["trnid"], "valid": splits["valid"]})
        return "setid.mat"
    elif fault == "label count":  # one label more than there are images
        scipy.io.savemat(base / "imagelabels.mat", {"labels": np.append(flowers102_labels(), 1)[None, :]})
        return "imagelabels.mat"
    elif fault == "too few labels":  # setid names an image the labels do not cover
        scipy.io.savemat(base / "imagelabels.mat", {"labels": flowers102_labels()[None, :-1]})
        return "setid.mat"
    elif fault == "missing image":
        (base / "jpg" / "image_00007.jpg").rename(base / "jpg" / "image_00099.jpg")
        return "image_00007.jpg"
    return fault


@pytest.mark.parametrize(
    "fault",
    [
        "imagelabels.mat",
        "setid.mat",
        "jpg",
        "unreadable",
        "truncated",
        "no labels key",
        "no tstid key",
        "label count",
        "too few labels",
        "missing image",
    ],
)
def test_flowers102_missing_or_corrupt_files_are_one_line_errors(tmp_path, fault):
    base = write_flowers102(tmp_path)
    named = corrupt_flowers(base, fault)
    message = config_error(flowers_cfg(tmp_path))
    assert named in message, message
    if fault == "label count":
        assert "labels 21 images" in message and "holds 20" in message
    if fault == "too few labels":
        assert "tstid names image 20" in message and "labels 19 images" in message
    if fault.startswith("no "):
        assert repr(fault.split()[1]) in message


def test_flowers102_needs_data_root(tmp_path):
    assert "data.root" in config_error(DataConfig(dataset="flowers102"))
    assert "nowhere" in config_error(flowers_cfg(tmp_path / "nowhere"))


def test_flowers102_merged_dirichlet_federation_fedl2g_setting(tmp_path):
    """FedL2G: Flowers102's three splits merged, 64x64, Dirichlet over clients, 0.75/0.25 per client."""
    write_flowers102(tmp_path, classes=4, per_class=10)
    cfg = flowers_cfg(
        tmp_path,
        num_clients=3,
        partition=PartitionConfig(kind="dirichlet", alpha=0.1, min_samples=5),
        split=SplitConfig(train=0.75, val=0.0, test=0.25, convention="merged"),
    )
    check_data(cfg)
    bundle = load_dataset(cfg)
    fed = build_federation(bundle, cfg, seed=3)
    assert (fed.num_clients, fed.image_size, fed.in_channels, fed.num_classes) == (3, 64, 3, 4)
    ids = np.concatenate([np.concatenate([s.train_ids, s.val_ids, s.test_ids]) for s in fed.shards])
    assert sorted(ids.tolist()) == list(range(40))  # train, val and test merged, each sample once
    for shard in fed.shards:
        assert len(shard.test) == int(np.floor(0.25 * (len(shard.train) + len(shard.test)) + 0.5))
        assert shard.train.x.shape[1:] == (3, 64, 64)
        labels = bundle.labels()[shard.train_ids]
        torch.testing.assert_close(shard.train.y, torch.from_numpy(labels))
    assert fed.global_test_ids is not None
    assert sorted(fed.global_test_ids.tolist()) == sorted(
        np.concatenate([s.test_ids for s in fed.shards]).tolist()
    )
    # too many clients for the 40 merged samples: caught before any image is decoded
    message = config_error_check_only(flowers_cfg(tmp_path, num_clients=41, split=cfg.split))
    assert "data.num_clients=41" in message and "40 train + test samples" in message


def config_error_check_only(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


# ------------------------------------------------------------------------------------------ Tiny-ImageNet


def tiny_cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(dataset="tiny_imagenet", root=str(root), **kw)


def test_tiny_imagenet_reads_sorted_classes_train_and_val(tmp_path):
    base = write_tiny_imagenet(tmp_path, classes=3, train_per_class=4, val_per_class=2)
    wnids = tiny_imagenet_wnids(3)
    assert wnids != sorted(wnids)  # so the test can tell the two orders apart
    index = {w: i for i, w in enumerate(sorted(wnids))}
    cfg = tiny_cfg(tmp_path)  # the folder holding tiny-imagenet-200/
    assert dataset_info(cfg) == SourceInfo(3, in_channels=3, image_size=64)
    assert official_sizes(cfg) == (12, 6)  # train/, val/ (test/ has no labels)
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape == (12, 3, 64, 64) and bundle.test.x.shape == (6, 3, 64, 64)
    assert bundle.train.y.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # class by class, sorted wnids
    assert bundle.test.y.tolist() == [index[w] for _, w in tiny_imagenet_val(3, 2)]  # annotation order
    for part in (bundle.train, bundle.test):
        for image, label in zip(part.x, part.y):
            assert_colour(image, class_colour(int(label)))
    assert bundle.class_names == [f"thing {w[-4:]}, object" for w in sorted(wnids)]  # words.txt
    assert cache_files(base)[0].startswith("tiny_imagenet-64-")


def test_tiny_imagenet_folder_root_image_size_and_wnid_names(tmp_path, monkeypatch):
    base = write_tiny_imagenet(tmp_path, classes=2, train_per_class=2, val_per_class=1, words=False)
    cfg = tiny_cfg(base, image_size=24)  # data.root = tiny-imagenet-200/ itself
    assert dataset_info(cfg).image_size == 24
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape == (4, 3, 24, 24) and bundle.image_size == 24
    assert bundle.class_names == sorted(tiny_imagenet_wnids(2))  # no words.txt: the wnids
    assert_colour(bundle.test.x[0], class_colour(int(bundle.test.y[0])))
    assert [n.rsplit("-", 1)[0] for n in cache_files(base)] == ["tiny_imagenet-24"]
    monkeypatch.setattr(image_files, "decode_files", no_decode)
    again = load_dataset(cfg)  # second load: from the cache
    torch.testing.assert_close(again.test.x, bundle.test.x)
    (base / "val" / "val_annotations.txt").write_text(
        "val_0.JPEG\t" + sorted(tiny_imagenet_wnids(2))[1] + "\n"
    )
    os.utime(base / "val" / "val_annotations.txt", (3, 3))
    with pytest.raises(AssertionError, match="decoded again"):  # a relabelled val set is new data
        load_dataset(cfg)


def test_tiny_imagenet_sizes_read_no_image(tmp_path, monkeypatch):
    write_tiny_imagenet(tmp_path, classes=4, train_per_class=3, val_per_class=2)
    monkeypatch.setattr(image_files, "decode_files", no_decode)
    cfg = tiny_cfg(tmp_path, num_clients=12, partition=PartitionConfig(kind="iid"))
    assert official_sizes(cfg) == (12, 8)
    check_data(cfg)
    message = config_error_check_only(
        tiny_cfg(tmp_path, num_clients=13, partition=PartitionConfig(kind="iid"))
    )
    assert "data.num_clients=13" in message and "12 training samples" in message


def break_tiny(base: Path, fault: str) -> str:
    wnids = tiny_imagenet_wnids(3)
    annotations = base / "val" / "val_annotations.txt"
    if fault == "wnids.txt":
        (base / "wnids.txt").unlink()
    elif fault == "train":
        (base / "train").rename(base / "training")
    elif fault == "val_annotations.txt":
        annotations.unlink()
    elif fault == "unknown wnid":
        annotations.write_text(annotations.read_text() + "val_0.JPEG\tn00000042\t0\t0\t1\t1\n")
        return "n00000042"
    elif fault == "no such file":
        annotations.write_text(annotations.read_text() + "val_77.JPEG\t" + wnids[0] + "\t0\t0\t1\t1\n")
        return "val_77.JPEG"
    elif fault == "class without train folder":
        (base / "wnids.txt").write_text((base / "wnids.txt").read_text() + "n00000007\n")
        return "n00000007"
    elif fault == "unlisted train folder":
        solid_jpeg(base / "train" / "n00000005" / "images" / "x.JPEG", (0, 0, 0), (64, 64))
        return "n00000005"
    elif fault == "malformed line":
        annotations.write_text("val_0.JPEG " + wnids[0] + "\n")
        return "val_annotations.txt:1"
    return fault


@pytest.mark.parametrize(
    "fault",
    [
        "wnids.txt",
        "train",
        "val_annotations.txt",
        "unknown wnid",
        "no such file",
        "class without train folder",
        "unlisted train folder",
        "malformed line",
    ],
)
def test_tiny_imagenet_missing_or_wrong_files_are_one_line_errors(tmp_path, fault):
    base = write_tiny_imagenet(tmp_path)
    named = break_tiny(base, fault)
    message = config_error(tiny_cfg(tmp_path))
    assert named in message, message
    if fault in ("unknown wnid", "no such file"):
        assert "val_annotations.txt:7" in message  # the line: after the 6 rows written


# ------------------------------------------------------------------------------------------ data.image_size


def torch_resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """The reference: torch's bilinear interpolate (antialiased), rounded back to uint8."""
    out = F.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return out.round().clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("size", [12, 3])
def test_image_size_resizes_synthetic_after_loading(size):
    cfg = DataConfig(dataset="synthetic", synthetic_samples=60, synthetic_classes=3, synthetic_image_size=5)
    native = load_dataset(cfg)
    sized_cfg = replace(cfg, image_size=size)
    assert dataset_info(sized_cfg) == SourceInfo(3, in_channels=1, image_size=size)
    bundle = load_dataset(sized_cfg)
    assert bundle.train.x.shape == (48, 1, size, size) and bundle.image_size == size
    assert bundle.train.x.dtype == torch.uint8
    torch.testing.assert_close(bundle.train.x, torch_resize(native.train.x, size), atol=0, rtol=0)
    torch.testing.assert_close(bundle.test.x, torch_resize(native.test.x, size), atol=0, rtol=0)
    torch.testing.assert_close(bundle.train.y, native.train.y)
    assert (bundle.mean, bundle.std) == channel_stats(bundle.train.x)
    assert bundle.mean != native.mean


def test_image_size_resizes_mnist_files(tmp_path):
    raw = write_mnist(tmp_path, n_train=20, n_test=6)
    cfg = DataConfig(dataset="mnist", root=str(tmp_path), image_size=32)
    assert dataset_info(cfg) == SourceInfo(10, in_channels=1, image_size=32)
    bundle = load_dataset(cfg)
    assert bundle.train.x.shape == (20, 1, 32, 32) and bundle.test.x.shape == (6, 1, 32, 32)
    pixels = np.frombuffer((raw / "train-images-idx3-ubyte").read_bytes()[16:], np.uint8).reshape(
        20, 1, 28, 28
    )
    torch.testing.assert_close(
        bundle.train.x, torch_resize(torch.from_numpy(pixels.copy()), 32), atol=0, rtol=0
    )
    assert bundle.train.y.tolist() == [i % 10 for i in range(20)]
    native = load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)))  # the cache holds 28x28
    assert native.image_size == 28
    np.testing.assert_array_equal(native.train.x.numpy(), pixels)


def test_resize_helper_in_chunks_and_identity(monkeypatch):
    x = torch.randint(0, 256, (7, 3, 10, 10), dtype=torch.uint8)
    monkeypatch.setattr(bundle_module, "RESIZE_CHUNK", 3)
    torch.testing.assert_close(resize_images(x, 6), torch_resize(x, 6), atol=0, rtol=0)
    assert resize_images(x, 10) is x
    assert resize_images(x[:0], 4).shape == (0, 3, 4, 4)
    ds = ArrayDataset(x, torch.arange(7))
    b = make_bundle("toy", ds, ds, ["a"] * 7)
    assert at_image_size(b, None) is b and at_image_size(b, 10) is b
    assert at_image_size(b, 4).image_size == 4


def test_imagefolder_image_size_and_cache_key(tmp_path, count_decodes):
    for split in ("train", "test"):
        for c, cls in enumerate(("ant", "bee")):
            solid_jpeg(tmp_path / split / cls / "0.png", class_colour(c), (6, 6))
            solid_jpeg(tmp_path / split / cls / "1.png", class_colour(c), (9, 9))
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path))
    assert dataset_info(cfg).image_size == 6  # unset: the first image's side, as before
    assert load_dataset(cfg).train.x.shape == (4, 3, 6, 6)
    # unset: the key of earlier versions, so their cache files stay valid
    assert [re.fullmatch(r"imagefolder-[0-9a-f]{16}\.pt", n) is not None for n in cache_files(tmp_path)] == [
        True
    ]
    sized = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=8)
    assert dataset_info(sized).image_size == 8
    bundle = load_dataset(sized)
    assert bundle.train.x.shape == (4, 3, 8, 8) and bundle.test.x.shape == (4, 3, 8, 8)
    assert_colour(bundle.train.x[3], class_colour(1))
    assert sum(count_decodes) == 16  # 8 images decoded at each side
    assert sorted(n.rsplit("-", 1)[0] for n in cache_files(tmp_path)) == ["imagefolder", "imagefolder-8"]
    load_dataset(sized)
    assert sum(count_decodes) == 16


class ToyText(Source):
    name = "toy_text"
    modality = "text"

    def info(self, cfg: DataConfig) -> SourceInfo:
        return SourceInfo(2, modality="text", seq_len=4, vocab_size=9)


def test_image_size_on_a_text_source_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sources_base._SOURCES, "toy_text", ToyText())
    check_source(DataConfig(dataset="toy_text"))
    with pytest.raises(ConfigError, match=r"data\.image_size=32: toy_text is text") as info:
        check_source(DataConfig(dataset="toy_text", image_size=32))
    assert "\n" not in str(info.value)
    assert dataset_info(DataConfig(dataset="toy_text", image_size=32)).image_size == 0


def test_a_real_jpeg_of_another_shape_is_stretched(tmp_path):
    """Flowers' photos are not square: decoded to the side without keeping the aspect (PFLlib's
    Resize((64, 64))), here a left half red and right half blue stays left red and right blue."""
    base = write_flowers102(tmp_path, classes=3, per_class=3)
    half = np.zeros((30, 60, 3), dtype=np.uint8)
    half[:, :30] = (255, 0, 0)
    half[:, 30:] = (0, 0, 255)
    Image.fromarray(half).save(base / "jpg" / "image_00001.jpg", quality=95)
    bundle = load_dataset(flowers_cfg(tmp_path, image_size=16))
    ids = np.concatenate([flowers102_splits(3, 3)[k] for k in ("trnid", "valid", "tstid")]).astype(int)
    position = int(np.flatnonzero(ids == 1)[0])
    image = bundle.take([position]).x[0]
    assert image.shape == (3, 16, 16)
    assert_colour(image[:, :, :6], (255, 0, 0), tolerance=12)
    assert_colour(image[:, :, 10:], (0, 0, 255), tolerance=12)
