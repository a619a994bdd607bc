"""Giving freed memory back to the operating system when the engine goes idle.

Why: each request allocates tensors of its own sizes (logits rows, packed inputs, KV caches) from several
threads (the scheduler's, the member forwards', the server's tokenizing workers). glibc's malloc keeps what
they free in its arenas for reuse. `malloc_trim(0)` returns the free pages of every arena; the scheduler
calls it when its last request is over, off the request path. On the soak's tiny models it keeps a server
~130 MB smaller (benchmarks/soak.py; docs/serve.md, "Memory over weeks", also has what made servers grow).
Set SAFE_ENGINE_TRIM_IDLE=0 to turn it off (to compare, or under another allocator such as jemalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
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


def trim_when_idle() -> bool:
    """Whether the scheduler gives freed memory back when it goes idle (SAFE_ENGINE_TRIM_IDLE, default on)."""
    return os.environ.get("SAFE_ENGINE_TRIM_IDLE", "1").strip().lower() not in ("0", "false", "no", "off")


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True if the allocator supports it (glibc) and it is on."""
    trim = _malloc_trim()
    if trim is None or not trim_when_idle():
        return False
    trim(0)
    return True
