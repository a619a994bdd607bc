"""Run torch work on a thread that ends with it.

torch runs a CPU operator on an OpenMP thread team that belongs to the calling thread and stays docked there
afterwards. While one thread keeps a docked team, libgomp counts more threads than cores and throttles the
spinning of every other thread's team: a 2-thread forward timed on another thread then measured 58–73 ms
against 45 ms (int8 Qwen2.5-0.5B on a 2-core AMD EPYC, the weights quantized on the building thread), and the
placement chose one thread for a model that two make faster. Work the engine does on a caller's behalf that
starts a team (quantizing weights, timing forwards) runs here, so the team ends with the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
