"""The one owner of physical KV blocks: free list, reference counts and the prefix cache.

Requests hold block ids only. A block whose reference count drops to zero goes to the back of
the free queue but keeps its hash and tokens: it can still be hit by a later request until it
is reused for something else (least recently freed first), at which point its hash is evicted.
Cache hits are confirmed by comparing the block's token ids, not the hash alone.

Events: every block hash that becomes cached is recorded as ``stored`` and every evicted one as
``removed``; a worker drains them (``drain_events``) into the global prefix index.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
import itertools
import logging

import numpy as np

from engine.sequence import Sequence
from pdcore.block_hash import BlockHasher

logger = logging.getLogger(__name__)
# _take_free_runs: how far past strict eviction order a multi-block allocation may look
RUN_WINDOW = 8  # times the blocks wanted
RUN_WINDOW_MAX = 4096  # blocks (bounds the host time)
RUN_MIN_BLOCKS = 16  # fewer are taken in eviction order (decode steps, short prompts)


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class BlockEvents:
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass
class CacheStats:
    num_blocks: int
    num_free: int
    num_cached_free: int
    prefix_queries_tokens: int
    prefix_hit_tokens: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hasher: BlockHasher | None,
                 enable_prefix_caching: bool = True, block_runs: bool = True):
        if num_blocks < 1:
            raise ValueError("need at least one KV block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        self.enable_prefix_caching = enable_prefix_caching and hasher is not None
        # block_runs False (kv_block_runs off): strict eviction order (the A/B of
        # _take_free_runs)
        self._runs = block_runs
        self.blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.events = BlockEvents()
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        # while a step launched ahead may still write KV (engine async_decode), freed blocks
        # wait here instead of entering the free pool: a new owner could fill them meanwhile
        # (a KV transfer lands on another stream) and the in-flight write would clobber it.
        # One list per step launched ahead (a generation): the frees made while that step
        # was the latest launched, released once it has been read
        self._held: deque[list[int]] = deque()

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that ``seq`` can hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def stats(self) -> CacheStats:
        cached_free = sum(1 for b in self.free if self.blocks[b].block_hash is not None)
        return CacheStats(self.num_blocks, len(self.free), cached_free,
                          self.prefix_queries_tokens, self.prefix_hit_tokens)

    # ------------------------------------------------------------ prefix cache
    def _update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        if self.hasher is None:
            return
        n_full = seq.num_tokens // self.block_size
        if len(seq.block_hashes) < n_full:
            start = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if start else None
            seq.block_hashes.extend(self.hasher.hash_blocks(seq.token_ids[:n_full * self.block_size],
                                                            start, parent))

    def _lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        bid = self.hash_to_block.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tokens:
            return None
        return bid

    def count_cached_prefix(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """How many leading tokens of ``token_ids`` are in the cache (no state change)."""
        bs = self.block_size
        n = 0
        for i, h in enumerate(block_hashes):
            if self._lookup(h, tuple(token_ids[i * bs:(i + 1) * bs])) is None:
                break
            n += 1
        return n * bs

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks of ``seq``'s longest cached prefix; returns tokens hit.

        At least one token is always left to compute (its logits give the next token)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        self._update_hashes(seq)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hit: list[int] = []
        for i in range(min(max_blocks, len(seq.block_hashes))):
            bid = self._lookup(seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if bid is None:
                break
            hit.append(bid)
        for bid in hit:
            self._ref(bid)
        seq.block_table.extend(hit)
        seq.num_computed_tokens = len(hit) * bs
        self.prefix_queries_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def fork_prefix(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give ``child`` (a new sequence over the same prompt) ``parent``'s first
        ``num_blocks`` blocks, full and computed, one more reference each: they count as its
        cached prefix (undone by :meth:`release_cached_prefix`, freed by :meth:`free_seq`)."""
        assert not child.block_table and child.num_computed_tokens == 0
        assert num_blocks * self.block_size < child.num_tokens
        if num_blocks == 0:
            return  # nothing to share: the scheduler looks the prompt up as for any other
        shared = parent.block_table[:num_blocks]
        for bid in shared:
            self._ref(bid)
        child.block_table.extend(shared)
        child.num_computed_tokens = len(shared) * self.block_size
        self.prefix_queries_tokens += child.num_tokens
        self.prefix_hit_tokens += child.num_computed_tokens

    def release_cached_prefix(self, seq: Sequence) -> None:
        """Undo :meth:`allocate_cached_prefix` (blocks and hit statistics) for a request that
        could not be scheduled after all: it must not hold blocks while it waits."""
        self.prefix_queries_tokens -= seq.num_tokens
        self.prefix_hit_tokens -= seq.num_computed_tokens
        self.free_seq(seq)
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every computed full block of ``seq`` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if n_full <= seq.num_hashed_blocks:
            return  # no block became full: nothing to look at (the common decode step)
        self._update_hashes(seq)
        start, seq.num_hashed_blocks = seq.num_hashed_blocks, n_full
        for i in range(start, n_full):
            blk = self.blocks[seq.block_table[i]]
            if blk.block_hash is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.hash_to_block:
                continue  # same content computed concurrently in another block; keep the first
            blk.block_hash = h
            blk.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.hash_to_block[h] = blk.block_id
            self.events.stored.append(h)

    # --------------------------------------------------------- allocate/free
    def _ref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.free[bid]
        blk.ref_count += 1

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        return self._claim(bid)

    def _take(self, bid: int) -> int:
        del self.free[bid]
        return self._claim(bid)

    def _claim(self, bid: int) -> int:
        blk = self.blocks[bid]
        if blk.block_hash is not None:  # evict its cached content
            if self.hash_to_block.get(blk.block_hash) == bid:
                del self.hash_to_block[blk.block_hash]
                self.events.removed.append(blk.block_hash)
            blk.block_hash = None
            blk.token_ids = None
        blk.ref_count = 1
        return bid

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens`` tokens.
        All or nothing: returns False (and changes nothing) when blocks are short."""
        need = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)
        if need > len(self.free):
            return False
        if need:  # most decode steps need none: every row of every step asks
            seq.block_table.extend(self._take_free_runs(need))
        return True

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Take ``n`` fresh blocks outside any sequence (e.g. a decode worker's pre-allocation)."""
        if n > len(self.free):
            return None
        return self._take_free_runs(n)

    def _take_free_runs(self, n: int) -> list[int]:
        """``n`` free blocks for one sequence (or pre-allocation), in ascending id order and
        in as few runs of consecutive ids as the oldest free blocks allow.

        A KV transfer costs one copy / message / descriptor per run that is contiguous in
        both caches (``kvtransfer.blocks.segments``), and each piece has a fixed cost, so a
        few long runs move much faster than many short ones. Taking blocks strictly in
        eviction order fragments a cache once it has been used through: every freed
        sequence goes back tail first and decode steps take blocks one at a time, so a long
        prompt's blocks come as runs of one or two. So ``n`` >= RUN_MIN_BLOCKS blocks come
        from the ``RUN_WINDOW * n`` least recently freed ones (at most RUN_WINDOW_MAX),
        whole runs of consecutive ids first, the longest first (ties: the older run).
        ``bench/kv_block_runs.py`` counts the pieces per transfer either way
        (docs/performance.md). The cost is eviction order within that window: a cached
        block there may go while an older one of a shorter run stays
        (``kv_block_runs`` off keeps strict order); and the window's ids are sorted
        on the host, a little more work than popping ``n`` blocks."""
        if not self._runs or n < RUN_MIN_BLOCKS or len(self.free) <= n:
            return sorted(self._take_free() for _ in range(n))
        k = min(len(self.free), max(n, min(RUN_WINDOW * n, RUN_WINDOW_MAX)))
        ids = np.fromiter(itertools.islice(self.free, k), dtype=np.int64, count=k)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.diff(sorted_ids, prepend=-2) != 1)  # run starts
        lengths = np.diff(np.append(starts, k))
        age = np.minimum.reduceat(order, starts)  # a run's oldest member's queue position
        pick = np.lexsort((age, -lengths))  # runs: the longest first, then the oldest
        total = np.cumsum(lengths[pick])
        m = int(np.searchsorted(total, n)) + 1  # the first m runs hold n blocks
        pick = pick[:m]
        take = lengths[pick].copy()
        take[-1] -= int(total[m - 1]) - n  # only the head of the last one
        firsts = sorted_ids[starts[pick]]
        # ids first..first+take-1 of each picked run, without a Python loop over runs
        offsets = np.arange(n) - np.repeat(np.cumsum(take) - take, take)
        chosen = (np.repeat(firsts, take) + offsets).tolist()
        chosen.sort()
        for bid in chosen:
            self._take(bid)
        return chosen

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Tail blocks are queued for eviction before head blocks,
        since a shared prefix is likelier to be hit again than a request's own tail."""
        if self._held:
            self._held[-1].extend(reversed(seq.block_table))
        else:
            for bid in reversed(seq.block_table):
                self._unref(bid)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def hold_frees(self) -> None:
        """A step was launched ahead: from now on, freed blocks are kept out of the free
        pool (in a new generation) until :meth:`release_held_frees` releases it."""
        self._held.append([])

    def release_held_frees(self, keep_latest: bool = False) -> None:
        """Return held blocks to the pool, in free order: every generation, or (with
        ``keep_latest``, while the latest step launched ahead is still unread) all but the
        latest one, whose blocks that step may still write."""
        while len(self._held) > (1 if keep_latest else 0):
            for bid in self._held.popleft():
                self._unref(bid)

    @property
    def held_blocks(self) -> list[int]:
        """Freed blocks not yet back in the pool (a step launched ahead may write them)."""
        return [bid for gen in self._held for bid in gen]

    def _unref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {bid}")
        blk.ref_count -= 1
        if blk.ref_count == 0:
            self.free[bid] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request uses (e.g. an operator's cache reset)."""
        for bid in self.free:
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                if self.hash_to_block.get(blk.block_hash) == bid:
                    del self.hash_to_block[blk.block_hash]
                    self.events.removed.append(blk.block_hash)
                blk.block_hash = None
                blk.token_ids = None

    def drain_events(self) -> BlockEvents:
        ev, self.events = self.events, BlockEvents()
        return ev
