"""The ensemble as one request's decoding sees it, and what such a request may not ask of Ray members."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import Strategy
from ..errors import ConfigError
from ..runtime.members import Member
from ..runtime.placement import Placement
from ..shaping.request import Request
from .aggregation import UnionVocab


class Gauge(Protocol):
    """The engine's schedule gauge (`engine.gauge.ScheduleGauge`), as a request's rounds use it: which schedule
    to run, the overlap chunk, and each round's timing."""

    chunk: int

    def choose(self) -> str: ...

    def record(self, schedule: str, seconds: float, tokens: int) -> None: ...

    def record_chunk(self, ratio: float, limit: int) -> None: ...


@dataclass
class Lineup:
    """The ensemble as one request's decoding sees it: the members, their names and weights, the drafter's
    index, and what the ensemble's requests share (a thread pool for forwards of different members at once,
    the overlap gauge, GaC's union vocabulary, built on first use)."""

    members: Sequence[Member]
    names: Sequence[str]
    drafter: int
    weights: torch.Tensor
    executor: Executor | None = None  # runs forwards of different members at once (overlap, devices)
    parallel_members: bool = False  # the verifiers sit on different devices: score them concurrently
    schedule_gauge: Gauge | None = None  # given when a free core or device exists (schedule="auto")
    union: Callable[[], UnionVocab] | None = None  # GaC's union vocabulary of the members
    placement: Placement | None = None  # threads per kind of forward, for members on the CPU

    def check(self, request: Request, strategy: Strategy, active: Sequence[int]) -> None:
        """Refuse, before any forward, what needs a member's logits where they never leave its Ray actor."""
        members, config = self.members, request.config
        remote_drafter = getattr(members[self.drafter], "is_remote", False)
        if strategy.full_vocabulary and any(getattr(members[i], "is_remote", False) for i in active):
            raise ConfigError(
                "aggregation='gac' needs every member's full next-token distribution, which never leaves a Ray "
                "actor (GaC is local-only); use aggregation='unite' with Ray members"
            )
        if request.grammar is not None and remote_drafter:
            raise ConfigError(
                "constrained output (tools, json_schema) masks the drafter's logits, which stay in its Ray "
                "actor; use a local drafter"
            )
        remote = [self.names[i] for i in active if getattr(members[i], "is_remote", False)]
        if remote and config.penalized:
            raise ConfigError(
                f"penalties are applied to each member's logits, which stay in its Ray actor ({', '.join(remote)}); "
                "use local members, or leave frequency_penalty / presence_penalty at 0 and repetition_penalty at 1"
            )
        if config.logit_bias and remote_drafter:
            raise ConfigError(
                "logit_bias is added to the drafter's logits, which stay in its Ray actor; use a local drafter"
            )
