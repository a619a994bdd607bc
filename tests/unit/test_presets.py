"""Named presets (`safe_engine.presets`): the paper's configurations, their layering under the options given
explicitly, the adapters' fields, and docs/api.md's table of their values. Every door's use of them, on a
real server: tests/server/test_parity.py."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from langchain_safe import ChatSafe
from llamaindex_safe import SafeLLM as IndexLLM
from safe_engine import ConfigError, Ensemble, GenerationConfig, build_request
from safe_engine.presets import PRESETS, preset_values
from tests.conftest import tiny_member

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}
UNKNOWN = r"unknown preset 'paper'; known presets: \['paper-unite', 'paper-gac'\]"


@pytest.fixture(scope="module")
def ens() -> Ensemble:
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 2)])


def test_the_paper_presets_are_the_papers_safe_with_each_aggregation():
    """The values ../shared/docs/safe-algorithm.md gives the paper's SAFE (n = 5, k = 10, heuristic λ = 0.1, both
    gates, a fixed draft, the pick handed as is, no loop handling); the two differ in the aggregation only."""
    paper = {
        "method": "safe",
        "gates": None,
        "draft_length": 5,
        "top_k": 10,
        "sharpening": "heuristic",
        "sharpen_threshold": 0.1,
        "adaptive_draft": False,
        "token_healing": False,
        "loop_guard": None,
        "loop_steer": None,
    }
    want = {"paper-unite": {**paper, "aggregation": "unite"}, "paper-gac": {**paper, "aggregation": "gac"}}
    assert want == PRESETS
    for name, values in PRESETS.items():
        assert set(values) <= FIELDS, name
        config = GenerationConfig.from_preset(name)
        assert {k: getattr(config, k) for k in values} == values
        assert config.active_gates == ("boundary", "consensus")
        # everything else is the defaults': a preset fixes the method, not the request
        assert {k: getattr(config, k) for k in FIELDS - set(values)} == {
            k: getattr(GenerationConfig(), k) for k in FIELDS - set(values)
        }


def test_a_preset_goes_over_the_base_and_options_given_go_over_the_preset():
    base = GenerationConfig(method="every_token", top_k=4, max_new_tokens=7, adaptive_draft=True)
    config = build_request("hi", config=base, preset="paper-gac", draft_length=3, token_healing=True).config
    assert config == GenerationConfig(
        method="safe",  # the preset's, over the base's
        aggregation="gac",
        top_k=10,
        adaptive_draft=False,
        max_new_tokens=7,  # the base's: not the preset's to set
        draft_length=3,  # given: over the preset's 5
        token_healing=True,  # given: over the preset's False
    )
    assert config == base.with_preset("paper-gac").updated(draft_length=3, token_healing=True)
    from_preset = GenerationConfig.from_preset("paper-gac", draft_length=3)
    assert from_preset == build_request("x", preset="paper-gac", draft_length=3).config
    assert build_request("hi", preset=None).config == GenerationConfig() == GenerationConfig.from_preset(None)
    # given options go over the preset under the shared semantics: a temperature alone samples
    assert build_request("hi", preset="paper-unite", temperature=0.7).config.do_sample is True


def test_an_unknown_preset_is_a_config_error_naming_the_known_ones():
    for call in (
        lambda: build_request("hi", preset="paper"),
        lambda: GenerationConfig.from_preset("paper"),
        lambda: GenerationConfig().with_preset("paper"),
        lambda: preset_values("paper"),
    ):
        with pytest.raises(ConfigError, match=UNKNOWN) as err:
            call()
        assert err.value.option == "preset"
    with pytest.raises(ConfigError, match=r"unknown preset \['paper-gac'\]"):
        build_request("hi", preset=["paper-gac"])


def _config(llm: ChatSafe | IndexLLM, call: dict) -> GenerationConfig:
    """The configuration an adapter decodes a call with these options under."""
    request = llm._request(None, call, prompt="hi") if isinstance(llm, ChatSafe) else llm._request(call, prompt="hi")
    return request.config


@pytest.mark.parametrize("model", [ChatSafe, IndexLLM])
def test_an_adapters_fields_show_its_preset_and_the_fields_given_win(ens, model):
    llm = model(ensemble=ens, preset="paper-gac", draft_length=3)
    assert (llm.aggregation, llm.adaptive_draft, llm.token_healing, llm.draft_length) == ("gac", False, False, 3)
    assert _config(llm, {}) == GenerationConfig.from_preset("paper-gac", draft_length=3)
    # a call's preset replaces the model's, under the fields given; a call's option goes over both
    want = GenerationConfig.from_preset("paper-unite", draft_length=3, top_k=4)
    assert _config(llm, {"preset": "paper-unite", "top_k": 4}) == want
    # without a preset, the fields left at their defaults are no options given: today's configuration
    assert _config(model(ensemble=ens), {}) == GenerationConfig()
    with pytest.raises(ConfigError, match=UNKNOWN):
        model(ensemble=ens, preset="paper")


def test_a_llamaindex_round_trip_keeps_the_presets_configuration():
    """to_dict holds the fields as the preset set them, so from_dict decodes the same way (nothing is loaded)."""
    llm = IndexLLM(models=["smollm2-135m", "qwen2.5-coder-0.5b"], preset="paper-unite", top_k=4)
    data = llm.to_dict()
    shown = (data["preset"], data["adaptive_draft"], data["token_healing"], data["top_k"])
    assert shown == ("paper-unite", False, False, 4)
    want = GenerationConfig.from_preset("paper-unite", top_k=4)
    assert _config(IndexLLM.from_dict(data), {}) == _config(llm, {}) == want


def test_the_docs_table_lists_each_presets_values():
    """docs/api.md's Presets table is the presets' values: a change to one shows in the other."""
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index("| field | `paper-unite` | `paper-gac` |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = [ast.literal_eval(c) for c in cells[1:3]]
    assert list(PRESETS) == re.findall(r"`([a-z-]+)`", text[start:].splitlines()[0])
    for i, name in enumerate(PRESETS):
        assert {field: values[i] for field, values in rows.items()} == PRESETS[name], name
