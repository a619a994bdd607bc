"""Where an ensemble's forwards run on the CPU: how many intra-op threads each kind of forward gets.

Why measured: whether a forward gains from a second core depends on the CPU (vector width, AMX / VNNI,
cache, memory bandwidth, a hypervisor's fork/join latency), the dtype and the member's size. On the 2-core
AMD EPYC (AVX2) this engine was first tuned on, HF `generate` of Qwen2.5-0.5B ran at 7.2 tok/s with one
thread and 6.6 with two; on a 2-core Intel Xeon (AVX-512, AMX) at 6.4 and 11.3. A constant tuned on one
machine is a bug on the other. So, unless the user chose torch's thread count, the engine times each
member's one-token step and its `CHUNK`-token pass (a verification) at 1 thread and at the candidate
counts up to all cores, when the ensemble is built, on a short-lived thread of its own (`measure_forwards`), and
plans from those times (`plan_placement`):

- the drafter alone (`method="single"`, the rounds schedule's drafting) gets its fastest one-token count;
- the rounds schedule's verifying phase gets the count that makes the verifiers' passes fastest;
- the overlap schedule splits the cores between drafter and verifiers (by the bytes each side reads per
  step), and is offered to the schedule gauge only where it is predicted to beat the rounds schedule
  (drafter step on its share against drafter step on its best count plus a verification per `CHUNK` tokens);
- a batch of several requests (multi-token forwards, one phase at a time) gets the drafter's fastest
  count for a `CHUNK`-token pass.

A thread count is set per thread (OpenMP keeps one per thread) and only on the engine's own threads (the
scheduler's worker, the forward pool) or on a caller's thread while it is lent to the engine (measuring, a
blocking `generate` running the rounds), which gets its count back: torch's process-wide default is left as
the user had it. Greedy text never depends on any of this.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from ..errors import MemberError
from .members import crop_cache
from .threads import on_short_lived_thread, release_thread_team

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_local = threading.local()
CHUNK = 5  # tokens of the measured verification pass (the default draft_length)
REPEATS = 3  # timed forwards per shape and count; the fastest is kept (a busy moment only slows one down)
WARM = 2  # untimed one-token steps first at each count
HOPELESS = 3  # a count whose first step takes this many times the best step so far is timed once, not REPEATS times
OVERLAP_MARGIN = 0.05  # overlap is offered to the gauge when predicted within 5 % of rounds (it times both)


@dataclass(frozen=True)
class Timing:
    """One member's measured forwards, in seconds by thread count: a one-token step over a cached prompt and a
    `CHUNK`-token pass (what a verification costs)."""

    name: str
    step: dict[int, float]
    chunk: dict[int, float]


@dataclass(frozen=True)
class Placement:
    """Intra-op threads per kind of forward, who chose them, and what was measured to choose them."""

    cores: int  # CPUs this process may run on
    drafter: int  # the drafter's forwards beside the verifiers (the overlap schedule)
    verifiers: int  # the verifiers' forwards beside the drafter (the overlap schedule)
    batch: int  # every forward of a batch of several requests (one phase at a time)
    process: int  # torch's count for every other thread (what the user has)
    chosen_by: str  # "engine", or "user" (torch.set_num_threads / OMP_NUM_THREADS: kept as set)
    alone: int = 0  # the drafter's forwards when it runs alone (single, rounds); 0: as `drafter`
    verifying: int = 0  # the verifiers' forwards in the rounds schedule (after the drafter's); 0: as `verifiers`
    overlap: bool | None = None  # whether the overlap schedule may pay here; None: when the split fits the cores
    # seconds per token by schedule, predicted from `timings`, what was measured (empty: nothing was); the
    # choices above are what compares (two measurements of one machine differ a little)
    predicted: dict[str, float] = field(default_factory=dict, compare=False)
    timings: tuple[Timing, ...] = field(default=(), compare=False)
    cpu: str = field(default="", compare=False)  # the CPU's model name

    def __post_init__(self) -> None:
        object.__setattr__(self, "alone", self.alone or self.drafter)
        object.__setattr__(self, "verifying", self.verifying or self.verifiers)
        if self.overlap is None:
            object.__setattr__(self, "overlap", self.drafter + self.verifiers <= self.cores)

    @property
    def spare(self) -> bool:
        """Whether the verifiers may run beside the drafter (the gauge then times the overlap schedule)."""
        return bool(self.overlap)

    def describe(self, measured: bool = True) -> str:
        """One line for logs: what was chosen and (`measured`) the timings it was chosen from."""
        where = f"{self.cores} core(s)" + (f" of {self.cpu}" if self.cpu else "")
        if self.chosen_by == "user":
            return f"user: {self.alone} thread(s) for every forward (torch.set_num_threads / OMP_NUM_THREADS), {where}"
        parts = [f"engine on {where}: drafter alone {self.alone} thread(s)"]
        if self.timings[1:] or not self.timings:
            parts.append(f"verifying {self.verifying}")
            split = f"overlap {self.drafter} + {self.verifiers}"
            if self.predicted:
                split += f" ({_ms(self.predicted['overlap'])} vs rounds {_ms(self.predicted['rounds'])} a token)"
            parts.append(split + (" timed by the gauge" if self.overlap else " not worth trying"))
        parts.append(f"batches {self.batch}")
        timed = "; ".join(
            f"{t.name} step " + ", ".join(f"{n}t {_ms(s)}" for n, s in sorted(t.step.items()))
            + f", {CHUNK} tokens " + ", ".join(f"{n}t {_ms(s)}" for n, s in sorted(t.chunk.items()))
            for t in self.timings
        )  # fmt: skip
        return ", ".join(parts) + (f" [measured: {timed}]" if measured and timed else "")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def plan_placement(
    weight_bytes: Sequence[int], drafter: int, timings: Sequence[Timing] | None = None, threads: int | None = None
) -> Placement:
    """The placement for CPU members with these weights (bytes read per decoding step), `drafter` indexing
    both lists, from `timings` (`measure_forwards`; None: plan from the weights alone, as before any was taken),
    where torch's count is `threads` (None: the calling thread's).

    Explicit choices win: OMP_NUM_THREADS / MKL_NUM_THREADS in the environment, or torch.set_num_threads
    to a count other than torch's default (before or after importing the engine); then every forward keeps
    that count, as it did before the engine placed its work."""
    cores, cpu = available_cores(), cpu_model()
    current = torch.get_num_threads() if threads is None else threads
    if threads_chosen_by_user(current):
        return Placement(cores, current, current, current, current, "user", cpu=cpu)
    if cores < 2:
        return Placement(cores, 1, 1, 1, current, "engine", overlap=False, cpu=cpu)
    drafting, verifying_beside = split_cores(weight_bytes, drafter, cores)
    if not timings:
        return Placement(cores, drafting, verifying_beside, max(current, 1), current, "engine", cpu=cpu)
    own = timings[drafter]
    others = [t for i, t in enumerate(timings) if i != drafter]
    alone = _fastest(own.step)
    batch = _fastest(own.chunk)
    if not others:  # nothing to verify: the drafter alone, and batches
        return Placement(cores, alone, alone, batch, current, "engine", overlap=False, timings=tuple(timings), cpu=cpu)
    verifying = min(own.chunk, key=lambda n: sum(t.chunk[n] for t in others))
    rounds = own.step[alone] + sum(t.chunk[verifying] for t in others) / CHUNK
    overlap = max(own.step[drafting], sum(t.step[verifying_beside] for t in others))
    return Placement(
        cores, drafting, verifying_beside, batch, current, "engine", alone, verifying,
        overlap <= rounds * (1 + OVERLAP_MARGIN), {"rounds": rounds, "overlap": overlap}, tuple(timings), cpu,
    )  # fmt: skip


def _fastest(seconds: dict[int, float]) -> int:
    """The thread count with the shortest time; the fewer threads on a tie."""
    return min(sorted(seconds), key=seconds.__getitem__)


def split_cores(weight_bytes: Sequence[int], drafter: int, cores: int) -> tuple[int, int]:
    """The overlap schedule's (drafter, verifiers) threads: the cores in proportion to the bytes each side
    reads per step, at least one each."""
    total = sum(weight_bytes) or 1
    share = round(cores * weight_bytes[drafter] / total)
    drafting = min(max(share, 1), cores - 1)
    return drafting, cores - drafting


def thread_counts(weight_bytes: Sequence[int], drafter: int) -> list[int]:
    """The counts worth timing: one thread, all cores, and the overlap split's shares."""
    cores = available_cores()
    return sorted({1, cores, *split_cores(weight_bytes, drafter, cores)}) if cores > 1 else [1]


