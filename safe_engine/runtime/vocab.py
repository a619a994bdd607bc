"""Token ↔ bytes normalisation: the one place where tokenizer quirks are handled.

Alignment and aggregation work on the UTF-8 bytes of the shared text, so every token id needs the exact
bytes it contributes. Tokenizers spell those bytes differently:

- byte-level BPE (GPT-2, Qwen, SmolLM, Llama-3): each vocab character stands for one byte (`Ġ` = space);
- SentencePiece (Llama-2, Mistral, Gemma, InternLM): `▁` is a space and `<0xNN>` a raw byte;
- control tokens (`<|im_end|>`, `<eos>`) contribute no text at all.

`Vocab` turns each of these into plain bytes once per tokenizer, and `encode` produces token ids whose
bytes concatenate to exactly the encoded text (no SentencePiece dummy prefix), with their byte offsets.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import weakref
from bisect import bisect_left
from functools import cached_property
from itertools import accumulate

from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..errors import InputError

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SENTINEL = "\n"  # encoded before a text to absorb a SentencePiece dummy prefix, then dropped
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def tokenizer_lock(tokenizer) -> threading.RLock:
    """The lock every call into `tokenizer` holds.

    A fast tokenizer's `split_special_tokens` is backend state that each call sets before encoding, so two
    threads encoding with different settings race: one gets `<|im_end|>` as a control token instead of
    text, or "Already borrowed". Members may share one tokenizer object, hence one lock per tokenizer.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(tokenizer)
        if lock is None:
            lock = _LOCKS[tokenizer] = threading.RLock()
        return lock


