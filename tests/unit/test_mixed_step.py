"""Mixed steps (sequences decoding while others prefill): the model runner lays out the
one-token rows first so the GPU backend can run the decode kernel on them, and the Triton
backend's split path gives the same attention as one prefill-kernel launch and as the torch
reference. Triton runs on the CPU through TRITON_INTERPRET=1 (tiny model)."""
from __future__ import annotations

import os

if not os.environ.get("TRITON_INTERPRET") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of engine.kernels

import pytest
import torch

from engine import LLM, SamplingParams


def mixed_step(**kw):
    """An engine after two steps of three requests under a 16-token budget, and its next
    (mixed) step: r0 and r2 decode, r1's prompt is still being prefilled in chunks, and r1
    is scheduled between them (running requests go oldest first)."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=16, **kw)
    eng = llm.engine
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng.add_request("r0", list(range(5, 10)), sp)  # 5 tokens
    eng.add_request("r1", list(range(20, 60)), sp)  # 40 tokens: chunks of 11, 14, ...
    eng.add_request("r2", [7], sp)
    for _ in range(2):
        eng.step()
    sched = eng.scheduler.schedule()
    return eng, sched


def test_prepare_puts_one_token_rows_first_and_keeps_sample_order():
    eng, sched = mixed_step()
    qlens = [item.num_new_tokens for item in sched.scheduled]
    assert [item.seq.request_id for item in sched.scheduled] == ["r0", "r1", "r2"]
    assert qlens[0] == 1 and qlens[1] > 1 and qlens[2] == 1
    ids, pos, meta, rows = eng.runner.prepare(sched)
    assert meta.num_decode == 2 and meta.query_lens_list == [1, 1, qlens[1]]
    r0, r1, r2 = (item.seq for item in sched.scheduled)
    # flat layout: r0, r2, then r1's chunk
    assert pos[:2].tolist() == [r0.num_computed_tokens, r2.num_computed_tokens]
    assert ids[:2].tolist() == [r0.token_ids[-1], r2.token_ids[-1]]
    start = r1.num_computed_tokens
    assert ids[2:].tolist() == r1.token_ids[start:start + qlens[1]]
    # sample rows in scheduled order: the items that sample (r0, r2; r1 only at its end)
    sampled = [i for i, item in enumerate(sched.scheduled) if item.samples]
    want = {0: 0, 2: 1, 1: 1 + qlens[1]}
    assert rows == [want[i] for i in sampled]
    rest = meta.rest
    assert rest.num_seqs == 1 and rest.query_start_loc.tolist() == [0, qlens[1]]
    assert rest.seq_lens.tolist() == [start + qlens[1]]
    assert rest.slot_mapping.tolist() == meta.slot_mapping[2:].tolist()
    assert rest.block_tables.tolist() == meta.block_tables[2:].tolist()


def test_a_step_of_one_kind_keeps_its_order():
    eng, sched = mixed_step()
    decode_only = type(sched)(scheduled=[s for s in sched.scheduled if s.num_new_tokens == 1])
    _, _, meta, _ = eng.runner.prepare(decode_only)
    assert meta.num_decode == 0 and meta.rest is None


@pytest.mark.parametrize("split", [True, False])
def test_triton_split_mixed_step_matches_the_torch_backend(split):
    pytest.importorskip("triton")
    from engine import kernels as K
    if not K.triton_available():
        pytest.skip("triton cannot run here")
    from engine.kernels.backend import TritonAttention
    from engine.layers.attention import TorchAttention

    eng, sched = mixed_step(attention_backend="torch")
    runner = eng.runner
    ids, pos, meta, _ = runner.prepare(sched)
    scale = runner.mc.head_dim ** -0.5
    cache = runner.kv_cache.clone()
    # one layer's q/k/v for the step, random, through each backend on its own cache copy
    g = torch.Generator().manual_seed(3)
    t, hq, hk, d = ids.shape[0], runner.mc.num_heads, runner.mc.num_kv_heads, runner.mc.head_dim
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hk, hk))
    ref = TorchAttention(scale).forward(1, q, k, v, cache.clone(), meta)
    got = TritonAttention(scale, split_mixed=split).forward(1, q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_generation_with_mixed_steps_matches_each_request_alone():
    """Greedy tokens of requests that met mixed steps (16-token budget) equal each request
    run alone (no mixed step), on the torch backend the CPU serves with."""
    prompts = [list(range(5, 10)), list(range(20, 60)), [7]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    mixed = LLM("dummy:tiny", block_size=4, num_blocks=128, max_num_seqs=8,
                max_num_batched_tokens=16).generate(prompts, sp)
    alone = LLM("dummy:tiny", block_size=4, num_blocks=128, max_num_seqs=8)
    for p, out in zip(prompts, mixed):
        assert out.token_ids == alone.generate([p], sp)[0].token_ids


def test_engine_stats_count_model_runs_by_path():
    """The CPU runs every step eagerly (no CUDA graphs): its stats say so."""
    eng, _ = mixed_step()
    while eng.has_work:
        eng.step()
    st = eng.stats()
    assert st.eager_steps == st.steps > 0
    assert st.graph_steps == st.mixed_graph_steps == 0
