"""The OpenAI front's translation (gateway/openai/translate.py) and rendering (render.py):
JSON bodies -> the GenerateRequest fields the one request path takes, GenerateResponse
streams -> OpenAI objects and SSE frames. Exact values; the HTTP exchange itself is tested
over real sockets in tests/integration/test_openai_http.py."""
from __future__ import annotations

import json

import grpc
import pytest

from gateway.openai import render, translate
from gateway.openai.errors import ApiError, from_status
from protos.pdserve.v1 import common_pb2

NAMES = ("served", "smollm2-135m")
MSGS = [{"role": "user", "content": "hi"}]


def chat(**body):
    return translate.chat_job({"messages": MSGS, **body}, NAMES, "lbl", 30.0, "k", 8192)


def completion(**body):
    return translate.completion_job({"prompt": "hi", **body}, NAMES, "", 30.0, "")


def error(fn, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(**body)
    return e.value


def test_chat_fields_land_in_the_proto():
    job = chat(model="served", max_completion_tokens=7, max_tokens=99, temperature=0.5,
               top_p=0.9, seed=3, stop="END", logprobs=True, top_logprobs=2, n=2, user="u",
               presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
               min_p=0.05, top_k=40, ignore_eos=True, min_tokens=2, stop_token_ids=[5, 6],
               logit_bias={"10": -100, "11": 2.5}, stream=True,
               stream_options={"include_usage": True})
    sp = job.creq.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed) == (7, 0.5, 0.9, 3)
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [5, 6]
    assert (sp.logprobs, sp.top_logprobs, sp.n, sp.top_k, sp.ignore_eos, sp.min_tokens) == \
        (True, 2, 2, 40, True, 2)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == \
        (0.5, -0.25, pytest.approx(1.1), pytest.approx(0.05))
    assert dict(sp.logit_bias) == {10: -100.0, 11: 2.5}
    assert job.creq.messages == MSGS and job.creq.label == "lbl" and job.creq.api_key == "k"
    assert (job.model, job.stream, job.include_usage, job.n) == ("served", True, True, 2)


def test_chat_defaults():
    job = chat()
    sp = job.creq.sampling
    assert sp.max_tokens == 8192  # up to the context limit, as OpenAI's chat
    assert not sp.HasField("temperature") and not sp.HasField("seed")
    assert not sp.HasField("presence_penalty") and not sp.HasField("constraint")
    assert (sp.n, sp.logprobs, sp.top_logprobs, job.model) == (0, False, 0, "served")
    assert chat(max_tokens=5).creq.sampling.max_tokens == 5  # the older name still works


def test_chat_content_parts_and_developer_role():
    job = translate.chat_job({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        NAMES, "", 1.0, "", 100)
    assert job.creq.messages == [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "ab"}]


def test_completion_prompts_and_integer_logprobs():
    assert completion().creq.prompt == "hi" and completion().creq.prompt_token_ids == []
    assert completion(prompt=["x"]).creq.prompt == "x"
    assert completion(prompt=[1, 2, 3]).creq.prompt_token_ids == [1, 2, 3]
    assert completion(prompt=[[4, 5]]).creq.prompt_token_ids == [4, 5]
    job = completion(logprobs=3)
    assert (job.creq.sampling.logprobs, job.creq.sampling.top_logprobs) == (True, 3)
    job = completion(logprobs=0)
    assert (job.creq.sampling.logprobs, job.creq.sampling.top_logprobs) == (True, 0)
    assert not completion().creq.sampling.HasField("max_tokens")  # the pipeline's 16


def test_response_formats_become_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat(response_format={"type": "json_schema",
                              "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(c.creq.sampling.constraint.json_schema) == schema
    assert chat(response_format={"type": "json_object"}).creq.sampling.constraint.json_object
    assert not chat(response_format={"type": "text"}).creq.sampling.HasField("constraint")
    assert chat(structured_outputs={"regex": "a+"}).creq.sampling.constraint.regex == "a+"
    assert chat(structured_outputs={"grammar": "root ::= \"x\""}).creq.sampling.constraint \
        .grammar == "root ::= \"x\""
    assert json.loads(chat(structured_outputs={"json": schema}).creq.sampling.constraint
                      .json_schema) == schema


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"stop": [1]}, "stop"), ({"n": 0}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"seed": -1}, "seed"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"),  # the engine's range, said in the message
    # found by fuzzing the HTTP front (each was a 500)
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    *[({"messages": [{"role": "user", "content": "x"},
                     {"role": "assistant", "tool_calls": calls}]}, "messages[1].tool_calls")
      for calls in ([1], "abc", {"a": 1}, [{"id": "x", "type": "function"}],
                    [{"function": "x"}], [{"function": None}],
                    [{"function": {"name": "f", "arguments": 5}}],
                    [{"function": {"name": "f", "arguments": [1, 2]}}])],
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id"),
])
def test_bad_chat_bodies_are_400_naming_the_field(body, param):
    e = error(chat, **body)
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param), e.message
    assert len(e.message) < 200, e.message


