"""Kernel correctness and speed at Llama-3-8B shapes (bf16, block 16) on one GPU.

    python3 -m bench.kernels_gpu --set h200-mycommit                (one GPU, ~1 min)
    python3 -m bench.kernels_gpu --decode-sweep --out x.json        (+ ~2 min)

For each case: max abs error vs the torch reference, median time (triton.testing.do_bench),
and achieved GB/s (memory-bound kernels) or TFLOP/s (prefill). A failing case records its
error and the rest still run; the JSON is always written.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from pdserve.benchlib import harness

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BF16 = 32, 8, 128, 16, torch.bfloat16
SCALE = HEAD_DIM ** -0.5


def paged(num_seqs, ctx):
    blocks = -(-ctx // BLOCK)
    n = num_seqs * blocks + 1
    cache = torch.randn(n, 2, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    bt = torch.randperm(n, device="cuda")[: num_seqs * blocks].view(num_seqs, blocks)
    return cache, bt.to(torch.int32)


def err(a, b):
    return float((a.float() - b.float()).abs().max())


def case_decode(K, R, batch, ctx):
    cache, bt = paged(batch, ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fn = lambda: K.paged_decode_attention(q, cache, 1, bt, lens, SCALE)
    e = err(fn(), R.paged_decode_attention_ref(q, cache, 1, bt, lens, SCALE))
    return fn, e, {"bytes": batch * ctx * 2 * KV_HEADS * HEAD_DIM * 2}


def case_decode_kvq(K, R, kind, batch, ctx):
    """Decode attention over an int8 / fp8 cache (codes + a scale per token and head;
    "bf16" the float control at the same shape): error against the reference over the
    dequantized cache, and the bytes read (codes and scales)."""
    if kind == "bf16":
        return case_decode(K, R, batch, ctx)
    from engine.quant.kv import CODE_DTYPES, read_cache
    blocks = -(-ctx // BLOCK)
    n = batch * blocks + 1
    cache = torch.zeros(n, 2, 2, BLOCK, KV_HEADS, HEAD_DIM + 4, dtype=CODE_DTYPES[kind],
                        device="cuda")
    kv = torch.randn(n * BLOCK, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    K.store_kv(kv, kv.roll(1, 0), cache, 1, torch.arange(n * BLOCK, device="cuda"))
    bt = torch.randperm(n, device="cuda")[: batch * blocks].view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fn = lambda: K.paged_decode_attention(q, cache, 1, bt, lens, SCALE)
    deq = read_cache(cache, 1, BF16).unsqueeze(1)  # [n, 1 layer, 2, BLOCK, KV_HEADS, D]
    e = err(fn(), R.paged_decode_attention_ref(q, deq, 0, bt, lens, SCALE))
    return fn, e, {"bytes": batch * ctx * 2 * KV_HEADS * (HEAD_DIM + 4)}


def case_prefill(K, R, prefix, n):
    cache, bt = paged(1, prefix + n)
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    sl = torch.tensor([prefix + n], dtype=torch.int32, device="cuda")
    fn = lambda: K.paged_prefill_attention(q, cache, 0, bt, qsl, sl, SCALE, max_query_len=n)
    e = err(fn(), R.paged_prefill_attention_ref(q, cache, 0, bt, qsl, sl, SCALE))
    keys = n * prefix + n * (n + 1) // 2  # (query, key) pairs under the causal mask
    return fn, e, {"flops": 4 * HEADS * HEAD_DIM * keys}


def case_sdpa(K, R, n):
    q = torch.randn(1, HEADS, n, HEAD_DIM, dtype=BF16, device="cuda")
    k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=BF16, device="cuda") for _ in range(2))
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn, None, {"flops": 4 * HEADS * HEAD_DIM * n * (n + 1) // 2}


def case_store_kv(K, R, n):
    cache, _ = paged(1, 2 * n)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda") for _ in range(2))
    slots = torch.randperm(cache.shape[0] * BLOCK, device="cuda")[:n]
    fn = lambda: K.store_kv(k, v, cache, 1, slots)
    fn()
    expect = cache.clone()
    R.store_kv_ref(k, v, expect, 1, slots)
    return fn, err(cache, expect), {"bytes": 4 * k.numel() * 2}


def case_rowwise(K, R, name):
    x, res = (torch.randn(4096, 4096, dtype=BF16, device="cuda") for _ in range(2))
    w = torch.randn(4096, dtype=BF16, device="cuda")
    nbytes = 2 * x.numel() * 2
    if name == "rmsnorm":
        fn = lambda: K.rmsnorm(x, w, 1e-5)
        e = err(fn(), R.rmsnorm_ref(x, w, 1e-5))
    elif name == "fused_add_rmsnorm":
        fn = lambda: K.fused_add_rmsnorm(x, res, w, 1e-5)
        e = max(err(a, b) for a, b in zip(fn(), R.fused_add_rmsnorm_ref(x, res, w, 1e-5)))
        nbytes *= 2
    elif name == "silu_and_mul":
        gu = torch.randn(4096, 2 * 4096, dtype=BF16, device="cuda")
        fn = lambda: K.silu_and_mul(gu)
        e = err(fn(), R.silu_and_mul_ref(gu))
        nbytes = 3 * x.numel() * 2
    else:  # rotary_embedding on q (4096 x 32 x 128) and k (4096 x 8 x 128), in place
        q = torch.randn(4096, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
        k = torch.randn(4096, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda")
        pos = torch.randint(0, 8192, (4096,), device="cuda")
        ang = torch.rand(8192, HEAD_DIM // 2, device="cuda") * 6.28
        cs = torch.cat([ang.cos(), ang.sin()], 1)
        eq, ek = q.clone(), k.clone()
        K.rotary_embedding(pos, q, k, cs)
        R.rotary_embedding_ref(pos, eq, ek, cs)
        e = max(err(q, eq), err(k, ek))
        fn = lambda: K.rotary_embedding(pos, q, k, cs)
        nbytes = 2 * (q.numel() + k.numel()) * 2
    return fn, e, {"bytes": nbytes}


def case_sample(K, R, n, vocab):
    logits = torch.randn(n, vocab, device="cuda") * 4
    t = torch.full((n,), 0.8, device="cuda")
    k = torch.full((n,), 50, dtype=torch.int32, device="cuda")
    p = torch.full((n,), 0.9, device="cuda")
    seeds = torch.arange(n, device="cuda")
    steps = torch.zeros(n, dtype=torch.int64, device="cuda")
    fn = lambda: K.sample(logits, t, k, p, seeds, steps)
    mismatch = float((fn() != R.sample_ref(logits, t, k, p, seeds, steps)).float().mean())
    return fn, mismatch, {"bytes": logits.numel() * 4}


def case_gemv(K, R, n, k, prologue, bn, bk, nw):
    """The batch-1 GEMV with the config the H200 tuner chose for this Llama-3-8B role (PDL on)."""
    kx = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(1, kx, dtype=BF16, device="cuda")
    w = torch.randn(n, k, dtype=BF16, device="cuda") / k ** 0.5
    kw = {}
    if prologue == "add_rmsnorm":
        kw = {"residual": torch.randn(1, k, dtype=BF16, device="cuda"),
              "norm_weight": torch.rand(k, dtype=BF16, device="cuda") + 0.5, "eps": 1e-5}
    fn = lambda: K.gemv(x, w, prologue=prologue, block_n=bn, block_k=bk, num_warps=nw,  # noqa
                        pdl=True, **kw)
    got, want = fn(), R.gemv_ref(x, w, prologue=prologue, **kw)
    if isinstance(want, tuple):
        got, want = got[0], want[0]
    return fn, err(got, want), {"bytes": n * k * 2}


CASES = [
    ("decode b1 ctx256", case_decode, (1, 256)),
    ("decode b1 ctx4096", case_decode, (1, 4096)),
    ("decode b64 ctx512", case_decode, (64, 512)),
    ("decode b1 ctx32768 bf16 KV", case_decode_kvq, ("bf16", 1, 32768)),
    ("decode b1 ctx32768 fp8 KV", case_decode_kvq, ("fp8", 1, 32768)),
    ("decode b1 ctx32768 int8 KV", case_decode_kvq, ("int8", 1, 32768)),
    ("decode b16 ctx32768 bf16 KV", case_decode_kvq, ("bf16", 16, 32768)),
    ("decode b16 ctx32768 fp8 KV", case_decode_kvq, ("fp8", 16, 32768)),
    ("prefill 4096 no prefix", case_prefill, (0, 4096)),
    ("prefill 1024 + 3072 prefix", case_prefill, (3072, 1024)),
    ("torch sdpa causal 4096", case_sdpa, (4096,)),
    ("store_kv 4096 tokens", case_store_kv, (4096,)),
    ("rmsnorm 4096x4096", case_rowwise, ("rmsnorm",)),
    ("fused_add_rmsnorm 4096x4096", case_rowwise, ("fused_add_rmsnorm",)),
    ("silu_and_mul 4096x4096", case_rowwise, ("silu_and_mul",)),
    ("rotary 4096 tokens", case_rowwise, ("rotary_embedding",)),
    ("gemv qkv 6144x4096 add_rmsnorm", case_gemv, (6144, 4096, "add_rmsnorm", 8, 2048, 8)),
    ("gemv o_proj 4096x4096", case_gemv, (4096, 4096, "none", 4, 1024, 4)),
    ("gemv gate_up 28672x4096 add_rmsnorm", case_gemv,
     (28672, 4096, "add_rmsnorm", 4, 1024, 4)),
    ("gemv down 4096x14336 silu_mul", case_gemv, (4096, 14336, "silu_mul", 8, 2048, 8)),
    ("sample b64 vocab128256 top-k50 top-p0.9 (err = mismatch rate)", case_sample, (64, 128256)),
]


SWEEP_CASES = [("bf16", 1, 32768), ("fp8", 1, 32768), ("bf16", 16, 32768),
               ("fp8", 16, 32768), ("fp8", 64, 4096), ("bf16", 64, 4096), ("int8", 16, 32768),
               ("bf16", 64, 512), ("bf16", 256, 512), ("bf16", 1, 512)]
SWEEP_CONFIGS = {  # per kind: (BLOCK_N, num_warps, num_stages, TYPED, F16)
    "bf16": [(n, 4, st, False, False) for n in (32, 64, 128) for st in (2, 3)],
    "fp8": [(n, w, st, ty, f) for n in (64, 128) for w, st in ((4, 2), (4, 3), (8, 2))
            for ty in (False, True) for f in (False, True)]}
SWEEP_CONFIGS["int8"] = SWEEP_CONFIGS["fp8"]


def decode_sweep(K, R, do_bench) -> list[dict]:
    """decode_attention.DECODE_CONFIG (BLOCK_N, num_warps, num_stages) per cache kind: each
    config's graph-replay time for the SWEEP_CASES (the entry in use restored after)."""
    from engine.kernels import decode_attention as da
    kvq = {"bf16": 0, "int8": 1, "fp8": 2}
    rows = []
    for kind, batch, ctx in SWEEP_CASES:
        saved = da.DECODE_CONFIG[kvq[kind]]
        try:
            for cfg in SWEEP_CONFIGS[kind]:
                da.DECODE_CONFIG[kvq[kind]] = cfg
                row = {"kind": kind, "batch": batch, "ctx": ctx, "config": list(cfg)}
                try:
                    fn, e, work = case_decode_kvq(K, R, kind, batch, ctx)
                    ms = graph_time(fn, do_bench) or do_bench(fn, warmup=10, rep=50,
                                                              return_mode="median")
                    row.update(max_abs_err=e, median_ms=ms, **{"GB/s": work["bytes"] / ms / 1e6})
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
        finally:
            da.DECODE_CONFIG[kvq[kind]] = saved
    return rows


