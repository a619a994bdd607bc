"""llamaindex_safe.SafeLLM on tiny random models over real tokenizers (fast; no real weights)."""

from __future__ import annotations

import asyncio
import copy
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from llama_index.core import Document, MockEmbedding, Settings, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import TextBlock, ToolCallBlock
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionInProgressEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.llms import ChatMessage, CompletionResponse, MessageRole
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

import safe_engine.engine.ensemble
from llamaindex_safe import SafeLLM
from safe_engine import (
    ChatTemplateError,
    ConfigError,
    Ensemble,
    GenerationTimeout,
    InputTypeError,
    ModelLoadError,
    ToolCallError,
)
from safe_engine.shaping.schemas import strict
from safe_engine.shaping.tools import TOOL_CALL_OPEN
from tests.conftest import save_tiny_member, tiny_member
from tests.scripted import script

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"
N = 8  # max_new_tokens: enough for several streamed rounds, small enough for a fast suite
MESSAGES = [ChatMessage(role=MessageRole.USER, content="Name three colours.")]
ENGINE_MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def ens() -> Ensemble:
    """Two members with chat templates and different tokenizers (byte-level BPE and SentencePiece)."""
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("mistral-7b-instruct-v0.3", 2)])


@pytest.fixture
def llm(ens) -> SafeLLM:
    return SafeLLM(ensemble=ens, max_new_tokens=N)


class Collector(BaseEventHandler):
    events: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Collector"

    def handle(self, event, **kwargs) -> None:
        self.events.append(event)

    def types(self) -> list[type]:
        return [type(e) for e in self.events]


@pytest.fixture
def collector():
    root = get_dispatcher()
    handler = Collector()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


