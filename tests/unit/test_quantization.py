"""Int8 members: each row is quantized on its own (a request's logits never depend on its batch), packed
forwards equal per-sequence forwards, greedy SAFE keeps its invariants on quantized members, and every door
passes `quantization` through or refuses a bad value by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from safe_engine import ConfigError, Ensemble, ModelSpec
from safe_engine.runtime.members import Member, load_member
from safe_engine.runtime.packed import KVPool, packed_forward
from safe_engine.runtime.quantization import Int8Embedding, Int8Linear, quantize_int8
from tests.conftest import tiny_member, tokenizer

PROMPT = "The quick brown fox"
SCHEDULES = [{"schedule": "rounds"}, {"schedule": "overlap"}, {"schedule": "auto"}]


def int8_member(family: str, seed: int) -> Member:
    """A quantized copy of the tests' (cached, shared) tiny model."""
    tok = tokenizer(family)
    model = copy.deepcopy(tiny_member(family, seed).model)
    return Member(quantize_int8(model), tok, name=f"{family}-{seed}-int8")


def test_each_row_is_quantized_on_its_own():
    """PyTorch's dynamic int8 scales a layer's whole input at once; here a row's result is bit-identical alone
    or beside a row of an 8x larger range, and within int8 error of the float layer."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    q = Int8Linear(linear)
    x = torch.randn(5, 96)
    x[3] *= 8
    together = q(x)
    alone = torch.cat([q(row[None]) for row in x])
    assert torch.equal(together, alone)
    with torch.no_grad():
        ref = linear(x)
    assert ((together - ref).abs().amax(1) / ref.abs().amax(1)).max() < 0.03
    assert q(x[None]).shape == (1, 5, 200)  # leading dimensions kept
    assert torch.equal(q(torch.zeros(2, 96)), linear.bias.detach().expand(2, 200))  # zero rows: the bias


def test_quantize_int8_replaces_every_linear_layer_and_the_embeddings():
    float_model = tiny_member("llama2", 1).model
    member = int8_member("llama2", 1)
    model = member.model
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.weight.dtype == torch.int8
    ids = torch.tensor([[5, 17, 5, 900]])
    looked_up = embedding(ids)
    assert looked_up.dtype == torch.float32 and torch.equal(looked_up[0, 0], looked_up[0, 2])
    reference = float_model.get_input_embeddings()(ids)
    assert ((looked_up - reference).abs().amax(-1) <= reference.abs().amax(-1) / 127).all()  # half a step
    assert member.vocab_size == model.config.vocab_size


@pytest.mark.parametrize("family", ["gpt2", "llama2", "qwen2.5-7b-instruct"])
def test_a_packed_forward_of_int8_members_equals_per_sequence_forwards(family):
    member = int8_member(family, 1)
    assert member.packed
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 30, 3, 20)]
    pools = [KVPool() for _ in seqs]
    rows = packed_forward(member.model, [(p, 0, s, 3) for p, s in zip(pools, seqs)], member.device)
    for r, s in zip(rows, seqs):
        with torch.no_grad():
            expected = member.model(input_ids=torch.tensor([s])).logits[0, -3:].float()
        assert torch.allclose(r, expected, atol=1e-4 * float(expected.abs().max()))


def test_two_copies_of_an_int8_model_give_its_own_greedy_text_in_every_schedule():
    a, b = int8_member("llama2", 7), int8_member("llama2", 7)
    alone = Ensemble([a]).generate(PROMPT, max_new_tokens=40).text
    ens = Ensemble([a, b])
    for options in SCHEDULES:
        res = ens.generate(PROMPT, max_new_tokens=40, **options)
        assert res.text == alone
        assert res.stats.ensembled_tokens == 0


def test_every_schedule_gives_the_same_greedy_text_on_int8_members():
    ens = Ensemble([int8_member("qwen2.5-7b-instruct", 1), int8_member("llama2", 2), int8_member("gpt2", 3)])
    texts = {ens.generate(PROMPT, max_new_tokens=60, **options).text for options in SCHEDULES}
    batch = ens.generate_batch([PROMPT, "Hello there", PROMPT], max_new_tokens=60)
    texts |= {batch[0].text, batch[2].text}
    assert len(texts) == 1


@pytest.mark.parametrize("bad", ["int4", "INT8", 8, True])
def test_a_bad_quantization_is_refused_by_name_before_loading(bad, tmp_path):
    with pytest.raises(ConfigError, match="quantization"):
        Ensemble.from_pretrained([str(tmp_path / "never-read")], quantization=bad)
    with pytest.raises(ConfigError, match="quantization"):
        load_member(ModelSpec(str(tmp_path / "never-read"), quantization=bad))


def test_int8_with_a_half_precision_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        Ensemble.from_pretrained([str(tmp_path / "x")], quantization="int8", dtype="bfloat16")


def test_from_pretrained_quantizes_every_member_or_the_specs_that_ask(tmp_path):
    tok = tokenizer("gpt2")
    member = tiny_member("gpt2", 4)
    member.model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    ens = Ensemble.from_pretrained([str(tmp_path / "m"), ModelSpec(str(tmp_path / "m"), quantization="int8")])
    assert [isinstance(m.model.get_output_embeddings(), Int8Linear) for m in ens.members] == [False, True]
    ens = Ensemble.from_pretrained([str(tmp_path / "m"), str(tmp_path / "m")], quantization="int8")
    assert all(isinstance(mem.model.get_output_embeddings(), Int8Linear) for mem in ens.members)
    res = ens.generate(PROMPT, max_new_tokens=12)
    assert res.stats.tokens == 12 and res.stats.ensembled_tokens == 0


def test_every_door_loads_int8_members_and_gives_the_engines_text(model_dirs, capsys):
    """Engine, CLI (generate and the loader `serve` uses), LangChain (SafeLLM, ChatSafe's base) and LlamaIndex:
    the same int8 members, the same greedy text."""
    import json

    from langchain_safe import SafeLLM as LangChainLLM
    from llamaindex_safe import SafeLLM as LlamaIndexLLM
    from safe_engine.cli import build_parser, main
    from safe_engine.cli.args import load

    engine = Ensemble.from_pretrained(model_dirs, quantization="int8")
    assert all(isinstance(m.model.get_output_embeddings(), Int8Linear) for m in engine.members)
    text = engine.generate(PROMPT, max_new_tokens=8).text
    float_text = Ensemble.from_pretrained(model_dirs).generate(PROMPT, max_new_tokens=8).text

    flags = ["-m", model_dirs[0], "-m", model_dirs[1], "--quantize", "int8"]
    assert main(["generate", *flags, "--max-new-tokens", "8", "--json", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == text
    served = load(build_parser().parse_args(["serve", *flags]), announce=False)
    assert all(isinstance(m.model.get_output_embeddings(), Int8Linear) for m in served.members)

    assert LangChainLLM(models=model_dirs, quantization="int8", max_new_tokens=8).invoke(PROMPT) == text
    assert LlamaIndexLLM(models=model_dirs, quantization="int8", max_new_tokens=8).complete(PROMPT).text == text
    assert LangChainLLM(models=model_dirs, max_new_tokens=8).invoke(PROMPT) == float_text  # not quantized


def test_every_door_refuses_a_bad_quantization_by_name(model_dirs, capsys):
    from langchain_safe import ChatSafe
    from llamaindex_safe import SafeLLM as LlamaIndexLLM
    from safe_engine.cli import main

    with pytest.raises(ConfigError, match="quantization"):
        ChatSafe(models=model_dirs, quantization="int4")  # at construction, before any load
    with pytest.raises(ConfigError, match="quantization"):
        LlamaIndexLLM(models=model_dirs, quantization="fp8")
    with pytest.raises(SystemExit):
        main(["generate", "-m", model_dirs[0], "--quantize", "int4", "Hi"])
    assert "--quantize" in capsys.readouterr().err


def test_load_member_quantizes_on_a_thread_that_has_ended_when_it_returns(tmp_path, monkeypatch):
    """The quantization's operators start an OpenMP team on the thread that runs them, and a team left docked
    on the building thread throttled the placement's timing (a 2-thread step timed 58-73 ms against 45 ms on
    an AMD EPYC). So `load_member` quantizes on a short-lived thread, never on the caller's."""
    import threading

    from safe_engine.runtime import members

    tiny_member("gpt2", 4).model.save_pretrained(tmp_path / "m")
    tokenizer("gpt2").save_pretrained(tmp_path / "m")
    ran_on: list[threading.Thread] = []

    def quantize(model: nn.Module) -> nn.Module:
        ran_on.append(threading.current_thread())
        return quantize_int8(model)

    monkeypatch.setattr(members, "quantize_int8", quantize)
    member = load_member(str(tmp_path / "m"), quantization="int8")
    assert isinstance(member.model.get_output_embeddings(), Int8Linear)
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()


def test_work_on_a_short_lived_thread_returns_its_result_or_raises_its_error_on_the_caller():
    from safe_engine.runtime.threads import on_short_lived_thread

    def fail() -> None:
        raise ConfigError("raised on the worker")

    assert on_short_lived_thread(lambda: torch.ones(3).sum().item(), "t") == 3.0
    with pytest.raises(ConfigError, match="raised on the worker"):
        on_short_lived_thread(fail, "t")
