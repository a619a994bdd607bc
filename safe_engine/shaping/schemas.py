"""JSON schemas as the grammar enforces them: read from what a caller passes, and made strict.

Why strict: JSON Schema lets an object carry keys its schema never names (`additionalProperties` defaults
to true). Under a grammar that lets a model open a key of its own with an unbounded string value and run to
the token limit (random-weight members do it every time, small real ones now and then), and nobody who
passed a pydantic class asked for extra keys. OpenAI's strict mode and xgrammar's default read an
unspecified `additionalProperties` as false; so does this engine for structured output and tool arguments.
A schema that says `additionalProperties` itself (true, false or a schema) keeps its word, and OpenAI's
`response_format` with `"strict": false` keeps JSON Schema's own meaning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

# Keywords whose value is a subschema of a value the reply holds: one, a list, or a name -> subschema map.
# Left out on purpose: `allOf`, `dependentSchemas`, `then` and `else`, whose branches describe the object
# beside them (closing a branch would refuse the keys the others and the parent add; pydantic's
# `allOf: [{"$ref": ...}]` wrappers are reached through `$defs`), and `not`, `if`, `contains`, where closing
# an object would change what matches.
_ONE = ("items", "additionalItems", "additionalProperties")
_MANY = ("anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def schema_dict(schema: Any) -> dict[str, Any]:
    """A JSON schema as a dict, from a dict, its JSON text, a boolean schema or a pydantic model class."""
    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if isinstance(schema, str | bytes):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ConfigError(f"json_schema is not valid JSON: {err}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise ConfigError(f"json_schema must be a JSON schema (a dict), got {type(schema).__name__}")
    return dict(schema)


def strict(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which every object that does not say `additionalProperties` gets false."""
    out: dict[str, Any] = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = strict(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [strict(s) if isinstance(s, Mapping) else s for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: strict(s) if isinstance(s, Mapping) else s for name, s in out[key].items()}
    if _is_object(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_object(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def tool_parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema, strict: a function takes the parameters it declares (a tool without
    parameters got its own schema, {"type": "object", "properties": {}}, as arguments under JSON Schema's
    default)."""
    function = tool.get("function", tool)
    return strict(schema_dict(function.get("parameters") or {"type": "object"}))


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """One tool call as the Hermes / Qwen2.5 format writes it: {"name": ..., "arguments": {...}}."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
