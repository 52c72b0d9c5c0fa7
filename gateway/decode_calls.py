"""The gateway's calls to decode workers.

By default every call to one decode worker travels on one DecodeWorker.GenerateMany stream
(decode_worker/many.py says why: one message per engine step instead of one per call).
:meth:`DecodeCalls.generate` hides which transport a call takes: it returns an object that
behaves as grpc's call of DecodeWorker.Generate does for the request path (iterate it for
the responses, a failure raises ``grpc.aio.AioRpcError`` with the call's status, ``cancel()``
ends it and makes the iteration raise ``asyncio.CancelledError``).

A stream that breaks (the worker died, the connection was lost) fails each of its calls with
the stream's status, as their own Generate calls would have failed; the next call opens a
new stream. A worker that says it is draining (shutting down: its calls finish on it)
is reported to ``on_draining`` (the router stops routing to it and keeps those calls
there). A worker that does not serve GenerateMany (an older one) gets a Generate call
per request from then on. ``decode_stream = "per_request"`` (a gateway setting) uses
Generate calls only.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from protos.pdserve.v1 import worker_pb2
from services.grpc_server import ChannelPool

logger = logging.getLogger(__name__)

STREAM_MODES = ("many", "per_request")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_CANCELLED = object()  # queued when the call is cancelled
_DEADLINE_SLACK_S = 1.0  # the worker ends a call at its deadline; the gateway this much later


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeCalls:
    def __init__(self, peers: ChannelPool, mode: str = "many", on_draining=None) -> None:
        """``on_draining(address, grace_s)``: a worker said on its stream that it is
        draining, and how long it gives its calls."""
        if mode not in STREAM_MODES:
            raise ValueError(f"decode_stream must be one of {', '.join(STREAM_MODES)}")
        self.peers, self.mode = peers, mode
        self.on_draining = on_draining
        self._streams: dict[str, _Stream] = {}
        self._per_request: set[str] = set()  # workers without GenerateMany

    def generate(self, address: str, request, timeout: float, metadata=()):
        """A call of DecodeWorker.Generate(``request``) on the worker at ``address``."""
        if self.mode == "per_request" or address in self._per_request:
            return self.peers.stub(address).Generate(request, timeout=timeout,
                                                     metadata=metadata)
        channel = self.peers.channel(address)
        stream = self._streams.get(address)
        if stream is None or stream.broken or stream.channel is not channel:
            if stream is not None:
                stream.retire()
            stream = self._streams[address] = _Stream(self, address, channel)
        return stream.start(request, timeout, metadata)

    def unimplemented(self, address: str) -> None:
        if address not in self._per_request:
            logger.warning("decode worker %s does not serve GenerateMany: one Generate call "
                           "per request from now on", address)
            self._per_request.add(address)

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.close()
        await self.peers.close()


class _Stream:
    """One GenerateMany stream to one decode worker, and the calls on it."""

    def __init__(self, owner: DecodeCalls, address: str, channel) -> None:
        from protos.pdserve.v1 import worker_pb2_grpc
        self.owner, self.address, self.channel = owner, address, channel
        self.calls: dict[int, _Call] = {}
        self.broken = False
        self.retired = False
        self.received = False  # an entry came: the worker serves GenerateMany
        self.messages = 0  # received (what batching saves shows in tests and benchmarks)
        self._next_id = 1
        self._sends: asyncio.Queue = asyncio.Queue()
        self.rpc = worker_pb2_grpc.DecodeWorkerStub(channel).GenerateMany(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    def start(self, request, timeout: float, metadata) -> _Call:
        cid, self._next_id = self._next_id, self._next_id + 1
        msg = worker_pb2.DecodeStreamRequest(call_id=cid, start=request, timeout_s=timeout,
                                             metadata=dict(metadata))
        call = _Call(self, cid, request, timeout, metadata)
        if msg.ByteSize() > self.owner.peers.max_message_bytes:
            # the worker would refuse the message, and with it the stream: fail this call only
            call.fail(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request of {msg.ByteSize()} bytes exceeds the "
                                f"{self.owner.peers.max_message_bytes}-byte message limit"))
            return call
        self.calls[cid] = call
        self._sends.put_nowait(msg)
        return call

    def cancel(self, cid: int) -> None:
        if self.calls.pop(cid, None) is not None and not self.broken:
            self._sends.put_nowait(worker_pb2.DecodeStreamRequest(call_id=cid, cancel=True))
        self._maybe_finish()

    def ended(self, cid: int) -> None:
        self.calls.pop(cid, None)
        self._maybe_finish()

    def retire(self) -> None:
        """A newer stream takes the new calls: this one ends once its calls are done."""
        self.retired = True
        self._maybe_finish()

    def close(self) -> None:
        self.broken = True
        self.rpc.cancel()

    def _maybe_finish(self) -> None:
        if self.retired and not self.calls:
            self._sends.put_nowait(None)

    def _draining(self, grace_s: float) -> None:
        """The worker is shutting down: its calls here finish on it; new calls open a new
        stream (to whatever serves that address next) and this one ends with its calls."""
        if self.owner._streams.get(self.address) is self:
            del self.owner._streams[self.address]
        self.retire()
        if self.owner.on_draining is not None:
            self.owner.on_draining(self.address, grace_s)

    async def _requests(self):
        while (msg := await self._sends.get()) is not None:
            yield msg

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for msg in self.rpc:
                self.received = True
                self.messages += 1
                if msg.draining:
                    self._draining(msg.grace_s)
                for entry in msg.entries:
                    call = self.calls.get(entry.call_id)
                    if call is not None:
                        call.queue.put_nowait(entry)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                              f"decode worker {self.address} ended the stream")
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() is grpc.StatusCode.INTERNAL:
                # mostly the worker ended the stream while a start was being written: grpc's
                # asyncio client then reports its failed write as INTERNAL instead of the
                # worker's status (grpc/grpc#36066); either way the stream broke under them
                error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"stream to decode worker {self.address} broke: "
                                  f"{e.details()}"[:300])
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway is closing")
        except Exception as e:  # noqa: BLE001 - whatever broke it, its calls fail
            logger.exception("GenerateMany stream to %s failed", self.address)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to the decode worker "
                                                           f"failed: {e!r}"[:300])
        finally:
            self.broken = True
            if self.owner._streams.get(self.address) is self:
                del self.owner._streams[self.address]
            if error is not None and error.code() is grpc.StatusCode.UNIMPLEMENTED \
                    and not self.received:
                self.owner.unimplemented(self.address)
            calls, self.calls = list(self.calls.values()), {}
            for call in calls:
                call.queue.put_nowait(error)
            self._sends.put_nowait(None)


class _Call:
    """One call on a stream: what the request path iterates and cancels."""

    def __init__(self, stream: _Stream, cid: int, request, timeout: float, metadata) -> None:
        self.stream, self.cid = stream, cid
        self.request, self.metadata = request, metadata
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout
        # the worker ends the call at its deadline; this ends it should the worker not
        self._timer = loop.call_at(self.deadline + _DEADLINE_SLACK_S, self._expire)

    def cancel(self) -> bool:
        if self.done:
            return False
        self._close()
        self.stream.cancel(self.cid)
        self.queue.put_nowait(_CANCELLED)
        return True

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """End the call before it was sent: its iteration raises ``error``."""
        self._close()
        self.queue.put_nowait(error)

    def _expire(self) -> None:
        if not self.done:
            self._close()
            self.stream.cancel(self.cid)
            self.queue.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            "Deadline Exceeded"))

    def _close(self) -> None:
        self.done = True
        self._timer.cancel()

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        try:
            while True:
                item = await self.queue.get()
                if item is _CANCELLED:
                    raise asyncio.CancelledError()
                if isinstance(item, grpc.aio.AioRpcError):
                    self._close()
                    if item.code() is grpc.StatusCode.UNIMPLEMENTED \
                            and not self.stream.received:
                        async for resp in self._per_request():
                            yield resp
                        return
                    raise item
                if item.HasField("response"):
                    yield item.response
                if item.end:
                    self._close()
                    self.stream.ended(self.cid)
                    if item.status_code:
                        raise rpc_error(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN),
                                        item.status_message)
                    return
        finally:
            if not self.done:  # the caller stopped reading: the call ends on the worker
                self.cancel()

    async def _per_request(self):
        """The worker does not serve GenerateMany: the same call as a Generate call."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        call = self.stream.owner.peers.stub(self.stream.address).Generate(
            self.request, timeout=left, metadata=self.metadata)
        self.cancel = call.cancel  # the caller's cancel() now ends that call
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()
