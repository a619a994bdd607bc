"""langchain_safe with tiny random models over real tokenizers: SafeLLM and ChatSafe behaviour.

The tiny models write gibberish, so tests compare the adapters with the engine itself (greedy decoding
is deterministic) and script the engine's verified text where a test needs a particular reply.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel

from langchain_safe import ChatSafe, SafeLLM
from langchain_safe._messages import to_engine_messages
from safe_engine import Ensemble, GenerationTimeout, SafeEngineError
from safe_engine.errors import ConfigError, InputError
from safe_engine.shaping.chat import chat_prompt_ids
from safe_engine.shaping.schemas import strict
from safe_engine.shaping.tools import new_tool_call_id
from tests.conftest import save_tiny_member, tiny_member, tokenizer
from tests.scripted import ScriptedStream, script

PROMPT = "The quick brown fox"
N = 12


@pytest.fixture(scope="module")
def members():
    """Qwen (template renders tools) + EXAONE (template ignores tools): both have chat templates."""
    return [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("exaone-3.5", 2)]


@pytest.fixture
def ens(members) -> Ensemble:
    return Ensemble(members, drafter=0)


@pytest.fixture
def llm(ens) -> SafeLLM:
    return SafeLLM(ensemble=ens, max_new_tokens=N)


@pytest.fixture
def chat(ens) -> ChatSafe:
    return ChatSafe(ensemble=ens, max_tokens=N)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


@tool
def add(a: int, b: int) -> int:
    """Add two integers a and b."""
    return a + b


class Recorder(BaseCallbackHandler):
    """Records every token and the final LLMResult the callbacks see."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.ends: list = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response, **kwargs) -> None:
        self.ends.append(response)


# -- SafeLLM ---------------------------------------------------------------------------------------------
def test_llm_invoke_matches_the_engine(llm, ens):
    expected = ens.generate(PROMPT, max_new_tokens=N)
    assert llm.invoke(PROMPT) == expected.text
    assert expected.text


def test_llm_batch(llm, ens):
    prompts = [PROMPT, "Once upon a time"]
    assert llm.batch(prompts) == [ens.generate(p, max_new_tokens=N).text for p in prompts]


def test_batches_decode_together(llm, chat, ens, monkeypatch):
    """SafeLLM.batch / abatch and ChatSafe.batch put the prompts in one engine batch (the scheduler steps
    them in the same rounds); each answer is the one the prompt gets alone."""
    from safe_engine.engine import rounds

    prompts = ["Hello", "The quick brown fox", "Once upon a time"]
    options = {"schedule": "rounds"}  # alone, a request may overlap instead: the same text either way
    alone = [llm.invoke(p, **options) for p in prompts]
    widths: list[int] = []
    run_round = rounds.run_round
    monkeypatch.setattr(
        "safe_engine.engine.scheduler.run_round", lambda gens: widths.append(len(gens)) or run_round(gens)
    )
    assert llm.batch(prompts, **options) == alone and max(widths) == 3
    widths.clear()
    assert asyncio.run(llm.abatch(prompts, **options)) == alone and max(widths) == 3
    widths.clear()
    replies = chat.batch(prompts, **options)
    assert [r.content for r in replies] == [chat.invoke(p, **options).content for p in prompts] and max(widths) >= 2


def test_llm_generate_carries_stats_and_finish_reason(llm):
    result = llm.generate([PROMPT])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] in ("eos", "length", "stop")
    stats = info["stats"]
    assert stats["tokens"] > 0 and 0.0 <= info["ensemble_rate"] <= 1.0
    assert info["ensemble_rate"] == pytest.approx(stats["ensembled_tokens"] / stats["tokens"])
    assert set(stats["forward_passes"]) == set(llm.member_names)
    assert result.llm_output["model_name"] == llm.ensemble_name


def test_llm_stream_yields_verified_deltas(llm):
    chunks = list(llm.stream(PROMPT))
    assert len([c for c in chunks if c]) > 1
    assert "".join(chunks) == llm.invoke(PROMPT)


async def test_llm_astream_and_ainvoke(llm):
    text = llm.invoke(PROMPT)
    chunks = [c async for c in llm.astream(PROMPT)]
    assert "".join(chunks) == text
    assert await llm.ainvoke(PROMPT) == text
    assert await llm.abatch([PROMPT, PROMPT]) == [text, text]


