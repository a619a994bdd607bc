"""Members: a causal LM with its own tokenizer, and how to load one from a spec.

A `Member` is shared by every request of an `Ensemble`, so it holds only what never changes: model,
tokenizer, byte-level vocabulary. Per-request state (token ids, KV cache) lives in a `Track`.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..config import GenerationConfig
from ..errors import ConfigError, InputTypeError, ModelLoadError
from . import demo_models
from .packed import KVPool, packed_forward, supports_packing, use_packing
from .penalties import penalize
from .quantization import check_quantization, loading_config, quantize_int8
from .rows import LocalRow, Row
from .threads import on_short_lived_thread
from .vocab import Vocab, tokenizer_lock


@dataclass(frozen=True)
class ModelSpec:
    """Where a member comes from and how to place it.

    `path` is a hub id, a local directory, a `.gguf` file or a demo model name
    (see `safe_engine.runtime.demo_models`). `chat_template` overrides the tokenizer's template, so base models
    or models with a broken template can still join a chat ensemble. `quantization="int8"` loads the member
    with int8 linear layers (`safe_engine.runtime.quantization`); a transformers quantization config object is
    passed to `from_pretrained` as is. `backend` chooses where the member runs: "torch", "llama.cpp" (a GGUF
    source decoded by llama.cpp, see `safe_engine.runtime.llamacpp`), "ray", or None / "auto" for the
    ensemble's choice (a GGUF source on the CPU runs in llama.cpp when llama-cpp-python is installed).
    """

    path: str
    gguf_file: str | None = None
    device: str | None = None
    dtype: str | None = None
    name: str | None = None
    chat_template: str | None = None
    quantization: Any = None
    backend: str | None = None


class Member:
    """One model of the ensemble: model + tokenizer + the byte view of its vocabulary."""

    backend = "torch"  # where its forwards run: "torch" here, "llama.cpp" / "ray" for the other runtimes
    # KV positions that all of this member's requests share (a llama.cpp context), which the scheduler admits
    # requests against; None: each request's cache grows on its own
    positions: int | None = None

    def __init__(self, model: Any, tokenizer: Any, name: str | None = None, chat_template: str | None = None):
        if not callable(getattr(model, "forward", None)) or not hasattr(model, "config"):
            raise InputTypeError(f"Member expects a transformers causal LM, got {type(model).__name__}")
        if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise InputTypeError(f"Member expects a transformers tokenizer, got {type(tokenizer).__name__}")
        self.model = model.eval()
        self._setup_tokenizer_side(
            tokenizer,
            name or getattr(model.config, "_name_or_path", None) or type(model).__name__,
            chat_template,
            _eos_ids(model, tokenizer),
            _output_size(model.get_output_embeddings()),
            _context_window(model.config),
        )
        self.device = next(itertools.chain(model.parameters(), model.buffers())).device  # int8 layers: buffers
        self.packed = supports_packing(model)  # many requests per forward, each with its own KV pool
        if self.packed:
            use_packing(model)

    def _setup_tokenizer_side(
        self,
        tokenizer: Any,
        name: str,
        chat_template: str | None,
        eos_ids: frozenset[int],
        vocab_size: int,
        context_window: int | None,
    ) -> None:
        """Everything the decoder reads besides the model (shared with members that live elsewhere)."""
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.vocab = Vocab(tokenizer)
        self.eos_ids = eos_ids
        if not self.eos_ids:
            raise ConfigError(
                f"member {self.name!r}: its tokenizer has no EOS token, so generation could never end "
                "naturally; set tokenizer.eos_token (or model.generation_config.eos_token_id)"
            )
        self.vocab_size = vocab_size
        # Ids the model can emit but the tokenizer does not define have no text.
        self.token_bytes = self.vocab.token_bytes + [None] * max(0, self.vocab_size - self.vocab.size)
        self.context_window = context_window

    def __repr__(self) -> str:
        return f"Member({self.name!r}, vocab={self.vocab_size}, device={self.device})"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (parameters and buffers: int8 layers keep theirs as buffers), which a
        decoding step reads once each: what its time follows on a memory-bound CPU."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- text -> ids --------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> list[int]:
        """Ids of a raw prompt: the tokenizer's own special prefix (BOS) + the text, control strings as text."""
        with tokenizer_lock(self.tokenizer):
            ids = self.tokenizer(prompt, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        return list(ids)

    # -- forward ------------------------------------------------------------------------------------
    def new_cache(self) -> object:
        """A request's cache that can be cropped later: a packed pool where the model supports one (see
        `packed`), else a DynamicCache with sliding-window layers recorded. Callers treat it as opaque (a
        remote member returns a key instead) and only hand it back to `score`, `forward` and `release`."""
        if self.packed:
            return KVPool()
        cache = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            cache.activate_past_recording()
        return cache

    def score(self, cache: Any, start: int, ids: list[int], keep: int, config: GenerationConfig) -> list[Row]:
        """Crop the cache to `start` positions, append `ids`, and return the next-token distributions
        after each of the last `keep` positions. (A remote member implements the same call.)"""
        return self.score_many([Job(cache, start, ids, keep, config)])[0]

    def score_many(self, jobs: Sequence[Job]) -> list[list[Row]]:
        """`score` for several requests in one forward pass (one per request without packing).

        The logits stay on the member's device; a row is normalised there when the decoder first reads it.
        """
        logits = self.forward_many(jobs)
        out: list[list[Row]] = []
        for job, rows in zip(jobs, logits):
            config = job.scoring_config()
            if job.history is not None:  # penalties / a logit bias: each row with the counts before it
                rows = penalize(
                    rows,
                    job.history,
                    job.prompt_len,
                    config.frequency_penalty,
                    config.presence_penalty,
                    config.repetition_penalty,
                    job.logit_bias,
                )
            out.append([LocalRow(row, config.sampling) for row in rows])
        return out

    def forward_many(self, jobs: Sequence[Job]) -> list[torch.Tensor]:
        """Each job's float32 logits of its last `keep` positions, after cropping its cache to `start`."""
        if self.packed:
            return packed_forward(self.model, [(j.cache, j.start, j.ids, j.keep) for j in jobs], self.device)
        out = []
        for job in jobs:
            crop_cache(job.cache, job.start)
            out.append(self.forward(job.ids, job.cache, job.keep))
        return out

    def release(self, cache: Any) -> None:
        """Forget a request's cache (local caches are simply garbage collected)."""

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: Any, keep: int = 1) -> torch.Tensor:
        """Logits (float32) of the last `keep` of `ids`, appended to what `cache` already holds."""
        if isinstance(cache, KVPool):
            return self.forward_many([Job(cache, cache.length, ids, keep, None)])[0]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()


