"""Awaiting device work and helper threads from the event loop, watching a control socket.

A transfer's side waits for CUDA events (copies, NCCL kernels, the prefill's forward pass),
for NCCL's communicator state and for NIXL requests without blocking its event loop and
without a busy loop holding the GIL; with ``watch`` (the transfer's control connection) a
peer that reports an error or hangs up ends the wait at once (:class:`TransferError` with
the peer's reason) instead of at the transfer's timeout. Used by :mod:`kvtransfer.stream`,
:mod:`kvtransfer.control` and the backends; depends only on the interface and the wire.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time

from kvtransfer.api import TransferError
from kvtransfer.wire import peer_failed, peer_reason


# threads that block on CUDA events for the event loop (a blocked thread holds no GIL); a
# receive waits in one for as long as the prefill computes, so under load many are taken
_EVENT_WAITERS = concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                       thread_name_prefix="kv-event-wait")
# threads that poll NCCL for a few hundred microseconds each (poll_in_thread): their own
# pool, so they never queue behind the long event waits above
_POLLERS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-poll")


async def wait_event(event, *, watch: socket.socket | None = None,
                     what: str = "device work", mark=None) -> None:
    """Await a CUDA event (anything with ``query()`` and ``synchronize()``; None: nothing to
    wait for). A helper thread blocks in ``synchronize()`` (events made with
    ``blocking=True`` sleep in the driver; default ones spin there, waking sooner but taking
    a core: only for short waits) and wakes the loop when it completes: no polling on the
    event loop, whose timers have millisecond granularity, and no busy loop holding
    the GIL (which would stall the engine thread of the same process at every torch call).
    With ``watch``, a peer that reports an error or hangs up first raises TransferError.
    The thread always returns: the work it waits on ends or is aborted (NCCL). ``mark``
    (a transfer's ``mark``) notes "synced" from the helper thread when the event completed,
    so a timeline shows the loop's wake-up apart from the device work."""
    if event is None or event.query():
        return
    loop = asyncio.get_running_loop()

    def synchronize() -> None:
        event.synchronize()
        if mark is not None:
            mark("synced")

    await _until_done(loop, _in_thread(loop, _EVENT_WAITERS, synchronize)[1], watch, what)


def _in_thread(loop: asyncio.AbstractEventLoop, pool: concurrent.futures.Executor,
               fn) -> tuple[concurrent.futures.Future, asyncio.Future]:
    """Run ``fn`` in ``pool``; returns the pool's future and a loop future that the thread
    settles itself (True, or ``fn``'s exception) with ONE ``call_soon_threadsafe``: a
    thread's completion wakes the awaiting coroutine in two loop iterations, where
    ``run_in_executor`` / ``wrap_future`` plus ``asyncio.wait`` chain four or five
    callbacks (each a loop iteration later). The loop future may already be settled or
    cancelled by then (the peer gave up, the waiter was cancelled)."""
    fut = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(True)
            else:
                fut.set_exception(exc)

    def job() -> None:
        exc = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            exc = e
        try:
            loop.call_soon_threadsafe(settle, exc)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass
        if exc is not None:
            raise exc

    return pool.submit(job), fut


async def _until_done(loop: asyncio.AbstractEventLoop, done: asyncio.Future,
                      watch: socket.socket | None, what: str) -> None:
    """Await ``done`` (settled by a helper thread, :func:`_in_thread`); with ``watch``, a
    peer that reports an error or hangs up first raises TransferError (it settles ``done``
    with False)."""
    if watch is None:
        await done
        return
    fd = watch.fileno()

    def on_readable() -> None:
        if peer_failed(watch) and not done.done():
            done.set_result(False)
        loop.remove_reader(fd)  # an OK is waiting: not our business

    loop.add_reader(fd, on_readable)
    try:
        if await done:
            return
        raise TransferError(f"peer gave up during {what}: {await peer_reason(loop, watch)}")
    finally:
        loop.remove_reader(fd)


async def poll_in_thread(done, *, interval_s: float = 0.00002, max_interval_s: float = 0.0002,
                         watch: socket.socket | None = None, what: str = "device work") -> None:
    """Like :func:`poll_until`, but a helper thread polls ``done()`` (which must be safe to
    call from another thread, like NCCL's communicator state): the event loop's timers have
    millisecond granularity (epoll, libuv), so a 20-200 us back-off on the loop costs a
    whole millisecond per wait, while a thread's sleep is that short (and holds no GIL).
    The thread stops when the wait ends for any reason (cancellation, the peer giving up)."""
    if done():
        return
    stop = threading.Event()

    def spin() -> None:
        delay = interval_s
        while not stop.is_set() and not done():
            time.sleep(delay)
            delay = min(delay * 2, max_interval_s)

    loop = asyncio.get_running_loop()
    job, done_ = _in_thread(loop, _POLLERS, spin)
    try:
        await _until_done(loop, done_, watch, what)
    finally:
        stop.set()
        # a started poll is at most one back-off from seeing ``stop``: let it finish its
        # call, so whatever the caller does next (abort the communicator) never races with it
        if not job.cancel():
            concurrent.futures.wait([job], timeout=1.0)


async def poll_until(done, *, interval_s: float = 0.00005, max_interval_s: float = 0.0002,
                     watch: socket.socket | None = None, what: str = "device work") -> None:
    """Await until ``done()`` is true (a NIXL request) without blocking the event loop,
    polling on the loop with a short back-off (whose sleeps the loop rounds up to 1 ms; a
    ``done`` callable from any thread: :func:`poll_in_thread`; CUDA events:
    :func:`wait_event`). With ``watch``, a control socket on which the peer reports an error
    or hangs up first raises TransferError with the peer's reason (a pending OK is left
    unread for its owner)."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Event | None = None
    if watch is not None:
        readable = asyncio.Event()
        loop.add_reader(watch.fileno(), readable.set)
    try:
        delay = interval_s
        while not done():
            if readable is not None and readable.is_set():
                if peer_failed(watch):
                    raise TransferError(f"peer gave up during {what}: "
                                        f"{await peer_reason(loop, watch)}")
                loop.remove_reader(watch.fileno())  # an OK is waiting: not our business
                readable = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_interval_s)
    finally:
        if readable is not None:
            loop.remove_reader(watch.fileno())
