"""Choose, once per process and shape, between the Triton GEMV (engine.kernels.matvec) and
cuBLAS for each one-token projection of a Llama-family model.

Each candidate is timed as the decode graph runs it: one call per layer (so the weights
stream from HBM, not L2), captured in a CUDA graph, replayed, timed with CUDA events. The
cuBLAS side includes the separate row-wise kernel the GEMV prologue would absorb
(add+rmsnorm before qkv / gate_up, silu_and_mul before down). Environment:
PDSERVE_GEMV=off disables the GEMV; PDSERVE_GEMV=force takes the fastest Triton config
even when cuBLAS is faster (for A/B measurements).
"""
from __future__ import annotations

import logging
import os
import statistics

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# (block_n, block_k, num_warps): tiles of 8-32 KB so each SM keeps enough loads in flight
CONFIGS = [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (8, 2048, 8),
           (16, 1024, 8)]
_CACHE: dict[tuple, tuple[dict | None, dict]] = {}


def _time_graph(fn, reps: int = 5) -> float:
    """Median ms of one replay of a CUDA graph holding fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / create handles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(2):
        g.replay()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps)]
    times = []
    for i in range(reps):
        ev[2 * i].record()
        g.replay()
        ev[2 * i + 1].record()
    torch.cuda.synchronize()
    times = [ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(reps)]
    del g
    return statistics.median(times)


def _role_inputs(model, role):
    """(weights per layer, biases, norm weights or None, prologue, input width)."""
    layers = model.layers
    if role == "qkv":
        lin = [l.self_attn.qkv_proj for l in layers]
        norms = [l.input_layernorm for l in layers]
        pro = "add_rmsnorm"
    elif role == "o":
        lin, norms, pro = [l.self_attn.o_proj for l in layers], None, "none"
    elif role == "gate_up":
        lin = [l.mlp.gate_up_proj for l in layers]
        norms = [l.post_attention_layernorm for l in layers]
        pro = "add_rmsnorm"
    else:
        lin, norms, pro = [l.mlp.down_proj for l in layers], None, "silu_mul"
    k = lin[0].weight.shape[1] * (2 if pro == "silu_mul" else 1)
    return lin, norms, pro, k


def tune_role(model, role: str, mode: str = "auto"):
    """-> (config dict or None for cuBLAS, {"cublas_ms": .., "triton_ms": {cfg: ms}})."""
    from engine.kernels.elementwise import fused_add_rmsnorm, silu_and_mul
    from engine.kernels.matvec import gemv
    lin, norms, pro, k = _role_inputs(model, role)
    w0 = lin[0].weight
    key = (role, tuple(w0.shape), w0.dtype, lin[0].bias is not None, len(lin), mode,
           torch.cuda.get_device_name(w0.device))
    if key in _CACHE:
        return _CACHE[key]
    dev, dt = w0.device, w0.dtype
    x = torch.randn(1, k, device=dev, dtype=dt)
    res = torch.randn(1, k, device=dev, dtype=dt)
    eps = norms[0].eps if norms else 1e-6

    def cublas():
        for i, l in enumerate(lin):
            h = x
            if pro == "add_rmsnorm":
                h, _ = fused_add_rmsnorm(x, res, norms[i].weight, eps)
            elif pro == "silu_mul":
                h = silu_and_mul(x)
            F.linear(h, l.weight, l.bias)

    def triton_fn(cfg):
        bn, bk, nw = cfg

        def fn():
            for i, l in enumerate(lin):
                gemv(x, l.weight, l.bias, prologue=pro, residual=res if norms else None,
                     norm_weight=norms[i].weight if norms else None, eps=eps,
                     block_n=bn, block_k=bk, num_warps=nw)
        return fn

    table = {"cublas_ms": _time_graph(cublas), "triton_ms": {}}
    for cfg in CONFIGS:
        try:
            table["triton_ms"][str(cfg)] = _time_graph(triton_fn(cfg))
        except Exception as e:  # a config that does not compile is skipped
            logger.warning("gemv %s config %s failed: %s", role, cfg, e)
    best = min(table["triton_ms"].items(), key=lambda kv: kv[1], default=None)
    plan = None
    if best is not None and (mode == "force" or best[1] < table["cublas_ms"]):
        bn, bk, nw = eval(best[0])  # noqa: S307 - our own tuple repr
        plan = {"block_n": bn, "block_k": bk, "num_warps": nw}
    table["chosen"] = plan
    _CACHE[key] = (plan, table)
    return plan, table


def tune_gemv_plan(model, mode: str | None = None):
    """-> (plan for LlamaForCausalLM.set_gemv_plan or None, timing table per role)."""
    mode = mode or os.environ.get("PDSERVE_GEMV", "auto")
    if mode == "off":
        return None, {}
    plan, tables = {}, {}
    for role in ("qkv", "o", "gate_up", "down"):
        plan[role], tables[role] = tune_role(model, role, mode)
    torch.cuda.synchronize()
    logger.info("gemv plan %s (%s)", plan, tables)
    if all(v is None for v in plan.values()):
        return None, tables
    return plan, tables