def test_llm_callbacks_receive_exactly_the_streamed_deltas(llm):
    rec = Recorder()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [rec]}))
    assert rec.tokens == chunks
    info = rec.ends[0].generations[0][0].generation_info
    assert info["finish_reason"] in ("eos", "length", "stop") and "stats" in info
    rec2 = Recorder()
    text = llm.invoke(PROMPT, config={"callbacks": [rec2]})
    assert "".join(rec2.tokens) == text and all(rec2.tokens)


async def test_llm_async_callbacks_receive_exactly_the_streamed_deltas(llm):
    rec = Recorder()
    chunks = [c async for c in llm.astream(PROMPT, config={"callbacks": [rec]})]
    assert rec.tokens == chunks


def test_llm_stop_sequences(llm, ens):
    full = ens.generate(PROMPT, max_new_tokens=N).text
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    before = full[: full.index(stop)]
    result = llm.generate([PROMPT], stop=[stop]).generations[0][0]
    assert result.text == before and stop not in result.text
    assert result.generation_info["finish_reason"] == "stop"
    assert "".join(llm.stream(PROMPT, stop=[stop])) == before
    # A field-level stop applies by default; a call's own stop replaces it.
    with_default = SafeLLM(ensemble=ens, max_new_tokens=N, stop=[stop])
    assert with_default.invoke(PROMPT) == before
    assert with_default.invoke(PROMPT, stop=["\x00never"]) == full


def test_llm_lcel_composition(llm):
    prompt = PromptTemplate.from_template("The {animal} jumps over")
    chain = prompt | llm | StrOutputParser()
    assert chain.invoke({"animal": "fox"}) == llm.invoke("The fox jumps over")


def test_llm_per_call_options_override_fields(llm):
    short = llm.generate([PROMPT], max_new_tokens=3).generations[0][0].generation_info
    assert short["stats"]["tokens"] <= 3 and short["finish_reason"] in ("length", "eos", "stop")
    alias = llm.generate([PROMPT], max_tokens=2).generations[0][0].generation_info
    assert alias["stats"]["tokens"] <= 2
    single = llm.generate([PROMPT], method="single").generations[0][0].generation_info
    assert single["stats"]["method"] == "single" and single["stats"]["ensembled_tokens"] == 0
    with pytest.raises(ConfigError, match="unknown option"):
        llm.invoke(PROMPT, bogus=1)


def test_llm_temperature_semantics(ens):
    greedy = SafeLLM(ensemble=ens, max_new_tokens=N, temperature=0).invoke(PROMPT)
    assert greedy == ens.generate(PROMPT, max_new_tokens=N).text
    sampled = SafeLLM(ensemble=ens, max_new_tokens=N, temperature=1.5, seed=7)
    assert sampled.invoke(PROMPT) == sampled.invoke(PROMPT)  # seeded sampling is reproducible
    assert (
        sampled.invoke(PROMPT) == ens.generate(PROMPT, max_new_tokens=N, do_sample=True, temperature=1.5, seed=7).text
    )


def test_llm_identity(llm):
    assert llm._llm_type == "safe-ensemble"
    params = llm._identifying_params
    assert (
        params["models"] == ["qwen2.5-7b-instruct-1", "exaone-3.5-2"] and params["drafter"] == "qwen2.5-7b-instruct-1"
    )
    assert params["method"] == "safe" and params["max_new_tokens"] == N
    ls = llm._get_ls_params(stop=["x"])
    assert ls["ls_provider"] == "safe" and ls["ls_model_type"] == "llm" and ls["ls_stop"] == ["x"]
    assert ls["ls_model_name"] == "safe:qwen2.5-7b-instruct-1+exaone-3.5-2"


def test_construction_errors(ens):
    with pytest.raises(ConfigError, match="exactly one of"):
        SafeLLM()
    with pytest.raises(ConfigError, match="exactly one of"):
        SafeLLM(ensemble=ens, models=["smollm2-135m"])
    with pytest.raises(ConfigError, match="only apply when loading"):
        SafeLLM(ensemble=ens, drafter=1)
    with pytest.raises(ConfigError, match="drafter must be"):
        ChatSafe(models=["a", "b"], drafter=2)
    with pytest.raises(ConfigError, match="unknown method"):
        SafeLLM(ensemble=ens, method="bogus")
    with pytest.raises(ConfigError, match="draft_length"):
        ChatSafe(ensemble=ens, draft_length=0)
    with pytest.raises(ConfigError, match=r"ChatSafe: invalid top_k: .*integer.*'ten'"):
        ChatSafe(ensemble=ens, top_k="ten")  # pydantic's own type check, reported as a ConfigError too


