"""The accepted text of one request: UTF-8 bytes in, decoded text and stop strings out.

Tokens arrive as bytes that may cut a character in two, and a stop string may span several tokens; both
are handled here so the decoder only appends bytes and asks whether a stop string was met, or (the loop
guard) whether the text has started to repeat itself.
"""

from __future__ import annotations

import codecs


class TextBuffer:
    """Accepted bytes, their decoded text (cut before a stop string once one appears), and what is safe
    to show while decoding goes on."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = stop
        self.data = bytearray()
        self.text = ""
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._longest_stop = max((len(s) for s in stop), default=0)

    def __len__(self) -> int:
        return len(self.data)

    def append(self, data: bytes, final: bool = False) -> bool:
        """Add bytes (`final`: no more follow, so a cut character becomes U+FFFD); True once a stop string
        appears, the text then ends right before it."""
        if self.stopped:
            return True
        self.data += data
        before = len(self.text)
        self.text += self._decoder.decode(data, final=final)
        window_start = max(0, before - self._longest_stop + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def truncate(self, size: int) -> None:
        """Keep the first `size` bytes (loop steering goes back to an earlier token); no stop string is in them."""
        del self.data[size:]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = self._decoder.decode(bytes(self.data))

    def visible(self, finished: bool) -> str:
        """Text no later round can change: all of it once finished, else minus a possible stop prefix."""
        if finished:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]


LOOP_WINDOW = 8192  # bytes of the text's end the loop guard looks at (a repeated span of up to 1/repeats of it)


def ends_in_loop(data: bytes | bytearray, span: int, repeats: int) -> bool:
    """Whether `data` ends with one stretch of at least `span` bytes repeated `repeats` times in a row."""
    return loop_period(data, span, repeats) is not None


DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")


def loop_period(data: bytes | bytearray, span: int, repeats: int, digits_equal: bool = False) -> int | None:
    """The period, in bytes, of the repetition `data` ends in (one stretch of at least `span` bytes repeated
    `repeats` times in a row), or None. With `digits_equal`, all digits count as one: a numbered list whose
    lines repeat ("13. **Step 13: ...", "14. **Step 14: ...") is a loop although no two lines are the same
    (most GSM8K loops of the accuracy study).

    Why this shape: a greedy model that loops repeats a sentence or a paragraph until the budget ends it
    (the accuracy study's looping answers: periods of 4 to 265 characters). A shorter period counts through
    its multiples (a 4-byte loop is also a 32-byte one), so `span` bounds how much pure repetition is
    needed, never the loop's own period. Candidate periods are where the last `span` bytes occurred before;
    each is checked with one comparison (the end is periodic iff it equals itself shifted by the period).
    """
    n = len(data)
    if n < span * repeats:
        return None
    view = bytes(data[-LOOP_WINDOW:])
    if digits_equal:
        view = view.translate(DIGITS_AS_ZERO)
    n = len(view)
    tail = view[-span:]
    end = n - 1  # occurrences must end before the text does
    while (pos := view.rfind(tail, 0, end)) >= 0:
        period = n - span - pos
        if period * repeats > n:
            return None  # farther occurrences only mean longer periods
        if period >= span and view[n - repeats * period : n - period] == view[n - (repeats - 1) * period :]:
            return period
        end = pos + span - 1
    return None
