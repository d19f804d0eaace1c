"""crop_flip checked by hand on tiny images, and wired to the training batches only, seeded."""

from __future__ import annotations

import torch
from conftest import tiny_overrides
from in_process import client_task

from fedray.platform.catalog import load_config
from fedray.platform.data.augment import crop_flip
from fedray.platform.runtime import local_training, storage
from fedray.platform.runtime.driver import federation_meta, prepare_federation
from fedray.platform.runtime.state_store import state_file
from fedray.platform.runtime.worker import ClientHost


def test_each_image_is_a_window_of_its_padded_self_possibly_mirrored():
    x = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 1, 3, 3) + 1  # no zeros inside
    out = crop_flip(x, torch.Generator().manual_seed(0), pad=1)
    assert out.shape == x.shape
    for img, src in zip(out, x):
        padded = torch.nn.functional.pad(src, (1, 1, 1, 1))
        windows = [padded[:, i : i + 3, j : j + 3] for i in range(3) for j in range(3)]
        assert any(torch.equal(img, w) or torch.equal(img, w.flip(-1)) for w in windows)


def test_draws_follow_the_generator_and_cover_shifts_and_flips():
    x = torch.randn(256, 3, 8, 8)
    a = crop_flip(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, crop_flip(x, torch.Generator().manual_seed(1)))
    assert not torch.equal(a, crop_flip(x, torch.Generator().manual_seed(2)))
    unchanged = sum(torch.equal(a[i], x[i]) for i in range(256))
    assert unchanged < 32  # 1/81 of offsets are (4, 4), half of those unflipped: a few, not most


def trained_state(augment: str, directory):
    """Client 0's model after one round of local training (``local``: its own model, no downlink)."""
    cfg = load_config(
        None, tiny_overrides(algorithm="local", **{"data.augment": augment, "train.local_epochs": 1})
    )
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    (result,) = host.train(0, [client_task(0, fed.shards[0], str(directory))], [[{}]])
    assert result.error is None
    return storage.load_torch(state_file(str(directory), 0, 1))["module"]


def test_augmentation_changes_training_and_repeats_exactly(tmp_path):
    plain, aug = trained_state("none", tmp_path), trained_state("crop_flip", tmp_path)
    assert any(not torch.equal(plain[k], aug[k]) for k in plain)
    again = trained_state("crop_flip", tmp_path)
    assert all(torch.equal(aug[k], again[k]) for k in aug)


def test_evaluation_batches_are_never_augmented(monkeypatch, tmp_path):
    calls = []
    real = local_training.crop_flip

    def counted(x, gen, **kwargs):
        calls.append(len(x))
        return real(x, gen, **kwargs)

    monkeypatch.setattr(local_training, "crop_flip", counted)
    scores = {}
    for augment in ("crop_flip", "none"):
        cfg = load_config(
            None, tiny_overrides(algorithm="local", **{"data.augment": augment, "train.local_epochs": 1})
        )
        fed = prepare_federation(cfg)
        host = ClientHost(cfg, num_threads=1)
        host.setup(federation_meta(fed))
        if augment == "crop_flip":  # the same host trains with augmentation: the spy sees it
            (result,) = host.train(0, [client_task(0, fed.shards[0], str(tmp_path))], [[{}]])
            assert result.error is None and sum(calls) > 0
            calls.clear()
        task = client_task(0, fed.shards[0], str(tmp_path), version=1)  # the trained client, committed
        scores[augment] = host.evaluate([task], None)
        assert calls == []  # evaluation drew no crop or flip
    assert scores["crop_flip"] == scores["none"]  # and scores exactly as an unaugmented run would
