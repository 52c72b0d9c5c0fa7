"""Prefill attention choices for Llama-3-8B shapes on one GPU (32 query heads, 8 KV heads,
head_dim 128, bf16), per layer: which way a prefill chunk's attention should run.

* prefix-free causal n tokens: SDPA after expanding K/V heads (``repeat_interleave``, what
  engine/kernels/backend.py does), SDPA with ``enable_gqa=True``, SDPA given the unexpanded
  K/V without the flag, and the Triton paged kernel;
* a chunk of n tokens after a cached prefix of p tokens (chunked prefill's later chunks):
  the Triton paged kernel against SDPA with a lower-right causal mask over gathered K/V.

Each variant: median GPU time of --reps calls (CUDA events), TFLOP/s of the causal work,
max |difference| to the expanded-SDPA result, or the error it raised.

    python3 -m bench.attention_prefill_gpu --set h200-mycommit          (one GPU, ~1 min)
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from engine.kernels.prefill_attention import paged_prefill_attention
from pdserve.benchlib import harness
from pdserve.benchlib.cuda_timing import event_median_s

HQ, HK, D, BS = 32, 8, 128, 16
FIGURES = [
    harness.Figure(f"{n} queries after {prefix}, {variant}", "ms",
                   ("results", f"n{n}_prefix{prefix}", variant, "ms"), format=".3f")
    for n, prefix, variant in ((4096, 0, "sdpa_enable_gqa"), (4096, 0, "triton_paged"),
                               (2048, 2048, "triton_paged"), (2048, 2048, "sdpa_enable_gqa"))]


def timed(fn, reps):
    """fn's output and its median ms over ``reps`` CUDA-event timed calls (3 warm-ups)."""
    out = fn()
    return out, event_median_s(fn, reps, warm=2) * 1e3


def paged_cache(k, v):
    """A layer-0 paged cache [blocks, 1, 2, BS, HK, D] holding k/v in blocks 0.."""
    total = k.shape[0]
    nb = -(-total // BS)
    cache = torch.zeros(nb, 1, 2, BS, HK, D, dtype=k.dtype, device=k.device)
    kk = torch.zeros(nb * BS, HK, D, dtype=k.dtype, device=k.device)
    vv = torch.zeros_like(kk)
    kk[:total], vv[:total] = k, v
    cache[:, 0, 0] = kk.view(nb, BS, HK, D)
    cache[:, 0, 1] = vv.view(nb, BS, HK, D)
    return cache


def paged(q, k, v, prefix):
    """Cache holding the sequence's K/V (prefix + chunk) in blocks; the Triton kernel."""
    total = k.shape[0]
    nb = -(-total // BS)
    cache = paged_cache(k, v)
    bt = torch.arange(nb, dtype=torch.int32, device=q.device)[None]
    qsl = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    sl = torch.tensor([total], dtype=torch.int32, device=q.device)
    scale = D ** -0.5
    return lambda: paged_prefill_attention(q, cache, 0, bt, qsl, sl, scale,
                                           max_query_len=q.shape[0])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.attention_prefill_gpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    harness.add_output_args(ap, "attention_prefill_gpu")
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("attention_prefill_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    rec["device"] = torch.cuda.get_device_name(0)
    torch.manual_seed(0)
    dev = "cuda"
    scale = D ** -0.5
    res = {}
    for n, prefix in ((512, 0), (1000, 0), (2048, 0), (4096, 0), (2048, 2048), (1800, 1500),
                      (512, 3584)):
        total = prefix + n
        q = torch.randn(n, HQ, D, dtype=torch.bfloat16, device=dev)
        k = torch.randn(total, HK, D, dtype=torch.bfloat16, device=dev)
        v = torch.randn(total, HK, D, dtype=torch.bfloat16, device=dev)
        qt = q.transpose(0, 1)[None]
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        # causal work: each query attends to prefix + its position + 1 keys
        flop = 4 * HQ * D * sum(prefix + j + 1 for j in range(n))
        if prefix == 0:
            causal = {"is_causal": True}
        else:  # queries are the last n of total positions: causal aligned lower right
            from torch.nn.attention.bias import causal_lower_right
            causal = {"attn_mask": causal_lower_right(n, total)}

        def expanded():
            ke = k.repeat_interleave(HQ // HK, dim=1).transpose(0, 1)[None]
            ve = v.repeat_interleave(HQ // HK, dim=1).transpose(0, 1)[None]
            return F.scaled_dot_product_attention(qt, ke, ve, scale=scale, **causal)
        variants = {"sdpa_expanded": expanded,
                    "sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(
                        qt, kt, vt, scale=scale, enable_gqa=True, **causal)}
        if prefix == 0:
            variants["sdpa_unexpanded_no_flag"] = lambda: F.scaled_dot_product_attention(
                qt, kt, vt, scale=scale, **causal)
        variants["triton_paged"] = paged(q, k, v, prefix)
        ref = None
        row = {}
        for name, fn in variants.items():
            try:
                out, ms = timed(fn, a.reps)
            except Exception as exc:  # noqa: BLE001
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"n={n} prefix={prefix} {name:26s} ERROR {row[name]['error'][:120]}",
                      flush=True)
                continue
            o = out[0].transpose(0, 1) if out.dim() == 4 else out
            if ref is None:
                ref = o.float()
            diff = (o.float() - ref).abs().max().item()
            row[name] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                         "max_abs_diff": diff}
            print(f"n={n} prefix={prefix} {name:26s} {ms:8.4f} ms {flop / ms / 1e9:7.1f} TFLOP/s "
                  f"diff {diff:.3g}", flush=True)
        res[f"n{n}_prefix{prefix}"] = row
    rec["results"] = res
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
