"""Sampling controls (issue 25) against transformers' logits processors and a plain torch
reference of OpenAI's presence / frequency penalties, on SmolLM2-135M in fp32 (the embedded
GGUF, dequantized by our loader; transformers gets the very same weights): identical greedy
tokens, chosen-token and top-N logprobs within 1e-4. Then the warpers (top-k, top-p, min_p),
seeded draws that do not depend on the batch, and n parallel samples forked over the
prompt's KV blocks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from engine import LLM, Constraint, SamplingParams
from engine.engine import LLMEngine
from engine.layers.sampler import Sampler, SamplingBatch, warp
from engine.llm import build_engine_config
from engine.loader import load_model
from tests.reference import hf_model_from_loaded

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Q: Name three colors.\nA: red, green, blue. Q: Name three colors.\nA:"]
N_TOKENS = 10
# greedy SmolLM2 ends this at once (EOS first)
EOS_PROMPT = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "Hello! How can I help you today?")


@pytest.fixture(scope="module")
def models():
    """(transformers model, LLM) over the same fp32 weights."""
    loaded = load_model("smollm2-135m", dtype=torch.float32)
    hf = hf_model_from_loaded(loaded)  # copies the weights before the engine takes them
    llm = LLM.__new__(LLM)
    llm._start(LLMEngine(build_engine_config("smollm2-135m", dtype="float32"), loaded))
    return hf, llm


def openai_penalties(scores: torch.Tensor, out: list[int], presence: float,
                     frequency: float) -> torch.Tensor:
    """OpenAI's formula, plainly: logit[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    counts = torch.zeros_like(scores)
    for t in out:
        counts[0, t] += 1
    return scores - counts * frequency - (counts > 0).float() * presence


def hf_reference(hf, ids, eos, *, bias=None, min_tokens=0, repetition=1.0, presence=0.0,
                 frequency=0.0, top=5):
    """Greedy decoding with transformers' KV cache and logits processors (in the engine's
    order); returns (tokens, chosen logprobs, top-N (ids, logprobs) per step)."""
    procs = []
    if bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()]))
    if min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(len(ids), min_tokens, sorted(eos)))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    out, lps, tops = [], [], []
    with torch.no_grad():
        res = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(N_TOKENS):
            scores = res.logits[:, -1].float()
            for p in procs:
                scores = p(torch.tensor([ids + out]), scores)
            if presence or frequency:
                scores = openai_penalties(scores, out, presence, frequency)
            lp = torch.log_softmax(scores, dim=-1)[0]
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(float(lp[tok]))
            v, i = lp.topk(top)
            tops.append((i.tolist(), v.tolist()))
            res = hf(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out, lps, tops


CASES = {
    "repetition": dict(repetition=1.3),
    "presence_frequency": dict(presence=0.7, frequency=0.9),
    "logit_bias": dict(bias={"first": -100.0, 13: 4.0, 28: 2.5}),
    "min_tokens": dict(min_tokens=N_TOKENS),
    "all_together": dict(repetition=1.15, presence=-0.4, frequency=0.3,
                         bias={"first": -3.0, 11: 1.5}, min_tokens=5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_controls_match_transformers_processors(models, case):
    hf, llm = models
    eos = llm.engine.eos_token_ids
    kw = dict(CASES[case])
    for i, prompt in enumerate(PROMPTS):
        ids = llm.engine.encode(prompt)
        if "bias" in kw:  # "first": the unbiased greedy first token, pushed away
            plain = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
            kw["bias"] = {(plain.token_ids[0] if t == "first" else t): v
                          for t, v in CASES[case]["bias"].items()}
        if case == "min_tokens" and i == 0:
            # an EOS-loving prompt: without the mask the model ends at once
            ids = llm.engine.encode(EOS_PROMPT)
        ref, ref_lp, ref_top = hf_reference(hf, ids, eos, **kw)
        sp = SamplingParams(max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=5,
                            repetition_penalty=kw.get("repetition", 1.0),
                            presence_penalty=kw.get("presence", 0.0),
                            frequency_penalty=kw.get("frequency", 0.0),
                            logit_bias=kw.get("bias", {}), min_tokens=kw.get("min_tokens", 0))
        out = llm.generate([ids], sp)[0]
        n = len(out.token_ids)
        assert out.token_ids == ref[:n], (case, prompt)
        assert n == N_TOKENS or out.token_ids[-1] in eos
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lp)) < 1e-4
        for got, (tids, tvals) in zip(out.top_logprobs, ref_top):
            assert len(got) == 5
            assert max(abs(v - w) for (_, v), w in zip(got, tvals)) < 1e-4
            # same tokens, up to the order of (near-)ties
            assert {t for t, v in got if v > tvals[-1] + 1e-4} <= set(tids)
        if case == "min_tokens":
            assert not set(out.token_ids) & eos  # masked until max_tokens


def test_controls_change_the_output(models):
    """The references above are not vacuous: each control changes SmolLM2's greedy output."""
    _, llm = models
    ids = llm.engine.encode(PROMPTS[0])
    plain = llm.generate([ids], SamplingParams(max_tokens=N_TOKENS, temperature=0))[0].token_ids
    for kw in (dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.9),
               dict(logit_bias={plain[0]: -100.0})):
        got = llm.generate([ids], SamplingParams(max_tokens=N_TOKENS, temperature=0, **kw))
        assert got[0].token_ids != plain, kw
    chat = llm.engine.encode(EOS_PROMPT)
    eos = llm.engine.eos_token_ids
    free = llm.generate([chat], SamplingParams(max_tokens=N_TOKENS, temperature=0))[0]
    assert len(free.token_ids) == 1 and free.token_ids[0] in eos
    held = llm.generate([chat], SamplingParams(max_tokens=N_TOKENS, temperature=0,
                                               min_tokens=4))[0]
    assert len(held.token_ids) >= 4 and not set(held.token_ids[:3]) & eos


