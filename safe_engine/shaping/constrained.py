"""Constrained decoding across the ensemble: JSON schemas, JSON mode and tool calls (issue 16).

Everything the ensemble emits becomes *drafter* token ids (an ensemble pick is turned into drafter ids), so
the whole constraint lives in the drafter's token space: one grammar matcher over the drafter's vocabulary,
spelled exactly as the decoder spells it (`Member.token_bytes`: byte-level BPE bytes, SentencePiece `▁` as a
space and `<0xNN>` as raw bytes, control tokens as no text). Every emitted byte is then valid whichever member
chose it:

- drafting: the drafter's logits are masked (`Constraint.mask_logits`) before its argmax / sample, and each
  drafted id is consumed, so the draft is valid token by token;
- ensemble points: candidate strings the grammar forbids get probability 0 and the rest is renormalised
  (`mask_distribution`), with the constraint rolled back to the ensemble point's offset first;
- acceptance: accepted ids stay consumed, discarded ones are rolled back (`Constraint.rollback`);
- EOS is allowed only where the grammar accepts, and is the only token allowed once it is complete.

Sampling stays exact: the drafter draws from its masked distribution q, the ensemble target P is masked and
renormalised, and speculative acceptance min(1, P/q) with the residual max(0, P − q) then emits strings
distributed exactly as the masked P (both sides are zero on forbidden strings).

Library: **llguidance**, chosen over xgrammar by `benchmarks/constraint_cost.py` (JSON schema with nested
objects, an enum, arrays, an anyOf-null field and a long string; a valid document fed token by token, mask
then consume; both given the same byte vocabulary; `benchmarks/results/constraint_cost.json`, on this
project's 2-core CPU shared with other jobs, so medians and per-document sums rather than means):

| mask / compile                              | llguidance 1.9.1 | xgrammar 0.2.9 |
|---------------------------------------------|------------------|----------------|
| mask per step, Qwen2.5 152k: median / p90   | 1.3 / 39 µs      | 29 / 32 µs     |
| mask, the whole 200-step document, Qwen2.5  | 2.7 ms           | 31 ms          |
| mask per step, Llama-2 32k: median / p90    | 1.0 / 26 µs      | 4.6 / 5.2 µs   |
| mask, the whole 218-step document, Llama-2  | 1.8 ms           | 0.8 ms         |
| compile the schema, Qwen2.5 / Llama-2       | 4 / 1.3 ms       | 3,560 / 322 ms |
| per-vocabulary object, once per drafter     | 1,500 / 92 ms    | 217 / 11 ms    |

Per step both are far below a forward pass (llguidance is 10x cheaper on the 152k vocabulary, xgrammar 2x
on the 32k one); what decides is compilation: xgrammar precomputes a token-mask cache per grammar *and
vocabulary*, seconds on a 152k vocabulary, and tool sets and schemas change from request to request, while
llguidance compiles a grammar in milliseconds (its per-vocabulary token trie is built once per drafter and
cached here). llguidance also takes the vocabulary as plain bytes with explicit special tokens
(`TokenizerWrapper`), so byte-level BPE and SentencePiece byte fallback are handled by the very table the
decoder uses (`Member.token_bytes`; its own Hugging Face import turns Qwen's non-special added tokens such
as `<tool_call>` into control tokens, which the decoder treats as text), and tokens ending inside a UTF-8
character work. It checks a token sequence without consuming it (`validate_tokens`), rolls back any number
of tokens, copies a matcher in 8 µs, has Lark grammars with inline JSON schemas and lazy lexemes (free text
or a tool call), and has no dependencies (xgrammar's wheel requires torch and triton).

Through this module (same document, Qwen2.5, a 152,064-wide float32 row): `mask_logits` ≈ 60 µs a step,
mask computation included, and `consume` ≈ 4 µs; a tool-call grammar ≈ 75 µs. The -inf logits come from a
0 / -inf float bias built from the bitmask with integer ops, added to the row: a boolean `masked_fill`
alone costs ≈ 110 µs there (≈ 1 ms on a scattered mask). `mask_distribution` at an ensemble point: ≈ 50 µs
for UniTE's ~20 candidates; GaC's whole union (157k strings for Qwen2.5 + Llama-2) with a `Candidates`
table ≈ 0.3 ms at a structural position, ≈ 8 ms inside a JSON string (5.6k strings that are not one
drafter token are checked byte by byte there).

Tool calls use the Hermes / Qwen2.5 format that `safe_engine.shaping.tools` reads back:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (up to 3 white-space characters allowed
around the JSON, so the compact ``<tool_call>{...}</tool_call>`` the system-message prompt asks for is valid
too). The JSON object has "name" first, then "arguments" (the tool's parameter schema).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol, cast

import llguidance
import numpy as np
import torch

from ..errors import ConfigError, InputError, SafeEngineError
from ..runtime.vocab import Vocab
from .schemas import call_schema, schema_dict, tool_parameters
from .tools import TOOL_CHOICES, ToolChoice, tool_names

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

log = logging.getLogger(__name__)

# JSON compile options (llguidance's JsonCompileOptions); a schema's own "x-guidance" overrides them.
# - lenient: keywords llguidance does not implement are ignored (with a warning in Grammar.warnings) rather
#   than refused;
# - general \uXXXX escapes: Python's json.dumps writes them, so models have seen them;
# - white space between JSON tokens: at most 12 characters a gap (a newline and pretty-printing 5 levels
#   deep). The default, any amount, lets a model under the mask emit newlines forever: every other token is
#   masked out, white space never is (tiny random models and a random walk over the allowed tokens do
#   exactly that; at 48 a gap they still spent most of a 300-token budget on white space).
JSON_OPTIONS: JsonCompileOptions = {
    "lenient": True,
    "json_allow_general_unicode_escapes": True,
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}",
}
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NEG_INF_BITS = -8388608  # 0xFF800000 as int32: the bit pattern of float32 -inf
_TEMPLATES_KEPT = 128  # compiled grammars kept per process (each a few hundred KB at most)


class ConstraintError(SafeEngineError, ValueError):
    """Token ids were offered that the grammar does not allow from the constraint's current state."""


