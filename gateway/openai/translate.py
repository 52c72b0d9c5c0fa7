"""OpenAI request bodies -> the fields of one gRPC GenerateRequest (a ClientRequest), and what
the answer must look like (a :class:`Job`).

Only the protocol is checked here: JSON types, which fields go together, the model's name
(404 for an unknown one, as OpenAI does) and what this front cannot do (``echo``, a batch of
prompts, tools for a template without them: 400 saying so). Values travel as they came into the proto, so their ranges
and size limits are checked once, by the same code as a gRPC request's
(services.validation, then the workers).

Fields: ``model``, ``messages`` (text content; ``developer`` is the system role) or
``prompt`` (a string or token ids, one prompt), ``max_completion_tokens`` / ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``stream`` + ``stream_options.include_usage``, ``stop``,
``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (token id strings),
``logprobs`` (+ ``top_logprobs`` for chat; an integer for completions), ``user`` (accepted,
not used), ``response_format`` (``text``, ``json_object``, ``json_schema``), ``tools`` and
``tool_choice`` (tools.py; messages may carry ``tool_calls``, and ``tool`` messages their
``tool_call_id``); extensions vLLM
clients send: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``structured_outputs`` (one of ``json``, ``regex``, ``grammar``,
``json_object``), ``return_token_ids`` (each choice, or chunk, also carries its
``token_ids``). Unknown fields are ignored, as vLLM does. Without a max, a chat answer may
run to the context limit; a completion stops after 16 tokens (OpenAI's default).
"""
from __future__ import annotations

from dataclasses import dataclass
import json

from gateway.openai import tools as tool_calls
from gateway.openai.errors import ApiError, bad
from gateway.pipeline import ClientRequest
from protos.pdserve.v1 import common_pb2

U32 = 2**32 - 1


@dataclass
class Job:
    """One HTTP request: the pipeline's request and how to render what it yields."""
    kind: str  # "chat" | "completion"
    creq: ClientRequest
    model: str  # the name echoed in every answer
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    token_ids: bool = False  # return_token_ids (vLLM's extension): each choice's token ids
    tools: tool_calls.ToolSpec | None = None  # chat with tools: parse tool calls back


def _typed(body: dict, key: str, types, what: str):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise bad(f"{key} must be {what}", key)
    return v


def _int(body: dict, key: str, lo: int = 0, hi: int = 2**63 - 1) -> int | None:
    v = _typed(body, key, (int,), "an integer")
    if v is not None and not lo <= v <= hi:
        got = str(v) if abs(v) < 10 ** 24 else f"a {len(str(abs(v)))}-digit number"
        raise bad(f"{key} must be an integer in [{lo}, {hi}], got {got}", key)
    return v


def _num(body: dict, key: str) -> float | None:
    v = _typed(body, key, (int, float), "a number")
    return None if v is None else float(v)


def _flag(body: dict, key: str) -> bool:
    return bool(_typed(body, key, (bool,), "true or false"))


def check_model(body: dict, names: tuple[str, ...]) -> str:
    """The model name to echo: the request's, which must be one of ``names`` (404 else),
    or the first name when the request has none."""
    name = _typed(body, "model", (str,), "a string")
    if not name:
        return names[0]
    if name not in names:
        raise ApiError(404, f"The model {name[:200]!r} does not exist; this server serves "
                            f"{', '.join(map(repr, names))}", "not_found_error", "model",
                       "model_not_found")
    return name


def check_sizes(body: dict, limits) -> None:
    """The request limits (services.config.RequestLimits) on the lists and maps of a body,
    judged by their length before any entry is converted: a body of a million logit_bias
    entries is refused at the cost of one len(), not of building them all first."""
    for key, most, what in (("logit_bias", limits.max_logit_bias, "logit_bias entries"),
                            ("stop", limits.max_stop_strings, "stop strings"),
                            ("stop_token_ids", limits.max_stop_token_ids, "stop_token_ids")):
        v = body.get(key)
        if isinstance(v, (list, dict)) and len(v) > most:
            raise bad(f"at most {most} {what}", key)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad("stop must be a string or an array of strings", "stop")


def _token_ids(v, key: str) -> list[int] | None:
    """``v`` as token ids, or None when it is not a list of non-negative integers."""
    if isinstance(v, list) and v and all(type(t) is int for t in v):
        if any(not 0 <= t <= U32 for t in v):
            raise bad(f"{key}: token ids must be integers in [0, {U32}]", key)
        return v
    return None


