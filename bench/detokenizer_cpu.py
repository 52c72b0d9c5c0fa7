"""Host cost of streaming detokenization per generated token, by output length (CPU).

    python bench/detokenizer_cpu.py --out bench/results/detokenizer_cpu.json

Streams 4,000 tokens of real text (README.md through the SmolLM2 tokenizer) through
engine.detokenizer.IncrementalDetokenizer, with and without a stop string, and through the
previous method (decode the whole output at every token) for comparison; reports the mean
cost per token over each 500-token stretch. The engine pays this once per request per step,
so at batch B a step's host time grows by B times it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from engine.loader import load_tokenizer  # noqa: E402


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
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args(argv)
    tok = load_tokenizer("smollm2-135m")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(here, "README.md")).read() * 4
    ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
    res = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(),
           "machine": platform.machine(), "tokens": len(ids), "stretch_tokens": 500,
           "us_per_token_by_stretch": {
               "incremental": per_stretch(IncrementalDetokenizer(tok), ids),
               "incremental_with_stop": per_stretch(IncrementalDetokenizer(tok, ("\n\n$$$",)),
                                                    ids),
               "whole_output_decode": per_stretch(WholeOutputDecode(tok), ids)}}
    print(json.dumps(res["us_per_token_by_stretch"], indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
