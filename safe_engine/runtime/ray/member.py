"""The driver's side of a Ray member: `RayMember` (tokenizer + actor handle) and `RemoteRow`."""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ...config import GenerationConfig
from ...errors import ConfigError, InputTypeError, MemberError
from ..members import Job, Member
from ..rows import Row

DEFAULT_MEMBER_TIMEOUT_S = 120.0  # one actor call (a forward pass over the drafted span)
MIN_TOP_K = 16  # every row brings at least this many of its best ids along


def _ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError("backend='ray' needs Ray; install it with: pip install 'langchain-safe[ray]'") from err
    return ray


# -- on the driver ----------------------------------------------------------------------------------
class Traffic:
    """Pickled payload bytes of every actor call of one member (what crosses the wire, approximately)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls = 0
            self.bytes_sent = 0
            self.bytes_received = 0
            self.max_call_bytes = 0
            self.call_s = 0.0  # driver-side wall time of the calls (send, queue, compute, answer)
            self.compute_s = 0.0  # of which the actor spent in `score` itself
            self.by_method: dict[str, dict[str, int]] = {}

    def add(self, method: str, sent: int, received: int, call_s: float = 0.0, compute_s: float = 0.0) -> None:
        with self._lock:
            self.calls += 1
            self.bytes_sent += sent
            self.bytes_received += received
            self.call_s += call_s
            self.compute_s += compute_s
            self.max_call_bytes = max(self.max_call_bytes, sent + received)
            entry = self.by_method.setdefault(method, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
            entry["calls"] += 1
            entry["bytes_sent"] += sent
            entry["bytes_received"] += received

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": self.calls,
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "bytes_total": self.bytes_sent + self.bytes_received,
                "max_call_bytes": self.max_call_bytes,
                "call_s": self.call_s,
                "compute_s": self.compute_s,
                "by_method": {k: dict(v) for k, v in self.by_method.items()},
            }


def _payload_size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class RemoteRequest:
    """Key of one request's KV cache in a member's actor; releases it when garbage collected."""

    __slots__ = ("__weakref__", "finalizer", "id", "lock", "released")

    def __init__(self, member: RayMember) -> None:
        self.id = uuid.uuid4().hex
        # `score` submits and `release` marks under this lock, so a release sent while another thread
        # is about to score (a verifier still running when a sibling failed) is never overtaken by it.
        self.lock = threading.RLock()
        self.released = False
        # Safety net for requests dropped without `release` (a thread that died, a Generation thrown
        # away): the key's finalizer queues the release, a daemon thread sends it.
        self.finalizer = weakref.finalize(self, _ORPHANS.put, (weakref.ref(member), self.id))
        self.finalizer.atexit = False

    def __repr__(self) -> str:
        return f"RemoteRequest({self.id})"


_ORPHANS: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe inside finalizers
_RELEASER: threading.Thread | None = None
_RELEASER_LOCK = threading.Lock()


def _release_orphans() -> None:
    while True:
        member_ref, request_id = _ORPHANS.get()
        member = member_ref()
        if member is not None:
            member._send_release(request_id)
        del member


def _start_releaser() -> None:
    global _RELEASER
    with _RELEASER_LOCK:
        if _RELEASER is None:
            _RELEASER = threading.Thread(target=_release_orphans, name="safe-ray-release", daemon=True)
            _RELEASER.start()


class RayMember(Member):
    """A member whose model and KV caches live in a Ray actor; only its tokenizer is on the driver.

    `device` is `"ray:<actor id>"`, distinct per actor, so the Ensemble verifies on several actors at
    once. `traffic` counts the pickled bytes of every call. A member whose actor died stays dead: every
    later call raises the same `MemberError` at once.
    """

    is_remote = True
    backend = "ray"

    def __init__(self, actor: Any, info: dict[str, Any], tokenizer: Any, timeout_s: float | None = None) -> None:
        if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise InputTypeError(f"RayMember expects a transformers tokenizer, got {type(tokenizer).__name__}")
        self._setup_tokenizer_side(
            tokenizer,
            info["name"],
            info["chat_template"],
            frozenset(info["eos_ids"]),
            info["vocab_size"],
            info["context_window"],
        )
        self.model = None  # the weights stay in the actor
        self.actor = actor
        self.actor_id: str = info["actor_id"]
        self.node_id: str | None = info.get("node_id")
        self.remote_device: str = info["device"]
        self.torch_threads: int | None = info.get("torch_threads")
        self.device = f"ray:{self.actor_id}"
        self.timeout_s = DEFAULT_MEMBER_TIMEOUT_S if timeout_s is None else timeout_s
        self.traffic = Traffic()
        self._dead: str | None = None
        _start_releaser()

    def __repr__(self) -> str:
        return f"RayMember({self.name!r}, vocab={self.vocab_size}, actor={self.actor_id}, on={self.remote_device})"

    @property
    def alive(self) -> bool:
        return self._dead is None

    # -- the member interface ---------------------------------------------------------------------------
    def new_cache(self) -> RemoteRequest:
        """A request key; the actor creates the request's KV cache at its first `score`."""
        self._check_alive()
        return RemoteRequest(self)

    def score(self, cache: RemoteRequest, start: int, ids: list[int], keep: int, config: GenerationConfig) -> list[Row]:
        return self.score_many([Job(cache, start, ids, keep, config)])[0]

    def score_many(self, jobs: Sequence[Job]) -> list[list[Row]]:
        """Every request's rows from one actor call (one packed forward in the actor)."""
        payload = []
        for job in jobs:
            config = job.scoring_config()
            payload.append(
                (
                    job.cache.id,
                    int(job.start),
                    list(job.ids),
                    int(job.keep),
                    config.sampling,
                    max(config.top_k, MIN_TOP_K),
                    2 * config.draft_length + 2,  # an overlapped chunk (<= draft_length) beside the carried one
                )
            )
        answers, _ = self._call("score_many", payload, requests=[job.cache for job in jobs])
        return [
            [RemoteRow(self, job.cache.id, call, r, *row) for r, row in enumerate(rows)]
            for job, (call, rows) in zip(jobs, answers)
        ]

    def release(self, cache: RemoteRequest) -> None:
        """Drop the request's cache in the actor (fire and forget: never blocks, never raises)."""
        with cache.lock:
            cache.released = True
            if cache.finalizer.detach() is not None:
                self._send_release(cache.id)

    def forward(self, ids: list[int], cache: Any, keep: int = 1) -> torch.Tensor:
        raise ConfigError(
            f"member {self.name!r} lives in a Ray actor; its logits never leave it (use score(), which returns rows)"
        )

    # -- remote-only helpers ----------------------------------------------------------------------------
    def open_requests(self) -> list[str]:
        """Requests holding a KV cache in the actor."""
        return self._call("open_requests")

    def ping(self, sleep_s: float = 0.0) -> str:
        return self._call("ping", sleep_s)

    def kill(self) -> None:
        """Stop the actor now (it also stops once no handle to it is left)."""
        ray = _ray()
        self._dead = self._dead or f"member {self.name!r} (Ray actor {self.actor_id}) was shut down"
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actor)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise MemberError(self._dead)

    def _send_release(self, request_id: str) -> None:
        if self._dead is not None:
            return
        try:
            self.actor.release.remote(request_id)
        except Exception:  # the actor is gone: nothing left to free
            return
        self.traffic.add("release", _payload_size(("release", (request_id,))), 0)

    def _call(self, method: str, *args: Any, requests: Sequence[RemoteRequest] = ()) -> Any:
        """One actor call with the member's timeout; Ray's failures become `MemberError`s.

        With `requests`, the call is refused once one of them was released (it would recreate its cache).
        """
        self._check_alive()
        ray = _ray()
        from ray import exceptions as rex

        started = time.perf_counter()
        try:
            with contextlib.ExitStack() as held:
                for request in requests:
                    held.enter_context(request.lock)
                    if request.released:
                        raise MemberError(f"member {self.name!r}: this request was already released (cancelled)")
                ref = getattr(self.actor, method).remote(*args)
            result = ray.get(ref, timeout=self.timeout_s)
        except rex.GetTimeoutError as err:
            raise MemberError(
                f"member {self.name!r} (Ray actor {self.actor_id}) did not answer {method} within "
                f"{self.timeout_s:g} s; raise member_timeout_s for slow models, or check the actor's node"
            ) from err
        except rex.RayActorError as err:
            self._dead = (
                f"member {self.name!r} (Ray actor {self.actor_id}) is dead: its actor died "
                f"({_first_line(err)}); the member cannot serve requests any more — rebuild the ensemble, "
                "or use one without it"
            )
            raise MemberError(self._dead) from err
        except rex.RayTaskError as err:
            cause = getattr(err, "cause", None) or err
            raise MemberError(
                f"member {self.name!r} (Ray actor {self.actor_id}) failed in {method}: "
                f"{type(cause).__name__}: {_first_line(cause)}"
            ) from err
        except rex.RayError as err:
            raise MemberError(
                f"member {self.name!r} (Ray actor {self.actor_id}) failed in {method}: {_first_line(err)}"
            ) from err
        elapsed = time.perf_counter() - started
        compute = result[-1] if method == "score_many" else 0.0
        self.traffic.add(method, _payload_size((method, args)), _payload_size(result), elapsed, compute)
        return result


