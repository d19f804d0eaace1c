"""A client process scans Lightning's plugin entry points once, and external callbacks still apply."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import lightning as L
import pytest
from lightning.fabric.utilities import registry

from fedray.platform.client import scan_lightning_plugins_once


class MarkerCallback(L.Callback):
    """What an installed package's ``lightning.pytorch.callbacks_factory`` entry point would add."""


def marker_callbacks() -> list[L.Callback]:
    return [MarkerCallback()]


@pytest.fixture
def counted_scan(monkeypatch):
    """Replaces the entry-point scan with one that counts its calls and finds one factory."""
    scans: list[dict] = []

    def scan(**params):
        scans.append(params)
        return [EntryPoint("marker", f"{__name__}:marker_callbacks", params["group"])]

    monkeypatch.setattr(registry, "entry_points", scan)
    return scans


def trainer() -> L.Trainer:
    return L.Trainer(max_epochs=1, accelerator="cpu", devices=1, barebones=True, num_sanity_val_steps=0)


def test_each_trainer_scans_without_it(counted_scan):
    trainer(), trainer()
    assert len(counted_scan) == 2  # the cost the cache removes: one scan of every package per fit


def test_trainers_scan_once_and_still_get_external_callbacks(counted_scan):
    scan_lightning_plugins_once()
    scan_lightning_plugins_once()  # a second call must not wrap the cache again
    first, second = trainer(), trainer()
    assert counted_scan == [{"group": "lightning.pytorch.callbacks_factory"}]
    markers = [[cb for cb in t.callbacks if isinstance(cb, MarkerCallback)] for t in (first, second)]
    assert [len(m) for m in markers] == [1, 1]
    assert markers[0][0] is not markers[1][0]  # the factory still runs for every Trainer
