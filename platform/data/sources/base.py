"""What a dataset source is, and the registry that finds one by ``data.dataset``.

A source is one module under :mod:`fedray.platform.data.sources` holding one :class:`Source` subclass
(or, for a family read by the same code, a few instances of one), registered with
:func:`register_source`. It says:

- how to check its files before anything heavy starts (:meth:`Source.check`: one line naming the
  missing file or folder);
- its modality and shape and its classes, from metadata alone (:meth:`Source.info`);
- its official train/test sizes, from metadata alone (:meth:`Source.sizes`), for the pre-flight of the
  partition and of split files;
- how to read its on-disk format into a :class:`~fedray.platform.data.bundle.DatasetBundle`
  (:meth:`Source.load`), through the decoded-data cache under the key :meth:`Source.cache_key`;
- whether it comes with its own federation (``natural``: ``data.partition.kind=natural`` keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedray.platform.config import DataConfig
from fedray.platform.data.bundle import DatasetBundle, Modality
from fedray.platform.errors import ConfigError


@dataclass(frozen=True)
class SourceInfo:
    """A dataset's shape without its data: what the model zoo and config validation need."""

    num_classes: int
    modality: Modality = "image"
    in_channels: int = 0  # images
    image_size: int = 0  # images: H == W
    seq_len: int = 0  # text: tokens per sample
    vocab_size: int = 0  # text: token ids 0..vocab_size-1


class Source:
    """One dataset on disk (or embedded). Subclasses set ``name`` and implement the four methods."""

    name: str = ""
    modality: Modality = "image"
    natural: bool = False  # it defines its own clients (data.partition.kind=natural)
    doc: str = ""  # one line: what it is and where its files go

    def check(self, cfg: DataConfig) -> None:
        """Cheap: the files are where the config says; raises a one-line ConfigError naming what is not."""

    def info(self, cfg: DataConfig) -> SourceInfo:
        raise NotImplementedError

    def num_classes(self, cfg: DataConfig) -> int:
        """The number of classes, for the partition's pre-flight; override where :meth:`info` is not
        cheap (Sent140's vocabulary with GloVe needs the data)."""
        return self.info(cfg).num_classes

    def sizes(self, cfg: DataConfig) -> tuple[int, int]:
        """``(train, test)`` sizes from metadata only (no sample is decoded)."""
        raise NotImplementedError

    def load(self, cfg: DataConfig) -> DatasetBundle:
        raise NotImplementedError

    def cache_key(self, cfg: DataConfig) -> str:
        """The name its decoded arrays are cached under: the source's name, plus any option that
        changes what is decoded."""
        return self.name

    def user_sizes(self, cfg: DataConfig) -> list[int]:
        """A ``natural`` source's users with a sample to train on, each one's sample count as its
        ``min_samples`` filter counts it, from metadata (the natural partition's pre-flight)."""
        raise NotImplementedError(f"{self.name} has no clients of its own")

    def provides_embeddings(self, cfg: DataConfig) -> bool:
        """Whether the bundle carries pretrained token vectors the model must take (Sent140 with GloVe)."""
        return False

    def sample_paths(self, cfg: DataConfig) -> list[str] | None:
        """Each sample's path relative to ``data.root`` in id order, from the listing only, for a source
        whose samples are files a split file may name (image folders); None for the others."""
        return None


_SOURCES: dict[str, Source] = {}


def register_source(source: Source) -> Source:
    if not source.name or source.name in _SOURCES:
        raise ValueError(f"dataset source {source.name!r} is unnamed or registered twice")
    _SOURCES[source.name] = source
    return source


def known_datasets() -> list[str]:
    return sorted(_SOURCES)


def unknown_dataset(name: str) -> ConfigError:
    return ConfigError(f"data.dataset={name!r}: unknown dataset; known: {', '.join(known_datasets())}")


def source_of(cfg: DataConfig) -> Source:
    """The source ``data.dataset`` names; a one-line ConfigError listing the known ones otherwise."""
    try:
        return _SOURCES[cfg.dataset]
    except KeyError:
        raise unknown_dataset(cfg.dataset) from None


def default_root() -> Path:
    """Where downloadable sets live when ``data.root`` is not set."""
    return Path.home() / ".cache" / "fedray" / "data"


def data_root(cfg: DataConfig) -> Path:
    return Path(cfg.root).expanduser() if cfg.root else default_root()


def required_root(cfg: DataConfig, layout: str) -> Path:
    """``data.root`` for a source that cannot be downloaded: a one-line error saying what goes there."""
    if not cfg.root:
        raise ConfigError(f"data.root is not set: data.dataset={cfg.dataset} needs data.root=<{layout}>")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"data.root={cfg.root!r}: no such folder (data.dataset={cfg.dataset} needs {layout})"
        )
    return root


def nested_root(cfg: DataConfig, folder: str, layout: str) -> Path:
    """``data.root/<folder>`` when it exists, else ``data.root`` itself: a dataset whose files sit in a
    folder of their own may be named by that folder or by its parent."""
    root = required_root(cfg, layout)
    return root / folder if (root / folder).is_dir() else root


def missing_file(cfg: DataConfig, path: Path, what: str) -> ConfigError:
    return ConfigError(f"data.root={cfg.root!r}: {path} is missing ({cfg.dataset} needs {what})")
