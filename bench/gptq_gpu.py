"""GPTQ rounding on the GPU (engine.quant.gptq) at Llama-3-8B projection shapes: seconds per
projection per format and the 32-layer total they add up to, the output error against
round-to-nearest on held-out inputs, and agreement with the CPU on a small shape.

    PYTHONPATH=. python3 -m bench.gptq_gpu --out $OUT/gptq_gpu_h200.json   (~1 min)

Each input width's ``H`` comes from HessianCollector's pre-hook (float32 on the GPU, as
pdserve quantize --gptq accumulates it; ``hessian``: its time) over --windows x --window
tokens of correlated activations with a few large channels (the recipe of
tests/unit/test_gptq.py), fed a window per call; the weight is random (std 0.02,
bf16-rounded). ``rounds``: the time of one gptq_quantize call (synchronized; the small
shape's calls run first, so cuBLAS's and cuSOLVER's start-up is not in it), the output error (mean
squared, quant_matmul_ref against the float weight) over --held other tokens of the same
distribution, and that error over round-to-nearest's (GPTQ is correct only if it is < 1;
the unit test asks < 0.8 at 256 features). ``layers_s``: the four projections' times times
--layers (the rounding of a Llama-3-8B; calibration's forward passes are not in it).
``float32``: the same rounding with dtype float32 (updates and H's inverse), time, error
ratio and codes against float64's. ``inverse``: H's damped Cholesky inverse alone per
dtype. ``cpu_agreement``: a --small shape rounded on the CPU (float64 H, as there) and on
the GPU (float32 H): codes that differ and the largest difference (in grid steps, in code
value and in weight), with the same float64 H on both and end to end.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from pdserve.benchlib import harness

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
FORMATS = ("int4", "int8", "fp8")
DEVICE = "cuda"
FIGURES = ([harness.Figure(f"GPTQ {f}, 32 layers of Llama-3-8B", "s",
                           ("layers_s", f), format=".1f") for f in FORMATS]
           + [harness.Figure("largest error ratio vs round-to-nearest", "",
                             ("max_error_ratio",), format=".3f")])


def _inputs(k: int, tokens: int, seed: int, device) -> torch.Tensor:
    """Correlated activations with a few large channels (tests/unit/test_gptq.py's recipe);
    ``seed`` draws other tokens of the same distribution."""
    g = torch.Generator(device=device).manual_seed(99)
    mix = torch.randn(k, k, generator=g, device=device) / k ** 0.5
    mix += torch.eye(k, device=device)
    x = torch.randn(tokens, k, device=device,
                    generator=torch.Generator(device=device).manual_seed(seed)) @ mix
    x[:, :4] *= 8.0
    return x


def _hessian(x: torch.Tensor, window: int) -> tuple[torch.Tensor, float]:
    """(H, seconds): HessianCollector's pre-hook (on an identity module: what a projection's
    hook sees), fed ``x`` a window at a time (the calibration's calls)."""
    from engine.quant.gptq import HessianCollector
    mod = torch.nn.Identity()
    col = HessianCollector()
    col.hook("p", mod)
    _sync()
    t0 = time.perf_counter()
    for part in x.split(window):
        mod(part)
    _sync()
    col.remove()
    return col.h["p"], time.perf_counter() - t0


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, *args, **kw):
    """(fn(*args, **kw), seconds with the GPU synchronized on both sides)."""
    _sync()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    _sync()
    return out, time.perf_counter() - t0


