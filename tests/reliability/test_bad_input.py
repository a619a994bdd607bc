"""Bad input: each mistake gets a clear SafeEngineError subclass that says what to do, and the next call
still works (and returns exactly what it returned before the error)."""

from __future__ import annotations

import copy

import pytest
import torch

from safe_engine import (
    ChatTemplateError,
    ConfigError,
    Ensemble,
    GenerationConfig,
    InputError,
    InputTypeError,
    Member,
    ModelSpec,
    SafeEngineError,
)
from tests.conftest import tiny_member, tiny_model, tokenizer

from .conftest import SIMPLE_TEMPLATE, check_invariants, small_window_member

PROMPT = "Hello there, general"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def baseline(ens2) -> str:
    return ens2.generate(PROMPT, max_new_tokens=4).text


def still_works(ens: Ensemble, baseline: str) -> None:
    res = ens.generate(PROMPT, max_new_tokens=4)
    assert res.text == baseline
    check_invariants(res, 4)


# (label, call(ens), expected class, message pattern) -- every message names the problem and a fix.
GENERATE_CASES = [
    ("empty prompt", lambda e: e.generate(""), InputError, "prompt is empty; pass some text"),
    ("empty messages", lambda e: e.generate(messages=[]), InputError, "messages is empty; pass at least one"),
    ("neither", lambda e: e.generate(), InputError, "exactly one of a prompt string or messages"),
    ("None prompt", lambda e: e.generate(None), InputError, "exactly one of a prompt string or messages"),
    ("both", lambda e: e.generate("x", messages=USER), InputError, "exactly one of"),
    ("bytes prompt", lambda e: e.generate(b"hello"), InputTypeError, "prompt must be a str, got bytes"),
    ("int prompt", lambda e: e.generate(42), InputTypeError, "prompt must be a str, got int"),
    ("list prompt", lambda e: e.generate(["a", "b"]), InputTypeError, "prompt must be a str, got list"),
    ("float prompt", lambda e: e.generate(1.5), InputTypeError, "prompt must be a str, got float"),
    ("dict prompt", lambda e: e.generate({"role": "user"}), InputTypeError, "for chat use messages="),
    ("messages str", lambda e: e.generate(messages="hi"), InputTypeError, "messages must be a list"),
    ("message no role", lambda e: e.generate(messages=[{"content": "x"}]), InputTypeError, "'role' and 'content'"),
    ("message not dict", lambda e: e.generate(messages=["hi"]), InputTypeError, "must be a dict"),
    (
        "content int",
        lambda e: e.generate(messages=[{"role": "user", "content": 3}]),
        InputTypeError,
        r"content'\] must be a string",
    ),
    ("surrogate prompt", lambda e: e.generate("abc \ud800 def"), InputError, "unpaired surrogate.*errors='replace'"),
    (
        "surrogate escape",
        lambda e: e.generate(b"ok \xff".decode(errors="surrogateescape")),
        InputError,
        "unpaired surrogate",
    ),
    (
        "surrogate content",
        lambda e: e.generate(messages=[{"role": "user", "content": "\udc00x"}]),
        InputError,
        r"messages\[0\]\['content'\] contains an unpaired surrogate",
    ),
    ("max_new_tokens 0", lambda e: e.generate(PROMPT, max_new_tokens=0), ConfigError, "max_new_tokens must be >= 1"),
    ("max_new_tokens -5", lambda e: e.generate(PROMPT, max_new_tokens=-5), ConfigError, "max_new_tokens must be >= 1"),
    ("max_new_tokens huge", lambda e: e.generate(PROMPT, max_new_tokens=10**12), ConfigError, "use at most"),
    ("max_new_tokens float", lambda e: e.generate(PROMPT, max_new_tokens=3.0), ConfigError, "must be an integer"),
    ("max_new_tokens str", lambda e: e.generate(PROMPT, max_new_tokens="3"), ConfigError, "must be an integer"),
    ("max_new_tokens bool", lambda e: e.generate(PROMPT, max_new_tokens=True), ConfigError, "must be an integer"),
    (
        "method",
        lambda e: e.generate(PROMPT, method="speculative"),
        ConfigError,
        r"unknown method 'speculative'; choose one of \['safe', 'every_token', 'single'\]",
    ),
    ("method None", lambda e: e.generate(PROMPT, method=None), ConfigError, "unknown method None"),
    (
        "aggregation",
        lambda e: e.generate(PROMPT, aggregation="mean"),
        ConfigError,
        r"unknown aggregation 'mean'; choose one of \['unite', 'gac'\]",
    ),
    ("sharpening", lambda e: e.generate(PROMPT, sharpening="max"), ConfigError, "unknown sharpening 'max'"),
    ("draft_length 0", lambda e: e.generate(PROMPT, draft_length=0), ConfigError, "draft_length must be >= 1"),
    ("draft_length -3", lambda e: e.generate(PROMPT, draft_length=-3), ConfigError, "draft_length must be >= 1"),
    ("top_k 0", lambda e: e.generate(PROMPT, top_k=0), ConfigError, "top_k must be >= 1"),
    ("lambda 1", lambda e: e.generate(PROMPT, sharpen_threshold=1.0), ConfigError, r"must be in \[0, 1\)"),
    ("lambda str", lambda e: e.generate(PROMPT, sharpen_threshold="0.1"), ConfigError, "must be a number"),
    ("lambda nan", lambda e: e.generate(PROMPT, sharpen_threshold=float("nan")), ConfigError, r"\[0, 1\)"),
    ("temperature < 0", lambda e: e.generate(PROMPT, temperature=-0.5), ConfigError, "temperature must be >= 0"),
    ("temperature nan", lambda e: e.generate(PROMPT, temperature=float("nan")), ConfigError, "must be >= 0"),
    (
        "temperature 0 with do_sample",
        lambda e: e.generate(PROMPT, temperature=0, do_sample=True),
        ConfigError,
        "temperature 0 means greedy",
    ),
    ("temperature str", lambda e: e.generate(PROMPT, temperature="0.5"), ConfigError, "must be a number"),
    (
        "two names of one limit",
        lambda e: e.generate(PROMPT, max_tokens=3, max_new_tokens=4),
        ConfigError,
        "name the same option",
    ),
    ("top_p 0", lambda e: e.generate(PROMPT, top_p=0.0), ConfigError, r"top_p must be in \(0, 1\]"),
    ("top_p 2", lambda e: e.generate(PROMPT, top_p=2), ConfigError, r"top_p must be in \(0, 1\]"),
    ("seed str", lambda e: e.generate(PROMPT, seed="7"), ConfigError, "seed must be an int"),
    ("seed huge", lambda e: e.generate(PROMPT, do_sample=True, seed=2**80), ConfigError, "seed must be an int in"),
    ("do_sample str", lambda e: e.generate(PROMPT, do_sample="no"), ConfigError, "do_sample must be True or False"),
    ("empty stop", lambda e: e.generate(PROMPT, stop=""), ConfigError, "stop strings must not be empty"),
    ("empty stop in list", lambda e: e.generate(PROMPT, stop=["x", ""]), ConfigError, "must not be empty"),
    ("stop int", lambda e: e.generate(PROMPT, stop=5), InputTypeError, "stop must be a string or a list"),
    ("stop list of int", lambda e: e.generate(PROMPT, stop=["a", 1]), InputTypeError, "stop must be a string"),
    ("stop bytes", lambda e: e.generate(PROMPT, stop=b"x"), InputTypeError, "stop must be a string"),
    (
        "unknown option",
        lambda e: e.generate(PROMPT, max_tokenz=3),
        ConfigError,
        r"unknown option 'max_tokenz'; valid options:",
    ),
    (
        "unknown options",
        lambda e: e.generate(PROMPT, temprature=0.5, topk=3),
        ConfigError,
        "unknown option 'temprature'",
    ),
    (
        "config dict",
        lambda e: e.generate(PROMPT, config={"method": "safe"}),
        InputTypeError,
        "config must be a GenerationConfig",
    ),
    (
        "chat without template",
        lambda e: e.generate(messages=USER),
        ChatTemplateError,
        "no chat template; pass a plain-text prompt instead, or give it one",
    ),
]