def _save_tiny(tmp_path, name: str, seed: int) -> str:
    return save_tiny_member(name, seed, tmp_path / f"{name}-saved")


def test_lazy_loading_from_specs(tmp_path, monkeypatch, members):
    dirs = [_save_tiny(tmp_path, "qwen2.5-7b-instruct", 1), _save_tiny(tmp_path, "exaone-3.5", 2)]
    loads = []
    original = Ensemble.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        loads.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(Ensemble, "from_pretrained", classmethod(spy))
    started = time.perf_counter()
    llm = SafeLLM(models=[str(d) for d in dirs], max_new_tokens=N, dtype="float32")
    chat = ChatSafe(models=[str(d) for d in dirs], max_tokens=N)
    assert time.perf_counter() - started < 1.0
    assert loads == [] and not llm.is_loaded and not chat.is_loaded
    assert llm.member_names == ["qwen2.5-7b-instruct-saved", "exaone-3.5-saved"]
    assert llm._identifying_params["models"] == llm.member_names and loads == []

    text = llm.invoke(PROMPT)
    assert len(loads) == 1 and llm.is_loaded
    assert text == Ensemble(members).generate(PROMPT, max_new_tokens=N).text  # same weights, same text
    assert llm.invoke(PROMPT) == text and len(loads) == 1  # loaded once
    assert chat.invoke("Hi").content is not None and len(loads) == 2


async def test_lazy_loading_async_does_not_block_the_loop(tmp_path):
    llm = SafeLLM(models=[str(_save_tiny(tmp_path, "qwen2.5-7b-instruct", 1))], max_new_tokens=N)
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    chunks = [c async for c in llm.astream(PROMPT)]
    stop.set()
    await task
    assert chunks and ticks > 5  # the loop kept running while loading and decoding


# -- ChatSafe: messages ----------------------------------------------------------------------------------
def test_messages_to_openai_dicts():
    call = {"name": "multiply", "args": {"a": 2, "b": 3}, "id": "abc123xyz", "type": "tool_call"}
    msgs = to_engine_messages(
        [
            SystemMessage("be brief"),
            HumanMessage("2*3?"),
            AIMessage("", tool_calls=[call]),
            ToolMessage("6", tool_call_id="abc123xyz", name="multiply"),
            AIMessage([{"type": "text", "text": "It is "}, {"type": "text", "text": "6."}]),
        ]
    )
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2*3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [  # OpenAI's shape (arguments as JSON text); the engine shapes it for each template
                {
                    "id": "abc123xyz",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "content": "6", "tool_call_id": "abc123xyz", "name": "multiply"},
        {"role": "assistant", "content": "It is 6."},
    ]
    with pytest.raises(InputError, match="text-only"):
        to_engine_messages([HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])])
    anthropic_style = AIMessage(
        [{"type": "text", "text": "calling"}, {"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
        tool_calls=[{"name": "add", "args": {}, "id": "t1", "type": "tool_call"}],
    )
    assert to_engine_messages([anthropic_style])[0]["content"] == "calling"


def test_tool_history_renders_in_every_template(members):
    """OpenAI-style ids reach Mistral's strict template (9 alphanumerics) as an alias; Qwen and EXAONE
    render the same history."""
    call_id = new_tool_call_id()
    assert call_id.startswith("call_") and len(call_id) == 29
    history = to_engine_messages(
        [
            HumanMessage("What is 2*3?"),
            AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 2, "b": 3}, "id": call_id}]),
            ToolMessage("6", tool_call_id=call_id),
        ]
    )
    mistral = tiny_member("mistral-7b-instruct-v0.3", 3)
    for member in [*members, mistral]:
        text = member.tokenizer.decode(chat_prompt_ids(member, history, None))
        assert "6" in text and "What is 2*3?" in text and "multiply" in text


