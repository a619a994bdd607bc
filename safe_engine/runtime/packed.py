"""Many requests in one forward pass: packed inputs and per-request key/value pools.

The requests of a batch have different lengths, and SAFE rolls each one back by a different number of
tokens every round. So instead of a padded cache, every request keeps its own `KVPool` (keys and values per
layer, grown by doubling); a forward packs all requests' new tokens into one `[1, ΣT]` input with each
request's own `position_ids`, and the attention function registered here (through transformers'
`AttentionInterface`) writes each segment's keys/values into its pool and runs transformers' own SDPA
attention over that segment alone. Rolling a request back is setting its pool's length: nothing is copied.

Outside a packed forward the registered function is plain SDPA, so the model keeps working as usual
(`model.generate`, other code holding the same model).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "safe_packed"


class KVPool:
    """One request's keys and values in every layer of one model; `length` positions are valid."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store [kv_heads, T, d] at positions start..start+T; return the keys/values up to there."""
        end = start + keys.shape[1]
        stored = self.keys.get(layer)
        if stored is None or stored.shape[1] < end:
            capacity = max(256, 2 * end)
            grown_k = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            grown_v = values.new_empty(values.shape[0], capacity, values.shape[2])
            if stored is not None:
                grown_k[:, :start] = stored[:, :start]
                grown_v[:, :start] = self.values[layer][:, :start]
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.keys[layer][:, start:end] = keys
        self.values[layer][:, start:end] = values
        return self.keys[layer][:, :end], self.values[layer][:, :end]


@dataclass
class Segment:
    """One request's slice of a packed forward."""

    pool: KVPool
    past: int  # positions already in the pool (the crop point)
    size: int  # new tokens of this request


@dataclass
class Packing:
    segments: list[Segment]


_PACKING: ContextVar[Packing | None] = ContextVar("safe_packing", default=None)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed forward: each segment against its own pool (plain SDPA outside one)."""
    packing = _PACKING.get()
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = cast(int, module.layer_idx)  # transformers sets it on every attention module
    outputs = []
    offset = 0
    for seg in packing.segments:
        span = slice(offset, offset + seg.size)
        offset += seg.size
        keys, values = seg.pool.write(layer, seg.past, key[0, :, span], value[0, :, span])
        mask = _mask(seg.past, seg.size, sliding_window, query.device)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, span],
            keys[None],
            values[None],
            mask,
            dropout,
            scaling,
            is_causal=mask is None and seg.size > 1,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _mask(past: int, size: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [1, 1, size, past + size] mask: causal from `past` on, within `window` if given.

    None where SDPA needs none: a single query sees everything before it (unless the window cuts it), and
    a prompt from position 0 is plain causal attention."""
    total = past + size
    if (window is None or total <= window) and (size == 1 or past == 0):
        return None
    q = torch.arange(past, total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed[None, None]


def packed_mask(*args, **kwargs):
    """No mask is built for a packed forward (each segment makes its own); SDPA's otherwise."""
    if _PACKING.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_mask)


def supports_packing(model: torch.nn.Module) -> bool:
    """Models whose attention goes through transformers' attention interface (Llama, Qwen2, Gemma 3, GPT-2…)."""
    return bool(getattr(model, "_supports_attention_backend", False)) and getattr(model.config, "is_decoder", True)


def use_packing(model: PreTrainedModel) -> None:
    model.set_attn_implementation(NAME)


@torch.inference_mode()
def packed_forward(
    model: torch.nn.Module, jobs: Sequence[tuple[KVPool, int, Sequence[int], int]], device: torch.device
) -> list[torch.Tensor]:
    """One forward over several requests: each job is (pool, start, ids, keep); the pool is cropped to
    `start`, the ids appended. Returns each job's float32 logits of its last `keep` positions."""
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    segments = []
    for pool, start, job_ids, job_keep in jobs:
        pool.crop(start)
        base = len(ids)
        ids.extend(job_ids)
        positions.extend(range(pool.length, pool.length + len(job_ids)))
        keep.extend(range(base + len(job_ids) - job_keep, base + len(job_ids)))
        segments.append(Segment(pool, pool.length, len(job_ids)))
    token = _PACKING.set(Packing(segments))
    try:
        out = model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, device=device),
        )
    finally:
        _PACKING.reset(token)
    for seg in segments:
        seg.pool.length = seg.past + seg.size
    logits = out.logits[0].float()
    rows, start = [], 0
    for _, _, _, job_keep in jobs:
        rows.append(logits[start : start + job_keep])
        start += job_keep
    return rows
