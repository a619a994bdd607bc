"""Named presets: bundles of `GenerationConfig` field values, reachable by name at every door.

Why: `GenerationConfig`'s defaults follow this project's measurements (adaptive drafts, token healing) and
will move further from the paper after the accuracy study (issue 46); the paper's configurations stay one
word away: `preset="paper-unite"` or `preset="paper-gac"` (engine keyword, adapter field or per-call keyword,
server extra body field, CLI `--preset`).

Semantics, the same at every door (`build_request`, `GenerationConfig.with_preset`): a preset's values
replace those of the configuration underneath (the defaults, `config=`, a server's defaults); any option the
caller gives explicitly replaces the preset's; an unknown name is a `ConfigError` naming the known ones;
None is no preset.

A preset fixes the *method*, not the request: the token limit, stop strings, sampling (temperature, top-p,
seed), penalties, logprobs, trace and timeout are the request's own, and `schedule` only decides how the
members' forwards are interleaved, never the text (docs/speed.md), so none of these is in a preset. The
paper's runs were greedy with at most 2048 new tokens; pass those yourself to reproduce them.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

# The paper's SAFE (arXiv 2510.15346, restated in ../shared/docs/safe-algorithm.md) with either aggregation.
_PAPER: dict[str, Any] = {
    # SAFE: draft, then ensemble only at the first position that passes both gates (Algorithm 1) ...
    "method": "safe",
    # ... both of them: boundary (tokenization mismatch) and consensus; one alone is the §5 ablation
    "gates": None,
    # n = 5 tokens the drafter proposes per round (the paper's default; n = 3 / 8 gave similar accuracy)
    "draft_length": 5,
    # k = 10: each member's top-k strings form UniTE's union (and the heuristic sharpening's targets)
    "top_k": 10,
    # "Heuristic (default, λ = 0.1)", applied when max P_ens < 0.5: the paper's default, the best λ of its ablation
    "sharpening": "heuristic",
    "sharpen_threshold": 0.1,
    # a fixed draft of n tokens every round; ending drafts early and adapting n is this project's addition
    "adaptive_draft": False,
    # the reference code hands the drafter its own first token of the chosen string (UniTE) or the string
    # re-encoded (GaC); token healing (the drafter's likeliest token starting with it) is ours
    "token_healing": False,
    # the paper ends an answer at EOS, a stop string or the token limit: no loop guard, no loop steering (ours)
    "loop_guard": None,
    "loop_steer": None,
}

#: name -> the GenerationConfig field values it sets: the one source of the presets' values (every door reads
#: them through `preset_values`).
PRESETS: dict[str, dict[str, Any]] = {
    # "UniTE+SAFE" of the paper's Table 2: the union of the members' top-k strings
    "paper-unite": {**_PAPER, "aggregation": "unite"},
    # "GaC+SAFE": the union of the full vocabularies, ensembling only where the drafter's P < 0.5
    "paper-gac": {**_PAPER, "aggregation": "gac"},
}

#: The preset option as the adapters' field descriptions and the CLI's help show it.
DOC = (
    f"a named configuration as the base of the others ({' | '.join(PRESETS)}: the paper's SAFE with that "
    "aggregation, fixed drafts, no token healing, no loop guard or steering); options given explicitly win; "
    "None: the defaults"
)


def preset_values(name: Any) -> dict[str, Any]:
    """The field values of preset `name` (a copy); an unknown name is a ConfigError naming the known ones."""
    values = PRESETS.get(name) if isinstance(name, str) else None
    if values is None:
        raise ConfigError(f"unknown preset {name!r}; known presets: {list(PRESETS)}", option="preset")
    return dict(values)
