"""Triton kernels vs torch references at Llama-3-8B shapes in bf16 (run on the GPU machine)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine import kernels as K  # noqa: E402
from engine.kernels import reference as R  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def close(a, b, tol=2e-2):
    assert not torch.isnan(a).any(), "unwritten (NaN) elements"
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def cache_and_tables(num_seqs, max_blocks, layers=2):
    n = num_seqs * max_blocks + 1
    cache = torch.randn(n, layers, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF16, device=DEV)
    bt = torch.randperm(n, device=DEV)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    return cache, bt.to(torch.int32)


@pytest.mark.parametrize("batch,ctx", [(1, 256), (1, 4096), (64, 512), (7, 1000)])
def test_decode(batch, ctx):
    cache, bt = cache_and_tables(batch, -(-ctx // BLOCK))
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=BF16, device=DEV)
    lens = torch.randint(1, ctx + 1, (batch,), device=DEV, dtype=torch.int32)
    lens[0] = ctx
    out = K.paged_decode_attention(q, cache, 1, bt, lens, HEAD_DIM ** -0.5)
    close(out, R.paged_decode_attention_ref(q, cache, 1, bt, lens, HEAD_DIM ** -0.5))


@pytest.mark.parametrize("prefix,qlens", [
    ([0], [4096]), ([3072], [1024]), ([0, 48, 500], [700, 33, 257])])
def test_prefill(prefix, qlens):
    seq_lens = [p + n for p, n in zip(prefix, qlens)]
    cache, bt = cache_and_tables(len(qlens), -(-max(seq_lens) // BLOCK))
    qsl = torch.tensor([0] + qlens, device=DEV).cumsum(0).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(qlens), HEADS, HEAD_DIM, dtype=BF16, device=DEV)
    out = K.paged_prefill_attention(q, cache, 0, bt, qsl, sl, HEAD_DIM ** -0.5)
    close(out, R.paged_prefill_attention_ref(q, cache, 0, bt, qsl, sl, HEAD_DIM ** -0.5))


def test_store_kv():
    cache, _ = cache_and_tables(4, 64)
    expect = cache.clone()
    k, v = (torch.randn(2048, KV_HEADS, HEAD_DIM, dtype=BF16, device=DEV) for _ in range(2))
    slots = torch.randperm(cache.shape[0] * BLOCK, device=DEV)[:2048]
    slots[::7] = -1
    K.store_kv(k, v, cache, 1, slots)
    R.store_kv_ref(k, v, expect, 1, slots)
    assert torch.equal(cache, expect)


def test_norm_silu_rope():
    x, res = (torch.randn(4096, 4096, dtype=BF16, device=DEV) for _ in range(2))
    w = torch.randn(4096, dtype=BF16, device=DEV)
    close(K.rmsnorm(x, w, 1e-5), R.rmsnorm_ref(x, w, 1e-5))
    got, want = K.fused_add_rmsnorm(x, res, w, 1e-5), R.fused_add_rmsnorm_ref(x, res, w, 1e-5)
    close(got[0], want[0])
    close(got[1], want[1])
    gu = torch.randn(4096, 2 * 14336, dtype=BF16, device=DEV)
    close(K.silu_and_mul(gu), R.silu_and_mul_ref(gu))
    qkv = torch.randn(4096, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=BF16, device=DEV)
    q, k = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS]
    pos = torch.randint(0, 8192, (4096,), device=DEV)
    inv = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM)
    ang = torch.arange(8192, device=DEV).float()[:, None] * inv
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    eq, ek = q.clone(), k.clone()
    K.rotary_embedding(pos, q, k, cs)
    R.rotary_embedding_ref(pos, eq, ek, cs)
    close(q, eq)
    close(k, ek)


def test_sample():
    n, vocab = 64, 128256
    logits = torch.randn(n, vocab, device=DEV) * 4
    t = torch.rand(n, device=DEV) + 0.2
    t[:8] = 0
    k = torch.randint(0, 100, (n,), device=DEV, dtype=torch.int32)
    p = torch.rand(n, device=DEV) * 0.5 + 0.5
    seeds = torch.randint(0, 2**62, (n,), device=DEV)
    steps = torch.randint(0, 1000, (n,), device=DEV)
    got = K.sample(logits, t, k, p, seeds, steps)
    ref = R.sample_ref(logits, t, k, p, seeds, steps)
    assert torch.equal(got[:8], logits[:8].argmax(1))
    # GPU exp/log may differ from torch's by an ulp: allow a rare tie flip
    assert (got == ref).float().mean() >= 0.95
    assert torch.equal(got, K.sample(logits, t, k, p, seeds, steps))


@pytest.mark.parametrize("n,k,prologue", [
    (6144, 4096, "add_rmsnorm"), (4096, 4096, "none"), (28672, 4096, "rmsnorm"),
    (4096, 14336, "silu_mul")])
def test_gemv(n, k, prologue):
    kx = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(1, kx, dtype=BF16, device=DEV)
    w = torch.randn(n, k, dtype=BF16, device=DEV) / k ** 0.5
    kw = {}
    if prologue != "none" and prologue != "silu_mul":
        kw["norm_weight"] = torch.randn(k, dtype=BF16, device=DEV)
    if prologue == "add_rmsnorm":
        kw["residual"] = torch.randn(1, k, dtype=BF16, device=DEV)
    want = R.gemv_ref(x, w, prologue=prologue, **kw)
    for bn, bk, nw, split in [(8, 1024, 4, 1), (16, 512, 4, 1), (8, 2048, 8, 1),
                              (8, 1024, 4, 2), (16, 512, 4, 4)]:
        for _ in range(2 if split > 1 else 1):  # the second launch reuses the reset counters
            got = K.gemv(x, w, prologue=prologue, block_n=bn, block_k=bk, num_warps=nw,
                         split_k=split, **kw)
            if isinstance(want, tuple):
                assert torch.equal(got[1], want[1])
                close(got[0], want[0])
            else:
                close(got, want)


def test_gemv_split_k_in_a_cuda_graph_replays_exactly():
    """The arrival counters return to zero, so a captured split-K GEMV replays correctly."""
    x = torch.randn(1, 4096, dtype=BF16, device=DEV)
    w = torch.randn(4096, 4096, dtype=BF16, device=DEV) / 64
    first = K.gemv(x, w, block_n=8, block_k=512, split_k=4)  # allocates the counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = K.gemv(x, w, block_n=8, block_k=512, split_k=4)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, K.gemv(x, w, block_n=8, block_k=512, split_k=4))
        close(y, R.gemv_ref(x, w))
    assert first.shape == y.shape


def test_gemv_pdl_chain_in_a_cuda_graph():
    """Programmatic dependent launch: a chain of GEMVs, each reading the previous one's output
    (and residual), captured in a graph, equals the same chain launched normally."""
    torch.manual_seed(0)
    k = 4096
    ws = [torch.randn(k, k, dtype=BF16, device=DEV) / 64 for _ in range(6)]
    nws = [torch.rand(k, dtype=BF16, device=DEV) + 0.5 for _ in range(6)]
    x0 = torch.randn(1, k, dtype=BF16, device=DEV)
    r0 = torch.randn(1, k, dtype=BF16, device=DEV)

    def chain(pdl, split):
        h, r = x0, r0
        for i, (w, nw) in enumerate(zip(ws, nws)):
            if i % 2:
                h = K.gemv(h, w, block_n=8, block_k=512, split_k=split, pdl=pdl)
            else:
                h, r = K.gemv(h, w, prologue="add_rmsnorm", residual=r, norm_weight=nw,
                              eps=1e-5, block_n=8, block_k=1024, pdl=pdl)
        return h, r

    for split in (1, 2):
        want = chain(False, split)
        chain(True, split)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = chain(True, split)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_store_kv():
    cache, _ = cache_and_tables(4, 64)
    expect = cache.clone()
    n = 512
    qkv = torch.randn(n, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=BF16, device=DEV)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    pos = torch.randint(0, 8192, (n,), device=DEV)
    inv = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM)
    ang = torch.arange(8192, device=DEV).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)
    slots = torch.randperm(cache.shape[0] * BLOCK, device=DEV)[:n]
    slots[::7] = -1
    eq, ek, ev = q.clone(), k.clone(), v.clone()
    K.rotary_store_kv(pos, q, k, v, cs, cache, 1, slots)
    R.rotary_store_kv_ref(pos, eq, ek, ev, cs, expect, 1, slots)
    close(q, eq, tol=1e-2)  # fp32 math on both sides; FMA contraction may move one ulp
    close(k, ek, tol=1e-2)
    close(cache, expect, tol=1e-2)


@pytest.mark.parametrize("subset", [False, True])
def test_token_bitmask(subset):
    batch, vocab = 64, 128256
    x = torch.randn(batch, vocab, device=DEV)
    rows = torch.randperm(batch, device=DEV)[:17].to(torch.int32) if subset else None
    n = 17 if subset else batch
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), device=DEV,
                            dtype=torch.int64).to(torch.int32)
    want, got = x.clone(), x.clone()
    R.apply_token_bitmask_ref(want, bitmask, rows)
    K.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_masked_argmax(dtype):
    batch, vocab = 64, 128256
    logits = torch.randn(batch, vocab, device=DEV).to(dtype)
    rows = torch.randperm(batch, device=DEV)[:17]
    bitmask = torch.randint(-2**31, 2**31 - 1, (17, (vocab + 31) // 32), device=DEV,
                            dtype=torch.int64).to(torch.int32)
    greedy = logits.argmax(dim=-1)
    want, got = greedy.clone(), greedy.clone()
    R.masked_argmax_ref(logits, bitmask, rows, want)
    K.masked_argmax(logits, bitmask, rows, got)
    assert torch.equal(got, want)
