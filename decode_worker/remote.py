"""A prompt prefilled on a prefill worker, its KV moved here, over one KV backend.

Steps of :class:`RemotePrefill`:
  1. ``start``: expect a transfer of the prompt's block count (the receiver writes nothing
     before it has their ids), call PrefillWorker.Prefill on the chosen worker and, while
     it runs, reserve the blocks (RESOURCE_EXHAUSTED if none are free); return once the
     prefill worker answered with the first token (and its text).
  2. ``landed``: wait for the KV to land, then hand the request to the engine, which counts
     the prompt as computed and continues from the first token.
  Any way out before ``landed`` returned (failure, timeout, cancellation, abort) gives the
  reserved blocks back (``give_up``) and calls off the prefill worker.

The first token may go out before the KV has landed (:func:`early_first`) only when it
cannot end the request: more than one token asked for, not a stop or EOS token, no stop
strings, room left in the context.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.request import RequestOutput
from pdcore.ids import new_id
from protos.pdserve.v1 import common_pb2, worker_pb2
from services import telemetry
from services.kv_proto import layout_to_proto
from services.protocol import sampling_to_proto, top_logprobs_from_proto
from services.validation import InvalidRequest

logger = logging.getLogger(__name__)


class PrefillFailed(Exception):
    def __init__(self, message: str, transfer: bool = False) -> None:
        super().__init__(message)
        self.transfer = transfer  # the prompt was computed, moving its KV failed


class NoFreeBlocks(Exception):
    """The decode worker has no free KV blocks for the prompt (RESOURCE_EXHAUSTED)."""


class RemotePrefill:
    def __init__(self, call, backend: str, receiver, pinned: RequestOutput | None) -> None:
        """``call``: the DecodeCall (request, deadlines, span); ``pinned``: a first token
        already streamed, which the continuation keeps whatever the prefill worker samples."""
        self.call, self.env = call, call.env
        self.backend, self.receiver, self.pinned = backend, receiver, pinned
        self.tid = f"{call.rid}-{new_id()}"
        self.num_blocks = -(-call.req.num_tokens // self.env.layout.block_size)
        self.kspan = telemetry.child(call.span, "kv.receive", {
            "pdserve.kv.backend": backend, "pdserve.kv.blocks": self.num_blocks,
            "pdserve.kv.transfer_id": self.tid})
        self.handle = None
        self.resp: worker_pb2.PrefillResponse | None = None
        self.t0 = time.perf_counter()

    # ----------------------------------------------------------------- start
    async def start(self) -> "RemotePrefill":
        rpc = None
        try:  # from here on, any way out but an answer gives the reserved blocks back
            transfer_s = self.call.transfer_timeout_s()
            self.handle = self.receiver.expect(self.tid, self.num_blocks, transfer_s)
            pspan = telemetry.child(self.call.span, "prefill.remote",
                                    {"pdserve.prefill_address": self.call.req.prefill_address})
            rpc = self._prefill_rpc(transfer_s, pspan)
            # the call runs while the blocks are reserved (under load the engine thread takes
            # them between two steps; with the cache full, running requests free them)
            blocks = await self.env.aengine.preallocate(
                self.call.rid, self.call.req.ids, self.call.req.sp, self.call.req.output_ids,
                wait_s=self.call.kv_blocks_wait_s())
            if blocks is None:
                telemetry.end_with_status(pspan, "CANCELLED", "no free KV blocks")
                raise NoFreeBlocks("decode worker has no free KV blocks for this prompt")
            self.handle.assign(blocks)
            self.resp = await self._answer(rpc, pspan)
            return self
        except BaseException:
            if rpc is not None:
                rpc.cancel()  # the prefill worker stops computing and sending
            await self.give_up()
            raise

    def _prefill_rpc(self, transfer_s: float, pspan):
        req = self.call.req
        msg = worker_pb2.PrefillRequest(
            request_id=self.call.label, prompt_token_ids=req.ids,
            sampling=sampling_to_proto(req.sp),
            model=self.env.model_id, output_token_ids=req.output_ids,
            kv_transfer=common_pb2.KVTransferParams(
                transfer_id=self.tid, backend=self.backend,
                receiver_endpoint=self.receiver.endpoint, num_blocks=self.num_blocks,
                timeout_ms=max(1, int(transfer_s * 1000)),
                layout=layout_to_proto(self.env.layout,
                                       self.env.engine.config.tensor_parallel_size,
                                       self.env.engine.kv_heads)))
        return self.env.peers.stub(req.prefill_address).Prefill(
            msg, timeout=self.call.prefill_timeout_s(),
            metadata=telemetry.outgoing_metadata(pspan, self.call.context))

    async def _answer(self, rpc, pspan) -> worker_pb2.PrefillResponse:
        address = self.call.req.prefill_address
        try:
            resp = await rpc
        except grpc.aio.AioRpcError as e:
            telemetry.end_with_status(pspan, e.code().name, e.details() or "")
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(e.details() or "invalid request") from None
            # FAILED_PRECONDITION: that worker lacks this backend / layout: try the next
            raise PrefillFailed(f"prefill on {address} failed: {e.code().name} {e.details()}",
                                transfer=e.code() == grpc.StatusCode.FAILED_PRECONDITION
                                ) from None
        pspan.set_attribute("pdserve.cached_tokens", resp.num_cached_tokens)
        pspan.end()
        # TRANSFERRING: the prefill worker answered once our receiver had accepted the
        # transfer, which tells us in landed() how it ends
        if resp.transfer.state not in (common_pb2.TRANSFER_STATE_DONE,
                                       common_pb2.TRANSFER_STATE_TRANSFERRING):
            raise PrefillFailed(f"KV transfer over {self.backend} "
                                f"{common_pb2.TransferState.Name(resp.transfer.state)}: "
                                f"{resp.transfer.error}", transfer=True)
        return resp

    # ---------------------------------------------------------------- landed
    async def landed(self):
        """Wait for the KV; returns the engine's output stream from the first token on."""
        env, resp = self.env, self.resp
        try:
            if resp.transfer.num_blocks:
                result = await self.handle.wait()
                env.metrics.transfer("received", result.state.value, result.num_bytes,
                                     time.perf_counter() - self.t0, result.pieces)
                self.kspan.set_attributes({"pdserve.kv.bytes": result.num_bytes,
                                           "pdserve.kv.state": result.state.value})
                if not result.ok:
                    raise PrefillFailed(f"KV transfer over {self.backend} "
                                        f"{result.state.value}: {result.error}", transfer=True)
            else:  # nothing to move (the prefill worker sent no blocks)
                self.receiver.cancel(self.tid)
        except BaseException:
            await self.give_up()
            raise
        telemetry.end_with_status(self.kspan, "OK")
        if self.pinned is not None:  # a retry keeps the token already streamed
            token = self.pinned.token_ids[0]
            lp = self.pinned.logprobs[0] if self.pinned.logprobs else None
            top = self.pinned.top_logprobs[0] if self.pinned.top_logprobs else None
        else:
            token = resp.first_token_id
            lp = resp.first_logprob if resp.HasField("first_logprob") else None
            top = first_top(resp, self.call.req.sp)
        return env.aengine.continue_from(self.call.rid, token, lp, resp.num_cached_tokens,
                                         top, samples=self.call.req.sp.n)

    async def give_up(self) -> None:
        self.receiver.cancel(self.tid)
        try:
            await asyncio.shield(self.env.aengine.abort(self.call.rid))
        except Exception:  # noqa: BLE001 - engine dead: nothing left to free
            pass
        telemetry.end_with_status(self.kspan, "UNAVAILABLE")


