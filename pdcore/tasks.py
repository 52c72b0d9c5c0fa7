"""Stopping background asyncio tasks so that a stop can never hang.

A single ``task.cancel()`` is not always enough: code that cleans up after a cancellation can
replace it with another exception (a cleanup step under its own ``asyncio.timeout``, say, whose
TimeoutError replaces the CancelledError; redis-py's connection clean-up awaits under such
timeouts). A background loop that treats that error as "Redis is slow, try again" then runs
on, and ``await task`` never returns. In CI a registry test hung for 600 s where the only
unbounded wait was a heartbeat's stop awaiting its cancelled task.
:func:`cancel_and_wait` cancels again until the task has finished and gives up after a
deadline, so shutdown paths are bounded whatever the task does with the first cancellation.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
import logging
import time

logger = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], *, timeout_s: float = 5.0,
                          recancel_s: float = 0.1) -> list[asyncio.Task]:
    """Cancel ``tasks`` and wait until every one has finished; return those still running.

    Tasks still running after ``recancel_s`` are cancelled again, until ``timeout_s`` has passed
    (then they are logged and returned, never awaited further). Exceptions the tasks end with
    are logged, not raised: this is for shutdown paths. ``None`` entries are skipped.
    """
    given = [t for t in tasks if t is not None]
    pending = set(given)
    for t in pending:
        t.cancel()
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
        for t in pending:
            t.cancel()  # the first cancellation was swallowed: ask again
    for t in given:
        if t in pending:
            logger.error("task %s did not stop within %.1f s of being cancelled", t.get_name(),
                         timeout_s)
        elif not t.cancelled() and t.exception() is not None:
            logger.error("task %s ended with an error", t.get_name(), exc_info=t.exception())
    return [t for t in given if t in pending]



class Stopped(Exception):
    """A wait was interrupted because its owner was stopped (see :func:`unless_stopped`)."""


async def unless_stopped(aw, stop: asyncio.Event):
    """Await ``aw``, unless ``stop`` is set first: then ``aw`` is cancelled (and awaited, so
    its clean-up has run) and :class:`Stopped` is raised. Cancelling the caller cancels
    ``aw`` too."""
    if stop.is_set():
        if asyncio.iscoroutine(aw):
            aw.close()
        raise Stopped
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        waiter.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Stopped