# -- packaging -----------------------------------------------------------------------------------------------
def test_imports_without_langchain():
    """llamaindex_safe never imports langchain: importing it with every langchain* import blocked works."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0].startswith('langchain'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from llamaindex_safe import SafeLLM\n"
        "from llama_index.llms.safe import SafeLLM as Alias\n"
        "assert Alias is SafeLLM\n"
        "bad = [m for m in sys.modules if m.split('.')[0].startswith('langchain')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_llama_index_namespace_package():
    import llama_index.core  # noqa: F401 - the core distribution's part of the namespace still imports

    from llama_index.llms.safe import SafeLLM as Alias

    assert Alias is SafeLLM
    # Our part of the namespace must not own it: no __init__.py above llama_index/llms/safe.
    assert not (REPO / "llama_index" / "__init__.py").exists()
    assert not (REPO / "llama_index" / "llms" / "__init__.py").exists()
    assert (REPO / "llama_index" / "llms" / "safe" / "__init__.py").is_file()


# -- construction --------------------------------------------------------------------------------------------
def test_construction_errors(ens):
    with pytest.raises(ConfigError, match="exactly one of"):
        SafeLLM()
    with pytest.raises(ConfigError, match="exactly one of"):
        SafeLLM(ensemble=ens, models=["smollm2-135m"])
    with pytest.raises(InputTypeError, match=r"safe_engine\.Ensemble"):
        SafeLLM(ensemble="smollm2-135m")
    with pytest.raises(ConfigError, match="unknown method"):
        SafeLLM(ensemble=ens, method="nope")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SafeLLM(models=["a", "b"], max_new_tokens=0)
    with pytest.raises(ConfigError, match="drafter"):
        SafeLLM(models=["a", "b"], drafter=2)
    with pytest.raises(ConfigError, match="weights"):
        SafeLLM(models=["a", "b"], weights=[1.0])
    with pytest.raises(ConfigError, match="non-empty list"):
        SafeLLM(models="smollm2-135m")
    with pytest.raises(ConfigError, match="only apply when loading"):
        SafeLLM(ensemble=ens, weights=[1, 2])
    with pytest.raises(ConfigError, match=r"invalid top_k: .*integer.*'ten'"):
        SafeLLM(ensemble=ens, top_k="ten")
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['max_new_token'\]"):
        SafeLLM(ensemble=ens, max_new_token=5)  # a misspelt option is refused, not silently ignored


def test_knobs_are_fields_and_serialise(ens):
    llm = SafeLLM(ensemble=ens, method="every_token", aggregation="gac", top_k=3, stop="END", seed=7)
    assert (llm.method, llm.aggregation, llm.top_k, llm.stop, llm.seed) == ("every_token", "gac", 3, ["END"], 7)
    data = llm.to_dict()
    assert data["method"] == "every_token" and data["class_name"] == "SafeLLM"
    assert "_ensemble" not in data


# -- completion ----------------------------------------------------------------------------------------------
def test_complete_matches_engine_and_carries_stats(llm, ens):
    expected = ens.generate(PROMPT, max_new_tokens=N)
    response = llm.complete(PROMPT)
    assert isinstance(response, CompletionResponse)
    assert response.text == expected.text and response.text
    extra = response.additional_kwargs
    assert extra["finish_reason"] == expected.finish_reason == "length"
    assert extra["tokens"] == N
    assert extra["ensemble_rate"] == pytest.approx(extra["ensembled_tokens"] / extra["tokens"])
    assert set(extra["forward_passes"]) == set(ens.names)
    raw = response.raw
    assert raw["stats"]["ensemble_rate"] == extra["ensemble_rate"]
    assert raw["usage"]["completion_tokens"] == N and raw["usage"]["prompt_tokens"] > 0


def test_stream_complete_cumulative_and_deltas(llm):
    full = llm.complete(PROMPT).text
    chunks = list(llm.stream_complete(PROMPT))
    assert len(chunks) >= 2
    text = ""
    for chunk in chunks:
        text += chunk.delta
        assert chunk.text == text
    assert "".join(c.delta for c in chunks) == full == chunks[-1].text
    assert chunks[-1].additional_kwargs["tokens"] == N  # the stats arrive with the last chunk
    assert chunks[-1].raw["usage"]["completion_tokens"] == N
    assert all(not c.additional_kwargs for c in chunks[:-1])


def test_stream_closed_early_is_fine(llm):
    stream = llm.stream_complete(PROMPT)
    first = next(stream)
    assert first.delta
    stream.close()
    assert llm.complete(PROMPT, max_new_tokens=2).text  # the ensemble is still usable


def test_per_call_options_and_stop(llm, ens):
    short = llm.complete(PROMPT, max_new_tokens=3)
    assert short.additional_kwargs["tokens"] <= 3
    assert short.text == ens.generate(PROMPT, max_new_tokens=3).text
    full = llm.complete(PROMPT).text
    stop = full.strip()[len(full.strip()) // 2 :][:3]
    stopped = llm.complete(PROMPT, stop=[stop])
    assert stopped.additional_kwargs["finish_reason"] == "stop"
    assert stop not in stopped.text and full.startswith(stopped.text)
    as_field = SafeLLM(ensemble=ens, max_new_tokens=N, stop=[stop]).complete(PROMPT)
    assert as_field.text == stopped.text
    single = llm.complete(PROMPT, method="single")
    assert single.additional_kwargs["ensembled_tokens"] == 0
    with pytest.raises(ConfigError, match="unknown option 'not_an_option'"):  # as at every door
        llm.complete(PROMPT, max_new_tokens=2, not_an_option=1)
    with pytest.raises(ValueError, match="top_k"):
        llm.complete(PROMPT, top_k=0)


def test_completion_to_prompt_in_complete_and_stream(ens):
    def wrap(prompt: str) -> str:
        return f"Question: {prompt}\nAnswer:"

    llm = SafeLLM(ensemble=ens, max_new_tokens=N, completion_to_prompt=wrap)
    expected = ens.generate(wrap(PROMPT), max_new_tokens=N).text
    assert expected != ens.generate(PROMPT, max_new_tokens=N).text
    assert llm.complete(PROMPT).text == expected
    assert "".join(c.delta for c in llm.stream_complete(PROMPT)) == expected  # HuggingFaceLLM skips it here
    # formatted=True means the prompt is final
    assert llm.complete(PROMPT, formatted=True).text == ens.generate(PROMPT, max_new_tokens=N).text


# -- chat ----------------------------------------------------------------------------------------------------
def test_chat_uses_each_members_template(llm, ens):
    expected = ens.generate(messages=ENGINE_MESSAGES, max_new_tokens=N).text
    generic = ens.generate(generic_messages_to_prompt(MESSAGES), max_new_tokens=N).text
    assert expected != generic  # the two routes really differ for these models
    response = llm.chat(MESSAGES)
    assert response.message.role == MessageRole.ASSISTANT
    assert response.message.content == expected
    assert response.additional_kwargs["tokens"] == N and "usage" in response.raw


def test_stream_chat(llm):
    full = llm.chat(MESSAGES).message.content
    chunks = list(llm.stream_chat(MESSAGES))
    assert len(chunks) >= 2
    text = ""
    for chunk in chunks:
        text += chunk.delta
        assert chunk.message.content == text and chunk.message.role == MessageRole.ASSISTANT
    assert text == full
    assert chunks[-1].additional_kwargs["finish_reason"] == "length"


def test_chat_system_prompt_and_roles(ens):
    llm = SafeLLM(ensemble=ens, max_new_tokens=N, system_prompt="Answer briefly.")
    expected = ens.generate(
        messages=[{"role": "system", "content": "Answer briefly."}, *ENGINE_MESSAGES], max_new_tokens=N
    )
    assert llm.chat(MESSAGES).message.content == expected.text
    # an explicit system message wins over system_prompt
    own = [ChatMessage(role="system", content="Be verbose."), *MESSAGES]
    expected = ens.generate(messages=[{"role": "system", "content": "Be verbose."}, *ENGINE_MESSAGES], max_new_tokens=N)
    assert llm.chat(own).message.content == expected.text


def test_custom_messages_to_prompt_is_honoured(ens):
    def render(messages) -> str:
        return "".join(f"[{m.role.value}] {m.content}\n" for m in messages) + "[assistant] "

    llm = SafeLLM(ensemble=ens, max_new_tokens=N, messages_to_prompt=render)
    expected = ens.generate(render(MESSAGES), max_new_tokens=N).text
    assert llm.chat(MESSAGES).message.content == expected
    assert "".join(c.delta for c in llm.stream_chat(MESSAGES)) == expected


def test_chat_without_template_says_what_to_do():
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 3)])
    llm = SafeLLM(ensemble=ens, max_new_tokens=2)
    assert llm.metadata.is_chat_model is False  # so LlamaIndex prefers complete()
    with pytest.raises(ChatTemplateError, match="chat template"):
        llm.chat(MESSAGES)
    assert llm.complete(PROMPT).text


# -- async ---------------------------------------------------------------------------------------------------
async def test_async_variants_match_sync(llm):
    assert (await llm.acomplete(PROMPT)).text == llm.complete(PROMPT).text
    chunks = [c async for c in await llm.astream_complete(PROMPT)]
    assert "".join(c.delta for c in chunks) == chunks[-1].text == llm.complete(PROMPT).text
    assert chunks[-1].additional_kwargs["tokens"] == N
    chat = await llm.achat(MESSAGES)
    assert chat.message.content == llm.chat(MESSAGES).message.content
    assert chat.additional_kwargs["tokens"] == N
    chunks = [c async for c in await llm.astream_chat(MESSAGES)]
    assert "".join(c.delta for c in chunks) == chunks[-1].message.content == chat.message.content


@pytest.fixture
def slow_llm(ens, monkeypatch):
    """Every member forward takes ≥ 30 ms more (a blocking sleep, as a real model's compute would be)."""
    for member in ens.members:
        for name in ("forward", "forward_many"):  # one request, or a batch of them
            original = getattr(member, name, None)
            if original is None:
                continue

            def slow(*args, _original=original, **kwargs):
                time.sleep(0.03)
                return _original(*args, **kwargs)

            monkeypatch.setattr(member, name, slow)
    return SafeLLM(ensemble=ens, max_new_tokens=N)


@pytest.mark.parametrize("call", ["astream_complete", "acomplete", "astream_chat", "achat"])
async def test_async_does_not_block_event_loop(slow_llm, call):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    arg = PROMPT if "complete" in call else MESSAGES
    start, began = ticks, time.perf_counter()
    result = await getattr(slow_llm, call)(arg)
    seen = []
    if call.startswith("astream"):
        async for _ in result:
            seen.append(ticks)
    elapsed = time.perf_counter() - began
    task.cancel()
    # A blocking implementation lets the ticker run ~0 times while decoding; here it keeps going.
    assert elapsed > 0.3
    assert ticks - start >= 10, f"only {ticks - start} ticks in {elapsed:.2f} s"
    if seen:
        assert seen[-1] - seen[0] >= 3  # it ticked between chunks, not only before or after


# -- metadata and lazy loading ------------------------------------------------------------------------------
def test_metadata_values(ens):
    llm = SafeLLM(ensemble=ens, max_new_tokens=17)
    meta = llm.metadata
    assert meta.context_window == ens.context_window == 4096
    assert meta.num_output == 17
    assert meta.is_chat_model is True
    assert meta.model_name == "safe:" + "+".join(ens.names)

    small = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("mistral-7b-instruct-v0.3", 5, context=2048)])
    assert SafeLLM(ensemble=small).metadata.context_window == 2048  # the smallest member's
    capped = SafeLLM(ensemble=small, context_window=1000, model_name="mine", is_chat_model=False).metadata
    assert (capped.context_window, capped.model_name, capped.is_chat_model) == (1000, "mine", False)
    assert SafeLLM(ensemble=small, context_window=100_000).metadata.context_window == 2048


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[str]:
    """Two tiny models saved with save_pretrained (+ their tokenizers), as a user's local directories."""
    root = tmp_path_factory.mktemp("models")
    return [
        save_tiny_member("qwen2.5-7b-instruct", 1, root / "qwen"),
        save_tiny_member("mistral-7b-instruct-v0.3", 2, root / "mistral", context=2048),
    ]


