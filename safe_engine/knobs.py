"""The generation knobs, declared once: `GenerationConfig`'s fields, for the adapters' fields and the CLI.

Why: each knob used to be spelled out five times with its default typed again (LangChain fields and
per-call options, LlamaIndex fields, CLI flags and their mapping) and they drifted apart. Here each one
is read from the dataclass: name, type, default and the one-line "doc" in its field metadata. A new
`GenerationConfig` field appears in every adapter and on the CLI without another line.

An adapter adapts a knob where its framework has a convention (`adapted`): LangChain calls
`max_new_tokens` `max_tokens` and `timeout_s` `timeout`, and means greedy by `temperature=None`.

Beside the knobs, every interface shows `preset` (`PRESET`, `OPTIONS`): not a field, but a name for a bundle of
field values (`safe_engine.presets`) that the options given explicitly go over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import config, presets


@dataclass(frozen=True)
class Knob:
    """One generation option as an interface shows it."""

    name: str
    type: Any  # the resolved annotation: int, str | None, tuple[str, ...], ...
    default: Any
    doc: str
    alias: str | None = None  # another name the option is accepted by (a framework's convention)
    cli: Mapping[str, Any] = field(default_factory=dict)  # argparse hints: metavar, help, list="comma"

    @property
    def optional(self) -> bool:
        """Whether None is a value of this knob."""
        return type(None) in typing.get_args(self.type)

    @property
    def base(self) -> Any:
        """The type without None: int, float, str, bool or tuple."""
        kind = self.type
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
        return typing.get_origin(kind) or kind

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def knobs_of(config_class: type) -> tuple[Knob, ...]:
    """The knobs of a GenerationConfig-like dataclass, in field order."""
    hints = typing.get_type_hints(config_class)
    return tuple(
        Knob(
            name=f.name,
            type=hints[f.name],
            default=f.default,
            doc=f.metadata.get("doc", f.name.replace("_", " ")),
            cli=f.metadata.get("cli", {}),
        )
        for f in dataclasses.fields(config_class)
    )


KNOBS: tuple[Knob, ...] = knobs_of(config.GenerationConfig)
KNOB_NAMES: tuple[str, ...] = tuple(k.name for k in KNOBS)
#: `build_request`'s `preset`: the base values the knobs given explicitly go over (None: the defaults).
PRESET = Knob(name="preset", type=str | None, default=None, doc=presets.DOC, cli={"metavar": "NAME"})
#: What every interface shows: the knobs, then the preset.
OPTIONS: tuple[Knob, ...] = (*KNOBS, PRESET)
OPTION_NAMES: tuple[str, ...] = tuple(k.name for k in OPTIONS)


def adapted(changes: Mapping[str, Mapping[str, Any]]) -> tuple[Knob, ...]:
    """The options (the knobs and the preset) with an adapter's changes to some knobs (type, default, doc or
    alias)."""
    unknown = sorted(set(changes) - set(KNOB_NAMES))
    if unknown:
        raise KeyError(f"no GenerationConfig field(s) {unknown}")
    return tuple(dataclasses.replace(k, **changes.get(k.name, {})) for k in OPTIONS)


#: The frameworks' convention for sampling (LangChain's and LlamaIndex's adapters): temperature and do_sample
#: default to "not given", so that greedy decoding is the default and a temperature above 0 alone samples.
UNSET_SAMPLING: dict[str, dict[str, Any]] = {
    "temperature": {
        "type": float | None,
        "default": None,
        "doc": "sampling temperature; None or 0 means greedy decoding (the SAFE default)",
    },
    "do_sample": {
        "type": bool | None,
        "default": None,
        "doc": "sample instead of greedy decoding; None: sample exactly when temperature > 0",
    },
}


def aliases(knobs: tuple[Knob, ...]) -> dict[str, str]:
    """alias -> knob name."""
    return {k.alias: k.name for k in knobs if k.alias}


# -- the CLI ---------------------------------------------------------------------------------------------
def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option (`--draft-length`, ..., `--preset`); see `cli_options` for the values they give.

    A flag not given leaves no attribute in the parsed arguments (argparse's SUPPRESS): an option not given,
    which `build_request` takes from the preset or the defaults, so that `--preset paper-unite
    --adaptive-draft` keeps the adaptive draft the flag asks for. A scalar flag's help names the knob's
    default, or none where its cli hints say default None (`--temperature`: not given is greedy, not 1.0).
    A bool knob is a switch, unless it has a metavar (`--trace FILE`: the knob is on when the flag is
    given; the command reads the value). A tuple knob is a repeatable flag (`--stop a --stop b`), or a
    comma list with cli list="comma" (`--gates boundary,consensus`; "none" = the empty list). A dict knob is
    a JSON object (`--logit-bias '{"50256": -100}'`). For a knob that may be None, the value "none" means
    None (`--sharpening none`).
    """
    for knob in OPTIONS:
        hints = dict(knob.cli)
        style = hints.pop("list", None)
        shown = hints.pop("default", knob.default)  # the default the help names (None: none)
        kwargs: dict[str, Any] = {"help": hints.pop("help", knob.doc), **hints, "default": argparse.SUPPRESS}
        if knob.base is bool:
            if "metavar" not in kwargs:  # --x, or --x / --no-x for a knob that is on by default
                kwargs["action"] = argparse.BooleanOptionalAction if knob.default else "store_true"
        elif knob.base is tuple:
            if style != "comma":
                kwargs["action"] = "append"
                kwargs["help"] += " (repeatable)"
        else:
            kwargs["type"] = _scalar(knob)
            if shown is not None:
                kwargs["help"] += f" (default: {shown})"
        parser.add_argument(knob.flag, **kwargs)


def cli_options(args: argparse.Namespace) -> dict[str, Any]:
    """`build_request` keywords from the flags `add_cli_arguments` added: the flags given, and only those."""
    options = {}
    for knob in OPTIONS:
        if not hasattr(args, knob.name):  # not given
            continue
        value = getattr(args, knob.name)
        if knob.base is bool and "metavar" in knob.cli:
            value = True  # --trace FILE: on; the command writes FILE
        elif knob.base is tuple:
            if knob.cli.get("list") == "comma":
                value = tuple(p for p in value.split(",") if p and p.lower() != "none")
            else:
                value = tuple(value)
        options[knob.name] = value
    return options


def _scalar(knob: Knob) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if knob.optional and text.lower() == "none":
            return None
        if knob.base is dict:  # a mapping knob (logit_bias) is given as a JSON object
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        return knob.base(text)

    parse.__name__ = knob.base.__name__  # argparse names it in "invalid int value: 'x'"
    return parse
