"""Ensemble distributions over candidate *strings*, and probability sharpening.

Members have different vocabularies, so their next-token distributions are compared on the bytes the
tokens spell. Inside this module a candidate is a byte string and `EOS` (the empty string, which no real
candidate can be) stands for "end of sequence" (any member's EOS); the decoder turns the pick into a typed
`Pick`.

- UniTE: the union of every member's top-k strings; each member's log-probs are renormalised over
  that union (a string a member lacks gets the probability of the first token it would use for it).
- GaC: every member's full distribution is summed into the union of all vocabularies (a map built once
  per ensemble); candidates are then the best entries of that full union.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.members import Member
from ..runtime.rows import Row

EOS = b""  # candidate string that ends the generation
GAC_CANDIDATES = 64  # union entries kept after GaC aggregation (for sharpening and the trace)
GAC_CONFIDENCE = 0.5  # GaC ensembles only where the drafter's top probability is below this (paper §4)


@dataclass(frozen=True)
class Pick:
    """What the ensemble chose at a position: some bytes of text, or the end of the sequence."""

    text: bytes
    eos: bool = False

    @classmethod
    def of(cls, candidate: bytes) -> Pick:
        return cls(candidate, eos=candidate == EOS)


@dataclass
class Distribution:
    """P_ens over candidate strings at one text offset, with each member's share.

    For GaC, `union_probs` is P_ens over the whole union vocabulary (`strings` holds its best entries).
    """

    strings: list[bytes]
    probs: torch.Tensor  # [C] ensemble probability of each string
    member_probs: torch.Tensor  # [M, C] each member's probability of each string
    union_probs: torch.Tensor | None = None

    def prob_of(self, s: bytes) -> float:
        return float(self.probs[self.strings.index(s)]) if s in self.strings else 0.0


def token_string(member: Member, token_id: int) -> bytes | None:
    """The candidate string of a token: its bytes, EOS for end tokens, None for other control tokens."""
    if token_id in member.eos_ids:
        return EOS
    return member.token_bytes[token_id] or None


def string_token(member: Member, row: Row, s: bytes) -> int | None:
    """The member's token for candidate s: its single token if it has one, else the first token it
    would spell s with; for EOS, its most likely end token. None if it cannot spell s."""
    if s == EOS:
        eos = eos_ids(member)
        return eos[int(torch.argmax(row.logprob(eos)))] if eos else None
    tid = member.vocab.id_of_bytes.get(s)
    if tid is None:
        tid = member.vocab.first_id(s)
    return tid if tid is not None and tid < member.vocab_size else None


def eos_ids(member: Member) -> list[int]:
    return [i for i in sorted(member.eos_ids) if i < member.vocab_size]


def top_strings(member: Member, row: Row, k: int) -> list[bytes]:
    """The member's k most likely tokens as candidate strings (control tokens other than EOS dropped)."""
    return [s for s in (token_string(member, i) for i in row.top(k)) if s is not None]


def string_probs(member: Member, row: Row, strings: Sequence[bytes]) -> torch.Tensor:
    """[C] the probability that this member's next token spells exactly each string (all ids that spell it,
    e.g. SentencePiece's "▁" and "<0x20>"; all EOS ids for EOS). Speculative sampling's q over strings."""
    groups = [eos_ids(member) if s == EOS else member.vocab.ids_of_bytes.get(s, []) for s in strings]
    flat = [i for g in groups for i in g if i < member.vocab_size]
    values = row.logprob(flat).exp() if flat else torch.zeros(0)
    out, pos = torch.zeros(len(strings), dtype=torch.float64), 0
    for c, g in enumerate(groups):
        n = sum(1 for i in g if i < member.vocab_size)
        out[c] = float(values[pos : pos + n].double().sum()) if n else 0.0
        pos += n
    return out


def _member_matrix(members: Sequence[Member], rows: Sequence[Row], strings: list[bytes]) -> torch.Tensor:
    """[M, C] log-probability each member gives each candidate string (-inf where it cannot spell it)."""
    out = torch.full((len(members), len(strings)), float("-inf"))
    for r, (member, row) in enumerate(zip(members, rows)):
        pairs = [(c, t) for c, s in enumerate(strings) if (t := string_token(member, row, s)) is not None]
        if pairs:
            cols, ids = zip(*pairs)
            out[r, list(cols)] = row.logprob(ids)
    return out


