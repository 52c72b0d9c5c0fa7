"""Offline API behaviour: sampling options, seeds, stops, logprobs, abort, chat, validation."""
from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.sampler import Sampler, SamplingBatch
from engine.request import FinishReason


@pytest.fixture(scope="module")
def tiny():
    return LLM("dummy:tiny", block_size=4, num_blocks=512)


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m")


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    p = [5, 6, 7, 8, 9]
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    a = tiny.generate([p], sp)[0].token_ids
    # same seed, now batched with other (unseeded and seeded) requests
    outs = tiny.generate([[1, 2, 3], p, [9, 9]], [
        SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), sp,
        SamplingParams(max_tokens=20, temperature=0.7, seed=1, ignore_eos=True)])
    assert outs[1].token_ids == a
    c = tiny.generate([p], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert c[0].token_ids != a


def test_top_k_one_is_greedy(tiny):
    p = [11, 12, 13]
    g = tiny.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    k1 = tiny.generate([p], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3,
                                           ignore_eos=True))[0]
    assert g.token_ids == k1.token_ids


def test_sampler_respects_top_k_and_top_p():
    gen = torch.Generator().manual_seed(0)
    s = Sampler(gen)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    toks = s(logits, SamplingBatch([1.0] * 400, [3] * 400, [1.0] * 400, [None] * 400, False),
             ).to_host()[0]
    assert set(toks) <= {0, 1, 2} and len(set(toks)) == 3
    # probs ~ [.64 .23 .09 ...]: top_p=0.8 keeps tokens 0 and 1 only
    toks = s(logits, SamplingBatch([1.0] * 400, [0] * 400, [0.8] * 400, [None] * 400, False),
             ).to_host()[0]
    assert set(toks) == {0, 1}
    # frequencies follow the softmax (token 0 ~ 0.64 of draws without truncation)
    toks = s(logits, SamplingBatch([1.0] * 400, [0] * 400, [1.0] * 400, [None] * 400, False),
             ).to_host()[0]
    frac0 = toks.count(0) / 400
    assert 0.55 < frac0 < 0.73


def test_logprobs_of_chosen_tokens(tiny):
    out = tiny.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0, logprobs=True,
                                                    ignore_eos=True))[0]
    assert len(out.logprobs) == 6 and all(lp <= 0 for lp in out.logprobs)


def test_stop_token_ids_and_max_tokens(tiny):
    p = [21, 22, 23]
    free = tiny.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = tiny.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                            stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == free.token_ids[:first + 1]


def test_stop_strings_truncate_text(smol):
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = smol.generate(["1, 2, 3, 4, 5,"], sp)[0]
    assert " 7" in full.text
    out = smol.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=40, temperature=0,
                                                            ignore_eos=True, stop=(" 7",)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[:full.text.index(" 7")]


def test_eos_stops_and_chat_template(smol):
    out = smol.chat([{"role": "user", "content": "Say the word hello."}],
                    SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason is FinishReason.STOP and out.text.strip()
    assert out.token_ids[-1] in smol.engine.eos_token_ids


def test_abort_frees_blocks_at_once(tiny):
    eng = tiny.engine
    free0 = eng.block_manager.num_free_blocks
    eng.add_request("ab", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.block_manager.num_free_blocks < free0
    assert eng.abort("ab")
    assert eng.block_manager.num_free_blocks == free0
    assert not eng.has_work


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-0.1),
                                 dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_prompts(tiny):
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        tiny.generate([[10**6]], SamplingParams())
    for prompt, named in (([3, -1, 4], "-1"), ([3, 4.0], "4.0"), ([3, "4"], "'4'"),
                          ([None], "None")):  # the first offending id is named
        with pytest.raises(ValueError, match=f"token id {re.escape(named)} is outside"):
            tiny.engine.validate(prompt, SamplingParams())
    tiny.engine.validate([True, 3, 4], SamplingParams())  # ints (bool is one) pass
    with pytest.raises(ValueError, match="context"):
        tiny.generate([[5] * 100000], SamplingParams())


def test_prefill_progress_reports_each_chunk():
    """Prefill role with streamed KV: for every chunk, the last one included, the engine
    reports how many prompt tokens will have KV after it and in which blocks, as soon as the
    chunk is queued (before its token is read), so they can be sent while the prompt
    computes; a preempted request reports a reset."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=64, max_num_batched_tokens=16)
    eng = llm.engine
    prompt = list(range(1, 51))  # 50 tokens: chunks of 16, 16, 16, 2
    eng.add_request("p", prompt, SamplingParams(max_tokens=4, temperature=0),
                    prefill_only=True, report_progress=True)
    outs = []
    while not outs:
        outs = eng.step()
    assert [p.num_computed_tokens for p in eng.progress] == [16, 32, 48, 50]
    assert all(p.ready is None and not p.reset for p in eng.progress)  # CPU: done at once
    held = outs[0].held_block_ids
    assert len(held) == 13
    for p in eng.progress:  # each report's full blocks are the final table's first blocks
        full = p.num_computed_tokens // 4
        assert p.block_ids[:full] == held[:full]
    assert eng.progress[-1].block_ids == held  # the last chunk: the whole table
    assert all(p.layer_ready is None for p in eng.progress)  # CPU: no layer events
    eng.progress.clear()
    assert eng.release("p")
    # without report_progress nothing is reported
    eng.add_request("q", prompt, SamplingParams(max_tokens=4, temperature=0), prefill_only=True)
    while not eng.step():
        pass
    assert eng.progress == []
    eng.release("q")


def test_prefill_progress_reports_a_reset_when_preempted():
    """A chunked prefill whose blocks are taken back (preempted for an older request) reports
    a reset, so a KV stream that already sent its first chunks can be failed; after the
    recompute it reports progress again and ends normally."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=10, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request("old", [1, 2, 3, 4, 5, 6, 7, 8],
                    SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))
    eng.step()  # "old" prefilled: 2 blocks, then grows one block per 4 tokens
    eng.add_request("p", list(range(10, 42)), SamplingParams(max_tokens=2, temperature=0),
                    prefill_only=True, report_progress=True)
    final = None
    for _ in range(200):
        for out in eng.step():
            if out.request_id == "p":
                final = out
        if final is not None:
            break
    mine = [p for p in eng.progress if p.request_id == "p"]
    resets = [i for i, p in enumerate(mine) if p.reset]
    assert resets, [(p.num_computed_tokens, p.reset) for p in mine]
    assert mine[resets[0]].block_ids == [] and mine[resets[0]].num_computed_tokens == 0
    assert final is not None and final.held_block_ids is not None
    assert eng.release("p")