def _first_line(err: BaseException) -> str:
    """The line of a Ray error that says what happened (Ray's messages run over many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("The actor is dead because"):
            return line.removeprefix("The actor is dead because ").rstrip(".")
    return lines[0] if lines else type(err).__name__


class RemoteRow:
    """One next-token distribution held in a member's actor, answered mostly from cached values."""

    __slots__ = ("_argmax", "_call", "_known", "_member", "_request", "_row", "_top")

    def __init__(
        self,
        member: RayMember,
        request: str,
        call: int,
        row: int,
        top_ids: list[int],
        top_logprobs: list[float],
        argmax: int,
        known: dict[int, float],
    ) -> None:
        self._member = member
        self._request = request
        self._call = call
        self._row = row
        self._top = top_ids
        self._argmax = argmax
        self._known = dict(zip(top_ids, top_logprobs))
        self._known.update(known)

    def _where(self) -> tuple[str, int, int]:
        return self._request, self._call, self._row

    def logprob(self, ids: Sequence[int]) -> torch.Tensor:
        ids = [int(i) for i in ids]
        missing = [i for i in dict.fromkeys(ids) if i not in self._known]
        if missing:
            values = self._member._call("row_logprobs", *self._where(), missing)
            self._known.update(zip(missing, values))
        return torch.tensor([self._known[i] for i in ids], dtype=torch.float32)

    def argmax(self) -> int:
        return self._argmax

    def top(self, k: int) -> list[int]:
        if k > len(self._top) and len(self._top) < self._member.vocab_size:
            ids, values = self._member._call("topk", *self._where(), int(k))
            self._top = ids
            self._known.update(zip(ids, values))
        return self._top[:k]

    def sample(self, seed: int) -> int:
        tok, value = self._member._call("sample", *self._where(), seed)
        self._known[tok] = value
        return tok

    def full(self) -> torch.Tensor:
        raise ConfigError(
            f"member {self._member.name!r} lives in a Ray actor and only small answers cross the wire, but "
            "GaC needs every member's full distribution (it is local-only); use aggregation='unite' with Ray members"
        )


# -- loading ----------------------------------------------------------------------------------------
