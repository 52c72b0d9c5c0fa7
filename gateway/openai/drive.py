"""One pipeline request on its own task, read through a queue.

The request's whole life (check, admit, tokenize, route, relay, migrate; its log context and
span) runs on one task, whatever part of the HTTP exchange is reading it: the handler waits
for the first response before it answers (so an error before any token gets its own HTTP
status), the streaming body reads the rest. :meth:`Drive.cancel` (the client left, or the
body's reader was cancelled) cancels that task, which cancels the decode call and so frees
the request's KV blocks on both workers (gateway.pipeline, decode_worker.call).
"""
from __future__ import annotations

import asyncio

from gateway.pipeline import GatewayRequest, RequestError

_END = object()


class ClientGone(Exception):
    """The HTTP client disconnected before the answer began."""


class Drive:
    def __init__(self, req: GatewayRequest) -> None:
        self.req = req
        self._q: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for resp in self.req.run():
                self._q.put_nowait(resp)
            self._q.put_nowait(_END)
        except RequestError as e:
            self._q.put_nowait(e)

    async def next(self):
        """The next GenerateResponse; None at the end; raises the request's RequestError."""
        item = await self._q.get()
        if item is _END:
            return None
        if isinstance(item, RequestError):
            raise item
        return item

    def cancel(self) -> None:
        if not self.task.done():
            self.req.cut("client gone")
            self.task.cancel()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(aw, receive, drive: Drive):
    """``await aw``, unless the client disconnects first: then the request is cancelled and
    :class:`ClientGone` raised. Only once the request body has been read."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        drive.cancel()
        raise
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    drive.cancel()
    raise ClientGone()
