"""What happens at one drafted position that passed the boundary gate: SAFE's remaining gates, the ensemble
distribution, and the pick.

In order (paper §3–4, Algorithm 1, App. H):
1. GaC only: ensemble only where the drafter is unsure, its top probability below 0.5 (greedy: the drafted
   token's probability, the reference's `draft_prob < 0.5`).
2. Consensus gate, greedy: skip when (a) every verifier's most likely token is its own aligned token, or
   (b) the weighted mean of P_drafter(t) and each verifier's P(own token) exceeds 1/2; either way t would
   win the averaged distribution.
3. The ensemble distribution (UniTE or GaC), sharpened when it is spread thin (max < 0.5).
4. The pick: greedy takes the argmax. Sampling (App. H) replaces the consensus gate by speculative
   sampling: keep the drafted string with probability min(1, P_ens / q), q being the drafter's own
   distribution the token was drawn from, else draw from the residual max(0, P_ens − q). The emitted
   string is then distributed exactly as P_ens. Without the consensus gate, sampling draws from P_ens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import GenerationConfig
from ..errors import ConfigError
from ..runtime.members import Member
from ..runtime.rows import Draws, Row, race_sample
from ..shaping.constrained import Constraint, mask_distribution
from ..stats import EnsemblePoint
from .aggregation import (
    EOS,
    GAC_CONFIDENCE,
    Distribution,
    Pick,
    UnionVocab,
    sharpen,
    string_probs,
    token_string,
    top_strings,
    unite,
)

TRACE_CANDIDATES = 10


@dataclass
class Verdict:
    """The outcome at one position: whether the ensemble decided it, and its pick (None: the drafted token
    stands, because a gate skipped the position or sampling kept the draft). `deferred`: the consensus
    gate cannot tell yet (a verifier's token is cut by the end of the draft); judge it next round."""

    ensembled: bool
    pick: Pick | None = None
    point: EnsemblePoint | None = None  # filled in when tracing (its `replaced` is set by the caller)
    deferred: bool = False
    # With logprobs: the distribution the position was decided from (candidate strings, probabilities), also
    # where speculative sampling kept the drafted string (its probability is then the ensemble's)
    decided_from: tuple[list[bytes], torch.Tensor] | None = None


SKIP = Verdict(ensembled=False)
DEFER = Verdict(ensembled=False, deferred=True)


class Judge:
    """Decides drafted positions for one request: members (drafter first), weights, config and RNG."""

    def __init__(
        self,
        members: Sequence[Member],
        weights: torch.Tensor,
        config: GenerationConfig,
        union: UnionVocab | None,
        draws: Draws,
    ) -> None:
        """Decides for one request. A grammar (`constrained.Constraint`) reaches `judge` as `constrain`: the
        ensemble's candidates are then restricted to what it allows, so whichever member proposed a string,
        every emitted byte is valid."""
        self.members = list(members)
        self.weights = weights
        self.config = config
        self.union = union
        self.draws = draws
        self.gates = config.active_gates
        # drafter ids logit_bias bars (-100): the ensemble never picks a string the drafter would spell with one
        self.banned = frozenset(t for t, b in (config.logit_bias or {}).items() if b <= -100)

    def drafter_confident(self, row: Row) -> bool:
        """GaC's own gate: the drafter's top probability is at least 0.5, so GaC leaves the position alone.

        Read off the distribution (not the sampled token), so that sampling stays exact."""
        return self.config.aggregation == "gac" and float(row.logprob([row.argmax()]).exp()) >= GAC_CONFIDENCE

    def judge(
        self,
        offset: int,
        drafted: int,
        rows: Sequence[Row],
        owns: Sequence[list[int]],
        cuts: Sequence[bool] | None = None,
        aligned: bool = True,
        constrain: Callable[[], Constraint] | None = None,
        drawn: Row | None = None,
        position: int = 0,
    ) -> Verdict:
        """`rows`: each member's distribution at `offset` (drafter first); `owns`: each verifier's own token
        ids there (its next token, or its EOS ids at the end of the text); `cuts`: which of those are cut by
        the end of the draft, `owns` then holding every token consistent with the drafted bytes (see
        `alignment.Verification.view`); `aligned`: whether every tokenizer has a boundary here (trace);
        `constrain`: the request's grammar, brought to this position (only asked for when a pick is made);
        `drawn`: the distribution the drafted token was drawn from, if not rows[0] (the masked row);
        `position`: the generated token's index (it keys the random numbers of sampling).

        With a cut token the consensus gate knows only bounds: P(own) lies in [0, mass of the consistent
        tokens]. Where the bounds already decide it, it is decided now; otherwise the verdict is DEFER."""
        cfg = self.config
        ran: tuple[str, ...] = ("boundary",) if "boundary" in self.gates else ()
        if cfg.aggregation == "gac":
            ran += ("gac",)
            if self.drafter_confident(rows[0]):
                return SKIP
        drafter = self.members[0]
        drafted_string = token_string(drafter, drafted)
        cuts = cuts or [False] * len(owns)
        probs = [float(rows[0].logprob([drafted]).exp())]  # exact, or the upper bound for a cut token
        floor = [probs[0]]  # the lower bound: 0 for a cut token
        unanimous = unanimous_surely = True
        for row, own, cut in zip(rows[1:], owns, cuts):
            values = row.logprob(own).exp() if own else torch.zeros(1)
            probs.append(float(values.sum() if cut else values.max()))
            floor.append(0.0 if cut else probs[-1])
            unanimous &= row.argmax() in own
            unanimous_surely &= unanimous and not cut
        consensus = "consensus" in self.gates
        if consensus:
            ran += ("consensus",)
            if not cfg.do_sample:
                if unanimous_surely or float(self.weights @ torch.tensor(floor)) > 0.5:
                    return SKIP
                if unanimous or float(self.weights @ torch.tensor(probs)) > 0.5:
                    return DEFER  # the bounds disagree: the rest of the cut token decides
        dist = self._distribution(rows)
        scores = sharpen(
            dist, top_strings(drafter, rows[0], cfg.top_k), cfg.sharpening, cfg.sharpen_threshold, self.weights
        )
        strings, target = self._target(dist, scores)
        if constrain is not None:
            union = self.union if self.union is not None and strings is self.union.strings else None
            masked = mask_distribution(union.candidates(drafter) if union is not None else strings, target, constrain())
            if masked is None:
                return SKIP  # the grammar allows none of them: the drafted token (drawn under the mask) stands
            target = masked
        if self.banned:
            allowed = self._unbanned(strings, target)
            if allowed is None:
                return SKIP  # logit_bias bars every candidate: the drafted token (drawn with the bias) stands
            target = allowed
        decided_from = (strings, target) if cfg.logprobs is not None else None
        choice: bytes | None
        if not cfg.do_sample:
            choice = strings[int(torch.argmax(target))]
        elif consensus:
            choice = self._speculative(strings, target, drawn or rows[0], drafted_string, position)
            if choice is None:  # the drafted string was kept: App. H counts this as no ensembling
                return SKIP if decided_from is None else Verdict(ensembled=False, decided_from=decided_from)
        else:
            choice = strings[_draw(target, self.draws.key("pick", position))]
        point = None
        if cfg.trace:
            best = torch.topk(target, min(TRACE_CANDIDATES, target.shape[0]))
            point = EnsemblePoint(
                offset=offset,
                drafted=_show(drafted_string),
                chosen=_show(choice),
                replaced=False,
                drafter_prob=probs[0],
                member_probs=probs,
                unanimous=unanimous,
                aligned=aligned,
                candidates=[(_show(strings[i]), float(p)) for i, p in zip(best.indices.tolist(), best.values.tolist())],
                gates=ran,
            )
        return Verdict(ensembled=True, pick=Pick.of(choice), point=point, decided_from=decided_from)

    def _unbanned(self, strings: list[bytes], target: torch.Tensor) -> torch.Tensor | None:
        """`target` without the candidates the drafter would be fed a barred id for (logit_bias -100), in
        order of probability until the best one left is allowed (a GaC union has ~10^5 strings; only the top
        can win), normalised; None when nothing is left. Sampling picks from the top too: candidates are
        checked down to where the mass left to check is below 1e-9."""
        target = target.clone()
        order = torch.argsort(target, descending=True).tolist()
        checked = 0.0
        for i in order:
            p = float(target[i])
            if p <= 0:
                break
            if self._bars(strings[i]):
                target[i] = 0.0
            elif not self.config.do_sample:
                break  # greedy: the best allowed candidate is found
            checked += p
            if checked > 1 - 1e-9:
                break
        total = float(target.sum())
        return target / total if total > 0 else None

    def _bars(self, candidate: bytes) -> bool:
        """Whether the drafter would be fed an id barred by logit_bias for this candidate string."""
        drafter = self.members[0]
        if candidate == EOS:
            return min(drafter.eos_ids) in self.banned
        single = drafter.vocab.id_of_bytes.get(candidate)
        ids = [single] if single is not None else drafter.vocab.encode(candidate)[0]
        if self.config.aggregation == "unite":
            ids = ids[:1]
        return any(i in self.banned for i in ids)

    def _distribution(self, rows: Sequence[Row]) -> Distribution:
        if self.config.aggregation == "gac":
            return self._union().gac(self.members, rows, self.weights)
        return unite(self.members, rows, self.weights, self.config.top_k)

    def _target(self, dist: Distribution, scores: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor]:
        """The distribution the pick follows: the sharpened scores normalised, or P_ens itself (for GaC over
        the whole union vocabulary, so nothing beyond its best candidates is lost)."""
        if scores is not None:
            return dist.strings, (scores / scores.sum()).double()
        if dist.union_probs is not None:
            return self._union().strings, dist.union_probs.double()
        return dist.strings, dist.probs.double()

    def _union(self) -> UnionVocab:
        """GaC's union vocabulary, which a request aggregating with GaC is always given."""
        if self.union is None:
            raise ConfigError("aggregation='gac' needs the members' union vocabulary, and this request has none")
        return self.union

    def _speculative(
        self, strings: list[bytes], target: torch.Tensor, drafter_row: Row, drafted: bytes | None, position: int
    ) -> bytes | None:
        """Keep the drafted string with probability min(1, P(s)/q(s)), else draw from the residual."""
        drafter = self.members[0]
        if self.union is not None and strings is self.union.strings:  # q mapped into the whole union
            q = self.union.mapped(drafter, drafter_row).double()
            index = self.union.index.get(drafted, -1) if drafted is not None else -1
        else:
            q = string_probs(drafter, drafter_row, strings)
            index = strings.index(drafted) if drafted in strings else -1
        if index >= 0:
            ratio = float(target[index]) / max(float(q[index]), 1e-300)
            if self.draws.uniform("accept", position) < min(1.0, ratio):
                return None
        residual = (target - q).clamp_min(0.0)
        weights = residual if float(residual.sum()) > 0 else target
        return strings[_draw(weights, self.draws.key("pick", position))]


def _draw(weights: torch.Tensor, seed: int) -> int:
    """Index drawn proportionally to non-negative `weights` (the exponential race, see rows.race_sample)."""
    return race_sample(weights.double().log(), seed)


def _show(s: bytes | None) -> str:
    if s is None:
        return "<control>"
    return "" if s == EOS else s.decode("utf-8", errors="replace")
