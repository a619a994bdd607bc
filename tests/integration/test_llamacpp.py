"""llama.cpp members on the real demo GGUF files: the engine's reading of llama.cpp equals llama-cpp-python's own,
rollback is exact, a llama.cpp member works beside a torch member, and a tokenizer that does not spell the GGUF's
tokens is refused. (What is *not* exact with quantized kernels, batch variance, is measured in
benchmarks/llamacpp_variance.py and docs/llamacpp.md.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers

from safe_engine import ConfigError, Ensemble, MemberError, ModelLoadError, ModelSpec
from safe_engine.engine import scheduler
from safe_engine.runtime import demo_models, llamacpp
from safe_engine.runtime.llamacpp import LlamaCppMember, load_llamacpp_member
from safe_engine.runtime.members import Member, crop_cache, load_member
from tests.conftest import tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra is part of `make test`")

pytestmark = pytest.mark.integration

STORY = "Once upon a time, in a small village by the sea, there lived"
CLI = [sys.executable, "-m", "safe_engine", "generate"]
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@pytest.fixture(scope="module")
def smol() -> LlamaCppMember:
    return load_llamacpp_member(ModelSpec("smollm2-135m"))


def own_greedy(member: LlamaCppMember, ids: list[int], n: int) -> str:
    """llama-cpp-python's own greedy generation of the same file (its high-level `Llama`)."""
    llm = llama_cpp.Llama(str(member.gguf), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)
    try:
        out = llm.create_completion(ids, max_tokens=n, temperature=0.0, repeat_penalty=1.0)
        return out["choices"][0]["text"]
    finally:
        llm.close()


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_single_equals_llama_cpp_pythons_own_greedy_text(smol, chat):
    ens = Ensemble([smol])
    options = {"max_new_tokens": 64, "method": "single"}
    request = ens.request(messages=CHAT, **options) if chat else ens.request(STORY, **options)
    result = ens.generate(request)
    assert result.stats.tokens >= 32
    assert result.text == own_greedy(smol, request.encode(smol), result.stats.tokens)


def test_rollback_then_redecode_gives_the_same_logits(smol):
    ids = smol.prompt_ids(STORY)
    cache = smol.new_cache()
    try:
        smol.forward(ids[:8], cache)
        first = smol.forward(ids[8:], cache, keep=len(ids) - 8)
        crop_cache(cache, 8)
        again = smol.forward(ids[8:], cache, keep=len(ids) - 8)
        assert torch.equal(first, again)
        crop_cache(cache, 10)  # a partial rollback, then one-token steps: each row as before the rollback
        steps = [smol.forward([t], cache)[0] for t in ids[10:14]]
        crop_cache(cache, 10)
        assert torch.equal(torch.stack(steps), torch.stack([smol.forward([t], cache)[0] for t in ids[10:14]]))
    finally:
        smol.release(cache)


def test_the_context_grows_as_its_requests_need_and_reads_as_a_full_size_one(monkeypatch):
    """A context starts at FIRST_CONTEXT positions (llama.cpp allocates its whole KV cache when it is made) and
    doubles when a pass needs more, copying every cell in order: with two requests, rollbacks included, every row
    across the growths equals the row of a context made at full size from the start. (Copying each sequence on
    its own instead gave rows up to 1.2 apart here, 26 argmax flips in 300: quantized kernels read the cells'
    layout.)"""
    gguf, tok = demo_models.gguf_path("smollm2-135m"), _tokenizer("smollm2-135m")
    grown = LlamaCppMember(gguf, tok)
    monkeypatch.setattr(llamacpp, "FIRST_CONTEXT", llamacpp.DEFAULT_CONTEXT)
    whole = LlamaCppMember(gguf, tok)
    assert (grown.allocated, whole.allocated) == (256, 4096)
    ids = list(range(1000, 1600))
    passes = [("a", 0, ids[:200]), ("b", 0, ids[:100]), ("a", 200, ids[200:400]), ("a", 390, ids[390:395])]
    passes += [("b", 100, ids[100:400]), ("a", 395, ids[395:600])]  # the last two grow it to 512, then 1024
    rows: dict[LlamaCppMember, list[torch.Tensor]] = {grown: [], whole: []}
    sizes = []
    for member in (grown, whole):
        caches = {"a": member.new_cache(), "b": member.new_cache()}
        for name, start, chunk in passes:
            crop_cache(caches[name], start)  # the 4th pass rolls "a" back by 10 positions
            rows[member].append(member.forward(chunk, caches[name], keep=len(chunk)))
            sizes.append(member.allocated)
        for cache in caches.values():
            member.release(cache)
    assert sizes == [256, 512, 512, 512, 1024, 1024] + [4096] * len(passes)
    assert all(torch.equal(g, w) for g, w in zip(rows[grown], rows[whole], strict=True))