def test_chat_invoke_stream_astream_agree(chat, ens):
    msg = chat.invoke("Hello")
    assert isinstance(msg, AIMessage) and msg.content
    expected = ens.generate(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=N)
    assert msg.content == expected.text
    full = None
    chunks = list(chat.stream("Hello"))
    for c in chunks:
        assert isinstance(c, AIMessageChunk)
        full = c if full is None else full + c
    assert full.content == msg.content and chunks[-1].chunk_position == "last"
    assert full.usage_metadata == msg.usage_metadata
    assert full.response_metadata["finish_reason"] == msg.response_metadata["finish_reason"]

    async def collect():
        out = None
        async for c in chat.astream("Hello"):
            out = c if out is None else out + c
        return out, await chat.ainvoke("Hello")

    afull, amsg = asyncio.run(collect())
    assert afull.content == msg.content == amsg.content


def test_chat_usage_and_response_metadata(chat, ens, members):
    msg = chat.invoke([SystemMessage("You are terse."), HumanMessage("Hello")])
    drafter_prompt = chat_prompt_ids(
        members[0], [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    )
    stats = msg.response_metadata["stats"]
    assert msg.usage_metadata["input_tokens"] == len(drafter_prompt) == stats["prompt_tokens"][ens.names[0]]
    assert msg.usage_metadata["output_tokens"] == stats["tokens"]
    assert msg.usage_metadata["total_tokens"] == len(drafter_prompt) + stats["tokens"]
    meta = msg.response_metadata
    assert meta["model_name"] == chat.ensemble_name and meta["model_provider"] == "safe"
    assert meta["finish_reason"] in ("eos", "length", "stop")
    assert meta["ensemble_rate"] == pytest.approx(stats["ensembled_tokens"] / stats["tokens"])


def test_chat_stop_and_callbacks(chat, ens):
    full = ens.generate(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=N).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip()
    msg = chat.invoke("Hello", stop=[stop])
    assert msg.content == full[: full.index(stop)] and msg.response_metadata["finish_reason"] == "stop"
    rec = Recorder()
    chunks = [c.content for c in chat.stream("Hello", config={"callbacks": [rec]})]
    assert rec.tokens == chunks


def test_chat_ls_params(chat):
    ls = chat._get_ls_params(stop=["x"])
    assert ls == {
        "ls_provider": "safe",
        "ls_model_name": "safe:qwen2.5-7b-instruct-1+exaone-3.5-2",
        "ls_model_type": "chat",
        "ls_max_tokens": N,
        "ls_stop": ["x"],
    }
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"
    assert chat._llm_type == "safe-ensemble-chat"


# -- ChatSafe: tools -------------------------------------------------------------------------------------
def _multiply_schema():
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return [convert_to_openai_tool(multiply), convert_to_openai_tool(add)]


def test_tool_calls_end_to_end_with_a_scripted_reply(chat, ens, monkeypatch):
    reply = ["Sure.", '\n<tool_call>\n{"name": "multiply", ', '"arguments": {"a": 2, "b": 3}}\n</tool_call>']
    calls = script(monkeypatch, ens, reply)
    bound = chat.bind_tools([multiply, add])
    msg = bound.invoke("What is 2*3?")
    assert msg.content == "Sure.\n"
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 2, "b": 3})]
    assert msg.usage_metadata == {"input_tokens": 10, "output_tokens": 7, "total_tokens": 17}
    request = calls[0]
    assert [t["function"]["name"] for t in request.tools] == ["multiply", "add"]
    assert request.messages == ({"role": "user", "content": "What is 2*3?"},)
    assert request.config.max_new_tokens == N and request.prompt is None

    chunks = list(bound.stream("What is 2*3?"))
    assert [c.content for c in chunks] == ["Sure.", "\n", ""]  # the last chunk carries the calls
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert full.content == "Sure.\n" and [c["name"] for c in full.tool_calls] == ["multiply"]
    assert full.tool_calls[0]["args"] == {"a": 2, "b": 3}

    async def astream():
        out = None
        async for c in bound.astream("What is 2*3?"):
            out = c if out is None else out + c
        return out, await bound.ainvoke("What is 2*3?")

    afull, amsg = asyncio.run(astream())
    assert afull.tool_calls[0]["args"] == amsg.tool_calls[0]["args"] == {"a": 2, "b": 3}


def test_malformed_call_end_to_end_is_not_an_exception(chat, ens, monkeypatch):
    script(monkeypatch, ens, ['<tool_call>{"name": "multiply", "arguments": {a: 2}}</tool_call>'])
    msg = chat.bind_tools([multiply]).invoke("2*3?")
    assert msg.tool_calls == [] and msg.content == ""
    assert msg.invalid_tool_calls[0]["name"] == "multiply" and "invalid JSON" in msg.invalid_tool_calls[0]["error"]


