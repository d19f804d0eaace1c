"""How tensors travel through Ray's object store: as raw bytes, not through torch's pickling.

Ray pickles a ``torch.Tensor`` with torch's own ``__reduce_ex__``, which ``torch.save``s each
storage into an in-memory zip file: putting one 3.5 MB model state costs about 16 ms, and a round
puts one per client. Sent as a flat ``uint8`` NumPy array, the same bytes go into the object store
out of band with one memcpy (about 1 ms). The receiver copies them into a fresh, writable tensor:
object-store buffers are read-only, and algorithms may update what they receive in place.

A tensor larger than ``WIRE_CHUNK`` travels as several buffers of at most that size: Ray copies a
buffer over 1 MiB into the object store on six threads it starts for that one copy, which on a
machine of few cores, busy with the clients' training, took 2-3x the time of plain copies (6 model
states of 3.5 MB: 24-31 ms against 11-12 ms on a 2-core VM).

Every fedray process that sends tensors through Ray calls :func:`use_fast_tensor_transport` once
(the driver in ``ensure_ray``, each ClientActor and the Coordinator when they start). Receivers
need nothing registered: the pickle names :func:`tensor_from_wire` itself.
"""

from __future__ import annotations

import pickle

import numpy as np
import torch

WIRE_CHUNK = 1 << 20  # bytes: Ray's threshold for its threaded copy (it copies one this size plainly)


def tensor_to_wire(tensor: torch.Tensor) -> tuple:
    """A picklable form of ``tensor`` whose data is its bytes as NumPy buffers: one, or chunks of
    ``WIRE_CHUNK`` bytes for a larger tensor (a sparse or quantized one is pickled by torch).

    Only CPU tensors travel: a GPU tensor in a payload or a state would reach a process that may
    have no GPU (the Coordinator, a checkpoint read back on a CPU node)."""
    if tensor.device.type != "cpu":
        raise TypeError(
            f"a {tensor.device} tensor {tuple(tensor.shape)} was sent through Ray: payloads, client "
            "states and checkpoints are CPU tensors (move it with .cpu())"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        return ("pickle", pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL))
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    data = (
        [raw[lo : lo + WIRE_CHUNK] for lo in range(0, raw.size, WIRE_CHUNK)] if raw.size > WIRE_CHUNK else raw
    )
    return (
        "bytes",
        data,
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
        tensor.requires_grad,
    )


def tensor_from_wire(wire: tuple) -> torch.Tensor:
    """The tensor :func:`tensor_to_wire` was given, in memory of its own (never the sender's buffer)."""
    if wire[0] == "pickle":
        return pickle.loads(wire[1])
    _, data, dtype_name, shape, requires_grad = wire
    dtype = getattr(torch, dtype_name)
    if isinstance(data, list):  # one tensor in chunks: joined into memory of its own
        data = np.concatenate(data)
    elif data.size == 0:  # NumPy gives an empty array stride 0, which torch cannot reinterpret
        return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
    else:
        data = np.array(data, copy=True)
    tensor = torch.from_numpy(data).view(dtype).reshape(shape)
    return tensor.requires_grad_(requires_grad)


def use_fast_tensor_transport() -> None:
    """Register the tensor serializer in this process's Ray serialization context (idempotent)."""
    import ray.util

    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire)
