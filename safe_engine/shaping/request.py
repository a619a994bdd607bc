"""`Request`: one generation as every door asks for it, validated once by `build_request`.

Why one function: the engine API, both framework adapters, the server and the CLI each used to assemble
a request their own way, and they drifted (tool_choice dropped over HTTP, temperature 0 refused by one
adapter). Each door now maps its own names onto `build_request`'s keywords, and the table of shared
semantics lives here:

| option | meaning at every door |
|---|---|
| `temperature` | 0 = greedy; > 0 samples at that temperature unless `do_sample=False` is given too; None = not given |
| `max_new_tokens`, `max_tokens`, `max_completion_tokens` | one limit under three names (they must agree) |
| `timeout_s`, `timeout` | wall-clock limit of the generation in seconds (`GenerationTimeout`) |
| `stop` | a string or a list of strings; matched across tokens, never emitted |
| `top_p`, `seed` | nucleus threshold and sampling seed (used when sampling) |
| `logprobs` | an int k: each token's logprob and k alternatives; True (+ `top_logprobs=k`): OpenAI's chat form |
| penalties, `logit_bias` | per member, in its own tokens; `logit_bias` in the drafter's token ids |
| `preset` | a named bundle of field values (`safe_engine.presets`) over `config`; options given explicitly win |
| anything else | a `GenerationConfig` field by its own name, or a `ConfigError` naming the unknown option |
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

from ..config import MAX_TOP_LOGPROBS, GenerationConfig
from ..errors import ConfigError, InputError, InputTypeError, SafeEngineError
from ..presets import preset_values
from ..runtime.members import Member
from .chat import chat_prompt_ids, check_text, validate_messages
from .constrained import Grammar
from .schemas import schema_dict, strict
from .tools import normalize_tool_choice, tool_names, with_tool_choice

#: Other names of GenerationConfig fields, as the frameworks and OpenAI spell them.
ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "timeout": "timeout_s"}
#: `response_format` types (OpenAI's shape); "text" is unconstrained.
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_FIELDS = tuple(f.name for f in fields(GenerationConfig))


def request_for_call(settings: Mapping[str, Any], call: Mapping[str, Any], **inputs: Any) -> Request:
    """One framework call's `Request`: an adapter's standing fields (GenerationConfig names; None = the
    engine's default, for `max_new_tokens`, `top_logprobs`) overridden by the call's options, which may use
    an alias (a call's `max_tokens` replaces the field `max_new_tokens`). Both adapters build requests here,
    so a field and a call option mean the same in LangChain and LlamaIndex."""
    options = {k: v for k, v in settings.items() if not (k in ("max_new_tokens", "top_logprobs") and v is None)}
    for key, value in call.items():
        options.pop(ALIASES.get(key, key), None)
        options[key] = value
    return build_request(**inputs, **options)


def standing_options(model: Any, names: Sequence[str]) -> dict[str, Any]:
    """A framework model's standing options for `request_for_call`: those of its fields `names` (the knobs and
    `preset`) that its caller set (pydantic's `model_fields_set`). Why not the others: a field left at its
    default is no option given, so that a preset (the model's or a call's) supplies it, as at every door."""
    return {name: getattr(model, name) for name in names if name in model.model_fields_set}


def show_preset(model: Any, names: Sequence[str]) -> None:
    """Show a framework model's `preset` in its fields: each of `names` that its caller did not set takes the
    preset's value, still not set (so a call's own preset replaces it). Why: the fields then read, and
    serialise (LlamaIndex's `to_dict`), as the configuration the model decodes with."""
    if model.preset is None:
        return
    for name, value in preset_values(model.preset).items():
        if name in names and name not in model.model_fields_set:
            model.__dict__[name] = value  # not setattr: pydantic would count the field as set


def check_known_fields(owner: Any, data: Any, tolerated: frozenset[str] = frozenset()) -> None:
    """A misspelt adapter option is an error, not silently dropped (pydantic would drop it). `owner` is a
    pydantic model class: its fields and their aliases, and `tolerated`, are the known names."""
    if not isinstance(data, dict):
        return
    known = set(tolerated) | set(owner.model_fields) | {f.alias for f in owner.model_fields.values() if f.alias}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown} for {owner.__name__}; valid: {sorted(known)}")


@dataclass(frozen=True)
class Request:
    """What one generation needs, checked: the members' input, tools and the reply's shape, the settings.

    `messages` are what the members' templates render: the caller's, with the instruction to call a tool
    (tool_choice "required" / a name) or to answer in JSON added to the system message. `tools` are the
    tools shown to the members (None with tool_choice "none"); `grammar` constrains the reply (None: free).
    """

    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    tools: tuple[dict[str, Any], ...] | None
    tool_choice: str  # "auto" | "none" | "required" | a tool name
    parallel_tool_calls: bool
    response_format: str  # "text" | "json_object" | "json_schema"
    json_schema: dict[str, Any] | None  # the reply's schema with response_format "json_schema"
    grammar: Grammar | None
    config: GenerationConfig

    @property
    def reads_tool_calls(self) -> bool:
        """Whether the reply is read for tool calls (tools are shown and may be called)."""
        return self.tools is not None

    def encode(self, member: Member) -> list[int]:
        """The member's prompt: the conversation through its own chat template, or the raw prompt."""
        if self.messages is not None:
            ids = chat_prompt_ids(member, list(self.messages), list(self.tools) if self.tools else None)
        else:
            assert self.prompt is not None
            ids = member.prompt_ids(self.prompt)
        if not ids:
            raise InputError(f"the prompt encodes to no tokens for member {member.name!r}; pass a non-empty prompt")
        return ids


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    json_schema: Mapping[str, Any] | str | Any | None = None,
    response_format: Mapping[str, Any] | str | None = None,
    grammar: Grammar | None = None,
    config: GenerationConfig | None = None,
    preset: str | None = None,
    **options: Any,
) -> Request:
    """The one place a request is assembled and validated; every door calls it.

    `tool_choice`: "auto" (text or calls), "none" (tools hidden), "required" / "any" / True (calls only),
    a tool name or OpenAI's {"type": "function", "function": {"name": ...}} (exactly that call);
    `parallel_tool_calls=False`: one call at most. `json_schema` (a dict, JSON text or a pydantic class)
    or `response_format` (OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}} or
    {"type": "json_object"}) constrain the reply to JSON, strictly: an object that does not say
    `additionalProperties` takes only the keys it names (response_format's `"strict": false` keeps JSON
    Schema's meaning); `grammar` to any llguidance grammar
    (`Grammar.lark(...)`, for research; not with tools or JSON). `options` are GenerationConfig fields or their
    aliases (module docstring), overriding `preset` (a name from `safe_engine.presets`: the paper's
    configurations), whose values override `config` (default: `GenerationConfig()`).
    """
    if (prompt is None) == (messages is None):
        raise InputError("pass exactly one of a prompt string or messages=[...]")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InputTypeError(f"prompt must be a str, got {type(prompt).__name__}; for chat use messages=")
        if not prompt:
            raise InputError("prompt is empty; pass some text to continue")
        check_text(prompt, "the prompt")
    with _about("messages"):
        checked = validate_messages(messages) if messages is not None else None
    config = _config(config, preset, options)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ConfigError(
            f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}", option="parallel_tool_calls"
        )
    parallel = parallel_tool_calls is not False
    if tools is not None and not isinstance(tools, str | bytes | Mapping) and len(tools) == 0:
        tools = None
    if tools is not None:
        with _about("tools"):
            tool_names(tools)  # each must be a schema with a name
        with _about("tool_choice"):
            choice = normalize_tool_choice(tool_choice, tools)
    elif tool_choice not in (None, False, "auto", "none"):
        raise ConfigError(f"tool_choice={tool_choice!r} needs tools; pass tools=[...] too", option="tool_choice")
    else:
        choice = "auto" if tool_choice in (None, False) else tool_choice
    with _about("response_format" if response_format is not None else "json_schema"):
        kind, schema = _response_format(json_schema, response_format)
    if checked is not None and tools is not None:  # "none" hides the tools; "required" / a name asks for the call
        checked, shown = with_tool_choice(checked, tools, choice)
    elif tools is not None and choice != "none":
        raise ConfigError(
            "tools are shown through the members' chat templates; pass messages=[...], not a prompt", option="tools"
        )
    else:
        shown = None
    if grammar is not None:
        if not isinstance(grammar, Grammar):
            raise InputTypeError(f"grammar must be a safe_engine Grammar (Grammar.lark(...)), got {grammar!r:.80}")
        if shown or kind != "text":
            raise ConfigError("grammar= constrains the whole reply; pass it without tools or a JSON response format")
    elif kind == "json_object":
        if shown:
            raise ConfigError(_JSON_AND_TOOLS, option="response_format")
        grammar = Grammar.json_object()
    else:
        with _about("response_format" if response_format is not None else "tools"):
            grammar = Grammar.for_request(schema, shown, choice, parallel)
    if kind != "text" and checked is not None:
        checked = _ask_for_json(checked, schema)
    return Request(
        prompt=prompt,
        messages=tuple(checked) if checked is not None else None,
        tools=tuple(dict(t) for t in shown) if shown else None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=kind,
        json_schema=schema,
        grammar=grammar,
        config=config,
    )


