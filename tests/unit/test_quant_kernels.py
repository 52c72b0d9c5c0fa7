"""Triton kernels of the quantized projections vs the torch reference, on the CPU through
TRITON_INTERPRET=1 at small shapes (the GPU runs the same tests at full size:
tests/gpu/test_quant_gpu.py). Outputs start as NaN so unwritten elements fail."""
import os

if not os.environ.get("TRITON_INTERPRET") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels

import pytest
import torch

pytest.importorskip("triton")

from engine import kernels as K  # noqa: E402

if not K.triton_available():
    pytest.skip("triton cannot run here", allow_module_level=True)

from engine.quant import kernels as QK  # noqa: E402
from engine.quant import reference as ref  # noqa: E402
from tests.reference import assert_fp8_codes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(fmt, n, k, m, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    qw = {key: (v.to(DEV) if isinstance(v, torch.Tensor) else v)
          for key, v in ref.QUANTIZERS[fmt](w).items()}
    x = torch.randn(m, k, generator=g).to(DEV)
    b = torch.randn(n, generator=g).to(DEV) if bias else None
    return x, qw, b


def _prologue_case(fmt, n, k, m, bias, prologue):
    """_case plus the x and keywords a GEMV prologue takes: (x, qw, bias, keywords)."""
    x, qw, b = _case(fmt, n, k, m, bias)
    if prologue == "silu_mul":
        x = torch.randn(m, 2 * k, device=DEV)
    kw = {}
    if prologue == "add_rmsnorm":
        kw = {"norm_weight": torch.randn(k, device=DEV), "residual": torch.randn(m, k, device=DEV),
              "eps": 1e-5}
    return x, qw, b, kw


def _weight_only(qw):
    """The GEMV keywords of ``qw`` with fp8's activation quantization off (the kernel's
    weight stream alone, checked against the dequantized weight)."""
    return {k: v for k, v in ref.gemv_keywords(qw).items() if k not in ("a8", "w_format")}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n,k,m,bias", [(40, 200, 1, False), (64, 256, 3, True),
                                        (33, 130, 8, False)])
def test_gemv_matches_reference(fmt, n, k, m, bias):
    x, qw, b = _case(fmt, n, k, m, bias)
    got = QK.quant_gemv(x, qw, b, block_n=16, block_k=64)
    want = ref.quant_matmul_ref(x, qw, b)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n,k,m,bias", [(40, 200, 9, True), (64, 256, 33, False)])
def test_gemm_matches_reference(fmt, n, k, m, bias):
    x, qw, b = _case(fmt, n, k, m, bias)
    got = QK.quant_gemm(x, qw, b, block_m=16, block_n=16, block_k=32)
    want = ref.quant_matmul_ref(x, qw, b)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_dispatch_and_argument_checks():
    x, qw, b = _case("int8", 16, 64, 2, False)
    with pytest.raises(ValueError, match="features"):
        QK.quant_linear(x[:, :32], qw)
    with pytest.raises(ValueError, match="fp8_gemm"):
        QK.quant_gemm(*_case("fp8", 16, 64, 16, False)[:2])
    with pytest.raises(ValueError, match="unknown weight format"):
        QK.quant_linear(x, {**qw, "format": "nf4"})


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("prologue", ["none", "add_rmsnorm", "silu_mul"])
@pytest.mark.parametrize("n,k,bias,cfg", [
    (40, 256, False, (8, 128, 4, 1)), (33, 200, True, (16, 128, 4, 1)),
    (48, 512, False, (8, 128, 4, 2)), (40, 256, True, (8, 256, 4, 1, True))])
@pytest.mark.parametrize("bits", [False, True])
def test_bandwidth_gemv_reads_quantized_weights(fmt, prologue, n, k, bias, cfg, bits):
    """engine.kernels.matvec.gemv with w_format: the dense GEMV's weight stream, prologues,
    split-K and the PDL prefetch on codes (converted by instructions, or by integer
    operations: bits), against the prologue then the dequantized weight (the reference's
    own math)."""
    from engine.kernels import reference as R
    from engine.kernels.matvec import gemv
    x, qw, b, kw = _prologue_case(fmt, n, k, 1, bias, prologue)
    wkw = _weight_only(qw)
    bn, bk, nw, split, *pdl = cfg
    got = gemv(x, qw["q"], b, prologue=prologue, block_n=bn, block_k=bk, num_warps=nw,
               split_k=split, pdl=bool(pdl), w_format=fmt, bits=bits, **wkw, **kw)
    want = R.gemv_ref(x, ref.dequantize(qw)[:, :k].contiguous(), b, prologue=prologue, **kw)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1], want[1])
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, atol=5e-4, rtol=5e-4)


