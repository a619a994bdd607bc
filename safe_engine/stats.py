"""What a generation did: the numbers every result carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EnsembleStats:
    """Counts for one generation. `ensemble_rate` is the paper's E/T (ensembled / generated tokens)."""

    method: str
    gates: tuple[str, ...] = ()  # the gates this generation ran ("boundary", "consensus"; GaC adds "gac")
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
    deferred_positions: int = 0  # positions judged a round later: a verifier's token there was cut by the draft's end
    steered_tokens: int = 0  # ensemble points where loop steering kept the drafted token (`loop_steer`)
    rolled_back_tokens: int = 0  # tokens loop steering took back and decoded again (its cost)

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


@dataclass(frozen=True)
class EnsemblePoint:
    """One position the ensemble decided (`generate(..., trace=True)`), for tests and research.

    Strings are the UTF-8 text of candidates (a byte-level token cut inside a character shows U+FFFD);
    "" stands for the end of the sequence.
    """

    offset: int  # byte offset in the generated text where the decided token starts
    drafted: str  # the drafter's token there
    chosen: str  # the ensemble's pick (UniTE then hands the drafter only its first token of it)
    replaced: bool  # the pick changed the drafter's text (the rest of the draft was dropped)
    drafter_prob: float  # P_drafter(drafted token)
    member_probs: list[float]  # each member's probability of its own token at this offset, drafter first
    unanimous: bool  # every verifier's most likely token was its own aligned token
    aligned: bool  # every tokenizer had a token boundary here (always, with the boundary gate)
    candidates: list[tuple[str, float]]  # best ensemble candidates after sharpening, best first
    gates: tuple[str, ...]  # the gates that ran here: "boundary", "gac" (drafter prob < 0.5), "consensus"
    # what the drafter was handed: the drafted token where it stood, else its token(s) carrying the pick (UniTE:
    # one token; with token healing the drafter's own token starting with the pick, ":\n" for ":")
    handed: str = ""
    steered: bool = False  # loop steering kept the drafted token: the pick had helped the text into a loop

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a token's position: its text, its UTF-8 bytes and its log-probability."""

    token: str
    bytes: list[int]
    logprob: float

    def to_dict(self) -> dict:
        return {"token": self.token, "bytes": list(self.bytes), "logprob": self.logprob}


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token (in the drafter's tokenization) with the log-probability of the distribution it was
    decided from: "ensemble" (the sharpened, grammar-restricted ensemble distribution over strings at an
    ensemble point) or "drafter" (the drafter's own distribution after penalties, temperature, top-p and the
    grammar's mask). `top_logprobs` come from that same distribution, best first."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]
    source: str  # "ensemble" | "drafter"

    def to_dict(self) -> dict:
        """OpenAI's chat shape (`choice.logprobs.content[i]`) plus the `source` field."""
        return {
            "token": self.token,
            "bytes": list(self.bytes),
            "logprob": self.logprob,
            "top_logprobs": [t.to_dict() for t in self.top_logprobs],
            "source": self.source,
        }


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs` object: {"content": [{token, bytes, logprob, top_logprobs, source}, ...]}."""
    return {"content": [e.to_dict() for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs (one {token:
    logprob} dict per token; the chosen token is always in it, as OpenAI's API adds it), text_offset (in
    characters, from `text_offset`), plus each token's `sources`."""
    offsets, data = [], b""
    for e in entries:
        offsets.append(text_offset + len(data.decode("utf-8", errors="ignore")))
        data += bytes(e.bytes)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{**{t.token: t.logprob for t in e.top_logprobs}, e.token: e.logprob} for e in entries],
        "text_offset": offsets,
        "sources": [e.source for e in entries],
    }


@dataclass
class GenerationResult:
    """Generated text (prompt excluded), why it ended, and the stats."""

    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "repetition" (the loop guard)
    stats: EnsembleStats
    trace: list[EnsemblePoint] | None = None  # the ensemble points, in order, when asked for with trace=True
    # With tools: the calls read back from the text ([{"id", "name", "arguments": dict}]), the text around
    # them, and calls that could not be read ([{"id", "name", "arguments": raw text, "error"}]).
    tool_calls: list[dict] | None = None
    content: str | None = None
    invalid_tool_calls: list[dict] | None = None
    # With logprobs=k: one entry per emitted token of `text` (the tokens' bytes spell it exactly)
    logprobs: list[TokenLogprob] | None = None
