"""The draft → verify loop shared by the three strategies.

One `Generation` is one request. Each round:
1. the drafter proposes up to n tokens (n = 1 for every-token ensembling, no verification for `single`);
2. each verifier re-encodes the generated text in its own tokenization and scores it in one forward pass
   over the tail it has not cached yet;
3. the drafted positions are scanned in order; a position is an ensemble point when every tokenizer has
   a token boundary at its byte offset (boundary gate) and the models do not already agree (consensus
   gate; `every_token` skips this gate);
4. at the first ensemble point whose choice differs from the drafter's token, the ensemble's string
   replaces it and the rest of the draft is dropped; caches are cropped, never recomputed from scratch.
"""

from __future__ import annotations

import codecs
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from .aggregation import EOS, Distribution, UnionVocab, sharpen, token_string, top_strings, unite
from .config import GenerationConfig
from .errors import InputError
from .members import Member
from .rows import Row
from .stats import EnsembleStats
from .vocab import token_starts


class Track:
    """One member's state for one request: its ids (prompt + generated text) and its KV cache."""

    def __init__(self, member: Member, prompt_ids: list[int], name: str) -> None:
        self.member = member
        self.name = name
        self.prompt_len = len(prompt_ids)
        self.ids = list(prompt_ids)
        self.cache = member.new_cache()
        self.cached = 0  # leading ids whose keys/values are in the cache
        self.passes = 0

    def run(self, config: GenerationConfig, rows_from: int | None = None) -> tuple[list[Row], int]:
        """Feed the ids the cache lacks; distributions after positions `rows_from`.. (default: the last).

        The cache is cropped to `rows_from` first when those positions were cached already.
        """
        last = len(self.ids) - 1
        rows_from = last if rows_from is None else max(0, min(rows_from, last))
        start = min(rows_from, self.cached)
        rows = self.member.score(self.cache, start, self.ids[start:], len(self.ids) - rows_from, config)
        self.cached = len(self.ids)
        self.passes += 1
        return rows, rows_from


class Verification:
    """A verifier's view of the drafted text: where its tokens start, and its distribution before each."""

    def __init__(
        self, track: Track, text: bytes, first_offset: int, drafter_ids: list[int] | None, config: GenerationConfig
    ) -> None:
        if drafter_ids is not None:  # same vocabulary as the drafter: score the drafter's own tokens
            ids = drafter_ids
            starts = token_starts(track.member.vocab, ids)
        else:
            ids, starts = track.member.vocab.encode(text)
        new_ids = track.ids[: track.prompt_len] + ids
        common = _common_prefix(track.ids, new_ids)
        track.ids = new_ids
        track.cached = min(track.cached, common)
        self.member = track.member
        self.too_long = member_full(track)
        if self.too_long:  # scoring would run the model past its window (IndexError for learned positions)
            self.rows, self.at = [], {}
            return
        k_first = bisect_left(starts, first_offset)
        self.rows, first_row = track.run(config, track.prompt_len + k_first - 1)
        # text offset -> (index of the row predicting the token that starts there, that token or None at end)
        self.at: dict[int, tuple[int, int | None]] = {}
        for k in range(k_first, len(ids) + 1):
            offset = starts[k] if k < len(ids) else len(text)
            # setdefault: when tokens share a start (normalised text), the boundary is before the first
            self.at.setdefault(offset, (track.prompt_len + k - 1 - first_row, ids[k] if k < len(ids) else None))


