"""AsyncEngine: drives an LLMEngine on its own thread for asyncio servers.

The engine (scheduler, block manager, model) is touched by exactly one thread. Callers submit
commands (closures over the engine) through a queue; the engine thread runs them between steps,
steps while there is work, and hands each request's outputs to that request's asyncio queue.
The torch forward pass releases the GIL, so the event loop keeps serving gRPC meanwhile.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any

from engine.engine import EngineStats, LLMEngine
from engine.request import FinishReason, PrefillProgress, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


# The engine thread's wait when the last step could schedule nothing although work waits
# (a prefill worker's blocks held by KV transfers): a command (a release, an abort, a new
# request) wakes it at once; this bounds the wait otherwise.
STALL_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # set once the engine thread takes no more commands (stopped or dead): a command
        # queued after that would wait forever, so call() refuses it; the lock makes the
        # check and the put one step against the thread's last drain
        self._closed: BaseException | None = None
        self._cmd_lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self.step_listeners: list[Callable[[list[RequestOutput]], None]] = []  # engine thread
        self.step_started_ns = 0  # wall clock (time.time_ns) when the current/last step began
        # the engine's counters after its latest step or command, for readers that must not
        # wait for a step (Stats, load reports); written by the engine thread
        self.snapshot: EngineStats = engine.stats()
        self.audit: EngineStats | None = None  # the latest detailed stats (see stranded())
        self._audit_time = 0.0
        # request id -> None while a caller owns the request (it will end, release or abort
        # it), else the monotonic time its owner let go; see stranded()
        self._owners: dict[str, float | None] = {}
        # decode role: pre-allocations waiting for free KV blocks, in arrival order (event
        # loop); ``_kv_need``: the first one's block count, which the engine thread compares
        # with the free blocks after each step and command (0: no one waits)
        self._kv_waiters: deque[_KvWaiter] = deque()
        self._kv_need = 0

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # prefill progress reaches its caller as soon as a chunk is queued on the device,
        # not after the step: the KV sender starts on it while the chunk computes
        self.engine.progress_sink = self._send_progress
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread; commands queued or called from now on fail with
        EngineDeadError (never wait forever), open streams end with it."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        else:
            self._close(EngineDeadError("engine stopped"))
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("engine stopped"))
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # tensor-parallel ranks: stopped with the engine

    def _run(self) -> None:
        try:
            self.engine.runner.bind_thread()
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a dead thread must not leave callers hanging
            logger.exception("engine thread failed; failing every in-flight request")
            self.dead = e
            self._fail_all(e)
        finally:  # stopped (or dead): commands queued from now on, or not run yet, fail
            self._close(EngineDeadError("engine stopped" if self.dead is None
                                        else f"engine failed: {self.dead!r}"))

    def _close(self, exc: BaseException) -> None:
        with self._cmd_lock:
            if self._closed is None:
                self._closed = exc
        self._drain(self._closed)

    def _drain(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    def _serve(self) -> None:
        eng = self.engine
        while not self._stopping:
            while True:
                try:
                    fn, fut = self._cmds.get_nowait()
                except queue.Empty:
                    break
                # RUNNING from here on: a caller cancelled now can no longer cancel the future
                # (set_result on a cancelled one raised and killed this thread). A command
                # whose caller already gave up still runs: its caller's clean-up (an abort)
                # is queued behind it and relies on that order.
                wanted = fut.set_running_or_notify_cancel()
                try:
                    res = fn(eng)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    self.snapshot = eng.stats()
                    if wanted:
                        fut.set_exception(e)
                    else:
                        logger.debug("engine command of a cancelled caller failed: %r", e)
                else:
                    self.snapshot = eng.stats()  # before the caller hears: it may read it
                    if wanted:
                        fut.set_result(res)
            self._check_kv_waiters(eng)
            if not eng.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.step_started_ns = time.time_ns()
            try:
                outs = eng.step()
            except BaseException as e:  # a broken step must not leave callers hanging
                logger.exception("engine step failed; failing every in-flight request")
                self.dead = e
                self._fail_all(e)
                return
            self.snapshot = eng.stats()
            self._check_kv_waiters(eng)
            if eng.stalled:  # nothing could be scheduled: wait for a command (a release)
                self._wake.wait(STALL_WAIT_S)
                self._wake.clear()
            for fn in self.step_listeners:
                fn(outs)
            if outs:  # one wake-up of the event loop per step, not one per request
                self._loop.call_soon_threadsafe(self._deliver_all, outs)

    def _check_kv_waiters(self, eng: LLMEngine) -> None:
        """Engine thread: wake the first waiting pre-allocation once its blocks are free."""
        need = self._kv_need
        if need and eng.block_manager.num_free_blocks >= need:
            self._kv_need = 0  # woken once; it arms again if it still cannot have them
            self._loop.call_soon_threadsafe(self._wake_first_kv_waiter)

    def _wake_first_kv_waiter(self) -> None:
        if self._kv_waiters and not self._kv_waiters[0].woken.done():
            self._kv_waiters[0].woken.set_result(None)

    def _arm_kv_waiters(self) -> None:
        """Event loop: tell the engine thread what the first waiter needs (and look now)."""
        self._kv_need = self._kv_waiters[0].need if self._kv_waiters else 0
        if self._kv_need:
            self._wake.set()

    def _send_progress(self, items: list[PrefillProgress]) -> None:
        """Engine thread (``LLMEngine.progress_sink``): a request's progress reaches its
        stream before that request's output, which is delivered after the step."""
        self._loop.call_soon_threadsafe(self._deliver_all, items)

    def _deliver_all(self, items: list[Any]) -> None:
        """Event loop: hand a step's outputs (and prefill progress) to their streams."""
        for item in items:
            q = self._streams.get(item.request_id)
            if q is not None:
                q.put_nowait(item)

    def _deliver(self, rid: str, item: Any) -> None:
        q = self._streams.get(rid)
        if q is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine failed: {exc!r}"))
        self._close(EngineDeadError(f"engine failed: {exc!r}"))

    # --------------------------------------------------------------- commands
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; return its result."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cmd_lock:
            if self._closed is not None:
                raise EngineDeadError(str(self._closed))
            self._cmds.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def _open(self, rid: str) -> asyncio.Queue:
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        return q

    # ------------------------------------------------------------- ownership
    def _own(self, rid: str) -> None:
        self._owners[rid] = None

    def _let_go(self, rid: str) -> None:
        if rid in self._owners:
            self._owners[rid] = time.monotonic()

    async def refresh_audit(self) -> EngineStats:
        """Take the detailed stats (a pass over every block, on the engine thread)."""
        st = await self.call(lambda e: e.stats(detail=True))
        st_time = time.monotonic()
        for rid, gone in list(self._owners.items()):
            if gone is not None and rid not in st.request_blocks and gone < st_time - 1.0:
                del self._owners[rid]
        self.audit, self._audit_time = st, st_time
        return st

    def stranded(self) -> int:
        """KV blocks held for no one, as of the latest :meth:`refresh_audit`: blocks no request
        references, plus those of requests whose caller let go of them over a second before
        the audit (their abort or release should have freed them by then) or that no caller
        ever owned. 0 unless something leaked."""
        st = self.audit
        if st is None:
            return 0
        cutoff = self._audit_time - 1.0
        n = st.kv_blocks_orphaned
        for rid, blocks in st.request_blocks.items():
            gone = self._owners.get(rid, float("-inf"))  # never owned: stranded too
            if gone is not None and gone < cutoff:
                n += blocks
        return n

    # --------------------------------------------------------------- streams
    async def _stream(self, rid: str, q: asyncio.Queue, samples: int = 1
                      ) -> AsyncIterator[RequestOutput]:
        """A request's outputs until each of its ``samples`` finished (an abort ends all).
        Outputs of one sample that queued up while the consumer was busy (it writes each to
        a socket) are merged into one (:func:`merge_outputs`): a consumer that falls behind
        the engine catches up with fewer, longer messages instead of one per token."""
        finished = False
        held = None  # taken from the queue but not merged: the next item
        try:
            while True:
                item, held = (held, None) if held is not None else (await q.get(), None)
                if isinstance(item, BaseException):
                    raise item
                while isinstance(item, RequestOutput) and not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if not isinstance(nxt, RequestOutput) or nxt.index != item.index:
                        held = nxt
                        break
                    item = merge_outputs(item, nxt)
                yield item
                if item.finished:
                    samples -= 1
                    if samples <= 0 or item.finish_reason is FinishReason.ABORT:
                        finished = True
                        return
        finally:
            self._streams.pop(rid, None)
            if not finished:  # cancelled, deadline, or the consumer went away
                await self._abort_quiet(rid)
            self._let_go(rid)

    async def _abort_quiet(self, rid: str) -> None:
        try:
            await asyncio.shield(self.call(lambda e: e.abort(rid)))
        except Exception:  # noqa: BLE001 - engine dead: nothing left to free
            pass
        self._let_go(rid)

    def _end_stream(self, rid: str, reason: FinishReason) -> None:
        """Event loop: end an open stream with a last, token-less output (an abort)."""
        q = self._streams.get(rid)
        if q is not None:
            q.put_nowait(RequestOutput(request_id=rid, prompt_token_ids=[], finished=True,
                                       finish_reason=reason))

    # --------------------------------------------------------------- requests
    async def generate(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                       output_token_ids: list[int] = ()) -> AsyncIterator[RequestOutput]:
        """Colocated: prefill and decode here; yields step deltas until finished.
        ``output_token_ids``: a resumed request's tokens so far (LLMEngine.add_request)."""
        q = self._open(rid)
        self._own(rid)
        try:
            await self.call(lambda e: e.add_request(rid, prompt_ids, sampling,
                                                    output_token_ids=output_token_ids))
        except BaseException:
            self._streams.pop(rid, None)
            await self._abort_quiet(rid)  # cancelled: the command still ran; undo it
            raise
        async for out in self._stream(rid, q, sampling.n):
            yield out

    async def prefill(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                      on_progress: Callable[[PrefillProgress], None] | None = None,
                      output_token_ids: list[int] = (), abort_on_error: bool = True
                      ) -> RequestOutput:
        """Prefill role: compute the prompt, sample the first token, HOLD the blocks.
        The caller must ``release`` (or ``abort``) the request when its transfer ends.
        ``on_progress`` is called (in the event loop) for each prefill chunk once it is
        queued on the device (the last one before this returns), so the caller can send the
        chunk's KV while it and the rest compute. A request ended by :meth:`abort` meanwhile
        returns an ``abort`` output. ``abort_on_error=False``: when this raises (cancelled
        included) the request is left to the caller to abort -- after it stopped whatever
        reads the request's blocks (a KV send)."""
        q = self._open(rid)
        self._own(rid)
        try:
            await self.call(lambda e: e.add_request(
                rid, prompt_ids, sampling, prefill_only=True,
                report_progress=on_progress is not None, output_token_ids=output_token_ids))
            item = await q.get()
            while isinstance(item, PrefillProgress):
                on_progress(item)
                item = await q.get()
        except BaseException:
            self._streams.pop(rid, None)
            if abort_on_error:
                await self._abort_quiet(rid)
            raise
        self._streams.pop(rid, None)
        if isinstance(item, BaseException):
            self._let_go(rid)
            raise item
        return item

    async def release(self, rid: str) -> bool:
        try:
            return await self.call(lambda e: e.release(rid))
        finally:
            self._let_go(rid)

    async def abort(self, rid: str) -> bool:
        """End a request now, whatever its state, and free its blocks; a stream still open
        on it ends with an ``abort`` output."""
        try:
            found = await self.call(lambda e: e.abort(rid))
        finally:
            self._let_go(rid)
        if found:
            self._end_stream(rid, FinishReason.ABORT)
        return found

    async def preallocate(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                          output_token_ids: list[int] = (), wait_s: float = 0.0
                          ) -> list[int] | None:
        """Decode role: reserve the blocks a prompt's KV will land in (LLMEngine.preallocate);
        None when there are not enough free ones. With ``wait_s`` > 0 a cache too full
        right now is waited on, up to ``wait_s``, in arrival order behind earlier waiters
        (their blocks come first, as a colocated engine admits its queue in order): running
        requests finish and free theirs."""
        need = -(-(len(prompt_ids) + len(output_token_ids))
                 // self.engine.block_manager.block_size)
        deadline = time.monotonic() + wait_s
        waiter = None
        try:
            while True:
                if waiter is not None or not self._kv_waiters:  # never ahead of a waiter
                    blocks = await self._preallocate(rid, prompt_ids, sampling,
                                                     output_token_ids)
                    if blocks is not None:
                        return blocks
                left = deadline - time.monotonic()
                if left <= 0 or need > self.engine.block_manager.num_blocks:
                    return None
                if waiter is None:
                    waiter = _KvWaiter(need, self._loop.create_future())
                    self._kv_waiters.append(waiter)
                else:
                    waiter.woken = self._loop.create_future()
                if self._kv_waiters[0] is waiter:
                    self._arm_kv_waiters()
                try:
                    await asyncio.wait_for(waiter.woken, left)
                except asyncio.TimeoutError:
                    return None
        finally:
            if waiter is not None:
                first = self._kv_waiters and self._kv_waiters[0] is waiter
                self._kv_waiters.remove(waiter)
                if first:  # the next one's turn (the engine thread checks its need)
                    self._arm_kv_waiters()

    async def _preallocate(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                           output_token_ids: list[int] = ()) -> list[int] | None:
        self._own(rid)
        try:
            blocks = await self.call(lambda e: e.preallocate(rid, prompt_ids, sampling,
                                                             output_token_ids))
        except asyncio.CancelledError:
            # the command runs anyway (or already ran): free what it reserved, or the
            # request would wait for its KV, holding its blocks, forever
            await self._abort_quiet(rid)
            raise
        except BaseException:
            self._let_go(rid)
            raise
        if blocks is None:
            self._let_go(rid)
        return blocks

    async def continue_from(self, rid: str, first_token: int, logprob: float | None,
                            num_cached_tokens: int, top_logprobs=None, samples: int = 1
                            ) -> AsyncIterator[RequestOutput]:
        """Decode role: KV landed; stream from the first token on (every one of the
        request's ``samples``: sample 0 continues from ``first_token``)."""
        q = self._open(rid)
        try:
            first = await self.call(
                lambda e: e.commit_transferred(rid, first_token, logprob, num_cached_tokens,
                                               top_logprobs))
        except BaseException:
            self._streams.pop(rid, None)
            await self._abort_quiet(rid)
            raise
        if first.finished:
            samples -= 1
        if first.finished and samples <= 0:
            self._streams.pop(rid, None)
            self._let_go(rid)
            yield first
            return
        try:
            yield first
        except BaseException:  # the consumer went away after the first token
            self._streams.pop(rid, None)
            await self._abort_quiet(rid)
            raise
        async for out in self._stream(rid, q, samples):
            yield out

    @property
    def kv_block_waiters(self) -> int:
        """Decode role: pre-allocations waiting for free KV blocks (preallocate's wait)."""
        return len(self._kv_waiters)

    async def stats(self):
        """The engine's counters as of its latest step or command (no wait for a step)."""
        return self.snapshot


class _KvWaiter:
    """A pre-allocation waiting for ``need`` free KV blocks; ``woken`` resolves when the
    engine thread saw them free (another may still take them first: it checks again)."""

    __slots__ = ("need", "woken")

    def __init__(self, need: int, woken: asyncio.Future) -> None:
        self.need, self.woken = need, woken


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One step delta for ``a`` then ``b`` (the same request and sample, in that order):
    tokens, text and logprobs joined; finished, finish_reason and num_cached_tokens from
    ``b``. Neither is changed."""
    # built directly, not with dataclasses.replace: this runs on the event loop for every
    # stream that fell behind, and replace() costs several times more
    return RequestOutput(
        request_id=a.request_id, prompt_token_ids=a.prompt_token_ids,
        token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
        finished=b.finished, finish_reason=b.finish_reason,
        logprobs=None if a.logprobs is None and b.logprobs is None
        else (a.logprobs or []) + (b.logprobs or []),
        top_logprobs=None if a.top_logprobs is None and b.top_logprobs is None
        else (a.top_logprobs or []) + (b.top_logprobs or []),
        index=a.index, num_cached_tokens=b.num_cached_tokens,
        held_block_ids=a.held_block_ids, samples=a.samples)
