"""The Triton kernels over an int8 / fp8 KV cache (engine.kernels: store_kv, decode and
prefill attention reading codes + scales) against the torch path (engine.quant.kv), on the
CPU through TRITON_INTERPRET=1 at small shapes; a GPU machine runs them compiled."""
import os

if not os.environ.get("TRITON_INTERPRET") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels

import pytest
import torch

pytest.importorskip("triton")

from engine import kernels as K  # noqa: E402

if not K.triton_available():
    pytest.skip("triton cannot run here", allow_module_level=True)

from engine.kernels import reference as R  # noqa: E402
from engine.quant.kv import CODE_DTYPES, quantize, read_cache, slabs  # noqa: E402
from tests.reference import assert_fp8_codes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
KINDS = ["int8", "fp8"]
# float32 on a GPU: tl.dot runs in TF32 (10-bit mantissa), as the float cache's kernels do
TOL = {torch.float32: 1e-5 if DEV == "cpu" else 5e-3, torch.bfloat16: 2e-2}


def _cache(kind, blocks=14, layers=2, bs=16, heads=2, d=64):
    return torch.zeros(blocks, layers, 2, bs, heads, d + 4, dtype=CODE_DTYPES[kind],
                       device=DEV)


def _filled(kind, dtype, bs=16, heads=2, d=64, blocks=14):
    """A cache whose every slot of layer 1 holds quantized random K/V, and its float view."""
    cache = _cache(kind, blocks, 2, bs, heads, d)
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(blocks * bs, heads, d, generator=g) * 2).to(DEV, dtype)
    v = torch.randn(blocks * bs, heads, d, generator=g).to(DEV, dtype)
    K.store_kv(k, v, cache, 1, torch.arange(blocks * bs, device=DEV))
    deq = torch.zeros(cache.shape[:-1] + (d,), dtype=dtype, device=DEV)
    deq[:, 1] = read_cache(cache, 1, dtype)
    return cache, deq


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantizes_rows_as_the_torch_path(kind, dtype):
    """Codes and scales equal engine.quant.kv.quantize_rows (ties to even for int8; the
    interpreter's own e4m3 rounding quirks aside for fp8); slot -1 writes nothing."""
    cache = _cache(kind, 6, 3, 4, 2, 64)
    want = cache.clone()
    g = torch.Generator().manual_seed(0)
    key = torch.randn(7, 2, 64, generator=g).to(DEV, dtype)
    value = torch.randn(7, 2, 64, generator=g).to(DEV, dtype)
    key[0, 0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # int8 ties: 0, 2, -2 after scaling
    value[1, 1] = 0.0  # an all-zero row: scale 1e-8 / qmax, codes 0
    slots = torch.randperm(24, generator=g)[:7].to(DEV)
    slots[3] = -1
    K.store_kv(key, value, cache, 1, slots)
    ok = slots >= 0
    blk, off = slots[ok] // 4, slots[ok] % 4
    for which, x in ((0, key), (1, value)):
        codes, scales = slabs(want, 1, which)
        codes[blk, off], scales[blk, :, off] = quantize(x[ok], CODE_DTYPES[kind])
    for which in (0, 1):
        (got_c, got_s), (want_c, want_s) = slabs(cache, 1, which), slabs(want, 1, which)
        assert torch.equal(got_s, want_s)  # the scales, bit for bit
        if kind == "int8":
            assert torch.equal(got_c, want_c)
        else:
            assert_fp8_codes(got_c, want_c, exact=DEV == "cuda", ties=dtype == torch.bfloat16)
    for layer in (0, 2):  # other layers untouched
        assert not cache.view(torch.uint8)[:, layer].any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_with_static_scales_as_the_torch_path(kind, dtype):
    """Static scales (one per layer, K/V and head): every stored row gets its head's scale
    in its slot, codes are x / scale saturated at the format's largest code (some rows here
    exceed the static range), as engine.quant.kv.quantize with that scale."""
    cache = _cache(kind, 6, 3, 4, 2, 64)
    want = cache.clone()
    g = torch.Generator().manual_seed(1)
    key = torch.randn(9, 2, 64, generator=g).to(DEV, dtype)
    value = torch.randn(9, 2, 64, generator=g).to(DEV, dtype)
    static = (torch.rand(3, 2, 2, generator=g) * 0.01 + 0.004).to(DEV)  # 3 layers, K/V, heads
    slots = torch.randperm(24, generator=g)[:9].to(DEV)
    slots[5] = -1
    K.store_kv(key, value, cache, 2, slots, static_scales=static)
    ok = slots >= 0
    blk, off = slots[ok] // 4, slots[ok] % 4
    for which, x in ((0, key), (1, value)):
        codes, scales = slabs(want, 2, which)
        codes[blk, off], scales[blk, :, off] = quantize(x[ok], CODE_DTYPES[kind],
                                                        static[2, which])
    qmax = 127 if kind == "int8" else 448
    assert (key.float().abs().amax(-1) / static[2, 0] > qmax).any()  # saturation exercised
    for which in (0, 1):
        (got_c, got_s), (want_c, want_s) = slabs(cache, 2, which), slabs(want, 2, which)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_s[blk, :, off], static[2, which].expand(len(blk), 2))
        if kind == "int8":
            assert torch.equal(got_c, want_c)
        else:
            assert_fp8_codes(got_c, want_c, exact=DEV == "cuda", ties=dtype == torch.bfloat16)
    assert not cache.view(torch.uint8)[:, :2].any()
    with pytest.raises(ValueError, match="static_scales"):
        K.store_kv(key, value, cache, 2, slots, static_scales=static[:2])
    with pytest.raises(ValueError, match="quantized"):
        K.store_kv(key, value, torch.zeros(6, 3, 2, 4, 2, 64, device=DEV), 2, slots,
                   static_scales=static)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_reads_codes_as_their_values(kind, dtype, num_splits):
    """Decode attention over the codes equals attention over the dequantized cache."""
    cache, deq = _filled(kind, torch.float32)
    bt = torch.randperm(14, generator=torch.Generator().manual_seed(1))[:12].view(3, 4)
    bt = bt.to(DEV, torch.int32)
    ctx = torch.tensor([1, 64, 19], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    out = K.paged_decode_attention(q, cache, 1, bt, ctx, 0.125, num_splits=num_splits)
    want = R.paged_decode_attention_ref(q.float(), deq, 1, bt, ctx, 0.125)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_codes_as_their_values(kind, dtype):
    """Ragged prefill with cached prefixes (0, 21, 5 tokens) over the codes equals the
    reference over the dequantized cache."""
    cache, deq = _filled(kind, torch.float32)
    qlen, prefix = [19, 3, 27], [0, 21, 5]
    bt = torch.randperm(14, generator=torch.Generator().manual_seed(4))[:9].view(3, 3)
    bt = bt.to(DEV, torch.int32)
    qsl = torch.tensor([0, 19, 22, 49], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([p + n for p, n in zip(prefix, qlen)], dtype=torch.int32,
                            device=DEV)
    q = torch.randn(49, 4, 64, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    out = K.paged_prefill_attention(q, cache, 1, bt, qsl, seq_lens, 0.125)
    want = R.paged_prefill_attention_ref(q.float(), deq, 1, bt, qsl, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_quantized_cache_arguments_are_checked():
    cache = _cache("fp8")
    q = torch.randn(1, 4, 64, device=DEV)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    ctx = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"q must have shape \(1, .*, 64\)"):  # not 64 + 4
        K.paged_decode_attention(torch.randn(1, 4, 68, device=DEV), cache, 0, bt, ctx, 0.1)
    odd = torch.zeros(2, 1, 2, 16, 2, 6 + 3, dtype=torch.int8, device=DEV)
    with pytest.raises(ValueError, match="4-byte aligned"):
        K.paged_decode_attention(q[..., :6], odd, 0, bt, ctx, 0.1)
    with pytest.raises(ValueError, match="dtype"):  # the fused rotary store takes floats
        K.rotary_store_kv(torch.zeros(1, dtype=torch.int64, device=DEV), q,
                          torch.randn(1, 2, 64, device=DEV), torch.randn(1, 2, 64, device=DEV),
                          torch.randn(8, 64, device=DEV), cache, 0,
                          torch.zeros(1, dtype=torch.int64, device=DEV))
