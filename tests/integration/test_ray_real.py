"""The real demo models in Ray actors on a local Ray cluster: SmolLM2-135M (byte-level BPE, 49k) and
gemma-3-270m (SentencePiece, 262k). Greedy output must equal the local ensemble's, token for token."""

from __future__ import annotations

import pytest
import torch

from safe_engine import Ensemble
from safe_engine.runtime.ray import RayMember

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray]

MODELS = ["smollm2-135m", "gemma3-270m"]
STORY = "Once upon a time, in a small village by the sea, there lived"
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 1024**2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same intra-op thread count as the actors (num_cpus=0 -> one thread)
    yield
    torch.set_num_threads(before)
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def local() -> Ensemble:
    return Ensemble.from_pretrained(MODELS, backend="torch")  # what the actors run


@pytest.fixture(scope="module")
def remote() -> Ensemble:
    return Ensemble.from_pretrained(MODELS, backend="ray", member_resources={"num_cpus": 0})


def test_ray_members_mirror_the_local_members(local, remote):
    for here, there in zip(local.members, remote.members):
        assert isinstance(there, RayMember) and there.torch_threads == 1
        assert (there.name, there.vocab_size, there.eos_ids, there.context_window) == (
            here.name,
            here.vocab_size,
            here.eos_ids,
            here.context_window,
        )
        assert there.token_bytes == here.token_bytes and there.chat_template == here.chat_template


@pytest.mark.parametrize("method", ["safe", "every_token"])
def test_greedy_output_equals_the_local_ensemble(local, remote, method):
    for prompt in (STORY, PROMPT):
        want = local.generate(prompt, max_new_tokens=24, method=method)
        got = remote.generate(prompt, max_new_tokens=24, method=method)
        assert got.text == want.text, (got.text, want.text)
        assert (got.stats.tokens, got.stats.ensembled_tokens, got.stats.rounds) == (
            want.stats.tokens,
            want.stats.ensembled_tokens,
            want.stats.rounds,
        )
    assert all(not m.open_requests() for m in remote.members)


def test_mixed_local_drafter_and_ray_verifier(local, remote):
    mixed = Ensemble([local.members[0], remote.members[1]])
    want = local.generate(STORY, max_new_tokens=24)
    assert "".join(mixed.stream(STORY, max_new_tokens=24)) == want.text
    for m in remote.members:
        assert m.traffic.snapshot()["max_call_bytes"] < 64_000 < 4 * m.vocab_size  # never a full row