# what a member's forwards measured, by thread counts: kept while the member lives (an ensemble rebuilt over
# the same members measures nothing again)
_measured: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Timing]] = weakref.WeakKeyDictionary()


def measure_forwards(members: Sequence[Any], counts: Sequence[int], again: bool = False) -> list[Timing]:
    """Each member's `Timing` at each of `counts` threads (kept from an earlier measurement of the member
    unless `again`), measured on a short-lived engine thread: a count set there touches no other thread, and
    its OpenMP team ends with it. (On the building thread the team would stay docked there, and throttle the
    worker thread that decodes streams and the server's requests: `make demo` fell to 1.0 tok/s that way.)"""
    key = tuple(counts)
    missing = [m for m in members if again or key not in _measured.get(m, {})]

    def run() -> None:
        engine_thread()
        for member in missing:
            try:
                _measured.setdefault(member, {})[key] = time_forwards(member, counts)
            except Exception as err:  # the member's first forward: say which member cannot run
                raise MemberError(
                    f"member {member.name!r} failed a forward pass while the ensemble timed its thread counts: "
                    f"{type(err).__name__}: {err}",
                    member=member.name,
                ) from err

    if missing:
        release_thread_team()  # a team the caller's torch work docked here would throttle the timed ones
        on_short_lived_thread(run, "safe-measure")
    return [_measured[m][key] for m in members]


