"""Streaming detokenization: token ids in, text deltas out, with stop strings.

Two stages, both O(1) amortised per token:

1. Decode. Only a short window of the latest tokens is decoded, never the
   whole output. The window is the tokens already released last time (the
   "prefix", kept as context because some decoders treat a sequence's first
   token differently) plus the tokens not yet released:

       window: [ prefix tokens | unreleased tokens ]
               ^ window start   ^ read offset

   The delta is decode(window) minus decode(prefix). While decode(window)
   ends in U+FFFD the last character is an incomplete UTF-8 sequence (an
   emoji split over byte tokens), so nothing is released and the window grows
   until it completes.

2. Stop strings. Decoded text that could still be the start of a stop string
   is held back, so a streaming client never sees a piece of one. When a stop
   string is complete, the text before it is released and the stream stops.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.model.tokenizer import ChatTokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one generated sequence; special tokens are left out of the text."""

    def __init__(self, tokenizer: ChatTokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._window: list[int] = []
        self._read_offset = 0  # window[:read_offset] is the released prefix
        self._prefix_text = ""  # decode(window[:read_offset])
        self._held = ""  # decoded text that might begin a stop string
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the text that can be shown now (often "")."""
        if self.stopped or token_id in self._tokenizer.special_token_ids:
            return ""
        self._window.append(token_id)
        text = self._tokenizer.decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text) :]
        # The unreleased tokens become the next prefix.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._tokenizer.decode(self._window)
        return self._apply_stops(delta)

    def flush(self) -> str:
        """Releases everything still held, at the end of the sequence."""
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self._window)
        delta = text[len(self._prefix_text) :]
        self._window.clear()
        self._read_offset = 0
        self._prefix_text = ""
        released = self._apply_stops(delta)
        if not self.stopped:
            released += self._held
            self._held = ""
        return released

    def _apply_stops(self, delta: str) -> str:
        if not self._stops:
            return delta
        text = self._held + delta
        # No stop string can start in text released earlier: its start would have been held.
        # The stop string that is complete first wins (then the one starting first), so the
        # result does not depend on how the text was cut into tokens.
        found = [(i + len(s), i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            _, index, stop = min(found)
            self.stopped = True
            self.stop_reason = stop
            self._held = ""
            return text[:index]
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper beginning of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
