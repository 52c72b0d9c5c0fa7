"""pdcore/tasks.py: stopping background tasks is bounded even when a cancellation is lost."""
from __future__ import annotations

import asyncio
import logging
import time

from pdcore.tasks import cancel_and_wait


def test_a_task_that_swallows_the_first_cancellation_is_cancelled_again():
    async def main():
        swallowed = []

        async def loop():  # like a retry loop that took the cancellation for a Redis timeout
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(1)

        task = asyncio.create_task(loop(), name="stubborn-once")
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        assert await cancel_and_wait([task], timeout_s=5.0, recancel_s=0.05) == []
        assert task.cancelled() and swallowed == [1]
        assert time.monotonic() - t0 < 1.0

    asyncio.run(main())


def test_a_task_that_never_stops_is_given_up_on_after_the_deadline(caplog):
    async def main():
        stop = asyncio.Event()

        async def deaf():
            while not stop.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    pass

        task = asyncio.create_task(deaf(), name="deaf")
        await asyncio.sleep(0.02)  # inside its loop
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="pdcore.tasks"):
            left = await cancel_and_wait([task, None], timeout_s=0.3, recancel_s=0.05)
        waited = time.monotonic() - t0
        assert left == [task] and not task.done()
        assert 0.3 <= waited < 1.5
        assert "deaf did not stop" in caplog.text
        stop.set()
        await task

    asyncio.run(main())


def test_errors_of_finished_tasks_are_logged_not_raised(caplog):
    async def main():
        async def boom():
            raise RuntimeError("kaput")

        async def sleeper():
            await asyncio.sleep(10)

        failed = asyncio.create_task(boom(), name="boom")
        await asyncio.sleep(0)  # let it fail before the cancel arrives
        sleeping = asyncio.create_task(sleeper(), name="sleeper")
        with caplog.at_level(logging.ERROR, logger="pdcore.tasks"):
            assert await cancel_and_wait([failed, sleeping], timeout_s=1.0) == []
        assert sleeping.cancelled() and isinstance(failed.exception(), RuntimeError)
        assert "boom ended with an error" in caplog.text and "kaput" in caplog.text

    asyncio.run(main())