@torch.inference_mode()
def time_forwards(member: Any, counts: Sequence[int]) -> Timing:
    """A member's one-token step and `CHUNK`-token pass over a cached prompt, at each thread count (run on an
    engine thread: `use_threads` sets the count there)."""
    ids = member.prompt_ids("The quick brown fox jumps over the lazy dog, and then it runs far away.")
    ids = (ids * (1 + (16 + CHUNK) // max(len(ids), 1)))[: 16 + CHUNK]
    prompt, tail = ids[:16], ids[16:]
    process = torch.get_num_threads()
    step: dict[int, float] = {}
    chunk: dict[int, float] = {}
    for count in counts:
        use_threads(count, process)
        cache = member.new_cache()
        member.forward(prompt, cache)
        repeats = REPEATS
        for warm in range(WARM):  # a new count starts a new thread team; quantized kernels pack on first use
            start = perf_counter()
            member.forward(tail[:1], cache)
            crop_cache(cache, len(prompt))
            if warm == 0 and step and perf_counter() - start > HOPELESS * min(step.values()):
                repeats = 1  # far slower than a count already timed (threads that spin against a busy core)
                break
        for shape, out in ((tail[:1], step), (tail, chunk)):
            times = []
            for _ in range(repeats):
                start = perf_counter()
                member.forward(shape, cache, keep=len(shape))
                times.append(perf_counter() - start)
                crop_cache(cache, len(prompt))
            out[count] = min(times)
        member.release(cache)
    return Timing(member.name, step, chunk)


def cpu_model() -> str:
    """The CPU's model name, as `lscpu` shows it (from /proc/cpuinfo; '' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_info() -> dict:
    """The CPU as `lscpu` names it, and its flags (what decides which kernels and thread counts are fast)."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next(
            (ln.split(":", 1)[1] for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
        )
    return {"model_name": cpu_model(), "cores": available_cores(), "flags": flags.split()}


def default_threads() -> int:
    """torch's count for threads started now (its process-wide default), read on a new thread: the calling
    thread's own count may differ (an engine thread's, a server's worker thread's)."""
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(torch.get_num_threads()), name="safe-threads")
    reader.start()
    reader.join()
    return seen[0]


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


@contextlib.contextmanager
def lent_thread() -> Iterator[None]:
    """The calling thread works as the engine's for a while (a caller running the rounds itself): the
    placement may set its thread count, which it gets back afterwards. No thread is started unless a count
    changes (a request that keeps the caller's count costs nothing here)."""
    if getattr(_local, "engine", False):
        yield
        return
    own = torch.get_num_threads()
    _local.engine, _local.process = True, None
    try:
        yield
    finally:
        if _local.process is not None:  # `use_threads` changed this thread's count: put it back
            use_threads(own, _local.process)
        _local.engine = False


def use_threads(count: int, process: int) -> None:
    """Give the calling engine thread `count` intra-op threads; other threads keep `process` (a no-op on a
    thread the engine does not own, and when the count is already set)."""
    if not getattr(_local, "engine", False) or torch.get_num_threads() == count:
        return
    torch.set_num_threads(count)  # this thread's count, and torch's default for threads started later...
    _local.process = process
    if count != process:  # ...which another thread sets back, since setting it here would change ours too
        restore = threading.Thread(target=torch.set_num_threads, args=(process,), name="safe-threads")
        restore.start()
        restore.join()
