"""Freed memory stays in the process: training steps stop faulting their buffers back in.

Measured with the FedAvg CNN at batch 50 on 32x32 images, 1 thread: glibc's defaults cost about
3,500 minor page faults per step on this machine, and after ``retain_freed_memory`` none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fedray.platform.memory import retain_freed_memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")


def page_faults_per_step() -> float:
    """Minor page faults per training step of the FedAvg CNN, after warm-up steps, in this process."""
    import resource

    import torch
    import torch.nn.functional as F

    from fedray.platform.models import build_model

    torch.set_num_threads(1)
    model = build_model("fedavg_cnn", 3, 32, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(50, 3, 32, 32), torch.randint(0, 10, (50,))

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    steps(10)  # the heap grows to its working size
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps(10)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10


def faults_in_fresh_process(env: dict | None = None) -> tuple[str, float]:
    """(what ``retain_freed_memory`` returned, page faults per step) in a new Python process."""
    script = textwrap.dedent(
        """
        from fedray.platform.memory import retain_freed_memory
        from test_memory import page_faults_per_step
        print(retain_freed_memory())
        print(page_faults_per_step())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(__file__),
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return out[0], float(out[1])


@glibc
def test_training_steps_reuse_their_memory_after_retain_freed_memory():
    took_effect, faults = faults_in_fresh_process()
    assert took_effect == "True"
    assert faults < 50  # glibc's defaults: thousands per step (every freed buffer comes back as new pages)


@glibc
def test_the_users_own_malloc_settings_win():
    took_effect, _ = faults_in_fresh_process(env={"MALLOC_TRIM_THRESHOLD_": "65536"})
    assert took_effect == "False"


@glibc
def test_client_actors_retain_freed_memory(client_actor):
    import ray

    measure = page_faults_per_step  # runs inside the actor's process, so it travels by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        assert ray.get(client_actor.__ray_call__.remote(lambda _self: measure())) < 50
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_is_harmless_to_call_twice():
    first = retain_freed_memory()
    assert retain_freed_memory() == first