def _hf_warp(scores, temperature, top_k, top_p, min_p):
    procs = [TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    ids = torch.zeros((1, 1), dtype=torch.long)
    for p in procs:
        scores = p(ids, scores)
    return scores


def test_warpers_match_transformers():
    """Temperature, top-k, top-p and min_p of a mixed batch, row by row, against transformers'
    warpers (what survives and its value)."""
    g = torch.Generator().manual_seed(3)
    rows = [(0.7, 0, 1.0, 0.1), (1.0, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.9, 50, 0.8, 0.05),
            (1.0, 0, 1.0, 0.0), (0.5, 7, 0.95, 0.2), (2.0, 0, 0.5, 0.3)]
    logits = torch.randn(len(rows), 4096, generator=g) * 3
    # V = 49152 (SmolLM2): the CPU's top-p sorts only the 1024 most likely tokens of a row
    # that hold top_p of its mass; a flat row (the last) sorts them all
    rows += [(0.8, 0, 0.9, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 0.95, 0.0)]
    wide = torch.randn(len(rows), 49152, generator=g) * 4
    wide[:len(logits), :4096] = logits
    wide[len(logits):len(logits) + 2, :50] += 12  # peaked: the candidates hold the mass
    wide[-1] = torch.rand(49152, generator=g)  # flat
    logits = wide
    temps = torch.tensor([r[0] for r in rows]).view(-1, 1)
    got = warp(logits / temps, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
    for i, (t, k, p, m) in enumerate(rows):
        ref = _hf_warp(logits[i:i + 1].clone(), t, k, p, m)[0]
        keep = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got[i]), keep), rows[i]
        assert torch.allclose(got[i][keep], ref[keep], atol=1e-6)
        if (k, p, m) != (0, 1.0, 0.0):
            assert keep.sum() < 49152  # the filter did something


def _batch(rows, gens, **extra):
    return SamplingBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                         gens, False, **extra)