def test_bandwidth_gemv_refuses_mismatched_quantized_weights():
    from engine.kernels.matvec import gemv
    x, qw, _ = _case("int4", 16, 256, 1, False)
    with pytest.raises(ValueError, match="group 128 must be"):
        gemv(x, qw["q"], w_format="int4", w_scale=qw["scale"], w_zero=qw["zero"], group=128,
             block_k=64)
    with pytest.raises(ValueError, match="int4 weight"):
        gemv(x, qw["q"], w_format="int4", w_scale=qw["scale"], group=128, block_k=128)
    x8, q8, _ = _case("fp8", 16, 64, 1, False)
    with pytest.raises(ValueError, match="need w_scale"):
        gemv(x8, q8["q"], w_format="fp8")
    with pytest.raises(ValueError, match=r"w_scale \[N\]"):
        gemv(x8, q8["q"], w_format="fp8", w_scale=q8["scale"][:8])
    with pytest.raises(ValueError, match="dtype"):
        gemv(x8, q8["q"], w_format="int8", w_scale=q8["scale"])


@pytest.mark.parametrize("m,k", [(1, 64), (9, 200), (5, 1500)])
def test_fp8_activation_kernel_matches_reference(m, k):
    """One-kernel per-token fp8 quantization: the same codes and scales as the torch
    reference (rows with a zero row and a large outlier included)."""
    x = torch.randn(m, k, device=DEV) * 3
    x[0, k // 2] = 900.0
    if m > 2:
        x[1] = 0.0
    q, s = QK.act_fp8(x, block=128)
    want_q, want_s = ref.quant_act_fp8(x)
    assert torch.equal(s, want_s)
    # (tests/gpu/test_quant_gpu.py checks every code on the GPU)
    assert_fp8_codes(q, want_q, exact=DEV == "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,residual", [(1, 64, False), (9, 200, True), (12, 96, True)])
def test_fused_prologue_codes_equal_the_unfused_kernels(dtype, m, k, residual):
    """norm_act_fp8 / silu_mul_act_fp8 (the row-wise kernel writes act_fp8's codes and
    scales, the fp8 prefill's prologues) give exactly what rmsnorm / fused_add_rmsnorm /
    silu_and_mul followed by act_fp8 give, new residual included; fp8_prologue_linear is
    those codes through fp8_gemm_codes."""
    from engine.kernels.elementwise import fused_add_rmsnorm, rmsnorm, silu_and_mul
    x = (torch.randn(m, k, device=DEV) * 3).to(dtype)
    x[0, k // 3] = 300.0
    r = torch.randn(m, k, device=DEV).to(dtype) if residual else None
    w = torch.rand(k, device=DEV).to(dtype) + 0.5
    q, s, new_res = QK.norm_act_fp8(x, w, 1e-5, r)
    if residual:
        h, want_res = fused_add_rmsnorm(x, r, w, 1e-5)
        assert torch.equal(new_res, want_res)
    else:
        h = rmsnorm(x, w, 1e-5)
        assert new_res is None
    wq, ws = QK.act_fp8(h)
    assert torch.equal(s, ws) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    gu = (torch.randn(m, 2 * k, device=DEV) * 2).to(dtype)
    q, s = QK.silu_mul_act_fp8(gu)
    wq, ws = QK.act_fp8(silu_and_mul(gu))
    assert torch.equal(s, ws) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    q, s = QK.silu_mul_act_fp8(gu, block=64)  # two passes over the row
    assert torch.equal(s, ws) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    with pytest.raises(ValueError, match="even"):
        QK.silu_mul_act_fp8(gu[:, :-1])
    with pytest.raises(ValueError, match="residual"):
        QK.norm_act_fp8(x, w, 1e-5, torch.randn(m + 1, k, device=DEV).to(dtype))
    with pytest.raises(ValueError, match="prologue"):
        QK.fp8_prologue_linear(ref.quantize_fp8(torch.randn(8, k)), None, "gelu", x)


def test_quantlinear_fuses_its_prologue_only_for_large_fp8_gpu_calls():
    """QuantLinear.prologue_forward: None (the caller runs the prologue) for int8 / int4, on
    the CPU (on a GPU, fp8 fuses it for calls of more than one row)."""
    from engine.layers.norm import RMSNorm
    from engine.quant.linear import QuantLinear
    lin = torch.nn.Linear(64, 32, bias=False)
    norm = RMSNorm(64, 1e-5)
    for fmt in ("int8", "int4", "fp8"):
        ql = QuantLinear.from_linear(lin, fmt)
        assert ql.prologue_forward("rmsnorm", torch.randn(16, 64), None, norm) is None
        assert ql.prologue_forward("silu_mul", torch.randn(16, 128)) is None


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("prologue", ["none", "add_rmsnorm", "silu_mul"])
@pytest.mark.parametrize("n,k,bias,bk", [(48, 256, False, 128), (33, 200, True, 128),
                                         (40, 512, False, 256)])
def test_tensor_core_gemv_reads_quantized_weights(fmt, prologue, n, k, bias, bk):
    """gemv(mma=True): tiles expanded to fp16 and multiplied on the tensor cores (x rounded
    to fp16, int4 weights too), against the prologue then the dequantized weight."""
    from engine.kernels import reference as R
    from engine.kernels.matvec import gemv
    x, qw, b, kw = _prologue_case(fmt, n, k, 1, bias, prologue)
    wkw = _weight_only(qw)
    got = gemv(x, qw["q"], b, prologue=prologue, block_n=16, block_k=bk, mma=True,
               w_format=fmt, **wkw, **kw)
    want = R.gemv_ref(x, ref.dequantize(qw)[:, :k].contiguous(), b, prologue=prologue, **kw)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1], want[1])
        got, want = got[0], want[0]
    assert not torch.isnan(got).any()
    assert ((got - want).norm() / want.norm()).item() < 3e-3
    with pytest.raises(ValueError, match="mma"):
        gemv(x, qw["q"], b, prologue=prologue, block_n=8, block_k=bk, mma=True, w_format=fmt,
             **wkw, **kw)


