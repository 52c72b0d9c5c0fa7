"""Request validation shared by the gateway and both worker roles: one set of limits, one
set of checks, messages that say what is wrong without echoing more than ``ECHO_BYTES`` of
what the client sent.

Every limit is a field of :class:`RequestLimits` (settings of every service; documented in
protos/pdserve/v1/*.proto next to the fields they bound). A check raises
:class:`InvalidRequest` (a ValueError, so the engine's own ValueErrors translate the same
way); servicers turn it into INVALID_ARGUMENT with :attr:`InvalidRequest.message`.
Nothing is allocated for a request before these checks pass.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
import json

from engine.config import check_settings, setting
from engine.request import SamplingParams
from protos.pdserve.v1 import common_pb2
from services.protocol import sampling_from_proto

ECHO_BYTES = 200  # at most this much of a client's value is quoted back in a message
CHAT_ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # a dict message's keys besides role/content


def _lim(default: int, help: str) -> int:
    return setting(default, help, ge=1)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on every repeated or string field a client sends (a normal client never
    meets them); a section of the gateway's and the workers' settings."""

    max_request_id_bytes: int = _lim(256, "longest request_id (a label) accepted, in bytes")
    max_model_name_bytes: int = _lim(256, "longest model name accepted, in bytes")
    max_prompt_bytes: int = _lim(1 << 20, "longest prompt text (or all chat contents "
                                          "together) accepted, in UTF-8 bytes")
    max_messages: int = _lim(1024, "most chat messages per request")
    max_stop_strings: int = _lim(16, "most stop strings per request")
    max_stop_string_bytes: int = _lim(1024, "longest stop string, in UTF-8 bytes")
    max_stop_token_ids: int = _lim(256, "most stop_token_ids per request")
    max_n: int = _lim(16, "most parallel samples (sampling.n) per request")
    max_logit_bias: int = _lim(300, "most logit_bias entries per request")
    max_top_logprobs: int = setting(20, "most top_logprobs per token a request may ask for",
                                    ge=0, le=20)
    max_constraint_bytes: int = _lim(64 << 10, "longest structured-output constraint (a JSON "
                                               "schema, regex or grammar), in UTF-8 bytes")

    def __post_init__(self) -> None:
        check_settings(self)


class InvalidRequest(ValueError):
    """A request that cannot be served as sent; ``message`` is safe to return."""

    @property
    def message(self) -> str:
        return str(self)


def clip(value: str | bytes, limit: int = ECHO_BYTES) -> str:
    """``value`` quoted for a message, cut to about ``limit`` bytes."""
    raw = value.encode("utf-8", "replace") if isinstance(value, str) else value
    text = raw[:limit].decode("utf-8", "ignore")
    more = f"... ({len(raw)} bytes)" if len(raw) > limit else ""
    return repr(text) + more


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def check_label(label: str, limits: RequestLimits) -> str:
    """A client's request_id: a label echoed back, never an identity."""
    if _nbytes(label) > limits.max_request_id_bytes:
        raise InvalidRequest(f"request_id is longer than {limits.max_request_id_bytes} bytes")
    return label


def check_model(name: str, served: str, limits: RequestLimits) -> None:
    if not name or name == served:
        return
    if _nbytes(name) > limits.max_model_name_bytes:
        raise InvalidRequest(f"model name is longer than {limits.max_model_name_bytes} bytes")
    raise InvalidRequest(f"unknown model {clip(name)}; this server serves {served!r}")


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "prompt") -> list[int]:
    ids = list(ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{what} token id {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return ids


def check_context(num_prompt: int, num_output: int, max_model_len: int,
                  whose: str = "the") -> None:
    """A prompt (plus tokens already generated, for a resumed request) must leave room for at
    least one new token. ``whose``: the limit's owner, for the message ("the workers'")."""
    n = num_prompt + num_output
    if n >= max_model_len:
        raise InvalidRequest(f"prompt has {n} tokens; {whose} context limit is "
                             f"{max_model_len} (prompt + at least one new token)")


def check_text(text: str, limits: RequestLimits, what: str = "prompt") -> None:
    if _nbytes(text) > limits.max_prompt_bytes:
        raise InvalidRequest(f"{what} is longer than {limits.max_prompt_bytes} bytes")


def check_messages(messages, limits: RequestLimits) -> list[dict[str, str]]:
    """Chat messages (proto or dicts with role/content) -> dicts, checked."""
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} chat messages")
    out, total = [], 0
    for m in messages:
        role, content = (m["role"], m.get("content") or "") if isinstance(m, dict) \
            else (m.role, m.content)
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"unknown chat role {clip(role, 40)} (one of "
                                 f"{', '.join(CHAT_ROLES)})")
        total += _nbytes(content)
        msg = {"role": role, "content": content}
        if isinstance(m, dict):  # the HTTP front's tool calls and results, for the template
            for k in TOOL_KEYS:
                if m.get(k) is not None:
                    msg[k] = m[k]
                    total += _nbytes(json.dumps(m[k]))
        out.append(msg)
    if total > limits.max_prompt_bytes:
        raise InvalidRequest(f"messages are longer than {limits.max_prompt_bytes} bytes")
    return out


