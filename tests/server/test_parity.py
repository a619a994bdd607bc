"""One request, every door: the same request through the engine, LangChain (`ChatSafe`, `SafeLLM`), LlamaIndex
(`SafeLLM`), the server (the openai SDK and `ChatOpenAI`) and the CLI gives the same text, tool calls and finish
reason as the engine itself, on tiny random models (greedy, or sampled with a seed: both are reproducible).

Every door spells the request its own way (OpenAI's names and `extra_body` for the SAFE knobs over HTTP,
keyword arguments in the frameworks, flags on the CLI); `build_request` gives them one meaning. Schemas are
bounded (`maxLength`, `maximum`) so that a random-weight model closes every value within the token budget.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from openai import InternalServerError, LengthFinishReasonError, OpenAI

from langchain_safe import ChatSafe
from langchain_safe import SafeLLM as LangChainLLM
from llamaindex_safe import SafeLLM as IndexLLM
from safe_engine import ConfigError, Ensemble, GenerationConfig, GenerationResult, GenerationTimeout
from safe_engine.cli import main
from safe_engine.presets import PRESETS

from .conftest import KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
SYSTEM, QUESTION = "You are terse.", "Name a prime number."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
PROMPT = "Once upon a time"
N = 12


def _tool(name: str, description: str) -> dict:
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    parameters = {
        "type": "object",
        "properties": {"a": number, "b": number},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [_tool("multiply", "Multiply two integers."), _tool("add", "Add two integers.")]
SCORE = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 6},
        "value": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["label", "value"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "score", "schema": SCORE, "strict": True}}
OPEN = {k: v for k, v in SCORE.items() if k != "additionalProperties"}
OPEN_SCHEMA = {"type": "json_schema", "json_schema": {"name": "score", "schema": OPEN, "strict": False}}

# name -> the request, as engine keyword arguments; every door sends the same request in its own terms.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature 0 is greedy": {"temperature": 0},
    "seeded sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    "max tokens": {"max_tokens": 5},
    "stop": {"stop": ["e"]},
    "method every_token": {"method": "every_token"},
    "method single": {"method": "single"},
    "aggregation gac": {"aggregation": "gac"},
    "draft_length and top_k": {"draft_length": 3, "top_k": 4},
    "geometric sharpening": {"sharpening": "geometric", "sharpen_threshold": 0.3},
    "no sharpening": {"sharpening": None},
    "boundary gate only": {"gates": ["boundary"]},
    "rounds, fixed drafts": {"schedule": "rounds", "adaptive_draft": False},
    # a repetition penalty below 1 makes the random members repeat words, so the guard and steering bite
    "loop guard, no token healing": {
        "loop_guard": 2,
        "loop_span": 4,
        "token_healing": False,
        "repetition_penalty": 0.3,
    },
    "loop steering": {"loop_steer": 2, "loop_span": 2, "token_healing": False, "repetition_penalty": 0.6},
    "tool_choice auto": {"tools": TOOLS},
    "tool_choice required": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 80},
    "tool_choice named": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 80,
    },
    "tool_choice none": {"tools": TOOLS, "tool_choice": "none"},
    "one call at most": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80},
    "json_schema": {"response_format": JSON_SCHEMA, "max_tokens": 60},
    # "strict": false keeps JSON Schema's meaning: a schema silent on additionalProperties admits other keys
    "json_schema, strict false": {"response_format": OPEN_SCHEMA, "max_tokens": 60},
    "json mode": {"response_format": {"type": "json_object"}},
    # negative penalties and a repetition penalty below 1 encourage repeats, which random models otherwise avoid
    "frequency and presence penalties": {"frequency_penalty": -2.0, "presence_penalty": -2.0},
    "repetition penalty": {"repetition_penalty": 0.3},  # vLLM's extra field over HTTP
    "logit_bias": {"logit_bias": {"15": 100}},  # the drafter's (Qwen's) "0"
    "logit_bias bars tokens": {"logit_bias": {"15": -100, "16": -100}},
    # the paper's configurations by name (safe_engine.presets); a field given goes over the preset's
    "preset paper-unite": {"preset": "paper-unite"},
    "preset paper-gac": {"preset": "paper-gac"},
    "preset, fields given": {"preset": "paper-gac", "draft_length": 3, "token_healing": True},
}
OPENAI_FIELDS = {"max_tokens", "temperature", "top_p", "seed", "stop", "tools", "tool_choice", "parallel_tool_calls"}
OPENAI_FIELDS |= {"response_format", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "repetition": "stop"}

Reply = tuple[str, list[tuple[str, dict]], str]  # content, tool calls (name, arguments), OpenAI finish reason


def _request(case: str) -> dict[str, Any]:
    return {"max_tokens": N, **CASES[case]}


def _openai(kwargs: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's own fields as they are; the SAFE knobs in extra_body."""
    extra = {k: v for k, v in kwargs.items() if k not in OPENAI_FIELDS}
    return {**{k: v for k, v in kwargs.items() if k in OPENAI_FIELDS}, **({"extra_body": extra} if extra else {})}


