"""Process-wide memory settings for a dedicated process (a server, a benchmark): glibc's mmap threshold.

By default glibc raises its mmap threshold, up to 32 MiB, as large blocks are freed, so later
blocks below it come from per-thread heaps that fragment and stay resident: a server's RSS
creeps up request after request, and a benchmark's later provider reuses pages an earlier one
left and looks free. `return_freed_memory` pins the threshold, so every block over it is its own
mapping, unmapped on free. Blocks below it come from the heap; code that allocates many
same-sized buffers (the server's response pieces) keeps them below `MMAP_THRESHOLD` so that
each one reuses heap memory instead of paying an mmap, its page faults and an munmap.

Limits: Linux with glibc; elsewhere nothing is pinned.
"""

from __future__ import annotations

import ctypes

MMAP_THRESHOLD = 256 << 10
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def return_freed_memory(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at `mmap_threshold` (trim threshold twice that) for this
    process; True when glibc took both. Idempotent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
                    and libc.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1)
    except (OSError, AttributeError):  # not glibc: nothing to pin
        return False