@pytest.fixture
def load_calls(monkeypatch) -> list[str]:
    """Record every member load (and the thread it ran in)."""
    calls: list[str] = []
    original = safe_engine.engine.ensemble.load_member

    def counting(spec, **kwargs):
        calls.append(threading.current_thread().name)
        return original(spec, **kwargs)

    monkeypatch.setattr(safe_engine.engine.ensemble, "load_member", counting)
    return calls


def test_lazy_loading_from_directories(model_dirs, load_calls, collector):
    llm = SafeLLM(models=model_dirs, drafter=1, max_new_tokens=4)
    assert not llm.is_loaded and load_calls == []
    # metadata is read from the config files, without loading weights
    meta = llm.metadata
    assert (meta.context_window, meta.is_chat_model) == (2048, True)
    assert meta.model_name == "safe:" + "+".join(Path(d).name for d in model_dirs)
    assert llm.to_payload()["drafter"] == Path(model_dirs[1]).name
    assert not llm.is_loaded and load_calls == []

    response = llm.complete(PROMPT)
    assert llm.is_loaded and len(load_calls) == 2
    assert response.text and response.additional_kwargs["tokens"] <= 4
    assert llm.ensemble.drafter.name == Path(model_dirs[1]).name
    assert llm.metadata == meta  # what was peeked is what the members say
    llm.chat(MESSAGES)
    assert len(load_calls) == 2  # loaded once