def test_a_growth_that_fails_leaves_the_context_as_it_was():
    """If llama.cpp cannot make the larger context, the pass is a MemberError and the requests go on in the
    context they had."""
    member = LlamaCppMember(demo_models.gguf_path("smollm2-135m"), _tokenizer("smollm2-135m"))
    cache = member.new_cache()
    before = member.forward(list(range(100, 300)), cache, keep=200)
    member._new_context = lambda size: None
    with pytest.raises(MemberError, match="could not grow its context to 512 positions"):
        member.forward(list(range(300, 400)), cache)
    assert (member.allocated, cache.length) == (llamacpp.FIRST_CONTEXT, 200)
    crop_cache(cache, 150)
    assert torch.equal(member.forward(list(range(250, 300)), cache, keep=50), before[150:])
    member.release(cache)


def test_two_copies_ensemble_only_where_the_model_is_unsure(smol):
    """Two copies of one torch model never ensemble (their rows are equal). Here a verifier's 5-token pass and the
    drafter's one-token steps differ in the last bits (quantized kernels are not batch-invariant), so what holds
    instead: few points, and only where the drafter itself put little on its token. (Measured over the schedules:
    at most 2 points in 96 tokens, the drafter's probability there at most 0.41, the copies' at most 0.09 apart.
    Whether the text stays the model's own is measured, not promised: docs/llamacpp.md.)"""
    twin = Ensemble([smol, smol])
    safe = twin.generate(messages=CHAT, max_new_tokens=96, trace=True)
    assert safe.stats.ensembled_tokens <= 0.1 * safe.stats.tokens, (safe.stats, safe.trace)
    for point in safe.trace:
        assert point.drafter_prob <= 0.65, point  # the consensus gate passes any token both copies give > 0.5


def test_a_llama_cpp_member_beside_a_torch_member(smol):
    gemma = load_member("gemma3-270m")  # torch, float32
    ens = Ensemble([smol, gemma])
    assert [m.backend for m in ens.members] == ["llama.cpp", "torch"]
    # a directory written from a GGUF is read with its tokenizer.json as it is, not GemmaTokenizer's Python parse
    assert type(gemma.tokenizer) is transformers.TokenizersBackend
    res = ens.generate(STORY, max_new_tokens=48)
    words = res.text.split()
    assert len(words) >= 15 and sum(w.isalpha() for w in words) / len(words) > 0.6, res.text  # fluent prose
    assert 0 < res.stats.ensemble_rate < 1, res.stats
    assert "".join(ens.stream(STORY, max_new_tokens=48)) == res.text


def test_a_batch_shares_one_context_and_gives_every_sequence_back(smol):
    ens = Ensemble([smol, smol], max_batch_size=4)
    prompts = [STORY, "The capital of France is", [{"role": "user", "content": "Name three colours."}]]
    results = ens.generate_batch(prompts, max_new_tokens=24)
    assert all(r.stats.tokens > 0 and r.text for r in results)
    assert ens.wait_idle(30)
    assert len(smol._free) == smol.sequences  # every request's sequence went back


def test_the_sequences_run_out_with_a_clear_error():
    member = LlamaCppMember(demo_models.gguf_path("smollm2-135m"), _tokenizer("smollm2-135m"), sequences=1)
    first, second = member.new_cache(), member.new_cache()  # caches take a sequence at their first pass
    member.forward([1, 2], first)
    with pytest.raises(MemberError, match="sequences are in use"):
        member.forward([1, 2], second)
    member.release(first)
    member.forward([1, 2], second)  # the released sequence serves the next request
    member.release(second)


def test_a_pass_that_would_overfill_the_shared_context_is_refused_before_llama_cpp_sees_it():
    """The context's positions are shared by its requests: a pass that would hold more is a MemberError, raised
    before `llama_decode` (which would fail natively), and the sequences stay usable at what they held."""
    member = LlamaCppMember(demo_models.gguf_path("smollm2-135m"), _tokenizer("smollm2-135m"), context=64)
    assert (member.context_window, member.positions) == (64, 4096)
    with pytest.raises(ConfigError, match="cannot hold one request's window of 4096; give kv_positions >= 4096"):
        LlamaCppMember(demo_models.gguf_path("smollm2-135m"), _tokenizer("smollm2-135m"), positions=1)
    member.positions = 48  # as if the context were that small: two requests of 30 positions do not fit
    first, second = member.new_cache(), member.new_cache()
    before = member.forward(list(range(100, 130)), first)
    with pytest.raises(MemberError, match="would hold 60 positions, more than the 48"):
        member.forward(list(range(100, 130)), second)
    assert second.length == 0
    member.forward([5], first)  # first goes on from its 30 positions
    crop_cache(first, 29)
    assert torch.equal(member.forward([129], first), before)  # and reads what it read before
    member.release(first)
    member.forward(list(range(100, 130)), second)  # the room the first freed serves the second
    member.release(second)


