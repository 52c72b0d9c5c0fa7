"""Host cost of streaming detokenization per generated token, by output length (CPU).

    python3 -m bench.detokenizer_cpu --set cpu-mybox

Streams 4,000 tokens of real text (README.md through the SmolLM2 tokenizer) through
engine.detokenizer.IncrementalDetokenizer, with and without a stop string, and through the
previous method (decode the whole output at every token) for comparison; reports the mean
cost per token over each 500-token stretch. The engine pays this once per request per step,
so at batch B a step's host time grows by B times it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from engine.detokenizer import IncrementalDetokenizer
from engine.loader import load_tokenizer
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("incremental, tokens 3500-4000", "us/token",
                   ("us_per_token_by_stretch", "incremental", -1)),
    harness.Figure("incremental with a stop string, tokens 3500-4000", "us/token",
                   ("us_per_token_by_stretch", "incremental_with_stop", -1)),
    harness.Figure("whole-output decode (the method before), tokens 3500-4000", "us/token",
                   ("us_per_token_by_stretch", "whole_output_decode", -1)),
]


class WholeOutputDecode:
    """The method before: decode every id at every token (no stop strings)."""

    def __init__(self, tok):
        self.tok, self.ids, self.n = tok, [], 0

    def add(self, t):
        self.ids.append(t)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return "", False
        out, self.n = full[self.n:], len(full)
        return out, False


def per_stretch(d, ids, stretch=500):
    out, times = [], []
    for t in ids:
        a = time.perf_counter()
        d.add(t)
        times.append(time.perf_counter() - a)
    for i in range(0, len(times), stretch):
        chunk = times[i:i + stretch]
        out.append(round(sum(chunk) / len(chunk) * 1e6, 2))
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.detokenizer_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    harness.add_output_args(ap, "detokenizer_cpu")
    args = ap.parse_args(argv)
    rec = harness.Recorder.start("detokenizer_cpu", args, argv=argv, about=__doc__,
                                 figures=FIGURES)
    tok = load_tokenizer("smollm2-135m")
    text = (harness.REPO / "README.md").read_text() * 4
    ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
    rec["tokens"] = len(ids)
    rec["stretch_tokens"] = 500
    rec["us_per_token_by_stretch"] = {
        "incremental": per_stretch(IncrementalDetokenizer(tok), ids),
        "incremental_with_stop": per_stretch(IncrementalDetokenizer(tok, ("\n\n$$$",)), ids),
        "whole_output_decode": per_stretch(WholeOutputDecode(tok), ids)}
    print(json.dumps(rec["us_per_token_by_stretch"], indent=1))
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
