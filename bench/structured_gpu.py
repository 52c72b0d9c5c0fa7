"""The structured-output mask per decode step on a GPU (issue 25, point 4: H200, batch 64
and 1). Not run by the CPU suite; the lead runs it on the GPU machine:

    python3 -m bench.structured_gpu --set h200                      (batch 64 and 1)
    python3 -m bench.structured_gpu --batches 64 --temperature 0 --set h200-greedy

For each batch size, bench.structured_cpu's step section on ``cuda``: LLMEngine (CUDA
graphs as served) decoding --batch rows of which none, one, half or all are constrained by
a grammar that never ends (llguidance, the engine's grammar engine), median step times of
the interleaved mixes, and the mask work of one step timed alone (bitmasks filled on the
host by the grammar engine's threads, copied and applied on the device). Targets: mask <=
5% of the step for constrained rows, <= 1% added for the unconstrained rows of the batch.

Needs only what the engine needs on the GPU machine plus the ``llguidance`` wheel
(abi3, no dependencies); ``xgrammar`` is not used here.
"""
from __future__ import annotations

import argparse
import copy
import sys

from bench import structured_cpu
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("batch 64: mask share of a step, all rows constrained", "%",
                   ("runs", {"batch": 64}, "mask_share_all_pct"), format=".2f"),
    harness.Figure("batch 64: step time added for unconstrained rows (half constrained)", "%",
                   ("runs", {"batch": 64}, "unconstrained_overhead_pct"), format=".2f"),
    harness.Figure("batch 1: mask share of a step, constrained", "%",
                   ("runs", {"batch": 1}, "mask_share_all_pct"), format=".2f"),
    # what the mask adds to a served step (the grammar engine's host work overlaps the
    # forward pass; the shares above time it alone)
    harness.Figure("batch 64: step time added, all rows constrained", "%",
                   ("runs", {"batch": 64}, "step_added_pct", "all"), format=".2f"),
    harness.Figure("batch 1: step time added, constrained", "%",
                   ("runs", {"batch": 1}, "step_added_pct", "all"), format=".2f"),
]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.structured_gpu",
                                 description=__doc__.splitlines()[0])
    structured_cpu.add_step_args(ap, 64)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1])
    ap.set_defaults(device="cuda", steps=64, repeats=5, mask_repeats=200)
    harness.add_output_args(ap, "structured_gpu")
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("structured_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=True)
    rec["runs"] = []
    for b in a.batches:
        one = copy.copy(a)
        one.batch = b
        rec["runs"].append(structured_cpu.steps_section(one))
        rec.save()
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
