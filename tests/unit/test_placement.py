"""The CPU placement: the engine times its members' forwards at each thread count worth trying and plans from
them (the drafter alone at its fastest count, the verifying phase at the verifiers' fastest, overlap only where it
can pay), unless the user chose torch's threads; sets thread counts on its own threads only, and never changes
the greedy text."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from safe_engine import Ensemble, MemberError
from safe_engine.runtime import placement as placement_module
from safe_engine.runtime.placement import Placement, Timing, plan_placement
from tests.conftest import tiny_member
from tests.unit.test_quantization import int8_member

PROMPT = "The quick brown fox"
SCHEDULES = [{"schedule": "rounds", "adaptive_draft": False}, {"schedule": "overlap"}, {"schedule": "auto"}]


@pytest.fixture
def two_cores(monkeypatch):
    """A real 2-core machine as the placement sees it, torch at its default count there (2), put back after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(placement_module, "available_cores", lambda: 2)
    monkeypatch.setattr(placement_module, "physical_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default on a 2-core machine
    yield
    torch.set_num_threads(before)


# Timings in seconds as measured on the project's two kinds of machine (one-token step, 5-token pass):
AMD = [  # 2-core AMD EPYC, AVX2 only: one thread is the faster
    Timing("qwen", step={1: 0.139, 2: 0.151}, chunk={1: 0.27, 2: 0.25}),
    Timing("smollm2", step={1: 0.050, 2: 0.048}, chunk={1: 0.082, 2: 0.070}),
]
XEON = [  # 2-core Intel Xeon, AVX-512 + AMX: two threads nearly halve a step
    Timing("qwen", step={1: 0.205, 2: 0.110}, chunk={1: 0.41, 2: 0.21}),
    Timing("smollm2", step={1: 0.070, 2: 0.047}, chunk={1: 0.13, 2: 0.085}),
]


def test_the_plan_follows_what_was_measured_on_each_kind_of_machine(machine):
    machine(2)
    amd = plan_placement([400, 100], drafter=0, timings=AMD)
    assert (amd.alone, amd.verifying, amd.drafter, amd.verifiers, amd.batch) == (1, 2, 1, 1, 2)
    assert amd.spare  # overlap: max(139, 48) ms a token against rounds' 139 + 70 / 5: the gauge times it
    assert amd.predicted == pytest.approx({"rounds": 0.139 + 0.070 / 5, "overlap": 0.139})
    xeon = plan_placement([400, 100], drafter=0, timings=XEON)
    assert (xeon.alone, xeon.verifying, xeon.batch) == (2, 2, 2)
    assert not xeon.spare  # the drafter on one core (205 ms) loses to rounds on two (110 + 85 / 5): not tried
    assert "not worth trying" in xeon.describe() and "qwen step 1t 205 ms, 2t 110 ms" in xeon.describe()
    alone = plan_placement([400], drafter=0, timings=XEON[:1])  # method="single" / a one-member ensemble
    assert (alone.alone, alone.batch, alone.spare) == (2, 2, False)
    assert plan_placement([400], drafter=0, timings=AMD[:1]).alone == 1
    machine(2, torch_threads=1)  # the user's count wins over any measurement
    assert plan_placement([400, 100], drafter=0, timings=XEON).alone == 1


@pytest.mark.parametrize("faster", [1, 2], ids=["one-thread-machine", "two-thread-machine"])
def test_an_ensemble_measures_its_members_and_runs_each_forward_at_the_faster_count(faster, two_cores, fake_clock):
    """A machine where one thread is faster and one where two are (the fake clock says so): the ensemble built
    on it times its members, and the drafter alone, the rounds schedule's phases and a batch run at that count."""
    fake_clock({faster: 1 / 64, 3 - faster: 1 / 32})  # binary fractions: exact sums, exact ties
    members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)]
    ens = Ensemble(members)
    placement = ens.placement
    assert placement is not None and placement.chosen_by == "engine"
    assert [t.name for t in placement.timings] == ens.names
    assert all(t.step == {faster: 1 / 64, 3 - faster: 1 / 32} for t in placement.timings), placement.timings
    assert (placement.alone, placement.verifying, placement.batch) == (faster, faster, faster)
    assert placement.spare == (faster == 1)  # split 1 + 1 is as fast as each alone only on the first
    seen: dict[str, set[int]] = {"drafter": set(), "verifiers": set()}
    for member, side in zip(members, seen):
        original = member.forward_many

        def counted(jobs, original=original, side=side):
            seen[side].add(torch.get_num_threads())
            return original(jobs)

        member.forward_many = counted
    ens.generate(PROMPT, max_new_tokens=8, method="single")
    ens.generate(PROMPT, max_new_tokens=12, schedule="rounds")
    ens.generate_batch([PROMPT, "Hello there"], max_new_tokens=6)
    assert seen == {"drafter": {faster}, "verifiers": {faster}}
    assert torch.get_num_threads() == 2  # the caller's thread kept its count


