"""Quantized projection kernels on the GPU at Llama-3-8B shapes: batch-1..8 GEMV weight
bandwidth and GEMM TFLOP/s per format (engine.quant.kernels), against bf16 cuBLAS.

    PYTHONPATH=. python3 -m bench.quant_kernels_gpu --out $OUT/quant_kernels_gpu.json   (~2 min)

GEMV: effective GB/s = bytes of the weight's codes and scales / time (the figure that bounds
batch-1 decode). GEMM: 2 M N K / time. Each timing is the median of CUDA-event timed runs
after a warm-up; every kernel's output is checked against the torch reference first.
"""
from __future__ import annotations

import argparse
import sys

import torch

from pdserve.benchlib import harness
from pdserve.benchlib.cuda_timing import event_median_s as _time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
FIGURES = [harness.Figure(f"{f} GEMV gate_up, batch 1", "GB/s",
                          ("gemv", {"case": f"{f}/gate_up/m1"}, "gb_s"), format=".0f")
           for f in ("bf16", "int8", "int4", "fp8")]




def main(argv=None) -> dict:
    from engine.quant import kernels as QK
    from engine.quant import reference as ref
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.quant_kernels_gpu")
    ap.add_argument("--gemm-m", default="512,4096")
    harness.add_output_args(ap, "quant_kernels_gpu")
    args = ap.parse_args(argv)
    rec = harness.Recorder.start("quant_kernels_gpu", args, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=True)
    rec["gemv"], rec["gemm"] = [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        fmts = {"bf16": None, **{f: ref.QUANTIZERS[f](w) for f in ref.FORMATS}}
        for m in [1, 4, 8] + [int(x) for x in args.gemm_m.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            for f, qw in fmts.items():
                if qw is None:
                    fn, nbytes = (lambda: x @ w.t()), w.numel() * 2
                else:
                    fn, nbytes = (lambda: QK.quant_linear(x, qw)), ref.weight_bytes(qw)
                    want = ref.quant_matmul_ref(x, qw).float()
                    err = ((fn().float() - want).norm() / want.norm()).item()
                    assert err < 1e-2, f"{f} {name} m={m}: relative error {err:.2e}"
                t = _time(fn)
                row = {"case": f"{f}/{name}/m{m}", "format": f, "shape": name, "m": m,
                       "us": round(t * 1e6, 2)}
                if m <= 8:
                    row["gb_s"] = round(nbytes / t / 1e9, 1)
                    rec["gemv"].append(row)
                else:
                    row["tflop_s"] = round(2 * m * n * k / t / 1e12, 1)
                    rec["gemm"].append(row)
                print(row, flush=True)
        rec.save()
    return rec.doc


if __name__ == "__main__":
    main()
