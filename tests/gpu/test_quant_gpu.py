"""Quantized projections on the GPU: every kernel of engine.quant.kernels against the torch
reference at Llama-3-8B shapes (bf16 activations), and a quantized engine under the CUDA
graphs giving the same greedy tokens as the same engine stepping eagerly.

    PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_quant_gpu.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine.quant import kernels as QK  # noqa: E402
from engine.quant import reference as ref  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _case(fmt, n, k, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    qw = ref.QUANTIZERS[fmt](w)
    x = torch.randn(m, k, device="cuda", generator=g).to(BF16)
    return x, qw


def _close(got, want, tol):
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gemv_full_size(fmt, shape, m):
    x, qw = _case(fmt, *SHAPES[shape], m)
    _close(QK.quant_linear(x, qw), ref.quant_matmul_ref(x, qw), 2e-3)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [9, 64, 512, 4096])
def test_gemm_full_size(fmt, shape, m):
    x, qw = _case(fmt, *SHAPES[shape], m)
    # bf16 weight tiles / fp8 activations: the reference rounds the same way for fp8
    _close(QK.quant_linear(x, qw), ref.quant_matmul_ref(x, qw), 1e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_engine_under_cuda_graphs_matches_eager(fmt):
    from engine import LLM, SamplingParams
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 5 for i in range(n)] for j, n in enumerate((5, 40, 300))]
    kw = dict(quantization=fmt, kv_cache_memory_bytes=2 << 30, max_model_len=1024)
    graphs = LLM("dummy:smollm2-135m", **kw)
    assert graphs.engine.runner.graphs, "no CUDA graphs were captured"
    got = [o.token_ids for o in graphs.generate(prompts, sp)]
    assert graphs.engine.runner.graph_steps > 0
    del graphs
    torch.cuda.empty_cache()
    eager = LLM("dummy:smollm2-135m", enforce_eager=True, **kw)
    want = [o.token_ids for o in eager.generate(prompts, sp)]
    assert got == want


def test_fp8_kv_cache_on_the_gpu_holds_twice_the_blocks():
    from engine import LLM, SamplingParams
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_memory_bytes=1 << 30, max_model_len=1024)
    bf = LLM("dummy:smollm2-135m", attention_backend="torch", **kw)
    ref_tokens = bf.generate([[3, 4, 5] * 50], sp)[0].token_ids
    nb = bf.engine.runner.num_blocks
    del bf
    torch.cuda.empty_cache()
    f8 = LLM("dummy:smollm2-135m", kv_dtype="fp8", **kw)
    assert f8.engine.runner.num_blocks >= 1.8 * nb  # 1 + 4/head_dim bytes a value, not 2
    got = f8.generate([[3, 4, 5] * 50], sp)[0].token_ids
    assert got[:4] == ref_tokens[:4]