def _codes(qw: dict) -> torch.Tensor:
    """A quantized weight's codes as integers [N, K], one step apart on the format's grid
    (fp8: sign-magnitude e4m3 bits, so neighbours are one apart)."""
    from engine.quant.reference import unpack_int4
    if qw["format"] == "int4":
        return unpack_int4(qw["q"])[:, :qw["k"]].long()
    if qw["format"] == "int8":
        return qw["q"].long()
    bits = qw["q"].view(torch.uint8).long()
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def _compare(a: dict, b: dict) -> dict:
    """Two roundings of one weight: the fraction of codes that differ, the largest difference
    in grid steps (fp8: e4m3 steps, of which there are many near zero) and in value (units
    of the row's scale: the integer codes; fp8 e4m3 values, 16 = one step of the top binade
    of 448)."""
    from engine.quant.reference import dequantize
    b = {k: v.to(a["q"].device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    ca, cb = _codes(a), _codes(b)
    d = (ca - cb).abs()
    if a["format"] == "fp8":
        dv = (a["q"].float() - b["q"].float()).abs().max().item()
    else:
        dv = float(d.max().item())
    dw = (dequantize(a) - dequantize(b)).abs().max().item()
    return {"codes_differ": round(d.ne(0).float().mean().item(), 6),
            "max_code_diff": int(d.max().item()), "max_value_diff": dv,
            "max_weight_diff": dw}


def _error(x: torch.Tensor, w: torch.Tensor, qw: dict) -> float:
    from engine.quant.reference import quant_matmul_ref
    return (quant_matmul_ref(x, qw) - x @ w.t()).pow(2).mean().item()


def _weight(n: int, k: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    return w.to(torch.bfloat16).float()  # what gptq_calibrate hands over from a bf16 engine


def _cpu_agreement(n: int, k: int, tokens: int, window: int) -> list[dict]:
    from engine.quant.gptq import gptq_quantize
    x = _inputs(k, tokens, 0, "cpu")
    w = _weight(n, k, "cpu", 1)
    h64, _ = _hessian(x, window)
    h32, _ = _hessian(x.to(DEVICE), window)
    rows = []
    for fmt in FORMATS:
        cpu = gptq_quantize(w, h64, fmt)
        same_h = gptq_quantize(w.to(DEVICE), h64.to(DEVICE), fmt)
        full = gptq_quantize(w.to(DEVICE), h32, fmt)
        row = {"format": fmt, "shape": [n, k], "h_dtype_gpu": str(h32.dtype),
               "same_h": _compare(cpu, same_h), "end_to_end": _compare(cpu, full),
               "scale_equal": bool(torch.equal(cpu["scale"], full["scale"].cpu()))}
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.gptq_gpu")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--windows", type=int, default=32, help="calibration windows")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--held", type=int, default=1024, help="held-out tokens")
    ap.add_argument("--layers", type=int, default=32, help="layers to extrapolate to")
    ap.add_argument("--float32", default="int4", help="formats also rounded in float32")
    ap.add_argument("--small", default="256x512", help="NxK of the CPU agreement")
    harness.add_output_args(ap, "gptq_gpu")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gptq_gpu: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        raise SystemExit(2)
    from engine.quant.gptq import DAMP, _inverse_factor, gptq_quantize
    from engine.quant.reference import QUANTIZERS
    shapes = [s for s in args.shapes.split(",") if s]
    formats = [f for f in args.formats.split(",") if f]
    f32 = [f for f in args.float32.split(",") if f]
    small_n, small_k = (int(v) for v in args.small.split("x"))
    rec = harness.Recorder.start("gptq_gpu", args, argv=argv, about=__doc__, figures=FIGURES,
                                 cuda=True)
    rec["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    t_start = time.perf_counter()
    rec["cpu_agreement"] = _cpu_agreement(small_n, small_k, args.windows * args.window,
                                          args.window)  # also the GPU's warm-up
    rec["rounds"], rec["float32"], rec["inverse"], rec["hessian"] = [], [], [], []
    times: dict[str, dict[str, float]] = {f: {} for f in formats}
    per_k: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # K -> (H, held-out inputs)
    for si, name in enumerate(shapes):
        n, k = SHAPES[name]
        if k not in per_k:  # the projections of one K share their inputs (qkv, o, gate_up)
            h, h_s = _hessian(_inputs(k, args.windows * args.window, 0, DEVICE), args.window)
            rec["hessian"].append({"k": k, "tokens": args.windows * args.window,
                                   "dtype": str(h.dtype), "s": round(h_s, 4)})
            for dt in (torch.float64, torch.float32):
                _, t = _timed(_inverse_factor, h, DAMP, dt)
                rec["inverse"].append({"k": k, "dtype": str(dt), "s": round(t, 4)})
            per_k[k] = (h, _inputs(k, args.held, 3, DEVICE))
        h, held = per_k[k]
        w = _weight(n, k, DEVICE, 10 + si)
        for fmt in formats:
            qg, t = _timed(gptq_quantize, w, h, fmt)
            e_g, e_r = _error(held, w, qg), _error(held, w, QUANTIZERS[fmt](w))
            row = {"case": f"{fmt}/{name}", "format": fmt, "shape": name, "n": n, "k": k,
                   "s": round(t, 3), "us_per_feature": round(t / k * 1e6, 1),
                   "error": e_g, "error_rtn": e_r, "error_ratio": round(e_g / e_r, 4)}
            times[fmt][name] = t
            rec["rounds"].append(row)
            print(row, flush=True)
            if fmt in f32:
                q32, t32 = _timed(gptq_quantize, w, h, fmt, dtype=torch.float32)
                row32 = {"case": f"{fmt}/{name}", "s": round(t32, 3),
                         "error_ratio": round(_error(held, w, q32) / e_r, 4),
                         "vs_float64": _compare(qg, q32)}
                rec["float32"].append(row32)
                print("float32", row32, flush=True)
        del w
        torch.cuda.empty_cache()
        rec.save()
    per_layer = {f: sum(ts.values()) for f, ts in times.items()}
    full = all(len(ts) == len(SHAPES) for ts in times.values())
    rec["per_layer_s"] = {f: round(v, 2) for f, v in per_layer.items()}
    rec["layers_s"] = ({f: round(v * args.layers, 1) for f, v in per_layer.items()} if full
                       else None)  # only when every projection of a layer was timed
    ratios = [r["error_ratio"] for r in rec["rounds"]] + [r["error_ratio"] for r in
                                                          rec["float32"]]
    rec["max_error_ratio"] = max(ratios) if ratios else None
    rec["wall_s"] = round(time.perf_counter() - t_start, 1)
    rec["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    rec.save()
    print(f"per layer {rec['per_layer_s']} s; {args.layers} layers {rec['layers_s']} s; "
          f"largest error ratio {rec['max_error_ratio']}; wrote {rec.path}", flush=True)
    if rec["max_error_ratio"] is not None and rec["max_error_ratio"] >= 1.0:
        print("bench.gptq_gpu: GPTQ's output error is not below round-to-nearest's",
              file=sys.stderr)
        raise SystemExit(1)
    return rec.doc


if __name__ == "__main__":
    main()
