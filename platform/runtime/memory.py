"""Keep freed memory in the process: training allocates and frees the same buffers every step.

glibc's malloc hands blocks over 128 kB out as fresh ``mmap`` pages, and gives the top of its heap
back to the OS whenever more than its trim threshold lies free there. A training step frees its
activations and im2col buffers and allocates them again in the next step, so each step faults them
back in page by page, and the kernel zeroes every page first. For the FedAvg CNN at batch 50 that
is about 3,500 page faults per step in a fresh process, 16 % of a 1-thread step spent in the kernel.

:func:`retain_freed_memory` sets both thresholds once per process (the ClientActors and the
Coordinator call it when they start, :mod:`.process_roles`): blocks up to 32 MB (glibc's largest
allowed setting) come from the heap, and the heap keeps up to 1 GiB of freed memory for the next step. A process's peak memory does not grow; its
resident memory just no longer shrinks between steps. Larger blocks are still mapped fresh.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses anything above HEAP_MAX_SIZE / 2 = 32 MB on 64-bit
TRIM_THRESHOLD = 2**30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; True when both took effect.

    A no-op (False) on a C library without ``mallopt`` (macOS, musl) and when the user has set
    glibc's own ``MALLOC_*_THRESHOLD_`` variables, which then win.
    """
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library already loaded (find_library would run ldconfig)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
