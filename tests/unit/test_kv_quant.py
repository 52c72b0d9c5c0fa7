"""The int8 / fp8 KV cache (engine.quant.kv): codes, slabs, attention, the engine, the layout."""
import pytest
import torch

from engine.layers.attention import AttentionMetadata, TorchAttention
from engine.quant.kv import (CODE_DTYPES, PACKED_KV, QuantKVAttention, dequantize, quantize,
                              slabs)


@pytest.mark.parametrize("kind,rel", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_codes_and_scales_round_trip(kind, rel):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    codes, scale = quantize(x, CODE_DTYPES[kind])
    assert codes.dtype == torch.uint8 and codes.shape == (5, 3, 64)
    assert scale.dtype == torch.float32 and scale.shape == (5, 3)
    amax = x.abs().amax(-1)
    assert torch.allclose(scale, amax / (127 if kind == "int8" else 448))
    back = dequantize(codes, scale, CODE_DTYPES[kind], torch.float32)
    assert ((back - x).abs() <= amax[..., None] * rel + 1e-6).all()


def test_slabs_hold_codes_then_scales_per_block_layer_and_kv():
    """Each (block, layer, K/V) slab of bs * Hk * (D + 4) bytes: the codes [bs, Hk, D], then
    the float32 scales [Hk, bs]; the views write the cache itself."""
    bs, hk, d = 4, 2, 8
    cache = torch.zeros(3, 2, 2, bs, hk, d + 4, dtype=torch.int8)
    codes, scales = slabs(cache, 1, 0)
    codes[2, 3, 1] = torch.arange(d, dtype=torch.uint8)
    scales[2, 1, 3] = 0.5
    slab = cache.view(torch.uint8)[2, 1, 0].flatten()
    at = (3 * hk + 1) * d
    assert slab[at:at + d].tolist() == list(range(d))
    sc = slab[bs * hk * d:].view(torch.float32)
    assert sc[1 * bs + 3] == 0.5 and int((sc != 0).sum()) == 1
    # nothing else written: codes 1..d-1, and 0.5's one nonzero byte (0x3f000000)
    assert int((cache.view(torch.uint8) != 0).sum()) == (d - 1) + 1


def _qdq(x, code):
    return dequantize(*quantize(x, code), code, torch.float32)


def _meta(qlens, slens, bs, tables):
    slots = []
    for q, s, t in zip(qlens, slens, tables):
        slots += [t[p // bs] * bs + p % bs for p in range(s - q, s)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens_list=slens,
        query_lens_list=qlens, max_seq_len=max(slens), max_query_len=max(qlens))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_attention_equals_float_attention_over_the_dequantized_kv(kind):
    """Prefill then decode through QuantKVAttention equal TorchAttention run on the K/V
    values the quantized cache holds (the only difference is the codes' rounding)."""
    g = torch.Generator().manual_seed(1)
    bs, L, hk, hq, d = 4, 2, 2, 4, 16
    code = CODE_DTYPES[kind]
    qcache = torch.zeros(8, L, 2, bs, hk, d + 4, dtype=code)
    fcache = torch.zeros(8, L, 2, bs, hk, d)
    tables = [[3, 1, 6], [2, 5]]
    q1, k1, v1 = (torch.randn(17, h, d, generator=g) for h in (hq, hk, hk))
    kq = _qdq(k1, code)
    vq = _qdq(v1, code)
    qa, fa = QuantKVAttention(d ** -0.5, code), TorchAttention(d ** -0.5)
    m = _meta([10, 7], [10, 7], bs, tables)
    got = qa.forward(1, q1, k1, v1, qcache, m)
    want = fa.forward(1, q1, kq, vq, fcache, _meta([10, 7], [10, 7], bs, tables))
    assert torch.allclose(got, want, atol=1e-5)
    q2, k2, v2 = (torch.randn(2, h, d, generator=g) for h in (hq, hk, hk))
    got = qa.forward(1, q2, k2, v2, qcache, _meta([1, 1], [11, 8], bs, tables))
    want = fa.forward(1, q2, _qdq(k2, code),
                      _qdq(v2, code), fcache,
                      _meta([1, 1], [11, 8], bs, tables))
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_engine_with_a_quantized_kv_cache(kind):
    from engine import LLM, SamplingParams
    from kvtransfer import KVLayout
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base = LLM("dummy:tiny", num_blocks=64)
    llm = LLM("dummy:tiny", num_blocks=64, kv_dtype=kind)
    r, mc = llm.engine.runner, llm.engine.model_config
    assert r.kv_cache.dtype == CODE_DTYPES[kind] and r.kv_cache.shape[-1] == mc.head_dim + 4
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11] * 3, [20, 21, 22]]
    want = [o.token_ids for o in base.generate(prompts, sp)]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    # the layout two workers compare at the handshake tells the formats apart, and names
    # the slab format (a build whose cache said "float8_e4m3fn" / "int8" is refused)
    lq = KVLayout.from_cache(r.kv_cache, packed=PACKED_KV[r.kv_cache.dtype])
    lf = KVLayout.from_cache(base.engine.runner.kv_cache)
    assert lq != lf and lq.head_dim == mc.head_dim + 4
    assert lq.dtype == {"int8": "int8/slab", "fp8": "fp8/slab"}[kind]
    assert lq != KVLayout.from_cache(r.kv_cache)
    lq.validate(r.kv_cache)
    with pytest.raises(ValueError, match="packed format"):
        KVLayout.from_cache(base.engine.runner.kv_cache, packed="fp8/slab")
    # block bytes: 8-bit codes + a 4-byte scale per row, against float32's 4 bytes a value
    assert lq.block_bytes * 4 * mc.head_dim == lf.block_bytes * (mc.head_dim + 4)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_triton_backend_over_a_quantized_cache_matches_the_torch_path(kind):
    """attention_backend triton with an int8 / fp8 cache (store_kv quantizing, the attention
    kernels reading codes; the CPU interpreter here) gives the torch path's greedy tokens;
    auto keeps the torch path for a quantized cache. int8: the first layer's cache bytes
    are the torch path's and the logprobs within 1e-4 (later layers see inputs that differ
    in the last bits, so a scale may differ by an ulp). fp8: the interpreter's own e4m3
    cast (tests/reference.assert_fp8_codes) moves logprobs by ~0.02, so tokens only."""
    import os
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU engine through the interpreter; tests/gpu/test_quant_gpu.py "
                    "runs the compiled kernels in a GPU engine")
    from engine import LLM, SamplingParams
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11] * 3, [20, 21, 22]]
    torch_llm = LLM("dummy:tiny", num_blocks=32, kv_dtype=kind)
    triton_llm = LLM("dummy:tiny", num_blocks=32, kv_dtype=kind, attention_backend="triton")
    assert torch_llm.engine.runner.backend.name == "torch-kvq"
    assert triton_llm.engine.runner.backend.name == "triton"
    want = torch_llm.generate(prompts, sp)
    got = triton_llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if kind == "int8":
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        layer0 = [llm.engine.runner.kv_cache.view(torch.uint8)[:, 0]
                  for llm in (triton_llm, torch_llm)]
        assert torch.equal(*layer0)