def _engine_reply(result: GenerationResult) -> Reply:
    calls = [(c["name"], c["arguments"]) for c in result.tool_calls or ()]
    return result.content or "", calls, "tool_calls" if calls else FINISH[result.finish_reason]


# -- the doors ----------------------------------------------------------------------------------------------------
def engine(served, kwargs) -> Reply:
    return _engine_reply(served.ens.generate(messages=CHAT, **kwargs))


def engine_stream(served, kwargs) -> Reply:
    stream = served.ens.stream(messages=CHAT, **kwargs)
    content = "".join(event.content for event in stream.events())
    reply = _engine_reply(stream.result)
    assert content == reply[0]  # the streamed content is the final content
    return reply


def engine_astream(served, kwargs) -> Reply:
    async def run():
        stream = served.ens.astream(messages=CHAT, **kwargs)
        content = "".join([event.content async for event in stream.events()])
        return content, stream.result

    content, result = asyncio.run(run())
    assert content == result.content
    return _engine_reply(result)


def _langchain_reply(message) -> Reply:
    calls = [(c["name"], c["args"]) for c in message.tool_calls]
    finish = "tool_calls" if calls else FINISH[message.response_metadata["finish_reason"]]
    return message.content, calls, finish


LC_CHAT = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]


def chatsafe(served, kwargs) -> Reply:
    return _langchain_reply(ChatSafe(ensemble=served.ens).invoke(LC_CHAT, **kwargs))


def chatsafe_stream(served, kwargs) -> Reply:
    chunks = list(ChatSafe(ensemble=served.ens).stream(LC_CHAT, **kwargs))
    return _langchain_reply(sum(chunks[1:], chunks[0]))


def llamaindex(served, kwargs) -> Reply:
    llm = IndexLLM(ensemble=served.ens)
    response = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in CHAT], **kwargs)
    calls = [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(response, False)]
    return response.message.content or "", calls, "tool_calls" if calls else FINISH[response.raw["finish_reason"]]


def llamaindex_stream(served, kwargs) -> Reply:
    llm = IndexLLM(ensemble=served.ens)
    responses = list(llm.stream_chat([ChatMessage(role=m["role"], content=m["content"]) for m in CHAT], **kwargs))
    last = responses[-1]
    assert "".join(r.delta or "" for r in responses) == (last.message.content or "")
    calls = [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(last, False)]
    return last.message.content or "", calls, "tool_calls" if calls else FINISH[last.raw["finish_reason"]]


def _client(served) -> OpenAI:
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=120)


def openai_sdk(served, kwargs) -> Reply:
    res = _client(served).chat.completions.create(model=MODEL, messages=CHAT, **_openai(kwargs))
    choice = res.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    assert res.usage.completion_tokens == res.model_extra["safe"]["tokens"]
    return choice.message.content or "", calls, choice.finish_reason


def openai_sdk_stream(served, kwargs) -> Reply:
    chunks = list(_client(served).chat.completions.create(model=MODEL, messages=CHAT, stream=True, **_openai(kwargs)))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [
        (tc.function.name, json.loads(tc.function.arguments))
        for c in chunks
        if c.choices
        for tc in c.choices[0].delta.tool_calls or ()
    ]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, calls, finish[-1]