@pytest.mark.parametrize(("label", "call", "cls", "pattern"), GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_bad_generate_input_is_a_clear_error_and_the_next_call_works(ens2, baseline, label, call, cls, pattern):
    with pytest.raises(cls, match=pattern) as info:
        call(ens2)
    assert isinstance(info.value, SafeEngineError)
    assert isinstance(info.value, ValueError | TypeError)  # the builtin it describes
    still_works(ens2, baseline)


@pytest.mark.parametrize(
    ("label", "call", "cls", "pattern"),
    [c for c in GENERATE_CASES if c[0] in {"empty prompt", "bytes prompt", "method", "unknown option", "empty stop"}],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_stream_and_async_raise_the_same_errors(ens2, baseline, label, call, cls, pattern):
    class Capture:
        def generate(self, *args, **kwargs):
            return args, kwargs

    args, kwargs = call(Capture())
    with pytest.raises(cls, match=pattern):
        list(ens2.stream(*args, **kwargs))
    with pytest.raises(cls, match=pattern):
        await ens2.agenerate(*args, **kwargs)
    with pytest.raises(cls, match=pattern):
        async for _ in ens2.astream(*args, **kwargs):
            pass
    assert (await ens2.agenerate(PROMPT, max_new_tokens=4)).text == baseline


def test_stop_strings_longer_than_the_output_are_harmless(ens2, baseline):
    res = ens2.generate(PROMPT, max_new_tokens=4, stop=["x" * 500, baseline + "never"])
    assert res.text == baseline and res.finish_reason == "length" and res.stats.tokens == 4
    check_invariants(res, 4, ("x" * 500,))


def test_langchain_surfaces_the_same_errors(ens2, baseline):
    from langchain_safe import SafeLLM  # installed by the test extra: an import error fails the test

    llm = SafeLLM(ensemble=ens2, max_new_tokens=4)
    with pytest.raises(InputError, match="prompt is empty"):
        llm.invoke("")
    with pytest.raises(ConfigError, match="unknown"):
        llm.invoke(PROMPT, temprature=0.2)
    # construction errors are the engine's own, not pydantic's ValidationError
    with pytest.raises(ConfigError, match="draft_length must be >= 1"):
        SafeLLM(ensemble=ens2, draft_length=0)
    assert llm.invoke(PROMPT) == baseline
    still_works(ens2, baseline)


def test_generation_config_validates_on_its_own():
    with pytest.raises(ConfigError, match="unknown generation option"):
        GenerationConfig().updated(nonsense=1)
    with pytest.raises(ConfigError, match="draft_length must be >= 1"):
        GenerationConfig(draft_length=0)
    assert GenerationConfig(stop="END").stop == ("END",)
    assert GenerationConfig(stop=["a", "a", "b"]).stop == ("a", "b")


# -- ensemble construction ------------------------------------------------------------------------------
def test_weights_and_drafter_are_checked(ens2, baseline):
    members = ens2.members
    cases = [
        (dict(weights=[1.0]), "weights has 1 entries but the ensemble has 2 members"),
        (dict(weights=[1.0, 2.0, 3.0]), "weights has 3 entries"),
        (dict(weights=[1.0, -0.5]), "finite, non-negative and not all zero"),
        (dict(weights=[0.0, 0.0]), "not all zero"),
        (dict(weights=[1.0, float("nan")]), "finite"),
        (dict(weights=[1.0, float("inf")]), "finite"),
        (dict(weights="ab"), "weights must be a list of 2 numbers"),
        (dict(weights=[None, 1]), "weights must be a list of 2 numbers"),
        (dict(drafter=2), r"drafter must be an index in \[0, 1\], got 2"),
        (dict(drafter=-1), r"drafter must be an index in \[0, 1\]"),
        (dict(drafter=True), "drafter must be an index"),
        (dict(drafter="0"), "drafter must be an index"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            Ensemble(members, **kwargs)
    with pytest.raises(ConfigError, match="at least one Member"):
        Ensemble([])
    with pytest.raises(InputTypeError, match="wrap models as Member"):
        Ensemble([members[0], "gpt2"])
    with pytest.raises(InputTypeError, match="list of model specs"):
        Ensemble.from_pretrained("gpt2")
    with pytest.raises(InputTypeError, match="list of model specs"):
        Ensemble.from_pretrained([])
    # valid weights are normalised, and a weighted ensemble generates
    weighted = Ensemble(members, weights=[3, 1])
    assert torch.allclose(weighted.weights, torch.tensor([0.75, 0.25]))
    check_invariants(weighted.generate(PROMPT, max_new_tokens=4), 4)
    still_works(ens2, baseline)


def test_member_checks_its_model_and_tokenizer():
    tok = tokenizer("gpt2")
    with pytest.raises(InputTypeError, match="transformers causal LM"):
        Member("not a model", tok)
    with pytest.raises(InputTypeError, match="transformers tokenizer"):
        Member(tiny_model(len(tok), 1, tok.eos_token_id), "not a tokenizer")


def test_tokenizer_without_eos_is_refused_with_a_fix():
    tok = copy.deepcopy(tokenizer("gpt2"))
    tok.eos_token = None
    assert tok.eos_token_id is None
    model = tiny_model(len(tok), 1, None)
    assert model.generation_config.eos_token_id is None
    with pytest.raises(ConfigError, match=r"no EOS token.*set tokenizer.eos_token"):
        Member(model, tok, name="no-eos")


def test_tokenizer_without_pad_works_because_the_engine_never_pads():
    tok = tokenizer("gpt2")
    assert tok.pad_token is None and tok.pad_token_id is None
    ens = Ensemble([tiny_member("gpt2", 5), tiny_member("llama2", 6)])
    for method in ("safe", "every_token", "single"):
        res = ens.generate(PROMPT, max_new_tokens=5, method=method)
        check_invariants(res, 5)
        assert res.stats.tokens >= 1


def test_one_member_is_not_an_error_it_decodes_as_single():
    ens = Ensemble([tiny_member("gpt2", 1)])
    res = ens.generate(PROMPT, max_new_tokens=5, method="safe")
    assert res.stats.method == "single" and "single" in res.stats.note
    assert res.text == ens.generate(PROMPT, max_new_tokens=5, method="single").text
    check_invariants(res, 5)


def test_chat_with_a_member_lacking_a_template_names_the_member(baseline, ens2):
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 2)])
    with pytest.raises(ChatTemplateError, match=r"member 'gpt2-2' has no chat template.*chat_template="):
        ens.generate(messages=USER, max_new_tokens=3)
    check_invariants(ens.generate(messages=USER, max_new_tokens=3, method="single"), 3)  # drafter has one
    fixed = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 2, chat_template=SIMPLE_TEMPLATE)])
    check_invariants(fixed.generate(messages=USER, max_new_tokens=3), 3)


