"""Translation between proto messages and the engine's plain dataclasses (one place)."""
from __future__ import annotations

from engine.request import Constraint, RequestOutput, SamplingParams
from protos.pdserve.v1 import common_pb2


def constraint_from_proto(pb: common_pb2.Constraint) -> Constraint:
    """The one field set (ValueError when several are)."""
    set_ = [k for k in ("json_schema", "json_object", "regex", "grammar") if getattr(pb, k)]
    if len(set_) > 1:
        raise ValueError(f"constraint: set one of json_schema, json_object, regex, grammar "
                         f"(got {', '.join(set_)})")
    if not set_:
        raise ValueError("constraint: set one of json_schema, json_object, regex, grammar")
    kind = set_[0]
    return Constraint(kind, "" if kind == "json_object" else getattr(pb, kind))


def constraint_to_proto(c: Constraint) -> common_pb2.Constraint:
    if c.kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    return common_pb2.Constraint(**{c.kind: c.text})

def sampling_from_proto(pb: common_pb2.SamplingParams, default_max_tokens: int = 16
                        ) -> SamplingParams:
    """Raises ValueError with a readable message for bad values (the size limits of the
    repeated fields are checked before, by services.validation.sampling)."""
    def opt(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    return SamplingParams(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else default_max_tokens,
        temperature=opt("temperature", 1.0), top_p=opt("top_p", 1.0),
        top_k=0 if pb.top_k == -1 else pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos, logprobs=pb.logprobs,
        presence_penalty=opt("presence_penalty", 0.0),
        frequency_penalty=opt("frequency_penalty", 0.0),
        repetition_penalty=opt("repetition_penalty", 1.0), min_p=opt("min_p", 0.0),
        logit_bias=dict(pb.logit_bias), min_tokens=pb.min_tokens,
        top_logprobs=pb.top_logprobs, n=max(pb.n, 1),
        constraint=constraint_from_proto(pb.constraint) if pb.HasField("constraint") else None)


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """Every field a hop needs to sample the same way (migration and prefill included)."""
    pb = common_pb2.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature,
                                   top_p=sp.top_p, top_k=sp.top_k, stop=list(sp.stop),
                                   stop_token_ids=list(sp.stop_token_ids),
                                   ignore_eos=sp.ignore_eos, logprobs=sp.logprobs,
                                   min_tokens=sp.min_tokens, top_logprobs=sp.top_logprobs,
                                   n=sp.n)
    if sp.seed is not None:
        pb.seed = sp.seed
    if sp.presence_penalty:
        pb.presence_penalty = sp.presence_penalty
    if sp.frequency_penalty:
        pb.frequency_penalty = sp.frequency_penalty
    if sp.repetition_penalty != 1.0:
        pb.repetition_penalty = sp.repetition_penalty
    if sp.min_p:
        pb.min_p = sp.min_p
    for t, v in sp.logit_bias:
        pb.logit_bias[t] = v
    if sp.constraint is not None:
        pb.constraint.CopyFrom(constraint_to_proto(sp.constraint))
    return pb


def top_logprobs_to_proto(top: list[tuple[int, float]]) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])


def top_logprobs_from_proto(pb: common_pb2.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip(pb.token_ids, pb.logprobs))


def response_from_output(out: RequestOutput, request_id: str) -> common_pb2.GenerateResponse:
    r = common_pb2.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=out.text,
                                    index=out.index)
    if out.logprobs:
        r.logprobs.extend(out.logprobs)
    if out.top_logprobs:
        r.top_logprobs.extend(top_logprobs_to_proto(t) for t in out.top_logprobs)
    if out.finished and out.finish_reason is not None:
        r.finish_reason = out.finish_reason.value
    return r
