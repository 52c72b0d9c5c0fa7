"""Choose, once per process and shape, between the Triton GEMV (engine.kernels.matvec) and
cuBLAS for each one-token projection of a Llama-family model.

Each candidate is timed as the decode graph runs it: one call per layer (so the weights
stream from HBM, not L2), captured in a CUDA graph, replayed, timed with CUDA events. The
cuBLAS side includes the separate row-wise kernel the GEMV prologue would absorb
(add+rmsnorm before qkv / gate_up, silu_and_mul before down). Settings (engine kernels
section): gemv=off disables the GEMV; gemv=force takes the fastest Triton config even when
cuBLAS is faster (for A/B measurements); gemv_split_k adds the split-K configs; Triton
configs launch with programmatic dependent launch (matvec.gemv's ``pdl``, on Hopper and
later) unless gemv_pdl is off. Every config's output is checked against cuBLAS before it is
timed.
"""
from __future__ import annotations

import logging
import statistics

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# (block_n, block_k, num_warps, split_k): tiles of 8-32 KB so each SM keeps enough loads in
# flight; split-K gives the small matrices (o_proj, qkv) more programs. A config whose
# block_k * split_k does not divide K is skipped for that role.
CONFIGS = [(4, 1024, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (16, 512, 4, 1), (8, 2048, 8, 1),
           (16, 1024, 8, 1), (4, 1024, 4, 1, "loop"), (8, 2048, 8, 1, "loop")]
# quantized weights carry 1 (fp8, int8) or 1/2 (int4) bytes a feature: wider K tiles keep
# the bytes a load moves where the float configs have them
# the same wider K tiles; a fifth element names a variant of matvec.gemv: "bits" (codes to
# fp32 by integer operations), "mma" (tiles through the tensor cores), "loop" (the passes
# over x before the weight stream as block_k loops, unroll=False: how every config ran
# before 2026-12-06; kept for the configs the H200 chose most, in case unrolling loses)
QUANT_CONFIGS = [(8, 1024, 4, 1), (8, 2048, 8, 1), (16, 1024, 4, 1), (16, 2048, 8, 1),
                 (4, 2048, 4, 1), (32, 1024, 8, 1), (8, 1024, 4, 1, "bits"),
                 (8, 2048, 8, 1, "bits"), (16, 1024, 4, 1, "bits"), (16, 2048, 8, 1, "bits"),
                 (4, 2048, 4, 1, "bits"), (32, 1024, 8, 1, "bits"), (4, 1024, 4, 1, "bits"),
                 (32, 512, 4, 1, "mma"), (64, 256, 4, 1, "mma"), (8, 1024, 4, 1, "loop"),
                 (16, 1024, 4, 1, "loop"), (16, 2048, 8, 1, "loop")]
# fp8 (W8A8) weights also try the FP8 tensor-core GEMV (matvec.gemv f8mma): wider row
# blocks (the MMA's 64-row operand), split-K where they leave SMs idle. A sixth element
# would be the pipeline depth (num_stages); deeper than Triton's default 3 was slower for
# every role on the H100 (bench/fp8_gemv_gpu.py, 2026-12-07), so none is listed. "xq": the
# a8 GEMV on codes the prologue's row-wise kernel wrote once for the call (matvec.gemv xq):
# weight-only, which skips that work, was 7-14% faster, so it may win despite its launch
F8_CONFIGS = [(64, 256, 4, 1, "f8mma"), (64, 512, 4, 1, "f8mma"), (128, 256, 4, 1, "f8mma"),
              (128, 256, 8, 1, "f8mma"), (64, 256, 4, 2, "f8mma"), (64, 512, 4, 2, "f8mma"),
              (32, 512, 4, 1, "f8mma"), (64, 128, 4, 4, "f8mma"), (64, 256, 4, 4, "f8mma"),
              (8, 1024, 4, 1, "xq"), (16, 1024, 4, 1, "xq"), (8, 2048, 8, 1, "xq"),
              (16, 2048, 8, 1, "xq")]
SPLIT_K_CONFIGS = [(4, 1024, 4, 2), (8, 1024, 4, 2), (8, 512, 4, 4), (16, 512, 4, 4),
                   (16, 1024, 8, 2)]
_VARIANT_KWARGS = {"bits": {"bits": True}, "mma": {"mma": True}, "f8mma": {"f8mma": True},
                   "loop": {"unroll": False}, "xq": {"xq": True}}
ROUNDS = 5  # candidates are timed in turn, ROUNDS times, so clock drift hits them alike
_CACHE: dict[tuple, tuple[dict | None, dict]] = {}


class GraphTimer:
    """fn() captured in a CUDA graph (after one eager call that compiles and allocates)."""

    def __init__(self, fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=s):  # not the per-process default stream,
            fn()                                         # which may belong to another GPU
        self.graph.replay()  # warm

    def time_ms(self) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def time_round_robin(fns: dict[str, object], rounds: int = ROUNDS) -> dict[str, float]:
    """Median ms of one replay per candidate, timing the candidates in turn each round."""
    graphs = {name: GraphTimer(fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(g.time_ms())
    return {name: statistics.median(t) for name, t in times.items()}


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
    k = lin[0].in_features * (2 if pro == "silu_mul" else 1)
    return lin, norms, pro, k


def tune_role(model, role: str, mode: str = "auto", pdl: bool = True, split_k: bool = False):
    """-> (config dict or None for the module's own path, {"cublas_ms": .., "triton_ms":
    {cfg: ms}}). The baseline is each projection's forward: cuBLAS for float weights, the
    quantized kernels (engine.quant.kernels) for quantized ones."""
    from engine.kernels.elementwise import fused_add_rmsnorm, silu_and_mul
    from engine.kernels.matvec import gemv, gemv_weight
    lin, norms, pro, k = _role_inputs(model, role)
    ws = [gemv_weight(l) for l in lin]
    w0 = ws[0][0]
    formats = tuple(wkw.get("w_format", "float") for _, wkw in ws)
    key = (role, tuple(w0.shape), w0.dtype, formats, lin[0].bias is not None, len(lin), mode,
           split_k, pdl, torch.cuda.get_device_name(w0.device))
    if key in _CACHE:
        return _CACHE[key]
    dev = w0.device
    dt = model.embed_tokens.weight.dtype
    x = torch.randn(1, k, device=dev, dtype=dt)
    res = torch.randn(1, k, device=dev, dtype=dt)
    eps = norms[0].eps if norms else 1e-6

    def prologue(i):
        if pro == "add_rmsnorm":
            return fused_add_rmsnorm(x, res, norms[i].weight, eps)[0]
        return silu_and_mul(x) if pro == "silu_mul" else x

    def cublas():
        for i, l in enumerate(lin):
            l(prologue(i))

    def call(i, cfg):
        bn, bk, nw, split, *var = cfg
        w, wkw = ws[i]
        got = gemv(x, w, lin[i].bias, prologue=pro, residual=res if norms else None,
                   norm_weight=norms[i].weight if norms else None, eps=eps, block_n=bn,
                   block_k=bk, num_warps=nw, split_k=split, pdl=pdl, **wkw,
                   **variant_kwargs(var))
        return got[0] if isinstance(got, tuple) else got

    def triton_fn(cfg):
        def fn():
            for i in range(len(lin)):
                call(i, cfg)
        return fn

    # every config is checked against the module's own path on the first layer of each
    # weight format before it may be timed
    checks = [(i, lin[i](prologue(i)).float()) for i in
              sorted({formats.index(f) for f in formats})]
    fns, rejected = {"cublas": cublas}, {}
    quantized = any(f != "float" for f in formats)
    configs = (QUANT_CONFIGS if quantized else CONFIGS) + (SPLIT_K_CONFIGS if split_k else [])
    if all(f == "fp8" for f in formats):
        configs = configs + F8_CONFIGS
    for cfg in configs:
        bn, bk, nw, split, *_ = cfg
        if split > 1 and lin[0].in_features % (bk * split):
            continue
        try:
            for i, want in checks:
                err = (call(i, cfg).float() - want).abs().max().item()
                tol = 2e-2 * want.abs().max().item() + 1e-3
                if not err <= tol:
                    raise ValueError(f"layer {i}: max error {err:.3g} > {tol:.3g}")
            fns[str(cfg)] = triton_fn(cfg)
        except Exception as e:  # a config that does not compile or is wrong is skipped
            rejected[str(cfg)] = f"failed: {e}"
    for cfg, why in rejected.items():
        logger.warning("gemv %s config %s rejected: %s", role, cfg, why)
    timed = time_round_robin(fns)
    table = {"cublas_ms": timed.pop("cublas"), "triton_ms": timed, "rejected": rejected}
    best = min(timed.items(), key=lambda kv: kv[1], default=None)
    plan = None
    if best is not None and (mode == "force" or best[1] < table["cublas_ms"]):
        bn, bk, nw, split, *var = eval(best[0])  # noqa: S307 - our own tuple repr
        plan = {"block_n": bn, "block_k": bk, "num_warps": nw, "split_k": split, "pdl": pdl,
                **variant_kwargs(var)}
    table["chosen"] = plan
    _CACHE[key] = (plan, table)
    return plan, table


def variant_kwargs(var) -> dict:
    """matvec.gemv keywords of a config's elements after the fourth: variant names, and an
    int, the software pipeline's depth (num_stages; Triton's default where absent)."""
    out = {}
    for v in var:
        out.update({"num_stages": v} if isinstance(v, int) else _VARIANT_KWARGS[v])
    return out


def tune_gemv_plan(model, mode: str = "auto", pdl: bool = True, split_k: bool = False):
    """-> (plan for LlamaForCausalLM.set_gemv_plan or None, timing table per role)."""
    if mode == "off":
        return None, {}
    plan, tables = {}, {}
    for role in ("qkv", "o", "gate_up", "down"):
        plan[role], tables[role] = tune_role(model, role, mode, pdl, split_k)
    torch.cuda.synchronize()
    logger.info("gemv plan %s (%s)", plan, tables)
    if all(v is None for v in plan.values()):
        return None, tables
    return plan, tables
