"""Iteration-level (continuous) batching. Works on ids and token counts only, never tensors.

Every step brings each scheduled request's ``num_computed_tokens`` closer to ``num_tokens``
within a token budget. There is no separate prefill or decode phase: a long prompt is simply
cut into chunks over several steps (chunked prefill) and mixed with one-token decode steps of
running requests; a prefix-cache hit or a KV transfer only starts the count higher.

Policy: running requests first (oldest first), then admission from the waiting queue while
the budget, the running cap and the free blocks allow: in arrival order (``fcfs``), or
(``short_first``) the request with the fewest tokens left to compute first, except that one
waiting longer than ``schedule_max_wait_s`` goes first (oldest first). Under load the second keeps short
prompts' TTFT low on a prefill worker whose queue holds long prompts; a request put back by
preemption resumes first under both. When a running request needs a block and
none is free, the newest running request is preempted: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed from its prompt and generated tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import logging
import time

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import FinishReason
from engine.sequence import Sequence, SeqStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    # (+ ``ahead``) tokens of seq that the step before this one computes: a step launched
    # before that one was read (Engine._launch_ahead) starts past them; 0 otherwise
    ahead: int = 0

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence (its logits give a token)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # KV landed (a decode worker's transferred prompts), no seat free yet: they hold
        # their blocks and take the next seats, before any waiting prompt
        self.ready: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # every unfinished or held request
        self._never_fits: set[str] = set()  # warned about once (see _short_of_blocks)

    # ------------------------------------------------------------- admission
    def add(self, seq: Sequence, front: bool = False) -> None:
        """``front``: admit it before the waiting queue (a sample forked from a request
        already running)."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        if seq.status is SeqStatus.WAITING:
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.append(seq)
        elif seq.status is not SeqStatus.AWAITING_KV:
            raise ValueError(f"cannot add a request in state {seq.status}")
        logger.debug("request %s added (%s, %d tokens)", seq.request_id, seq.status.value,
                     seq.num_tokens)

    def activate(self, seq: Sequence) -> None:
        """AWAITING_KV -> RUNNING once the transferred KV has landed, or READY while
        ``max_num_seqs`` requests run (it takes a seat as one frees: :meth:`seat_ready`)."""
        assert seq.status is SeqStatus.AWAITING_KV
        seq.status = SeqStatus.READY
        self.ready.append(seq)
        self.seat_ready()

    def seat_ready(self) -> None:
        """READY -> RUNNING, oldest first, while seats are free."""
        while self.ready and len(self.running) < self.config.max_num_seqs:
            seq = self.ready.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.seat_ready()

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        self.running.sort(key=lambda s: s.order)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:  # nothing to compute (should not happen); skip
                i += 1
                continue
            while not self.bm.allocate_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: it was the last running one

        # 2. Waiting requests in policy order, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted \
                and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            n, _ = self._admit(seq, budget, whole=False)
            if n is None:
                if not self.running:
                    self._short_of_blocks(seq)
                break
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _short_of_blocks(self, seq: Sequence) -> None:
        """Nothing runs and ``seq`` still does not fit. Blocks held for KV transfers
        (a prefill worker's HELD requests) come back when those end (the engine waits, it
        does not spin: LLMEngine.stalled); only when nothing holds any can it never fit."""
        if any(s.status is SeqStatus.HELD for s in self.requests.values()):
            return
        if seq.request_id not in self._never_fits:
            self._never_fits.add(seq.request_id)
            logger.warning("request %s needs more KV blocks than exist", seq.request_id)

    def _admit(self, seq: Sequence, budget: int, whole: bool) -> tuple[int | None, int]:
        """Move waiting ``seq`` to running with its next chunk's blocks (after attaching its
        cached prefix): up to ``budget`` tokens, or (``whole``) its whole remaining prompt
        if that fits ``budget``. Returns (the chunk's tokens, or None when it does not fit
        or blocks are short; the tokens it had left to compute after its cached prefix).
        On None its cached prefix is given back: a waiting request holding blocks could
        starve the running ones (and itself) for good."""
        if not seq.block_table:
            seq.num_cached_tokens = self.bm.allocate_cached_prefix(seq)
        left = seq.num_tokens - seq.num_computed_tokens
        n = left if whole else min(left, budget)
        if n > budget or not self.bm.allocate_slots(seq, n):
            self.bm.release_cached_prefix(seq)
            seq.num_cached_tokens = 0
            return None, left
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return n, left

    def admit_ahead(self, budget: int) -> tuple[list[ScheduledSeq], bool]:
        """Admit waiting requests into a step launched before the one running is read
        (Engine._launch_ahead): in policy order, each with its whole remaining prompt in
        one chunk within ``budget`` tokens, while seats and free blocks allow; never
        preempting. Returns (the admitted, in order; whether the next in line is left for
        a scheduled step: it needs chunking, or reports its progress, or is a prefill
        worker's). A request short of seats or blocks just waits: a scheduled step could
        not admit it either."""
        out: list[ScheduledSeq] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            if seq.prefill_only or seq.report_progress:
                return out, True
            n, left = self._admit(seq, budget, whole=True)
            if n is None:  # chunking needed (after its prefix hit), or blocks short
                return out, left > budget
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out, False

    def _next_waiting(self) -> Sequence:
        """The waiting request to admit next (see the module's policy)."""
        head = self.waiting[0]  # arrival order; preempted requests were put at the front
        if self.config.schedule_policy == "fcfs" or head.num_preemptions:
            return head
        aged_before = time.monotonic() - self.config.schedule_max_wait_s
        if head.arrival_time <= aged_before:
            return head  # the oldest has waited too long: FIFO until the backlog is served
        return min(self.waiting,
                   key=lambda q: (q.num_tokens - q.num_computed_tokens, q.order))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("request %s preempted (recompute %d tokens)", seq.request_id, seq.num_tokens)

    # ---------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance counters after the model ran ``out``; ``sampled`` maps request id to the
        token sampled for it (only for chunks that reached the end of their sequence)."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            tok = sampled.get(seq.request_id)
            if tok is not None:
                seq.token_ids.append(tok)
            self.bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason, hold: bool = False) -> None:
        """End ``seq``; its blocks are freed now, or kept (HELD) until ``release``."""
        if seq.status in (SeqStatus.FINISHED, SeqStatus.HELD):
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.READY:
            self.ready.remove(seq)
        seq.finish_reason = reason
        if hold:
            seq.status = SeqStatus.HELD
        else:
            self.bm.free_seq(seq)
            seq.status = SeqStatus.FINISHED
            self.requests.pop(seq.request_id, None)
        self._never_fits.discard(seq.request_id)
        logger.debug("request %s finished (%s%s)", seq.request_id, reason.value,
                     ", blocks held" if hold else "")

    def release(self, request_id: str) -> bool:
        """Free a HELD request's blocks (its KV transfer ended). False if unknown."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SeqStatus.HELD:
            return False
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        del self.requests[request_id]
        return True

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now, whatever its state, and free its blocks at once."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.HELD:
            self.release(request_id)
            return seq
        if seq.status is SeqStatus.AWAITING_KV:
            self.bm.free_seq(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            del self.requests[request_id]
            return seq
        self.finish(seq, FinishReason.ABORT)
        return seq
