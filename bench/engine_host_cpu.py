"""Host time per decode step (everything but the model runner's launch), by batch (CPU).

    python3 -m bench.engine_host_cpu --set cpu-mybox
    python3 -m bench.engine_host_cpu --repo /path/to/an/older/checkout --out ...   (compare)
    python3 -m bench.engine_host_cpu --cases 8:16:4 --out /tmp/host.json            (quick)

dummy:tiny (its model is small, so the host share shows), greedy, ignore_eos: B requests of P
random prompt tokens are prefilled, then ``--steps`` decode steps are timed; the runner's
``launch`` (``execute`` in older checkouts) is timed separately and subtracted. The host part
(schedule, input lists, scheduler update, detokenize, stop checks, prefix-cache bookkeeping)
is what a GPU step pays on top of its graph replay unless async_decode hides it. Each case
runs in a child process that imports the engine of ``--repo`` (this checkout by default).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, unit, path) of harness.Figure: the harness is imported in the parent only, a child
# imports nothing but the engine of --repo (an older checkout may have no harness)
FIGURES_SPEC = [
    ("host time per step, 512 requests x 200-token prompts", "ms",
     ("cases", {"batch": 512}, "host_ms_per_step")),
    ("host time per step, 256 requests x 1000-token prompts", "ms",
     ("cases", {"batch": 256}, "host_ms_per_step")),
]


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

    def timed(s, *args, **kw):
        t = time.perf_counter()
        r = orig(s, *args, **kw)
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


def parse_args(argv=None) -> argparse.Namespace:
    from pdserve.benchlib import harness
    ap = argparse.ArgumentParser(prog="python3 -m bench.engine_host_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(harness.REPO),
                    help="checkout whose engine is measured (an older one to compare)")
    ap.add_argument("--cases", default="512:200:180,256:1000:60",
                    help="batch:prompt:steps,...")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # a child: one case, JSON on stdout
    harness.add_output_args(ap, "engine_host_cpu")
    return ap.parse_args(argv)


def run_case(repo: str, case: str) -> dict:
    """``case`` measured by a child whose import path starts at ``repo`` (its engine)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(repo))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case],
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    if argv is None and "--case" in sys.argv:  # a child: only the engine of --repo
        b, p, s = map(int, sys.argv[sys.argv.index("--case") + 1].split(":"))
        print(json.dumps(measure(b, p, s)))
        return
    from pdserve.benchlib import harness
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    figures = [harness.Figure(n, u, path) for n, u, path in FIGURES_SPEC]
    rec = harness.Recorder.start("engine_host_cpu", args, argv=argv, about=__doc__,
                                 figures=figures)
    rev = subprocess.run(["git", "-C", args.repo, "rev-parse", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    rec["measured_repo_commit"] = rev or None  # the engine measured (--repo)
    rec["cases"] = []
    for case in args.cases.split(","):
        r = run_case(args.repo, case)
        print(r, flush=True)
        rec["cases"].append(r)
        rec.save()
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
