"""Members that live in Ray actors: the decoder talks to them as to local members.

SAFE exchanges only small things between members: the token ids a member has to read, and each
member's answers about its next-token distributions (top-k ids and log-probabilities, argmax, the
log-probability of a few ids, a sample). So a member's weights and KV caches can stay in a Ray actor on
any node or GPU while tokenization, byte alignment and aggregation run on the driver, which holds only
the member's tokenizer.

- `MemberActor` runs inside the actor: it loads the model with `load_member` on the actor's node and
  keeps one KV cache per request, plus the processed log-probability rows of the request's last few
  `score` calls, so later questions about a row need no recomputation.
- `RayMember(Member)` is the driver's stand-in: the tokenizer side of a `Member` (vocab, EOS ids, byte
  spelling, chat template) plus an actor handle. `new_cache()` returns a `RemoteRequest` key, `score()`
  is one actor call returning `RemoteRow`s, `release()` drops the request's state in the actor.
- `RemoteRow` answers the `Row` protocol from the values `score` returned (top-K with K >= 16, argmax,
  the next fed token, EOS ids) and asks the actor only for ids it does not know yet.

Full-vocabulary tensors never cross the wire, so GaC (which needs every member's whole distribution)
is local-only; `Ensemble` refuses `aggregation="gac"` with remote members before decoding starts.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import queue
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .config import GenerationConfig
from .errors import ConfigError, InputTypeError, MemberError, ModelLoadError
from .members import Member, ModelSpec, load_member, resolve_spec
from .rows import Row

__all__ = [
    "DEFAULT_LOAD_TIMEOUT_S",
    "DEFAULT_MEMBER_TIMEOUT_S",
    "MIN_TOP_K",
    "MemberActor",
    "PendingRayMembers",
    "RayMember",
    "RemoteRequest",
    "RemoteRow",
    "Traffic",
    "load_ray_members",
    "resolve_backends",
    "start_ray_members",
]

DEFAULT_MEMBER_TIMEOUT_S = 120.0  # one actor call (a forward pass over the drafted span)
DEFAULT_LOAD_TIMEOUT_S = 3600.0  # scheduling the actor + downloading and loading the weights
MIN_TOP_K = 16  # every row brings at least this many of its best ids along
BACKENDS = ("local", "ray")


def _ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError("backend='ray' needs Ray; install it with: pip install 'langchain-safe[ray]'") from err
    return ray


# -- inside the actor -------------------------------------------------------------------------------
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
    def score(
        self,
        request: str,
        start: int,
        ids: list[int],
        keep: int,
        sampling: tuple[bool, float, float],
        top_k: int,
        retain: int,
    ) -> tuple[int, list[tuple[list[int], list[float], int, dict[int, float]]], float]:
        """`Member.score` on this request's cache; per kept row: top-k ids + log-probs, argmax, and the
        log-probabilities of the EOS ids and of the next fed token (where one exists). Also the seconds
        this took in the actor, so the driver can tell compute from transport."""
        started = time.perf_counter()
        member = self._member()
        req = self.requests.get(request)
        if req is None:
            req = self.requests[request] = _Request(member.new_cache())
        do_sample, temperature, top_p = sampling
        config = SimpleNamespace(do_sample=do_sample, temperature=temperature, top_p=top_p)
        rows = member.score(req.cache, start, ids, keep, config)  # same numerics as a local member
        values = torch.stack([r.values for r in rows]) if rows else torch.empty(0, member.vocab_size)
        call = next(self._calls)
        req.calls.append((call, values))
        while len(req.calls) > max(retain, 1):
            req.calls.popleft()
        top = torch.topk(values, min(top_k, values.shape[-1]), dim=-1)
        argmax = torch.argmax(values, dim=-1).tolist()
        eos = [i for i in member.eos_ids if i < values.shape[-1]]
        out = []
        for r in range(values.shape[0]):
            known = eos + ([ids[len(ids) - keep + r + 1]] if r < keep - 1 else [])
            known_lp = values[r, known].tolist()
            out.append((top.indices[r].tolist(), top.values[r].tolist(), argmax[r], dict(zip(known, known_lp))))
        return call, out, time.perf_counter() - started

    def row_logprobs(self, request: str, call: int, row: int, ids: list[int]) -> list[float]:
        return self._row(request, call, row)[ids].tolist()

    def topk(self, request: str, call: int, row: int, k: int) -> tuple[list[int], list[float]]:
        values = self._row(request, call, row)
        top = torch.topk(values, min(k, values.shape[0]))
        return top.indices.tolist(), top.values.tolist()

    def sample(self, request: str, call: int, row: int, seed: int) -> tuple[int, float]:
        values = self._row(request, call, row)
        generator = torch.Generator().manual_seed(seed)
        tok = int(torch.multinomial(values.exp(), 1, generator=generator))
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
            "(the request was released, or rows older than draft_length + 1 forward calls were asked for)"
        )


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
        sampling = (bool(config.do_sample), float(config.temperature), float(config.top_p))
        call, rows, _ = self._call(
            "score", cache.id, int(start), list(ids), int(keep), sampling, max(config.top_k, MIN_TOP_K),
            config.draft_length + 1, request=cache,
        )  # fmt: skip
        return [RemoteRow(self, cache.id, call, r, *row) for r, row in enumerate(rows)]

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

    def _call(self, method: str, *args: Any, request: RemoteRequest | None = None) -> Any:
        """One actor call with the member's timeout; Ray's failures become `MemberError`s.

        With `request`, the call is refused once the request was released (it would recreate its cache).
        """
        self._check_alive()
        ray = _ray()
        from ray import exceptions as rex

        started = time.perf_counter()
        try:
            if request is None:
                ref = getattr(self.actor, method).remote(*args)
            else:
                with request.lock:
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
        compute = result[-1] if method == "score" else 0.0
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

    def sample(self, generator: torch.Generator) -> int:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        tok, value = self._member._call("sample", *self._where(), seed)
        self._known[tok] = value
        return tok

    def full(self) -> torch.Tensor:
        raise ConfigError(
            f"member {self._member.name!r} lives in a Ray actor and only small answers cross the wire, but "
            "GaC needs every member's full distribution (it is local-only); use aggregation='unite' with Ray members"
        )


# -- loading ----------------------------------------------------------------------------------------
def resolve_backends(backend: str | Sequence[str], n: int) -> list[str]:
    """One backend per member: "local" or "ray", for all members or as a list."""
    if isinstance(backend, str):
        backends = [backend] * n
    elif isinstance(backend, Sequence):
        backends = list(backend)
        if len(backends) != n:
            raise ConfigError(f"backend lists {len(backends)} entries for {n} members")
    else:
        raise ConfigError(f"backend must be 'local', 'ray' or a list of them, got {backend!r}")
    for b in backends:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend {b!r}; use 'local' or 'ray' (or a list with one per member)")
    return backends


def _resources(member_resources: dict | Sequence[dict | None] | None, n: int) -> list[dict[str, Any]]:
    if member_resources is None:
        return [{} for _ in range(n)]
    if isinstance(member_resources, dict):
        return [dict(member_resources) for _ in range(n)]
    if isinstance(member_resources, Sequence) and not isinstance(member_resources, str):
        entries = list(member_resources)
        if len(entries) != n or not all(e is None or isinstance(e, dict) for e in entries):
            raise ConfigError(
                f"member_resources must be one dict for every member or a list of {n} dicts (one per member), "
                f"got {member_resources!r}"
            )
        return [dict(e or {}) for e in entries]
    raise ConfigError(
        f"member_resources must be a dict or a list of dicts, e.g. {{'num_gpus': 1}}, got {member_resources!r}"
    )


_ACTOR_CLASS: Any = None


def _actor_class() -> Any:
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = _ray().remote(MemberActor)
    return _ACTOR_CLASS


def ensure_ray(address: str | None = None) -> None:
    """Connect to `address` ("auto": the cluster this node belongs to) or start a local Ray, once."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address)


