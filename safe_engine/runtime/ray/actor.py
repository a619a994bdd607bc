"""What runs inside a member's Ray actor: the member itself, one KV cache per request, recent rows."""

from __future__ import annotations

import functools
import itertools
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from ...config import GenerationConfig, SamplingParams
from ..members import Job, Member, ModelSpec, load_member
from ..rows import race_sample


# -- inside the actor -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _scoring_config(sampling: SamplingParams) -> GenerationConfig:
    """A job's config as the local member's `score_many` reads it here: the request's sampling (a Ray
    member refuses penalties and logit bias, so nothing else of the request's config reaches the actor)."""
    return GenerationConfig(do_sample=sampling.do_sample, temperature=sampling.temperature, top_p=sampling.top_p)


class _Request:
    __slots__ = ("cache", "calls")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.calls: deque[tuple[int, torch.Tensor]] = deque()  # (call id, [keep, V] log-probs)


class MemberActor:
    """One member inside a Ray actor (wrapped with `ray.remote` at launch; plain class for clarity).

    The actor runs one call at a time, so per-request state needs no locks. A request's state is
    created at its first `score` and lives until `release`.
    """

    def __init__(self) -> None:
        self.member: Member | None = None
        self.requests: dict[str, _Request] = {}
        self._calls = itertools.count(1)

    # -- setup --------------------------------------------------------------------------------------
    def load(self, spec: ModelSpec, device: str | None, dtype: Any, trust_remote_code: bool) -> dict[str, Any]:
        """Load the member on this node; return what the driver needs to build its `RayMember`."""
        import ray

        if device is None and spec.device is None:
            gpus = ray.get_gpu_ids() if torch.cuda.is_available() else []
            device = "cpu" if not gpus else "cuda:0" if len(gpus) == 1 else "auto"
            if device == "auto" and dtype is None and spec.dtype is None:
                dtype = torch.bfloat16
        member = load_member(spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        self.member = member
        with tempfile.TemporaryDirectory() as tmp:
            member.tokenizer.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
        context = ray.get_runtime_context()
        return {
            "name": member.name,
            "chat_template": member.chat_template,
            "eos_ids": sorted(member.eos_ids),
            "vocab_size": int(member.vocab_size),
            "context_window": member.context_window,
            "device": str(member.device),
            "actor_id": context.get_actor_id(),
            "node_id": context.get_node_id(),
            "torch_threads": torch.get_num_threads(),
            "tokenizer_files": files,
        }

    # -- per request --------------------------------------------------------------------------------
    def score_many(
        self, jobs: list[tuple[str, int, list[int], int, SamplingParams, int, int]]
    ) -> tuple[list[tuple[int, list[tuple[list[int], list[float], int, dict[int, float]]]]], float]:
        """`Member.score_many` over several requests' caches in one forward. A job is (request, start, ids,
        keep, sampling, top_k, retain); per job: its call id and, per kept row, top-k ids + log-probs, argmax,
        and the log-probabilities of the EOS ids and of the next fed token (where one exists). Also the
        seconds this took in the actor, so the driver can tell compute from transport."""
        started = time.perf_counter()
        member = self._member()
        work = []
        for request, start, ids, keep, sampling, _, _ in jobs:
            req = self.requests.get(request)
            if req is None:
                req = self.requests[request] = _Request(member.new_cache())
            work.append(Job(req.cache, start, ids, keep, _scoring_config(sampling)))
        answers = []
        for (request, _, ids, keep, _, top_k, retain), rows in zip(jobs, member.score_many(work)):
            answers.append(self._answer(self.requests[request], ids, keep, top_k, retain, rows))
        return answers, time.perf_counter() - started

    def _answer(self, req: _Request, ids: list[int], keep: int, top_k: int, retain: int, rows: list) -> tuple:
        member = self._member()
        argmax = [r.argmax() for r in rows]
        values = torch.stack([r.values for r in rows]) if rows else torch.empty(0, member.vocab_size)
        call = next(self._calls)
        req.calls.append((call, values))
        while len(req.calls) > max(retain, 1):
            req.calls.popleft()
        top = torch.topk(values, min(top_k, values.shape[-1]), dim=-1)
        eos = [i for i in member.eos_ids if i < values.shape[-1]]
        out = []
        for r in range(values.shape[0]):
            known = eos + ([ids[len(ids) - keep + r + 1]] if r < keep - 1 else [])
            known_lp = values[r, known].tolist()
            out.append((top.indices[r].tolist(), top.values[r].tolist(), argmax[r], dict(zip(known, known_lp))))
        return call, out

    def row_logprobs(self, request: str, call: int, row: int, ids: list[int]) -> list[float]:
        return self._row(request, call, row)[ids].tolist()

    def topk(self, request: str, call: int, row: int, k: int) -> tuple[list[int], list[float]]:
        values = self._row(request, call, row)
        top = torch.topk(values, min(k, values.shape[0]))
        return top.indices.tolist(), top.values.tolist()

    def sample(self, request: str, call: int, row: int, seed: int) -> tuple[int, float]:
        values = self._row(request, call, row)
        tok = race_sample(values, seed)  # the seed comes from the request's Draws on the driver
        return tok, float(values[tok])

    def release(self, request: str) -> None:
        self.requests.pop(request, None)

    def open_requests(self) -> list[str]:
        """Requests that hold a KV cache here (empty once every request finished or was abandoned)."""
        return sorted(self.requests)

    def ping(self, sleep_s: float = 0.0) -> str:
        if sleep_s > 0:
            time.sleep(sleep_s)
        return "pong"

    # -- helpers ------------------------------------------------------------------------------------
    def _member(self) -> Member:
        if self.member is None:
            raise RuntimeError("this member actor has not loaded a model yet")
        return self.member

    def _row(self, request: str, call: int, row: int) -> torch.Tensor:
        req = self.requests.get(request)
        for c, values in req.calls if req is not None else ():
            if c == call:
                return values[row]
        raise LookupError(
            f"request {request}: the distributions of call {call} are no longer held "
            "(the request was released, or rows older than 2 * draft_length + 2 forward calls were asked for)"
        )