def chat_openai(served, kwargs) -> Reply:
    llm = ChatOpenAI(model=MODEL, base_url=served.v1, api_key=KEY, max_retries=0, timeout=120)
    try:
        message = llm.invoke(LC_CHAT, **_openai(kwargs))
    except LengthFinishReasonError as err:  # ChatOpenAI parses a response_format reply; cut JSON it refuses
        message = err.completion.choices[0].message
        return message.content or "", [], "length"
    calls = [(c["name"], c["args"]) for c in message.tool_calls]
    return message.content, calls, message.response_metadata["finish_reason"]


DOORS = [
    engine_stream,
    engine_astream,
    chatsafe,
    chatsafe_stream,
    llamaindex,
    llamaindex_stream,
    openai_sdk,
    openai_sdk_stream,
    chat_openai,
]


@pytest.fixture(scope="module")
def expected(served) -> dict[str, Reply]:
    return {case: engine(served, _request(case)) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_every_door_gives_the_engines_reply(served, expected, case):
    want = expected[case]
    for door in DOORS:
        assert door(served, _request(case)) == want, f"{door.__name__}: {case}"
    served.wait_idle()


def check_the_cases_bite(expected: dict[str, Reply]) -> None:
    """What every ensemble's replies show, whatever its members: the tool cases call tools, json cases give JSON,
    limits, sampling, stop, the repetition penalty and logit_bias change the reply (id 15 is the drafter's, Qwen's,
    "0")."""
    assert {name for name, _ in expected["tool_choice required"][1]} <= {"multiply", "add"}
    assert expected["tool_choice required"][1] and expected["tool_choice required"][2] == "tool_calls"
    assert [name for name, _ in expected["tool_choice named"][1]] == ["add"]
    assert len(expected["one call at most"][1]) == 1
    assert expected["tool_choice none"][1] == [] and expected["tool_choice none"][2] != "tool_calls"
    score = json.loads(expected["json_schema"][0])
    assert set(score) == {"label", "value"} and 0 <= score["value"] <= 99
    assert expected["json mode"][0].lstrip().startswith("{")
    assert expected["max tokens"][2] == "length" and expected["greedy"] == expected["temperature 0 is greedy"]
    assert expected["seeded sampling"] != expected["greedy"]
    assert "e" not in expected["stop"][0]
    for case in ("repetition penalty", "logit_bias"):
        assert expected[case] != expected["greedy"], case
    assert expected["logit_bias"][0].startswith("0")


def test_the_matrix_checks_what_it_claims(served, expected):
    """The cases are not vacuous (`check_the_cases_bite`), and on these tiny random members the penalties and the
    loop knobs bite too."""
    check_the_cases_bite(expected)
    assert expected["frequency and presence penalties"] != expected["greedy"]
    guard, steering = CASES["loop guard, no token healing"], CASES["loop steering"]
    unguarded = engine(served, _request("greedy") | guard | {"loop_guard": None})
    assert expected["loop guard, no token healing"][2] == "stop" and unguarded[2] == "length"
    assert unguarded[0].startswith(expected["loop guard, no token healing"][0])
    assert expected["loop steering"] != engine(served, _request("greedy") | steering | {"loop_steer": None})
    # a preset decodes as its values spelled out, unlike the defaults (here: token healing off); a field given
    # goes over the preset's
    for name, values in PRESETS.items():
        assert expected[f"preset {name}"] == engine(served, _request("greedy") | values), name
    assert expected["preset paper-unite"] != expected["greedy"]
    assert expected["preset paper-gac"] != expected["aggregation gac"]
    given = {k: v for k, v in CASES["preset, fields given"].items() if k != "preset"}
    assert expected["preset, fields given"] == engine(served, _request("greedy") | PRESETS["paper-gac"] | given)
    assert expected["preset, fields given"] != expected["preset paper-gac"]
    # "strict": false lets the random members open keys the schema does not name, which strict mode bars
    assert expected["json_schema, strict false"] != expected["json_schema"]
    strict_reply = engine(served, _request("greedy") | {"response_format": JSON_SCHEMA | {"json_schema": {
        **JSON_SCHEMA["json_schema"], "schema": OPEN}}, "max_tokens": 60})  # fmt: skip
    assert strict_reply == expected["json_schema"]  # the open schema, strict, is closed like SCORE


# -- logprobs: every door reports the engine's, in its framework's shape ------------------------------------------
LOGPROBS = {"logprobs": True, "top_logprobs": 3}
Entries = list[tuple[str, float, list[str]]]  # token, logprob, the alternatives' tokens


def _close(got: Entries, want: Entries) -> bool:
    """Same tokens and alternatives, logprobs within 1e-4 (two forwards of one text differ in the last bits)."""
    return len(got) == len(want) and all(
        g[0] == w[0] and g[2] == w[2] and abs(g[1] - w[1]) < 1e-4 for g, w in zip(got, want)
    )


def _from_chat(content: list[dict]) -> Entries:
    return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in content]


