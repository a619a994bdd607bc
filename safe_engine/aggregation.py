"""Ensemble distributions over candidate *strings*, and probability sharpening.

Members have different vocabularies, so their next-token distributions are compared on the bytes the
tokens spell. A candidate is a byte string; `b""` stands for "end of sequence" (any member's EOS).

- UniTE: the union of every member's top-k strings; each member's log-probs are renormalised over
  that union (a string a member lacks gets the probability of the first token it would use for it).
- GaC: every member's full distribution is summed into the union of all vocabularies (a map built once
  per ensemble); candidates are then the best entries of that full union.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .members import Member
from .rows import Row

EOS = b""  # candidate string that ends the generation
GAC_CANDIDATES = 64  # union entries kept after GaC aggregation (for sharpening and sampling)


@dataclass
class Distribution:
    """P_ens over candidate strings at one text offset, with each member's share."""

    strings: list[bytes]
    probs: torch.Tensor  # [C] ensemble probability of each string
    member_probs: torch.Tensor  # [M, C] each member's probability of each string

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
        eos = [i for i in member.eos_ids if i < member.vocab_size]
        return eos[int(torch.argmax(row.logprob(eos)))] if eos else None
    tid = member.vocab.id_of_bytes.get(s)
    if tid is None:
        tid = member.vocab.first_id(s)
    return tid if tid is not None and tid < member.vocab_size else None


def top_strings(member: Member, row: Row, k: int) -> list[bytes]:
    """The member's k most likely tokens as candidate strings (control tokens other than EOS dropped)."""
    return [s for s in (token_string(member, i) for i in row.top(k)) if s is not None]


def _member_matrix(members: Sequence[Member], rows: Sequence[Row], strings: list[bytes]) -> torch.Tensor:
    """[M, C] log-probability each member gives each candidate string (-inf where it cannot spell it)."""
    out = torch.full((len(members), len(strings)), float("-inf"))
    for r, (member, row) in enumerate(zip(members, rows)):
        pairs = [(c, t) for c, s in enumerate(strings) if (t := string_token(member, row, s)) is not None]
        if pairs:
            cols, ids = zip(*pairs)
            out[r, list(cols)] = row.logprob(ids)
    return out


def unite(
    members: Sequence[Member], rows: Sequence[Row], weights: torch.Tensor, top_k: int, extra: bytes | None
) -> Distribution:
    """UniTE: average of each member's distribution renormalised over the union of top-k strings."""
    strings = list(dict.fromkeys(s for m, row in zip(members, rows) for s in top_strings(m, row, top_k)))
    if extra is not None and extra not in strings:
        strings.append(extra)
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
        self.maps = {key: torch.where(t < 0, trash, t) for key, t in maps.items()}

    def gac(
        self, members: Sequence[Member], rows: Sequence[Row], weights: torch.Tensor, extra: bytes | None
    ) -> Distribution:
        """GaC: weighted sum of full distributions mapped into the union; keep the best candidates."""
        total = torch.zeros(len(self.strings) + 1)
        for w, member, row in zip(weights.tolist(), members, rows):
            values = row.full()  # GaC needs every member's whole distribution
            total.index_add_(0, self.maps[id(member)][: values.shape[0]], values.exp() * w)
        probs = total[:-1]
        top = torch.topk(probs, min(GAC_CANDIDATES, probs.shape[0])).indices.tolist()
        strings = [self.strings[i] for i in top]
        if extra is not None and extra not in strings:
            strings.append(extra)
            top.append(self.index.get(extra, -1))
        picked = torch.tensor([float(probs[i]) if i >= 0 else 0.0 for i in top])
        member_probs = _member_matrix(members, rows, strings).exp()
        return Distribution(strings, picked, member_probs)


def sharpen(
    dist: Distribution, drafter_strings: list[bytes], method: str | None, threshold: float, weights: torch.Tensor
) -> torch.Tensor:
    """Scores to pick from; unchanged unless the ensemble is unsure (max P_ens < 0.5).

    heuristic: a drafter top-k string s with P_ens(s) > λ also receives the mass of every candidate that
    extends it ("Inc" collects "Incorrect"), because that mass is the same word split differently.
    geometric: the weighted geometric mean of member probabilities, which rewards agreement.
    """
    probs = dist.probs
    if method is None or float(probs.max()) >= 0.5:
        return probs
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
