"""Tensors through Ray's object store as raw bytes: exact round trips, private writable memory."""

from __future__ import annotations

import pickle

import pytest
import torch

from fedray.platform.runtime.transport import (
    WIRE_CHUNK,
    tensor_from_wire,
    tensor_to_wire,
    use_fast_tensor_transport,
)

CASES = {
    "float32 matrix": torch.randn(4, 5),
    "float64": torch.randn(3, dtype=torch.float64),
    "int64": torch.arange(-5, 7),
    "bool": torch.tensor([True, False, True]),
    "bfloat16 (no NumPy dtype)": torch.randn(2, 3).to(torch.bfloat16),
    "uint8 images": torch.randint(0, 255, (2, 3, 4, 4), dtype=torch.uint8),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 5),
    "transposed view": torch.randn(3, 4).t(),
    "complex": torch.randn(3, dtype=torch.complex64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_exact(name):
    original = CASES[name]
    back = tensor_from_wire(pickle.loads(pickle.dumps(tensor_to_wire(original))))
    assert back.dtype == original.dtype and back.shape == original.shape
    assert torch.equal(back, original)


def test_received_tensor_owns_writable_memory():
    wire = tensor_to_wire(torch.ones(6))
    back = tensor_from_wire(wire)
    back += 1  # algorithms may update what they receive in place
    assert torch.equal(torch.from_numpy(wire[1]).view(torch.float32), torch.ones(6))
    assert back.is_contiguous() and torch.equal(back, torch.full((6,), 2.0))


def test_a_view_sends_only_its_own_bytes_and_keeps_requires_grad():
    big = torch.randn(1000, 10)
    wire = tensor_to_wire(big[3:5])
    assert wire[1].nbytes == 2 * 10 * 4  # torch's pickling would send the whole 40 kB storage
    leaf = torch.randn(3, requires_grad=True)
    back = tensor_from_wire(tensor_to_wire(leaf))
    assert back.requires_grad and torch.equal(back.detach(), leaf.detach())


def test_a_large_tensor_travels_in_buffers_ray_copies_plainly():
    """Ray copies a buffer over 1 MiB on six threads it starts for the copy (slow where cores are
    few and busy): a model's large weight goes as chunks of at most ``WIRE_CHUNK``, and comes back
    whole, exact, and in memory of its own."""
    assert WIRE_CHUNK <= 1 << 20
    weight = torch.randn(1600, 513)  # 3.3 MB, not a whole number of chunks
    buffers: list = []
    wire = pickle.loads(
        pickle.dumps(tensor_to_wire(weight), protocol=5, buffer_callback=buffers.append), buffers=buffers
    )
    sizes = [b.raw().nbytes for b in buffers]
    assert len(sizes) == 4 and max(sizes) <= WIRE_CHUNK and sum(sizes) == weight.numel() * 4
    back = tensor_from_wire(wire)
    assert back.shape == weight.shape and torch.equal(back, weight)
    back += 1  # its own memory: the buffers it came in are untouched
    assert torch.equal(torch.from_numpy(wire[1][0]).view(torch.float32)[:5], weight.reshape(-1)[:5])


def test_a_tensor_of_exactly_one_chunk_stays_one_buffer_and_one_byte_more_is_two():
    exact = torch.arange(WIRE_CHUNK // 4, dtype=torch.float32)  # WIRE_CHUNK bytes
    assert not isinstance(tensor_to_wire(exact)[1], list)
    over = torch.arange(WIRE_CHUNK + 1, dtype=torch.uint8)
    wire = tensor_to_wire(over)
    assert [chunk.nbytes for chunk in wire[1]] == [WIRE_CHUNK, 1]
    assert torch.equal(tensor_from_wire(wire), over)


def test_sparse_tensors_fall_back_to_torch_pickling():
    sparse = torch.eye(3).to_sparse()
    wire = tensor_to_wire(sparse)
    assert wire[0] == "pickle"
    assert torch.equal(tensor_from_wire(wire).to_dense(), torch.eye(3))


def out_of_band_bytes(value) -> int:
    """Bytes Ray's pickler hands out of band for ``value`` in this process."""
    import ray

    buffers: list = []
    ray.cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return sum(b.raw().nbytes for b in buffers)


def test_ray_puts_tensor_data_out_of_band_and_actors_do_too(client_actor):
    """The driver, a ClientActor and the Coordinator all send tensor data as out-of-band buffers."""
    import ray

    from fedray.platform.runtime.coordinator import Coordinator

    state = {"w": torch.randn(64, 64), "b": torch.zeros(64), "steps": 3}
    use_fast_tensor_transport()
    buffers: list = []  # what Ray's pickler hands to the object store out of band, without a copy
    ray.cloudpickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == (64 * 64 + 64) * 4

    got = ray.get(ray.put(state))
    assert torch.equal(got["w"], state["w"]) and got["steps"] == 3
    got["w"].add_(1.0)  # writable, and not the object store's buffer
    assert torch.equal(ray.get(ray.put(state))["w"], state["w"])

    coordinator = Coordinator.remote()
    try:
        for handle in (client_actor, coordinator):
            # fedray's reducer, not just any: a view of 2 rows of a 1000-row tensor goes out of band
            # as its own 80 bytes (torch's pickling would copy the whole 40 kB storage in band)
            sent = ray.get(
                handle.__ray_call__.remote(lambda _self: out_of_band_bytes(torch.randn(1000, 10)[3:5]))
            )
            assert sent == 2 * 10 * 4
    finally:
        ray.kill(coordinator)


def test_only_cpu_tensors_travel():
    """A tensor on another device (a GPU; here the meta device, which this machine has) is refused
    with one line, not pickled for a process that may have no such device."""
    with pytest.raises(TypeError, match=r"a meta tensor \(2, 3\) was sent through Ray: payloads"):
        tensor_to_wire(torch.empty(2, 3, device="meta"))