# -- context window ------------------------------------------------------------------------------------
@pytest.mark.parametrize("learned_positions", [False, True], ids=["rotary", "learned-positions"])
@pytest.mark.parametrize("drafter", [0, 1], ids=["small-drafts", "small-verifies"])
def test_prompt_longer_than_the_smallest_context_window_is_an_error(drafter, learned_positions):
    small = small_window_member(window=64, learned_positions=learned_positions)
    ens = Ensemble([small, tiny_member("llama2", 2)], drafter=drafter)
    assert ens.context_window == 64
    long_prompt = "word " * 100
    with pytest.raises(
        InputError, match=rf"tokens for member '{small.name}'.*context window of 64; shorten the prompt"
    ):
        ens.generate(long_prompt, max_new_tokens=4)
    exact = small.tokenizer.decode(small.prompt_ids(long_prompt)[:64])
    assert len(small.prompt_ids(exact)) == 64
    with pytest.raises(InputError, match="context window of 64"):
        ens.generate(exact, max_new_tokens=4)
    # prompts that fit: generation ends at the window ("length"), never runs a model past it
    positions: list[int] = []  # the furthest position each forward of the small model reached

    def record(module, args, kwargs):
        positions.append(int(kwargs["position_ids"].max()) + 1)  # the members decode with packed forwards

    hook = small.model.register_forward_pre_hook(record, with_kwargs=True)
    ens._schedule_gauge.record_chunk = lambda *timing: None  # and on the overlap's chunk: hold it at one
    try:
        for words in (40, 50, 55, 60, 63):
            prompt = " ".join(["go"] * words)
            texts = set()
            for schedule in ("rounds", "overlap"):
                res = ens.generate(prompt, max_new_tokens=40, schedule=schedule)
                assert res.finish_reason in {"length", "eos"}
                assert 0 <= res.stats.ensembled_tokens <= res.stats.tokens
                assert positions and max(positions) <= 64, (words, res.stats)
                assert "".join(ens.stream(prompt, max_new_tokens=40, schedule=schedule)) == res.text
                texts.add(res.text)
            assert len(texts) == 1, words  # the window ends the answer before the same token in every schedule
    finally:
        hook.remove()
    check_invariants(ens.generate("Hi", max_new_tokens=4), 4)


