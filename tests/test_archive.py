"""Unpacking an image archive (the CIFAR-10 JPEGs for `make bench`, `make reproduce`, the slow
tests): once, whole or not at all."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from fedray.platform.data.archive import unpack_image_archive
from fedray.platform.errors import ConfigError

MEMBERS = ["top/test/cat/0.jpg", "top/train/cat/0.jpg", "top/train/cat/1.jpg", "top/train/dog/0.jpg"]


def make_archive(path: Path, members: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in members:
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_an_archive_is_unpacked_once_and_its_wrapping_folder_found(tmp_path):
    archive = make_archive(tmp_path / "images.tar.gz", MEMBERS)
    root = unpack_image_archive(archive, tmp_path / "cache" / "images")
    assert root == tmp_path / "cache" / "images" / "top"
    assert files_under(root) == ["test/cat/0.jpg", "train/cat/0.jpg", "train/cat/1.jpg", "train/dog/0.jpg"]
    archive.unlink()  # done once: the archive is not read again
    assert unpack_image_archive(archive, tmp_path / "cache" / "images") == root
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["images"]  # nothing left beside it


def test_an_unpacking_stopped_part_way_leaves_nothing_that_reads_as_done(tmp_path, monkeypatch):
    archive = make_archive(tmp_path / "images.tar.gz", MEMBERS)
    target = tmp_path / "cache" / "images"
    whole = tarfile.TarFile.extractall

    def stopped_after_two_files(self, path, members=None, **kwargs):
        whole(self, path, members=self.getmembers()[:2], **kwargs)  # test/ and a part of train/
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", stopped_after_two_files)
    with pytest.raises(KeyboardInterrupt):
        unpack_image_archive(archive, target)
    assert not target.exists() and list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(tarfile.TarFile, "extractall", whole)
    root = unpack_image_archive(archive, target)  # the next command unpacks it all
    assert len(files_under(root)) == len(MEMBERS)


def test_an_archive_without_train_and_test_is_one_line_and_leaves_nothing(tmp_path):
    archive = make_archive(tmp_path / "images.tar.gz", ["pictures/cat/0.jpg"])
    with pytest.raises(ConfigError, match="no train/ and test/ folders inside") as caught:
        unpack_image_archive(archive, tmp_path / "cache" / "images")
    assert "\n" not in str(caught.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_target_holding_something_else_is_one_line_and_left_as_it_was(tmp_path):
    archive = make_archive(tmp_path / "images.tar.gz", MEMBERS)
    target = tmp_path / "cache" / "images"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds something other than an unpacked image archive"):
        unpack_image_archive(archive, target)
    assert files_under(tmp_path / "cache") == ["images/notes.txt"]


def test_a_missing_archive_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        unpack_image_archive(tmp_path / "nowhere.tar.gz", tmp_path / "cache")
