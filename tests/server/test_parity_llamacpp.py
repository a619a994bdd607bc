"""The parity matrix (`test_parity.py`) over llama.cpp members: the same CASES through the same doors (the engine's
stream and astream, LangChain `ChatSafe` and `SafeLLM`, LlamaIndex `SafeLLM`, the server through the openai SDK
and `ChatOpenAI`, the CLI) give the engine's reply when the ensemble is the real demo pair in llama.cpp
(Qwen2.5-Coder-0.5B drafts, SmolLM2-135M verifies, `backend="llama.cpp"`), as they do on tiny torch models.

The doors, CASES and request spelling are test_parity's, imported; only the served ensemble differs. Quantized
llama.cpp kernels are not batch-invariant, so a reply is deterministic for one request alone: every door sends
one request at a time and waits for the server to be idle before the next case.

The CLI door loads both members again on every call (`--backend llama.cpp`, the demo names), so it runs over
test_parity's CLI_CASES (greedy, seeded sampling, stop, method every_token, tool_choice named, json_schema,
loop steering) and its logprobs check over greedy, not over every case.

Slow (an integration module): the four cases with tools prefill about 300 prompt tokens per member for each
request, so they run at the doors that build requests (engine, ChatSafe, LlamaIndex, the openai SDK, ChatOpenAI)
and not again at each one's streaming twin; forwards run on two threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from safe_engine import Ensemble

from . import test_parity as parity
from .conftest import Served, serving
from .test_parity import CASES, CHAT, CLI_CASES, DOORS, FINISH, QUESTION, ROOT, SYSTEM, Reply, _request, engine

pytestmark = pytest.mark.integration

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the drafter first
BACKEND = "llama.cpp"
THREADS = 2
# The tool cases prefill a long prompt (about 300 tokens a member) for each request: they run at the doors that
# build requests, not again at each one's streaming twin (the tiny-model matrix runs them at every door).
STREAMING_TWINS = {parity.engine_stream, parity.engine_astream, parity.chatsafe_stream, parity.llamaindex_stream,
                   parity.openai_sdk_stream}  # fmt: skip
# the CLI's environment: offline (the demo models are cached by the `served` fixture's load), and one thread a
# forward, as the package's `_one_torch_thread` gives the in-process ensemble (a count the user chose: no timing
# of thread counts at load, which takes minutes on a busy 2-core machine)
CLI_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": str(THREADS),
}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The package's server, over the demo pair in llama.cpp instead of the tiny torch models, with two threads a
    forward (the package's one thread is for tiny models; prefilling the tool prompts at one took minutes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # this thread's count and the default of threads started from here on
    ens = Ensemble.from_pretrained(MODELS, backend=BACKEND)
    assert [m.backend for m in ens.members] == [BACKEND, BACKEND]
    with serving(ens) as s:
        yield s
    torch.set_num_threads(before)


class _Replies(dict):
    """The engine's reply to each case, computed when a test first asks for it."""

    def __init__(self, served: Served) -> None:
        super().__init__()
        self.served = served

    def __missing__(self, case: str) -> Reply:
        self[case] = reply = engine(self.served, _request(case))
        return reply


@pytest.fixture(scope="module")
def expected(served: Served) -> dict[str, Reply]:
    return _Replies(served)


@pytest.mark.parametrize("case", list(CASES))
def test_every_door_gives_the_engines_reply(served, expected, case):
    want = expected[case]
    doors = [d for d in DOORS if d not in STREAMING_TWINS] if "tools" in CASES[case] else DOORS
    for door in doors:
        assert door(served, _request(case)) == want, f"{door.__name__}: {case}"
    served.wait_idle()


def test_the_cases_bite_on_real_members(expected):
    """The matrix is not vacuous on real members either (`test_parity.check_the_cases_bite`), and the stop case
    ends on its stop string.

    test_parity's own check is left out: its penalty and loop cases are tuned to make tiny random models repeat
    themselves; the demo pair answers this question in a few tokens without repeating, so the frequency and
    presence penalties, the loop guard and loop steering leave its reply as it is."""
    parity.check_the_cases_bite(expected)
    assert expected["stop"][2] == "stop"


def _cli(argv: list[str]) -> dict:
    command = [sys.executable, "-m", "safe_engine", "generate", "--chat", "--json", "--system", SYSTEM]
    for name in MODELS:
        command += ["-m", name]
    command += ["--backend", BACKEND, *argv, QUESTION]
    env = {**os.environ, **CLI_ENV}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"({BACKEND})" in proc.stderr  # the "loaded" line names each member's backend
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", CLI_CASES)
def test_the_cli_gives_the_engines_reply(served, expected, tmp_path: Path, case):
    out = _cli(parity._flags(_request(case), tmp_path))
    calls = [(c["name"], c["arguments"]) for c in out.get("tool_calls") or ()]
    assert (out["content"], calls, "tool_calls" if calls else FINISH[out["finish_reason"]]) == expected[case]


def test_the_cli_reports_the_engines_logprobs(served):
    result = served.ens.generate(messages=CHAT, **_request("greedy"), logprobs=3)
    got = parity._from_chat(_cli(["--max-new-tokens", str(parity.N), "--logprobs", "3"])["logprobs"]["content"])
    assert parity._close(got, [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in result.logprobs or []])


# test_parity's other checks, as they are, over this module's `served`
test_every_door_gives_the_engines_logprobs = parity.test_every_door_gives_the_engines_logprobs
test_every_completion_door_gives_the_engines_logprobs = parity.test_every_completion_door_gives_the_engines_logprobs
test_every_completion_door_gives_the_engines_text = parity.test_every_completion_door_gives_the_engines_text
test_an_unknown_option_is_named_at_every_door = parity.test_an_unknown_option_is_named_at_every_door
test_a_timeout_ends_the_generation_at_every_door = parity.test_a_timeout_ends_the_generation_at_every_door
