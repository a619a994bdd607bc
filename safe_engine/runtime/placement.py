"""Where an ensemble's forwards run on the CPU: how many intra-op threads the drafter and the verifiers get.

Why: torch gives every forward all the cores it finds. Decoding one token reads every weight once, so it is
bound by memory bandwidth and a second thread buys little (HF `generate` of Qwen2.5-0.5B on the 2-core CI
machine: 6.56 tok/s with torch's 2 threads, 7.19 with 1), while it leaves no core on which the verifiers
could score beside the drafter (the overlap schedule). So unless the user chose torch's thread count, the
engine splits the cores this process may use (`os.sched_getaffinity`) between its drafting thread and its
verifying thread, in proportion to the bytes of weights each reads per step, and gives a batch of several
requests (one phase at a time, compute grows with the batch) all of them.

A thread count is set per thread (OpenMP keeps one per thread) and only on the engine's own threads (the
scheduler's worker, the forward pool): a caller's threads keep torch's settings, and torch's process-wide
default is left as the user had it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_local = threading.local()


@dataclass(frozen=True)
class Placement:
    """Intra-op threads per kind of work, and who chose them."""

    cores: int  # CPUs this process may run on
    drafter: int  # the drafter's forwards of a lone request
    verifiers: int  # the verifiers' forwards of a lone request (beside the drafter's when overlapping)
    batch: int  # every forward of a batch of several requests (one phase at a time)
    process: int  # torch's count for every other thread (what the user has)
    chosen_by: str  # "engine", or "user" (torch.set_num_threads / OMP_NUM_THREADS: kept as set)

    @property
    def spare(self) -> bool:
        """Whether the verifiers have cores of their own beside the drafter's (the overlap schedule can pay)."""
        return self.drafter + self.verifiers <= self.cores

    def describe(self) -> str:
        """One line for logs and stats: 'engine: drafter 1 + verifiers 1 of 2 cores, batches 2'."""
        return (
            f"{self.chosen_by}: drafter {self.drafter} + verifiers {self.verifiers} thread(s) of {self.cores} "
            f"core(s), batches {self.batch}"
        )


def plan_placement(weight_bytes: Sequence[int], drafter: int) -> Placement:
    """The placement for CPU members with these weights (bytes read per decoding step), `drafter` indexing it.

    Explicit choices win: OMP_NUM_THREADS / MKL_NUM_THREADS in the environment, or torch.set_num_threads
    to a count other than torch's default (before or after importing the engine); then every forward keeps
    that count, as it did before the engine placed its work."""
    cores = available_cores()
    current = torch.get_num_threads()
    if threads_chosen_by_user(current):
        return Placement(cores, current, current, current, current, "user")
    if cores < 2:
        return Placement(cores, 1, 1, 1, current, "engine")
    total = sum(weight_bytes) or 1
    share = round(cores * weight_bytes[drafter] / total)
    drafting = min(max(share, 1), cores - 1)
    return Placement(cores, drafting, cores - drafting, max(current, 1), current, "engine")


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit counts)."""
    return len(_affinity())


def threads_chosen_by_user(current: int) -> bool:
    """Whether torch's thread count was chosen rather than defaulted: an environment variable sets it, or it
    differs from both counts torch may default to (logical CPUs, physical cores)."""
    if any(os.environ.get(name) for name in _THREAD_ENV):
        return True
    return current not in {available_cores(), physical_cores()}


def physical_cores() -> int:
    """Physical cores among this process's CPUs (MKL's default thread count, which torch adopts)."""
    cores = set()
    for cpu in _affinity():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return available_cores()
    return len(cores) or available_cores()


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def engine_thread() -> None:
    """Mark the calling thread as the engine's own: `use_threads` may then set its torch thread count."""
    _local.engine = True


def use_threads(count: int, process: int) -> None:
    """Give the calling engine thread `count` intra-op threads; other threads keep `process` (a no-op on a
    thread the engine does not own, and when the count is already set)."""
    if not getattr(_local, "engine", False) or torch.get_num_threads() == count:
        return
    torch.set_num_threads(count)  # this thread's count, and torch's default for threads started later...
    restore = threading.Thread(target=torch.set_num_threads, args=(process,), name="safe-threads")
    restore.start()  # ...which another thread sets back, since setting it here would change ours too
    restore.join()