def _logprob_doors(served, kwargs: dict[str, Any]) -> dict[str, Entries]:
    out: dict[str, Entries] = {}
    stream = served.ens.stream(messages=CHAT, **kwargs)
    out["engine stream"] = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for ev in stream.events()
                            for e in ev.logprobs or []]  # fmt: skip
    out["ChatSafe"] = _from_chat(
        ChatSafe(ensemble=served.ens).invoke(LC_CHAT, **kwargs).response_metadata["logprobs"]["content"]
    )
    chunks = list(ChatSafe(ensemble=served.ens).stream(LC_CHAT, **kwargs))
    out["ChatSafe stream"] = _from_chat(sum(chunks[1:], chunks[0]).response_metadata["logprobs"]["content"])
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
    index = IndexLLM(ensemble=served.ens).chat(messages, **kwargs)
    out["LlamaIndex"] = [("", 0.0, [a.token for a in alts]) for alts in index.logprobs]  # the alternatives only
    res = _client(served).chat.completions.create(model=MODEL, messages=CHAT, **_openai(kwargs))
    out["openai SDK"] = _from_chat([e.model_dump() for e in res.choices[0].logprobs.content])
    assert all(e.model_extra["source"] in ("drafter", "ensemble") for e in res.choices[0].logprobs.content)
    chunks = _client(served).chat.completions.create(model=MODEL, messages=CHAT, stream=True, **_openai(kwargs))
    streamed = [
        e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    out["openai SDK stream"] = _from_chat(streamed)
    llm = ChatOpenAI(model=MODEL, base_url=served.v1, api_key=KEY, max_retries=0, timeout=120)
    out["ChatOpenAI"] = _from_chat(llm.invoke(LC_CHAT, **_openai(kwargs)).response_metadata["logprobs"]["content"])
    return out


@pytest.mark.parametrize("case", ["greedy", "seeded sampling", "method every_token", "repetition penalty"])
def test_every_door_gives_the_engines_logprobs(served, case):
    kwargs = {**_request(case), **LOGPROBS}
    result = served.ens.generate(messages=CHAT, **kwargs)
    want = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in result.logprobs or []]
    assert want and b"".join(bytes(e.bytes) for e in result.logprobs or []).decode(errors="replace") == result.text
    if case == "method every_token":
        assert {e.source for e in result.logprobs or []} == {"ensemble"}
    for door, got in _logprob_doors(served, kwargs).items():
        if door == "LlamaIndex":  # LlamaIndex's LogProb lists hold each token's alternatives
            got = [(w[0], w[1], g[2]) for g, w in zip(got, want)] if len(got) == len(want) else got
        assert _close(got, want), f"{door}: {case}"
    served.wait_idle()


def test_the_cli_reports_the_engines_logprobs(served, model_dirs):
    kwargs = {**_request("greedy"), "logprobs": 3}
    result = served.ens.generate(messages=CHAT, **kwargs)
    argv = [sys.executable, "-m", "safe_engine", "generate", "--chat", "--json", "--system", SYSTEM]
    for path in model_dirs:
        argv += ["-m", path]
    argv += ["--max-new-tokens", str(N), "--logprobs", "3", QUESTION]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = _from_chat(json.loads(proc.stdout)["logprobs"]["content"])
    assert _close(got, [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in result.logprobs or []])


