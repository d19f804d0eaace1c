"""``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: torchvision's own dataset classes.

Read once with torchvision's readers (its on-disk formats: MNIST's idx files or processed tensors,
CIFAR's pickled batches) and converted array-to-tensor, no per-image PIL transform. ``data.download=true``
lets torchvision fetch them; otherwise the files must be under ``data.root`` (default
``~/.cache/fedray/data``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle
from fedray.platform.data.cache import bundle_from_payload, cached
from fedray.platform.data.sources.base import Source, SourceInfo, data_root, register_source
from fedray.platform.errors import ConfigError


class TorchvisionSet(Source):
    """One of torchvision's classification sets, by its class name in ``torchvision.datasets``."""

    def __init__(
        self,
        name: str,
        cls_name: str,
        num_classes: int,
        in_channels: int,
        image_size: int,
        sizes: tuple[int, int],
    ) -> None:
        self.name = name  # one class, four registered instances
        self.cls_name = cls_name
        self.doc = f"torchvision's {cls_name} (data.root, or data.download=true)"
        self._info = SourceInfo(num_classes, in_channels=in_channels, image_size=image_size)
        self._sizes = sizes  # official sizes, for the cheap pre-flight

    def check(self, cfg: DataConfig) -> None:
        if not cfg.download and self.files(cfg) is None:
            root = data_root(cfg)
            where = f"data.root={cfg.root!r}" if cfg.root else f"data.root is not set (looked in {root})"
            raise ConfigError(
                f"{where}: the {cfg.dataset} files are not there; set data.root=<dir holding them> "
                "or data.download=true"
            )

    def info(self, cfg: DataConfig) -> SourceInfo:
        return self._info

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        return self._sizes

    def files(self, cfg: DataConfig) -> list[Path] | None:
        """The files torchvision would read under the root, or None if any is missing."""
        import torchvision.datasets as tvd

        root = data_root(cfg)
        cls = getattr(tvd, self.cls_name)
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

    def decode(self, cfg: DataConfig) -> dict[str, Any]:
        import torchvision.datasets as tvd

        cls = getattr(tvd, self.cls_name)
        out: dict[str, Any] = {}
        for split, train in (("train", True), ("test", False)):
            try:
                ds = cls(root=str(data_root(cfg)), train=train, download=cfg.download)
            except (RuntimeError, OSError) as err:  # corrupt files, or a failed download
                message = str(err).splitlines()[0] if str(err) else type(err).__name__
                advice = (
                    "the download failed: check the network, or put the files there yourself"
                    if cfg.download
                    else "fix the files or set data.download=true"
                )
                raise ConfigError(
                    f"data.root={cfg.root!r}: torchvision could not read {cfg.dataset} ({message}); {advice}"
                ) from err
            x = torch.as_tensor(np.asarray(ds.data))
            x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # MNIST [N,H,W]; CIFAR [N,H,W,C]
            out[f"{split}_x"] = x.to(torch.uint8).contiguous()
            out[f"{split}_y"] = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
            out["class_names"] = [str(c) for c in ds.classes]
        return out

    def load(self, cfg: DataConfig) -> DatasetBundle:
        if not cfg.download:
            return self._load(cfg)
        # a sweep's trials start together: without the lock each would fetch into the same files,
        # truncating the archive another is still checking or reading (torchvision writes in place)
        from filelock import FileLock

        root = data_root(cfg)
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(root / f".fedray-download-{self.name}.lock"):
            return self._load(cfg)

    def _load(self, cfg: DataConfig) -> DatasetBundle:
        files = self.files(cfg)
        fresh = None
        if files is None:  # download=true (checked): torchvision fetches the files, then we fingerprint them
            fresh = self.decode(cfg)
            files = self.files(cfg)
            if files is None:
                raise ConfigError(f"data.root={cfg.root!r}: {cfg.dataset} download left no readable files")
        payload = cached(data_root(cfg), self.cache_key(cfg), files, lambda: fresh or self.decode(cfg))
        return bundle_from_payload(self.name, payload)


register_source(TorchvisionSet("mnist", "MNIST", 10, 1, 28, (60000, 10000)))
register_source(TorchvisionSet("fashion_mnist", "FashionMNIST", 10, 1, 28, (60000, 10000)))
register_source(TorchvisionSet("cifar10", "CIFAR10", 10, 3, 32, (50000, 10000)))
register_source(TorchvisionSet("cifar100", "CIFAR100", 100, 3, 32, (50000, 10000)))