def test_measure_placement_follows_a_machine_whose_load_changed(two_cores, fake_clock, monkeypatch):
    """Built while one thread is the faster (a busy neighbour), the placement keeps that (an ensemble rebuilt
    over the same members too) until `measure_placement` times the forwards again: then two threads, which the
    next request's forwards use."""
    fake_clock({1: 1 / 64, 2: 1 / 2})
    members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)]
    ens = Ensemble(members)
    assert ens.placement is not None and ens.placement.alone == 1
    fake_clock({1: 1 / 32, 2: 1 / 64})  # the neighbour left
    assert Ensemble(members).placement == ens.placement  # what was measured of these members is kept
    placement = ens.measure_placement()
    assert placement is ens.placement and placement is not None
    assert (placement.alone, placement.verifying, placement.batch) == (2, 2, 2)
    assert placement.timings[0].step == {1: 1 / 32, 2: 1 / 64}
    seen: list[int] = []
    original = members[0].forward_many

    def counted(jobs):
        seen.append(torch.get_num_threads())
        return original(jobs)

    monkeypatch.setattr(members[0], "forward_many", counted)
    ens.generate(PROMPT, max_new_tokens=6, method="single")
    assert set(seen) == {2}
    torch.set_num_threads(1)  # the user's choice now: kept, nothing timed
    assert ens.measure_placement() == Placement(2, 1, 1, 1, 1, "user")


def test_a_hopeless_thread_count_is_timed_once(fake_clock, monkeypatch):
    """Threads that spin against a busy core (llama.cpp's, beside another process) can make a count 50x slower:
    such a count is timed once per shape instead of warming up and repeating, so loading stays quick."""
    fake_clock({1: 1 / 64, 2: 1 / 2})
    member = tiny_member("qwen2.5-7b-instruct", 1)
    calls = {1: 0, 2: 0}
    original = member.forward

    def counted(*args, **kwargs):
        calls[torch.get_num_threads()] += 1
        return original(*args, **kwargs)

    member.forward = counted
    before = torch.get_num_threads()
    placement_module.engine_thread()  # this test's thread may set its count, as the engine's measuring thread
    try:
        timing = placement_module.time_forwards(member, [1, 2])
    finally:
        placement_module._local.engine = False
        torch.set_num_threads(before)
    assert calls == {
        1: 1 + placement_module.WARM + 2 * placement_module.REPEATS,  # prompt, warm steps, both shapes repeated
        2: 1 + 1 + 2,  # prompt, one warm step found hopeless, each shape once
    }
    assert timing.step == {1: 1 / 64, 2: 1 / 2} and timing.chunk == {1: 1 / 64, 2: 1 / 2}


def test_the_engine_splits_the_cores_by_the_weights_each_side_reads(machine):
    machine(2)
    assert plan_placement([400, 100], drafter=0) == Placement(2, 1, 1, 2, 2, "engine")
    machine(8)
    assert plan_placement([600, 100, 100], drafter=0) == Placement(8, 6, 2, 8, 8, "engine")
    assert plan_placement([100, 600, 100], drafter=0) == Placement(8, 1, 7, 8, 8, "engine")  # a small drafter
    assert plan_placement([10**9, 1], drafter=0).verifiers == 1  # each side keeps at least one core
    machine(1)
    one = plan_placement([400, 100], drafter=0)
    assert (one.drafter, one.verifiers, one.spare) == (1, 1, False)  # nothing to overlap with


