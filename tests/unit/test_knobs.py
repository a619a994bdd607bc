"""The generation knobs are declared once (GenerationConfig's fields): every adapter and the CLI derive theirs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from langchain_safe import ChatSafe
from langchain_safe import SafeLLM as LangChainLLM
from llamaindex_safe import GENERATION_OPTIONS
from llamaindex_safe import SafeLLM as IndexLLM
from safe_engine import GenerationConfig, build_request
from safe_engine.cli import build_parser
from safe_engine.knobs import KNOBS, PRESET, cli_options
from safe_engine.presets import DOC as PRESET_DOC

REPO = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(GenerationConfig)]
DEFAULTS = GenerationConfig()


def test_every_field_is_a_knob_with_its_doc():
    assert [k.name for k in KNOBS] == FIELDS
    assert all(k.doc and k.default == getattr(DEFAULTS, k.name) for k in KNOBS)
    assert {"sharpen_threshold", "timeout_s", "gates", "trace"} <= set(FIELDS)


def test_every_adapter_has_every_knob_with_the_engines_default():
    for model in (ChatSafe, LangChainLLM, IndexLLM):
        assert set(FIELDS) <= set(model.model_fields), model
        assert model.model_fields["top_k"].description == "tokens per member in the UniTE union (k)"
    assert (*FIELDS, "preset") == GENERATION_OPTIONS
    for model in (ChatSafe, LangChainLLM, IndexLLM):  # the preset too: a field, None by default, its doc shared
        field = model.model_fields["preset"]
        assert (field.default, field.description) == (None, PRESET_DOC), model
    # LangChain's own conventions, and only those, differ from the engine's defaults
    changed = {n for n in FIELDS if ChatSafe.model_fields[n].default != getattr(DEFAULTS, n)}
    assert changed == {"temperature", "do_sample", "stop"}  # None = greedy / per temperature / no stops
    assert ChatSafe.model_fields["max_new_tokens"].alias == "max_tokens"
    assert ChatSafe.model_fields["timeout_s"].alias == IndexLLM.model_fields["timeout_s"].alias == "timeout"
    changed = {n for n in FIELDS if IndexLLM.model_fields[n].default != getattr(DEFAULTS, n)}
    assert changed == {"temperature", "do_sample", "stop"}  # the same conventions; stop: a list, not a tuple


def test_every_knob_is_a_cli_flag():
    parser = build_parser()
    args = parser.parse_args(["generate", "-m", "x", "hi"])
    # a flag not given is no option given (the defaults', or a preset's): a --temperature above 0 alone samples
    assert cli_options(args) == {} and build_request("hi", **cli_options(args)).config == DEFAULTS
    argv = ["generate", "-m", "x", "--sharpen-threshold", "0.2", "--timeout-s", "30", "--sharpening", "none"]
    argv += ["--gates", "boundary", "--stop", "a", "--stop", "b", "--trace", "-", "--seed", "3", "hi"]
    options = cli_options(parser.parse_args(argv))
    assert options["sharpen_threshold"] == 0.2 and options["timeout_s"] == 30.0 and options["sharpening"] is None
    assert options["gates"] == ("boundary",) and options["stop"] == ("a", "b") and options["trace"] is True
    assert set(options) == {"sharpen_threshold", "timeout_s", "sharpening", "gates", "stop", "trace", "seed"}
    build_request("hi", **options)
    assert cli_options(parser.parse_args(["generate", "-m", "x", "--gates", "none", "hi"]))["gates"] == ()


def test_the_preset_is_a_cli_flag_and_flags_given_go_over_it(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    assert "--preset NAME" in capsys.readouterr().out and PRESET.doc == PRESET_DOC  # the help: the knob's doc
    argv = ["generate", "-m", "x", "--preset", "paper-unite", "--adaptive-draft", "--draft-length", "5", "hi"]
    options = cli_options(parser.parse_args(argv))
    assert options == {"preset": "paper-unite", "adaptive_draft": True, "draft_length": 5}
    config = build_request("hi", **options).config
    assert config == GenerationConfig.from_preset("paper-unite", adaptive_draft=True)
    assert config.adaptive_draft is True and config.token_healing is False  # the flag given, the preset's


NEW_FIELD = """
import dataclasses
import safe_engine.config as config

Base = config.GenerationConfig
config.GenerationConfig = dataclasses.make_dataclass(
    "GenerationConfig",
    [
        ("new_knob", int, dataclasses.field(default=3, metadata={"doc": "a knob added later"})),
        ("new_switch", bool, dataclasses.field(default=True, metadata={"doc": "on unless asked"})),
    ],
    bases=(Base,),
    frozen=True,
)
import safe_engine
safe_engine.GenerationConfig = config.GenerationConfig

from langchain_safe import ChatSafe
from llamaindex_safe import GENERATION_OPTIONS, SafeLLM
from safe_engine.cli import build_parser
from safe_engine.cli.args import options as _options

for model in (ChatSafe, SafeLLM):
    field = model.model_fields["new_knob"]
    assert (field.default, field.description) == (3, "a knob added later"), model
assert "new_knob" in GENERATION_OPTIONS
args = build_parser().parse_args(["generate", "-m", "x", "--new-knob", "7", "hi"])
assert _options(args) == {"new_knob": 7}  # a flag not given is no option given
args = build_parser().parse_args(["generate", "-m", "x", "--no-new-switch", "hi"])
assert _options(args) == {"new_switch": False}
print("ok")
"""


def test_a_new_generation_config_field_appears_everywhere_without_another_line():
    proc = subprocess.run([sys.executable, "-c", NEW_FIELD], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
