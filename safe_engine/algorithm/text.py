"""The accepted text of one request: UTF-8 bytes in, decoded text and stop strings out.

Tokens arrive as bytes that may cut a character in two, and a stop string may span several tokens; both
are handled here so the decoder only appends bytes and asks whether a stop string was met.
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