@dataclass
class Job:
    """One request's part of a forward pass: crop `cache` to `start`, feed `ids`, keep the last `keep` rows."""

    cache: Any
    start: int
    ids: list[int]
    keep: int
    config: GenerationConfig | None  # the request's sampling settings (and, for Ray members, its top-k)
    # With penalties or a logit bias: the track's ids (prompt + generated) up to the last fed id, the prompt's
    # length, and the bias (the drafter's); None: the logits are used as they are (the default, at no cost).
    history: tuple[int, ...] | None = None
    prompt_len: int = 0
    logit_bias: dict[int, float] | None = None

    def scoring_config(self) -> GenerationConfig:
        """`config`, which every scored job carries (only `Member.forward`'s bare forward runs without one)."""
        if self.config is None:
            raise InputTypeError("a scored Job needs its request's GenerationConfig; config=None is for a bare forward")
        return self.config


class Track:
    """One member's state for one request: its ids (prompt + generated text) and its KV cache."""

    def __init__(self, member: Member, prompt_ids: list[int], name: str) -> None:
        self.member = member
        self.name = name
        self.prompt_len = len(prompt_ids)
        self.ids = list(prompt_ids)
        self.cache: object | None = member.new_cache()
        self.cached = 0  # leading ids whose keys/values are in the cache
        self.passes = 0
        # A verifier's tokens of the generated text that no later text can change (alignment.Verification):
        self.frozen_ids = 0  # how many generated ids
        self.frozen_bytes = 0  # how many bytes of the generated text they spell
        self.logit_bias: dict[int, float] | None = None  # the request's logit bias (set on the drafter's track)

    @property
    def full(self) -> bool:
        """Whether scoring more would run the model past its context window."""
        window = self.member.context_window
        return window is not None and len(self.ids) >= window

    def job(self, config: GenerationConfig, rows_from: int | None = None) -> tuple[Job, int]:
        """The forward that feeds the ids the cache lacks, with distributions after positions `rows_from`..
        (default: the last one); the cache is cropped to `rows_from` first when those were cached already.
        Returns the job and the position of its first row. Call `done` once it ran."""
        last = len(self.ids) - 1
        rows_from = last if rows_from is None else max(0, min(rows_from, last))
        start = min(rows_from, self.cached)
        job = Job(self.cache, start, self.ids[start:], len(self.ids) - rows_from, config)
        if config.penalized or self.logit_bias:
            job.history, job.prompt_len, job.logit_bias = tuple(self.ids), self.prompt_len, self.logit_bias
        return job, rows_from

    def done(self) -> None:
        self.cached = len(self.ids)
        self.passes += 1

    def run(self, config: GenerationConfig, rows_from: int | None = None) -> tuple[list[Row], int]:
        """`job` + its forward + `done`, for this request alone."""
        job, first = self.job(config, rows_from)
        rows = self.member.score_many([job])[0]
        self.done()
        return rows, first

    def release(self) -> None:
        if self.cache is not None:
            self.member.release(self.cache)
            self.cache = None


