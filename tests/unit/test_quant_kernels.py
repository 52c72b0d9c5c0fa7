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

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(fmt, n, k, m, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    qw = {key: (v.to(DEV) if isinstance(v, torch.Tensor) else v)
          for key, v in ref.QUANTIZERS[fmt](w).items()}
    x = torch.randn(m, k, generator=g).to(DEV)
    b = torch.randn(n, generator=g).to(DEV) if bias else None
    return x, qw, b


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
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