@pytest.mark.parametrize("prologue", ["none", "add_rmsnorm", "silu_mul"])
@pytest.mark.parametrize("n,k,m,split,pdl", [(48, 256, 1, 1, False), (33, 200, 3, 1, True),
                                             (48, 512, 1, 2, False), (40, 256, 8, 1, False)])
def test_fp8_gemv_quantizes_its_activations(prologue, n, k, m, split, pdl):
    """fp8 is W8A8 in every call: the GEMV (a8) quantizes each row of the prologue's output
    per token in the kernel, as act_fp8 does, then multiplies codes by codes. Compared
    with act_fp8 on the same values and a float32 matmul of the codes (on the CPU the
    interpreter's float8 cast stands on both sides; tests/gpu checks the torch reference)."""
    from engine.kernels import reference as R
    from engine.kernels.matvec import gemv
    x, qw, _, kw = _prologue_case("fp8", n, k, m, False, prologue)
    got = gemv(x, qw["q"], None, prologue=prologue, block_n=16, block_k=128, split_k=split,
               pdl=pdl, **ref.gemv_keywords(qw), **kw)
    h = R.gemv_ref(x, torch.eye(k, device=DEV), None, prologue=prologue, **kw)
    h = h[0] if isinstance(h, tuple) else h
    xq, sx = QK.act_fp8(h.contiguous(), block=128)
    want = (xq.float() @ qw["q"].float().t()) * sx * qw["scale"][None, :]
    got = got[0] if isinstance(got, tuple) else got
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="a8"):
        gemv(x, qw["q"], None, prologue=prologue, mma=True, block_n=16, block_k=128,
             **ref.gemv_keywords(qw), **kw)
    with pytest.raises(ValueError, match="quantize their activations"):
        QK.quant_gemv(x[:, :k], qw)


@pytest.mark.parametrize("prologue", ["none", "add_rmsnorm", "silu_mul", "rmsnorm"])
@pytest.mark.parametrize("n,k,m,split,bias", [(48, 256, 1, 1, False), (33, 200, 3, 1, True),
                                              (64, 512, 16, 2, True)])
