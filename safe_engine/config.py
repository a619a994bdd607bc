"""GenerationConfig: every decoding knob, validated once, with messages that say what to do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ConfigError, InputTypeError

METHODS = ("safe", "every_token", "single")
AGGREGATIONS = ("unite", "gac")
SHARPENINGS = ("heuristic", "geometric", None)
MAX_NEW_TOKENS_LIMIT = 1_000_000


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. Defaults follow the SAFE paper (n = 5, k = 10, λ = 0.1, greedy)."""

    method: str = "safe"  # "safe" | "every_token" | "single" (drafter alone)
    aggregation: str = "unite"  # "unite" (top-k union) | "gac" (full vocabulary union)
    draft_length: int = 5
    top_k: int = 10
    sharpening: str | None = "heuristic"  # "heuristic" | "geometric" | None
    sharpen_threshold: float = 0.1  # λ
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

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
        if not isinstance(self.temperature, int | float) or not self.temperature > 0:  # `not >`: NaN too
            raise ConfigError(f"temperature must be > 0, got {self.temperature!r}; use do_sample=False for greedy")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise ConfigError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.do_sample, bool):  # "no" would be truthy and silently sample
            raise ConfigError(f"do_sample must be True or False, got {self.do_sample!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))

    def updated(self, **overrides: Any) -> GenerationConfig:
        """A copy with some fields replaced; unknown names are an error, not silently ignored."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown generation option(s) {unknown}; valid options: {sorted(known)}")
        return replace(self, **overrides)


def _choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {list(allowed)}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


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
