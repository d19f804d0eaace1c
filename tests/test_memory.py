"""Freed memory stays in the process: ``retain_freed_memory`` sets glibc's allocator thresholds.

The tests read glibc's own bookkeeping (``mallinfo2``: how many blocks are mmapped), not page-fault
counts or timings, which depend on the kernel and on the machine's load. The effect on a training
step (about 3,500 minor faults per step of the FedAvg CNN at batch 50 before, none after) is
measured in the README's benchmark notes, not asserted here.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="mallopt and mallinfo2 are glibc's (2.33+)",
)


def block_is_mmapped(nbytes: int = 4 * 2**20) -> bool:
    """Whether glibc serves an ``nbytes`` block with its own mmap (rather than from the heap) here."""

    class MallInfo2(ctypes.Structure):  # defined here: the probe travels by value into an actor
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    mapped = libc.mallinfo2().hblks > before
    libc.free(block)
    return mapped


def in_fresh_process(env: dict | None = None, calls: int = 1) -> tuple[str, ...]:
    """What ``retain_freed_memory`` returned on each of ``calls`` calls, then whether a 4 MB block
    is mmapped, in a new process."""
    script = textwrap.dedent(
        f"""
        from fedray.platform.runtime.memory import retain_freed_memory
        from test_memory import block_is_mmapped
        for _ in range({calls}):
            print(retain_freed_memory())
        print(block_is_mmapped())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        cwd=os.path.dirname(__file__),
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return tuple(out)


@glibc
def test_large_blocks_come_from_the_heap_after_retain_freed_memory():
    assert in_fresh_process() == ("True", "False")


@glibc
def test_the_users_own_malloc_settings_win():
    # the user's 64 kB threshold stays: a 4 MB block is still mapped fresh
    assert in_fresh_process(env={"MALLOC_MMAP_THRESHOLD_": "65536"}) == ("False", "True")


@glibc
def test_client_actors_retain_freed_memory(client_actor):
    import ray

    probe = block_is_mmapped  # runs inside the actor's process, so it travels by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        assert ray.get(client_actor.__ray_call__.remote(lambda _self: probe())) is False
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@glibc
def test_a_second_call_keeps_the_settings():
    # both calls take effect, and a 4 MB block still comes from the heap after the second
    assert in_fresh_process(calls=2) == ("True", "True", "False")