class DrafterVocab(Protocol):
    """What a constraint reads from the drafter: a `Member` has all of it."""

    vocab: Vocab
    token_bytes: list[bytes | None]  # one entry per logit column (ids past the tokenizer: None)
    eos_ids: frozenset[int]


# -- grammars -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grammar:
    """A constraint's description, independent of any tokenizer; compiled per drafter vocabulary on first use.

    `source` is llguidance's grammar text (its serialized top-level grammar); `warnings` lists what the
    compiler ignored (unimplemented JSON-schema keywords), so callers can tell the constraint is looser."""

    source: str
    kind: str  # "json_schema" | "json_object" | "tool_calls" | "lark"
    warnings: tuple[str, ...] = ()

    @cached_property
    def key(self) -> str:
        """What the compiled-grammar cache is keyed on (with the drafter's vocabulary)."""
        return hashlib.sha256(self.source.encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | Any) -> Grammar:
        """The reply is one JSON value valid for `schema` (a dict, its JSON text, or a pydantic model class).
        No text before or after it: EOS is forced once the value is complete."""
        schema = schema_dict(schema)
        return cls._checked(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), "json_schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """JSON mode: the reply is any one JSON object."""
        source = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        return cls._checked(source, "json_object")

    @classmethod
    def tool_calls(
        cls, tools: Sequence[Mapping[str, Any]], choice: ToolChoice = "auto", parallel: bool = True
    ) -> Grammar | None:
        """Tool calls in the Hermes / Qwen2.5 format; `choice` as `build_request` carries it
        (`safe_engine.shaping.tools.normalize_tool_choice`):

        - "auto": free text without ``<tool_call>``, or text followed by one or more valid calls (once
          ``<tool_call>`` is written, a valid call must follow);
        - "required": one or more valid calls and nothing else;
        - a tool name: exactly one call to that tool;
        - "none": None, nothing to constrain (the tools are not shown either).

        `parallel=False`: one call at most (OpenAI's `parallel_tool_calls`).
        """
        names = tool_names(tools)
        if choice not in (*TOOL_CHOICES, *names):
            raise ConfigError(
                f"tool_choice {choice!r} is not 'auto', 'none', 'required' or a tool of {names} "
                "(normalize_tool_choice reads the other forms, as build_request does)"
            )
        if choice == "none":
            return None
        if choice in ("auto", "required"):
            bodies = [call_schema(name, tool_parameters(tool)) for name, tool in zip(names, tools)]
        else:
            bodies = [call_schema(choice, tool_parameters(tools[names.index(choice)]))]
        body = {**({"anyOf": bodies} if len(bodies) > 1 else bodies[0]), "x-guidance": JSON_OPTIONS}
        start = {"auto": "TEXT | head calls", "required": "OPEN calls"}.get(choice, "OPEN call SEP?")
        lark = "\n".join(
            [
                f"start: {start}",
                # free text never contains the opening tag; text that does becomes a call (lazy: ends there)
                "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                "head[lazy]: /(?s:.*)<tool_call>/",
                "calls: call (SEP OPEN call)* SEP?" if parallel else "calls: call SEP?",
                "call: WS? body CLOSE",
                "OPEN: " + json.dumps(TOOL_CALL_OPEN),
                r"CLOSE: /[ \t\r\n]{0,3}<\/tool_call>/",
                r"SEP: /[ \t\r\n]{1,3}/",
                r"WS: /[ \t\r\n]{1,3}/",
                "body: %json " + json.dumps(body, ensure_ascii=False),
            ]
        )
        return cls._checked(llguidance.LLMatcher.grammar_from_lark(lark), "tool_calls")

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Any llguidance Lark grammar (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
        return cls._checked(llguidance.LLMatcher.grammar_from_lark(text), "lark")

    @classmethod
    def for_request(
        cls,
        json_schema: Mapping[str, Any] | str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
    ) -> Grammar | None:
        """The grammar of the engine API's `json_schema=` / `tools=` + `tool_choice=`; None: unconstrained."""
        calls = cls.tool_calls(tools, tool_choice, parallel_tool_calls) if tools else None
        if json_schema is not None and calls is not None:
            raise ConfigError(
                "json_schema constrains the whole reply, so it cannot be combined with tool calls; "
                "pass tool_choice='none' (or no tools) with json_schema, or drop json_schema"
            )
        if json_schema is not None:
            return cls.json_schema(json_schema)
        return calls

    @classmethod
    def _checked(cls, source: str, kind: str) -> Grammar:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
        if is_error:
            raise ConfigError(f"invalid {kind.replace('_', ' ')} constraint: {messages[0] if messages else source}")
        for message in messages:
            log.warning("%s constraint: %s", kind, message)
        return cls(source, kind, tuple(messages))


# -- per-vocabulary compilation, cached ------------------------------------------------------------------
class _SpelledTokenizer:
    """The decoder's spelling of each drafter id, as llguidance's `TokenizerWrapper` reads it.

    Control tokens (no text) and EOS are llguidance "special" tokens: never text, allowed only where the
    grammar names them (EOS: where it accepts)."""

    def __init__(self, drafter: DrafterVocab, eos: list[int]) -> None:
        self._vocab = drafter.vocab
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        pieces = drafter.vocab.tokenizer.convert_ids_to_tokens(list(range(drafter.vocab.size)))
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for tid, spelled in enumerate(drafter.token_bytes):
            if spelled is None or tid in drafter.eos_ids:
                piece = pieces[tid] if tid < len(pieces) and pieces[tid] else f"<|unused_{tid}|>"
                self.tokens.append(piece.encode())
                self.special_token_ids.append(tid)
            else:
                self.tokens.append(spelled)

    def __call__(self, data: bytes) -> list[int]:
        return self._vocab.encode(data)[0]


_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple, llguidance.LLTokenizer] = {}
_TEMPLATES: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()


