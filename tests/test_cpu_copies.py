"""Uplinks and states leave a worker as CPU tensors; what a GPU holds crosses in one transfer per
dtype (``copy_to_cpu``). The gathering itself is device-agnostic, so it is checked here on the CPU;
the transfer from a GPU where there is one."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedray.platform.api.algorithm import copy_to_cpu, cpu_state, gathered_to_cpu
from fedray.platform.runtime.transport import tensor_from_wire, tensor_to_wire
from fedray.platform.runtime.worker import to_cpu


def assorted() -> list[torch.Tensor]:
    """The shapes and layouts a state holds: a channels_last conv weight, a transposed matrix, a
    0-dim counter, an empty tensor, a bias."""
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(8, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
    return [conv, torch.randn(7, 4, generator=g).t(), torch.tensor(3.5), torch.empty(0, 4), torch.randn(9)]


def regions(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]


def test_gathered_tensors_come_back_equal_in_their_shapes_each_in_a_region_of_its_own():
    given = assorted()
    got = gathered_to_cpu(given)
    assert [g.shape for g in got] == [t.shape for t in given]
    assert all(torch.equal(g, t) for g, t in zip(got, given, strict=True))
    ours, theirs = regions(got), regions(given)
    assert all(a_end <= b or b_end <= a for a, a_end in ours for b, b_end in theirs)  # nothing shared
    ours.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ours))  # disjoint
    got[4].add_(1)  # one written in place leaves the others alone
    assert all(torch.equal(g, t) for g, t in zip(got[:4], given[:4], strict=True))


def test_cpu_tensors_are_copied_only_when_asked_and_the_order_is_kept():
    given = [torch.arange(4), torch.ones(2, 2), torch.tensor([True, False])]
    kept = copy_to_cpu(given, copy=False)
    assert [t.data_ptr() for t in kept] == [t.data_ptr() for t in given]
    copied = copy_to_cpu(given, copy=True)
    assert all(c.data_ptr() != t.data_ptr() and torch.equal(c, t) for c, t in zip(copied, given, strict=True))
    assert [c.dtype for c in copied] == [torch.int64, torch.float32, torch.bool]


def test_to_cpu_rebuilds_the_payload_around_its_tensors():
    payload = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "protos": [torch.eye(2), 3], "n": 7}
    moved = to_cpu(payload, copy=True)
    assert moved.keys() == payload.keys() and moved["n"] == 7 and moved["protos"][1] == 3
    assert torch.equal(moved["protos"][0], torch.eye(2)) and torch.equal(moved["model"]["w"], torch.ones(2))
    assert moved["model"]["w"].data_ptr() != payload["model"]["w"].data_ptr()


def test_without_room_to_gather_on_the_device_each_tensor_is_copied_alone(monkeypatch):
    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    given = assorted()
    monkeypatch.setattr(torch, "cat", no_room)
    got = gathered_to_cpu(given)
    assert all(torch.equal(g, t) for g, t in zip(got, given, strict=True))
    assert not set(regions(got)) & set(regions(given))


def test_a_gathered_tensor_travels_as_its_own_bytes():
    part = gathered_to_cpu([torch.ones(1000), torch.full((3,), 2.0)])[1]
    wire = tensor_to_wire(part)
    assert wire[1].nbytes == 3 * 4
    assert torch.equal(tensor_from_wire(wire), part)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_state_crosses_to_the_cpu_equal_to_tensor_by_tensor():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).cuda()
    state = cpu_state(model)
    assert all(t.device.type == "cpu" for t in state.values())
    assert all(torch.equal(state[k], v.cpu()) for k, v in model.state_dict().items())
    assert state["1.num_batches_tracked"].dtype == torch.int64
