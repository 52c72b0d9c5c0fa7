"""DecodeWorker.GenerateMany: many Generate calls on one stream.

A gateway keeps one such stream per decode worker. Each call on it is a
:class:`decode_worker.call.DecodeCall`, exactly as a Generate call is; what differs is the
transport. A Generate call costs the worker's event loop one gRPC message per engine step;
on a busy worker (hundreds of streams, a step every ~20 ms) that per-message work was most of
the loop's time, and the loop shares the interpreter lock with the engine thread. Here every
call's output of one step leaves in one message.

  * a ``start`` entry opens a call (its deadline and trace headers travel with it); a
    ``cancel`` entry ends it as a cancelled RPC would (its blocks are freed); a second
    ``start`` with the id of an open call ends that call with INVALID_ARGUMENT (every call
    gets exactly one end entry, and nothing after it);
  * each call's responses go out in order, tagged with its ``call_id``; its last entry says
    how it ended: OK, or the status code and message its Generate call would have ended with
    (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE at shutdown ...);
  * a stream that breaks (the gateway left, or sent a message over the size limit, which
    grpc refuses for the whole stream: the gateway fails such a request alone before
    sending it) ends every call on it, as cancelled RPCs;
  * a message that does not parse (services.interceptors.MalformedRequest) ends every open
    call with INVALID_ARGUMENT, then the stream with INVALID_ARGUMENT;
  * a worker shutting down says so on every stream (a message with ``draining`` set, so
    the gateway routes new work elsewhere and keeps these calls here while the worker
    refuses other RPCs), refuses new calls (UNAVAILABLE) and ends the stream once its calls
    are done.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from protos.pdserve.v1 import worker_pb2
from services.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.interceptors import MalformedRequest

logger = logging.getLogger(__name__)

MAX_ENTRIES_PER_MESSAGE = 4096
# a message holds at most this share of the message size limit (the worker's own
# max_message_bytes, which it sends under, and grpc's default the gateway receives under):
# one over it would end the stream, and every call on it, with RESOURCE_EXHAUSTED
MESSAGE_BYTES_SHARE = 0.5
MAX_OPEN_CALLS = 65536  # per stream: a caller that never ends its calls is refused more


class CallEnded(Exception):
    """A call's context.abort(): the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a DecodeCall needs of a ServicerContext, for one call on a GenerateMany stream:
    its deadline, its trace headers, abort, and done callbacks (run when the call ends)."""

    def __init__(self, stream_context, metadata, timeout_s: float) -> None:
        self._stream = stream_context
        self._metadata = tuple(metadata.items())
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout_s if timeout_s > 0 else None
        self._callbacks: list = []
        self.finished = False  # its end entry went out

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise CallEnded(code, details)

    def add_done_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def peer(self) -> str:
        return self._stream.peer()

    def auth_context(self):
        return self._stream.auth_context()

    def done(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - one callback's failure ends no other's
                logger.exception("done callback failed")


class ManyCalls:
    """One GenerateMany stream: its calls, and the messages that carry their outputs."""

    def __init__(self, servicer, context) -> None:
        self.servicer, self.context = servicer, context
        self.tasks: dict[int, asyncio.Task] = {}
        self._out: list[worker_pb2.DecodeStreamEntry] = []
        self._ready = asyncio.Event()
        self._reader_done = False
        self._refused: dict[int, str] = {}  # open calls ended by a caller's protocol error
        self._malformed: MalformedRequest | None = None  # the stream's message that did not parse
        # the draining message is due (at once on a stream opened during the drain delay:
        # its calls are refused, and it ends when its caller closes it)
        self._tell_draining = servicer.closing
        limit = min(servicer.env.settings.max_message_bytes, DEFAULT_MAX_MESSAGE_BYTES)
        self._max_bytes = int(limit * MESSAGE_BYTES_SHARE)

    async def run(self, requests):
        """The handler: read the caller's entries in a task, answer with batched entries."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                if self._tell_draining:
                    self._tell_draining = False
                    yield worker_pb2.DecodeStreamResponse(
                        draining=True, grace_s=self.servicer.env.settings.grace_s)
                    continue
                if self._out:
                    yield worker_pb2.DecodeStreamResponse(entries=self._take())
                    continue
                if self._reader_done and not self.tasks:
                    if self._malformed is not None:  # every call's end went out: now the stream's
                        raise self._malformed
                    return  # the caller half-closed (or shutdown) and every call has ended
                self._ready.clear()
                await self._ready.wait()
        finally:
            reader.cancel()
            tasks = list(self.tasks.values())
            for t in tasks:
                t.cancel()
            if tasks:  # each call frees what it holds (its DecodeCall cleans up)
                await asyncio.gather(*tasks, return_exceptions=True)

    def _take(self) -> list[worker_pb2.DecodeStreamEntry]:
        """The next message's entries: in order, at most MAX_ENTRIES_PER_MESSAGE of them and
        about _max_bytes (always at least one; an entry alone is one call's step, as big as
        its Generate call's message would be)."""
        n, size = 0, 0
        for entry in self._out[:MAX_ENTRIES_PER_MESSAGE]:
            size += entry.ByteSize() + 8  # + the entry's tag and length
            if n and size > self._max_bytes:
                break
            n += 1
        batch = self._out[:n]
        del self._out[:n]
        return batch

    def _emit(self, entry: worker_pb2.DecodeStreamEntry) -> None:
        self._out.append(entry)
        self._ready.set()

    def _end(self, call_id: int, code: grpc.StatusCode = grpc.StatusCode.OK,
             message: str = "") -> None:
        self._emit(worker_pb2.DecodeStreamEntry(call_id=call_id, end=True,
                                                status_code=code.value[0],
                                                status_message=message))

    async def _read(self, requests) -> None:
        try:
            async for msg in requests:
                action = msg.WhichOneof("action")
                if action == "start":
                    self._start(msg)
                elif action == "cancel":
                    task = self.tasks.get(msg.call_id)
                    if task is not None:
                        task.cancel()
        except asyncio.CancelledError:
            raise
        except MalformedRequest as e:  # the caller's error: its open calls end with it
            self._malformed = e
            for cid, task in list(self.tasks.items()):
                self._refused[cid] = f"the stream broke: {e.reason}"
                task.cancel()
        except Exception as e:  # noqa: BLE001 - the stream broke: its calls end with it
            logger.debug("GenerateMany stream from %s ended: %r", self.context.peer(), e)
            for task in list(self.tasks.values()):
                task.cancel()
        finally:
            self._reader_done = True
            self._ready.set()

    def _start(self, msg) -> None:
        cid = msg.call_id
        if cid in self.tasks:  # a caller's error: the call it names ends, once, with this
            self._refused[cid] = f"call_id {cid} was started again while open on this stream"
            self.tasks[cid].cancel()
            return
        if not msg.timeout_s >= 0:  # negative, or NaN
            self._end(cid, grpc.StatusCode.INVALID_ARGUMENT,
                      f"timeout_s {msg.timeout_s} is invalid (seconds >= 0; 0: none)")
            return
        if self.servicer.closing:
            self._end(cid, grpc.StatusCode.UNAVAILABLE,
                      "decode worker is shutting down: resume the request elsewhere")
            return
        if len(self.tasks) >= MAX_OPEN_CALLS:
            self._end(cid, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"more than {MAX_OPEN_CALLS} calls open on one stream")
            return
        ctx = CallContext(self.context, msg.metadata, msg.timeout_s)
        task = self.tasks[cid] = asyncio.ensure_future(self._serve(cid, msg.start, ctx))
        # a task cancelled before it first ran never enters _serve: end its call here
        task.add_done_callback(
            lambda _t: ctx.finished or self._finish(cid, ctx, *self._cancelled(cid)))

    def _cancelled(self, cid: int) -> tuple[grpc.StatusCode, str]:
        refused = self._refused.pop(cid, None)
        if refused is not None:
            return grpc.StatusCode.INVALID_ARGUMENT, refused
        return grpc.StatusCode.CANCELLED, "cancelled by the caller"

    async def _serve(self, cid: int, request, ctx: CallContext) -> None:
        from decode_worker.call import DecodeCall
        code, message = grpc.StatusCode.INTERNAL, "internal error"
        try:
            call = DecodeCall(self.servicer.env, request, ctx)
            with self.servicer.calls.track(request.request_id, call):
                async with asyncio.timeout_at(ctx.deadline):
                    async for resp in call.run():
                        self._emit(worker_pb2.DecodeStreamEntry(call_id=cid, response=resp))
            code, message = grpc.StatusCode.OK, ""
        except CallEnded as e:
            code, message = e.code, e.details
        except TimeoutError:
            if ctx.time_remaining() == 0:
                code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:  # a timeout inside the call that it did not turn into a status
                logger.exception("request %s failed", request.request_id[:64])
        except asyncio.CancelledError:
            code, message = self._cancelled(cid)
        except Exception:  # noqa: BLE001 - as grpc would: this call fails, no other does
            logger.exception("request %s failed", request.request_id[:64])
        finally:
            self._finish(cid, ctx, code, message)

    def _finish(self, cid: int, ctx: CallContext, code: grpc.StatusCode, message: str) -> None:
        """A call's one end entry (a second call of this for the same call does nothing)."""
        if ctx.finished:
            return
        ctx.finished = True
        self.tasks.pop(cid, None)
        self._end(cid, code, message)
        ctx.done()
        if self._reader_done and not self.tasks:
            self._ready.set()

    def close_when_idle(self) -> None:
        """Shutdown: the caller is told, and the stream ends once its calls are done (new
        ones are refused)."""
        self._tell_draining = True
        self._reader_done = True
        self._ready.set()