def test_assistant_tool_calls_reach_the_template_with_object_arguments():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "f", "arguments": '{"a": 1}'}}, {"id": "c2", "type": "function",
                 "function": {"name": "g", "arguments": {"b": 2}}},
                 # what a model wrote that is not JSON, echoed back by the client: kept as text
                 {"id": "c3", "type": "function", "function": {"name": "h", "arguments": '{"a"'}},
                 {"id": "c4", "type": "function", "function": {"name": "h",
                                                               "arguments": "[" * 100000}}]}]
    calls = translate.messages({"messages": msgs})[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"a": 1}, {"b": 2}, '{"a"',
                                                           "[" * 100000]


def test_an_out_of_range_integer_is_named_not_echoed():
    e = error(chat, max_tokens=10 ** 4000)
    assert e.param == "max_tokens" and "4001-digit" in e.message and len(e.message) < 120


def test_unknown_model_is_404_and_completion_refusals():
    e = error(chat, model="gpt-4")
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert "'gpt-4'" in e.message and "'served'" in e.message
    for body in ({"prompt": ["a", "b"]}, {"prompt": 5}, {"echo": True}, {"best_of": 3},
                 {"prompt": [1, -2]}):
        assert error(completion, **body).status == 400, body


def test_grpc_statuses_map_to_openai_http_statuses():
    want = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
            grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
            grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INTERNAL: 500}
    for code, status in want.items():
        e = from_status(code, "why")
        assert e.status == status and e.body()["error"]["message"] == "why"
        assert e.body()["error"]["code"] == code.name.lower()


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return {1: "He", 2: "llo", 3: "!", 9: "?"}[ids[0]]


def _resp(ids, text, lps=(), finish="", index=0, usage=None, tops=()):
    r = common_pb2.GenerateResponse(token_ids=ids, text=text, logprobs=list(lps),
                                    finish_reason=finish, index=index)
    for t in tops:
        r.top_logprobs.add(token_ids=[x for x, _ in t], logprobs=[y for _, y in t])
    if usage:
        r.usage.CopyFrom(common_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1],
                                          cached_tokens=usage[2]))
    return r


def test_answer_of_a_chat_with_logprobs_and_usage():
    job = chat(logprobs=True, top_logprobs=1, return_token_ids=True)
    a = render.Answer(job, "rid", 123, render.TokenText(_Tok()))
    a.add(_resp([1], "He", [-0.5], tops=[[(1, -0.5)]]))
    a.add(_resp([2, 3], "llo!", [-0.25, -1.0], "stop", usage=(5, 3, 2),
                tops=[[(2, -0.25)], [(9, -0.5)]]))
    body = a.body()
    assert body["id"] == "chatcmpl-rid" and body["object"] == "chat.completion"
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": "Hello!"}
    assert c["finish_reason"] == "stop" and c["token_ids"] == [1, 2, 3]
    assert [e["token"] for e in c["logprobs"]["content"]] == ["He", "llo", "!"]
    assert c["logprobs"]["content"][2]["top_logprobs"] == [
        {"token": "?", "logprob": -0.5, "bytes": [63]}]
    assert c["logprobs"]["content"][0]["bytes"] == [72, 101]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_logprobs_offsets_and_samples():
    job = completion(logprobs=1, n=2)
    a = render.Answer(job, "r", 1, render.TokenText(_Tok()))
    a.add(_resp([1], "He", [-0.5], index=1, tops=[[(1, -0.5)]]))
    a.add(_resp([3], "!", [-0.1], "length", index=0, tops=[[(3, -0.1)]]))
    a.add(_resp([2], "llo", [-0.25], "stop", index=1, usage=(4, 3, 0), tops=[[(2, -0.25)]]))
    c0, c1 = a.body()["choices"]
    assert (c0["text"], c0["finish_reason"], c1["text"], c1["finish_reason"]) == \
        ("!", "length", "Hello", "stop")
    assert c1["logprobs"] == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -0.25],
                              "top_logprobs": [{"He": -0.5}, {"llo": -0.25}],
                              "text_offset": [0, 2]}
    assert a.body()["usage"]["completion_tokens"] == 3


