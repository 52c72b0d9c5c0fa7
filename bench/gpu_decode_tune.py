"""One device call for the batch-1 decode work (issue: 204 -> 230 tok/s on dummy:llama-3-8b).

    PYTHONUNBUFFERED=1 python3 bench/gpu_decode_tune.py --out-dir $OUT

In order, each guarded by the time left (--budget-s): the GPU tests; the full engine bench
(sections d,a,c,b) with the default settings (Triton GEMV chosen per shape at startup + fused
rotary/store_kv); then section a alone for the A/B variants: both off (the previous version),
fused rotary only, GEMV forced on every role. Prints a summary table last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = [  # name, env, sections
    ("full_default", {}, "d,a,c,b"),
    ("a_base", {"PDSERVE_GEMV": "off", "PDSERVE_FUSE_ROTARY": "0"}, "a"),
    ("a_rope_only", {"PDSERVE_GEMV": "off"}, "a"),
    ("a_gemv_force", {"PDSERVE_GEMV": "force"}, "a"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env0 = dict(os.environ, PYTHONPATH=root, PYTHONUNBUFFERED="1")
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if not args.skip_tests:
        with open(os.path.join(args.out_dir, "gpu_tests.log"), "w") as f:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"],
                               cwd=root, env=env0, stdout=f, stderr=subprocess.STDOUT)
        summary["gpu_tests_rc"] = r.returncode
        summary["gpu_tests_s"] = round(time.time() - t0, 1)
        print("gpu tests rc", r.returncode, summary["gpu_tests_s"], "s", flush=True)
    need = {"d,a,c,b": 150, "a": 60}
    for name, env, sections in VARIANTS:
        left = args.budget_s - (time.time() - t0)
        if left < need[sections]:
            summary[name] = f"skipped ({left:.0f} s left)"
            continue
        out = os.path.join(args.out_dir, f"{name}.json")
        t1 = time.time()
        r = subprocess.run([sys.executable, "bench/gpu_engine.py", "--out", out,
                            "--sections", sections], cwd=root, env=dict(env0, **env),
                           timeout=max(30, left - 5), capture_output=True, text=True)
        with open(os.path.join(args.out_dir, "variants.log"), "a") as f:
            f.write(f"===== {name} rc {r.returncode}\n" + r.stdout[-200000:]
                    + "\n--- stderr ---\n" + r.stderr[-50000:])
        row = {"rc": r.returncode, "s": round(time.time() - t1, 1)}
        if os.path.exists(out):
            R = json.load(open(out))
            a = R.get("a", {})
            row.update({k: a.get(k) for k in ("decode_tok_s_median", "e2e_tok_s_median",
                                               "graph_replay_ms_b1", "graph_replay_ms_b64",
                                               "graph_replay_ms_b256")})
            row["gemv_plan"] = {k: v.get("chosen") for k, v in (R.get("gemv_tuning") or {}).items()}
            if "c" in R:
                row["ttft_4096_ms"] = R["c"]["ttft_ms_median"]
            if "b" in R:
                row["b_out_tok_s"] = R["b"]["output_tok_s"]
            if "d" in R:
                row["d_exact"] = R["d"]["exact_prompts"]
        summary[name] = row
        print(name, row, flush=True)
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
