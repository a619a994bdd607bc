"""Members on llama.cpp: a GGUF file decoded by llama.cpp's quantized kernels, read by the engine as rows.

Why: people who run models on a CPU run GGUF files in llama.cpp; converted to float32 torch, the same file
reads 4-7x more bytes per token. A `LlamaCppMember` keeps the GGUF as it is and talks to llama.cpp through
llama-cpp-python's low-level API (`llama_cpp.llama_cpp`):

- one `llama_model` + `llama_context` per member; a request's cache is a sequence id of that context
  (`LlamaSequence`), so a batch of requests is one `llama_decode` and continuous batching keeps working;
- a verification pass is one `llama_decode` with a logits flag on exactly the positions that need a row;
- rollback is `llama_memory_seq_rm(memory, seq, start, -1)` before the next pass;
- the context starts small and doubles as its requests hold more positions, so its KV memory follows use;
- tokens come from the member's Hugging Face tokenizer (a GGUF's ids are the tokenizer's by construction),
  checked at load: every id's bytes in llama.cpp must equal the engine's byte view of the tokenizer;
- rows are the logits as float32 torch tensors, so penalties, logit_bias, logprobs, grammars, sampling and
  token healing read them as they read a torch member's.

Threads: a pass uses as many threads as torch would on the calling thread (`torch.get_num_threads()`), so
the measured placement (`runtime/placement.py`) times and places llama.cpp members as it does torch ones.

Quantized kernels are not batch-invariant: a k-token pass and k one-token steps can differ in the last bits
(docs/llamacpp.md has the measurement and what holds instead).

A native crash cannot be caught in Python, so before the first model loads, a child process decodes one
token with this build on this CPU (`smoke_check`); its verdict is cached per build and CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, MemberError, ModelLoadError
from . import demo_models
from .members import Job, Member, ModelSpec, resolve_spec, spec_name
from .placement import cpu_info, cpu_model

DEFAULT_CONTEXT = 4096  # positions shared by a member's sequences (kv_unified)
FIRST_CONTEXT = 256  # positions a context starts with; it doubles as its requests come to hold more
PIECE_BUFFER = 256  # bytes for one token's piece (the high-level wrappers use 32 and cut longer ones)
INSTALL = (
    "pip install 'langchain-safe[llamacpp]' (builds llama.cpp from source, about 9 minutes on 2 cores; "
    "see docs/llamacpp.md for the build flags)"
)

_init_lock = threading.Lock()
_silent: Any = None  # the log callback given to llama.cpp, once initialised


def llama() -> Any:
    """The low-level bindings, or a ConfigError saying how to install them."""
    try:
        import llama_cpp.llama_cpp as ll
    except ImportError as err:
        raise ConfigError(f"backend='llama.cpp' needs llama-cpp-python; {INSTALL}") from err
    return ll


def available() -> bool:
    """Whether llama-cpp-python can be imported (then a GGUF source on the CPU uses it by default)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _init_backend() -> None:
    """Once per process: llama.cpp's log silenced (it prints every load), then its backend."""
    global _silent
    with _init_lock:
        if _silent is not None:
            return
        ll = llama()
        _silent = ll.llama_log_callback(lambda level, text, user_data: None)  # kept: llama.cpp calls it later
        ll.llama_log_set(_silent, None)
        ll.llama_backend_init()


# -- the one-time smoke decode ----------------------------------------------------------------------
_SMOKE = r"""
import sys, llama_cpp.llama_cpp as ll
quiet = ll.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp calls it later
ll.llama_log_set(quiet, None)
ll.llama_backend_init()
mp = ll.llama_model_default_params(); mp.n_gpu_layers = 0
model = ll.llama_model_load_from_file(sys.argv[1].encode(), mp)
assert model, "the model did not load"
cp = ll.llama_context_default_params(); cp.n_ctx = 64; cp.n_batch = 64; cp.n_threads = 1; cp.n_threads_batch = 1
ctx = ll.llama_init_from_model(model, cp)
batch = ll.llama_batch_init(4, 0, 1)
for i in range(4):
    batch.token[i] = 1 + i; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = i == 3
batch.n_tokens = 4
assert ll.llama_decode(ctx, batch) == 0, "llama_decode failed"
print("ok")
"""


