"""The engine against transformers (fp32, CPU): greedy tokens must be identical.

SmolLM2-135M-Instruct comes from the embedded GGUF (dequantized by our loader; transformers
gets the very same weights), tiny Llama / Qwen2 / Mistral configs use random weights.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.llm import build_engine_config
from engine.loader import load_model
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from tests.reference import hf_model_from_loaded

PROMPTS = [
    "The capital of France is", "Write a short poem about autumn leaves.",
    "def quicksort(arr):", "Q: What is 17 * 23?\nA:", "Once upon a time in a small village,",
    "The three laws of thermodynamics are", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "import torch\nimport torch.nn as nn\n\nclass", "Translate to German: I like apples.",
    "List of planets: Mercury, Venus,", "¿Cuál es la capital de España?", "1 2 3 4 5 6 7",
    "The best way to learn programming is", "Summarize: The cat sat on the mat all day long.",
    "SELECT name, age FROM users WHERE", "Recipe for pancakes:\n1.", "E = mc^2 means that",
    "In machine learning, overfitting", "日本の首都は", "A long time ago in a galaxy far, far away",
]


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` computed by the engine's paged path in one step."""
    seq = Sequence("logits", list(ids), SamplingParams(max_tokens=1))
    assert engine.block_manager.allocate_slots(seq, len(ids))
    try:
        out = SchedulerOutput([ScheduledSeq(seq, len(ids))])
        x, pos, meta, _ = engine.runner.prepare(out)
        with torch.inference_mode():
            h = engine.runner.model(x, pos, engine.runner.kv_cache, meta, engine.runner.backend)
            return engine.runner.model.compute_logits(h)
    finally:
        engine.block_manager.free_seq(seq)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_exact(spec: str, prompts_ids: list[list[int]], n: int, **engine_kw) -> float:
    loaded = load_model(spec, dtype=torch.float32)
    hf = hf_model_from_loaded(loaded)
    hf.generation_config.eos_token_id = None
    refs = [hf_greedy(hf, p, n) for p in prompts_ids]
    engine = LLMEngine(build_engine_config(spec, **engine_kw), loaded)
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    import itertools
    llm._ids = itertools.count()
    outs = llm.generate(prompts_ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    mism = [(i, r, o.token_ids) for i, (r, o) in enumerate(zip(refs, outs)) if r != o.token_ids]
    assert not mism, f"{spec}: {len(mism)} prompts differ, first: {mism[0]}"
    # max |logit difference| over prompt + generated positions
    diff = 0.0
    for p, r in zip(prompts_ids[:4], refs[:4]):
        full = p + r
        with torch.no_grad():
            ref_logits = hf(torch.tensor([full])).logits[0]
        diff = max(diff, (engine_logits(engine, full) - ref_logits).abs().max().item())
    print(f"{spec}: {len(prompts_ids)} prompts x {n} tokens identical; max |dlogit| = {diff:.2e}")
    assert diff < 1e-3
    return diff


@pytest.mark.parametrize("spec", ["dummy:tiny", "dummy:tiny-qwen2", "dummy:tiny-mistral",
                                  "dummy:tiny-llama3"])
def test_tiny_models_token_exact(spec):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (1, 5, 17, 33, 64)]
    check_exact(spec, prompts, 24, block_size=4, num_blocks=256, max_num_batched_tokens=32)


def _smollm_ids(prompts):
    from engine.loader import load_tokenizer
    tok = load_tokenizer("smollm2-135m")
    return [tok.encode(p) for p in prompts]


def test_smollm2_token_exact_quick():
    check_exact("smollm2-135m", _smollm_ids(PROMPTS[:4]), 24)


@pytest.mark.slow
def test_smollm2_token_exact_20x64():
    check_exact("smollm2-135m", _smollm_ids(PROMPTS), 64)


def test_prefix_cache_on_off_same_outputs_and_fewer_computed_tokens():
    shared = "You are a helpful assistant. Answer every question carefully and briefly. " * 6
    prompts = [shared + q for q in ("What is 2+2?", "Name a fruit.", "Say hi.")]
    sp = SamplingParams(max_tokens=12, temperature=0)
    on = LLM("smollm2-135m", enable_prefix_caching=True)
    ids = [on.tokenizer.encode(p) for p in prompts]
    common = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1)
    first = on.generate(prompts[0], sp)[0]
    rest = on.generate(prompts[1:], sp)
    assert first.num_cached_tokens == 0
    # exactly the shared full blocks are hit; only the rest of each prompt is computed
    assert [o.num_cached_tokens for o in rest] == [common // 16 * 16] * 2 and common >= 64
    off = LLM("smollm2-135m", enable_prefix_caching=False)
    ref = off.generate(prompts, sp)
    assert [o.token_ids for o in [first] + rest] == [o.token_ids for o in ref]
    assert all(o.num_cached_tokens == 0 for o in ref)


@pytest.mark.slow
def test_64_concurrent_with_preemption_equal_alone():
    tok_prompts = []
    g = torch.Generator().manual_seed(1)
    base = _smollm_ids(PROMPTS)
    for i in range(64):
        p = base[i % len(base)]
        extra = torch.randint(100, 40000, (int(torch.randint(0, 40, (1,), generator=g)),),
                              generator=g).tolist()
        tok_prompts.append(p + extra)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # 64 x ~70 tokens need ~300 blocks of 16; give far fewer so requests are preempted
    llm = LLM("smollm2-135m", num_blocks=48, max_num_seqs=64, max_num_batched_tokens=256)
    together = llm.generate(tok_prompts, sp)
    assert llm.engine.num_preemptions > 0
    alone_llm = LLM("smollm2-135m", enable_prefix_caching=False)
    for p, t in zip(tok_prompts, together):
        assert alone_llm.generate([p], sp)[0].token_ids == t.token_ids