class PendingRayMembers:
    """Member actors that are loading; `wait()` returns the `RayMember`s (or raises, killing them all)."""

    def __init__(self, actors: list[Any], refs: list[Any], specs: list[ModelSpec], timeout_s: float, load_timeout_s):
        self._actors = actors
        self._refs = refs
        self._specs = specs
        self._timeout_s = timeout_s
        self._load_timeout_s = load_timeout_s

    def wait(self, trust_remote_code: bool = False) -> list[RayMember]:
        ray = _ray()
        from ray import exceptions as rex

        members = []
        try:
            for actor, ref, spec in zip(self._actors, self._refs, self._specs):
                try:
                    info = ray.get(ref, timeout=self._load_timeout_s)
                except rex.GetTimeoutError as err:
                    raise ModelLoadError(
                        f"member {spec.path!r} did not load within {self._load_timeout_s:g} s; its actor may be "
                        "waiting for resources no node has (check member_resources against `ray status`)"
                    ) from err
                except rex.RayTaskError as err:
                    cause = getattr(err, "cause", None) or err
                    if isinstance(cause, ModelLoadError | ConfigError):
                        raise type(cause)(f"{cause} (in its Ray actor)") from err
                    raise ModelLoadError(
                        f"could not load member {spec.path!r} in its Ray actor: {type(cause).__name__}: {cause}"
                    ) from err
                except rex.RayError as err:
                    raise ModelLoadError(f"the Ray actor of member {spec.path!r} failed: {_first_line(err)}") from err
                members.append(RayMember(actor, info, _driver_tokenizer(info, trust_remote_code), self._timeout_s))
        except BaseException:
            self.cancel()
            raise
        return members

    def cancel(self) -> None:
        ray = _ray()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _driver_tokenizer(info: dict[str, Any], trust_remote_code: bool) -> Any:
    """The member's tokenizer, rebuilt on the driver from the files its actor loaded (so the driver
    needs neither the weights nor access to the model's source)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in info["tokenizer_files"].items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, trust_remote_code=trust_remote_code)


def start_ray_members(
    specs: Sequence[str | ModelSpec],
    *,
    devices: Sequence[str | None] | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    member_resources: dict | Sequence[dict | None] | None = None,
    ray_address: str | None = None,
    member_timeout_s: float | None = None,
    load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
) -> PendingRayMembers:
    """Start one actor per spec; they load in parallel (on their own nodes) while the caller goes on."""
    specs = [resolve_spec(s) for s in specs]
    devices = list(devices) if devices is not None else [None] * len(specs)
    resources = _resources(member_resources, len(specs))
    if member_timeout_s is not None and not (isinstance(member_timeout_s, int | float) and member_timeout_s > 0):
        raise ConfigError(f"member_timeout_s must be a positive number of seconds, got {member_timeout_s!r}")
    ray = _ray()
    ensure_ray(ray_address)
    remote_cls = _actor_class()
    actors: list[Any] = []
    try:
        for res in resources:
            actors.append(remote_cls.options(max_restarts=0, max_task_retries=0, **res).remote())
    except (TypeError, ValueError) as err:
        for actor in actors:
            ray.kill(actor)
        raise ConfigError(f"invalid member_resources {resources!r}: {err}") from err
    refs = [a.load.remote(spec, dev, dtype, trust_remote_code) for a, spec, dev in zip(actors, specs, devices)]
    return PendingRayMembers(actors, refs, specs, member_timeout_s, load_timeout_s)


def load_ray_members(
    specs: Sequence[str | ModelSpec],
    *,
    devices: Sequence[str | None] | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    member_resources: dict | Sequence[dict | None] | None = None,
    ray_address: str | None = None,
    member_timeout_s: float | None = None,
    load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
) -> list[RayMember]:
    """Load each spec in its own Ray actor; returns the driver-side `RayMember`s."""
    pending = start_ray_members(
        specs,
        devices=devices,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        member_resources=member_resources,
        ray_address=ray_address,
        member_timeout_s=member_timeout_s,
        load_timeout_s=load_timeout_s,
    )
    return pending.wait(trust_remote_code)
