"""Starting member actors on a Ray cluster and turning them into `RayMember`s."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError, ModelLoadError
from ..members import ModelSpec, resolve_spec
from .actor import MemberActor
from .member import RayMember, _first_line, _ray

DEFAULT_LOAD_TIMEOUT_S = 3600.0  # scheduling the actor + downloading and loading the weights
BACKENDS = ("auto", "torch", "llama.cpp", "ray", "local")  # "local": "auto" in this process (its old name)


def resolve_backends(backend: str | Sequence[str], n: int) -> list[str]:
    """One backend per member, for all members or as a list: "auto" (llama.cpp for a GGUF source on the CPU
    when llama-cpp-python is installed, else torch), "torch", "llama.cpp" or "ray"."""
    if isinstance(backend, str):
        backends = [backend] * n
    elif isinstance(backend, Sequence):
        backends = list(backend)
        if len(backends) != n:
            raise ConfigError(f"backend lists {len(backends)} entries for {n} members")
    else:
        raise ConfigError(f"backend must be one of {BACKENDS[:4]} or a list of them, got {backend!r}")
    for b in backends:
        if b not in BACKENDS:
            raise ConfigError(
                f"unknown backend {b!r}; use 'auto', 'torch', 'llama.cpp' or 'ray' (or a list with one per member)"
            )
    return ["auto" if b == "local" else b for b in backends]


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

    def __init__(
        self,
        actors: list[Any],
        refs: list[Any],
        specs: list[ModelSpec],
        timeout_s: float | None,
        load_timeout_s: float | None,
    ) -> None:
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
    resolved = [resolve_spec(s) for s in specs]
    devices = list(devices) if devices is not None else [None] * len(resolved)
    resources = _resources(member_resources, len(resolved))
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
    refs = [a.load.remote(spec, dev, dtype, trust_remote_code) for a, spec, dev in zip(actors, resolved, devices)]
    return PendingRayMembers(actors, refs, resolved, member_timeout_s, load_timeout_s)


def load_ray_members(
    specs: Sequence[str | ModelSpec], *, trust_remote_code: bool = False, **options: Any
) -> list[RayMember]:
    """Load each spec in its own Ray actor and wait; returns the driver-side `RayMember`s. `options` are
    `start_ray_members`' keywords (devices, dtype, member_resources, ray_address, the timeouts)."""
    pending = start_ray_members(specs, trust_remote_code=trust_remote_code, **options)
    return pending.wait(trust_remote_code)