def test_the_scheduler_admits_llama_cpp_requests_as_their_positions_fit(smol, monkeypatch):
    """Requests whose reserved positions together exceed the shared context wait for room instead of failing
    inside llama.cpp. (Answers decoded together may differ from their solo text: batch variance,
    docs/llamacpp.md; the one that waits runs alone, so its text is its solo text.)"""
    ens = Ensemble([smol, smol], max_batch_size=4)
    prompts = [STORY, "The capital of France is", "Three colours are"]
    alone = [ens.generate(p, max_new_tokens=20, method="single").text for p in prompts]
    rounds: list[list[int]] = []  # each round's requests, by their reserved positions
    run_round = scheduler.run_round
    monkeypatch.setattr(
        scheduler,
        "run_round",
        lambda gens: (rounds.append([g.reserved_positions()[0][1] for g in gens]), run_round(gens))[1],
    )
    ens.generate_batch(prompts, max_new_tokens=20, method="single")
    first = rounds[0]
    assert len(first) == 3 and all(20 < n <= 20 + 5 + 1 + 15 for n in first)  # prompt + budget + a draft's lookahead
    rounds.clear()
    monkeypatch.setattr(smol, "positions", first[0] + first[1])  # room for the first two, not the third
    together = ens.generate_batch(prompts, max_new_tokens=20, method="single")
    assert all(r.stats.tokens == 20 for r in together) and together[2].text == alone[2]
    assert max(len(r) for r in rounds) == 2 and rounds[-1] == [first[2]]  # the third ran once there was room


def test_a_llama_cpp_member_reads_its_tokenizer_json_as_it_is():
    """Not Qwen2Tokenizer, which keeps a Python parse of the file (104 MiB against 54 for Qwen2.5:
    benchmarks/member_memory.py); the vocabulary check at load still compares every id's bytes."""
    qwen = load_llamacpp_member(ModelSpec("qwen2.5-coder-0.5b"))
    assert type(qwen.tokenizer) is transformers.TokenizersBackend
    assert qwen.tokenizer.encode(STORY) == _tokenizer("qwen2.5-coder-0.5b").encode(STORY)


def test_a_tokenizer_that_does_not_spell_the_gguf_is_refused():
    gguf = demo_models.gguf_path("smollm2-135m")
    with pytest.raises(ModelLoadError, match=r"does not spell the GGUF's tokens: ids \d+ \(tokenizer b"):
        LlamaCppMember(gguf, tokenizer("llama2"))  # 32,000 ids, spelled otherwise
    with pytest.raises(ModelLoadError, match=r"its tokenizer has 151936 ids but .* only 49152"):
        LlamaCppMember(gguf, _tokenizer("qwen2.5-coder-0.5b"))


def test_backend_choice():
    auto = Ensemble.from_pretrained(["smollm2-135m"])
    assert isinstance(auto.members[0], LlamaCppMember)  # a GGUF source on the CPU: llama.cpp by default
    torch_member = Ensemble.from_pretrained([ModelSpec("smollm2-135m", backend="torch")]).members[0]
    assert type(torch_member) is Member and torch_member.model is not None
    int8 = Ensemble.from_pretrained(["smollm2-135m"], quantization="int8").members[0]
    assert int8.backend == "torch"  # asked for the engine's own quantization: torch
    directory = str(demo_models.model_dir("smollm2-135m"))
    with pytest.raises(ConfigError, match="runs GGUF files"):
        Ensemble.from_pretrained([directory], backend="llama.cpp")
    with pytest.raises(ConfigError, match="dtype= and quantization= apply to backend='torch' only"):
        Ensemble.from_pretrained(["smollm2-135m"], backend="llama.cpp", dtype="bfloat16")
    with pytest.raises(ConfigError, match="unknown backend 'vllm'"):
        Ensemble.from_pretrained(["smollm2-135m"], backend="vllm")


