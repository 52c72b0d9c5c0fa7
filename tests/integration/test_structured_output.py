"""Structured output and grammar-constrained tool calls over real sockets: LocalCluster
(real processes, real Redis), the official ``openai`` SDK and the gRPC client.

- json_schema (strict) through HTTP, streamed and not, and the same constraint through gRPC:
  the answers parse, validate (jsonschema) and end with ``stop``; greedy HTTP equals gRPC
  token for token, in 1P1D (the prefill worker masks the first token, the decode worker
  rebuilds the matcher from it) as colocated.
- A forced tool call (tool_choice naming a function) returns ``tool_calls`` whose arguments
  validate against the tool's schema (HTTP, streamed too); under ``tool_choice: auto`` the
  sampled answers are text or calls, and every call validates.
- Bad schemas / regexes / grammars: 400 (HTTP) and INVALID_ARGUMENT (gRPC), short messages.
- Slow: the 20 committed schemas (tests/data/json_schemas.json) x 10 sampled documents = 200
  documents, colocated and 1P1D: every one parses, validates and ends with ``stop``.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from pdserve import client
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import gateway_pb2_grpc
from tests.integration.helpers import run
from tests.tool_fixtures import FLIGHT, ONE_SHOT, WEATHER, save_hermes_folder

MODEL = "smollm2-135m"
SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "data" / "json_schemas.json")
                     .read_text())["schemas"]
SYSTEM = {"role": "system", "content": "Answer with JSON only."}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "golf", "music"]},
                "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pd():
    with LocalCluster(MODEL, prefill=1, decode=1, http_port=0) as c:
        yield c


@pytest.fixture(scope="module")
def colo():
    with LocalCluster(MODEL, prefill=0, decode=0, colocated=1, http_port=0) as c:
        yield c


def sdk(cluster, cls=openai.OpenAI):
    return cls(base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0,
               timeout=600)


def _fmt(schema, name="doc"):
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True,
                                                   "schema": schema}}


def _grpc(cluster, req):
    async def go():
        async with client.channel(cluster.address) as ch:
            return await client.generate(gateway_pb2_grpc.GatewayStub(ch), req, timeout=300)
    return run(go())


def test_json_schema_http_grpc_and_stream_agree(pd):
    msgs = [SYSTEM, {"role": "user", "content": "Describe a person."}]
    r = sdk(pd).chat.completions.create(model=MODEL, messages=msgs, max_tokens=100,
                                        temperature=0, response_format=_fmt(PERSON),
                                        extra_body={"return_token_ids": True})
    ch = r.choices[0]
    jsonschema.validate(json.loads(ch.message.content), PERSON)
    assert ch.finish_reason == "stop"
    text, fin = "", None
    for chunk in sdk(pd).chat.completions.create(model=MODEL, messages=msgs, max_tokens=100,
                                                 temperature=0, response_format=_fmt(PERSON),
                                                 stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            fin = chunk.choices[0].finish_reason or fin
    assert (text, fin) == (ch.message.content, "stop")
    req = client.make_request(messages=msgs, max_tokens=100)
    req.sampling.constraint.json_schema = json.dumps(PERSON)
    got = _grpc(pd, req)
    assert (got.token_ids, got.finish_reason) == (ch.token_ids, "stop")


def test_regex_and_grammar_extensions(colo):
    c = sdk(colo)
    r = c.completions.create(model=MODEL, prompt="The answer is", max_tokens=30,
                             temperature=0.7, seed=1,
                             extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    assert r.choices[0].text in ("yes!", "no!") and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt="Pet:", max_tokens=30, temperature=0,
                             extra_body={"structured_outputs": {
                                 "grammar": 'root ::= "cat" | "dog" | "bird"'}})
    assert r.choices[0].text in ("cat", "dog", "bird")
    r = c.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, messages=[
                                  {"role": "user", "content": "Describe a cat as JSON."}],
                                  response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, words", [
    ({"response_format": _fmt({"type": "objectx"})}, "objectx"),
    ({"extra_body": {"structured_outputs": {"regex": "a[("}}}, "unclosed"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "missing"),
    ({"response_format": _fmt({"type": "string", "pattern": "x" * 70000})}, "longer than"),
])
def test_bad_constraints_are_400_and_invalid_argument(pd, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(pd).chat.completions.create(model=MODEL, messages=[SYSTEM], max_tokens=8, **body)
    assert words in e.value.message and len(e.value.message) < 700
    req = client.make_request(prompt="x", max_tokens=8)
    req.sampling.constraint.regex = "(unclosed"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _grpc(pd, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
    ok = sdk(pd).chat.completions.create(model=MODEL, messages=[SYSTEM], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")  # the workers still serve


async def _documents(cluster, n: int) -> list[tuple[str, object, str]]:
    c = sdk(cluster, openai.AsyncOpenAI)

    async def one(i, e):
        r = await c.chat.completions.create(
            model=MODEL, messages=[SYSTEM, {"role": "user", "content": e["prompt"]}],
            max_tokens=256, temperature=0.8, seed=i, n=n,
            response_format=_fmt(e["schema"], e["name"]))
        return [(e["name"], ch.message.content, ch.finish_reason) for ch in r.choices]
    out = await asyncio.gather(*(one(i, e) for i, e in enumerate(SCHEMAS)))
    return [d for docs in out for d in docs]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["colo", "pd"])
def test_200_documents_of_20_schemas(layout, request):
    cluster = request.getfixturevalue(layout)
    docs = run(_documents(cluster, 10))
    assert len(docs) == 200
    by_name = {e["name"]: e["schema"] for e in SCHEMAS}
    bad = []
    for name, text, fin in docs:
        try:
            jsonschema.validate(json.loads(text), by_name[name])
            assert fin == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            bad.append((name, fin, text[:120], str(e)[:80]))
    assert not bad, bad


# --------------------------------------------------------------------------- tool calls
# SmolLM2's weights in a Hugging Face folder with a Hermes-style chat template
# (tests/tool_fixtures.py)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    path = save_hermes_folder(str(tmp_path_factory.mktemp("hermes") / "model"))
    with LocalCluster(path, prefill=1, decode=1, http_port=0) as c:
        yield c


def _calls(tool_calls):
    return [(t.function.name, json.loads(t.function.arguments)) for t in tool_calls or []]


@pytest.mark.slow
def test_tool_calls_are_constrained_to_their_schemas(hermes):
    c = openai.OpenAI(base_url=f"http://{hermes.http_address}/v1", api_key="x", max_retries=0,
                      timeout=600)
    model = c.models.list().data[0].id
    ask = [{"role": "user", "content": "Book two business seats from Paris to Oslo."}]
    for choice in ({"type": "function", "function": {"name": "book_flight"}}, "required"):
        for seed in range(3):
            r = c.chat.completions.create(model=model, messages=ask, max_tokens=120,
                                          temperature=0.9, seed=seed, tools=[FLIGHT, WEATHER],
                                          tool_choice=choice)
            ch = r.choices[0]
            calls = _calls(ch.message.tool_calls)
            assert calls and ch.finish_reason == "tool_calls", ch
            for name, args in calls:
                tool = FLIGHT if name == "book_flight" else WEATHER
                assert choice == "required" or name == "book_flight"
                jsonschema.validate(args, tool["function"]["parameters"])
    # auto: text or calls, as the model likes; whatever calls it makes hold to their schema
    kinds = set()
    for seed in range(6):
        r = c.chat.completions.create(model=model, messages=ONE_SHOT, max_tokens=160,
                                      temperature=1.0, seed=seed, tools=[FLIGHT, WEATHER])
        ch = r.choices[0]
        kinds.add(ch.finish_reason)
        if ch.finish_reason == "length":
            continue  # cut inside the grammar: nothing to validate
        calls = _calls(ch.message.tool_calls)
        assert (ch.finish_reason == "tool_calls") == bool(calls), ch
        assert calls or "<tool_call>" not in (ch.message.content or ""), ch
        for name, args in calls:
            tool = FLIGHT if name == "book_flight" else WEATHER
            jsonschema.validate(args, tool["function"]["parameters"])
    assert "tool_calls" in kinds, kinds
    streamed, fin = [], None
    for chunk in c.chat.completions.create(model=model, messages=ask, max_tokens=120,
                                           temperature=0, tools=[FLIGHT], stream=True,
                                           tool_choice="required", parallel_tool_calls=False):
        if chunk.choices:
            streamed += _calls(chunk.choices[0].delta.tool_calls)
            fin = chunk.choices[0].finish_reason or fin
    (name, args), = streamed
    assert name == "book_flight" and fin == "tool_calls"
    jsonschema.validate(args, FLIGHT["function"]["parameters"])