def test_copies_share_members_and_pickles_reload_lazily(model_dirs, ens):
    llm = SafeLLM(models=model_dirs, max_new_tokens=2)
    llm.complete(PROMPT)
    clone = copy.deepcopy(llm)
    assert clone.ensemble is llm.ensemble  # no second copy of the weights
    assert SafeLLM(ensemble=ens).model_copy(deep=True).ensemble is ens
    restored = pickle.loads(pickle.dumps(llm))
    assert llm.is_loaded and not restored.is_loaded  # specs travel, weights reload on first use
    assert restored.models == llm.models and restored.metadata == llm.metadata


async def test_lazy_loading_async_happens_off_the_loop(model_dirs, load_calls):
    llm = SafeLLM(models=model_dirs, max_new_tokens=2)
    assert load_calls == []
    chunks = [c async for c in await llm.astream_chat(MESSAGES)]
    assert chunks and len(load_calls) == 2
    assert all(name != threading.main_thread().name for name in load_calls)


def test_unknown_specs_fall_back_to_loading_for_metadata(load_calls):
    llm = SafeLLM(models=["/nonexistent/model-a", "/nonexistent/model-b"])
    assert llm.to_payload()["context_window"] > 0 and load_calls == []  # events never load
    with pytest.raises(ModelLoadError, match="not a model directory"):
        llm.metadata  # noqa: B018 - not peekable, so metadata loads (and the spec is reported)