_JSON_AND_TOOLS = (
    "a JSON response format constrains the whole reply, so it cannot be combined with tool calls; "
    "pass tool_choice='none' (or no tools) with it, or drop the response format"
)


@contextlib.contextmanager
def _about(option: str) -> Iterator[None]:
    """Name `option` as the one at fault in the errors raised here (unless they name one already)."""
    try:
        yield
    except SafeEngineError as err:
        if err.option is None:
            err.option = option
        raise


def _config(base: GenerationConfig | None, preset: str | None, options: dict[str, Any]) -> GenerationConfig:
    """`base` with `preset`'s values, then `options` applied under the shared semantics (aliases, temperature
    0 = greedy): an option given explicitly beats the preset."""
    if base is not None and not isinstance(base, GenerationConfig):
        raise InputTypeError(f"config must be a GenerationConfig, got {type(base).__name__}")
    base = (base or GenerationConfig()).with_preset(preset)
    options = _logprobs(options)
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # field -> the name the caller used (for messages)
    for name, value in options.items():
        field = ALIASES.get(name, name)
        if field not in _FIELDS:
            valid = sorted((*_FIELDS, *ALIASES))
            raise ConfigError(f"unknown option {name!r}; valid options: {valid}", option=name)
        if field in values and values[field] != value:
            raise ConfigError(
                f"{spelled[field]}={values[field]!r} and {name}={value!r} name the same option; pass one", option=name
            )
        values[field], spelled[field] = value, name
    for name in ("temperature", "do_sample"):  # None: not given (the frameworks' and the CLI's default)
        if name in values and values[name] is None:
            del values[name], spelled[name]
    if "temperature" in values:
        temperature = values["temperature"]
        if "do_sample" not in values and isinstance(temperature, int | float) and not isinstance(temperature, bool):
            values["do_sample"] = temperature > 0  # 0 = greedy; > 0 samples, as OpenAI clients mean it
    if values.get("stop", ()) is None:
        values["stop"] = ()
    if isinstance(values.get("gates"), list):
        values["gates"] = tuple(values["gates"])
    for field, value in values.items():  # one at a time first: the error names the option
        try:
            base.updated(**{field: value})
        except (ConfigError, InputTypeError) as err:
            if field in ("do_sample", "temperature") and field not in spelled:
                continue  # derived from temperature: judged together below
            raise type(err)(f"invalid {spelled.get(field, field)}: {err}", option=spelled.get(field, field)) from None
    try:
        return base.updated(**values)
    except (ConfigError, InputTypeError) as err:
        raise type(err)(str(err), option=next(iter(spelled.values()), None)) from None