# -- devices -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    tok = tokenizer("gpt2")
    tiny_model(len(tok), 4, tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_devices_that_do_not_exist_are_clear_errors_before_anything_loads(model_dir, monkeypatch, ens2, baseline):
    from safe_engine.runtime import members as members_module

    loads = []
    original = members_module.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        members_module.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(k) or original(*a, **k)
    )
    missing = f"cuda:{torch.cuda.device_count() + 7}"
    cases = [
        (dict(device_map=["cpu"]), ConfigError, "device_map lists 1 devices for 2 members"),
        (dict(device_map=["cpu", "cpu", "cpu"]), ConfigError, "device_map lists 3 devices for 2 members"),
        (dict(device_map=missing), ConfigError, f"device '{missing}' does not exist on this machine"),
        (dict(device_map=["cpu", missing]), ConfigError, "does not exist on this machine.*use 'cpu'"),
        (dict(device_map="banana"), ConfigError, "unknown device 'banana'; use e.g. 'cpu'"),
        (dict(device_map="meta"), ConfigError, "holds no weights"),
    ]
    if not torch.backends.mps.is_available():
        cases.append((dict(device_map="mps"), ConfigError, "device 'mps' does not exist"))
    for kwargs, cls, pattern in cases:
        with pytest.raises(cls, match=pattern):
            Ensemble.from_pretrained([str(model_dir), str(model_dir)], **kwargs)
    assert loads == []  # refused before any weights were read
    with pytest.raises(ConfigError, match="does not exist on this machine"):
        Ensemble.from_pretrained([ModelSpec(str(model_dir), device=missing)])
    ens = Ensemble.from_pretrained([str(model_dir), str(model_dir)], device_map=["cpu", "cpu"])
    check_invariants(ens.generate(PROMPT, max_new_tokens=3), 3)
    still_works(ens2, baseline)