def test_a_thread_count_the_user_chose_is_kept(machine, monkeypatch):
    machine(4, torch_threads=1)  # torch.set_num_threads(1)
    assert plan_placement([400, 100], drafter=0) == Placement(4, 1, 1, 1, 1, "user")
    machine(4, torch_threads=3)
    kept = plan_placement([400, 100], drafter=0)
    assert (kept.drafter, kept.verifiers, kept.batch, kept.chosen_by, kept.spare) == (3, 3, 3, "user", False)
    machine(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the environment says so, even at the default count
    assert plan_placement([400, 100], drafter=0).chosen_by == "user"


def test_threads_are_set_on_the_engines_threads_only(members3):
    """The drafter's and the verifiers' forwards run with the placement's counts; the caller's thread and
    threads started later keep torch's count."""
    ens = Ensemble(members3)
    before = torch.get_num_threads()
    ens.placement = Placement(2, 1, 1, 2, before, "engine")
    seen: dict[str, set[int]] = {"drafter": set(), "verifiers": set()}
    for member, side in zip(ens.members, ("drafter", "verifiers", "verifiers")):
        original = member.forward_many

        def counted(jobs, original=original, side=side):
            seen[side].add(torch.get_num_threads())
            return original(jobs)

        member.forward_many = counted
    for options in SCHEDULES:
        ens.generate(PROMPT, max_new_tokens=24, **options)
    assert seen == {"drafter": {1}, "verifiers": {1}}
    ens.placement = Placement(2, 1, 1, 2, before, "engine")
    ens.generate_batch([PROMPT, "Hello there"], max_new_tokens=12)
    assert seen["drafter"] == {1, 2}  # a batch: all cores, one phase at a time
    assert torch.get_num_threads() == before
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [before]  # torch's process-wide default is as it was


def test_a_request_starts_a_thread_only_to_put_back_a_count_it_changed(members3, monkeypatch):
    """Setting a count on the caller's thread also sets torch's default for threads started later, which only
    another thread can put back: a request pays that thread start when the placement changes the caller's count
    to one other than the default, and not otherwise (before, every blocking request started two or three)."""
    ens = Ensemble(members3)
    before = torch.get_num_threads()  # 1 in this package (see conftest)
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    ens.placement = Placement(2, 1, 1, before, before, "engine", alone=before, verifying=before, overlap=False)
    ens.generate(PROMPT, max_new_tokens=8, schedule="rounds")
    assert started == []
    ens.placement = Placement(2, 1, 1, 2, before, "engine", alone=2, verifying=2, overlap=False)
    seen: list[int] = []
    original = ens.members[0].forward_many

    def counted(jobs):
        seen.append(torch.get_num_threads())
        return original(jobs)

    monkeypatch.setattr(ens.members[0], "forward_many", counted)
    ens.generate(PROMPT, max_new_tokens=8, schedule="rounds")
    assert set(seen) == {2} and started == ["safe-threads"]  # set once for the request, default put back once
    assert torch.get_num_threads() == before  # the caller's count back, without another thread
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [before]  # torch's default as it was


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_the_placement_never_changes_the_greedy_text(quantized):
    """Every schedule with the engine's placement and with the user's 1 or 2 threads gives round-based SAFE's
    text on the same members."""
    if quantized:
        members = [int8_member("qwen2.5-7b-instruct", 1), int8_member("llama2", 2)]
    else:
        from tests.conftest import tiny_member

        members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)]
    ens = Ensemble(members)
    ens.placement = None  # rounds on the caller's settings: the reference
    reference = ens.generate(PROMPT, max_new_tokens=60, schedule="rounds", adaptive_draft=False)
    assert reference.stats.ensembled_tokens > 0
    process = torch.get_num_threads()
    placements = [
        Placement(2, 1, 1, 2, process, "engine"),
        Placement(2, 1, 1, 1, process, "user"),
        Placement(4, 2, 2, 2, process, "user"),
        Placement(2, 1, 1, 2, process, "engine", alone=2, verifying=2, overlap=True),
    ]
    for placement in placements:
        ens.placement = placement
        for options in SCHEDULES:
            res = ens.generate(PROMPT, max_new_tokens=60, **options)
            assert res.text == reference.text, (placement, options)
            assert res.stats.ensembled_tokens == reference.stats.ensembled_tokens