def _logit_bias(body: dict) -> dict[int, float]:
    v = _typed(body, "logit_bias", (dict,), "an object of token id -> bias")
    out = {}
    for k, b in (v or {}).items():
        # str.isdigit admits "²" and other non-ASCII digits; 10 digits bound int(k)
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10
                and int(k) <= U32):
            raise bad(f"logit_bias keys must be token ids, got {k[:40]!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad("logit_bias values must be numbers", "logit_bias")
        out[int(k)] = float(b)
    return out


def _constraint(body: dict) -> common_pb2.Constraint | None:
    """``response_format`` or the ``structured_outputs`` extension (at most one)."""
    rf = _typed(body, "response_format", (dict,), "an object")
    so = _typed(body, "structured_outputs", (dict,), "an object")
    if rf and so:
        raise bad("give response_format or structured_outputs, not both", "response_format")
    if rf:
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return common_pb2.Constraint(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise bad("response_format.json_schema must be an object with a 'schema' "
                          "object", "response_format")
            return common_pb2.Constraint(json_schema=json.dumps(js.get("schema", {})))
        raise bad("response_format.type must be 'text', 'json_object' or 'json_schema'",
                  "response_format")
    if so:
        if len(so) != 1 or next(iter(so)) not in ("json", "regex", "grammar", "json_object"):
            raise bad("structured_outputs takes one of json, regex, grammar, json_object",
                      "structured_outputs")
        (key, v), = so.items()
        if key == "json_object":
            return common_pb2.Constraint(json_object=bool(v))
        if key == "json":
            v = v if isinstance(v, str) else json.dumps(v)
        elif not isinstance(v, str):
            raise bad(f"structured_outputs.{key} must be a string", "structured_outputs")
        return common_pb2.Constraint(**{"json_schema" if key == "json" else key: v})
    return None


def _penalties(body: dict, sp: common_pb2.SamplingParams) -> None:
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        v = _num(body, key)
        if v is not None:
            setattr(sp, key, v)
    sp.logit_bias.update(_logit_bias(body))
    sp.min_tokens = _int(body, "min_tokens", 0, U32) or 0
    c = _constraint(body)
    if c is not None:
        sp.constraint.CopyFrom(c)


def sampling(body: dict, max_key: str | None, n: int) -> common_pb2.SamplingParams:
    """The sampling fields both endpoints share (``max_key``: chat's newer name for the
    output limit, read first)."""
    sp = common_pb2.SamplingParams()
    mt = _int(body, max_key, 1, U32) if max_key else None
    mt = mt if mt is not None else _int(body, "max_tokens", 1, U32)
    if mt is not None:
        sp.max_tokens = mt
    for key in ("temperature", "top_p"):
        v = _num(body, key)
        if v is not None:
            setattr(sp, key, v)
    sp.top_k = _int(body, "top_k", -1, 2**31 - 1) or 0
    seed = _int(body, "seed", 0, 2**63 - 1)  # the engine's range (services.validation)
    if seed is not None:
        sp.seed = seed
    sp.stop.extend(_stop(body))
    ids = body.get("stop_token_ids")
    if ids is not None and ids != [] and _token_ids(ids, "stop_token_ids") is None:
        raise bad("stop_token_ids must be an array of token ids", "stop_token_ids")
    sp.stop_token_ids.extend(ids or [])
    sp.ignore_eos = _flag(body, "ignore_eos")
    sp.n = n if n > 1 else 0
    _penalties(body, sp)
    return sp


def _content(v, i: int) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):
        parts = []
        for p in v:
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts are supported",
                          f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or an array of text parts",
              f"messages[{i}].content")


def messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _content(m.get("content"), i)}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return tool_calls.template_messages(out)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    so = _typed(body, "stream_options", (dict,), "an object")
    if so is not None and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    return stream, bool((so or {}).get("include_usage"))


def _unsupported(body: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if body.get(key) not in (None, False, [], "none", "auto"):
            raise bad(f"{key} is not supported by this server", key)


def _tool_constraint(sp: common_pb2.SamplingParams, spec: tool_calls.ToolSpec | None) -> None:
    """The grammar a request's tool calls follow (gateway.openai.tools)."""
    if spec is None:
        return
    schema = tool_calls.forced_schema(spec)
    if schema is not None:
        if sp.HasField("constraint"):
            raise bad("a forced tool_choice cannot be combined with response_format",
                      "tool_choice")
        sp.constraint.json_schema = json.dumps(schema)
    elif not sp.HasField("constraint"):  # auto under a response_format: that format wins
        sp.constraint.grammar = tool_calls.auto_grammar(spec)


def chat_job(body: dict, names: tuple[str, ...], label: str, timeout_s: float,
             api_key: str, default_max_tokens: int, tool_format: str | None = None) -> Job:
    model = check_model(body, names)
    _unsupported(body, ("functions", "function_call", "audio"))
    spec = tool_calls.tool_spec(body, tool_format)
    n = _int(body, "n", 1, 128) or 1
    sp = sampling(body, "max_completion_tokens", n)
    _tool_constraint(sp, spec)
    if not sp.HasField("max_tokens"):
        sp.max_tokens = default_max_tokens  # to the context limit, as OpenAI's chat does
    logprobs = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20) or 0
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    sp.logprobs, sp.top_logprobs = logprobs, top
    stream, usage = _stream(body)
    creq = ClientRequest(label=label, messages=messages(body), sampling=sp,
                         api_key=api_key, timeout_s=timeout_s,
                         tools=spec.tools if spec else None)
    return Job("chat", creq, model, stream, usage, logprobs, top, n,
               _flag(body, "return_token_ids"), spec)


def _prompt(body: dict) -> tuple[str, list[int]]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p, []
    ids = _token_ids(p, "prompt")
    if ids is None:
        raise bad("prompt must be a string or an array of token ids (one prompt per "
                  "request)", "prompt")
    return "", ids


def completion_job(body: dict, names: tuple[str, ...], label: str, timeout_s: float,
                   api_key: str) -> Job:
    model = check_model(body, names)
    _unsupported(body, ("echo", "suffix"))
    n = _int(body, "n", 1, 128) or 1
    if _int(body, "best_of", 1, 128) not in (None, n):
        raise bad("best_of other than n is not supported by this server", "best_of")
    sp = sampling(body, None, n)
    lp = _int(body, "logprobs", 0, 20)
    sp.logprobs, sp.top_logprobs = lp is not None, lp or 0
    stream, usage = _stream(body)
    prompt, ids = _prompt(body)
    creq = ClientRequest(label=label, prompt=prompt, prompt_token_ids=ids, sampling=sp,
                         api_key=api_key, timeout_s=timeout_s)
    return Job("completion", creq, model, stream, usage, lp is not None, lp or 0, n,
               _flag(body, "return_token_ids"))
