"""Run torch work on a thread that ends with it, and release a thread's docked OpenMP team.

torch runs a CPU operator on an OpenMP thread team that belongs to the calling thread and stays docked there
afterwards. While one thread keeps a docked team, libgomp counts more threads than cores and throttles the
spinning of every other thread's team: a 2-thread forward timed on another thread then measured 58–89 ms
against 45–52 ms (int8 Qwen2.5-0.5B on a 2-core AMD EPYC, after the building thread had quantized the weights
or run other torch work), and the placement chose one thread for a model that two make faster. So the engine
does its own such work (quantizing weights, timing forwards) on short-lived threads, and before timing it
releases the team that the caller's earlier torch work left docked on the caller's thread.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_OMP_PAUSE_SOFT = 1


def on_short_lived_thread(work: Callable[[], T], name: str) -> T:
    """`work()` on a new thread that ends with it: its result, or its exception raised here."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as err:  # re-raised on the caller's thread
            failure.append(err)

    worker = threading.Thread(target=run, name=name)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


def release_thread_team() -> bool:
    """End the OpenMP team docked on the calling thread (libgomp's `omp_pause_resource_all`, which frees the
    calling thread's pool; its next parallel operator starts a new team). True where a loaded libgomp did it;
    False where the process has no libgomp (another OpenMP runtime, or no /proc): nothing is released there."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return False
    libraries = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    released = False
    for library in sorted(libraries):
        pause = getattr(ctypes.CDLL(library), "omp_pause_resource_all", None)
        if pause is not None and pause(_OMP_PAUSE_SOFT) == 0:
            released = True
    return released