def test_every_door_gets_the_engines_placement_or_keeps_the_users_threads(machine, fake_clock, model_dirs):
    """The engine, the CLI's loader (which `generate` and `serve` share), LangChain (SafeLLM, ChatSafe) and
    LlamaIndex all decode through an `Ensemble` that measured its members and placed its work, or kept the
    user's thread count."""
    from langchain_safe import ChatSafe
    from langchain_safe import SafeLLM as LangChainLLM
    from llamaindex_safe import SafeLLM as LlamaIndexLLM
    from safe_engine.cli import build_parser
    from safe_engine.cli.args import load

    serve = ["serve", "-m", model_dirs[0], "-m", model_dirs[1]]

    def placements() -> list[Placement | None]:
        return [
            Ensemble.from_pretrained(model_dirs).placement,
            load(build_parser().parse_args(serve), announce=False).placement,
            LangChainLLM(models=model_dirs).get_ensemble().placement,
            ChatSafe(models=model_dirs).get_ensemble().placement,
            LlamaIndexLLM(models=model_dirs).ensemble.placement,
        ]

    machine(2)
    fake_clock({2: 1 / 64})  # every count as fast: the fewer threads win the tie
    engine = placements()
    assert all(p is not None and p.chosen_by == "engine" and (p.drafter, p.verifiers) == (1, 1) for p in engine)
    assert all(p is not None and len(p.timings) == 2 and p.timings[0].step == {1: 1 / 64, 2: 1 / 64} for p in engine)
    assert len(set(engine)) == 1 and engine[0] is not None and engine[0].alone == 1
    machine(2, torch_threads=1)  # torch.set_num_threads(1) in the user's script
    assert all(p is not None and p.chosen_by == "user" and p.drafter == p.verifiers == 1 for p in placements())


def test_a_member_that_cannot_run_a_forward_is_named_when_the_ensemble_times_it(fake_clock, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(placement_module, "available_cores", lambda: 2)
    monkeypatch.setattr(placement_module, "physical_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        broken = tiny_member("llama2", 2)

        def fail(*args, **kwargs):
            raise RuntimeError("out of memory")

        broken.forward = fail
        with pytest.raises(MemberError, match=r"llama2-2.*timed its thread counts.*out of memory") as raised:
            Ensemble([tiny_member("qwen2.5-7b-instruct", 1), broken])
        assert raised.value.member == "llama2-2"
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(before)


RELEASE_SCRIPT = """
import os, sys, time
import torch
from safe_engine.runtime.threads import release_thread_team

def tasks():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
alone = tasks()
torch.ones(4_000_000).exp_()  # a parallel operator: a team of 2 docks on this thread
docked = tasks()
released = release_thread_team() if sys.argv[1] == "release" else False
deadline = time.monotonic() + 2
while tasks() > alone and time.monotonic() < deadline:
    time.sleep(0.02)
print(alone, docked, tasks(), released)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_release_thread_team_ends_the_team_the_callers_torch_work_docked():
    """Timing forwards while the caller's thread keeps a docked team measured a 2-thread step at 58-89 ms
    against 45-52 ms (int8 Qwen, AMD EPYC): `measure_forwards` releases it first. In a fresh process, a
    parallel operator docks a second thread; it is still there without the release and gone with it."""
    counts = {}
    for mode in ("keep", "release"):
        out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT, mode], capture_output=True, text=True, check=True)
        alone, docked, after, released = out.stdout.split()
        counts[mode] = (int(alone), int(docked), int(after), released)
    alone, docked, after, released = counts["keep"]
    assert docked == alone + 1 and after == docked and released == "False"
    alone, docked, after, released = counts["release"]
    assert docked == alone + 1 and after == alone and released == "True"