def test_tool_choice_and_parallel_tool_calls(chat, ens, monkeypatch):
    two = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'
    )
    calls = script(monkeypatch, ens, [two])
    msg = chat.bind_tools([multiply, add], tool_choice="multiply").invoke(
        [SystemMessage("Be exact."), HumanMessage("?")]
    )
    assert len(msg.tool_calls) == 2
    # the engine enforces the choice (grammar) and instructs the members; the adapter passes it on
    assert calls[-1].messages[0]["content"].startswith('Be exact.\n\nYou must call the tool "multiply"')
    assert calls[-1].tool_choice == "multiply" and calls[-1].parallel_tool_calls is True
    assert calls[-1].grammar is not None
    chat.bind_tools([multiply, add], tool_choice="any").invoke("?")
    assert calls[-1].tool_choice == "required"
    chat.bind_tools([multiply, add], tool_choice="auto").invoke("?")
    assert calls[-1].messages == ({"role": "user", "content": "?"},) and calls[-1].tool_choice == "auto"
    msg = chat.bind_tools([multiply, add], tool_choice="none").invoke("?")
    assert calls[-1].tools is None and msg.tool_calls == []
    msg = chat.bind_tools([multiply, add], parallel_tool_calls=False).invoke("?")
    assert [c["name"] for c in msg.tool_calls] == ["add"] and calls[-1].parallel_tool_calls is False
    with pytest.raises(ConfigError, match="not a bound tool"):
        chat.bind_tools([multiply], tool_choice="divide")


def test_with_structured_output_via_tools(chat, ens, monkeypatch):
    class Product(BaseModel):
        """The product of two numbers."""

        value: int

    calls = script(monkeypatch, ens, ['{"value": 6}'])  # a small model's bare-arguments reply
    assert chat.with_structured_output(Product, method="function_calling").invoke("2*3?") == Product(value=6)
    assert calls[-1].tool_choice == "required" and [t["function"]["name"] for t in calls[-1].tools] == ["Product"]
    script(monkeypatch, ens, ['<tool_call>{"name": "Product", "arguments": {"value": 6}}</tool_call>'])
    schema = Product.model_json_schema()
    assert chat.with_structured_output(schema, method="function_calling").invoke("2*3?") == {"value": 6}
    raw = chat.with_structured_output(Product, method="function_calling", include_raw=True).invoke("2*3?")
    assert raw["parsed"] == Product(value=6) and isinstance(raw["raw"], AIMessage)


def test_tools_reach_each_members_template(members):
    """Qwen renders the schemas itself; EXAONE's template ignores tools, so they go in its system message."""
    schemas = _multiply_schema()
    msgs = [{"role": "user", "content": "What is 2*3?"}]
    qwen = tokenizer("qwen2.5-7b-instruct").decode(chat_prompt_ids(members[0], msgs, schemas))
    exaone = tokenizer("exaone-3.5").decode(chat_prompt_ids(members[1], msgs, schemas))
    assert "<tools>" in qwen and '"multiply"' in qwen
    assert '"multiply"' in exaone and "<tool_call>" in exaone
    assert exaone.index('"multiply"') < exaone.index("What is 2*3?")


def test_tools_with_real_decoding_do_not_raise(chat):
    """Random tiny models write gibberish; whatever they write, the reply is a well-formed AIMessage."""
    msg = chat.bind_tools([multiply, add], tool_choice="any").invoke("What is 2*3?")
    assert isinstance(msg, AIMessage) and isinstance(msg.tool_calls, list)
    json.dumps(msg.response_metadata)


def test_engine_errors_surface_as_safe_engine_errors(chat):
    with pytest.raises(SafeEngineError):
        chat.invoke("Hi", method="bogus")


def test_unknown_constructor_parameters_are_refused(ens):
    with pytest.raises(ConfigError, match="unknown parameter"):
        ChatSafe(ensemble=ens, max_new_token=5)
    # LangChain's standard parameters: api_key is accepted (nothing to authenticate), timeout is the
    # engine's timeout_s, retries are refused (a local generation would fail the same way again).
    chat = ChatSafe(ensemble=ens, api_key="x", timeout=30, max_retries=0, streaming=True)
    assert chat.streaming and chat.timeout_s == 30
    with pytest.raises(ConfigError, match=r"does not retry .*with_retry"):
        ChatSafe(ensemble=ens, max_retries=2)


