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

With async decode (the GPU default) the none and all mixes run again in lockstep (async
decode off): what launching steps ahead saves, and how constrained batches stepped before
issue 25's fix (a constrained row kept its whole batch in lockstep: at 8B shapes, greedy,
batch 64, +35%). Then (--profile-steps, 0: off) a torch.profiler summary of a few steady
steps of the none, all and all-lockstep mixes: wall and GPU-busy time per step, the top
CUDA kernels and CPU ops, and the CUDA runtime calls per step (synchronisations, copies,
graph and kernel launches), so the run explains where a step's time goes.

Needs only what the engine needs on the GPU machine plus the ``llguidance`` wheel
(abi3, no dependencies); ``xgrammar`` is not used here.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time

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
    harness.Figure("batch 64: step time added, half constrained", "%",
                   ("runs", {"batch": 64}, "step_added_pct", "half"), format=".2f"),
    harness.Figure("batch 64: step time added, all constrained in lockstep (before the fix)",
                   "%", ("runs", {"batch": 64}, "step_added_pct", "all_lockstep"),
                   format=".2f"),
]
# CUDA runtime calls counted per profiled step (the profiler records them as CPU events)
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                 "cudaMemcpyAsync", "cudaMemcpy", "cudaHostAlloc", "cudaMallocHost",
                 "cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaEventRecord", "cudaStreamWaitEvent")


def _dev_us(e) -> float:
    return (getattr(e, "self_device_time_total", None)
            or getattr(e, "self_cuda_time_total", 0) or 0)


def summarize(prof, wall_s: float, steps: int, top: int = 12) -> dict:
    """Per step: wall time, GPU-busy time (kernels and copies, one stream), the CUDA
    runtime calls; the top CUDA kernels by device time and CPU ops by self CPU time."""
    avg = prof.key_averages()
    dev = [e for e in avg if _dev_us(e) > 0]
    busy_us = sum(_dev_us(e) for e in dev)
    per = 1.0 / steps
    calls = {e.key: {"per_step": round(e.count * per, 2),
                     "cpu_us_per_step": round(e.self_cpu_time_total * per, 1)}
             for e in avg if e.key in RUNTIME_CALLS}
    return {
        "steps": steps, "wall_ms_per_step": round(1e3 * wall_s * per, 3),
        "gpu_busy_ms_per_step": round(busy_us * per / 1e3, 3),
        "gpu_idle_pct": round(100 * max(0.0, 1 - busy_us / 1e6 / wall_s), 1),
        "runtime_calls": calls,
        "top_cuda": [{"name": e.key[:90], "count_per_step": round(e.count * per, 2),
                      "us_per_step": round(_dev_us(e) * per, 1)}
                     for e in sorted(dev, key=_dev_us, reverse=True)[:top]],
        "top_cpu": [{"name": e.key[:90], "count_per_step": round(e.count * per, 2),
                     "self_us_per_step": round(e.self_cpu_time_total * per, 1)}
                    for e in sorted(avg, key=lambda e: e.self_cpu_time_total,
                                    reverse=True)[:top]]}


def profile_section(eng, a) -> dict:
    """torch.profiler over --profile-steps steady steps of the none, all and all-lockstep
    mixes (after 4 steps; the rest of each mix is aborted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = eng.runner.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {}
    for name, (k, ls) in structured_cpu.mixes_of(eng, a.batch).items():
        if name not in ("none", "all", "all_lockstep"):
            continue
        with structured_cpu.lockstep(eng, ls):
            ids = structured_cpu.add_mix(eng, a, k, f"prof-{name}")
            for _ in range(4):
                eng.step()
            sync()
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(a.profile_steps):
                    eng.step()
                sync()
                wall = time.perf_counter() - t0
            for rid in ids:
                eng.abort(rid)
            while eng.has_work:
                eng.step()
        res[name] = summarize(prof, wall, a.profile_steps)
        r = res[name]
        print(f"profile {name}: {r['wall_ms_per_step']} ms/step, GPU busy "
              f"{r['gpu_busy_ms_per_step']} ms, idle {r['gpu_idle_pct']}%, calls/step "
              f"{ {c: v['per_step'] for c, v in r['runtime_calls'].items()} }", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.structured_gpu",
                                 description=__doc__.splitlines()[0])
    structured_cpu.add_step_args(ap, 64)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="steps profiled per mix (torch.profiler); 0: no profile")
    ap.set_defaults(device="cuda", steps=64, repeats=5, mask_repeats=200)
    harness.add_output_args(ap, "structured_gpu")
    a = ap.parse_args(argv)
    import torch
    ran = set(a.batches)  # a run of some batches only records the figures it measured
    figures = [f for f in FIGURES if f.path[1]["batch"] in ran]
    rec = harness.Recorder.start("structured_gpu", a, argv=argv, about=__doc__,
                                 figures=figures, cuda=True)
    rec["runs"] = []
    for b in a.batches:
        one = copy.copy(a)
        one.batch = b
        eng = structured_cpu._engine(one)
        run = structured_cpu.steps_section(one, eng)
        rec["runs"].append(run)
        rec.save()
        if a.profile_steps:
            try:
                run["profile"] = profile_section(eng, one)
            except Exception as e:  # the figures above stand without it
                run["profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            rec.save()
        del eng  # before the next batch's engine takes the GPU's memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