# -- LlamaIndex integration ------------------------------------------------------------------------------------
def test_instrumentation_events(llm, collector):
    llm.complete(PROMPT)
    assert collector.types() == [LLMCompletionStartEvent, LLMCompletionEndEvent]
    end = collector.events[-1]
    assert end.response.additional_kwargs["tokens"] == N
    start = collector.events[0]
    assert start.prompt == PROMPT and start.model_dict["class_name"] == "SafeLLM"

    collector.events.clear()
    chunks = list(llm.stream_complete(PROMPT))
    types = collector.types()
    assert types[0] is LLMCompletionStartEvent and types[-1] is LLMCompletionEndEvent
    assert types.count(LLMCompletionInProgressEvent) == len(chunks)
    assert collector.events[-1].response.text == chunks[-1].text

    collector.events.clear()
    llm.chat(MESSAGES)
    assert collector.types() == [LLMChatStartEvent, LLMChatEndEvent]

    collector.events.clear()
    chunks = list(llm.stream_chat(MESSAGES))
    types = collector.types()
    assert types[0] is LLMChatStartEvent and types[-1] is LLMChatEndEvent
    assert types.count(LLMChatInProgressEvent) == len(chunks)


async def test_instrumentation_events_async(llm, collector):
    await llm.acomplete(PROMPT)
    assert collector.types() == [LLMCompletionStartEvent, LLMCompletionEndEvent]
    collector.events.clear()
    chunks = [c async for c in await llm.astream_chat(MESSAGES)]
    types = collector.types()
    assert types[0] is LLMChatStartEvent and types[-1] is LLMChatEndEvent
    assert types.count(LLMChatInProgressEvent) == len(chunks)


@pytest.fixture
def settings(monkeypatch):
    """Settings is global: restore the LLM and embedding model afterwards."""
    monkeypatch.setattr(Settings, "_llm", None)
    monkeypatch.setattr(Settings, "_embed_model", None)
    return Settings


DOCS = [
    "The Eiffel Tower is in Paris and was completed in 1889.",
    "Mount Fuji is the highest mountain in Japan.",
    "The Nile flows north into the Mediterranean Sea.",
]


def test_settings_llm_in_a_query_engine(ens, settings, collector):
    settings.llm = SafeLLM(ensemble=ens, max_new_tokens=N)
    settings.embed_model = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS])

    response = index.as_query_engine(similarity_top_k=2).query("Where is the Eiffel Tower?")
    chat_ends = [e for e in collector.events if isinstance(e, LLMChatEndEvent)]
    assert len(chat_ends) == 1  # a chat model: the QA prompt went through chat() and the members' templates
    assert str(response) == chat_ends[0].response.message.content and str(response)
    assert len(response.source_nodes) == 2
    starts = [e for e in collector.events if isinstance(e, LLMChatStartEvent)]
    assert any("Eiffel" in (m.content or "") for m in starts[0].messages)

    collector.events.clear()
    streaming = index.as_query_engine(similarity_top_k=2, streaming=True).query("Where is the Eiffel Tower?")
    text = "".join(streaming.response_gen)
    assert text == str(response)


async def test_query_engine_async(ens, settings):
    settings.llm = SafeLLM(ensemble=ens, max_new_tokens=N)
    settings.embed_model = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS])
    engine = index.as_query_engine(similarity_top_k=2)
    response = await engine.aquery("Where is the Eiffel Tower?")
    assert str(response) == str(engine.query("Where is the Eiffel Tower?"))