def _eos(drafter: DrafterVocab) -> list[int]:
    eos = sorted(i for i in drafter.eos_ids if i < len(drafter.token_bytes))
    if not eos:
        raise ConfigError("the drafter has no EOS token inside its vocabulary, so a constraint could never end")
    return eos


def _vocab_key(drafter: DrafterVocab) -> tuple:
    return (drafter.vocab.fingerprint, len(drafter.token_bytes), tuple(_eos(drafter)))


def _template(grammar: Grammar, drafter: DrafterVocab) -> llguidance.LLMatcher:
    """A fresh matcher: a deep copy (µs) of the compiled, never-advanced one of (vocabulary, grammar).

    The per-vocabulary token trie takes ~0.8 s for a 152k vocabulary and a grammar a few ms, so both are
    built once; many concurrent requests share them."""
    vocab_key = _vocab_key(drafter)
    key = (vocab_key, grammar.key)
    with _LOCK:
        template = _TEMPLATES.get(key)
        if template is not None:
            _TEMPLATES.move_to_end(key)
            return template.deep_copy()
        tokenizer = _TOKENIZERS.get(vocab_key)
        if tokenizer is None:
            eos = list(vocab_key[2])
            wrapper = llguidance.TokenizerWrapper(_SpelledTokenizer(drafter, eos))
            tokenizer = _TOKENIZERS[vocab_key] = llguidance.LLTokenizer(wrapper, eos_token=eos)
        template = llguidance.LLMatcher(tokenizer, grammar.source, log_level=0)
        if template.is_error():
            raise ConfigError(f"{grammar.kind} constraint does not compile: {template.get_error()}")
        _TEMPLATES[key] = template
        while len(_TEMPLATES) > _TEMPLATES_KEPT:
            _TEMPLATES.popitem(last=False)
        return template.deep_copy()


