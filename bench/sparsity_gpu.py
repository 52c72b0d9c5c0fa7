"""2:4 semi-structured sparse GEMMs (torch.sparse.to_sparse_semi_structured) against dense
bf16 cuBLAS at the prefill GEMMs of Llama-3-8B, on one GPU.

    python3 -m bench.sparsity_gpu --out $OUT/sparsity_gpu_h200.json        (1 GPU, < 1 min)

Each projection weight (random, bf16, N x K) is pruned to 2:4 by magnitude (:func:`prune_2_4`:
the 2 largest |w| of every 4 consecutive along K kept) and compressed once per backend:

- ``cutlass``: ``SparseSemiStructuredTensor._FORCE_CUTLASS = True``, ``F.linear(x, w_sparse)``;
- ``cutlass_mm``: the same weight, the CUTLASS kernel called alone
  (``torch._sparse_semi_structured_mm(packed, meta, x.t())``, an N x M result): what
  F.linear's wrapper adds around the kernel (padding, layout copies) is left out;
- ``cusparselt``: ``_FORCE_CUTLASS = False``, ``F.linear(x, w_sparse)``, cuSPARSELt's default
  algorithm (alg_id 0);
- ``cusparselt_search``: as ``cusparselt`` with the algorithm cuSPARSELt's search picks for
  the case (:func:`cslt_search`; set as the tensor's ``alg_id_cusparselt``, the one tuning
  knob F.linear passes on);
- ``cusparselt_tuned``: ``torch._cslt_sparse_mm(packed, x.t(), transpose_result=True)``
  called directly with everything the search found (alg_id and, where this torch's search
  returns them, split_k and split_k_mode), without the tensor subclass around it.

The dense figure is ``F.linear(x, w)`` (cuBLAS; its time does not depend on the zeros).
Timings: CUDA events around each call, the median of --reps after --warmup calls. TFLOP/s
counts the dense work, 2 M N K; speedup = dense time / sparse time. Every sparse output is
checked against dense ``F.linear`` on the pruned weight (max abs and relative Frobenius
error; ``ok`` when the relative error is under 1e-2; the dense row's ``rel_err_fp32`` is
dense bf16's own error against fp32 on the pruned weight, the scale of bf16 rounding). A
variant that fails records its error string (its times None) and the others still run; the
JSON is saved after every case.

``prune_cost`` per shape: the relative Frobenius error of the pruned weight's output against
the unpruned weight's (fp32, random x), and the share of the weight's energy (sum of w^2)
pruning keeps. For random Gaussian weights this only sizes the change: what 2:4 costs a real
model's quality needs a model trained or fine-tuned for 2:4 sparsity, not measured here.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from pdserve.benchlib import harness
from pdserve.benchlib.cuda_timing import event_median_s as _time

# Llama-3-8B: hidden 4096, intermediate 14336, 32 heads and 8 KV heads of 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
VARIANTS = ("cutlass", "cutlass_mm", "cusparselt", "cusparselt_search", "cusparselt_tuned")
OK_REL_ERR = 1e-2
FIGURES = [harness.Figure(f"2:4 {v} vs dense bf16, {shape} M={m}", "x",
                          ("cases", {"case": f"{shape}/m{m}"}, "sparse", v, "speedup"),
                          format=".2f")
           for v, shape, m in (("cusparselt", "gate_up", 8192), ("cutlass", "gate_up", 8192),
                               ("cusparselt_tuned", "gate_up", 8192),
                               ("cusparselt", "down", 8192), ("cusparselt", "qkv", 2048),
                               ("cusparselt", "o", 512))]


def prune_2_4(w: torch.Tensor) -> torch.Tensor:
    """``w`` (..., K) with all but the 2 largest magnitudes of every 4 consecutive values
    along the last dimension set to zero (between equal magnitudes topk picks; exactly 2 are
    kept per group either way). K must be a multiple of 4."""
    k = w.shape[-1]
    if k % 4:
        raise ValueError(f"2:4 pruning needs the last dimension a multiple of 4, got {k}")
    groups = w.reshape(*w.shape[:-1], k // 4, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(w.shape)




def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:400]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def to_sparse(wp: torch.Tensor, cutlass: bool):
    """``wp`` (already 2:4) as a SparseSemiStructuredTensor of one backend; the class flag
    ``_FORCE_CUTLASS`` is restored afterwards."""
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    before = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = cutlass
    try:
        return to_sparse_semi_structured(wp)
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = before


def backend_info() -> dict:
    """What this torch offers for 2:4 sparsity (asked, never assumed)."""
    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "device": torch.cuda.get_device_name(0),
                 "capability": list(torch.cuda.get_device_capability(0))}
    try:
        import torch.backends.cusparselt as cslt
        out["cusparselt_available"] = bool(cslt.is_available())
        out["cusparselt_version"] = cslt.version()
        out["cusparselt_max_alg_id"] = getattr(cslt, "get_max_alg_id", lambda: None)()
    except Exception as e:  # an older torch without the module
        out["cusparselt_available"], out["cusparselt_error"] = None, _error_text(e)
    return out


def cslt_search(packed: torch.Tensor, xt: torch.Tensor) -> dict:
    """cuSPARSELt's own search for ``packed @ xt`` with an M x N result: alg_id, split_k and
    split_k_mode from ``torch._C._cusparselt.mm_search`` where this torch has it, else the
    alg_id alone from the older ``torch._cslt_sparse_mm_search``."""
    mm_search = getattr(getattr(torch._C, "_cusparselt", None), "mm_search", None)
    if mm_search is not None:
        found = mm_search(packed, xt, None, None, None, True)
        out = {"via": "torch._C._cusparselt.mm_search", "returned": repr(found),
               "alg_id": int(found[0]), "split_k": int(found[1])}
        if not isinstance(found[2], bool):  # a bool split_k_one_kernel in some versions
            out["split_k_mode"] = int(found[2])
        return out
    found = torch._cslt_sparse_mm_search(packed, xt, transpose_result=True)
    return {"via": "torch._cslt_sparse_mm_search", "returned": repr(found),
            "alg_id": int(found[0] if isinstance(found, (tuple, list)) else found)}


def _variant(name: str, x: torch.Tensor, wp: torch.Tensor, made: dict):
    """``(fn, info, transposed)``: the call to time for one sparse variant, what it ran as,
    and whether its result is N x M. ``made`` keeps the compressed weights and searches
    across the variants and Ms that share them (one weight per backend and per searched
    cuSPARSELt alg_id, one search per M)."""
    cutlass = name.startswith("cutlass")
    key = "cutlass" if cutlass else "cusparselt"
    if key not in made:
        made[key] = to_sparse(wp, cutlass)
    ws = made[key]
    info = {"class": type(ws).__name__, "backend": getattr(ws, "BACKEND", None)}
    if name == "cutlass_mm":
        packed, meta = ws.packed, ws.meta
        return (lambda: torch._sparse_semi_structured_mm(packed, meta, x.t())), info, True
    if name in ("cusparselt_search", "cusparselt_tuned"):
        skey = f"search_m{x.shape[0]}"
        if skey not in made:
            t0 = time.perf_counter()
            made[skey] = cslt_search(ws.packed, x.t())
            made[skey]["search_s"] = round(time.perf_counter() - t0, 3)
        info["search"] = found = made[skey]
    if name == "cusparselt_tuned":
        packed, kw = ws.packed, {k: found[k] for k in ("alg_id", "split_k", "split_k_mode")
                                 if k in found}
        info.update(kw)
        return (lambda: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True, **kw)), \
            info, False
    if name == "cusparselt_search":
        alg = found["alg_id"]
        if f"cusparselt_alg{alg}" not in made:
            made[f"cusparselt_alg{alg}"] = to_sparse(wp, False)
        ws = made[f"cusparselt_alg{alg}"]
        ws.alg_id_cusparselt = alg
    if not cutlass:
        info["alg_id"] = getattr(ws, "alg_id_cusparselt", None)
        info["fuse_transpose"] = getattr(ws, "fuse_transpose_cusparselt", None)
    return (lambda: F.linear(x, ws)), info, False


def run_case(shape: str, n: int, k: int, m: int, w: torch.Tensor, wp: torch.Tensor,
             made: dict, args, g: torch.Generator) -> dict:
    """One (shape, M): dense bf16, then each sparse variant, checked and timed."""
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    flops = 2 * m * n * k
    dense_t = _time(lambda: F.linear(x, w), args.reps, args.warmup)
    want = F.linear(x, wp)
    want32 = F.linear(x.float(), wp.float())
    row = {"case": f"{shape}/m{m}", "shape": shape, "m": m, "n": n, "k": k,
           "dense": {"us": round(dense_t * 1e6, 2), "tflop_s": round(flops / dense_t / 1e12, 1),
                     "rel_err_fp32": round(_rel(want, want32), 6)},
           "sparse": {}}
    del want32
    for name in args.variants:
        res: dict = {"ran": False, "us": None, "tflop_s": None, "speedup": None}
        try:
            fn, info, transposed = _variant(name, x, wp, made)
            res.update(info)
            got = fn()
            torch.cuda.synchronize()
            got = got.t() if transposed else got
            if tuple(got.shape) != (m, n):
                raise RuntimeError(f"output shape {tuple(got.shape)}, expected {(m, n)}")
            res["max_abs_err"] = float((got.float() - want.float()).abs().max())
            res["rel_err"] = round(_rel(got, want), 6)
            res["ok"] = res["rel_err"] < OK_REL_ERR
            del got
            t = _time(fn, args.reps, args.warmup)
            res.update(ran=True, us=round(t * 1e6, 2), tflop_s=round(flops / t / 1e12, 1),
                       speedup=round(dense_t / t, 3))
        except Exception as e:  # recorded; the other variants still run
            res["error"] = _error_text(e)
        row["sparse"][name] = res
    return row


def prune_cost(w: torch.Tensor, wp: torch.Tensor, m: int, g: torch.Generator) -> dict:
    """How much 2:4 magnitude pruning changes this (random) weight's output, in fp32."""
    x = torch.randn(m, w.shape[1], device="cuda", generator=g)
    full = F.linear(x, w.float())
    err = F.linear(x, (w.float() - wp.float()))
    kept = float(wp.float().square().sum() / w.float().square().sum())
    return {"m": m, "output_rel_err": round(float(err.norm() / full.norm()), 4),
            "weight_energy_kept": round(kept, 4),
            "nonzero_share": round(float((wp != 0).float().mean()), 4)}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.sparsity_gpu")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="projections of Llama-3-8B, from " + ",".join(SHAPES))
    ap.add_argument("--m", default="512,2048,8192",
                    help="token counts (prefill chunk sizes; 8192 = default max batched)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="sparse variants, from " + ",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    harness.add_output_args(ap, "sparsity_gpu")
    args = ap.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.m = [int(v) for v in args.m.split(",") if v]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [s for s in args.shapes if s not in SHAPES] + \
        [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown shape or variant: {', '.join(bad)}")
    if not torch.cuda.is_available():
        print("bench.sparsity_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        raise SystemExit(2)
    rec = harness.Recorder.start("sparsity_gpu", args, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=True)
    rec["backends"] = backend_info()
    rec["cases"], rec["prune_cost"] = [], {}
    print(rec["backends"], flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wp = prune_2_4(w)
        rec["prune_cost"][shape] = prune_cost(w, wp, min(args.m), g)
        made: dict = {}
        for m in args.m:
            row = run_case(shape, n, k, m, w, wp, made, args, g)
            rec["cases"].append(row)
            print({"case": row["case"], "dense_us": row["dense"]["us"],
                   **{v: (r["speedup"], r.get("error")) for v, r in row["sparse"].items()}},
                  flush=True)
            rec.save()
        del w, wp, made
        torch.cuda.empty_cache()
    rec["measure_s"] = round(time.perf_counter() - t0, 1)
    rec.save()
    return rec.doc


if __name__ == "__main__":
    main()
