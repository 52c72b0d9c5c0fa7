"""Sampling controls over gRPC in a real 1P1D cluster (gateway, prefill and decode worker
processes, Redis, KV transfer): n samples from one prefill and one KV transfer, penalties and
top logprobs equal to the offline engine's (the first token sampled on the prefill worker),
seeded samples that do not depend on other traffic, bad values refused."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve import client
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.helpers import PROMPTS, run, wait_all_free, worker_stats

LONG = ("You are a helpful assistant. Answer briefly and precisely. " * 3
        + "Question: what is the tallest mountain on Earth? Answer:")


@dataclass
class Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str = ""


def request(prompt=None, *, token_ids=None, max_tokens=12, **sampling):
    sp = common_pb2.SamplingParams(max_tokens=max_tokens)
    for k, v in sampling.items():
        if k == "logit_bias":
            for t, b in v.items():
                sp.logit_bias[t] = b
        elif k == "constraint":
            sp.constraint.CopyFrom(v)
        else:
            setattr(sp, k, v)
    req = gateway_pb2.GenerateRequest(sampling=sp)
    if prompt is not None:
        req.prompt = prompt
    if token_ids is not None:
        req.prompt_token_ids.extend(token_ids)
    return req


async def collect(address: str, req, timeout: float = 180.0):
    """(samples by index, [(index, usage)] of the messages carrying usage)."""
    samples: dict[int, Sample] = {}
    usages = []
    async with client.channel(address) as ch:
        async for resp in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=timeout):
            s = samples.setdefault(resp.index, Sample())
            assert not s.finish, "a message after the sample's finish_reason"
            s.tokens.extend(resp.token_ids)
            s.logprobs.extend(resp.logprobs)
            s.tops.extend(list(zip(t.token_ids, t.logprobs)) for t in resp.top_logprobs)
            s.finish = resp.finish_reason
            if resp.HasField("usage"):
                usages.append((resp.index, resp.usage))
    return samples, usages


async def collect_many(address: str, reqs):
    return await asyncio.gather(*(collect(address, r) for r in reqs))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster("smollm2-135m", prefill=1, decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    return LLM("smollm2-135m")


def test_n_samples_one_prefill_one_transfer(cluster, offline):
    pre, dec = (w.address for w in cluster.workers)
    ids = offline.engine.encode(LONG)
    bs = offline.engine.block_manager.block_size
    keep = (len(ids) - 1) // bs
    assert keep >= 2
    same_len = offline.engine.encode(LONG.replace("tallest mountain", "longest river"))[:len(ids)]
    # a first request of the same length: what one prompt's transfer moves
    before = run(worker_stats(dec)).transferred_bytes
    run(collect(cluster.address, request(token_ids=same_len, max_tokens=2, temperature=0.0)))
    one_transfer = run(worker_stats(dec)).transferred_bytes - before
    assert one_transfer > 0
    p0, d0 = run(worker_stats(pre)), run(worker_stats(dec))
    samples, usages = run(collect(cluster.address, request(
        token_ids=ids, max_tokens=10, temperature=1.0, seed=21, n=3, ignore_eos=True)))
    p1, d1 = run(worker_stats(pre)), run(worker_stats(dec))
    assert sorted(samples) == [0, 1, 2]
    assert all(len(s.tokens) == 10 and s.finish == "length" for s in samples.values())
    assert len({tuple(s.tokens) for s in samples.values()}) == 3
    # usage once, on the request's last message, over every sample
    assert len(usages) == 1 and usages[0][1].completion_tokens == 30
    assert usages[0][1].prompt_tokens == len(ids)
    # one prefill of the prompt, one transfer; the decode worker forked the other two
    # samples over the landed blocks
    assert p1.prefix_cache_query_tokens - p0.prefix_cache_query_tokens == len(ids)
    assert d1.transferred_bytes - d0.transferred_bytes == one_transfer
    assert d1.prefix_cache_hit_tokens - d0.prefix_cache_hit_tokens == 2 * keep * bs
    # the same samples as the offline engine (colocated), the first token of sample 0 from
    # the prefill worker's stream, the others from their own seeded streams
    ref = offline.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=21, n=3,
                                                 ignore_eos=True))[0]
    assert [samples[i].tokens for i in range(3)] == [s.token_ids for s in ref.samples]
    stats = run(wait_all_free([pre, dec]))
    assert all(s.kv_blocks_used == 0 for s in stats)


def test_controls_and_top_logprobs_match_the_engine(cluster, offline):
    kw = dict(max_tokens=12, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
              frequency_penalty=0.4, min_tokens=3, logprobs=True, top_logprobs=4)
    # the last: greedy SmolLM2 ends it at once; min_tokens holds EOS off
    prompts = [PROMPTS[0], PROMPTS[8], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>"
               "assistant\nHello! How can I help you today?"]
    first = offline.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0))[0]
    bias = {first.token_ids[0]: -100.0, 13: 2.0}
    outs = run(collect_many(cluster.address,
                            [request(p, logit_bias=bias, **kw) for p in prompts]))
    refs = offline.generate(prompts, SamplingParams(logit_bias=bias, **kw))
    for (samples, _), ref in zip(outs, refs):
        s = samples[0]
        assert s.tokens == ref.token_ids and len(s.tokens) >= 3
        assert s.tokens[0] != first.token_ids[0]
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) < 1e-4
        assert len(s.tops) == len(s.tokens)
        for got, want in zip(s.tops, ref.top_logprobs):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) < 1e-4


def test_seeded_samples_do_not_depend_on_other_traffic(cluster):
    seeded = [request(p, max_tokens=16, temperature=0.9, top_p=0.95, seed=1000 + i,
                      presence_penalty=0.3, ignore_eos=True) for i, p in enumerate(PROMPTS[:3])]
    alone = [run(collect(cluster.address, r))[0][0].tokens for r in seeded]
    noise = [request(p, max_tokens=20, temperature=1.0, ignore_eos=True) for p in PROMPTS[3:9]]
    busy = run(collect_many(cluster.address, noise[:3] + seeded + noise[3:]))
    assert [b[0][0].tokens for b in busy[3:6]] == alone
    again = run(collect(cluster.address, seeded[1]))[0][0].tokens
    assert again == alone[1]


def test_bad_sampling_values_are_invalid_argument(cluster):
    async def status(req):
        try:
            await collect(cluster.address, req, timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""
    cases = [
        (request("hi", n=17), "at most 16 samples"),
        (request("hi", top_logprobs=21), "top_logprobs"),
        (request("hi", presence_penalty=2.5), "presence_penalty"),
        (request("hi", frequency_penalty=-3.0), "frequency_penalty"),
        (request("hi", repetition_penalty=0.0), "repetition_penalty"),
        (request("hi", min_p=1.5), "min_p"),
        (request("hi", logit_bias={10**6: 1.0}), "outside the vocabulary"),
        (request("hi", logit_bias={5: 150.0}), "logit_bias"),
        (request("hi", logit_bias={t: 1.0 for t in range(301)}), "logit_bias entries"),
        (request("hi", max_tokens=4, min_tokens=5), "min_tokens"),
        (request("hi", constraint=common_pb2.Constraint(json_schema="{not json")),
         "not valid JSON"),
        (request("hi", constraint=common_pb2.Constraint(json_object=True, regex="a")),
         "set one of"),
        (request("hi", constraint=common_pb2.Constraint(regex="a" * 70000)), "longer than"),
    ]
    for req, words in cases:
        code, details = run(status(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (req.sampling, code, details)
        assert words in details, details
    samples, _ = run(collect(cluster.address, request("Hello", max_tokens=3)))
    assert len(samples[0].tokens) == 3


def test_colocated_n_samples_and_top_logprobs(offline):
    """A colocated worker (the prompt computed by the decode worker itself): the same samples
    and top logprobs as the offline engine, each sample ending once, blocks freed."""
    ids = offline.engine.encode(LONG)
    kw = dict(max_tokens=8, temperature=0.7, seed=9, n=2, top_logprobs=3, logprobs=True,
              frequency_penalty=0.5, ignore_eos=True)
    ref = offline.generate([ids], SamplingParams(**kw))[0]
    with LocalCluster("smollm2-135m", prefill=0, decode=0, colocated=1) as c:
        samples, usages = run(collect(c.address, request(token_ids=ids, **kw)))
        stats = run(wait_all_free([w.address for w in c.workers]))
    assert [samples[i].tokens for i in (0, 1)] == [s.token_ids for s in ref.samples]
    for i in (0, 1):
        assert samples[i].finish == "length" and len(samples[i].tops) == 8
        want = ref.samples[i].top_logprobs
        assert max(abs(a[1] - b[1]) for g, w in zip(samples[i].tops, want)
                   for a, b in zip(g, w)) < 1e-4
    assert len(usages) == 1 and usages[0][1].completion_tokens == 16
    assert all(s.kv_blocks_used == 0 for s in stats)