def member_full(track: Track) -> bool:
    window = track.member.context_window
    return window is not None and len(track.ids) >= window


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Generation:
    """One request decoded by the ensemble; `step()` runs one round and returns whether it finished."""

    def __init__(
        self,
        members: Sequence[Member],
        names: Sequence[str],
        prompt_ids: Sequence[list[int]],
        drafter: int,
        weights: torch.Tensor,
        config: GenerationConfig,
        union: UnionVocab | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.config = config
        method = config.method if len(members) > 1 else "single"
        note = "one member: decoded as single" if len(members) == 1 and config.method != "single" else ""
        self.method = method
        order = [drafter] + [i for i in range(len(members)) if i != drafter]
        active = order if method != "single" else [drafter]
        self.tracks = [Track(members[i], prompt_ids[i], names[i]) for i in active]
        self.weights = weights[active] / weights[active].sum()
        self.union = union
        self.executor = executor
        self.stats = EnsembleStats(method=method, note=note)
        self.stats.prompt_tokens = {t.name: t.prompt_len for t in self.tracks}
        self.generator = torch.Generator().manual_seed(
            config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        )
        self.data = bytearray()  # accepted generated text, as bytes
        self.text = ""  # accepted generated text, decoded (stop-truncated once finished)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.finish_reason: str | None = None
        self._busy = threading.Lock()
        self._cancelled = False
        self._started = time.perf_counter()
        for track in self.tracks:
            if member_full(track):
                raise InputError(
                    f"the prompt has {track.prompt_len} tokens for member {track.name!r}, which does not fit its "
                    f"context window of {track.member.context_window}; shorten the prompt"
                )

    @property
    def drafter(self) -> Track:
        return self.tracks[0]

    @property
    def verifiers(self) -> list[Track]:
        return self.tracks[1:]

    # -- the round ------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one draft → verify round; True once the generation has finished."""
        with self._busy:
            if self.finish_reason is not None:
                return True
            if self._cancelled:
                raise InputError("this generation was cancelled; start a new one")
            try:
                return self._round()
            finally:
                if self._cancelled or self.finish_reason is not None:
                    self._release()

    def _round(self) -> bool:
        cfg = self.config
        budget = cfg.max_new_tokens - self.stats.tokens
        n = 1 if self.method == "every_token" else cfg.draft_length
        draft_ids, draft_rows, draft_text = self._draft(min(n, budget))
        start = len(self.data)
        if self.method == "single":
            accepted, replacement = len(draft_ids), None
        else:
            checks = self._verify(bytes(self.data) + draft_text, start)
            if any(c.too_long for c in checks):
                return self._finish("length")
            accepted, replacement = self._scan(draft_ids, draft_rows, checks, start)
            if replacement is not None:
                self.stats.replaced_tokens += 1
                self.stats.discarded_draft_tokens += len(draft_ids) - accepted - 1
        self._accept(draft_ids[:accepted], replacement, budget)
        self.stats.rounds += 1
        return self.finish_reason is not None

    def _draft(self, n: int) -> tuple[list[int], list[Row], bytes]:
        drafter = self.drafter
        ids: list[int] = []
        rows: list[Row] = []
        text = bytearray()
        for _ in range(n):
            row = drafter.run(self.config)[0][-1]
            tok = row.sample(self.generator) if self.config.do_sample else row.argmax()
            drafter.ids.append(tok)
            ids.append(tok)
            rows.append(row)
            piece = token_string(drafter.member, tok)
            if not piece:  # EOS or another control token ends the draft
                break
            text += piece
            if member_full(drafter):
                break
        return ids, rows, bytes(text)

    def _verify(self, text: bytes, start: int) -> list[Verification]:
        drafter = self.drafter
        generated = drafter.ids[drafter.prompt_len :]
        if generated and not token_string(drafter.member, generated[-1]):
            generated = generated[:-1]  # a final control token has no text to score
        own = drafter.member.vocab.fingerprint
        jobs = [
            (t, text, start, generated if t.member.vocab.fingerprint == own else None, self.config)
            for t in self.verifiers
        ]
        if self.executor is not None and len(jobs) > 1:
            return [f.result() for f in [self.executor.submit(Verification, *job) for job in jobs]]
        return [Verification(*job) for job in jobs]

    def _scan(
        self, draft_ids: list[int], draft_rows: list[Row], checks: list[Verification], start: int
    ) -> tuple[int, bytes | None]:
        """Index of the first drafted token not accepted, and the ensemble's string for it (or None)."""
        offset = start
        drafter = self.drafter.member
        for j, (tok, row) in enumerate(zip(draft_ids, draft_rows)):
            here = offset
            offset += len(token_string(drafter, tok) or b"")
            if not all(here in c.at for c in checks):
                continue  # boundary gate: some tokenizer splits the text inside this token
            rows = [row] + [c.rows[c.at[here][0]] for c in checks]
            if self.method == "safe" and self._consensus(tok, rows, checks, here):
                continue
            choice = self._ensemble(tok, rows)
            if choice is None:
                continue  # sampling accepted the drafter's token
            self.stats.ensembled_tokens += 1
            if choice != token_string(drafter, tok):
                return j, choice
        return len(draft_ids), None

    def _consensus(self, tok: int, rows: list[Row], checks: list[Verification], offset: int) -> bool:
        """True when the drafter's token would win the ensemble anyway (paper's conditions a and b)."""
        probs = [float(rows[0].logprob([tok]).exp())]
        unanimous = True
        for c, row in zip(checks, rows[1:]):
            own = c.at[offset][1]
            own_ids = [i for i in c.member.eos_ids if i < c.member.vocab_size] if own is None else [own]
            probs.append(float(row.logprob(own_ids).exp().max()) if own_ids else 0.0)
            unanimous &= row.argmax() in own_ids
        if unanimous and not self.config.do_sample:
            return True
        return float(self.weights @ torch.tensor(probs)) > 0.5

    def _ensemble(self, tok: int, rows: list[Row]) -> bytes | None:
        """The ensemble's string at this position; None when sampling keeps the drafter's token."""
        cfg = self.config
        members = [t.member for t in self.tracks]
        drafted = token_string(members[0], tok)
        if cfg.aggregation == "gac":
            dist = self.union.gac(members, rows, self.weights, drafted)
        else:
            dist = unite(members, rows, self.weights, cfg.top_k, drafted)
        scores = sharpen(
            dist, top_strings(members[0], rows[0], cfg.top_k), cfg.sharpening, cfg.sharpen_threshold, self.weights
        )
        if not cfg.do_sample:
            return dist.strings[int(torch.argmax(scores))]
        return self._sample(dist, scores / scores.sum(), drafted)

    def _sample(self, dist: Distribution, p_ens: torch.Tensor, drafted: bytes | None) -> bytes | None:
        """Speculative-sampling acceptance (paper App. H): keep the draft with prob min(1, P_ens / q)."""
        if self.method == "safe" and drafted in dist.strings:
            i = dist.strings.index(drafted)
            q = dist.member_probs[0]
            ratio = float(p_ens[i]) / max(float(q[i]), 1e-30)
            if float(torch.rand((), generator=self.generator)) < min(1.0, ratio):
                return None
            residual = (p_ens - q).clamp_min(0.0)
            if float(residual.sum()) > 0:
                p_ens = residual / residual.sum()
        return dist.strings[int(torch.multinomial(p_ens, 1, generator=self.generator))]

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _accept(self, kept: list[int], replacement: bytes | None, budget: int) -> None:
        drafter = self.drafter
        member = drafter.member
        base = drafter.prompt_len + self.stats.tokens
        ended = bool(kept) and not token_string(member, kept[-1])
        pieces = [token_string(member, t) or b"" for t in kept]
        extra: list[int] = []
        if replacement is not None:
            if replacement == EOS:
                extra, ended = [min(member.eos_ids)], True
            else:
                single = member.vocab.id_of_bytes.get(replacement)
                extra = [single] if single is not None else member.vocab.encode(replacement)[0]
                room = budget - len(kept)  # >= 1: the replaced position was within the budget and the window
                if member.context_window is not None:
                    room = min(room, member.context_window - base - len(kept))
                extra = extra[: max(room, 1)]
                pieces += [member.token_bytes[t] or b"" for t in extra]
        drafter.ids = drafter.ids[:base] + kept + extra
        drafter.cached = min(drafter.cached, base + len(kept))
        self.stats.tokens += len(kept) + len(extra)
        self._append(b"".join(pieces))
        if self.finish_reason is None:
            if ended:
                self._finish("eos")
            elif self.stats.tokens >= self.config.max_new_tokens or member_full(drafter):
                self._finish("length")

    def _append(self, data: bytes, final: bool = False) -> None:
        """Add accepted bytes; finish with "stop" as soon as a stop string appears in the text."""
        self.data += data
        before = len(self.text)
        self.text += self._decoder.decode(data, final=final)
        longest = max((len(s) for s in self.config.stop), default=0)
        window_start = max(0, before - longest + 1)
        hits = [i for s in self.config.stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self._finish("stop")

    def _finish(self, reason: str) -> bool:
        if reason != "stop":
            self._append(b"", final=True)  # a cut character becomes U+FFFD, which may complete a stop string
            if self.finish_reason == "stop":
                return True
        self.finish_reason = reason
        self.stats.wall_time_s = time.perf_counter() - self._started
        self.stats.forward_passes = {t.name: t.passes for t in self.tracks}
        return True

    def cancel(self) -> None:
        """Abandon the request: its KV caches are freed now, or when the round in progress ends."""
        self._cancelled = True
        if self._busy.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._busy.release()

    def _release(self) -> None:
        for track in self.tracks:
            if track.cache is not None:
                track.member.release(track.cache)
                track.cache = None

    def visible_text(self) -> str:
        """Text that no later round can change: all of it once finished, else minus a possible stop prefix."""
        if self.finish_reason is not None:
            return self.text
        hold = 0
        for s in self.config.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]
