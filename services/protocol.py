"""Translation between proto messages and the engine's plain dataclasses (one place)."""
from __future__ import annotations

from engine.request import RequestOutput, SamplingParams
from protos.pdserve.v1 import common_pb2

def sampling_from_proto(pb: common_pb2.SamplingParams, default_max_tokens: int = 16
                        ) -> SamplingParams:
    """Raises ValueError with a readable message for bad values (the size limits of the
    repeated fields are checked before, by services.validation.sampling)."""
    return SamplingParams(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else default_max_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=0 if pb.top_k == -1 else pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos, logprobs=pb.logprobs)


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature,
                                   top_p=sp.top_p, top_k=sp.top_k, stop=list(sp.stop),
                                   stop_token_ids=list(sp.stop_token_ids),
                                   ignore_eos=sp.ignore_eos, logprobs=sp.logprobs)
    if sp.seed is not None:
        pb.seed = sp.seed
    return pb


def response_from_output(out: RequestOutput, request_id: str) -> common_pb2.GenerateResponse:
    r = common_pb2.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=out.text)
    if out.logprobs:
        r.logprobs.extend(out.logprobs)
    if out.finished and out.finish_reason is not None:
        r.finish_reason = out.finish_reason.value
    return r
