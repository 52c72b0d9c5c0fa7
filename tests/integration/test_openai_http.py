"""The OpenAI-compatible HTTP API of the gateway, over real sockets against real clusters
(LocalCluster: real processes, real Redis), with the official ``openai`` SDK (sync and async,
streaming and not) and ``curl``.

Greedy output through HTTP equals gRPC and the offline engine token for token (1P1D and
colocated); usage (cached tokens too), logprobs, stop, seed, max_tokens; every error status;
API keys and per-key limits; a client that leaves frees its KV blocks on both workers
(Stats RPC). Tests of fields whose engine side is issue 25's sampler work (n, top_logprobs,
penalties, logit_bias, min_p, min_tokens, constraints) skip while the engine's
SamplingParams lacks the field ("needs the engine's ... (samp25)").
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from engine.request import SamplingParams as EngineSampling
from pdserve import client
from pdserve.cluster import REPO, LocalCluster, free_port
from protos.pdserve.v1 import gateway_pb2_grpc
from tests.integration.helpers import run, scrape, wait_all_free, worker_stats

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three prime numbers:"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Name a color."}]]
KEY = "http-test-key-0123"
HASHED = "http-test-key-stored-hashed"  # configured as its sha256 only
N = 16


def needs_engine(field: str):
    have = field in {f.name for f in dataclasses.fields(EngineSampling)}
    return pytest.mark.skipif(not have, reason=f"needs the engine's {field} (samp25)")


@pytest.fixture(scope="module")
def pd():
    with LocalCluster(MODEL, prefill=1, decode=1, http_port=0, metrics=True,
                      gateway_args=("--served-model-name", "pd-model",
                                    "--http-max-body-bytes", "65536")) as c:
        yield c


@pytest.fixture(scope="module")
def colo():
    with LocalCluster(MODEL, prefill=0, decode=0, colocated=1, http_port=0, metrics=True,
                      gateway_args=("--key-max-concurrent", "1"),
                      env={"PDSERVE_API_KEYS": KEY + ",sha256:"
                           + hashlib.sha256(HASHED.encode()).hexdigest()}) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL)
    sp = SamplingParams(max_tokens=N, temperature=0)
    return ([o.token_ids for o in llm.generate(PROMPTS, sp)],
            [llm.chat(m, sp)[0].token_ids for m in CHATS])


def sdk(cluster, key="none", cls=openai.OpenAI):
    return cls(base_url=f"http://{cluster.http_address}/v1", api_key=key, max_retries=0,
               timeout=120)


def curl(*args, stdin=None) -> tuple[int, str]:
    p = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True,
                       text=True, timeout=120, input=stdin)
    body, _, code = p.stdout.rpartition("\n")
    return int(code), body


def grpc_tokens(address, reqs):
    async def go():
        async with client.channel(address, api_key=KEY) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            return [(await client.generate(stub, r, timeout=120)).token_ids for r in reqs]
    return run(go())


def _http_greedy(cluster, key="none"):
    """Greedy ids of PROMPTS (completions, sync SDK, not streamed) and CHATS (chat, async
    SDK, streamed)."""
    c = sdk(cluster, key)
    comp = []
    for p in PROMPTS:
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=N, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens == len(r.choices[0].token_ids)
        comp.append(r.choices[0].token_ids)

    async def chats():
        ac = sdk(cluster, key, openai.AsyncOpenAI)
        out = []
        for m in CHATS:
            ids, text = [], ""
            stream = await ac.chat.completions.create(
                model=MODEL, messages=m, max_tokens=N, temperature=0, stream=True,
                extra_body={"return_token_ids": True})
            async for chunk in stream:
                ids += chunk.choices[0].token_ids
                text += chunk.choices[0].delta.content or ""
            out.append((ids, text))
        await ac.close()
        return out
    return comp, run(chats())


def _check_equal(cluster, reference, key="none"):
    ref_comp, ref_chat = reference
    comp, chats = _http_greedy(cluster, key)
    assert comp == ref_comp
    assert [ids for ids, _ in chats] == ref_chat
    reqs = [client.make_request(p, max_tokens=N) for p in PROMPTS] + \
        [client.make_request(messages=m, max_tokens=N) for m in CHATS]
    assert grpc_tokens(cluster.address, reqs) == ref_comp + ref_chat
    # the streamed text is the non-streamed answer's
    r = sdk(cluster, key).chat.completions.create(model=MODEL, messages=CHATS[0],
                                                  max_tokens=N, temperature=0)
    assert r.choices[0].message.content == chats[0][1]


def test_greedy_http_equals_grpc_and_engine_1p1d(pd, reference):
    _check_equal(pd, reference)


def test_greedy_http_equals_grpc_and_engine_colocated(colo, reference):
    _check_equal(colo, reference, KEY)


def test_models_health_and_served_name(pd):
    assert [m.id for m in sdk(pd).models.list().data] == ["pd-model", MODEL]
    assert curl(f"http://{pd.http_address}/health") == (200, '{"status":"ok"}')
    r = sdk(pd).completions.create(model="pd-model", prompt="Hi", max_tokens=2)
    assert r.model == "pd-model" and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_usage_counts_cached_prompt_tokens(pd):
    long = [{"role": "system", "content": "You answer questions about geography. " * 12},
            {"role": "user", "content": "Where is Peru?"}]
    c = sdk(pd)
    first = c.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    again = c.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert again.usage.total_tokens == again.usage.prompt_tokens + again.usage.completion_tokens

    async def streamed():
        ac = sdk(pd, cls=openai.AsyncOpenAI)
        chunks = [ch async for ch in await ac.chat.completions.create(
            model=MODEL, messages=long, max_tokens=4, stream=True,
            stream_options={"include_usage": True})]
        await ac.close()
        return chunks
    chunks = run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 64
    assert chunks[-2].choices[0].finish_reason == "length"


def test_logprobs_equal_grpc(pd):
    r = sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=8,
                                        temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(bytes(e.bytes) == e.token.encode() for e in content)

    async def via_grpc():
        async with client.channel(pd.address) as ch:
            req = client.make_request(messages=CHATS[0], max_tokens=8, logprobs=True)
            return [lp async for resp in gateway_pb2_grpc.GatewayStub(ch).Generate(req)
                    for lp in resp.logprobs]
    assert [e.logprob for e in content] == pytest.approx(run(via_grpc()), abs=1e-5)
    c = sdk(pd).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                   temperature=0, logprobs=0)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]


def test_stop_seed_and_max_tokens(pd):
    c = sdk(pd)
    full = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0]
    assert full.finish_reason == "length"
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0,
                               stop=[stop, "never-seen-stop"]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.text) < len(full.text)
    seeded = [c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=12,
                                        temperature=1.0, seed=1234,
                                        extra_body={"return_token_ids": True})
              for _ in range(2)]
    ids = [s.choices[0].token_ids for s in seeded]
    assert ids[0] == ids[1]
    req = client.make_request(messages=CHATS[1], max_tokens=12, temperature=1.0, seed=1234)
    assert grpc_tokens(pd.address, [req]) == [ids[0]]  # the same seed on gRPC: the same tokens
    other = c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=12,
                                      temperature=1.0, seed=99,
                                      extra_body={"return_token_ids": True})
    assert other.choices[0].token_ids != ids[0]
    r = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_completion_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")


def _status(err) -> tuple[int, dict]:
    return err.status_code, err.body


def test_errors_have_openai_shape_and_status(pd):
    c = sdk(pd)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=CHATS[0])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=-1)
    assert "temperature" in e.value.message  # checked by the shared validation (gRPC's)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x " * 9000, max_tokens=2)
    assert "context limit" in e.value.message
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    base = f"http://{pd.http_address}"
    code, body = curl("-d", "{not json", f"{base}/v1/completions")
    assert code == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    code, body = curl("-d", json.dumps({"prompt": "a" * 70000}), f"{base}/v1/completions")
    assert code == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    code, body = curl("-H", "Transfer-Encoding: chunked", "--data-binary", "@-",
                      f"{base}/v1/completions", stdin=json.dumps({"prompt": "a" * 70000}))
    assert code == 413  # no Content-Length: counted while read
    code, body = curl("--data-binary", "@-", f"{base}/v1/completions",
                      stdin="[" * 30000 + "]" * 30000)
    assert code == 400 and "nested too deeply" in body
    code, body = curl("-d", '{"prompt": "a \\ud800 b"}', f"{base}/v1/completions")
    assert code == 400 and "lone surrogate" in body, body
    code, body = curl(f"{base}/v1/nothing")
    assert code == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    code, body = curl("-d", json.dumps({"prompt": "hi", "tools": [{}]}),
                      f"{base}/v1/completions")
    assert code == 200  # tools are a chat field: ignored by completions, like vLLM
    code, body = curl("-d", json.dumps({"messages": CHATS[0], "tools": [{"type": "function"}]}),
                      f"{base}/v1/chat/completions")
    assert code == 400 and json.loads(body)["error"]["param"] == "tools"


def test_api_keys_and_per_key_limit(colo):
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(colo, "wrong").chat.completions.create(model=MODEL, messages=CHATS[0])
    assert e.value.status_code == 401 and "invalid API key" in e.value.message
    code, body = curl("-d", json.dumps({"messages": CHATS[0]}),
                      f"http://{colo.http_address}/v1/chat/completions")
    assert code == 401 and "missing API key" in body
    assert curl(f"http://{colo.http_address}/health")[0] == 200  # exempt, like gRPC health
    assert curl(f"http://{colo.http_address}/v1/models")[0] == 401
    assert [m.id for m in sdk(colo, HASHED).models.list()]  # a key stored as its hash
    c = sdk(colo, KEY)
    stream = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # one request of the key in flight (key_max_concurrent 1)
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2)
    assert e.value.status_code == 429 and "in flight" in e.value.message
    stream.close()
    m = scrape(colo.gateway.metrics_port)
    assert m[("pdserve_requests_total", (("code", "UNAUTHENTICATED"),))] >= 3
    assert m[("pdserve_http_requests_total", (("route", "chat"), ("status", "429")))] >= 1
    assert run(wait_all_free([w.address for w in colo.workers]))[0].kv_blocks_used == 0


def _cancelled(cluster) -> float:
    return scrape(cluster.gateway.metrics_port).get(
        ("pdserve_requests_total", (("code", "CANCELLED"),)), 0.0)


def _wait_running(addrs, timeout_s=60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(run(worker_stats(a)).num_running for a in addrs) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def _freed(addrs) -> None:
    stats = run(wait_all_free(addrs, timeout_s=20))
    assert all(s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0
               for s in stats), stats


def test_client_disconnect_cancels_and_frees_kv_on_both_workers(pd):
    addrs = [w.address for w in pd.workers]
    before = _cancelled(pd)
    stream = sdk(pd).chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})  # about a minute of decoding if nothing cancels it
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert max(run(worker_stats(a)).kv_blocks_used for a in addrs) > 0
    stream.close()
    _freed(addrs)
    # not streamed: the client leaves while the answer is being generated
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True})
    host, port = pd.http_address.split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        _wait_running(addrs)
    _freed(addrs)
    deadline = time.monotonic() + 10
    while _cancelled(pd) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancelled(pd) == before + 2


def test_clients_gone_before_routing_leave_nothing_running(pd):
    """Clients that close the connection right after sending: the cancellation lands while
    the gateway routes (its prefix-index lookup, where redis-py used to swallow it, so the
    request went on and decoded to the end for nobody). None may start generating for
    long: the workers are idle again within seconds, every request counted cancelled."""
    addrs = [w.address for w in pd.workers]
    before = _cancelled(pd)
    # token ids (no tokenizing: the disconnect is seen during routing), 4 samples each
    body = json.dumps({"prompt": list(range(5, 37)), "max_tokens": 1500, "ignore_eos": True,
                       "n": 4, "stream": True})
    host, port = pd.http_address.split(":")
    for _ in range(12):  # a leaked one decodes 1500 tokens: far longer than the wait below
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                      .encode())
    deadline = time.monotonic() + 15
    while _cancelled(pd) < before + 12 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancelled(pd) == before + 12
    _freed(addrs)


class _Gateway:
    """A gateway process of its own (flags ``args``), HTTP on a free port."""

    def __init__(self, *args: str) -> None:
        self.http = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "pdserve.cli", "gateway", "--model", MODEL,
               "--host", "127.0.0.1", "--port", "0", "--http-port", self.http.split(":")[1],
               "--log-format", "text", "--log-level", "WARNING", *args]
        import os
        env = {**os.environ, "PYTHONPATH": REPO}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        for line in self.proc.stdout:
            if line.startswith("READY "):
                return
        raise RuntimeError(f"gateway did not start (exit {self.proc.wait()})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def test_no_workers_is_503_and_deadline_is_504(colo):
    with _Gateway("--decode-addrs", f"127.0.0.1:{free_port()}") as g:
        code, body = curl("-d", json.dumps({"prompt": "hi"}), f"http://{g.http}/v1/completions")
        assert code == 503 and json.loads(body)["error"]["code"] == "unavailable", body
        assert curl(f"http://{g.http}/health")[0] == 503
    worker = next(w.address for w in colo.workers)
    # the cluster is secure by default: this gateway needs its certificate to reach the worker
    with _Gateway("--decode-addrs", worker, "--request-timeout-s", "1",
                  *colo.security_args("gateway")) as g:
        c = openai.OpenAI(base_url=f"http://{g.http}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=1000,
                                 extra_body={"ignore_eos": True})
        assert e.value.status_code == 504 and e.value.code == "deadline_exceeded"
        with pytest.raises(openai.APIError):  # after the first token: an error event
            for _ in c.completions.create(model=MODEL, prompt="Hi", max_tokens=1000,
                                          stream=True, extra_body={"ignore_eos": True}):
                pass
    _freed([worker])


def test_a_stalled_body_is_408_and_its_connection_closed():
    """A client that sends fewer body bytes than it declared (slowloris) gets 408 after
    http_body_timeout_s, and the connection is closed: it holds nothing for long."""
    with _Gateway("--decode-addrs", f"127.0.0.1:{free_port()}",
                  "--http-body-timeout-s", "1") as g:
        host, port = g.http.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                      "application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
            got = b""
            while chunk := s.recv(65536):  # until the server closes
                got += chunk
            waited = time.monotonic() - t0
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got[:200]
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.9 < waited < 8, waited


def test_curl_streams_sse(pd):
    p = subprocess.run(["curl", "-sN", f"http://{pd.http_address}/v1/chat/completions",
                        "-H", "Content-Type: application/json", "-d",
                        json.dumps({"model": MODEL, "messages": CHATS[0], "max_tokens": 6,
                                    "stream": True, "temperature": 0,
                                    "stream_options": {"include_usage": True}})],
                       capture_output=True, text=True, timeout=120)
    events = [b for b in p.stdout.split("\n\n") if b]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1])
    r = sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=6,
                                        temperature=0)
    assert text == r.choices[0].message.content


# ---------------------------------------------------------------------------------------
# Fields whose engine side is issue 25's sampler work: they skip until the engine has them.

@pytest.mark.skipif("presence_penalty" in {f.name for f in dataclasses.fields(EngineSampling)},
                    reason="the engine has presence_penalty")
def test_fields_the_engine_lacks_are_400_not_ignored(pd):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], presence_penalty=0.5)
    assert "presence_penalty is not supported yet" in e.value.message
    # the "off" values clients send by default pass
    r = sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2,
                                        presence_penalty=0, frequency_penalty=0, n=1)
    assert r.usage.completion_tokens >= 1

@needs_engine("n")
def test_n_samples(pd):
    r = sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=8, n=3,
                                        temperature=1.0, seed=5,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24
    assert len({c.message.content for c in r.choices}) > 1


@needs_engine("top_logprobs")
def test_top_logprobs(pd):
    r = sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=3)
    for e in r.choices[0].logprobs.content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the top one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)


@needs_engine("logit_bias")
def test_logit_bias_forces_a_token(pd):
    tid = run(_token_id(pd, " blue"))
    r = sdk(pd).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                   temperature=0, logit_bias={str(tid): 100},
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == [tid] * 4


async def _token_id(cluster, text: str) -> int:
    from engine.loader import load_tokenizer
    ids = load_tokenizer(MODEL).encode(text, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


@needs_engine("presence_penalty")
def test_penalties_http_equals_grpc(pd):
    body = dict(presence_penalty=1.5, frequency_penalty=0.5, max_tokens=N, temperature=0)
    r = sdk(pd).completions.create(model=MODEL, prompt=PROMPTS[3], **body,
                                   extra_body={"return_token_ids": True,
                                               "repetition_penalty": 1.3})
    req = client.make_request(PROMPTS[3], max_tokens=N)
    req.sampling.presence_penalty, req.sampling.frequency_penalty = 1.5, 0.5
    req.sampling.repetition_penalty = 1.3
    assert grpc_tokens(pd.address, [req]) == [r.choices[0].token_ids]


@needs_engine("constraint")
def test_json_object_response_format(pd):
    r = sdk(pd).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# ---------------------------------------------------------------------------------------
# Tool calls: SmolLM2's weights in a Hugging Face folder whose chat template is Hermes-style
# (the format of Qwen2.5's: tools in the system turn, calls as <tool_call>{json}</tool_call>).

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    from tests.tool_fixtures import save_hermes_folder
    path = save_hermes_folder(str(tmp_path_factory.mktemp("hermes") / "model"))
    with LocalCluster(path, prefill=0, decode=0, colocated=1, http_port=0) as c:
        yield c


def _answer_calls(msg):
    return [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls or []]


@pytest.mark.slow
def test_tools_render_in_the_template_and_answers_parse(hermes):
    c = openai.OpenAI(base_url=f"http://{hermes.http_address}/v1", api_key="x", max_retries=0)
    model = c.models.list().data[0].id
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    plain = c.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0)
    with_tools = c.chat.completions.create(model=model, messages=ask, max_tokens=40,
                                           temperature=0, tools=[WEATHER])
    # the template rendered the tool's definition into the prompt
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    msg, fin = with_tools.choices[0].message, with_tools.choices[0].finish_reason
    assert (fin == "tool_calls") == bool(msg.tool_calls)
    # streamed: the same greedy answer, the same content and calls
    content, calls, finish = "", [], None
    for ch in c.chat.completions.create(model=model, messages=ask, max_tokens=40,
                                        temperature=0, tools=[WEATHER], stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        calls += [(t.function.name, json.loads(t.function.arguments)) for t in d.tool_calls or []]
        finish = ch.choices[0].finish_reason or finish
    assert (content or None, calls, finish) == (msg.content or None, _answer_calls(msg), fin)
    # a conversation that went through a call: the call and its result render
    history = ask + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    after = c.chat.completions.create(model=model, messages=history, max_tokens=8,
                                      temperature=0, tools=[WEATHER])
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=ask, tools=[{"type": "function"}])


def test_tools_for_a_template_without_them_are_400(pd):
    with pytest.raises(openai.BadRequestError) as e:  # SmolLM2's own template has no tools
        sdk(pd).chat.completions.create(model=MODEL, messages=CHATS[0], tools=[WEATHER])
    assert e.value.param == "tools" and "defines no tool calls" in e.value.message


@needs_engine("constraint")
@pytest.mark.slow
def test_forced_tool_choice_returns_a_valid_call(hermes):
    import jsonschema
    c = openai.OpenAI(base_url=f"http://{hermes.http_address}/v1", api_key="x", max_retries=0)
    model = c.models.list().data[0].id
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=60, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (name, args), = _answer_calls(r.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER["function"]["parameters"])
