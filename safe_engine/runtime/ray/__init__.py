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

Layout: `actor` (what runs in the actor), `member` (the driver's stand-ins: `RayMember`, `RemoteRow`),
`launch` (starting actors and loading members into them).
"""

from .actor import MemberActor
from .launch import (
    BACKENDS,
    DEFAULT_LOAD_TIMEOUT_S,
    PendingRayMembers,
    load_ray_members,
    resolve_backends,
    start_ray_members,
)
from .member import DEFAULT_MEMBER_TIMEOUT_S, MIN_TOP_K, RayMember, RemoteRequest, RemoteRow, Traffic

__all__ = [
    "BACKENDS",
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
