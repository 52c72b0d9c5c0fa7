"""When the decode worker may stream the prefill worker's first token before the KV landed:
only when that token cannot end the request (the engine decides those after the commit)."""
from __future__ import annotations

from types import SimpleNamespace

from decode_worker.remote import early_first
from engine.request import SamplingParams
from protos.pdserve.v1 import common_pb2, worker_pb2

ENGINE = SimpleNamespace(eos_token_ids=frozenset({2}), max_model_len=64)


def pending(token=7, text=" hi", logprob=None):
    resp = worker_pb2.PrefillResponse(request_id="r", first_token_id=token, num_cached_tokens=16,
                                      transfer=common_pb2.KVTransferResult(num_blocks=2))
    if text is not None:
        resp.first_text = text
    if logprob is not None:
        resp.first_logprob = logprob
    return SimpleNamespace(call=SimpleNamespace(rid="r", req=SimpleNamespace()), resp=resp)


def _early_first(p, ids, sp, engine, generated=0):
    """A prompt of ``ids`` after which ``generated`` tokens were already streamed."""
    p.call.req.num_prompt_tokens = len(ids)
    return early_first(p, len(ids) + generated, sp, engine)


def test_a_token_that_cannot_end_the_request_goes_out_early():
    out = _early_first(pending(logprob=-0.5), [1] * 20, SamplingParams(max_tokens=4, logprobs=True),
                       ENGINE)
    assert (out.token_ids, out.text, out.logprobs, out.num_cached_tokens) == ([7], " hi", [-0.5], 16)
    assert not out.finished
    # logprobs only when asked for
    assert _early_first(pending(logprob=-0.5), [1] * 20, SamplingParams(max_tokens=4),
                        ENGINE).logprobs is None


def test_a_token_that_could_end_the_request_waits_for_the_engine():
    ids = [1] * 20
    cases = [
        (pending(), SamplingParams(max_tokens=1)),                        # the only token
        (pending(), SamplingParams(max_tokens=4, stop=("x",))),           # stop strings trim text
        (pending(token=9), SamplingParams(max_tokens=4, stop_token_ids=(9,))),
        (pending(token=2), SamplingParams(max_tokens=4)),                 # EOS
        (pending(text=None), SamplingParams(max_tokens=4)),               # an older prefill worker
    ]
    for p, sp in cases:
        assert _early_first(p, ids, sp, ENGINE) is None, sp
    assert _early_first(pending(token=2), ids, SamplingParams(max_tokens=4, ignore_eos=True),
                        ENGINE) is not None
    assert _early_first(pending(), [1] * 63, SamplingParams(max_tokens=4), ENGINE) is None


def test_a_resumed_request_counts_the_tokens_it_already_generated():
    ids = [1] * 20
    assert _early_first(pending(), ids, SamplingParams(max_tokens=4), ENGINE, generated=2) \
        is not None
    # one token left: it may end the request
    assert _early_first(pending(), ids, SamplingParams(max_tokens=4), ENGINE, generated=3) is None
