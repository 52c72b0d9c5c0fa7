"""Timing a GPU callable with CUDA events (the GPU benches under bench/)."""
from __future__ import annotations

import statistics


def event_median_s(fn, reps: int = 50, warm: int = 10) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event timed calls after ``warm`` calls
    (each call timed alone: recorded around it, waited for before the next)."""
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)
