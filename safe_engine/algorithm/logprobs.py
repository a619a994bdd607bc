"""Log-probabilities of an ensemble's output, token by token (`logprobs=k`).

An ensemble has no single next-token distribution, so each emitted token (in the drafter's tokenization,
whose tokens spell the text exactly) reports the distribution it was *decided from*:
- "drafter": the drafter's own distribution (after penalties and logit_bias, temperature and top-p when
  sampling, and the grammar's mask): every position no ensemble point decided;
- "ensemble": at an ensemble point, the ensemble distribution over candidate strings (sharpened, restricted
  by the grammar and logit_bias) the pick followed. The token's logprob is that of the chosen *string*: where
  UniTE's pick is a string the drafter spells with several ids, the drafter is fed only the first one, and
  it carries the pick's probability. Where GaC feeds several ids, the first carries the pick's probability
  and the others, determined by the pick, carry log 1 = 0 (source "ensemble", no alternatives).
`top_logprobs` come from the same distribution (strings for the ensemble), best first; alternatives of
probability 0 (cut by top-p, masked) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..runtime.members import Member
from ..runtime.rows import Row
from ..stats import TokenLogprob, TopLogprob
from .aggregation import EOS
from .round import Round


class Logprobs:
    """One request's entries, one per accepted token that spells text (EOS and control tokens spell none)."""

    def __init__(self, drafter: Member, k: int) -> None:
        self.member = drafter
        self.k = k
        self.entries: list[TokenLogprob] = []
        self.ends: list[int] = []  # byte offset in the generated text where each entry's token ends

    # -- entries ---------------------------------------------------------------------------------------
    def drafter(self, tok: int, row: Row) -> TokenLogprob:
        """A token the drafter's own distribution decided."""
        value = float(row.logprob([tok])[0])
        top: list[TopLogprob] = []
        if self.k:
            ids = row.top(self.k)
            values = row.logprob(ids).tolist() if ids else []
            top = [self._top(self._id_bytes(i), v) for i, v in zip(ids, values) if v > -math.inf]
        return self._entry(tok, value, top, "drafter")

    def ensemble(self, tok: int, strings: Sequence[bytes], target: torch.Tensor, chosen: bytes) -> TokenLogprob:
        """The (first) token of the string an ensemble point chose, with that string's probability."""
        probs = target.double()
        index = list(strings).index(chosen) if chosen in strings else -1
        value = math.log(float(probs[index])) if index >= 0 and float(probs[index]) > 0 else -math.inf
        top: list[TopLogprob] = []
        if self.k:
            best = torch.topk(probs, min(self.k, probs.shape[0]))
            top = [
                self._top(self._string_bytes(strings[i]), math.log(p))
                for i, p in zip(best.indices.tolist(), best.values.tolist())
                if p > 0
            ]
        return self._entry(tok, value, top, "ensemble")

    def determined(self, tok: int) -> TokenLogprob:
        """A later id of a GaC pick spelled with several drafter ids: certain, given the pick."""
        return self._entry(tok, 0.0, [], "ensemble")

    def of_round(self, rnd: Round, kept: int) -> list[TokenLogprob]:
        """The entries of a round's first `kept` drafted tokens: the ensemble's where it decided a position,
        certain where a GaC pick covered it, the drafter's otherwise."""
        draft, entries = rnd.draft, []
        for j in range(kept):
            if j in rnd.decided:
                strings, target, chosen = rnd.decided[j]
                entries.append(self.ensemble(draft.ids[j], strings, target, chosen))
            elif j in rnd.covered:
                entries.append(self.determined(draft.ids[j]))
            else:
                entries.append(self.drafter(draft.ids[j], draft.drawn[j]))
        return entries

    def of_replacement(self, rnd: Round, kept: int, replacement: Sequence[int]) -> list[TokenLogprob]:
        """The entries of the ids that replaced drafted token `kept`: the pick's, then those it determines."""
        strings, target, chosen = rnd.decided[kept]
        return [self.ensemble(replacement[0], strings, target, chosen)] + [self.determined(t) for t in replacement[1:]]

    def extend(self, entries: Sequence[TokenLogprob], pieces: Sequence[bytes]) -> None:
        """Accept the entries of tokens moved into the text (`pieces`: the bytes each spells)."""
        end = self.ends[-1] if self.ends else 0
        for entry, piece in zip(entries, pieces):
            if piece:
                end += len(piece)
                self.entries.append(entry)
                self.ends.append(end)

    def truncate(self, nbytes: int) -> None:
        """Drop the entries of tokens that end past the first `nbytes` of the text (loop steering went back)."""
        keep = sum(1 for end in self.ends if end <= nbytes)
        del self.entries[keep:], self.ends[keep:]

    # -- reading ---------------------------------------------------------------------------------------
    def upto(self, start: int, nbytes: int) -> list[TokenLogprob]:
        """Entries from index `start` on whose tokens end within the first `nbytes` of the text."""
        out = []
        for i in range(start, len(self.entries)):
            if self.ends[i] > nbytes:
                break
            out.append(self.entries[i])
        return out

    def spelling(self, text: str) -> list[TokenLogprob]:
        """The entries of the tokens that spell `text` (the output, cut before a stop string): a token the
        cut goes through keeps only its bytes before the cut."""
        limit = len(text.encode("utf-8"))
        out = []
        start = 0
        for entry, end in zip(self.entries, self.ends):
            if start >= limit:
                break
            if end > limit:
                kept = bytes(entry.bytes[: limit - start])
                entry = TokenLogprob(
                    kept.decode("utf-8", errors="replace"), list(kept), entry.logprob, entry.top_logprobs, entry.source
                )
            out.append(entry)
            start = end
        return out

    # -- strings ---------------------------------------------------------------------------------------
    def _entry(self, tok: int, value: float, top: list[TopLogprob], source: str) -> TokenLogprob:
        data = self._id_bytes(tok)
        return TokenLogprob(data.decode("utf-8", errors="replace"), list(data), value, top, source)

    def _id_bytes(self, tok: int) -> bytes:
        """The bytes a drafter token spells; a control token (EOS) shows its name."""
        piece = self.member.token_bytes[tok] if tok < len(self.member.token_bytes) else None
        if piece:
            return piece
        name = self.member.tokenizer.convert_ids_to_tokens(tok)
        return (name if isinstance(name, str) else f"<id {tok}>").encode("utf-8")

    def _string_bytes(self, candidate: bytes) -> bytes:
        return self._id_bytes(min(self.member.eos_ids)) if candidate == EOS else candidate

    @staticmethod
    def _top(data: bytes, value: float) -> TopLogprob:
        return TopLogprob(data.decode("utf-8", errors="replace"), list(data), value)
