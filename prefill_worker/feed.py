"""How a prompt's KV blocks reach the KV sender while the prompt computes."""
from __future__ import annotations

from engine.request import PrefillProgress
from kvtransfer.stream import BlockStream


class ChunkFeed:
    """Feeds a transfer's BlockStream from the engine: the blocks each prefill chunk fills,
    handed over as soon as the chunk is queued on the device, with the events that complete
    once its KV (per layer, on a GPU) is written; full blocks only, but for the last chunk,
    which completes the prompt's partial last block too. Transfer block ``i`` is the
    prompt's block ``skip + i`` (the decode worker already holds the first ``skip``)."""

    def __init__(self, total: int, skip: int, block_size: int, prompt_tokens: int) -> None:
        self.stream = BlockStream(total)
        self.total, self.skip, self.block_size = total, skip, block_size
        self.prompt_tokens = prompt_tokens
        self.handed = 0
        self.parts = 0  # extends so far (one per prefill chunk that completed blocks)

    def progress(self, p: PrefillProgress) -> None:
        if p.reset:
            self.fail("the prefill was preempted on the prefill worker (its blocks were freed)")
            return
        done = p.num_computed_tokens
        # the last chunk completes the prompt's partial last block too
        full = -(-done // self.block_size) if done >= self.prompt_tokens else \
            done // self.block_size
        self._hand(p.block_ids, min(full, self.skip + self.total), p.ready, p.layer_ready)

    def finish(self, block_ids: list[int] | None) -> None:
        if not block_ids or len(block_ids) - self.skip < self.total:
            have = len(block_ids or []) - self.skip
            self.fail(f"decode worker expects {self.total} blocks, prefill holds {have}")
            return
        self._hand(block_ids, self.skip + self.total, None)

    def _hand(self, block_ids: list[int], upto: int, ready, layers=None) -> None:
        start = self.skip + self.handed
        if upto > start and not self.stream.failed:
            self.stream.extend(block_ids[start:upto], ready, layers)
            self.handed = upto - self.skip
            self.parts += 1

    def fail(self, reason: str) -> None:
        if not self.stream.complete:
            self.stream.fail(reason)