def test_seeded_rows_do_not_depend_on_the_batch():
    """A seeded row's token is the same alone and among other rows (with penalties, bias,
    min_p on neighbours, and a shared-generator row drawing too)."""
    torch.manual_seed(0)
    V = 1000
    logits = torch.randn(5, V) * 2
    target = 2

    def seeded():
        return torch.Generator().manual_seed(1234)

    s = Sampler(torch.Generator().manual_seed(9))
    alone = []
    g = seeded()
    for _ in range(20):  # 20 steps of one stream
        alone.append(s(logits[target:target + 1], _batch([(1.0, 0, 0.9)], [g])).to_host()[0][0])
    rows = [(0.8, 5, 1.0), (0.0, 0, 1.0), (1.0, 0, 0.9), (1.2, 0, 1.0), (1.0, 10, 0.7)]
    g = seeded()
    others = [torch.Generator().manual_seed(5), None, g, None, torch.Generator().manual_seed(6)]
    mixed = []
    for step in range(20):
        b = _batch(rows, others, min_ps=[0.1, 0, 0, 0.2, 0],
                   bias=[(0, 3, 5.0), (4, 7, -100.0)], banned=[(3, 1)],
                   penalties=[(1, 0.5, 0.5, 1.2, np.array([1, 2, 3, 4, 4]), 3),
                              (3, 0.0, 0.3, 1.0, np.arange(step), 0)])
        mixed.append(s(logits, b).to_host()[0][target])
    assert mixed == alone
    assert len(set(alone)) > 3  # it samples, not a constant


def test_n_samples_fork_the_prompt_blocks(models):
    """n=4 (seeded, temperature 1): one prompt computation, the samples share its full blocks
    (reference counts), sample 0 is the n=1 request with the same seed, the others their own
    reproducible streams; greedy samples are all the greedy output."""
    _, llm = models
    eng = llm.engine
    bs = eng.block_manager.block_size
    ids = eng.encode(PROMPTS[1] * 3)
    assert len(ids) > 3 * bs
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=4, ignore_eos=True)
    eng.add_request("fork", ids, sp)
    outs = eng.step()  # the prompt, and sample 0's first token
    assert [(o.request_id, o.index) for o in outs] == [("fork", 0)]
    parent = eng.scheduler.requests["fork"]
    keep = (len(ids) - 1) // bs
    children = [eng.scheduler.requests[f"fork/{i}"] for i in (1, 2, 3)]
    for c in children:
        assert c.block_table == parent.block_table[:keep]
        assert c.num_computed_tokens == keep * bs
    assert all(eng.block_manager.blocks[b].ref_count == 4 for b in parent.block_table[:keep])
    eng.abort("fork")  # every sample goes, every block comes back
    assert not eng.scheduler.requests and not eng.groups
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks

    hits = eng.block_manager.prefix_hit_tokens
    many = llm.generate([ids], sp)[0]
    samples = [s.token_ids for s in many.samples]
    assert [s.index for s in many.samples] == [0, 1, 2, 3]
    assert all(len(t) == 10 for t in samples) and len({tuple(t) for t in samples}) == 4
    # the forked prompt blocks count as prefix hits of the samples (the cache may add more)
    assert eng.block_manager.prefix_hit_tokens - hits >= 3 * keep * bs
    one = llm.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=11,
                                             ignore_eos=True))[0]
    assert one.token_ids == samples[0]
    # the same request again, now among other traffic: the same samples
    busy = llm.generate([ids, eng.encode(PROMPTS[0]), ids[:40]],
                        [sp, SamplingParams(max_tokens=12, temperature=0.8),
                         SamplingParams(max_tokens=6, temperature=1.0, seed=2, n=2)])
    assert [s.token_ids for s in busy[0].samples] == samples
    greedy = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, n=3))[0]
    assert len({tuple(s.token_ids) for s in greedy.samples}) == 1
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_n_samples_without_prefix_caching_compute_the_prompt_once():
    llm = LLM("dummy:tiny", enable_prefix_caching=False, dtype="float32")
    eng = llm.engine
    bs = eng.block_manager.block_size
    ids = [5 + (i * 7) % 90 for i in range(5 * bs + 3)]
    out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0.9, seed=1, n=3,
                                             ignore_eos=True))[0]
    assert [len(s.token_ids) for s in out.samples] == [5, 5, 5]
    assert eng.block_manager.prefix_hit_tokens == 2 * 5 * bs  # 2 samples x 5 shared blocks


