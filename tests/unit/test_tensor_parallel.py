"""Tensor parallelism on the CPU (gloo): a TP=2 engine gives TP=1's tokens and logits.

Real rank processes, real gloo collectives; two processes per test (rank 0 is pytest's)."""
from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.loader import load_model
from engine.loader.dummy import dummy_config, weight_shapes
from engine.parallel import RankFailure, ShardPlan, check_shardable

PROMPTS = [[1, 5 + i, 17, 33 + 3 * i, 99, 7 * i + 2] for i in range(8)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------------- the plan
def test_plan_slices_heads_mlp_and_vocab():
    c = dummy_config("tiny")  # 4 heads, 2 KV heads, head_dim 16, inter 128, vocab 512
    p = ShardPlan(c, 1, 2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert p.slices(q, (64, 64)) == (slice(32, 64),)
    assert p.slices("model.layers.1.self_attn.k_proj.weight", (32, 64)) == (slice(16, 32),)
    assert p.slices("model.layers.0.self_attn.o_proj.weight", (64, 64)) == (
        slice(None), slice(32, 64))
    assert p.slices("model.layers.0.mlp.up_proj.weight", (128, 64)) == (slice(64, 128),)
    assert p.slices("model.layers.0.mlp.down_proj.weight", (64, 128)) == (
        slice(None), slice(64, 128))
    assert p.slices("model.embed_tokens.weight", (512, 64)) == (slice(256, 512),)
    assert p.slices("model.layers.0.input_layernorm.weight", (64,)) is None
    assert p.kv_heads == (1, 2)


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    c = dummy_config("tiny-mistral")  # 4 heads, 1 KV head
    plans = [ShardPlan(c, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1)]
    assert [p.num_heads for p in plans] == [2, 2]
    c8 = ModelConfig(arch="llama", vocab_size=100, hidden_size=64, intermediate_size=64,
                     num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8)
    # query heads 2r, 2r+1 of rank r use KV head (2r) // 4 = r // 2
    assert [ShardPlan(c8, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_plan_pads_the_last_vocab_shard_and_rejects_what_does_not_divide():
    c = ModelConfig(arch="llama", vocab_size=101, hidden_size=64, intermediate_size=64,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    p = ShardPlan(c, 1, 2)
    assert p.vocab_range == (51, 101) and p.pad_rows("lm_head.weight") == 1
    w = torch.arange(101 * 2, dtype=torch.float32).view(101, 2)
    t = p.take("lm_head.weight", (101, 2), lambda ix: w[ix])
    assert t.shape == (51, 2) and torch.equal(t[:50], w[51:]) and not t[50].any()
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_shardable(c, 3)
    with pytest.raises(ValueError, match="intermediate size"):
        check_shardable(ModelConfig(arch="llama", vocab_size=8, hidden_size=8,
                                    intermediate_size=6, num_layers=1, num_heads=4,
                                    num_kv_heads=4, head_dim=2), 4)


def test_sharded_dummy_load_is_a_slice_of_the_whole_and_about_half_the_bytes():
    whole = load_model("dummy:tiny", seed=3).weights
    parts = [load_model("dummy:tiny", seed=3, shard=lambda c, r=r: ShardPlan(c, r, 2)).weights
             for r in range(2)]
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([parts[0][q], parts[1][q]]), whole[q])
    d = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([parts[0][d], parts[1][d]], dim=1), whole[d])
    nbytes = [sum(t.numel() for t in w.values()) for w in (whole, *parts)]
    norms = sum(n for name, n in weight_shapes(dummy_config("tiny")).items()
                if name.endswith("norm.weight") for n in [n[0]])
    assert nbytes[1] == nbytes[2] == (nbytes[0] - norms) // 2 + norms


# --------------------------------------------------------------- the engines
def _run(model: str, tp: int, record: bool = True, **kw):
    """(outputs, logits of every step in order) of greedy decoding of PROMPTS."""
    llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp, **kw)
    steps: list[torch.Tensor] = []
    try:
        m = llm.engine.runner.model
        orig = m.compute_logits

        def spy(hidden):  # the logits sampling reads, kept for the comparison
            out = orig(hidden)
            steps.append(out.clone())
            return out

        if record:
            m.compute_logits = spy
        return llm.generate(PROMPTS, GREEDY), steps
    finally:
        llm.close()


def _assert_tp_matches(model: str, **kw):
    ref, ref_logits = _run(model, 1, **kw)
    got, got_logits = _run(model, 2, **kw)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ref, got))
    assert same >= 7, [(a.token_ids, b.token_ids) for a, b in zip(ref, got)]
    # steps line up while every sequence's tokens agree (all of them when same == 8)
    n = len(ref_logits) if same == 8 else 1
    assert len(got_logits) == len(ref_logits)
    delta = max((a - b).abs().max().item() for a, b in zip(ref_logits[:n], got_logits[:n]))
    assert delta <= 1e-4, delta
    assert len({tuple(o.token_ids) for o in ref}) > 1  # varied prompts, varied outputs