def test_a_build_that_crashes_on_this_cpu_is_a_load_error(tmp_path, monkeypatch):
    """The smoke decode runs in a child process, so a native crash there becomes a ModelLoadError here, and the
    verdict is cached per build and CPU."""
    monkeypatch.setenv("SAFE_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp, "_SMOKE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    gguf = demo_models.gguf_path("smollm2-135m")
    with pytest.raises(ModelLoadError, match="died with signal 11"):
        llamacpp.smoke_check(gguf)
    monkeypatch.setattr(llamacpp, "_SMOKE", "raise SystemExit('never run: the verdict is cached')")
    with pytest.raises(ModelLoadError, match="signal 11"):
        llamacpp.smoke_check(gguf)
    assert len(list((tmp_path / "llamacpp-smoke").glob("*.json"))) == 1


def test_the_cli_runs_llama_cpp_members():
    out = subprocess.run(
        [*CLI, "-m", "smollm2-135m", "--backend", "llama.cpp", "--method", "single", "--max-new-tokens", "8", STORY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert "smollm2-135m (llama.cpp)" in out.stderr
    assert out.stdout.strip()


STRONGER = "qwen2.5-coder-1.5b"


@pytest.mark.skipif(
    not demo_models.gguf_path(STRONGER).is_file(),
    reason=f"{STRONGER} (1.1 GB) is not fetched, and CI does not fetch it: "
    f"`safe-engine models fetch --gguf {STRONGER}` does",
)
def test_the_stronger_drafter_runs_in_llama_cpp_as_llama_cpp_python_does():
    """The 1.5B demo model loads in llama.cpp with its tokenizer saved alone (the vocabulary check at load passes;
    no float32 copy is made), its greedy `single` is llama-cpp-python's own greedy text, it shares the 0.5B's
    tokenizer, and it drafts for SmolLM2."""
    converted = demo_models.cache_root() / "gguf" / demo_models.DEMO_MODELS[STRONGER].sha256[:16]
    had_conversion = converted.exists()
    big = load_llamacpp_member(ModelSpec(STRONGER))
    assert big.backend == "llama.cpp" and converted.exists() == had_conversion  # never converted by a load
    small = _tokenizer("qwen2.5-coder-0.5b")
    assert len(big.tokenizer) == len(small)
    assert all(big.tokenizer.encode(t) == small.encode(t) for t in (STORY, CHAT[0]["content"], "def f(x):\n\treturn x"))
    ens = Ensemble([big])
    request = ens.request(messages=CHAT, max_new_tokens=16, method="single")
    result = ens.generate(request)
    assert result.stats.tokens == 16
    assert result.text == own_greedy(big, request.encode(big), result.stats.tokens)
    pair = Ensemble([big, load_llamacpp_member(ModelSpec("smollm2-135m"))])
    safe = pair.generate(messages=CHAT, max_new_tokens=8)
    assert pair.drafter is big and safe.stats.tokens == 8 and safe.text.strip()


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_models.model_dir(name))


def test_every_door_sizes_the_shared_kv_cache_and_refuses_it_by_name():
    """`kv_positions` (the KV positions a llama.cpp member's requests share) reaches the member from the engine,
    the CLI's `generate` and `serve` loaders, LangChain (SafeLLM, ChatSafe) and LlamaIndex; where no member runs
    in llama.cpp, or below one request's window, it is refused by name, before anything loads."""
    from langchain_safe import ChatSafe
    from langchain_safe import SafeLLM as LangChainLLM
    from llamaindex_safe import SafeLLM as LlamaIndexLLM
    from safe_engine.cli import build_parser
    from safe_engine.cli.args import load

    models, wanted = ["smollm2-135m"], 6000
    flags = ["-m", "smollm2-135m", "--kv-positions", str(wanted)]
    doors = {
        "engine": Ensemble.from_pretrained(models, kv_positions=wanted),
        "generate": load(build_parser().parse_args(["generate", *flags, "Hi"]), announce=False),
        "serve": load(build_parser().parse_args(["serve", *flags]), announce=False),
        "LangChain SafeLLM": LangChainLLM(models=models, kv_positions=wanted)._holder.get(),
        "ChatSafe": ChatSafe(models=models, kv_positions=wanted)._holder.get(),
        "LlamaIndex": LlamaIndexLLM(models=models, kv_positions=wanted)._holder.get(),
    }
    pools = {door: [m.positions for m in ens.members] for door, ens in doors.items()}
    assert pools == {door: [wanted] for door in doors}
    assert Ensemble.from_pretrained(models).members[0].positions == llamacpp.DEFAULT_CONTEXT  # not given: one window
    text = doors["engine"].generate(STORY, max_new_tokens=8).text
    assert text == Ensemble.from_pretrained(models).generate(STORY, max_new_tokens=8).text  # a pool, not the text

    with pytest.raises(ConfigError, match=r"none of these members runs in llama\.cpp"):
        Ensemble.from_pretrained(models, backend="torch", kv_positions=wanted)
    with pytest.raises(ConfigError, match=r"none of these members runs in llama\.cpp"):
        ChatSafe(models=models, backend="torch", kv_positions=wanted).invoke("Hi")
    with pytest.raises(ConfigError, match="kv_positions must be a positive int"):
        load(build_parser().parse_args(["generate", "-m", "smollm2-135m", "--kv-positions", "0", "Hi"]))
    with pytest.raises(ConfigError, match="kv_positions"):
        LlamaIndexLLM(models=models, kv_positions=-1)
    with pytest.raises(ConfigError, match="cannot hold one request's window of 4096; give kv_positions >= 4096"):
        Ensemble.from_pretrained(models, kv_positions=100)