# -- tools: a FunctionCallingLLM ------------------------------------------------------------------------------
# The engine shows the tools to each member's template and reads the calls back (safe_engine.shaping.tools). Tiny
# random models write gibberish, so replies that must contain a call are scripted (tests/scripted.py); the
# real decoding path runs too. Qwen's template renders tools; Mistral's too, with strict 9-character ids.
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers a and b."""
    return a + b


TOOLS = [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(add)]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'


class Product(BaseModel):
    """The product of two numbers."""

    value: int


def test_it_is_a_function_calling_llm(llm, ens):
    assert isinstance(llm, FunctionCallingLLM) and isinstance(llm, CustomLLM)
    assert llm.metadata.is_function_calling_model is True
    no_template = SafeLLM(ensemble=Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 3)]))
    assert no_template.metadata.is_function_calling_model is False  # tools need chat templates
    custom = SafeLLM(ensemble=ens, messages_to_prompt=lambda messages: "x")
    assert custom.metadata.is_function_calling_model is False
    with pytest.raises(ConfigError, match="drop messages_to_prompt"):
        custom.chat_with_tools(TOOLS, user_msg="2*3?")


def test_chat_with_tools_end_to_end_on_tiny_models(llm, ens):
    """The real path: schemas reach both templates, the reply is parsed, nothing raises."""
    plain = ens.generate(messages=[{"role": "user", "content": "What is 2*3?"}], max_new_tokens=N)
    response = llm.chat_with_tools(TOOLS, user_msg="What is 2*3?", tool_required=True)
    assert response.raw["stats"]["prompt_tokens"][ens.names[0]] > plain.stats.prompt_tokens[ens.names[0]] + 50
    assert isinstance(llm.get_tool_calls_from_response(response, error_on_no_tool_call=False), list)
    chunks = list(llm.stream_chat_with_tools(TOOLS, user_msg="What is 2*3?"))
    assert chunks and chunks[-1].raw["usage"]["completion_tokens"] > 0
    assert all(TOOL_CALL_OPEN not in c.delta for c in chunks)


def test_tool_calls_are_tool_call_blocks(llm, ens, monkeypatch):
    calls = script(monkeypatch, ens, ["Let me compute. ", CALL])
    response = llm.chat_with_tools(TOOLS, user_msg="What is 2*3?")
    assert response.message.content == "Let me compute. "
    (selection,) = llm.get_tool_calls_from_response(response)
    assert (selection.tool_name, selection.tool_kwargs) == ("multiply", {"a": 2, "b": 3})
    assert selection.tool_id.startswith("call_")
    (block,) = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert block.tool_call_id == selection.tool_id
    request = calls[-1]
    assert [t["function"]["name"] for t in request.tools] == ["multiply", "add"]
    props = request.tools[0]["function"]["parameters"]["properties"]
    assert props == {"a": {"type": "integer"}, "b": {"type": "integer"}}  # no pydantic titles for a model to copy
    assert request.messages == ({"role": "user", "content": "What is 2*3?"},)
    assert request.config.max_new_tokens == N


def test_parallel_calls_and_tool_required(llm, ens, monkeypatch):
    two = CALL + '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    calls = script(monkeypatch, ens, [two])
    both = llm.chat_with_tools(TOOLS, user_msg="?", allow_parallel_tool_calls=True)
    assert [c.tool_name for c in llm.get_tool_calls_from_response(both)] == ["multiply", "add"]
    first = llm.chat_with_tools(TOOLS, user_msg="?")  # allow_parallel_tool_calls=False by default
    assert [c.tool_name for c in llm.get_tool_calls_from_response(first)] == ["multiply"]
    assert calls[-1].messages == ({"role": "user", "content": "?"},)
    assert calls[-1].tool_choice == "auto" and calls[-1].parallel_tool_calls is False
    # the engine enforces the choice (a grammar) and instructs the members; the adapter passes it on
    llm.chat_with_tools(TOOLS, user_msg="?", tool_required=True)
    assert calls[-1].tool_choice == "required"
    llm.chat_with_tools(TOOLS, user_msg="?", tool_choice="add", allow_parallel_tool_calls=True)
    assert calls[-1].tool_choice == "add" and calls[-1].parallel_tool_calls is True


def test_no_call_and_invalid_calls(llm, ens, monkeypatch):
    script(monkeypatch, ens, ["Just text."])
    response = llm.chat_with_tools(TOOLS, user_msg="?")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ToolCallError, match=r"without a tool call: 'Just text\.'.*error_on_no_tool_call=False"):
        llm.get_tool_calls_from_response(response)
    script(monkeypatch, ens, ['<tool_call>{"name": "multiply", "arguments": {a: 2}}</tool_call>'])
    response = llm.chat_with_tools(TOOLS, user_msg="?")
    (bad,) = response.raw["invalid_tool_calls"]
    assert bad["name"] == "multiply" and "invalid JSON" in bad["error"]
    with pytest.raises(ValueError, match="could not be read"):  # ToolCallError is a ValueError, as LlamaIndex expects
        llm.get_tool_calls_from_response(response)


def test_streaming_never_shows_a_call(llm, ens, monkeypatch):
    script(
        monkeypatch,
        ens,
        ["Sure", ". <tool", '_call>{"name": "multiply", ', '"arguments": {"a": 2, "b": 3}}</tool_call>'],
    )
    chunks = list(llm.stream_chat_with_tools(TOOLS, user_msg="2*3?"))
    assert "".join(c.delta for c in chunks) == "Sure. " == chunks[-1].message.content
    assert all(llm.get_tool_calls_from_response(c, error_on_no_tool_call=False) == [] for c in chunks[:-1])
    (call,) = llm.get_tool_calls_from_response(chunks[-1])
    assert call.tool_kwargs == {"a": 2, "b": 3} and chunks[-1].raw["usage"]

    async def astream():
        return [c async for c in await llm.astream_chat_with_tools(TOOLS, user_msg="2*3?")]

    achunks = asyncio.run(astream())
    assert [c.delta for c in achunks] == [c.delta for c in chunks]
    assert llm.get_tool_calls_from_response(achunks[-1])[0].tool_kwargs == {"a": 2, "b": 3}
    response = asyncio.run(llm.achat_with_tools(TOOLS, user_msg="2*3?"))
    assert llm.get_tool_calls_from_response(response)[0].tool_name == "multiply"


def test_tool_history_reaches_the_templates(llm, ens):
    """A call and its result (ids of any shape) render through Qwen's and Mistral's (strict) templates."""
    call = ToolCallBlock(
        tool_call_id="call_0123456789abcdef01234567", tool_name="multiply", tool_kwargs={"a": 2, "b": 3}
    )
    history = [
        ChatMessage(role=MessageRole.USER, content="What is 2*3?"),
        ChatMessage(role=MessageRole.ASSISTANT, blocks=[TextBlock(text=""), call]),
        ChatMessage(role=MessageRole.TOOL, content="6", additional_kwargs={"tool_call_id": call.tool_call_id}),
    ]
    response = llm.chat_with_tools(TOOLS, chat_history=history)
    without = llm.chat(history[:1])
    assert response.raw["stats"]["prompt_tokens"][ens.names[1]] > without.raw["stats"]["prompt_tokens"][ens.names[1]]


def test_predict_and_call_and_structured_predict(llm, ens, monkeypatch):
    script(monkeypatch, ens, [CALL])
    assert llm.predict_and_call(TOOLS, user_msg="What is 2*3?").response == "6"
    calls = script(monkeypatch, ens, ['{"value": 6}'])
    prompt = PromptTemplate("What is {a} times {b}?")
    assert llm.structured_predict(Product, prompt, a=2, b=3) == Product(value=6)
    assert calls[-1].json_schema == strict(Product.model_json_schema()) and calls[-1].tools is None
    assert calls[-1].json_schema["additionalProperties"] is False  # strict: no keys the class does not name
    assert asyncio.run(llm.astructured_predict(Product, prompt, a=2, b=3)) == Product(value=6)
    script(monkeypatch, ens, ['<tool_call>{"name": "Product", "arguments": {"value": 6}}</tool_call>'])
    assert list(llm.stream_structured_predict(Product, prompt, a=2, b=3))[-1] == Product(value=6)


def test_function_agent_with_a_scripted_reply(llm, ens, monkeypatch):
    calls = script(monkeypatch, ens, [CALL], ["The answer is 6."])
    agent = FunctionAgent(tools=TOOLS, llm=llm)

    async def run():
        handler = agent.run(user_msg="What is 2*3?")
        events = [event async for event in handler.stream_events()]
        return await handler, events

    output, events = asyncio.run(run())
    assert str(output) == "The answer is 6."
    assert [c.tool_name for c in output.tool_calls] == ["multiply"] and output.tool_calls[0].tool_output.content == "6"
    second = list(calls[1].messages)
    call_id = second[1]["tool_calls"][0]["id"]
    assert second[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 2, "b": 3}}
    assert second[2] == {"role": "tool", "content": "6", "tool_call_id": call_id}
    assert not any(TOOL_CALL_OPEN in getattr(e, "delta", "") for e in events)


def test_timeout_is_enforced(ens):
    llm = SafeLLM(ensemble=ens, max_new_tokens=N, timeout=1e-9)
    assert llm.timeout_s == 1e-9
    with pytest.raises(GenerationTimeout, match="timeout_s"):
        llm.complete("The quick brown fox")
    with pytest.raises(GenerationTimeout):
        SafeLLM(ensemble=ens, max_new_tokens=N).chat([ChatMessage(role="user", content="Hi")], timeout=1e-9)