def _output_size(head: Any) -> int:
    """Logits per position: an nn.Linear's (or an Int8Linear's) out_features, else its weight's rows."""
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else head.weight.shape[0]


def crop_cache(cache: Any, keep: int) -> None:
    """Drop cached positions beyond the first `keep` (transformers 5's DynamicCache takes a negative count)."""
    if hasattr(cache, "length"):  # a cache that counts its own positions: a KVPool, a LlamaSequence
        cache.crop(keep)
        return
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _context_window(config: Any) -> int | None:
    for field in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, field, None) or getattr(getattr(config, "text_config", None), field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- loading --------------------------------------------------------------------------------------
def resolve_spec(spec: str | ModelSpec) -> ModelSpec:
    """Accept a plain string or a ModelSpec; reject anything else with a clear message."""
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str | os.PathLike):
        return ModelSpec(path=os.fspath(spec))
    raise InputTypeError(
        f"a model spec must be a hub id, directory, .gguf path, demo name or ModelSpec, got {type(spec).__name__}"
    )


def spec_name(spec: str | ModelSpec) -> str:
    """The name a spec's member gets (an Ensemble then numbers repeats: "smollm2-135m#2")."""
    spec = resolve_spec(spec)
    return spec.name or Path(spec.path).name or spec.path


def unique_names(names: list[str]) -> list[str]:
    """Member names made unique by numbering repeats, as an Ensemble shows them."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return unique


def peek_spec(spec: str | ModelSpec, trust_remote_code: bool = False) -> tuple[int | None, bool] | None:
    """(context window, has a chat template) of a spec read from its config files, without loading weights.

    Why: adapters report metadata (LlamaIndex's context window) before the lazy load. None when finding
    out would mean fetching, converting or hashing (a .gguf, a demo model not yet converted, an uncached
    hub id).
    """
    spec = resolve_spec(spec)
    directory = _existing_dir(spec)
    if directory is None:
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return _context_window(config), bool(spec.chat_template) or _has_chat_template(directory)


def _existing_dir(spec: ModelSpec) -> Path | None:
    """A directory already holding the spec's config.json, or None."""
    if spec.gguf_file is not None or spec.path.endswith(".gguf"):
        return None  # the converted copy is keyed by the file's hash: finding it means reading the file
    if demo_models.is_demo_name(spec.path):
        row = next(r for r in demo_models.list_models() if r["name"] == spec.path)
        return Path(row["path"]) if row["converted"] else None
    path = Path(spec.path).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    try:  # a hub id already in the local Hugging Face cache
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec.path, "config.json")
    except Exception:
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def _local_dir(spec: ModelSpec) -> str:
    """Map a spec to something `from_pretrained` can load: a converted directory or a hub id."""
    if not spec.path or not spec.path.strip():
        raise ModelLoadError("empty model spec; pass a hub id, a directory, a .gguf file or a demo model name")
    if demo_models.is_demo_name(spec.path):
        return str(demo_models.model_dir(spec.path))
    path = Path(spec.path).expanduser()
    if spec.gguf_file is not None:
        path = path / spec.gguf_file
    if path.suffix == ".gguf":
        return str(demo_models.convert_gguf(path))
    if path.is_dir():
        return str(path)
    looks_local = spec.path.startswith((".", "/", "~")) or os.sep in spec.path.strip("/").replace("/", "", 1)
    if path.exists() or looks_local:
        raise ModelLoadError(
            f"model spec {spec.path!r} is not a model directory or .gguf file "
            f"(demo names: {', '.join(demo_models.DEMO_MODELS)})"
        )
    return spec.path  # a hub id such as "Qwen/Qwen2.5-7B-Instruct"


