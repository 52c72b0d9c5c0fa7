"""Host time per decode step (everything but the model runner's launch), by batch (CPU).

    python bench/engine_host_cpu.py --out bench/results/engine_host_cpu.json
    python bench/engine_host_cpu.py --repo /path/to/an/older/checkout --out ...   (compare)

dummy:tiny (its model is small, so the host share shows), greedy, ignore_eos: B requests of P
random prompt tokens are prefilled, then ``--steps`` decode steps are timed; the runner's
``launch`` (``execute`` in older checkouts) is timed separately and subtracted. The host part
(schedule, input lists, scheduler update, detokenize, stop checks, prefix-cache bookkeeping)
is what a GPU step pays on top of its graph replay unless async_decode hides it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def measure(batch: int, prompt: int, steps: int) -> dict:
    import torch
    from engine import LLM, SamplingParams
    torch.set_num_threads(2)
    llm = LLM("dummy:tiny", block_size=16, num_blocks=40000, max_num_seqs=max(512, batch),
              max_num_batched_tokens=16384, max_model_len=4096)
    eng = llm.engine
    sp = SamplingParams(max_tokens=steps + 20, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(3, 500, (prompt,), generator=g).tolist(), sp)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                       for s in eng.scheduler.running):
        eng.step()
    name = "launch" if hasattr(eng.runner, "launch") else "execute"
    orig, spent = getattr(eng.runner, name), [0.0]

    def timed(s):
        t = time.perf_counter()
        r = orig(s)
        spent[0] += time.perf_counter() - t
        return r
    setattr(eng.runner, name, timed)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t0
    return {"batch": batch, "prompt": prompt, "steps": steps,
            "host_ms_per_step": round((total - spent[0]) / steps * 1e3, 3),
            "runner_ms_per_step": round(spent[0] / steps * 1e3, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--cases", default="512:200:180,256:1000:60",
                    help="batch:prompt:steps,...")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.repo))
    import subprocess
    rev = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    res = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(),
           "cpus": os.cpu_count(), "repo_commit": rev, "cases": []}
    for case in args.cases.split(","):
        b, p, s = map(int, case.split(":"))
        r = measure(b, p, s)
        print(r, flush=True)
        res["cases"].append(r)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
