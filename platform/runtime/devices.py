"""Which device a worker trains on, its settings, and which of its errors mean the device is broken.

The device comes from the config and from Ray's assignment, never from what the process can see: on
a GPU node Ray no longer hides the GPUs from an actor that asked for none, so a worker started with
``ray.num_gpus_per_client=0`` would otherwise train on GPU 0 outside Ray's accounting. A worker
that asked for a GPU slice trains on the GPU Ray gave it (``CUDA_VISIBLE_DEVICES`` then shows it as
``cuda:0``), and on the CPU when the process has no CUDA (a node that declares GPUs it does not
have, as the tests do); either way the run records what was used.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from fedray.platform.config import ExperimentConfig, TrainConfig
from fedray.platform.errors import ConfigError

# cuBLAS picks non-deterministic reductions unless its workspace is fixed before the first CUDA call
CUBLAS_DETERMINISTIC = ":4096:8"


@dataclass(frozen=True)
class DeviceInfo:
    """What a worker trains on, as the run records it."""

    kind: str  # "cpu" | "cuda"
    name: str  # "cpu", "NVIDIA H100 80GB HBM3"
    gpu_ids: tuple[str, ...] = ()  # Ray's assignment (may be set while kind is cpu: no CUDA here)
    note: str = ""  # why a worker with a GPU assignment trains on the CPU

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"cuda ({self.name}, Ray GPU {','.join(self.gpu_ids)})"
        return f"cpu ({self.note})" if self.note else "cpu"


def assigned_gpu_ids() -> tuple[str, ...]:
    """The GPUs Ray assigned to this process (none outside a Ray worker)."""
    import ray

    if not ray.is_initialized():
        return ()
    try:
        return tuple(str(i) for i in ray.get_gpu_ids())
    except Exception:  # the driver, or a Ray that cannot tell: no assignment
        return ()


def missing_gpus(need: float, have: float, where: str) -> ConfigError:
    return ConfigError(
        f"ray.num_gpus_per_client={need:g}: {where} {have:g} GPUs; set ray.num_gpus_per_client=0 "
        "to train on CPUs, or join a cluster with GPUs (RAY_ADDRESS)"
    )


def require_visible_gpus(need: float, cluster_address: str) -> None:
    """A run that asks for GPUs and will start a local Ray needs this machine to have them (Ray would
    otherwise wait forever to place a ClientActor no node can hold). Needs torch only, so the command
    line checks it before the heavy imports; a cluster (``RayConfig.cluster_address``, or one this
    process already joined with its own ``ray.init``) is asked once joined."""
    joined = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # without importing Ray
    if need <= 0 or joined or cluster_address:
        return
    have = torch.cuda.device_count()
    if have < need:
        raise missing_gpus(need, have, "this machine has")


def worker_device(
    cfg: ExperimentConfig, gpu_ids: tuple[str, ...] | None = None
) -> tuple[torch.device, DeviceInfo]:
    """The device this worker trains on: the CPU unless the run asked for GPUs and Ray gave some."""
    if cfg.ray.num_gpus_per_client <= 0:
        return torch.device("cpu"), DeviceInfo("cpu", "cpu")
    ids = assigned_gpu_ids() if gpu_ids is None else gpu_ids
    if not ids:
        return torch.device("cpu"), DeviceInfo("cpu", "cpu", note="no GPU assigned by Ray")
    if not torch.cuda.is_available():
        note = f"Ray assigned GPU {','.join(ids)}, but CUDA is not available in this process"
        return torch.device("cpu"), DeviceInfo("cpu", "cpu", ids, note)
    return torch.device("cuda", 0), DeviceInfo("cuda", torch.cuda.get_device_name(0), ids)


def configure_device(device: torch.device, train: TrainConfig, gpu_fraction: float) -> None:
    """The process-wide settings a GPU worker trains under: TF32 off unless asked for, deterministic
    kernels when asked for, and a memory cap of its share of the GPU. Nothing to do on a CPU (its
    kernels are deterministic for a fixed thread count, and the deterministic mode's NaN-filling of
    fresh memory would only slow it down)."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)  # before the first cuBLAS call
    torch.backends.cuda.matmul.allow_tf32 = train.tf32
    torch.backends.cudnn.allow_tf32 = train.tf32
    torch.backends.cudnn.benchmark = not train.deterministic
    torch.backends.cudnn.deterministic = train.deterministic
    # set either way: a kept worker's last run may have turned it on (KeptRuntime)
    torch.use_deterministic_algorithms(train.deterministic, warn_only=True)
    if 0 < gpu_fraction < 1:  # a slice: this process may not take its neighbours' memory
        torch.cuda.set_per_process_memory_fraction(gpu_fraction, device)


def image_memory_format(train: TrainConfig, device: torch.device) -> torch.memory_format:
    """How a worker lays out its image tensors (``train.memory_format``). ``auto`` picks channels_last
    on a CPU, where oneDNN's convolutions run faster on it (a 5-step client of the FedAvg CNN at
    batch 10 trains in about 0.7 of the time), and NCHW on a GPU, where it is not measured yet."""
    if train.memory_format == "auto":
        return torch.channels_last if device.type == "cpu" else torch.contiguous_format
    return torch.channels_last if train.memory_format == "channels_last" else torch.contiguous_format


def laid_out(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``x`` in ``memory_format`` when it is a batch of images of more than one channel; anything
    else as it is (a one-channel image is the same in either layout, and only 4-D tensors have one)."""
    if x.dim() != 4 or x.shape[1] == 1:
        return x
    return x.contiguous(memory_format=memory_format)


class DeviceError(RuntimeError):
    """The worker's device failed (a CUDA error, out of memory twice): the worker is replaced and
    its clients run again elsewhere; it is not the client's fault."""


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(err)


def is_device_error(err: BaseException) -> bool:
    """A CUDA runtime or driver failure rather than a bug in the client's code."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if accelerator_error and isinstance(err, accelerator_error):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        marker in text
        for marker in ("CUDA error", "CUDA driver", "cuDNN error", "CUBLAS_STATUS", "NCCL error")
    )
