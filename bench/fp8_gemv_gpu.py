"""fp8 (W8A8) projections of 1-16 rows at Llama-3-8B shapes: the a8 GEMV (fp8 codes converted
and multiplied in fp32, one program row per token) against the FP8 tensor-core GEMV
(matvec.gemv f8mma: every row in one pass over W, codes as stored), per config.

    python3 -m bench.fp8_gemv_gpu --set h200-mycommit            (one GPU, ~4 min)

Each candidate runs as the decode graph runs it: 32 calls on 32 distinct weight matrices (so
the codes stream from HBM), with the role's prologue fused, captured in one CUDA graph and
timed in turn with the others (engine.kernels.gemv_tune.time_round_robin). GB/s counts the
codes and channel scales. Every candidate's output is checked first against the torch
reference: the prologue in float32, act_fp8's codes of x and a float32 matmul of the codes
(max error relative to the largest output).
"""
from __future__ import annotations

import argparse
import sys

import torch

from engine.kernels import reference as R
from engine.kernels.gemv_tune import time_round_robin
from engine.kernels.matvec import gemv
from pdserve.benchlib import harness

LAYERS = 32
SHAPES = {"qkv": (6144, 4096, "add_rmsnorm"), "o": (4096, 4096, "none"),
          "gate_up": (28672, 4096, "add_rmsnorm"), "down": (4096, 14336, "silu_mul")}
# (block_n, block_k, num_warps, split_k, variant[, num_stages])
# "a8": the one-token GEMV as it runs now; "a8loop": its passes over x as block_k loops
# (gemv unroll=False, as before _row_stats); a sixth element: the software pipeline's depth
# (Triton's default, 3, where absent); "wo": the a8 GEMV
# weight-only (W8A16, a8 off, x not quantized: a diagnostic of what quantizing x in every
# program costs; its error against the W8A8 reference is not a defect); "xq": the a8 GEMV
# on codes written once for the call by the prologue's row-wise kernel (gemv xq; the
# timing includes that kernel)
A8 = [(8, 1024, 4, 1, "a8"), (16, 1024, 4, 1, "a8"), (16, 2048, 8, 1, "a8"),
      (8, 1024, 4, 1, "a8loop"), (16, 1024, 4, 1, "a8loop"), (16, 2048, 8, 1, "a8loop"),
      (8, 1024, 4, 1, "a8", 4), (16, 1024, 4, 1, "a8", 4),
      (8, 1024, 4, 1, "wo"), (16, 1024, 4, 1, "wo"),
      (8, 1024, 4, 1, "xq"), (16, 1024, 4, 1, "xq"), (8, 2048, 8, 1, "xq"),
      (16, 2048, 8, 1, "xq")]
F8 = [(64, 256, 4, 1, "f8mma"), (64, 512, 4, 1, "f8mma"), (128, 256, 4, 1, "f8mma"),
      (128, 256, 8, 1, "f8mma"), (128, 512, 8, 1, "f8mma"), (64, 256, 4, 2, "f8mma"),
      (64, 512, 4, 2, "f8mma"), (32, 512, 4, 1, "f8mma"), (32, 256, 4, 2, "f8mma"),
      (64, 128, 4, 4, "f8mma"), (64, 256, 4, 4, "f8mma"), (128, 256, 8, 2, "f8mma"),
      (64, 512, 4, 2, "f8mma", 4), (64, 512, 4, 2, "f8mma", 5), (64, 256, 4, 2, "f8mma", 5),
      (64, 256, 4, 4, "f8mma", 4), (128, 256, 8, 1, "f8mma", 4), (128, 256, 8, 1, "f8mma", 5),
      (64, 1024, 4, 2, "f8mma"), (64, 1024, 4, 1, "f8mma"), (128, 512, 8, 1, "f8mma", 2),
      (128, 128, 8, 2, "f8mma", 6)]
FIGURES = [harness.Figure(f"{role} batch 1, best f8mma / best a8 time", "x",
                          ("speedup", f"{role}/m1"), format=".2f") for role in SHAPES]


