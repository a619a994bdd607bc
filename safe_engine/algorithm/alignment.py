"""Alignment on bytes: where each member's tokens start in the shared text, and where all agree.

SAFE may only ensemble at a byte offset where *every* member has a token boundary; elsewhere some member
would be forced into an unnatural sub-word split. Offsets are bytes of the UTF-8 text, not characters,
because a byte-level BPE token can end inside a multi-byte character.

A verifier re-tokenizes the generated text every round, but only after its *frozen* prefix: the tokens
that end a few words before the accepted text does, which later text cannot change. That keeps a round's
cost independent of how long the output already is.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from ..config import GenerationConfig
from ..runtime.members import Track
from ..runtime.rows import Row
from ..runtime.vocab import Vocab, token_starts

__all__ = ["Verification", "boundaries", "common_boundaries", "texts_held", "token_starts"]

FREEZE_MARGIN = 4  # tokens before the end of the accepted text that stay open to re-tokenization
_SPACE = b" \t\n\r\x0b\x0c"


def boundaries(vocab: Vocab, text: bytes) -> set[int]:
    """Offsets where this tokenizer, encoding `text`, starts a token (plus the end of the text)."""
    _, starts = vocab.encode(text)
    return {*starts, len(text)}


def common_boundaries(vocabs: Sequence[Vocab], text: bytes) -> set[int]:
    """Offsets that are token boundaries for every tokenizer: the only places SAFE may ensemble."""
    return set.intersection(*(boundaries(v, text) for v in vocabs))


def texts_held(track: Track, text: bytes, ends: Sequence[int], id_counts: Sequence[int] | None) -> int:
    """How many of the texts `text[:end]` for `ends` (the accepted text, then one more drafted token each) the
    verifier can score within its context window, counted from the first: the text ends before the first it
    cannot. Every one is counted, not only the longest, so the answer ends before the same token whatever
    the schedule drafted it in (a 5-token round or the overlap's chunk of one), and a tokenizer whose count
    shrinks as text grows (BPE merges) cannot hide one. `id_counts`: the generated ids of each, for a
    verifier that scores the drafter's own ids (a byte-identical vocabulary)."""
    window = track.member.context_window
    if window is None:
        return len(ends)
    if id_counts is not None:
        return next((j for j, n in enumerate(id_counts) if track.prompt_len + n >= window), len(ends))
    head, base = track.prompt_len + track.frozen_ids, track.frozen_bytes
    if head + 2 * (ends[-1] - base) + 2 < window:  # far from it: a token spells a byte or more of the text
        return len(ends)  # (a normalizer may expand it; twice its bytes leaves room for that)
    for j, end in enumerate(ends):
        if head + len(track.member.vocab.encode(text[base:end])[0]) >= window:
            return j
    return len(ends)


class Verification:
    """A verifier's view of the generated text: where its tokens start, and its distribution before each.

    `drafter_ids` is given when the verifier's vocabulary is byte-identical to the drafter's: it then
    scores the drafter's own tokens (two copies of one model agree exactly). Otherwise it re-encodes the
    text after its frozen prefix. One forward pass (`job`, batched with other requests' by the caller, then
    `take`) scores everything from the token at `first_offset` on.
    """

    def __init__(
        self,
        track: Track,
        text: bytes,
        first_offset: int,
        drafter_ids: list[int] | None,
        config: GenerationConfig,
    ) -> None:
        self.track = track
        self.text = text
        self.config = config
        self.same_vocab = drafter_ids is not None
        base = track.frozen_bytes
        if drafter_ids is not None:
            ids = drafter_ids[track.frozen_ids :]
            starts = [base + s for s in token_starts(track.member.vocab, ids)]
        else:
            ids, starts = track.member.vocab.encode(text[base:])
            starts = [base + s for s in starts]
        self.ids, self.starts = ids, starts  # the tokens after the frozen prefix
        head = track.prompt_len + track.frozen_ids
        new_ids = track.ids[:head] + ids
        track.cached = min(track.cached, head + _common_prefix(track.ids[head:], ids))
        track.ids = new_ids
        assert not track.full, "the text was cut to what the verifier's window holds (`texts_held`)"
        # text offset -> (index of the row predicting the token that starts there, that token or None at end)
        self.at: dict[int, tuple[int, int | None]] = {}
        self.rows: list[Row] = []
        self._k_first = bisect_left(starts, first_offset)
        self.job, self._first_row = track.job(config, head + self._k_first - 1)

    def take(self, rows: list[Row]) -> None:
        """The rows the job's forward returned."""
        self.track.done()
        self.rows = rows
        head = self.track.prompt_len + self.track.frozen_ids
        ids, starts = self.ids, self.starts
        for k in range(self._k_first, len(ids) + 1):
            offset = starts[k] if k < len(ids) else len(self.text)
            # setdefault: when tokens share a start (normalised text), the boundary is before the first
            self.at.setdefault(offset, (head + k - 1 - self._first_row, ids[k] if k < len(ids) else None))

    def view(self, offset: int, final: bool) -> tuple[Row, list[int], bool]:
        """At a boundary offset: the distribution, the ids that count as the verifier's own token there (its
        next token, or its EOS ids at the end of the text), and whether that token is *cut*.

        The verifier's last token may be cut by the end of the draft (" Inc" where the text goes on as
        " Incorrect"), unless the text is `final`. Its probability there would be falsely low, so a cut
        token stands for every token consistent with the drafted bytes (`Vocab.consistent_ids`): their
        mass bounds the probability of the token the verifier will really have. A verifier scoring the
        drafter's own tokens is never cut."""
        row, own = self.at[offset]
        member = self.track.member
        if own is None:
            return self.rows[row], [i for i in member.eos_ids if i < member.vocab_size], False
        if final or self.same_vocab or offset != self.starts[-1]:
            return self.rows[row], [own], False
        return self.rows[row], member.vocab.consistent_ids(self.text[offset:]), True

    def prefix_view(self, offset: int, final: bool) -> tuple[Row, list[int], bool]:
        """Like `view` where the verifier has no boundary at `offset` (only with the boundary gate off):
        its distribution after its own tokenization of the text before `offset` (an extra forward pass, as
        every-token ensembling pays), its own next token, and whether that token is cut."""
        track = self.track
        base = track.frozen_bytes
        ids, _ = track.member.vocab.encode(self.text[base:offset])
        head = track.prompt_len + track.frozen_ids
        track.cached = min(track.cached, head + _common_prefix(track.ids[head:], ids))
        track.ids = track.ids[:head] + ids
        rows, _ = track.run(self.config)
        rest, _ = track.member.vocab.encode(self.text[offset:])
        member = track.member
        if not rest:
            return rows[-1], [i for i in member.eos_ids if i < member.vocab_size], False
        if len(rest) == 1 and not final:
            return rows[-1], member.vocab.consistent_ids(self.text[offset:]), True
        return rows[-1], [rest[0]], False

    def starts_token_at(self, offset: int, more: bytes) -> bool:
        """Whether the verifier would start a token at `offset` of this text followed by `more` (for the
        trace of every-token ensembling, whose verifiers read only the accepted text)."""
        if self.same_vocab:
            return True
        base = self.track.frozen_bytes
        _, starts = self.track.member.vocab.encode(self.text[base:] + more)
        return offset - base in starts

    def freeze(self, agreed: int) -> None:
        """Freeze the tokens that end a margin before byte `agreed` (the verified text and the accepted text
        agree up to there), at the start of a word, so the next round re-encodes only from there."""
        track = self.track
        last = bisect_right(self.starts, agreed) - 1 - FREEZE_MARGIN
        for k in range(last, 0, -1):
            start = self.starts[k]
            if start <= track.frozen_bytes:
                return
            if self.same_vocab or _starts_a_word(self.text, start):
                head = track.prompt_len + track.frozen_ids
                if track.ids[head : head + k] != self.ids[:k]:  # a prefix view fed other ids since
                    track.cached = min(track.cached, head + _common_prefix(track.ids[head:], self.ids[:k]))
                    track.ids = track.ids[:head] + self.ids[:k]
                track.frozen_ids += k
                track.frozen_bytes = start
                return


def _starts_a_word(text: bytes, offset: int) -> bool:
    """A single space before a word, after a non-space: a split point that BPE pre-tokenizers and
    SentencePiece never merge across, so re-encoding from here gives the same tokens as encoding it all.
    (Inside a run of spaces they may: "\t\t   x" splits differently depending on where encoding starts.)"""
    return (
        0 < offset < len(text) - 1
        and text[offset] == 0x20
        and text[offset - 1] not in _SPACE
        and text[offset + 1] not in _SPACE
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
