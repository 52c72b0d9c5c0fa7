"""Incremental detokenization against the obvious reference (decode everything each step)."""
from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.loader import load_tokenizer


class FullDecodeReference:
    """What the detokenizer must produce: decode all ids every step (quadratic, but plain)."""

    def __init__(self, tok, stop=()):
        self.tok, self.stop, self.ids, self.text = tok, stop, [], ""

    def add(self, t):
        self.ids.append(t)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return "", False
        old = len(self.text)
        cuts = [j for j in (full.find(s) for s in self.stop) if j != -1]
        if cuts:
            self.text = full[:min(cuts)]
            return self.text[old:], True
        hold = max((k for s in self.stop for k in range(1, len(s))
                    if full.endswith(s[:k])), default=0)
        release = full[:len(full) - hold]
        if len(release) < old:
            return "", False
        self.text = release
        return release[old:], False

    def flush(self):
        full = self.tok.decode(self.ids)
        delta = full[len(self.text):]
        self.text = full
        return delta


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


class Counting:
    """A tokenizer that records the length of every id list it is asked to decode."""

    def __init__(self, tok, sizes):
        self.tok, self.sizes = tok, sizes

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def _stream(d, ids):
    parts, hit = [], False
    for t in ids:
        delta, hit = d.add(t)
        parts.append(delta)
        if hit:
            break
    if not hit:
        parts.append(d.flush())
    return parts, hit


TEXTS = ["Hello, world! The café serves crème brûlée.", "日本語のテキストと絵文字 😀👍🏽 mixed in",
         "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))", "  leading spaces and\ttabs  "]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    parts, _ = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(parts) == tok.decode(ids) == text
    ref, _ = _stream(FullDecodeReference(tok), ids)
    assert parts == ref  # same deltas at the same steps


def test_random_tokens_and_stop_strings_match_the_reference(tok):
    rng = random.Random(0)
    vocab = tok.vocab_size
    for trial in range(60):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        else:
            text = rng.choice(TEXTS) * 3
            ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        stop = ()
        if trial % 3 and len(full) > 4:
            a = rng.randrange(len(full) - 2)
            stop = (full[a:a + rng.randrange(1, 5)].replace("\ufffd", "") or "zz", "never-seen")
        got = _stream(IncrementalDetokenizer(tok, stop), ids)
        want = _stream(FullDecodeReference(tok, stop), ids)
        assert got == want, (trial, ids, stop)


def test_tokens_without_text_do_not_grow_the_window():
    """Dummy models pair a 128k vocabulary with the byte tokenizer: most ids decode to ""."""
    from engine.loader.tokenizer import ByteTokenizer
    bt = ByteTokenizer()
    rng = random.Random(1)
    ids = [rng.randrange(128256) if i % 5 else rng.randrange(3, 259) for i in range(3000)]
    sizes = []
    d = IncrementalDetokenizer(Counting(bt, sizes), ("zq",))
    parts, _ = _stream(d, ids)
    # a window only grows while its text ends in an incomplete (here: invalid, random) UTF-8
    # sequence, until a byte that completes or breaks it: tens of tokens, never the output
    assert max(sizes) <= 64, max(sizes)
    assert parts == _stream(FullDecodeReference(bt, ("zq",)), ids)[0]


def test_cost_per_token_does_not_grow_with_the_output(tok):
    """Each step decodes a short window, not the whole output (which made a 4,000-token
    output cost ~0.5 ms per token here, ~100x the windowed decode)."""
    ids = tok.encode(" ".join(TEXTS) * 60, add_special_tokens=False)[:4000]
    window_sizes = []
    d = IncrementalDetokenizer(Counting(tok, window_sizes), ("###",))
    for t in ids:
        d.add(t)
    assert max(window_sizes) <= 16, max(window_sizes)
    assert d.text + d.flush() == tok.decode(ids)
