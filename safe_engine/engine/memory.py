"""Giving freed memory back to the operating system when the engine goes idle.

Why: each request allocates tensors of its own sizes (logits rows, packed inputs, KV caches) from several
threads. glibc's malloc keeps what they free in per-thread arenas for reuse, so a long-running process
(a server) grows wave after wave although no live object remains. `malloc_trim(0)` returns the free
pages; the scheduler calls it when its last request is over (benchmarks/idle_memory.py measures it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is another (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True if the allocator supports it (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