def bias_of_bitmask(words: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """[32 * len(words)] float32 on `device`: 0 where a bit of the int32 `words` is set, -inf where not.

    Integer ops on the bit pattern of -inf (x - 1 is all ones for a cleared bit, 0 for a set one), so no
    boolean masking: numpy's unpackbits on the CPU, shifts on an accelerator (only the bitmask crosses)."""
    if device is None or torch.device(device).type == "cpu":
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little").astype(np.int32)
        bits -= 1
        bits &= _NEG_INF_BITS
        return torch.from_numpy(bits.view(np.float32))
    return _bias_by_shifts(words.to(device))


def _bias_by_shifts(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((((words.view(-1, 1) >> shifts) & 1) - 1) & _NEG_INF_BITS).view(-1).view(torch.float32)


# -- one request's state ---------------------------------------------------------------------------------
class Constraint:
    """One request's position in a grammar, over the drafter's token ids.

    The state is everything consumed so far: the accepted text plus the current draft. `ids` lists them
    (a final EOS included). Queries (`bitmask`, `allowed`, `mask_logits`, `allows`, `valid_prefix`,
    `allows_text`, `allows_strings`) never change the state; `consume`, `rollback`, `reset` do.
    Not thread-safe: one request, one thread at a time (`fork` for another).
    """

    def __init__(self, grammar: Grammar, drafter: DrafterVocab, *, _matcher: llguidance.LLMatcher | None = None):
        self.grammar = grammar
        self.drafter = drafter
        self.vocab_size = len(drafter.token_bytes)
        self.eos_ids = frozenset(_eos(drafter))
        self._matcher = _matcher if _matcher is not None else _template(grammar, drafter)
        self.ids: list[int] = []
        self._ended = False  # EOS consumed (never fed to the matcher: it does not count it as a token)
        self._bitmask: torch.Tensor | None = None
        self._allowed: np.ndarray | None = None
        byte_id = drafter.vocab.id_of_bytes
        self._byte_ids: list[int | None] = [byte_id.get(bytes([b])) for b in range(256)]

    def __repr__(self) -> str:
        return f"Constraint({self.grammar.kind}, {len(self.ids)} ids, can_stop={self.can_stop()})"

    # -- the mask --------------------------------------------------------------------------------------
    def bitmask(self) -> torch.Tensor:
        """[ceil(V/32)] int32 on the CPU: bit i of word w set = id 32w+i allowed next (llguidance's layout)."""
        if self._bitmask is None:
            bitmask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
            if not self._ended:
                self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
                self._check()
            self._bitmask = bitmask
        return self._bitmask

    def allowed(self) -> np.ndarray:
        """[V] bool, read-only: which drafter ids may come next (EOS ids only where the grammar accepts)."""
        if self._allowed is None:
            bits = np.unpackbits(self.bitmask().numpy().view(np.uint8), bitorder="little")
            self._allowed = bits[: self.vocab_size].view(np.bool_)
            self._allowed.flags.writeable = False  # cached for this state: read it, never change it
        return self._allowed

    def bias(self, device: torch.device | str | None = None, width: int | None = None) -> torch.Tensor:
        """[width] float32: 0 for allowed ids, -inf for the rest (columns past the vocabulary too).

        Built from the bitmask with integer ops (the -inf bit pattern), on `device`: only the 4-bytes-per-32-ids
        bitmask crosses to an accelerator."""
        width = self.vocab_size if width is None else width
        flat = bias_of_bitmask(self.bitmask(), device)[: min(width, self.vocab_size)]
        if width > flat.shape[0]:
            flat = torch.cat([flat, torch.full((width - flat.shape[0],), float("-inf"), device=flat.device)])
        return flat

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` ([..., V], any device and float dtype) with every disallowed id at -inf (a new tensor).

        Apply it to the drafter's *raw* logits, before temperature / top-p: masking after top-p could leave
        no token at all."""
        bias = self.bias(logits.device, logits.shape[-1])
        return logits + bias.to(logits.dtype)

    # -- checks without consuming ----------------------------------------------------------------------
    def valid_prefix(self, ids: Sequence[int]) -> int:
        """How many leading ids of `ids` are a valid continuation of the current state (EOS counts where
        the text before it completes the grammar; nothing counts after it)."""
        if self._ended:
            return 0
        ids = list(ids)
        text_ids = ids
        for i, tid in enumerate(ids):
            if tid in self.eos_ids or not 0 <= tid < self.vocab_size:
                text_ids = ids[:i]
                break
        n = self._matcher.validate_tokens(text_ids) if text_ids else 0
        if n < len(text_ids) or len(text_ids) == len(ids) or ids[len(text_ids)] not in self.eos_ids:
            return n
        if not text_ids:
            return int(self._matcher.is_accepting())
        self._matcher.consume_tokens(text_ids)
        accepting = self._matcher.is_accepting()
        self._matcher.rollback(len(text_ids))
        return len(text_ids) + int(accepting)

    def allows(self, ids: Sequence[int]) -> bool:
        """Whether all of `ids` may follow the current state (they are not consumed)."""
        return self.valid_prefix(ids) == len(ids)

    def allows_text(self, data: bytes) -> bool:
        """Whether the bytes `data` may follow the current state, however the drafter would tokenize them
        (the grammar works on bytes: any spelling of valid bytes is valid). Checked as single-byte ids,
        which byte-level BPE and SentencePiece byte fallback both have."""
        if not data:
            return True
        spelled = [self._byte_ids[b] for b in data]
        if None in spelled:  # a vocabulary without every byte: the drafter's own tokenization
            try:
                ids = self.drafter.vocab.encode(data)[0]
            except InputError:
                return False
        else:
            ids = cast("list[int]", spelled)  # no None in it: checked just above
        return not self._ended and self._matcher.validate_tokens(ids) == len(ids)

    def allows_strings(self, strings: Sequence[bytes] | Candidates, only: np.ndarray | None = None) -> np.ndarray:
        """[C] bool: which candidate strings may follow, as `aggregation` spells them (b"" = EOS).

        A string that is one drafter token is read off the mask (vectorised); others are checked byte by
        byte. `only` ([C] bool): check just these (e.g. the candidates with probability > 0); the rest
        count as not allowed. Pass a `Candidates` built once for a list checked again and again."""
        table = strings if isinstance(strings, Candidates) else Candidates(strings, self.drafter)
        allowed = self.allowed()
        out = np.zeros(len(table.strings), dtype=np.bool_)
        out[table.single_at] = allowed[table.single_ids]
        out[table.eos_at] = self.can_stop()
        # a longer string can only be allowed where its longest spelled prefix is: a vectorised first cut
        head = table.multi_head
        keep = (head < 0) | allowed[np.maximum(head, 0)]
        if only is not None:
            only = np.asarray(only, dtype=np.bool_)
            keep &= only[table.multi_at]
            out &= only
        validate = self._matcher.validate_tokens
        for j in np.flatnonzero(keep).tolist() if not self._ended else []:
            ids = table.multi_bytes[j]
            at = int(table.multi_at[j])
            out[at] = validate(ids) == len(ids) if ids is not None else self.allows_text(table.strings[at])
        return out

    def can_stop(self) -> bool:
        """Whether EOS may come next (the text so far is complete for the grammar)."""
        return not self._ended and self._matcher.is_accepting()

    def must_stop(self) -> bool:
        """Whether EOS is the only id allowed next (the grammar can take no more text)."""
        return not self._ended and self._matcher.is_stopped()

    def is_finished(self) -> bool:
        """Whether EOS has been consumed."""
        return self._ended

    def forced_text(self) -> bytes:
        """Bytes the grammar forces next whatever is chosen (e.g. the rest of a fixed key); b"" if none."""
        return b"" if self._ended else bytes(self._matcher.compute_ff_bytes())

    # -- state changes ---------------------------------------------------------------------------------
    def consume(self, ids: Sequence[int]) -> None:
        """Advance past `ids` (accepted or drafted ids). All or nothing: ConstraintError if any is not allowed."""
        ids = list(ids)
        n = self.valid_prefix(ids)
        if n < len(ids):
            bad = ids[n]
            spelled = self.drafter.token_bytes[bad] if 0 <= bad < self.vocab_size else None
            raise ConstraintError(
                f"drafter id {bad} ({spelled!r}) at position {n} of {ids} is not allowed by the {self.grammar.kind} "
                f"constraint after {len(self.ids)} ids; mask the drafter's logits with Constraint.mask_logits "
                "and filter ensemble candidates with mask_distribution"
            )
        text_ids = [t for t in ids if t not in self.eos_ids]
        if text_ids and not self._matcher.consume_tokens(text_ids):
            self._check()
        self.ids += ids
        self._ended = self._ended or len(text_ids) < len(ids)
        self._changed()

    def rollback(self, n: int) -> None:
        """Forget the last `n` consumed ids (a discarded tail of the draft)."""
        if not 0 <= n <= len(self.ids):
            raise ConstraintError(f"cannot roll back {n} ids: the constraint has consumed {len(self.ids)}")
        if n == 0:
            return
        dropped = self.ids[-n:]
        text = sum(1 for t in dropped if t not in self.eos_ids)
        if text and not self._matcher.rollback(text):
            self._check()
        del self.ids[-n:]
        self._ended = False  # EOS can only be the last id consumed, so it went first
        self._changed()

    def reset(self) -> None:
        """Back to the start of the grammar (nothing consumed)."""
        self._matcher.reset()
        self.ids = []
        self._ended = False
        self._changed()

    def fork(self) -> Constraint:
        """An independent copy in the same state (µs: the compiled grammar is shared)."""
        twin = Constraint(self.grammar, self.drafter, _matcher=self._matcher.deep_copy())
        twin.ids = list(self.ids)
        twin._ended = self._ended
        return twin

    def _changed(self) -> None:
        self._bitmask = None
        self._allowed = None

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"{self.grammar.kind} constraint failed: {self._matcher.get_error()}")


# -- ensemble points -------------------------------------------------------------------------------------
class Candidates:
    """Candidate strings prepared for repeated checks: each one's single drafter token, if it is one.

    Build it once for a list that comes back at every ensemble point (GaC's whole union vocabulary,
    `UnionVocab.strings`: 157k strings for Qwen + Llama-2, 5.6k of them not one Qwen token); a short
    UniTE candidate list can be passed as a plain list."""

    def __init__(self, strings: Sequence[bytes], drafter: DrafterVocab) -> None:
        self.strings = list(strings)
        single = drafter.vocab.id_of_bytes
        size = len(drafter.token_bytes)
        ids = np.array([single.get(s, -1) if s else -2 for s in self.strings], dtype=np.int64)
        ids[ids >= size] = -1
        self.single_at = np.flatnonzero(ids >= 0)
        self.single_ids = ids[self.single_at]
        self.eos_at = np.flatnonzero(ids == -2)
        self.multi_at = np.flatnonzero(ids == -1)
        longer = [self.strings[i] for i in self.multi_at.tolist()]
        heads = np.array([_head(s, single) for s in longer], dtype=np.int64)
        heads[heads >= size] = -1
        self.multi_head = heads  # the drafter token of each such string's longest spelled prefix (-1: none)
        byte_ids = [single.get(bytes([b])) for b in range(256)]
        spelled = ([byte_ids[b] for b in s] for s in longer)
        # each such string as single-byte ids, the way Constraint.allows_text checks it (None: a byte is missing)
        self.multi_bytes: list[list[int] | None] = [
            None if None in ids else cast("list[int]", ids)  # no None in it: checked in the same expression
            for ids in spelled
        ]


def _head(s: bytes, single: Mapping[bytes, int]) -> int:
    for k in range(len(s) - 1, 0, -1):
        tid = single.get(s[:k])
        if tid is not None:
            return tid
    return -1


def mask_distribution(
    strings: Sequence[bytes] | Candidates, probs: torch.Tensor, constraint: Constraint
) -> torch.Tensor | None:
    """The ensemble distribution over candidate strings restricted to what the constraint allows.

    Contract (for `decision.Judge`): `strings` are candidates as `aggregation.Distribution` holds them
    (bytes; `aggregation.EOS` = b"" is end of sequence), or a `Candidates` built from them once, and
    `probs` their probabilities ([C], any float dtype and device: `Distribution.probs`, sharpened scores
    or GaC's `union_probs`). The constraint must be at the ensemble point: rolled back to the drafted
    position being judged (accepted text + the draft before it). Returns a new [C] tensor of `probs`'
    dtype, on the CPU: forbidden candidates 0, the rest renormalised to sum 1; candidates with probability
    0 are not checked (they stay 0). None when no candidate with probability > 0 is allowed: keep the
    drafted token then (drawn from the masked drafter row, it is allowed).

    Exactness with sampling: use the result as the target P and the *masked* drafter row as q; the pick
    then follows the masked, renormalised P.
    """
    weights = probs.detach().cpu().double().numpy()
    kept = np.where(constraint.allows_strings(strings, only=weights > 0), weights, 0.0)
    total = float(kept.sum())
    if not total > 0:
        return None
    return torch.from_numpy(kept / total).to(probs.dtype)