def test_every_completion_door_gives_the_engines_logprobs(served):
    result = served.ens.generate(PROMPT, max_new_tokens=N, logprobs=2, frequency_penalty=0.5)
    want = [(e.token, e.logprob) for e in result.logprobs or []]
    client = _client(served)
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, logprobs=2, frequency_penalty=0.5)
    legacy = res.choices[0].logprobs
    got = list(zip(legacy.tokens, legacy.token_logprobs))
    assert len(got) == len(want) and all(g[0] == w[0] and abs(g[1] - w[1]) < 1e-4 for g, w in zip(got, want))
    assert all(len(top) <= 3 and legacy.tokens[i] in top for i, top in enumerate(legacy.top_logprobs))
    assert legacy.text_offset[0] == 0 and legacy.text_offset == sorted(legacy.text_offset)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, logprobs=2, frequency_penalty=0.5,
                                       stream=True)  # fmt: skip
    tokens, offsets = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == legacy.tokens and offsets == legacy.text_offset
    langchain = LangChainLLM(ensemble=served.ens, logprobs=2, frequency_penalty=0.5, max_tokens=N)
    info = langchain.generate([PROMPT]).generations[0][0].generation_info
    assert info["logprobs"]["tokens"] == legacy.tokens and info["logprobs"]["text_offset"] == legacy.text_offset


# -- completions: SafeLLM, LlamaIndex complete, /v1/completions, the CLI --------------------------------------------
COMPLETION_CASES = ["greedy", "seeded sampling", "stop", "method every_token", "geometric sharpening"]
COMPLETION_CASES += ["preset paper-unite", "preset paper-gac"]


def _completion_doors(served, kwargs) -> dict[str, tuple[str, str]]:
    res = _client(served).completions.create(model=MODEL, prompt=PROMPT, **_openai(kwargs))
    index = IndexLLM(ensemble=served.ens).complete(PROMPT, **kwargs)
    langchain = LangChainLLM(ensemble=served.ens).generate([PROMPT], **kwargs).generations[0][0]
    return {
        "/v1/completions": (res.choices[0].text, res.choices[0].finish_reason),
        "LangChain SafeLLM": (langchain.text, FINISH[langchain.generation_info["finish_reason"]]),
        "LlamaIndex complete": (index.text, FINISH[index.raw["finish_reason"]]),
    }


@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_every_completion_door_gives_the_engines_text(served, case):
    kwargs = _request(case)
    result = served.ens.generate(PROMPT, **kwargs)
    want = (result.text, FINISH[result.finish_reason])
    for door, got in _completion_doors(served, kwargs).items():
        assert got == want, f"{door}: {case}"


# -- the CLI ------------------------------------------------------------------------------------------------------
def _flags(kwargs: dict[str, Any], tmp_path: Path) -> list[str]:
    flags = []
    for key, value in kwargs.items():
        if key == "max_tokens":
            flags += ["--max-new-tokens", str(value)]
        elif key == "tools":
            path = tmp_path / "tools.json"
            path.write_text(json.dumps(value))
            flags += ["--tools", str(path)]
        elif key == "tool_choice":
            flags += ["--tool-choice", value if isinstance(value, str) else value["function"]["name"]]
        elif key == "parallel_tool_calls":
            flags += ["--no-parallel-tool-calls"]
        elif key == "response_format":
            is_schema = value["type"] == "json_schema"
            flags += ["--json-schema", json.dumps(value["json_schema"]["schema"])] if is_schema else ["--json-object"]
        elif key == "stop":
            for s in value:
                flags += ["--stop", s]
        elif isinstance(value, bool):  # a switch: --token-healing / --no-token-healing
            flags += [f"--{'' if value else 'no-'}{key.replace('_', '-')}"]
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


CLI_CASES = [
    "greedy",
    "seeded sampling",
    "stop",
    "method every_token",
    "tool_choice named",
    "json_schema",
    "loop steering",
    "preset paper-unite",
    "preset paper-gac",
]


@pytest.mark.parametrize("case", CLI_CASES)
def test_the_cli_gives_the_engines_reply(served, model_dirs, expected, tmp_path, case):
    argv = [sys.executable, "-m", "safe_engine", "generate", "--chat", "--json", "--system", SYSTEM]
    for path in model_dirs:
        argv += ["-m", path]
    argv += [*_flags(_request(case), tmp_path), QUESTION]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    calls = [(c["name"], c["arguments"]) for c in out.get("tool_calls") or ()]
    assert (out["content"], calls, "tool_calls" if calls else FINISH[out["finish_reason"]]) == expected[case]


