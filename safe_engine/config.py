"""GenerationConfig: every decoding knob, validated once, with messages that say what to do."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import ConfigError, InputTypeError
from .presets import preset_values

METHODS = ("safe", "every_token", "single")
GATES = ("boundary", "consensus")  # SAFE's two conditions; each alone is the paper's ablation
AGGREGATIONS = ("unite", "gac")
SCHEDULES = ("auto", "rounds", "overlap")
SHARPENINGS = ("heuristic", "geometric", None)
MAX_NEW_TOKENS_LIMIT = 1_000_000
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns a member's logits into its next-token distribution. Read off the request's
    `GenerationConfig` (where `build_request` resolved "greedy unless a temperature is given") and carried
    as it is to every member: local rows, llama.cpp rows and Ray actors."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. Defaults follow the SAFE paper (n = 5, k = 10, λ = 0.1, greedy) with this project's
    additions on (adaptive drafts, token healing); the paper's own configurations are presets
    (`from_preset("paper-unite")`, `safe_engine.presets`), so they stay reachable when the defaults move."""

    # Each field's metadata holds its one-line "doc" (the adapters' field descriptions, the CLI's help) and
    # optional "cli" hints for its flag; safe_engine.knobs derives both from here.
    method: str = field(
        default="safe",
        metadata={"doc": '"safe" | "every_token" (every token ensembled: the UniTE/GaC baseline) | "single" (drafter)'},
    )
    aggregation: str = field(
        default="unite", metadata={"doc": '"unite" (union of the members\' top-k) | "gac" (full-vocabulary union)'}
    )
    draft_length: int = field(default=5, metadata={"doc": "tokens the drafter proposes per round (n)"})
    top_k: int = field(default=10, metadata={"doc": "tokens per member in the UniTE union (k)"})
    sharpening: str | None = field(
        default="heuristic", metadata={"doc": '"heuristic" | "geometric" | None: sharpening of a spread ensemble'}
    )
    sharpen_threshold: float = field(default=0.1, metadata={"doc": "threshold λ of the heuristic sharpening"})
    max_new_tokens: int = field(default=256, metadata={"doc": "most tokens to generate"})
    stop: tuple[str, ...] = field(default=(), metadata={"doc": "stop strings (matched across tokens, never emitted)"})
    do_sample: bool = field(default=False, metadata={"doc": "sample (exact speculative sampling) instead of greedy"})
    # A temperature not given leaves decoding greedy, whatever its default (`shaping.request`: temperature 0 =
    # greedy, > 0 samples unless do_sample is False), so the CLI's help names no default for it.
    temperature: float = field(
        default=1.0,
        metadata={
            "doc": "sampling temperature; 0 means greedy, > 0 samples unless do_sample is False",
            "cli": {"default": None},
        },
    )
    top_p: float = field(default=1.0, metadata={"doc": "nucleus sampling threshold (with do_sample)"})
    seed: int | None = field(default=None, metadata={"doc": "seed for sampling (reproducible draws)"})
    # Which of SAFE's gates run: None = the method's own (safe: both; every_token: none). An ablation is
    # method="safe" with one gate, e.g. gates=("boundary",); gates=() is every-token ensembling.
    gates: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "doc": 'SAFE gates to run, for ablations ("boundary", "consensus"); None: the method\'s own',
            "cli": {
                "list": "comma",
                "metavar": "LIST",
                "help": "ablation: comma-separated SAFE gates to run "
                "(boundary,consensus; 'none' = every-token); default: the method's",
            },
        },
    )
    trace: bool = field(
        default=False,
        metadata={
            "doc": "record every ensemble point in the result's trace",
            "cli": {"metavar": "FILE", "help": "write every ensemble point as a JSON line to FILE ('-': stdout)"},
        },
    )
    schedule: str = field(
        default="auto",
        metadata={
            "doc": '"rounds" | "overlap" (verifiers score behind the drafter, concurrently) | "auto": overlap when '
            "one request runs alone, a spare core or a verifier device is free and the verifiers keep up with "
            "the drafter (timed on the first overlapped rounds)"
        },
    )
    adaptive_draft: bool = field(
        default=True,
        metadata={
            "doc": "end a draft one token after an unsure drafter token at a shared boundary (where replacements "
            "happen) and adapt the draft length to the request's replacement rate (a request alone; a batch "
            "drafts the configured length in lockstep)"
        },
    )
    token_healing: bool = field(
        default=True,
        metadata={
            "doc": "hand a replaced position to the drafter as the token it would spell the chosen text with "
            "(its likeliest token starting with it), never as a split its tokenizer does not make"
        },
    )
    loop_guard: int | None = field(
        default=None,
        metadata={
            "doc": "end an answer that repeats itself (finish_reason 'repetition') once a stretch of at least "
            "loop_span bytes has occurred this many times in a row at its end; None: off (the paper's method)",
            "cli": {"metavar": "REPEATS"},
        },
    )
    loop_steer: int | None = field(
        default=None,
        metadata={
            "doc": "steer away from a repetition: once the answer ends in a stretch of at least loop_span bytes "
            "occurring this many times in a row (digits counting as equal), go back to the first ensemble "
            "replacement inside those copies and keep the drafter's own token there (a stream holds back text it "
            "may still take back); None: off (the paper's method)",
            "cli": {"metavar": "REPEATS"},
        },
    )
    loop_span: int = field(
        default=32, metadata={"doc": "shortest repeated stretch, in bytes, the loop guard and loop steering count"}
    )
    timeout_s: float | None = field(
        default=None, metadata={"doc": "wall-clock limit of one generation in seconds (GenerationTimeout)"}
    )
    # Penalties apply to every member's logits, in its own tokens (its own tokenization of the text so far),
    # before the gates and the aggregation: SAFE over members that each decode with the penalty.
    frequency_penalty: float = field(
        default=0.0,
        metadata={
            "doc": "OpenAI's frequency penalty in [-2, 2]: each member's logit of a token drops by this times the "
            "token's count in its own tokens of the generated text"
        },
    )
    presence_penalty: float = field(
        default=0.0,
        metadata={
            "doc": "OpenAI's presence penalty in [-2, 2]: each member's logit of a token that occurs in its own "
            "tokens of the generated text drops by this"
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "doc": "transformers' / vLLM's repetition penalty (> 0, 1 = off): each member's logit of a token in its "
            "own prompt + generated tokens is divided by it (when positive) or multiplied by it"
        },
    )
    logit_bias: dict[int, float] | None = field(
        default=None,
        metadata={
            "doc": "{drafter token id: bias in [-100, 100]} added to the drafter's logits (OpenAI's logit_bias in "
            "the drafter's token ids; -100 also bars the token from the ensemble's picks)",
            "cli": {"metavar": "JSON", "help": 'logit bias as a JSON object {"drafter token id": bias in [-100, 100]}'},
        },
    )
    logprobs: int | None = field(
        default=None,
        metadata={
            "doc": "report each emitted token's log-probability (result.logprobs) with this many alternatives "
            f"(0-{MAX_TOP_LOGPROBS}); None: off",
            "cli": {"metavar": "K"},
        },
    )

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("sharpening", self.sharpening, SHARPENINGS)
        _int_at_least("draft_length", self.draft_length, 1)
        _int_at_least("top_k", self.top_k, 1)
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        if self.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} is absurdly large; use at most {MAX_NEW_TOKENS_LIMIT}"
            )
        if isinstance(self.sharpen_threshold, bool) or not isinstance(self.sharpen_threshold, int | float):
            raise ConfigError(f"sharpen_threshold (λ) must be a number in [0, 1), got {self.sharpen_threshold!r}")
        if not 0.0 <= self.sharpen_threshold < 1.0:
            raise ConfigError(f"sharpen_threshold (λ) must be in [0, 1), got {self.sharpen_threshold}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not self.temperature >= 0:  # `not >=`: NaN too
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}; 0 means greedy decoding")
        if self.temperature == 0 and self.do_sample is True:
            raise ConfigError("temperature 0 means greedy decoding; pass temperature > 0 to sample, or do_sample=False")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise ConfigError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.do_sample, bool):  # "no" would be truthy and silently sample
            raise ConfigError(f"do_sample must be True or False, got {self.do_sample!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "gates", _gates(self.gates, self.method))
        if not isinstance(self.trace, bool):
            raise ConfigError(f"trace must be True or False, got {self.trace!r}")
        _choice("schedule", self.schedule, SCHEDULES)
        if not isinstance(self.adaptive_draft, bool):
            raise ConfigError(f"adaptive_draft must be True or False, got {self.adaptive_draft!r}")
        if not isinstance(self.token_healing, bool):
            raise ConfigError(f"token_healing must be True or False, got {self.token_healing!r}")
        if self.loop_guard is not None:
            _int_at_least("loop_guard", self.loop_guard, 2)
        if self.loop_steer is not None:
            _int_at_least("loop_steer", self.loop_steer, 2)
        _int_at_least("loop_span", self.loop_span, 1)
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0
        ):
            raise ConfigError(f"timeout_s must be a positive number of seconds or None, got {self.timeout_s!r}")
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if (
            isinstance(self.repetition_penalty, bool)
            or not isinstance(self.repetition_penalty, int | float)
            or not 0 < self.repetition_penalty < float("inf")
        ):
            raise ConfigError(
                "repetition_penalty must be a number > 0 (1 = off, > 1 discourages repeats), "
                f"got {self.repetition_penalty!r}"
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise ConfigError(
                    f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives per token (None: off), "
                    f"got {self.logprobs}"
                )

    def strategy(self, members: int) -> Strategy:
        """How an ensemble of `members` models decodes with this configuration."""
        return Strategy.of(self, members)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the members' logits (off by default, at no cost)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def active_gates(self) -> tuple[str, ...]:
        """The gates this configuration runs (the method's own unless `gates` was given)."""
        if self.gates is not None:
            return self.gates
        return GATES if self.method == "safe" else ()

    @property
    def sampling(self) -> SamplingParams:
        """The fields that shape a row's distribution (temperature and top-p apply only when sampling)."""
        return SamplingParams(bool(self.do_sample), float(self.temperature), float(self.top_p))

    @classmethod
    def from_preset(cls, preset: str | None, **fields: Any) -> GenerationConfig:
        """Preset `preset`'s configuration (`safe_engine.presets`) with `fields` over it (None: the defaults with
        `fields`): a configuration by name in Python, as `preset=` gives it at every door."""
        return cls().with_preset(preset).updated(**fields)

    def with_preset(self, preset: str | None) -> GenerationConfig:
        """A copy with preset `preset`'s values in place of its own (None: unchanged); the one place a preset
        is applied, so that options given explicitly can go over it (`build_request`)."""
        return self if preset is None else self.updated(**preset_values(preset))

    def updated(self, **overrides: Any) -> GenerationConfig:
        """A copy with some fields replaced; unknown names are an error, not silently ignored."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown generation option(s) {unknown}; valid options: {sorted(known)}")
        return replace(self, **overrides)


@dataclass(frozen=True)
class Strategy:
    """How one request is decoded, resolved once from its configuration and the ensemble's size.

    Why: the decoder, the judge and the facade each used to re-derive this from the option strings
    (`method != "single"` in seven places); they read these fields instead.
    """

    method: str  # "safe" | "every_token" | "single" (an ensemble of one member decodes as "single")
    gates: tuple[str, ...]  # SAFE's gates that run: none for every_token, and none for single
    aggregation: str  # "unite" | "gac"
    schedule: str  # "auto" | "rounds" | "overlap"
    note: str = ""  # why the method differs from the one asked for

    @classmethod
    def of(cls, config: GenerationConfig, members: int) -> Strategy:
        method = config.method if members > 1 else "single"
        note = "one member: decoded as single" if members == 1 and config.method != "single" else ""
        gates = config.active_gates if method != "single" else ()
        return cls(method, gates, config.aggregation, config.schedule, note)

    @property
    def ensembles(self) -> bool:
        """Whether any member but the drafter runs (False for the drafter alone)."""
        return self.method != "single"

    @property
    def full_vocabulary(self) -> bool:
        """GaC: the ensemble distribution spans the union of the members' full vocabularies."""
        return self.ensembles and self.aggregation == "gac"

    @property
    def labels(self) -> tuple[str, ...]:
        """The gates as the stats name them (GaC's own confidence gate is "gac")."""
        return self.gates + (("gac",) if self.full_vocabulary else ())


def _choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {list(allowed)}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


def _number_in(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"{name} must be a number in [{low:g}, {high:g}] (0 = off), got {value!r}")


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias}, keys as ints (JSON objects key them by strings), biases in [-100, 100]; {} is None."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InputTypeError(f"logit_bias must be a mapping {{drafter token id: bias}}, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            tid = -1
        if isinstance(key, bool) or tid < 0 or (isinstance(key, str) and not key.strip().isdigit()):
            raise ConfigError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ConfigError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key!r}")
        out[tid] = float(value)
    return out or None


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise InputTypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ConfigError("stop strings must not be empty (an empty string would match before any output)")
    return tuple(dict.fromkeys(stop))


def _gates(gates: Any, method: str) -> tuple[str, ...] | None:
    if gates is None:
        return None
    if isinstance(gates, str):
        gates = (gates,)
    if not isinstance(gates, Sequence) or not all(isinstance(g, str) for g in gates):
        raise InputTypeError(f"gates must be a list of gate names from {list(GATES)}, got {gates!r}")
    unknown = sorted(set(gates) - set(GATES))
    if unknown:
        raise ConfigError(f"unknown gate(s) {unknown}; choose from {list(GATES)}")
    if method != "safe":
        raise ConfigError(
            f"gates apply to method='safe' (every_token runs no gate, single no ensemble); got method={method!r}; "
            "for an ablation pass method='safe' with e.g. gates=('boundary',)"
        )
    return tuple(g for g in GATES if g in gates)
