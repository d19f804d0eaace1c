"""``train.memory_format``: a CPU worker keeps colour images channels_last (oneDNN's convolutions run
faster on it), leaves everything else as it is, and trains the model it would have trained on NCHW
images, up to rounding. Checked on a ClientHost driven directly (no Ray)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_overrides
from torch.nn.utils import parameters_to_vector

from fedray.algorithms.fedavg import FedAvgClient
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.data.augment import crop_flip
from fedray.platform.data.federation import ClientShard
from fedray.platform.models.inputs import InputShape
from fedray.platform.runtime.devices import image_memory_format, laid_out
from fedray.platform.runtime.state_store import ClientTask
from fedray.platform.runtime.worker import ClientHost

CL = torch.channels_last


def is_channels_last(x: torch.Tensor) -> bool:
    """Laid out channels_last, and not also NCHW (a one-channel image is both)."""
    return x.is_contiguous(memory_format=CL) and not x.is_contiguous()


def test_auto_is_channels_last_on_a_cpu_and_nchw_on_a_gpu():
    cfg = load_config(None, tiny_overrides())
    assert cfg.train.memory_format == "auto"
    assert image_memory_format(cfg.train, torch.device("cpu")) == CL
    assert image_memory_format(cfg.train, torch.device("cuda", 0)) == torch.contiguous_format
    cfg = load_config(None, tiny_overrides(**{"train.memory_format": "contiguous"}))
    assert image_memory_format(cfg.train, torch.device("cpu")) == torch.contiguous_format
    cfg = load_config(None, tiny_overrides(**{"train.memory_format": "channels_last"}))
    assert image_memory_format(cfg.train, torch.device("cuda", 0)) == CL


def test_a_bad_memory_format_is_one_line_before_anything_runs():
    with pytest.raises(Exception, match="memory_format") as err:
        load_config(None, tiny_overrides(**{"train.memory_format": "nhwc"}))
    assert "\n" not in str(err.value)


def test_only_colour_images_change_layout():
    colour = torch.rand(4, 3, 8, 8)
    assert is_channels_last(laid_out(colour, CL))
    assert torch.equal(laid_out(colour, CL), colour)  # the same values, another memory order
    assert laid_out(colour, torch.contiguous_format) is colour
    for other in (torch.rand(4, 1, 8, 8), torch.rand(4, 20), torch.randint(0, 9, (4, 12))):
        assert laid_out(other, CL) is other  # grey images, features, token ids


def test_crop_flip_keeps_the_layout_it_was_given_and_draws_the_same_crops():
    x = torch.rand(6, 3, 10, 10)
    nchw = crop_flip(x, torch.Generator().manual_seed(3))
    cl = crop_flip(x.contiguous(memory_format=CL), torch.Generator().manual_seed(3))
    assert nchw.is_contiguous() and is_channels_last(cl)
    assert torch.equal(nchw, cl)
    assert crop_flip(torch.rand(6, 1, 10, 10), torch.Generator().manual_seed(3)).is_contiguous()


def colour_host(memory_format: str, num_classes: int = 4) -> tuple[ClientHost, ClientShard]:
    """A FedAvg worker fed one hand-made client of 3-channel 8x8 images."""
    cfg = load_config(None, tiny_overrides(**{"train.memory_format": memory_format, "train.local_epochs": 2}))
    gen = torch.Generator().manual_seed(0)

    def images(n: int) -> ArrayDataset:
        x = torch.randint(0, 256, (n, 3, 8, 8), generator=gen, dtype=torch.uint8)
        return ArrayDataset(x, torch.randint(0, num_classes, (n,), generator=gen))

    shard = ClientShard(0, images(64), images(0), images(16))
    host = ClientHost(cfg, num_threads=1)
    meta = {
        "num_classes": num_classes,
        "inputs": InputShape("image", 3, 8),
        "embeddings": None,
        "mean": (0.5, 0.4, 0.3),
        "std": (0.25, 0.25, 0.25),
        "train_sizes": [64],
    }
    host.setup(meta)
    return host, shard


def train_once(host: ClientHost, shard: ClientShard, global_state: dict) -> dict[str, torch.Tensor]:
    (result,) = host.train(0, [ClientTask(0, [shard])], [[{"model": global_state}]])
    assert result.error is None, result.error
    return result.uplink["model"]


def test_a_cpu_worker_trains_on_channels_last_images_and_gets_the_nchw_model_up_to_rounding():
    cl_host, shard = colour_host("auto")
    nchw_host, _ = colour_host("contiguous")
    start = {k: v.clone() for k, v in cl_host.arch_model("cnn_small").state_dict().items()}

    cl_model = train_once(cl_host, shard, start)
    nchw_model = train_once(nchw_host, shard, start)
    kept = cl_host.data.take(0)
    assert is_channels_last(kept.train.x) and is_channels_last(kept.test_x)
    assert nchw_host.data.take(0).train.x.is_contiguous()
    # the parameters stay NCHW: an algorithm's view(-1) and parameters_to_vector work as always
    model = cl_host.arch_model("cnn_small")
    assert all(p.is_contiguous() for p in model.parameters())
    parameters_to_vector(model.parameters())

    assert cl_model.keys() == nchw_model.keys()
    # the kernels round differently and two epochs of momentum SGD carry it on: one element ended
    # 5.6e-4 apart relative to its value once (rtol 1e-4 failed a run); a wrong computation is off by
    # far more than 2e-3
    for key in cl_model:
        torch.testing.assert_close(cl_model[key], nchw_model[key], rtol=2e-3, atol=1e-4)
    assert any(not torch.equal(cl_model[k], nchw_model[k]) for k in cl_model)  # other kernels ran
    again, _ = colour_host("auto")
    assert all(torch.equal(v, train_once(again, shard, start)[k]) for k, v in cl_model.items())


def test_a_view_that_fails_on_channels_last_images_says_what_to_do(monkeypatch):
    def flattening_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model.head(x.view(x.shape[0], -1)[:, :512]), y)

    monkeypatch.setattr(FedAvgClient, "training_step", flattening_step)
    host, shard = colour_host("auto")
    # a copy, as a downlink is: the worker's own model's tensors would share memory with the
    # module it trains (a stateless client trains on that model), which the contract refuses
    start = {k: v.clone() for k, v in host.arch_model("cnn_small").state_dict().items()}
    (result,) = host.train(0, [ClientTask(0, [shard])], [[{"model": start}]])
    line = result.error.line
    assert line.startswith("RuntimeError: view size is not compatible")
    assert "train.memory_format=contiguous" in line and "\n" not in line
    # where: the step above, not torch's frames nor the worker's loop
    assert line.endswith(
        f"(at tests/test_memory_format.py:{flattening_step.__code__.co_firstlineno + 2} in flattening_step)"
    )
    assert "Traceback (most recent call last)" in result.error.traceback