def unite(members: Sequence[Member], rows: Sequence[Row], weights: torch.Tensor, top_k: int) -> Distribution:
    """UniTE: average of each member's distribution renormalised over the union of top-k strings."""
    strings = list(dict.fromkeys(s for m, row in zip(members, rows) for s in top_strings(m, row, top_k)))
    member_probs = torch.softmax(_member_matrix(members, rows, strings), dim=-1).nan_to_num(0.0)
    return Distribution(strings, weights @ member_probs, member_probs)


class UnionVocab:
    """GaC's union of all members' vocabularies: one index per distinct string, built once."""

    def __init__(self, members: Sequence[Member]) -> None:
        index: dict[bytes, int] = {EOS: 0}
        maps: dict[int, torch.Tensor] = {}  # id(member) -> union index of each of its token ids
        for m in members:
            ids = []
            for tid, b in enumerate(m.token_bytes):
                if tid in m.eos_ids:
                    ids.append(0)
                elif b:
                    ids.append(index.setdefault(b, len(index)))
                else:
                    ids.append(-1)  # control token: its mass is dropped
            maps[id(m)] = torch.tensor(ids, dtype=torch.long)
        self.index = index
        self.strings = list(index)
        trash = len(self.strings)
        self._maps = {key: torch.where(t < 0, trash, t) for key, t in maps.items()}
        self._on_device: dict[tuple[int, str], torch.Tensor] = {}
        self._candidates: dict[int, Any] = {}

    def candidates(self, drafter: Member) -> Any:
        """The union's strings as `constrained.Candidates` for `drafter` (built once: ~50 ms)."""
        from ..shaping.constrained import Candidates

        table = self._candidates.get(id(drafter))
        if table is None:
            table = self._candidates[id(drafter)] = Candidates(self.strings, drafter)
        return table

    def mapped(self, member: Member, row: Row) -> torch.Tensor:
        """[U] the member's full distribution summed into the union (on the CPU)."""
        values = row.full()  # GaC needs every member's whole distribution
        key = (id(member), str(values.device))
        index = self._on_device.get(key)
        if index is None:
            index = self._on_device[key] = self._maps[id(member)].to(values.device)
        total = torch.zeros(len(self.strings) + 1, device=values.device)
        total.index_add_(0, index[: values.shape[0]], values.exp())
        return total[:-1].cpu()

    def gac(self, members: Sequence[Member], rows: Sequence[Row], weights: torch.Tensor) -> Distribution:
        """GaC: weighted sum of full distributions mapped into the union; keep the best candidates."""
        probs = sum(w * self.mapped(m, row) for w, m, row in zip(weights.tolist(), members, rows))
        top = torch.topk(probs, min(GAC_CANDIDATES, probs.shape[0])).indices.tolist()
        strings = [self.strings[i] for i in top]
        member_probs = _member_matrix(members, rows, strings).exp()
        return Distribution(strings, probs[top], member_probs, union_probs=probs)


def sharpen(
    dist: Distribution, drafter_strings: list[bytes], method: str | None, threshold: float, weights: torch.Tensor
) -> torch.Tensor | None:
    """Scores to pick from, or None when the ensemble is sure enough (max P_ens >= 0.5) to leave it alone.

    heuristic: a drafter top-k string s with P_ens(s) > λ also receives the mass of every candidate that
    extends it ("Inc" collects "Incorrect"), because that mass is the same word split differently.
    geometric: the weighted geometric mean of member probabilities, which rewards agreement.
    """
    probs = dist.probs
    if method is None or float(probs.max()) >= 0.5:
        return None
    if method == "geometric":
        geo = torch.exp(weights @ torch.log(dist.member_probs.clamp_min(1e-30)))
        return geo / geo.sum()
    scores = probs.clone()
    position = {s: i for i, s in enumerate(dist.strings)}
    for s in drafter_strings:
        i = position.get(s)
        if i is None or s in (EOS, b" ") or float(probs[i]) <= threshold:
            continue
        scores[i] += sum(float(probs[j]) for t, j in position.items() if j != i and t.startswith(s))
    return scores