def _frames(data: bytes) -> list:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            body = block[len("data: "):]
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_stream_events_role_first_usage_chunk_and_done():
    job = chat(stream=True, stream_options={"include_usage": True})
    ev = render.Events(job, "rid", 7, render.TokenText(_Tok()))
    data = ev.frame(_resp([1], "He")) + ev.frame(_resp([2], "llo", finish="stop",
                                                        usage=(5, 2, 0))) + ev.tail()
    f1, f2, fu, done = _frames(data)
    assert f1["object"] == "chat.completion.chunk" and f1["usage"] is None
    assert f1["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "He"},
                              "logprobs": None, "finish_reason": None}]
    assert f2["choices"][0]["delta"] == {"content": "llo"}
    assert f2["choices"][0]["finish_reason"] == "stop"
    assert fu["choices"] == [] and fu["usage"]["total_tokens"] == 7 and done == "[DONE]"
    # without include_usage: no usage key, no usage chunk
    ev = render.Events(chat(stream=True), "r", 7, render.TokenText(_Tok()))
    frames = _frames(ev.frame(_resp([1], "He", finish="length", usage=(1, 1, 0))) + ev.tail())
    assert len(frames) == 2 and "usage" not in frames[0]
    err = _frames(render.Events.error(from_status(grpc.StatusCode.UNAVAILABLE, "gone")))
    assert err[0]["error"]["code"] == "unavailable" and err[1] == "[DONE]"


def test_sampling_fields_the_engine_lacks_are_refused_when_turned_on():
    """services.validation.check_supported: one check for both fronts, keyed on the engine's
    SamplingParams, so it lets a field through as soon as the engine has it."""
    import dataclasses
    from engine.request import SamplingParams
    from services import validation
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    off = common_pb2.SamplingParams(presence_penalty=0.0, frequency_penalty=0.0,
                                    repetition_penalty=1.0, min_p=0.0, n=1)
    validation.check_supported(off)  # the values clients send by default are "off"
    validation.check_supported(common_pb2.SamplingParams())
    on = {"presence_penalty": dict(presence_penalty=0.5), "n": dict(n=2),
          "repetition_penalty": dict(repetition_penalty=1.2), "min_p": dict(min_p=0.1),
          "logit_bias": dict(logit_bias={3: 1.0}), "min_tokens": dict(min_tokens=2),
          "top_logprobs": dict(top_logprobs=2),
          "constraint": dict(constraint=common_pb2.Constraint(json_object=True))}
    for name, kw in on.items():
        pb = common_pb2.SamplingParams(**kw)
        if name in have:
            validation.check_supported(pb)
        else:
            with pytest.raises(validation.InvalidRequest, match=f"sampling.{name} is not "
                               "supported yet"):
                validation.check_supported(pb)


def test_list_and_map_sizes_are_judged_before_any_entry_is_converted():
    """A body of a million logit_bias entries is refused by its length (the limits of
    services.config.RequestLimits), without converting them: fast, whatever the size."""
    import time
    from services.config import RequestLimits
    lim = RequestLimits()
    bodies = (("logit_bias", {str(i): 1.0 for i in range(1_000_000)}),
              ("stop", ["x"] * 1_000_000), ("stop_token_ids", [1] * 1_000_000))
    t0 = time.perf_counter()  # the checks only (building the bodies takes ~0.5 s here)
    for key, v in bodies:
        with pytest.raises(ApiError) as e:
            translate.check_sizes({key: v}, lim)
        assert (e.value.status, e.value.param) == (400, key) and "at most" in e.value.message
    # converting a million entries takes seconds; judging the lengths, microseconds
    assert time.perf_counter() - t0 < 0.5
    translate.check_sizes({"logit_bias": {"1": 1}, "stop": ["a"], "stop_token_ids": [2]}, lim)
    e = error(chat, seed=2**63)
    assert "2**63" in e.message or str(2**63 - 1) in e.message
