"""What a generation did: the numbers every result carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EnsembleStats:
    """Counts for one generation. `ensemble_rate` is the paper's E/T (ensembled / generated tokens)."""

    method: str
    tokens: int = 0  # drafter tokens accepted
    ensembled_tokens: int = 0  # positions decided by the ensemble distribution
    rounds: int = 0  # draft → verify rounds
    wall_time_s: float = 0.0
    forward_passes: dict[str, int] = field(default_factory=dict)  # per member name
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per member name
    note: str = ""
    # Why SAFE can cost more than its floor: a position where the ensemble picks another token than the
    # drafter's ends the round there, and the drafted tokens after it (one drafter pass each) are thrown away.
    replaced_tokens: int = 0  # ensemble points whose choice differed from the drafted token
    discarded_draft_tokens: int = 0  # drafted tokens dropped after a replaced one

    @property
    def ensemble_rate(self) -> float:
        return self.ensembled_tokens / self.tokens if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ensemble_rate": self.ensemble_rate, "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        passes = ", ".join(f"{k}={v}" for k, v in self.forward_passes.items())
        return (
            f"{self.method}: {self.tokens} tokens, {self.ensembled_tokens} ensembled "
            f"(E/T {self.ensemble_rate:.1%}), {self.rounds} rounds, {self.wall_time_s:.2f} s, "
            f"{self.tokens_per_s:.1f} tok/s; forward passes: {passes}"
        )


@dataclass
class GenerationResult:
    """Generated text (prompt excluded), why it ended, and the stats."""

    text: str
    finish_reason: str  # "eos" | "length" | "stop"
    stats: EnsembleStats