def run_role(role: str, m: int, rounds: int, variants=None) -> dict:
    from engine.quant import kernels as QK
    import engine.quant.reference as ref
    n, k, pro = SHAPES[role]
    dev, dt = "cuda", torch.bfloat16
    qws = [ref.quantize_fp8(torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5)
           for _ in range(LAYERS)]
    nws = [torch.rand(k, device=dev, dtype=dt) + 0.5 for _ in range(LAYERS)]
    kx = 2 * k if pro == "silu_mul" else k
    x = torch.randn(m, kx, device=dev, dtype=dt)
    res = torch.randn(m, kx, device=dev, dtype=dt)
    kw = lambda i: ({"residual": res, "norm_weight": nws[i], "eps": 1e-5}
                    if pro == "add_rmsnorm" else {})

    def call(i, cfg):
        bn, bk, nw, sk, var, *stages = cfg
        wkw = {**ref.gemv_keywords(qws[i]), **({"a8": False} if var.startswith("wo") else {})}
        got = gemv(x, qws[i]["q"], None, prologue=pro, block_n=bn, block_k=bk, num_warps=nw,
                   split_k=sk, pdl=True, num_stages=stages[0] if stages else None,
                   f8mma=var == "f8mma", unroll=var != "a8loop", xq=var == "xq", **wkw,
                   **kw(i))
        return got[0] if isinstance(got, tuple) else got

    h = R.gemv_ref(x.float(), torch.eye(k, device=dev), None, prologue=pro,
                   **{a: (b.float() if torch.is_tensor(b) else b) for a, b in kw(0).items()})
    h = (h[0] if isinstance(h, tuple) else h).to(dt)
    xq, sx = QK.act_fp8(h.contiguous())
    want = (xq.float() @ qws[0]["q"].float().t()) * sx * qws[0]["scale"][None, :]
    fns, errors, rejected = {}, {}, {}
    for cfg in A8 + F8:
        if variants and cfg[4] not in variants:
            continue
        if cfg[3] > 1 and k % (cfg[1] * cfg[3]):
            continue
        try:
            got = call(0, cfg).float()
            errors[str(cfg)] = ((got - want).abs().max() / want.abs().max()).item()
            fns[str(cfg)] = (lambda c: lambda: [call(i, c) for i in range(LAYERS)])(cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            rejected[str(cfg)] = f"{type(e).__name__}: {str(e)[:300]}"
    ms = time_round_robin(fns, rounds)
    nbytes = LAYERS * (n * k + 4 * n)
    rows = {c: {"ms": t, "gb_s": nbytes / t / 1e6, "max_rel_err": errors[c]}
            for c, t in ms.items()}
    best = {v: min(((c, r) for c, r in rows.items() if eval(c)[4] == v),  # noqa: S307
                   key=lambda cr: cr[1]["ms"], default=(None, None))
            for v in ("a8", "a8loop", "f8mma", "wo", "xq")}
    return {"role": role, "m": m, "n": n, "k": k, "prologue": pro, "configs": rows,
            "rejected": rejected, "best": {v: c for v, (c, _) in best.items()},
            "speedup": (best["a8"][1]["ms"] / best["f8mma"][1]["ms"]
                        if best["a8"][0] and best["f8mma"][0] else None)}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.fp8_gemv_gpu")
    ap.add_argument("--roles", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4,8", help="tokens per call (comma list, <= 16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variants", default=None,
                    help="comma list of the variants to time (default: all)")
    harness.add_output_args(ap, "fp8_gemv_gpu")
    args = ap.parse_args(argv)
    rec = harness.Recorder.start("fp8_gemv_gpu", args, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=True)
    rec["cases"], rec["speedup"] = [], {}
    for m in [int(v) for v in args.rows.split(",")]:
        for role in args.roles.split(","):
            case = run_role(role, m, args.rounds,
                            args.variants.split(",") if args.variants else None)
            rec["cases"].append(case)
            rec["speedup"][f"{role}/m{m}"] = case["speedup"]
            b = case["best"]
            print(f"{role} m={m}: " + ", ".join(
                f"{v} {c} {case['configs'][c]['ms']:.4f} ms err {case['configs'][c]['max_rel_err']:.1e}"
                for v, c in b.items() if c) + f"; f8mma / a8 {case['speedup']}", flush=True)
            for c, why in case["rejected"].items():
                print("  rejected", c, why, flush=True)
            rec.save()  # after every case: a run cut short keeps what it measured
    print(rec.save())
    return rec.doc


if __name__ == "__main__":
    main()