def check_device(device: Any) -> None:
    """Refuse a device this machine does not have, before any weights are read (torch would fail later
    with an assertion or a device-string error that does not say which member or what to do)."""
    if device is None or device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda:0' or device_map='auto'") from err
    if dev.type == "meta":
        raise ConfigError("device 'meta' holds no weights, so it cannot generate; use 'cpu' or 'cuda:N'")
    if dev.type == "cpu":
        return
    backend = getattr(torch, dev.type, None)
    available = bool(backend is not None and getattr(backend, "is_available", lambda: False)())
    count = int(getattr(backend, "device_count", lambda: 1)()) if available else 0
    if not available or (dev.index is not None and dev.index >= count):
        raise ConfigError(
            f"device {device!r} does not exist on this machine ({count} {dev.type} device(s) available); "
            "use 'cpu', an existing device, or device_map='auto'"
        )


def default_dtype(device: str | torch.device | None) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there), bfloat16 on accelerators."""
    return torch.float32 if device is None or torch.device(device).type == "cpu" else torch.bfloat16


def load_member(
    spec: str | ModelSpec,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    quantization: Any = None,
) -> Member:
    """Load one member. Never enables remote code unless the caller asked for it."""
    spec = resolve_spec(spec)
    device = spec.device or device or "cpu"
    check_device(device)
    dtype = spec.dtype or dtype
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'")
        dtype = getattr(torch, dtype)
    quantization = spec.quantization if spec.quantization is not None else quantization
    check_quantization(quantization, dtype, device)
    dtype = dtype or default_dtype(device)
    source = _local_dir(spec)
    extra = {}
    if (config := loading_config(quantization, device)) is not None:
        extra["quantization_config"] = config
    try:
        if demo_models.written_here(source):
            tokenizer = demo_models.load_tokenizer(source)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, device_map=device, trust_remote_code=trust_remote_code, **extra
        )
    except pickle.UnpicklingError as err:  # torch.load(weights_only=True) met more than plain tensors
        raise ModelLoadError(
            f"refused to load {spec.path!r}: its pickle checkpoint (.bin) holds objects other than tensors, and "
            "unpickling them could run code; convert it to safetensors where you trust its source"
        ) from err
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load model {spec.path!r}: {err}") from err
    if quantization == "int8" and not extra:  # its operators' thread team must not stay docked on the caller's
        on_short_lived_thread(lambda: quantize_int8(model), "safe-quantize")
    return Member(model, tokenizer, name=spec_name(spec), chat_template=spec.chat_template)