def _is_byte_level(tokenizer) -> bool:
    """True when the tokenizer's decoder maps vocab characters to bytes (GPT-2-style BPE)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


class Vocab:
    """Byte spelling of every token id of one tokenizer, plus text ↔ ids with byte offsets."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = len(tokenizer)
        self.special_ids = frozenset(
            tid for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special
        ) | frozenset(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(list(range(self.size)))
        byte_of_char = {c: b for b, c in bytes_to_unicode().items()} if _is_byte_level(tokenizer) else None
        added = {tid: tok.content for tid, tok in tokenizer.added_tokens_decoder.items()}
        self.token_bytes: list[bytes | None] = []
        self._byte_tokens: set[int] = set()  # SentencePiece byte-fallback ids (`<0xNN>`)
        for tid, piece in enumerate(pieces):
            if tid in self.special_ids or piece is None:
                self.token_bytes.append(None)  # control token: no text
            elif tid in added:
                self.token_bytes.append(added[tid].encode())
            elif byte_of_char is not None:
                self.token_bytes.append(bytes(byte_of_char.get(c, 0) for c in piece))
            elif m := _BYTE_TOKEN.match(piece):
                self.token_bytes.append(bytes([int(m.group(1), 16)]))
                self._byte_tokens.add(tid)
            else:
                self.token_bytes.append(piece.replace("▁", " ").encode())
        self.adds_dummy_prefix = self._bytes_of(self._raw_encode("a")) == b" a"
        self._sentinel_ids = self._raw_encode(_SENTINEL) if self.adds_dummy_prefix else []
        self._first_ids: dict[bytes, int | None] = {}

    @cached_property
    def id_of_bytes(self) -> dict[bytes, int]:
        """Token id of each byte string that is a single token.

        Where two ids spell the same bytes (SentencePiece `▁` and `<0x20>`), the ordinary piece wins,
        as it does in the tokenizer's own encoding.
        """
        table: dict[bytes, int] = {}
        for tid, b in enumerate(self.token_bytes):
            if b and (b not in table or table[b] in self._byte_tokens):
                table[b] = tid
        return table

    @cached_property
    def ids_of_bytes(self) -> dict[bytes, list[int]]:
        """Every token id that spells each byte string (speculative sampling needs the mass of all of them)."""
        table: dict[bytes, list[int]] = {}
        for tid, b in enumerate(self.token_bytes):
            if b:
                table.setdefault(b, []).append(tid)
        return table

    @cached_property
    def _sorted_spellings(self) -> tuple[list[bytes], list[int]]:
        pairs = sorted((b, tid) for tid, b in enumerate(self.token_bytes) if b)
        return [b for b, _ in pairs], [tid for _, tid in pairs]

    def extensions(self, data: bytes) -> tuple[list[bytes], list[int]]:
        """Spellings and ids of every token whose bytes start with `data` (`data` itself included), found
        by two bisections of the sorted spellings (a lone space starts tens of thousands of tokens)."""
        spellings, ids = self._sorted_spellings
        lo = bisect_left(spellings, data)
        hi = bisect_left(spellings, _successor(data), lo) if data.rstrip(b"\xff") else len(spellings)
        return spellings[lo:hi], ids[lo:hi]

    def consistent_ids(self, data: bytes) -> list[int]:
        """Ids of every token that could start text beginning with `data`: tokens that extend `data`
        (" Incorrect" for " Inc") and tokens that are a proper prefix of it (" In")."""
        out = list(self.extensions(data)[1])
        for k in range(1, len(data)):
            tid = self.id_of_bytes.get(data[:k])
            if tid is not None:
                out.append(tid)
        return out

    def first_id(self, data: bytes) -> int | None:
        """The token this tokenizer would start `data` with (None if it cannot spell it); memoised."""
        memo = self._first_ids  # read once: another thread may swap in a fresh dict between check and read
        if data in memo:
            return memo[data]
        try:
            ids, _ = self.encode(data)
        except InputError:
            ids = []
        first = ids[0] if ids else None
        if len(self._first_ids) > 200_000:  # bounded: candidate strings of a long-lived service
            self._first_ids = {}
        self._first_ids[data] = first
        return first

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the byte spelling of the whole vocabulary; equal for copies of one tokenizer."""
        digest = hashlib.sha256()
        for b in self.token_bytes:
            digest.update(b"\xff" if b is None else len(b).to_bytes(2, "little") + b)
        return digest.hexdigest()

    def _raw_encode(self, text: str, control_tokens: bool = False) -> list[int]:
        with tokenizer_lock(self.tokenizer):
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=not control_tokens)["input_ids"]

    def _bytes_of(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] or b"" for i in ids)

    def encode_text(self, text: str, control_tokens: bool = False) -> list[int]:
        """Ids that continue a sequence with exactly `text` (no dummy prefix space).

        Control-token strings such as `<|im_end|>` stay plain text unless `control_tokens` is set
        (only chat templates set it, for the control tokens they write themselves).
        """
        if not text:
            return []
        if not self.adds_dummy_prefix:
            return self._raw_encode(text, control_tokens)
        n = len(self._sentinel_ids)
        ids = self._raw_encode(_SENTINEL + text, control_tokens)
        if ids[:n] == self._sentinel_ids:
            return ids[n:]
        ids = self._raw_encode(text, control_tokens)  # sentinel merged with the text: strip the dummy space instead
        first = self.token_bytes[ids[0]] or b""
        if first.startswith(b" ") and not text.startswith(" "):
            rest = first[1:]
            return ([self.id_of_bytes[rest]] if rest else []) + ids[1:]
        return ids

    def encode(self, data: bytes) -> tuple[list[int], list[int]]:
        """Token ids for `data` and the byte offset at which each token starts.

        Valid UTF-8 runs are tokenized as text; bytes that are not valid UTF-8 (a character cut by a
        byte-level token) become single-byte tokens, which byte-level BPE and SentencePiece byte
        fallback both have. A token that does not start on a boundary of the original text (after
        the tokenizer normalised it, e.g. NFC) repeats the previous token's start.
        """
        ids: list[int] = []
        starts: list[int] = []
        offset = 0
        for run, is_text in _utf8_runs(data):
            if is_text:
                text = run.decode()
                run_ids = self.encode_text(text)
                if self._bytes_of(run_ids) == run:
                    run_starts = token_starts(self, run_ids)
                else:  # the tokenizer normalised the text: take offsets from the tokenizer itself
                    run_ids, run_starts = self._encode_with_offsets(text)
            else:
                run_ids = [self._byte_token(byte) for byte in run]
                run_starts = list(range(len(run)))
            ids += run_ids
            starts += [offset + s for s in run_starts]
            offset += len(run)
        return ids, starts

    def _byte_token(self, byte: int) -> int:
        tid = self.id_of_bytes.get(bytes([byte]))
        if tid is None:
            raise InputError(
                f"tokenizer {type(self.tokenizer).__name__} has no token for byte 0x{byte:02x}; "
                "it cannot represent this text"
            )
        return tid

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Ids of a text the tokenizer normalises, with byte starts mapped back to the original text."""
        prefix = _SENTINEL if self.adds_dummy_prefix else ""
        with tokenizer_lock(self.tokenizer):
            enc = self.tokenizer(
                prefix + text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
            )
        ids, spans = list(enc["input_ids"]), list(enc["offset_mapping"])
        skip = len(self._sentinel_ids) if prefix and ids[: len(self._sentinel_ids)] == self._sentinel_ids else 0
        byte_at = [0, *accumulate(len(c.encode()) for c in text)]  # char index -> byte offset
        starts: list[int] = []
        for char_start, _ in spans[skip:]:
            char_start = min(max(char_start - len(prefix), 0), len(text))
            start = byte_at[char_start]
            starts.append(max(start, starts[-1]) if starts else start)
        return ids[skip:], starts


def _successor(data: bytes) -> bytes:
    """The smallest byte string above every string that starts with `data` (which has a byte below 0xff)."""
    head = data.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1])


def token_starts(vocab: Vocab, ids: list[int]) -> list[int]:
    """Byte offset at which each token starts when the tokens are concatenated."""
    starts, offset = [], 0
    for tid in ids:
        starts.append(offset)
        offset += len(vocab.token_bytes[tid] or b"")
    return starts


def _utf8_runs(data: bytes) -> list[tuple[bytes, bool]]:
    """Split bytes into maximal valid-UTF-8 runs (True) and runs of undecodable bytes (False)."""
    runs: list[tuple[bytes, bool]] = []
    pos = 0
    while pos < len(data):
        try:
            data[pos:].decode()
            runs.append((data[pos:], True))
            break
        except UnicodeDecodeError as err:
            if err.start:
                runs.append((data[pos : pos + err.start], True))
            bad_end = pos + err.end
            runs.append((data[pos + err.start : bad_end], False))
            pos = bad_end
    return runs