def _build_key() -> str:
    """Which llama.cpp build on which CPU: the library file's identity + the CPU's model and flags."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    files = sorted(lib.glob("*.so*")) if lib.is_dir() else []
    ident = [llama_cpp.__version__] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    cpu = cpu_info()
    return hashlib.sha256("\n".join([*ident, cpu["model_name"], *cpu["flags"]]).encode()).hexdigest()[:16]


def smoke_check(gguf: Path) -> None:
    """Decode a few tokens of `gguf` in a child process once per llama.cpp build and CPU (the verdict is cached): a
    build that crashes on this CPU (a `-march=native` build on a Xeon whose CPUID reports AMX segfaulted in
    `llama_decode`) becomes a ModelLoadError here, never a process that dies at its first request."""
    path = demo_models.cache_root() / "llamacpp-smoke" / f"{_build_key()}.json"
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        verdict = None
    if verdict is None:
        run = subprocess.run(
            [sys.executable, "-c", _SMOKE, str(gguf)], capture_output=True, text=True, timeout=300, check=False
        )
        verdict = {
            "ok": run.returncode == 0 and run.stdout.strip() == "ok",
            "returncode": run.returncode,
            "stderr": run.stderr[-2000:],
            "cpu": cpu_model(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict, indent=1))
    if not verdict["ok"]:
        how = f"signal {-verdict['returncode']}" if verdict["returncode"] < 0 else f"exit {verdict['returncode']}"
        raise ModelLoadError(
            f"this llama.cpp build cannot decode on this CPU ({verdict['cpu'] or 'unknown'}): a child process "
            f"died with {how} ({verdict['stderr'].strip().splitlines()[-1:] or ''}); rebuild llama-cpp-python "
            "with the portable flags of docs/llamacpp.md, or use backend='torch'"
        )


# -- a request's cache ------------------------------------------------------------------------------
class LlamaSequence:
    """One request's sequence in a member's llama.cpp context; `length` positions are valid.

    The sequence id is taken at the request's first pass, so requests waiting for a slot in the batch hold
    none. Cropping only lowers `length`: the positions beyond it leave llama.cpp's memory at the next pass,
    which writes new ones there anyway."""

    __slots__ = ("__weakref__", "finalizer", "length", "seq")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.length = 0
        self.finalizer: weakref.finalize | None = None

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


# -- the member -------------------------------------------------------------------------------------
class LlamaCppMember(Member):
    """A GGUF model in llama.cpp with its Hugging Face tokenizer on the engine's side."""

    backend = "llama.cpp"
    positions: int  # the most positions its context grows to, shared by this member's requests (set at load)
    allocated: int  # the positions its context has now

    def __init__(
        self,
        gguf: str | os.PathLike,
        tokenizer: Any,
        name: str | None = None,
        chat_template: str | None = None,
        context: int = DEFAULT_CONTEXT,
        sequences: int = 64,
        positions: int | None = None,
    ) -> None:
        ll = llama()
        path = Path(gguf)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        smoke_check(path)
        _init_backend()
        self.gguf = path
        self._ll = ll
        model_params = ll.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = ll.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        self._native: list[Any] = [None, None, self._model]  # batch, context, model: freed in this order
        self._close = weakref.finalize(self, _free_native, ll, self._native)
        self._close.atexit = False  # at exit the OS frees it: a decode still running elsewhere must not crash
        if ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model):
            raise ModelLoadError(
                f"{path.name} is a recurrent or hybrid model: its llama.cpp memory cannot be cut at a position, "
                "which SAFE's rollback needs; use backend='torch'"
            )
        self._vocab = ll.llama_model_get_vocab(self._model)
        n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        trained = ll.llama_model_n_ctx_train(self._model)
        context = min(context, trained) if trained > 0 else context  # one request's window
        if positions is not None and positions < context:
            raise ConfigError(
                f"{path.name}: a context of {positions} KV positions cannot hold one request's window of {context}; "
                f"give kv_positions >= {context} (the positions all of the member's requests share)"
            )
        self.positions = positions or max(context, DEFAULT_CONTEXT)  # shared by its requests (see Member)
        self._params = params = ll.llama_context_default_params()
        params.n_batch = context  # a prompt is one pass (llama.cpp caps it at the context's size)
        params.n_ubatch = min(512, context)
        params.n_seq_max = sequences
        params.kv_unified = True  # the sequences share the context's positions
        params.no_perf = True
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama-cpp-python's `Llama` (same rows)
        self._threads = torch.get_num_threads()  # every context is made with the member's thread count
        ctx = self._new_context(min(FIRST_CONTEXT, self.positions))
        if ctx is None:
            raise ModelLoadError(f"llama.cpp could not create a context for {path.name}")
        self._set_context(ctx)
        self.sequences = sequences
        self._free = list(range(sequences))
        self._free_lock = threading.Lock()
        # a context is never used by two threads at once; reentrant: a dropped request's finalizer may give its
        # sequence back (under this lock) while this thread is inside a pass
        self._forward_lock = threading.RLock()
        self._held: dict[int, int] = {}  # sequence id -> positions it holds in the context
        self._batch_size = 0
        self._batch: Any = None
        eos = {int(ll.llama_vocab_eos(self._vocab)), int(ll.llama_vocab_eot(self._vocab))} - {-1}
        self._setup_tokenizer_side(
            tokenizer,
            name or path.stem,
            chat_template,
            frozenset(eos) | _tokenizer_eos(tokenizer),
            n_vocab,
            context,
        )
        check_vocabulary(self)
        self.model = None  # the weights live in llama.cpp
        self.device = torch.device("cpu")
        self.packed = True  # many requests per pass (sequence ids of one context)

    def __repr__(self) -> str:
        return f"LlamaCppMember({self.name!r}, vocab={self.vocab_size}, gguf={self.gguf.name})"

    @property
    def weight_bytes(self) -> int:
        """The GGUF's size: what a decoding step reads (llama.cpp maps the file as it is)."""
        return self.gguf.stat().st_size

    def piece(self, token: int) -> bytes:
        """llama.cpp's bytes of one id, special tokens rendered (a buffer large enough for any piece)."""
        buf = ctypes.create_string_buffer(PIECE_BUFFER)
        n = self._ll.llama_token_to_piece(self._vocab, token, buf, PIECE_BUFFER, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, True)
        return buf.raw[:n]

    # -- caches -----------------------------------------------------------------------------------------
    def new_cache(self) -> LlamaSequence:
        return LlamaSequence()

    def release(self, cache: Any) -> None:
        if cache.finalizer is not None:
            cache.finalizer()

    def _sequence(self, cache: LlamaSequence) -> int:
        """The cache's sequence id, taken from the free ones at its first pass."""
        if cache.seq is None:
            with self._free_lock:
                if not self._free:
                    raise MemberError(
                        f"member {self.name!r}: all {self.sequences} llama.cpp sequences are in use; lower "
                        "max_batch_size or release finished requests' caches",
                        member=self.name,
                    )
                cache.seq = self._free.pop(0)
            cache.finalizer = weakref.finalize(cache, self._free_sequence, cache.seq)
            cache.finalizer.atexit = False
        return cache.seq

    def _free_sequence(self, seq: int) -> None:
        with self._forward_lock:
            self._ll.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._held.pop(seq, None)
        with self._free_lock:
            self._free.append(seq)

    # -- forward ----------------------------------------------------------------------------------------
    def forward_many(self, jobs: Sequence[Job]) -> list[torch.Tensor]:
        """Each job's float32 logits of its last `keep` positions: one `llama_decode` for all jobs, after
        cutting each sequence back to its job's `start`."""
        ll = self._ll
        total = sum(len(job.ids) for job in jobs)
        if total == 0:
            return [torch.empty(0, self.vocab_size) for _ in jobs]
        with self._forward_lock:
            for job in jobs:
                if job.start > job.cache.length:
                    raise MemberError(
                        f"member {self.name!r}: a pass starts at {job.start}, past the cache's {job.cache.length} "
                        "positions",
                        member=self.name,
                    )
            self._make_room(jobs)
            batch = self._batch_for(total)
            i = 0
            for job in jobs:
                cache: LlamaSequence = job.cache
                seq = self._sequence(cache)
                self._held[seq] = job.start + len(job.ids)
                ll.llama_memory_seq_rm(self._memory, seq, job.start, -1)
                for k, token in enumerate(job.ids):
                    batch.token[i] = token
                    batch.pos[i] = job.start + k
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = k >= len(job.ids) - job.keep
                    i += 1
            batch.n_tokens = total
            threads = torch.get_num_threads()
            if threads != self._threads:
                ll.llama_set_n_threads(self._ctx, threads, threads)
                self._threads = threads
            status = ll.llama_decode(self._ctx, batch)
            if status != 0:
                for job in jobs:  # nothing was written for certain: these sequences hold their start only
                    job.cache.length = self._held[job.cache.seq] = job.start
                raise MemberError(
                    f"member {self.name!r}: llama_decode failed ({status}) on {total} tokens; the context holds "
                    f"{self.context_window} positions for all requests together",
                    member=self.name,
                )
            out = []
            i = 0
            for job in jobs:
                rows = np.empty((job.keep, self.vocab_size), dtype=np.float32)
                first = i + len(job.ids) - job.keep
                for r in range(job.keep):
                    pointer = ll.llama_get_logits_ith(self._ctx, first + r)
                    rows[r] = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
                out.append(torch.from_numpy(rows))
                job.cache.length = job.start + len(job.ids)
                i += len(job.ids)
        return out

    def _make_room(self, jobs: Sequence[Job]) -> None:
        """Refuse a pass that would hold more positions than the member's `positions`, before llama.cpp sees it
        (the scheduler admits requests so that this does not happen: `Generation.reserved_positions`); grow the
        context first if the pass needs more than it has now."""
        after = dict(self._held)
        for job in jobs:
            after[job.cache.seq if job.cache.seq is not None else -1 - id(job)] = job.start + len(job.ids)
        needed = sum(after.values())
        if needed > self.positions:
            raise MemberError(
                f"member {self.name!r}: its requests would hold {needed} positions, more than the "
                f"{self.positions} its llama.cpp context shares among them; lower max_batch_size or max_new_tokens",
                member=self.name,
            )
        if needed > self.allocated:
            self._grow(needed)

    # -- the context: it starts small and grows -----------------------------------------------------------
    # Why: llama.cpp allocates (and clears) a context's whole KV cache when the context is made, 138 MiB for
    # the demo pair's 4,096 positions. A context that starts at FIRST_CONTEXT positions and doubles when a pass
    # needs more keeps the KV memory near what the requests hold, as a torch member's cache does; it never
    # shrinks. A growth makes a larger context and copies every cell into it, in order (the same f16 values).
    # What holds: where the used cells had no free ones between them (always with one request), the rows that
    # follow are bit for bit the larger context's own. Cells freed in the middle (a request that ended) are
    # closed up by the copy, so later passes lay their cells out otherwise, and their rows may then differ
    # from a full-size context's as rows differ with any change of batch (docs/llamacpp.md).
    def _new_context(self, size: int) -> Any:
        """A context of `size` positions with the member's settings, or None where llama.cpp cannot make one."""
        self._params.n_ctx = size
        self._params.n_threads = self._params.n_threads_batch = self._threads
        return self._ll.llama_init_from_model(self._model, self._params) or None

    def _set_context(self, ctx: Any) -> None:
        self._ctx = self._native[1] = ctx
        self._memory = self._ll.llama_get_memory(ctx)
        self.allocated = int(self._ll.llama_n_ctx(ctx))  # llama.cpp may round the size up

    def _grow(self, needed: int) -> None:
        """Move every sequence into a context of at least `needed` positions (doubling, at most `positions`).
        The copies are taken before this pass cuts its sequences back, so they may need what they hold now."""
        ll = self._ll
        needed = max(needed, sum(self._held.values()))
        size = self.allocated
        while size < needed:
            size *= 2
        size = min(size, self.positions)
        ctx = self._new_context(size)
        moved = ctx is not None
        if moved:  # sequence -1: every cell, in its order, with its positions and sequence ids
            state = (ctypes.c_uint8 * ll.llama_state_seq_get_size(self._ctx, -1))()
            written = ll.llama_state_seq_get_data(self._ctx, state, len(state), -1)
            moved = ll.llama_state_seq_set_data(ctx, state, written, -1) == written
            if not moved:
                ll.llama_free(ctx)
        if not moved:  # the old context is untouched: its requests go on where they were
            raise MemberError(
                f"member {self.name!r}: llama.cpp could not grow its context to {size} positions "
                f"(it holds {self.allocated}); lower max_batch_size or max_new_tokens",
                member=self.name,
            )
        old, self._native[1] = self._ctx, None
        ll.llama_free(old)
        self._set_context(ctx)

    def forward(self, ids: list[int], cache: Any, keep: int = 1) -> torch.Tensor:
        """Logits (float32) of the last `keep` of `ids`, appended to what `cache` already holds."""
        return self.forward_many([Job(cache, cache.length, ids, keep, None)])[0]

    def _batch_for(self, size: int) -> Any:
        if size > self._batch_size:
            if self._batch is not None:
                self._native[0] = None
                self._ll.llama_batch_free(self._batch)
            self._batch_size = max(size, 64)
            self._batch = self._native[0] = self._ll.llama_batch_init(self._batch_size, 0, 1)
        return self._batch