def early_first(pending: RemotePrefill, num_tokens: int, sp, engine) -> RequestOutput | None:
    """The first token as an output to stream before the KV landed, or None when it could
    end the request (then only the engine, after the commit, says how): one token left to
    generate, a stop / EOS token, stop strings (which trim text), the model's length limit,
    a constraint (its grammar may end at that token), or a prefill worker too old to send
    the token's text. ``num_tokens``: prompt tokens
    plus tokens already generated (a resumed request)."""
    resp = pending.resp
    tok = resp.first_token_id
    left = sp.max_tokens - (num_tokens - pending.call.req.num_prompt_tokens)
    if (not resp.HasField("first_text") or left <= 1 or sp.stop or sp.constraint is not None
            or tok in sp.stop_token_ids or (not sp.ignore_eos and tok in engine.eos_token_ids)
            or num_tokens + 1 >= engine.max_model_len):
        return None
    lp = resp.first_logprob if resp.HasField("first_logprob") else None
    top = first_top(resp, sp)
    return RequestOutput(request_id=pending.call.rid, prompt_token_ids=[], token_ids=[tok],
                         text=resp.first_text,
                         logprobs=[lp] if sp.logprobs and lp is not None else None,
                         top_logprobs=[top] if top is not None else None,
                         num_cached_tokens=resp.num_cached_tokens)


def first_top(resp: worker_pb2.PrefillResponse, sp) -> list[tuple[int, float]] | None:
    """The first token's top logprobs as the prefill worker computed them (or None)."""
    if not sp.top_logprobs or not resp.HasField("first_top_logprobs"):
        return None
    return top_logprobs_from_proto(resp.first_top_logprobs)
