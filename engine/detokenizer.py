"""Incremental detokenization and stop-string detection for one request.

Each new token costs a decode of a few tokens, not of the whole output: the text is extended
by decoding a short window that ends at the new token (``ids[prefix:]``) and taking what it
adds beyond the window's older part (``ids[prefix:read]``). Tokenizers decode a token's
leading space or byte run in the context of its neighbours, so the window keeps the tokens
since the last released text as context, the way streaming servers do it. Byte-level BPE
tokens can end mid-character: text is only released once it no longer ends in an incomplete
UTF-8 sequence (U+FFFD), so the streamed deltas concatenate to the final text.

Stop strings are searched only in the part of the text that could hold a new match, and a
tail that could still grow into a stop string is held back until it cannot.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.decoded = ""  # every complete character decoded so far
        self.released = 0  # how much of ``decoded`` has been handed out
        self.max_stop = max((len(s) for s in stop), default=0)
        self._prefix = 0  # window start: context for the tokens after ``_read``
        self._read = 0  # ids before this index are in ``decoded``

    @property
    def text(self) -> str:
        """The text released so far."""
        return self.decoded[:self.released]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _window_delta(self) -> str:
        """Text the ids after ``_read`` add (possibly ending in an incomplete character)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        return after[len(before):] if len(after) > len(before) else ""

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; returns (newly released text, hit a stop string)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        delta = self._window_delta()
        if delta.endswith("\ufffd"):
            return "", False  # a character still incomplete: wait for the next token
        old_len = len(self.decoded)
        self.decoded += delta
        self._prefix, self._read = self._read, len(self.ids)
        if not delta:  # e.g. a skipped special token: nothing new (the window moves on)
            return "", False
        full = self.decoded
        if self.stop:
            search_from = max(0, min(old_len, self.released) - self.max_stop + 1)
            cut = -1
            for s in self.stop:
                j = full.find(s, search_from)
                if j != -1 and (cut == -1 or j < cut):
                    cut = j
            if cut != -1:
                out = full[self.released:cut] if cut > self.released else ""
                self.decoded = full[:cut]
                self.released = cut
                return out, True
        # hold back a tail that could still grow into a stop string
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = len(full) - hold
        if end <= self.released:
            return "", False
        out = full[self.released:end]
        self.released = end
        return out, False

    def flush(self) -> str:
        """At the end: release whatever was held back (no stop string matched), including an
        incomplete last character."""
        if self.tokenizer is None:
            return ""
        if self._read < len(self.ids):
            self.decoded += self._window_delta()
            self._prefix = self._read = len(self.ids)
        out = self.decoded[self.released:]
        self.released = len(self.decoded)
        return out
