"""What each of a run's processes sets once for its role, in one place: torch's thread count, glibc's
allocator thresholds (:mod:`.memory`) and Ray's serializers for tensors (:mod:`.transport`).

============  ==============================  ======================  ==========================
role          torch threads                   keeps freed memory      tensors as raw bytes
============  ==============================  ======================  ==========================
driver        the user's                      no                      shards, global test set
coordinator   1 (small tensor math) [#]_      a round's uplinks       downlinks
worker        its CPUs (num_cpus_per_client)  a training step's       uplinks, client states
============  ==============================  ======================  ==========================

.. [#] FedAvg's average sums its blocks on threads of its own (``algorithms/fedavg.py``): between
   rounds the clients' CPUs are idle.

A worker's thread count is set by :class:`~fedray.platform.runtime.worker.ClientHost` itself
(:func:`set_worker_threads`), so a host driven without Ray (tests, benchmarks) trains as an actor does.
"""

from __future__ import annotations

import os

import torch

from fedray.platform.runtime.memory import retain_freed_memory
from fedray.platform.runtime.transport import use_fast_tensor_transport


def set_up_driver() -> None:
    use_fast_tensor_transport()


def set_up_coordinator() -> None:
    # the server half computes on the CPU, and Ray hides the GPUs from no actor that asks for none;
    # set before anything initialises CUDA in this process (in its env, the actors it starts would
    # inherit it: coordinator.COORDINATOR_ENV)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    use_fast_tensor_transport()
    retain_freed_memory()  # a round's uplinks reuse the last round's memory instead of fresh pages


def set_up_worker() -> None:
    use_fast_tensor_transport()
    retain_freed_memory()  # a training step reuses the last step's buffers instead of faulting in new pages


def set_worker_threads(num_threads: int) -> None:
    torch.set_num_threads(max(1, num_threads))