def test_package_imports_without_llama_index():
    code = (
        "import sys, langchain_safe; "
        "assert not any(m.split('.')[0] in ('llama_index', 'llamaindex_safe') for m in sys.modules); "
        "print(sorted(langchain_safe.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['ChatSafe', 'SafeLLM']"


def test_leaving_a_stream_early_frees_the_request(llm, chat, ens, monkeypatch):
    opened: list[ScriptedStream] = []
    script(monkeypatch, ens, ["a", "b", "c", "d"])
    scripted = ens.stream
    monkeypatch.setattr(ens, "stream", lambda *a, **k: opened.append(scripted(*a, **k)) or opened[-1])
    for model in (llm, chat):
        stream = model.stream("Hi")
        next(stream)
        stream.close()
        assert opened[-1].closed and opened[-1].result is None

        async def first(model=model):
            agen = model.astream("Hi")
            await agen.__anext__()
            await agen.aclose()

        asyncio.run(first())
        assert opened[-1].closed and opened[-1].result is None


def test_timeout_is_the_engines_timeout_s_and_is_enforced(ens):
    """`timeout` (LangChain's standard name) is `timeout_s`: a generation past it raises GenerationTimeout."""
    for model in (
        ChatSafe(ensemble=ens, max_tokens=N, timeout=1e-9),
        SafeLLM(ensemble=ens, max_tokens=N, timeout=1e-9),
    ):
        assert model.timeout_s == 1e-9
        with pytest.raises(GenerationTimeout, match="timeout_s"):
            model.invoke(PROMPT)
        with pytest.raises(GenerationTimeout):
            list(model.stream(PROMPT))
    # per call, under either name
    chat = ChatSafe(ensemble=ens, max_tokens=N)
    with pytest.raises(GenerationTimeout):
        chat.invoke(PROMPT, timeout=1e-9)
    with pytest.raises(GenerationTimeout):
        asyncio.run(chat.ainvoke(PROMPT, timeout_s=1e-9))
    assert chat.invoke(PROMPT, timeout=60).content == chat.invoke(PROMPT).content
    with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
        ChatSafe(ensemble=ens, timeout=0)


def test_with_structured_output_methods(chat, ens, monkeypatch):
    class Product(BaseModel):
        """The product of two numbers."""

        value: int

    calls = script(monkeypatch, ens, ['{"value": 6}'])
    # json_schema (the default): the engine decodes under the schema; no tools are bound
    assert chat.with_structured_output(Product).invoke("2*3?") == Product(value=6)
    assert calls[-1].json_schema == strict(convert_to_json_schema(Product)) and calls[-1].tools is None
    assert calls[-1].json_schema["additionalProperties"] is False  # strict: no keys the class does not name
    assert chat.with_structured_output(Product, method="json_schema").invoke("2*3?") == Product(value=6)
    assert chat.with_structured_output(Product, strict=True).invoke("2*3?") == Product(value=6)
    assert calls[-1].json_schema["additionalProperties"] is False
    assert chat.with_structured_output(Product, strict=False).invoke("2*3?") == Product(value=6)
    assert calls[-1].json_schema == convert_to_json_schema(Product)  # JSON Schema's meaning: other keys allowed
    with pytest.raises(ConfigError, match="strict must be True, False or None"):
        chat.with_structured_output(Product, strict="yes")
    # json_mode: any JSON object (the parser also takes a code fence, e.g. from a scripted reply)
    calls = script(monkeypatch, ens, ['Here it is:\n```json\n{"value": 6}\n```'])
    assert chat.with_structured_output(Product, method="json_mode").invoke("2*3? Reply in JSON.") == Product(value=6)
    assert calls[-1].response_format == "json_object" and calls[-1].json_schema is None
    assert chat.with_structured_output(Product.model_json_schema(), method="json_mode").invoke("?") == {"value": 6}
    raw = chat.with_structured_output(Product, method="json_mode", include_raw=True).invoke("?")
    assert raw["parsed"] == Product(value=6) and raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)
    script(monkeypatch, ens, ["no JSON at all"])
    failed = chat.with_structured_output(Product, method="json_mode", include_raw=True).invoke("?")
    assert failed["parsed"] is None and failed["parsing_error"] is not None
    with pytest.raises(ConfigError, match="unknown method 'xml'"):
        chat.with_structured_output(Product, method="xml")