def test_fp8_tensor_core_gemv_matches_the_a8_gemv(prologue, n, k, m, split, bias):
    """gemv(f8mma=True): the a8 GEMV's codes of x (per row, after the prologue) multiplied by
    the weight codes on the FP8 tensor cores, every row in one pass over W; the result, the
    new residual and the rows past M (untouched) agree with the a8 GEMV."""
    from engine.kernels.matvec import gemv
    x, qw, b, kw = _prologue_case("fp8", n, k, m, bias, prologue)
    if prologue == "rmsnorm":
        kw = {"norm_weight": torch.randn(k, device=DEV), "eps": 1e-5}
    args = dict(prologue=prologue, block_n=16, block_k=64, split_k=split,
                **ref.gemv_keywords(qw), **kw)
    want = gemv(x, qw["q"], b, **args)
    got = gemv(x, qw["q"], b, f8mma=True, **args)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.shape == want.shape == (m, n)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    for bad in (dict(block_n=8), dict(block_k=16), dict(a8=False)):
        with pytest.raises(ValueError, match="f8mma"):
            gemv(x, qw["q"], b, f8mma=True, **{**args, **bad})
    with pytest.raises(ValueError, match="f8mma"):
        gemv(torch.randn(17, k, device=DEV), qw["q"], None, f8mma=True, block_n=16,
             block_k=64, **ref.gemv_keywords(qw))


def test_fp8_results_do_not_depend_on_the_batch():
    """The same request gives the same logprob alone and prefilled with another prompt
    (one call of more than GEMV_MAX_ROWS tokens): fp8 is W8A8 whatever the call's size.
    Weight-only decode calls once made these differ (-3.464 against -3.495 on dummy:tiny),
    and on the GPU a CUDA graph's padding did the same."""
    from engine import LLM, SamplingParams
    sp = SamplingParams(max_tokens=3, temperature=0, logprobs=True, ignore_eos=True)
    llm = LLM("dummy:tiny", device="cpu", quantization="fp8", enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 26, max_model_len=256)
    a, b = [5, 9, 13, 17, 21], list(range(30, 50))
    alone = llm.generate([a], sp)[0]
    both = llm.generate([a, b], sp)[0]
    assert alone.token_ids == both.token_ids
    assert alone.logprobs == pytest.approx(both.logprobs, abs=1e-5)


def test_every_gemv_tuner_config_is_a_gemv_call():
    """Each config the GPU tuner may time (engine.kernels.gemv_tune) names only variants it
    maps to matvec.gemv keywords: a wrong name would only show on a GPU, at startup."""
    import inspect
    from engine.kernels import gemv_tune as GT
    from engine.kernels.matvec import gemv
    params = inspect.signature(gemv).parameters
    for cfg in GT.CONFIGS + GT.QUANT_CONFIGS + GT.F8_CONFIGS + GT.SPLIT_K_CONFIGS:
        assert len(cfg) in (4, 5, 6) and all(isinstance(v, int) for v in cfg[:4])
        kw = GT.variant_kwargs(cfg[4:])
        assert set(kw) <= set(params), (cfg, kw)
    assert GT.variant_kwargs(("loop",)) == {"unroll": False}
    assert GT.variant_kwargs(("f8mma", 4)) == {"f8mma": True, "num_stages": 4}
    with pytest.raises(KeyError):
        GT.variant_kwargs(("nope",))



@pytest.mark.parametrize("prologue", ["none", "add_rmsnorm", "silu_mul", "rmsnorm"])
@pytest.mark.parametrize("n,k,m,split,pdl,bias", [(48, 256, 1, 1, True, False),
                                                  (33, 200, 3, 1, False, True),
                                                  (48, 512, 1, 2, True, True)])
def test_fp8_gemv_on_codes_quantized_once_matches_the_a8_gemv(prologue, n, k, m, split, pdl,
                                                               bias):
    """gemv(xq=True): the prologue and x's quantization run once, in the fp8 prefill's
    row-wise kernel, and the GEMV reads the codes; the result, the new residual and the
    refusals agree with the a8 GEMV that quantizes x in every program."""
    from engine.kernels.matvec import gemv
    x, qw, b, kw = _prologue_case("fp8", n, k, m, bias, prologue)
    if prologue == "rmsnorm":
        kw = {"norm_weight": torch.randn(k, device=DEV), "eps": 1e-5}
    args = dict(prologue=prologue, block_n=16, block_k=128, split_k=split, pdl=pdl,
                **ref.gemv_keywords(qw), **kw)
    want = gemv(x, qw["q"], b, **args)
    got = gemv(x, qw["q"], b, xq=True, **args)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.shape == want.shape == (m, n)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    for bad in (dict(a8=False), dict(bits=True), dict(f8mma=True)):
        with pytest.raises(ValueError, match="xq"):
            gemv(x, qw["q"], b, xq=True, **{**args, **bad})
