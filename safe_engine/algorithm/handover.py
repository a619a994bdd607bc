"""The pick → drafter handover: which drafter ids a pick of the ensemble becomes (like transformers'
`AssistantToTargetTranslator`, from the verifiers' strings to the drafter's tokens)."""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from ..runtime.members import Member
from ..runtime.rows import Draws, Row, race_sample
from .aggregation import Pick, eos_ids
from .round import Draft


class Handover:
    """Translates picks into the drafter's ids, healed into the drafter's own spelling."""

    def __init__(self, drafter: Member, config: GenerationConfig, aggregation: str, draws: Draws) -> None:
        self.drafter, self.config, self.aggregation, self.draws = drafter, config, aggregation, draws

    def ids(self, pick: Pick, row: Row, position: int) -> list[int]:
        """The drafter ids a pick becomes. UniTE hands the drafter one id, its first token of the string,
        and lets it continue from there (as the reference does); GaC the whole string re-encoded.

        With `token_healing` (the default), a pick the drafter spells with one token is handed as the token
        the drafter itself would spell the text with: its likeliest token (under `row`, the distribution the
        drafted token was drawn from) that starts with the pick and agrees with all of it. Why: a verifier's
        token is often a piece of one of the drafter's (":" of ":\\n", "\\n" of "\\n\\n", " sub" of
        " subspace"); handed the piece, the drafter continues from a split its tokenizer never makes, a
        sequence it was not trained on (issue 31: such handovers preceded most loops of the accuracy study)."""
        member = self.drafter
        if pick.eos:
            return [min(member.eos_ids)]
        single = member.vocab.id_of_bytes.get(pick.text)
        ids = [single] if single is not None else member.vocab.encode(pick.text)[0]
        if self.aggregation == "unite":
            ids = ids[:1]
        if len(ids) == 1 and self.config.token_healing:
            ids = [self.healed(ids[0], pick.text, row, position)]
        return ids

    def healed(self, first: int, text: bytes, row: Row, position: int) -> int:
        """The drafter's token that spells the start of `text` as the drafter would (see `ids`)."""
        vocab = self.drafter.vocab
        start = vocab.token_bytes[first] or b""
        spellings, ids = vocab.extensions(start)
        if text != start:  # a pick of several drafter tokens: keep to spellings that agree with all of it
            ids = [tid for b, tid in zip(spellings, ids) if b.startswith(text) or text.startswith(b)]
        if len(ids) <= 1:
            return first
        logprobs = row.logprob(ids)
        if not bool(torch.isfinite(logprobs).any()):
            return first  # top-p left none of them: the pick's own token stands
        if self.config.do_sample:
            return ids[race_sample(logprobs, self.draws.key("heal", position))]
        return ids[int(torch.argmax(logprobs))]

    def spelled(self, ids: list[int]) -> bytes:
        """The bytes handed over (for the trace)."""
        return b"".join(self.drafter.token_bytes[t] or b"" for t in ids)

    @staticmethod
    def first_ids(member: Member, draft: Draft, j: int) -> list[int]:
        """A verifier's own first token of the drafted text from position j (its EOS ids where none is left)."""
        text = b"".join(draft.pieces[j:])
        first = member.vocab.first_id(text) if text else None
        return [first] if first is not None else eos_ids(member)
