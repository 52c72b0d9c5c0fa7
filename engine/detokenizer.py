"""Incremental detokenization and stop-string detection for one request.

Byte-level BPE tokens can end mid-character: text is only released once it no longer ends in
an incomplete UTF-8 sequence (U+FFFD), so streamed deltas concatenate to the final text.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # text released so far
        self.max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; returns (newly released text, hit a stop string)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        if full.endswith("\ufffd"):
            return "", False
        old_len = len(self.text)
        if self.stop:
            search_from = max(0, old_len - self.max_stop + 1)
            cut = -1
            for s in self.stop:
                j = full.find(s, search_from)
                if j != -1 and (cut == -1 or j < cut):
                    cut = j
            if cut != -1:
                self.text = full[:cut]
                return self.text[old_len:], True
        # hold back a tail that could still grow into a stop string
        hold = 0
        if self.stop:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        release = full[:len(full) - hold] if hold else full
        if len(release) < old_len:
            return "", False
        self.text = release
        return release[old_len:], False

    def flush(self) -> str:
        """At the end: release whatever was held back (no stop string matched)."""
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta
