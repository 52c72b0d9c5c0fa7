"""Triton kernels vs their torch references, on CPU through TRITON_INTERPRET=1 (tiny shapes).

Outputs are poisoned (NaN) before each kernel runs so unwritten elements fail the comparison.
"""
import os

if not os.environ.get("TRITON_INTERPRET") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of engine.kernels

import pytest
import torch

pytest.importorskip("triton")

from engine import kernels as K  # noqa: E402
from engine.kernels import reference as R  # noqa: E402

if not K.triton_available():
    pytest.skip("triton cannot run here", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]


def close(a, b, dtype, scale=1.0):
    assert not torch.isnan(a).any(), "unwritten (NaN) elements in kernel output"
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype] * scale,
                               rtol=TOL[dtype] * scale)


def make_cache(num_blocks, layers, block_size, kv_heads, head_dim, dtype):
    return torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, dtype=dtype,
                       device=DEV)


def random_block_tables(num_seqs, max_blocks, num_blocks):
    perm = torch.randperm(num_blocks, device=DEV)[: num_seqs * max_blocks]
    return perm.view(num_seqs, max_blocks).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    cache = make_cache(6, 3, 4, 2, 64, dtype)
    expect = cache.clone()
    key = torch.randn(7, 2, 64, dtype=dtype, device=DEV)
    value = torch.randn(7, 2, 64, dtype=dtype, device=DEV)
    slots = torch.randperm(24, device=DEV)[:7]
    slots[3] = -1
    K.store_kv(key, value, cache, 1, slots)
    R.store_kv_ref(key, value, expect, 1, slots)
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size,group,num_splits", [
    (64, 16, 4, None), (64, 16, 4, 3), (128, 8, 2, 1), (64, 32, 1, 4)])
def test_paged_decode_attention(dtype, head_dim, block_size, group, num_splits):
    kv_heads, max_blocks, seqs = 2, 5, 3
    cache = make_cache(seqs * max_blocks + 2, 2, block_size, kv_heads, head_dim, dtype)
    bt = random_block_tables(seqs, max_blocks, cache.shape[0])
    ctx = torch.tensor([1, block_size * max_blocks, block_size + 3], dtype=torch.int32,
                       device=DEV)
    q = torch.randn(seqs, kv_heads * group, head_dim, dtype=dtype, device=DEV)
    scale = head_dim ** -0.5
    out = K.paged_decode_attention(q, cache, 1, bt, ctx, scale, num_splits=num_splits)
    close(out, R.paged_decode_attention_ref(q, cache, 1, bt, ctx, scale), dtype)


def test_decode_zero_context_gives_zeros():
    cache = make_cache(4, 1, 16, 1, 64, torch.float32)
    bt = random_block_tables(2, 2, 4)
    q = torch.randn(2, 2, 64, device=DEV)
    ctx = torch.tensor([0, 5], dtype=torch.int32, device=DEV)
    for splits in (1, 2):
        out = K.paged_decode_attention(q, cache, 0, bt, ctx, 0.125, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8)])
def test_paged_prefill_attention(dtype, head_dim, block_size):
    kv_heads, group, max_blocks = 2, 2, 4
    prefix = [0, 21, 5]
    qlen = [19, 3, 27]
    seqs = len(qlen)
    cache = make_cache(seqs * max_blocks + 1, 2, block_size, kv_heads, head_dim, dtype)
    max_blocks = -(-max(p + n for p, n in zip(prefix, qlen)) // block_size)
    cache = make_cache(seqs * max_blocks + 1, 2, block_size, kv_heads, head_dim, dtype)
    bt = random_block_tables(seqs, max_blocks, cache.shape[0])
    qsl = torch.tensor([0, 19, 22, 49], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([p + n for p, n in zip(prefix, qlen)], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(qlen), kv_heads * group, head_dim, dtype=dtype, device=DEV)
    out = K.paged_prefill_attention(q, cache, 0, bt, qsl, seq_lens, 0.1)
    close(out, R.paged_prefill_attention_ref(q, cache, 0, bt, qsl, seq_lens, 0.1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_and_fused_add(dtype):
    x = torch.randn(5, 96, dtype=dtype, device=DEV)
    res = torch.randn(5, 96, dtype=dtype, device=DEV)
    w = torch.randn(96, dtype=dtype, device=DEV)
    close(K.rmsnorm(x, w, 1e-6), R.rmsnorm_ref(x, w, 1e-6), dtype)
    normed, new_res = K.fused_add_rmsnorm(x, res, w, 1e-5)
    e_normed, e_res = R.fused_add_rmsnorm_ref(x, res, w, 1e-5)
    close(new_res, e_res, dtype)
    close(normed, e_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(4, 2 * 80, dtype=dtype, device=DEV)
    close(K.silu_and_mul(x), R.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_embedding(dtype, head_dim, rot_dim):
    n, max_pos = 6, 40
    pos = torch.randint(0, max_pos, (n,), device=DEV)
    qkv = torch.randn(n, 4 + 2 + 2, head_dim, dtype=dtype, device=DEV)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views, as split from a fused qkv projection
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim)
    ang = torch.arange(max_pos, device=DEV).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)
    eq, ek = q.clone(), k.clone()
    K.rotary_embedding(pos, q, k, cs)
    R.rotary_embedding_ref(pos, eq, ek, cs)
    close(q, eq, dtype)
    close(k, ek, dtype)
    assert torch.equal(qkv[:, 6:], qkv[:, 6:])


def sampling_inputs(n, vocab, temps, top_ks, top_ps, seeds=None, steps=None):
    logits = torch.randn(n, vocab, device=DEV) * 3
    f = lambda v, dt: torch.as_tensor(v, dtype=dt, device=DEV).expand(n).contiguous()
    seeds = torch.randint(0, 2**62, (n,), device=DEV) if seeds is None else f(seeds, torch.int64)
    return (logits, f(temps, torch.float32), f(top_ks, torch.int32), f(top_ps, torch.float32),
            seeds, f(0 if steps is None else steps, torch.int64))


@pytest.mark.parametrize("temp,top_k,top_p", [
    (0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 10, 0.8), (1.0, 1, 1.0)])
def test_sample_matches_reference(temp, top_k, top_p):
    args = sampling_inputs(3, 100, temp, top_k, top_p, steps=3)
    got = K.sample(*args)
    assert torch.equal(got, R.sample_ref(*args))
    if temp == 0.0 or top_k == 1:
        assert torch.equal(got, args[0].argmax(dim=1))


def test_sample_stays_inside_top_k_and_top_p():
    # the kernel equals the reference (above), so the property is checked on many rows of it
    logits, t, k, p, seeds, steps = sampling_inputs(400, 100, 1.0, 7, 0.5)
    got = R.sample_ref(logits, t, k, p, seeds, steps)
    assert torch.equal(K.sample(*(x[:2] for x in (logits, t, k, p, seeds, steps))), got[:2])
    order = torch.softmax(logits, dim=1).sort(dim=1, descending=True)
    top = order.values[:, :7] / order.values[:, :7].sum(1, keepdim=True)
    n_keep = (top.cumsum(1) < 0.5).sum(1) + 1  # the smallest prefix reaching top_p
    rank = (order.indices == got[:, None]).float().argmax(dim=1)
    assert bool((rank < n_keep).all())


def test_sample_reproducible_and_batch_independent():
    args = sampling_inputs(3, 100, 1.0, 0, 0.9, steps=11)
    a = K.sample(*args)
    assert torch.equal(a, K.sample(*args))
    assert torch.equal(K.sample(*(x[2:3] for x in args)), a[2:3])


def test_sample_frequencies_follow_softmax():
    vocab, n = 8, 20000
    row = torch.randn(vocab, device=DEV)
    logits = row.expand(n, vocab).contiguous()
    f = lambda v, dt: torch.full((n,), v, dtype=dt, device=DEV)
    args = (logits, f(0.8, torch.float32), f(0, torch.int32), f(1.0, torch.float32),
            f(1234, torch.int64), torch.arange(n, device=DEV))
    got = R.sample_ref(*args)
    assert torch.equal(K.sample(*(x[:32] for x in args)), got[:32])
    counts = torch.bincount(got, minlength=vocab).float()
    expect = torch.softmax(row / 0.8, dim=0) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 30.0, chi2  # 7 degrees of freedom: p < 1e-4 by chance


def test_wrappers_reject_bad_arguments():
    cache = make_cache(4, 2, 16, 2, 64, torch.float32)
    key = torch.randn(3, 2, 64, device=DEV)
    with pytest.raises(ValueError, match="layer"):
        K.store_kv(key, key, cache, 2, torch.zeros(3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="slot_mapping"):
        K.store_kv(key, key, cache, 0, torch.zeros(4, dtype=torch.int64, device=DEV))
    q = torch.randn(2, 3, 64, device=DEV)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    ctx = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple"):
        K.paged_decode_attention(q, cache, 0, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        K.paged_decode_attention(q[:, :2].half(), cache, 0, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="even"):
        K.silu_and_mul(torch.randn(2, 5, device=DEV))
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm(torch.randn(2, 8, device=DEV), torch.ones(9, device=DEV), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "add_rmsnorm", "silu_mul"])
@pytest.mark.parametrize("m,n,k,bias,cfg", [
    (1, 48, 96, False, (8, 32, 4, 1)), (1, 40, 64, True, (16, 64, 4, 1)),
    (3, 24, 80, False, (4, 32, 2, 1)),
    # split-K: partial sums per split, the last program of a row block reduces them
    (1, 48, 96, False, (8, 32, 4, 3)), (2, 40, 128, True, (16, 32, 4, 2)),
    # pdl: the first weight tile is loaded ahead of the prologue (on a GPU, before gdc_wait)
    (1, 48, 96, False, (8, 32, 4, 1, True)), (1, 40, 72, True, (16, 32, 4, 1, True)),
    (2, 40, 128, False, (8, 32, 4, 2, True))])
def test_gemv(dtype, prologue, m, n, k, bias, cfg):
    kx = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(m, kx, dtype=dtype, device=DEV)
    w = torch.randn(n, k, dtype=dtype, device=DEV) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=DEV) if bias else None
    kw = {}
    if prologue in ("rmsnorm", "add_rmsnorm"):
        kw["norm_weight"] = torch.randn(k, dtype=dtype, device=DEV)
        kw["eps"] = 1e-5
    if prologue == "add_rmsnorm":
        kw["residual"] = torch.randn(m, k, dtype=dtype, device=DEV)
    bn, bk, nw, split, *pdl = cfg
    kw["pdl"] = bool(pdl)
    got = K.gemv(x, w, b, prologue=prologue, block_n=bn, block_k=bk, num_warps=nw,
                 split_k=split, **kw)
    kw.pop("pdl")
    want = R.gemv_ref(x, w, b, prologue=prologue, **kw)
    if isinstance(want, tuple):
        close(got[1], want[1], dtype)
        got, want = got[0], want[0]
    close(got, want, dtype, scale=2.0)
    if split > 1:  # counters were reset: a second launch gives the same (deterministic) y
        again = K.gemv(x, w, b, prologue=prologue, block_n=bn, block_k=bk, num_warps=nw,
                       split_k=split, pdl=bool(pdl), **kw)
        assert torch.equal(again[0] if isinstance(again, tuple) else again,
                           got[0] if isinstance(got, tuple) else got)


def test_gemv_split_k_must_divide_k():
    x = torch.randn(1, 96, device=DEV)
    w = torch.randn(8, 96, device=DEV)
    with pytest.raises(ValueError, match="split_k=2 needs block_k"):
        K.gemv(x, w, block_n=8, block_k=64, split_k=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32)])
def test_rotary_store_kv(dtype, head_dim, rot_dim):
    n, max_pos = 7, 40
    cache = make_cache(6, 3, 4, 2, head_dim, dtype)
    expect = cache.clone()
    pos = torch.randint(0, max_pos, (n,), device=DEV)
    qkv = torch.randn(n, 4 + 2 + 2, head_dim, dtype=dtype, device=DEV)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]  # strided views of a fused projection
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim)
    ang = torch.arange(max_pos, device=DEV).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)
    slots = torch.randperm(24, device=DEV)[:n]
    slots[3] = -1
    eq, ek, ev = q.clone(), k.clone(), v.clone()
    K.rotary_store_kv(pos, q, k, v, cs, cache, 1, slots)
    R.rotary_store_kv_ref(pos, eq, ek, ev, cs, expect, 1, slots)
    close(q, eq, dtype)
    close(k, ek, dtype)
    assert torch.equal(v, ev)
    close(cache, expect, dtype)


def _tiny_decode_step():
    """dummy:tiny (fp32, fused ops on) and the inputs of one decode token at context 6:
    (model, config, KV cache, metadata, ids, positions)."""
    from engine.layers.attention import AttentionMetadata
    from engine.loader import load_model
    from engine.models.llama import LlamaForCausalLM
    loaded = load_model("dummy:tiny", dtype=torch.float32, device=DEV, seed=0)
    cfg = loaded.config
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg)
    model.load_weights(loaded.weights)
    model.enable_fused_ops(True)
    ctx = 6
    cache = torch.randn(4, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim, device=DEV)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([ctx - 1], device=DEV),
        block_tables=torch.tensor([[2, 0]], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEV),
        seq_lens_list=[ctx], query_lens_list=[1], max_seq_len=ctx, max_query_len=1)
    return model, cfg, cache, meta, torch.tensor([7], device=DEV), torch.tensor([ctx - 1],
                                                                              device=DEV)


def test_model_gemv_plan_matches_default_path():
    """One-token decode through the GEMV plan (fused norm / silu prologues) and the fused
    rotary+store_kv backend vs the plain model, on dummy:tiny."""
    from engine.kernels.backend import TritonAttention
    model, cfg, cache, meta, ids, pos = _tiny_decode_step()
    outs = []
    for plan, fuse in ((None, False), ({"qkv": {"block_n": 8, "block_k": 32}, "o": None,
                                        "gate_up": {"block_n": 16, "block_k": 64},
                                        "down": {"block_n": 8, "block_k": 64}}, True)):
        model.set_gemv_plan(plan)
        c = cache.clone()
        with torch.no_grad():
            outs.append((model(ids, pos, c, meta, TritonAttention(cfg.head_dim ** -0.5,
                                                                    fuse_rotary=fuse)), c))
    close(outs[1][0], outs[0][0], torch.float32, scale=10)
    close(outs[1][1], outs[0][1], torch.float32, scale=10)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_model_gemv_plan_reads_quantized_projections(fmt):
    """The GEMV plan over QuantLinear projections (codes through matvec.gemv's w_format,
    prologues fused; bits and mma variants on two roles) against the same quantized model
    on its module path, one decode token of dummy:tiny."""
    from engine.kernels.backend import TritonAttention
    from engine.quant.linear import QuantLinear
    if fmt == "fp8" and DEV == "cpu":
        pytest.skip("the interpreter's float8 cast rounds some activations to half their "
                    "value (test_quant_kernels.py); fp8 W8A8 is checked against its torch "
                    "reference on the GPU (tests/gpu/test_quant_gpu.py)")
    model, cfg, cache, meta, ids, pos = _tiny_decode_step()
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, QuantLinear.from_linear(getattr(parent, name), fmt))
    outs = []
    variant = "bits" if fmt == "fp8" else "mma"  # fp8 quantizes x in the kernel: no mma
    for plan in (None, {"qkv": {"block_n": 8, "block_k": 128}, "o": None,
                        "gate_up": {"block_n": 16, "block_k": 128, variant: True},
                        "down": {"block_n": 8, "block_k": 128, "bits": True}}):
        model.set_gemv_plan(plan)
        c = cache.clone()
        with torch.no_grad():
            outs.append(model(ids, pos, c, meta, TritonAttention(cfg.head_dim ** -0.5)))
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < err < 5e-3, f"relative error {err:.2e}"  # mma: x and int4 weights in fp16


@pytest.mark.parametrize("vocab", [100, 128, 1000])
@pytest.mark.parametrize("subset", [False, True])
def test_token_bitmask_matches_reference(vocab, subset):
    g = torch.Generator().manual_seed(vocab + subset)
    batch, words = 5, (vocab + 31) // 32
    x = torch.randn(batch, vocab, generator=g).to(DEV)
    rows = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEV) if subset else None
    n = 3 if subset else batch
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), generator=g,
                            dtype=torch.int64).to(torch.int32).to(DEV)
    bitmask[0] = -1  # every token allowed
    bitmask[-1] = 0  # none allowed
    want = x.clone()
    R.apply_token_bitmask_ref(want, bitmask, rows)
    got = x.clone()
    K.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    # the definition, bit by bit: token 32 w + b is bit b of word w
    targets = rows.tolist() if subset else list(range(batch))
    for j, r in enumerate(targets):
        bits = [(int(bitmask[j, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        expect = torch.where(torch.tensor(bits, device=DEV) == 1, x[r], float("-inf"))
        assert torch.equal(got[r], expect)
    untouched = [r for r in range(batch) if r not in targets]
    assert torch.equal(got[untouched], x[untouched])


def test_token_bitmask_checks_its_arguments():
    x = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError, match="bitmask must have shape"):
        K.apply_token_bitmask(x, torch.zeros(2, 3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="pass rows"):
        K.apply_token_bitmask(x, torch.zeros(1, 2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        K.apply_token_bitmask(x, torch.zeros(2, 2, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_argmax_matches_reference(dtype):
    g = torch.Generator().manual_seed(7)
    batch, vocab = 6, 700
    logits = torch.randn(batch, vocab, generator=g).to(dtype).to(DEV)
    logits[2, 5] = logits[2, 9] = 50.0  # a tie: the first index wins, as torch.argmax
    rows = torch.tensor([4, 2, 0, 5], dtype=torch.int64, device=DEV)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=g,
                            dtype=torch.int64).to(torch.int32).to(DEV)
    bitmask[1] = -1  # row 2: everything allowed
    bitmask[3] = 0  # row 5: nothing allowed (0, as torch.argmax over -inf)
    out = torch.full((batch,), -7, dtype=torch.int64, device=DEV)
    want = out.clone()
    R.masked_argmax_ref(logits, bitmask, rows, want)
    K.masked_argmax(logits, bitmask, rows, out)
    assert torch.equal(out, want)
    assert int(out[2]) == 5 and int(out[5]) == 0 and int(out[1]) == -7
    masked = logits.float().index_select(0, rows)
    K.apply_token_bitmask(masked, bitmask)
    assert torch.equal(out[rows], masked.argmax(dim=-1))


def test_masked_greedy_equals_the_sampler():
    """engine.layers.sampler.masked_greedy (GPU graph steps masked and nothing else) gives
    the tokens of the full sampler: the forward's argmax for free rows, masked for the
    rest (llguidance matchers over the dummy models' byte tokenizer)."""
    from engine import Constraint
    from engine.grammar import GrammarCompiler
    from engine.layers.sampler import Sampler, SamplingBatch, masked_greedy
    from engine.loader import ByteTokenizer

    bt = ByteTokenizer()
    vocab = 512
    c = GrammarCompiler(bt, vocab, bt.eos_token_ids)
    batch = 5
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(3)).to(DEV)
    sb = SamplingBatch([0.0] * batch, [0] * batch, [1.0] * batch, [None] * batch, False,
                       masks=[(1, c.matcher(Constraint("regex", "(yes|no)"))),
                              (3, c.matcher(Constraint("regex", "[0-9]+")))])
    assert sb.masks_only
    got = masked_greedy(logits, logits.argmax(dim=-1), sb).tokens
    want = Sampler(torch.Generator(device=DEV))(logits, sb).tokens
    assert torch.equal(got, want)
    assert int(got[1]) - bt.OFFSET in (ord("y"), ord("n"))
    assert chr(int(got[3]) - bt.OFFSET).isdigit()
    free = [0, 2, 4]
    assert torch.equal(got[free], logits[free].argmax(dim=-1))


def test_seeded_exponentials_are_the_counter_rng_and_batch_independent():
    seeds = torch.tensor([3, 2**62 + 5, 3, -9], dtype=torch.int64, device=DEV)
    steps = torch.tensor([0, 7, 1, 2**40], dtype=torch.int64, device=DEV)
    got = K.seeded_exponentials(seeds, steps, 300)
    want = R.seeded_exponentials_ref(seeds, steps, 300)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert bool((got > 0).all()) and not torch.equal(got[0], got[2])  # a new step: new draws
    alone = K.seeded_exponentials(seeds[1:2], steps[1:2], 300)
    assert torch.equal(alone[0], got[1])  # a row's draws do not depend on the batch
    big = K.seeded_exponentials(seeds[:1], steps[:1], 4000)
    assert abs(float(big.mean()) - 1.0) < 0.05  # Exp(1): mean 1 (sd of the mean ~0.016)


def test_sampler_draws_counted_rows_from_the_counter_rng():
    """SamplingBatch.counters (a GPU's seeded rows): each such row's token is the exponential
    race over its own (seed, step) draws, whatever else is in the batch."""
    from engine.layers.sampler import Sampler, SamplingBatch
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(DEV)

    def batch(rows, counters):
        n = len(rows)
        return SamplingBatch([0.9] * n, [0] * n, [1.0] * n, [None] * n, False,
                             counters=counters)

    s = Sampler(torch.Generator(device=DEV).manual_seed(0))
    got = s(logits, batch([0, 1, 2], [(11, 4), None, (12, 0)])).tokens
    for r, (seed, step) in ((0, (11, 4)), (2, (12, 0))):
        e = R.seeded_exponentials_ref(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
        p = torch.softmax(logits[r].float().cpu() / 0.9, dim=-1)
        assert int(got[r]) == int((p / e).argmax())
        alone = s(logits[r:r + 1], batch([r], [(seed, step)])).tokens
        assert int(alone[0]) == int(got[r])


def test_model_gemv_plan_with_codes_quantized_once_matches_the_a8_plan():
    """A GEMV plan whose fp8 roles take xq (the prologue's row-wise kernel quantizes x once
    for the call; matvec.gemv xq) gives the decode step of the same plan without it: the
    residual stream, the fused prologues and the codes pass through the model as before."""
    from engine.kernels.backend import TritonAttention
    from engine.quant.linear import QuantLinear
    model, cfg, cache, meta, ids, pos = _tiny_decode_step()
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, QuantLinear.from_linear(getattr(parent, name), "fp8"))
    outs = []
    for xq in ({}, {"xq": True}):
        cfg1 = {"block_n": 8, "block_k": 128, **xq}
        model.set_gemv_plan({"qkv": cfg1, "o": cfg1, "gate_up": cfg1, "down": cfg1})
        c = cache.clone()
        with torch.no_grad():
            outs.append(model(ids, pos, c, meta, TritonAttention(cfg.head_dim ** -0.5)))
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert err < 1e-5, f"relative error {err:.2e}"