def _logprobs(options: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's chat form (`logprobs=True`, `top_logprobs=k`) as the engine's `logprobs=k`; an int passes."""
    options = dict(options)
    top = options.pop("top_logprobs", None)
    flag = options.get("logprobs")
    if top is not None:
        if flag is not True:
            raise ConfigError(
                f"top_logprobs={top!r} needs logprobs=True (OpenAI's chat form); or pass logprobs=k alone",
                option="top_logprobs",
            )
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ConfigError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", option="top_logprobs"
            )
        options["logprobs"] = top
    elif flag is True:
        options["logprobs"] = 0
    elif flag is False:
        options["logprobs"] = None
    return options


def _response_format(json_schema: Any, response_format: Any) -> tuple[str, dict[str, Any] | None]:
    """("text" | "json_object" | "json_schema", the schema) from `json_schema=` or `response_format=`.

    The schema is strict (`safe_engine.shaping.schemas.strict`): an object that does not say
    `additionalProperties` takes no other keys, unless response_format says `"strict": false`."""
    if response_format is None or response_format == "text":
        kind, schema = "text", None
    elif response_format == "json_object":
        kind, schema = "json_object", None
    elif isinstance(response_format, Mapping):
        format_type = response_format.get("type")
        if format_type not in RESPONSE_FORMATS:
            raise ConfigError(f"response_format type {format_type!r} is not one of {list(RESPONSE_FORMATS)}")
        kind = cast(str, format_type)  # one of RESPONSE_FORMATS: checked just above
        schema = None
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise ConfigError(
                    'response_format json_schema needs {"type": "json_schema", "json_schema": {"name": ..., '
                    '"schema": {...}}}'
                )
            schema = schema_dict(spec["schema"])
            if spec.get("strict") not in (None, True, False):
                raise ConfigError(f"response_format json_schema strict must be true or false, got {spec['strict']!r}")
            if spec.get("strict") is not False:  # strict by default; false keeps JSON Schema's own meaning
                schema = strict(schema)
    else:
        raise ConfigError(
            f"response_format must be 'text', 'json_object' or OpenAI's dict form, got {response_format!r:.80}"
        )
    if json_schema is not None:
        if kind != "text":
            raise ConfigError("pass json_schema or response_format, not both")
        kind, schema = "json_schema", strict(schema_dict(json_schema))
    return kind, schema


def _ask_for_json(messages: list[dict[str, Any]], schema: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Tell the members what the grammar will hold them to: a model that knows the keys fills them in
    meaningfully, the grammar alone only makes the reply valid. An object's keys are listed with their types
    and descriptions (a 0.5B model given the raw JSON schema wrote one long looping value instead)."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if schema is None:
        instruction = "Reply with only a JSON object."
    elif isinstance(properties, dict) and properties:
        keys = "; ".join(_describe_key(k, v) for k, v in properties.items())
        instruction = f"Reply with only a JSON object with these keys: {keys}. Keep every value short."
    else:
        instruction = (
            f"Reply with only a JSON value that follows this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}"
        )
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{instruction}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def _describe_key(name: str, spec: Any) -> str:
    spec = spec if isinstance(spec, dict) else {}
    kind = spec.get("type") or ("one of " + json.dumps(spec["enum"]) if "enum" in spec else "value")
    text = f'"{name}" ({kind if isinstance(kind, str) else "/".join(map(str, kind))})'
    return f"{text}: {spec['description']}" if spec.get("description") else text