# -- refusals and limits, the same at every door ------------------------------------------------------------------
def test_an_unknown_option_is_named_at_every_door(served):
    with pytest.raises(ConfigError, match="tempreature"):
        served.ens.generate(messages=CHAT, tempreature=0.5)
    with pytest.raises(ConfigError, match="tempreature"):
        ChatSafe(ensemble=served.ens).invoke(LC_CHAT, tempreature=0.5)
    with pytest.raises(ConfigError, match="tempreature"):
        IndexLLM(ensemble=served.ens).chat([ChatMessage(role="user", content=QUESTION)], tempreature=0.5)
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        _client(served).chat.completions.create(model=MODEL, messages=CHAT, extra_body={"tempreature": 0.5})
    assert err.value.body["param"] == "tempreature"
    proc = subprocess.run(
        [sys.executable, "-m", "safe_engine", "generate", "-m", "x", "--tempreature", "0.5", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and "--tempreature" in proc.stderr


def test_a_timeout_ends_the_generation_at_every_door(served):
    with pytest.raises(GenerationTimeout):
        served.ens.generate(messages=CHAT, timeout_s=1e-9)
    with pytest.raises(GenerationTimeout):
        ChatSafe(ensemble=served.ens, timeout=1e-9).invoke(LC_CHAT)
    with pytest.raises(GenerationTimeout):
        IndexLLM(ensemble=served.ens, timeout=1e-9).chat([ChatMessage(role="user", content=QUESTION)])
    with pytest.raises(InternalServerError) as err:  # 504, OpenAI's shape, naming the knob
        _client(served).chat.completions.create(model=MODEL, messages=CHAT, extra_body={"timeout_s": 1e-9})
    assert err.value.status_code == 504 and err.value.body["param"] == "timeout_s"
    served.wait_idle()


# -- presets: every door decodes with the preset's configuration, the fields given over it --------------------------
def _spy(monkeypatch: pytest.MonkeyPatch, ens: Ensemble) -> list[GenerationConfig]:
    """The GenerationConfig of every request `ens` starts from now on: every door's requests, the server's
    (in this process) included, start at `Ensemble._start`."""
    used: list[GenerationConfig] = []
    start = ens._start

    def spy(request):
        used.append(request.config)
        return start(request)

    monkeypatch.setattr(ens, "_start", spy)
    return used


def _configs_at_every_door(served, monkeypatch, capsys, tmp_path, preset: str, given: dict[str, Any]) -> dict:
    """door -> the configurations its requests ran with, for `preset` and the fields `given`, each door spelling
    them its own way (a framework: fields, call options, or fields with the preset per call)."""
    used = _spy(monkeypatch, served.ens)
    monkeypatch.setattr("safe_engine.cli.load", lambda args: served.ens)  # the CLI's own parsing, this ensemble
    kwargs = {"max_tokens": N, "preset": preset, **given}
    fields = {"max_new_tokens": N, "preset": preset, **given}  # LlamaIndex's field has no max_tokens alias
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
    client = _client(served)
    cli = ["generate", "-m", "unused", "--json", "--max-new-tokens", str(N), "--preset", preset]
    cli += [*_flags(given, tmp_path), PROMPT]
    doors = {
        "engine generate": lambda: served.ens.generate(messages=CHAT, **kwargs),
        "engine generate_batch": lambda: served.ens.generate_batch([PROMPT, CHAT], **kwargs),
        "engine stream": lambda: "".join(served.ens.stream(PROMPT, **kwargs)),
        "engine astream": lambda: asyncio.run(served.ens.agenerate(PROMPT, **kwargs)),
        "GenerationConfig.from_preset": lambda: served.ens.generate(
            PROMPT, config=GenerationConfig.from_preset(preset, max_new_tokens=N, **given)
        ),
        "ChatSafe per call": lambda: ChatSafe(ensemble=served.ens).invoke(LC_CHAT, **kwargs),
        "ChatSafe fields": lambda: ChatSafe(ensemble=served.ens, **fields).invoke(LC_CHAT),
        "ChatSafe fields, preset per call": lambda: ChatSafe(ensemble=served.ens, max_new_tokens=N, **given).invoke(
            LC_CHAT, preset=preset
        ),
        "LangChain SafeLLM per call": lambda: LangChainLLM(ensemble=served.ens).invoke(PROMPT, **kwargs),
        "LangChain SafeLLM fields": lambda: LangChainLLM(ensemble=served.ens, **fields).invoke(PROMPT),
        "LlamaIndex chat per call": lambda: IndexLLM(ensemble=served.ens).chat(messages, **kwargs),
        "LlamaIndex complete fields": lambda: IndexLLM(ensemble=served.ens, **fields).complete(PROMPT),
        "LlamaIndex fields, preset per call": lambda: IndexLLM(ensemble=served.ens, max_new_tokens=N, **given).chat(
            messages, preset=preset
        ),
        "/v1/chat/completions": lambda: client.chat.completions.create(model=MODEL, messages=CHAT, **_openai(kwargs)),
        "/v1/completions": lambda: client.completions.create(model=MODEL, prompt=PROMPT, **_openai(kwargs)),
        "/v1/responses": lambda: client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=N, extra_body={"preset": preset, **given}
        ),
        "CLI": lambda: main(cli),
    }
    configs = {}
    for door, call in doors.items():
        before = len(used)
        call()
        configs[door] = used[before:]
    capsys.readouterr()  # the CLI's JSON
    served.wait_idle()
    return configs


PRESET_CASES = {name: (name, {}) for name in PRESETS} | {
    "paper-gac, fields given": ("paper-gac", {"draft_length": 3, "token_healing": True}),
}


@pytest.mark.parametrize("case", list(PRESET_CASES))
def test_every_door_decodes_with_the_presets_configuration(served, monkeypatch, capsys, tmp_path, case):
    """One test per preset (and one with fields given over it): every door, each way it takes options, runs
    its requests with one configuration, the preset's values with the fields given over them."""
    preset, given = PRESET_CASES[case]
    want = GenerationConfig.from_preset(preset, max_new_tokens=N, **given)
    assert {k: getattr(want, k) for k in PRESETS[preset]} == PRESETS[preset] | given  # what the doors must reach
    assert want != GenerationConfig(max_new_tokens=N, **given)  # not the defaults: the check has teeth
    configs = _configs_at_every_door(served, monkeypatch, capsys, tmp_path, preset, given)
    assert all(configs.values()), [door for door, used in configs.items() if not used]
    wrong = {door: used for door, used in configs.items() if any(c != want for c in used)}
    assert not wrong, f"{case}: these doors decoded with another configuration: {wrong}"


def test_an_unknown_preset_is_refused_by_name_at_every_door(served, capsys):
    """A ConfigError naming the known presets (the server: a 400 with `param: "preset"`, the CLI: exit 2)."""
    message = r"unknown preset 'paper'; known presets: \['paper-unite', 'paper-gac'\]"
    refusals = {
        "engine": lambda: served.ens.generate(messages=CHAT, preset="paper"),
        "GenerationConfig.from_preset": lambda: GenerationConfig.from_preset("paper"),
        "ChatSafe field": lambda: ChatSafe(ensemble=served.ens, preset="paper"),
        "ChatSafe per call": lambda: ChatSafe(ensemble=served.ens).invoke(LC_CHAT, preset="paper"),
        "LangChain SafeLLM field": lambda: LangChainLLM(ensemble=served.ens, preset="paper"),
        "LangChain SafeLLM per call": lambda: LangChainLLM(ensemble=served.ens).invoke(PROMPT, preset="paper"),
        "LlamaIndex field": lambda: IndexLLM(ensemble=served.ens, preset="paper"),
        "LlamaIndex per call": lambda: IndexLLM(ensemble=served.ens).complete(PROMPT, preset="paper"),
    }
    for door, call in refusals.items():
        with pytest.raises(ConfigError, match=message):
            call()
            pytest.fail(f"{door} took an unknown preset")
    from openai import BadRequestError

    for create in (
        lambda extra: _client(served).chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra),
        lambda extra: _client(served).completions.create(model=MODEL, prompt=PROMPT, extra_body=extra),
        lambda extra: _client(served).responses.create(model=MODEL, input=QUESTION, extra_body=extra),
    ):
        with pytest.raises(BadRequestError, match=message) as err:
            create({"preset": "paper"})
        assert err.value.status_code == 400 and err.value.body["param"] == "preset"
    assert main(["generate", "-m", "unused", "--preset", "paper", PROMPT]) == 2  # refused before loading
    assert re.search("safe-engine: error: .*" + message, capsys.readouterr().err)
    served.wait_idle()