@pytest.mark.parametrize("kw, words", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(top_logprobs=-1), "top_logprobs"),
    (dict(n=0), "n must"),
])
def test_bad_values_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused(models):
    _, llm = models
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10**6: 1.0}))
    assert not llm.engine.scheduler.requests


def test_resumed_request_continues_the_same_samples(models):
    """A request resumed elsewhere (migration: prompt + the tokens already streamed, the
    same sampling parameters) continues exactly: penalties count the streamed tokens, the
    seeded stream skips their draws, min_tokens counts them."""
    _, llm = models
    ids = llm.engine.encode(PROMPTS[1])
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=5, presence_penalty=0.8,
                        frequency_penalty=0.4, repetition_penalty=1.2, min_tokens=12,
                        logit_bias={13: 1.0}, top_k=40, min_p=0.02)
    full = llm.generate([ids], sp)[0].token_ids
    assert len(full) == 12
    for cut in (1, 5):
        llm.engine.add_request(f"resume{cut}", ids, sp, output_token_ids=full[:cut])
        rest = []
        while llm.engine.has_work:
            rest.extend(t for o in llm.engine.step() for t in o.token_ids)
        assert full[:cut] + rest == full


def test_sampling_state_survives_the_proto_round_trip():
    """What a hop (prefill call, migration) sends is what the next one samples with."""
    from services.protocol import sampling_from_proto, sampling_to_proto
    sp = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=12, seed=3,
                        stop=("x",), stop_token_ids=(4,), logprobs=True, presence_penalty=0.5,
                        frequency_penalty=-0.25, repetition_penalty=1.5, min_p=0.125,
                        logit_bias={7: -100.0, 2: 0.5}, min_tokens=2, top_logprobs=3, n=4)
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sampling_from_proto(sampling_to_proto(SamplingParams())) == SamplingParams()
    for c in (Constraint("json_schema", '{"type": "string"}'), Constraint("json_object"),
              Constraint("regex", "a+"), Constraint("grammar", 'start: "x"')):
        sp = SamplingParams(constraint=c)
        assert sampling_from_proto(sampling_to_proto(sp)) == sp


@pytest.mark.parametrize("field, value, words", [
    ("n", 17, "at most 16 samples"), ("top_logprobs", 21, "at most 20"),
    ("logit_bias", 301, "at most 300 logit_bias"), ("constraint", 65537, "constraint is longer than 65536"),
])
def test_request_limits(field, value, words):
    from protos.pdserve.v1 import common_pb2
    from services import validation
    pb = common_pb2.SamplingParams()
    if field == "logit_bias":
        for t in range(value):
            pb.logit_bias[t] = 1.0
    elif field == "constraint":
        pb.constraint.regex = "a" * value
    else:
        setattr(pb, field, value)
    with pytest.raises(validation.InvalidRequest, match=words):
        validation.sampling(pb, validation.RequestLimits())
    ok = validation.sampling(common_pb2.SamplingParams(n=16, top_logprobs=20),
                             validation.RequestLimits())
    assert (ok.n, ok.top_logprobs) == (16, 20)
    with pytest.raises(validation.InvalidRequest, match="outside the vocabulary"):
        validation.check_sampling_vocab(SamplingParams(logit_bias={100: 1.0}), 100)


def test_seeded_batch_bench_on_the_cpu_finds_every_sample_batch_independent(tmp_path):
    """bench/seeded_batch_gpu.py's comparison, run on the CPU where the answer is known
    (fp32, a generator per seeded request): every composition gives batch 1's tokens."""
    from bench import seeded_batch_gpu
    doc = seeded_batch_gpu.main(["--model", "dummy:tiny", "--device", "cpu", "--requests", "4",
                                 "--fillers", "8", "--max-tokens", "8", "--prompt-len", "8:24",
                                 "--out", str(tmp_path / "sb.json")])
    for run in doc["runs"]:
        for comp in run["compositions"]:
            assert comp["identical"] == comp["requests"] == 4, (run["mode"], comp)
    fillers = next(c for c in doc["runs"][0]["compositions"] if c["name"] == "with_fillers")
    assert fillers["batch"] == 12