def _free_native(ll: Any, native: list[Any]) -> None:
    """Free a member's batch, context and model, in that order (a context freed after its model crashes)."""
    batch, ctx, model = native
    if batch is not None:
        ll.llama_batch_free(batch)
    if ctx is not None:
        ll.llama_free(ctx)
    ll.llama_model_free(model)


def _tokenizer_eos(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()


def check_vocabulary(member: LlamaCppMember) -> None:
    """Every id's bytes in llama.cpp equal the engine's byte view of the member's tokenizer; a mismatch is a
    ModelLoadError naming the first ids. Not compared: control tokens (no text for the engine) and ids the GGUF
    marks unused (Qwen's `[PAD151665]` fillers past its real vocabulary, empty in llama.cpp)."""
    ll = member._ll
    skipped = ll.LLAMA_TOKEN_ATTR_UNUSED | ll.LLAMA_TOKEN_ATTR_CONTROL
    if member.vocab.size > member.vocab_size:
        raise ModelLoadError(
            f"member {member.name!r}: its tokenizer has {member.vocab.size} ids but {member.gguf.name} only "
            f"{member.vocab_size}; pass the tokenizer that belongs to this GGUF"
        )
    wrong = []
    for token, expected in enumerate(member.vocab.token_bytes):
        if expected is None or ll.llama_vocab_get_attr(member._vocab, token) & skipped:
            continue
        if member.piece(token) != expected:
            wrong.append(token)
            if len(wrong) == 5:
                break
    if wrong:
        shown = ", ".join(f"{t} (tokenizer {member.vocab.token_bytes[t]!r}, GGUF {member.piece(t)!r})" for t in wrong)
        raise ModelLoadError(
            f"member {member.name!r}: the tokenizer does not spell the GGUF's tokens: ids {shown}; pass the "
            "tokenizer that belongs to this GGUF"
        )


# -- loading ----------------------------------------------------------------------------------------
def local_runtime(spec: ModelSpec, backend: str, device: str | None, dtype: Any) -> str:
    """ "torch" or "llama.cpp" for a member loaded in this process. `backend` is the ensemble's; the spec's
    own wins. "auto" picks llama.cpp for a GGUF source on the CPU with the GGUF's own weights (no dtype, no
    quantization asked for) when llama-cpp-python is installed: fast by default."""
    chosen = spec.backend or backend
    if chosen in ("torch", "llama.cpp"):
        return chosen
    if chosen not in ("auto", "local"):
        raise ConfigError(
            f"unknown backend {chosen!r} for member {spec_name(spec)!r}; use 'auto', 'torch' or 'llama.cpp'"
        )
    on_cpu = (spec.device or device) in (None, "cpu")
    as_is = spec.quantization is None and (spec.dtype or dtype) is None
    gguf = demo_models.is_demo_name(spec.path) or spec.gguf_file is not None or spec.path.endswith(".gguf")
    return "llama.cpp" if gguf and on_cpu and as_is and available() else "torch"


def gguf_source(spec: ModelSpec) -> Path | None:
    """The GGUF file behind a spec (a `.gguf` path, a directory + `gguf_file`, a demo name), or None."""
    if demo_models.is_demo_name(spec.path):
        return demo_models.fetch(spec.path)  # verified: a cached copy is hashed again (about a second)
    path = Path(spec.path).expanduser()
    if spec.gguf_file is not None:
        path = path / spec.gguf_file
    return path if path.suffix == ".gguf" else None


def peek_window(spec: str | ModelSpec, backend: str, window: int | None) -> int | None:
    """A peeked context window as the member will have it: a member that runs in llama.cpp holds
    `DEFAULT_CONTEXT` positions at most (its context, shared by its requests)."""
    spec = resolve_spec(spec)
    if window and backend != "ray" and local_runtime(spec, backend, None, None) == "llama.cpp":
        return min(window, DEFAULT_CONTEXT)
    return window


def load_llamacpp_member(
    spec: ModelSpec, device: str | None = None, dtype: Any = None, positions: int | None = None
) -> LlamaCppMember:
    """A llama.cpp member from a GGUF spec; its tokenizer is the file's own, saved once by transformers
    (`demo_models.tokenizer_dir`: the weights are never converted). Its context holds `positions` for all its
    requests together (default: one window, DEFAULT_CONTEXT; more lets more long requests run at once, at the
    cost of its KV memory)."""
    gguf = gguf_source(spec)
    if gguf is None:
        raise ConfigError(
            f"backend='llama.cpp' runs GGUF files; {spec.path!r} is not a .gguf file or a demo model name "
            "(use backend='torch' for it)"
        )
    if spec.quantization is not None or (spec.dtype or dtype) is not None:
        raise ConfigError(
            f"member {spec_name(spec)!r}: backend='llama.cpp' runs the GGUF's own quantization; dtype= and "
            "quantization= apply to backend='torch' only"
        )
    if (spec.device or device) not in (None, "cpu"):
        raise ConfigError(f"backend='llama.cpp' members run on the CPU here, not {spec.device or device!r}")
    # the tokenizer alone: the weights stay in the GGUF (a converted dir is used when one exists)
    pinned = demo_models.DEMO_MODELS[spec.path].sha256 if demo_models.is_demo_name(spec.path) else None
    tokenizer = demo_models.load_tokenizer(demo_models.tokenizer_dir(gguf, pinned))
    return LlamaCppMember(gguf, tokenizer, spec_name(spec), spec.chat_template, positions=positions)