@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:tiny-qwen2"])
def test_tp2_equals_tp1(model):
    _assert_tp_matches(model)


def test_tp2_equals_tp1_with_fewer_kv_heads_than_ranks():
    assert dummy_config("tiny-mistral").num_kv_heads == 1
    _assert_tp_matches("dummy:tiny-mistral")


def test_tp2_from_safetensors_equals_tp1(tmp_path):
    from engine.loader import load_tokenizer
    from tests.reference import save_hf_folder

    tok = load_tokenizer("smollm2-135m").backend.to_str()  # decodes the ids; prompts are ids
    save_hf_folder(load_model("dummy:tiny-llama3", seed=5), str(tmp_path / "m"), shards=2,
                   tokenizer_json=tok)
    _assert_tp_matches(str(tmp_path / "m"))


def test_rejects_a_model_the_ranks_cannot_split_before_any_rank_starts(monkeypatch):
    from engine.parallel import driver
    started = []
    real = driver._start_rank
    monkeypatch.setattr(driver, "_start_rank", lambda: started.append(1) or real())
    with pytest.raises(ValueError, match="does not divide"):
        LLM("dummy:tiny", device="cpu", tensor_parallel_size=3)
    assert started == []  # the model's config is read first; no process to clean up


def test_a_killed_rank_fails_the_engine_within_seconds_and_leaves_nothing_behind():
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", tensor_parallel_size=2)
    tp = llm.engine.runner.tp
    pid = tp.pids[0]
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=200, temperature=0,
                                                   ignore_eos=True))
    eng.step()
    eng.step()  # mid-request: prompts computed, decoding
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - t0 < 10
    assert tp.failure is not None and "rank 1" in tp.failure
    llm.close()
    assert tp.procs[0].poll() is not None
    assert not os.path.exists(tp.dir)


@pytest.mark.slow
def test_tp3_from_the_gguf_equals_tp1():
    """smollm2-135m (9 heads, 3 KV heads): each of 3 ranks dequantizes and keeps its slices
    of the GGUF; TP=1 runs the same dense weights (cpu_packed off)."""
    prompts = PROMPTS[:4]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs, logits = [], []
    for tp in (1, 3):
        with LLM("smollm2-135m", device="cpu", dtype="float32", cpu_packed=False,
                 tensor_parallel_size=tp, num_blocks=64) as llm:
            m = llm.engine.runner.model
            steps: list[torch.Tensor] = []
            orig = m.compute_logits
            m.compute_logits = lambda h, orig=orig, steps=steps: steps.append(orig(h)) or steps[-1]
            outs.append([o.token_ids for o in llm.generate(prompts, sp)])
            logits.append(steps)
    assert outs[0] == outs[1]
    delta = max((a - b).abs().max().item() for a, b in zip(*logits))
    assert delta <= 1e-3, delta  # logits of order 10-30 here; fp32 sums in another order


def test_dummy_llama_3_70b_has_the_real_shapes_and_splits_on_2_4_8_ranks():
    c = dummy_config("llama-3-70b")
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size) == (80, 8192, 28672, 64, 8, 128, 128256)
    params = sum(math.prod(s) for s in weight_shapes(c).values())
    assert 70.5e9 < params < 70.6e9  # Llama-3-70B: 70.55B parameters
    for n in (2, 4, 8):
        check_shardable(c, n)
        assert [ShardPlan(c, r, n).kv_heads for r in range(n)] == [
            (r * 8 // n, (r + 1) * 8 // n) for r in range(n)]
    with pytest.raises(ValueError, match="does not divide the model's 64 attention heads"):
        check_shardable(c, 48)
    odd = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=12,
                      num_layers=1, num_heads=12, num_kv_heads=4, head_dim=2)
    with pytest.raises(ValueError, match="4 KV heads: one must divide the other"):
        check_shardable(odd, 6)


def test_ranks_exit_when_rank_0_is_killed(tmp_path):
    """Rank 0 (the engine's process) dies by SIGKILL: its ranks see the pipe close and exit
    (no orphaned process waiting on a collective)."""
    import subprocess
    import sys

    code = ("from engine import LLM\n"
            "llm = LLM('dummy:tiny', device='cpu', tensor_parallel_size=2)\n"
            "print(llm.engine.runner.tp.pids[0], flush=True)\n"
            "import time; time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        rank = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(rank):
            time.sleep(0.1)
        assert not _alive(rank)
    finally:
        if p.poll() is None:
            p.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
