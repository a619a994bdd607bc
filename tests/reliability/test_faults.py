"""Faults inside a batched round: a member's forward that fails (out of memory) fails the round's requests
with a MemberError naming the member, frees their caches, and leaves the ensemble serving."""

from __future__ import annotations

import pytest
import torch

from safe_engine import MemberError

from .conftest import live_caches, wait_until

PROMPTS = ["It was a bright cold day in April", "The clocks were striking", "Call me Ishmael. Some years ago"]
NEXT = "Whether I shall turn out to be the hero"


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("CUDA out of memory")],
    ids=["OutOfMemoryError", "RuntimeError"],
)
@pytest.mark.parametrize("who", [0, 2], ids=["drafter", "verifier"])
def test_a_member_failing_mid_batched_round_fails_that_round_with_a_member_error(ens3, monkeypatch, error, who):
    expected = ens3.generate(NEXT, max_new_tokens=8).text
    baseline = live_caches()
    member = ens3.members[who]
    original = member.forward_many
    batches: list[int] = []

    def forward_many(jobs):
        if len(jobs) == len(PROMPTS) and not batches:  # the first forward over the whole batch fails
            batches.append(len(jobs))
            raise error
        return original(jobs)

    streams = [ens3.stream(p, max_new_tokens=200) for p in PROMPTS]
    for s in streams:
        assert next(s)  # every request is live (each has produced text) before the fault
    monkeypatch.setattr(member, "forward_many", forward_many)
    for s in streams:
        with pytest.raises(MemberError) as raised:
            for _ in s:
                pass
        assert raised.value.member == ens3.names[who]
        assert f"member {ens3.names[who]!r}" in str(raised.value) and "out of memory" in str(raised.value)
        assert raised.value.__cause__ is error
    assert batches == [len(PROMPTS)]  # one failing forward, over the three requests at once
    assert wait_until(lambda: ens3.open_requests == 0) and ens3.wait_idle(30)
    del streams, s, raised
    assert live_caches() <= baseline  # the failed requests' caches are gone although their errors live on
    monkeypatch.undo()
    assert ens3.generate(NEXT, max_new_tokens=8).text == expected  # the next request decodes normally