def graph_time(fn, do_bench):
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    except Exception:
        return None


FIGURES = [
    harness.Figure(f"{case}: {what}", unit, ("results", {"case": case}, key), format=fmt)
    for case, what, unit, key, fmt in (
        ("decode b1 ctx4096", "max abs error", "", "max_abs_err", ".2g"),
        ("decode b64 ctx512", "bandwidth", "GB/s", "GB/s", ".0f"),
        ("decode b16 ctx32768 bf16 KV", "time", "ms", "median_ms", ".3f"),
        ("decode b16 ctx32768 fp8 KV", "time", "ms", "median_ms", ".3f"),
        ("prefill 4096 no prefix", "max abs error", "", "max_abs_err", ".2g"),
        ("prefill 4096 no prefix", "rate", "TFLOP/s", "TFLOP/s", ".0f"),
        ("gemv gate_up 28672x4096 add_rmsnorm", "bandwidth", "GB/s", "GB/s", ".0f"))]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.kernels_gpu",
                                 description=__doc__.splitlines()[0])
    harness.add_output_args(ap, "kernels_gpu")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="also time decode attention's (BLOCK_N, warps, stages) configs")
    args = ap.parse_args(argv)
    rec = harness.Recorder.start("kernels_gpu", args, argv=argv, about=__doc__, figures=FIGURES)
    report = rec.doc
    report["results"] = []
    try:
        from triton.testing import do_bench

        from engine import kernels as K
        from engine.kernels import reference as R
        report["device"] = torch.cuda.get_device_name()
        for name, make, params in CASES:
            row = {"case": name}
            t0 = time.time()
            try:
                fn, e, work = make(K, R, *params)
                ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
                row.update(max_abs_err=e, median_ms=ms)
                graph_ms = graph_time(fn, do_bench)
                if graph_ms is not None:  # launch overhead removed, as under the decode graphs
                    row["graph_median_ms"] = graph_ms
                    ms = min(ms, graph_ms)
                if "bytes" in work:
                    row["GB/s"] = work["bytes"] / ms / 1e6
                if "flops" in work:
                    row["TFLOP/s"] = work["flops"] / ms / 1e9
            except Exception as exc:  # record and go on
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=6)
            row["wall_s"] = round(time.time() - t0, 2)
            report["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            torch.cuda.empty_cache()
        if args.decode_sweep:
            report["decode_sweep"] = decode_sweep(K, R, do_bench)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
