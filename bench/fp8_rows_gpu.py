"""fp8 (W8A8) calls of 2..8 rows on one GPU: does an eager prefill of a few tokens give the
first token the CUDA graphs give (their mixed-step graphs pad a prefill to >= 129 rows, so
it runs act_fp8 + _scaled_mm), and what do the two kernels for such calls cost.

    python3 -m bench.fp8_rows_gpu > fp8_rows_gpu.log          (one GPU, ~1.5 min)

Part 1: dummy:smollm2-135m with quantization fp8; prompts of 5, 40 and 300 tokens, one at a
time ("single") and together ("batch3"), greedy, 4 tokens: the first tokens and top-3
logprobs of the engine with CUDA graphs, of the engine stepping eagerly (the routing of this
commit: two rows or more take act_fp8 + _scaled_mm), and of the eager engine with calls of
2..8 rows sent to the FP8 tensor-core GEMV as they were until 2026-12-07 (matvec.gemv f8mma,
the tiles that routing used). Part 2: ms per 32 calls (32 distinct Llama-3-8B-shaped weights,
in one CUDA graph, engine.kernels.gemv_tune.time_round_robin) at 2 and 8 rows, the old
routing's f8mma against act_fp8 + _scaled_mm.

The log of 2026-12-07 (bench/results/fp8_rows_gpu/) came from this script's first version,
run at 0d62424, when the eager engine still took f8mma for 2..8 rows: its "eager" lines are
this version's "eager-f8mma-2to8" and its "eager-2to8-rows-by-scaled_mm" lines this
version's "eager".
"""
import torch

import engine.quant.kernels as QK
import engine.quant.reference as ref
from engine import LLM, SamplingParams
from engine.kernels.gemv_tune import time_round_robin
from engine.kernels.matvec import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def f8mma_rows(x, qw, bias=None):
    """Calls of 2..8 fp8 rows as they ran until 2026-12-07 (F8MMA_ROWS_CONFIG's tiles)."""
    n, k = qw["q"].shape
    cfg = ({"block_n": 128, "block_k": 512, "num_warps": 8} if n >= 6144 else
           {"block_n": 64, "block_k": 512, "num_warps": 4,
            "split_k": 2 if k % 1024 == 0 else 1})
    return gemv(x.contiguous(), qw["q"], bias, f8mma=True, **cfg, **ref.gemv_keywords(qw))


def first_tokens():
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=3)
    prompts = [[(7 * i + j) % 1000 + 5 for i in range(n)] for j, n in enumerate((5, 40, 300))]
    kw = dict(quantization="fp8", device="cuda", kv_cache_memory_bytes=2 << 30,
              max_model_len=1024)

    def run(name, **extra):
        llm = LLM("dummy:smollm2-135m", **kw, **extra)
        for tag, oo in (("single", [llm.generate([p], sp)[0] for p in prompts]),
                        ("batch3", llm.generate(prompts, sp))):
            print(name, tag, [(o.token_ids[:4], [(t, round(lp, 3)) for t, lp in
                                                 o.top_logprobs[0]]) for o in oo], flush=True)
        del llm
        torch.cuda.empty_cache()

    run("graphs")
    run("eager", enforce_eager=True)
    orig = QK.quant_linear

    def old_routing(x, qw, bias=None):
        if 1 < x.shape[0] <= ref.GEMV_MAX_ROWS and qw["format"] == "fp8":
            return f8mma_rows(x, qw, bias)
        return orig(x, qw, bias)

    QK.quant_linear = old_routing
    try:
        run("eager-f8mma-2to8", enforce_eager=True)
    finally:
        QK.quant_linear = orig


def timings():
    for m in (2, 8):
        for role, (n, k) in SHAPES.items():
            qws = [ref.quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64)
                   for _ in range(32)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = {"f8mma": lambda: [f8mma_rows(x, q) for q in qws],
                   "scaled_mm": lambda: [QK.fp8_gemm(x, q) for q in qws]}
            ms = time_round_robin(fns, 3)
            print(f"m={m} {role}: " + ", ".join(f"{a} {b:.4f} ms" for a, b in ms.items()),
                  flush=True)
            del qws


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    first_tokens()
    timings()