def check_sampling_lists(pb: common_pb2.SamplingParams, limits: RequestLimits) -> None:
    if len(pb.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"at most {limits.max_stop_strings} stop strings")
    for s in pb.stop:
        if _nbytes(s) > limits.max_stop_string_bytes:
            raise InvalidRequest(f"a stop string is longer than "
                                 f"{limits.max_stop_string_bytes} bytes")
    if len(pb.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"at most {limits.max_stop_token_ids} stop_token_ids")
    if len(pb.logit_bias) > limits.max_logit_bias:
        raise InvalidRequest(f"at most {limits.max_logit_bias} logit_bias entries")
    if pb.n > limits.max_n:
        raise InvalidRequest(f"n is {pb.n}; at most {limits.max_n} samples per request")
    if pb.top_logprobs > limits.max_top_logprobs:
        raise InvalidRequest(f"top_logprobs is {pb.top_logprobs}; at most "
                             f"{limits.max_top_logprobs}")
    if pb.HasField("constraint"):
        c = pb.constraint
        if max(_nbytes(c.json_schema), _nbytes(c.regex), _nbytes(c.grammar)) \
                > limits.max_constraint_bytes:
            raise InvalidRequest(f"sampling.constraint is longer than "
                                 f"{limits.max_constraint_bytes} bytes")


async def compile_constraint(engine, sp: SamplingParams) -> None:
    """A worker compiles a request's constraint (engine.grammar) on a thread, before the
    engine sees the request (it then takes the compiled grammar from its cache): a bad
    schema, regex or grammar, or one that does not compile within the engine's
    grammar_compile_timeout_s, is refused with a short message."""
    if sp.constraint is None:
        return
    limit = engine.config.structured.grammar_compile_timeout_s
    task = asyncio.get_running_loop().run_in_executor(None, engine.grammars.compile,
                                                      sp.constraint)
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except TimeoutError:
        raise InvalidRequest(f"sampling.constraint did not compile within {limit:g} s") \
            from None
    except ValueError as e:  # quotes the client's text: keep it short
        raise InvalidRequest(_short(str(e))) from None
    except RecursionError:
        raise InvalidRequest("sampling.constraint is nested too deeply") from None


def _short(msg: str, most: int = 200) -> str:
    return msg if len(msg) <= most else msg[:most - 3] + "..."


def check_sampling_vocab(sp: SamplingParams, vocab_size: int) -> None:
    """Token ids the sampling parameters name must be in the model's vocabulary."""
    bad = next((t for t, _ in sp.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")


# SamplingParams fields of the proto whose engine side may not exist yet (issue 25's sampler
# work), each with its "off" value: a request that turns one on before the engine's
# SamplingParams has it is refused, never served without it
_ENGINE_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_p": 0.0, "logit_bias": {}, "min_tokens": 0, "top_logprobs": 0, "n": 1,
                  "constraint": None}


def check_supported(pb: common_pb2.SamplingParams) -> None:
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, off in _ENGINE_FIELDS.items():
        if name in have:
            continue
        if name == "constraint":
            on = pb.HasField("constraint")
        elif name == "n":
            on = pb.n > 1
        elif name == "logit_bias":
            on = len(pb.logit_bias) > 0
        elif name in ("min_tokens", "top_logprobs"):
            on = getattr(pb, name) != off
        else:  # optional fields: unset is off
            on = pb.HasField(name) and getattr(pb, name) != off
        if on:
            raise InvalidRequest(f"sampling.{name} is not supported yet by this server")


def sampling(pb: common_pb2.SamplingParams, limits: RequestLimits,
             default_max_tokens: int = 16) -> SamplingParams:
    """Checked sampling parameters of a request (limits first: nothing big is copied)."""
    check_sampling_lists(pb, limits)
    check_supported(pb)
    try:
        return sampling_from_proto(pb, default_max_tokens)
    except InvalidRequest:
        raise
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
