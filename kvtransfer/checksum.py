"""Per-block checksums of KV data, so corrupted KV is never decoded.

The side that sends a transfer's blocks computes one checksum per block over the source
blocks and sends them with the data; the receiver computes the same over the destination
blocks once the data landed and fails the transfer (FAILED, naming the first bad block)
before counting it DONE when any differs. A block that arrives damaged, lands in the wrong
place, or is read before it was written is caught, whatever moved it.

Definition (the same on every device, so a CPU and a GPU side agree): a block's bytes are read
as little-endian integer words of the widest of 8 / 4 / 2 / 1 bytes that divides
``block_bytes``, cut into rows of ``C = gcd(words per block, 64)`` words, and::

    checksum = sum over rows r of (2r + 1) * (sum of the row's words)    (mod 2**64)

Integer sums wrap identically in any order, so the result is exact on CPU and GPU alike. Any
change confined to one row (a flipped bit or byte, a damaged word) is always detected (an odd
weight is invertible mod 2**64); a block swapped with another is detected unless both hold
equal data. It is not a cryptographic hash: it guards against accidents, not adversaries.

Cost: one read of the transferred bytes on each side (torch reductions on a CPU; on a GPU a
few kernels per run of consecutive blocks, or one Triton kernel for many scattered blocks),
queued on the caller's stream without a host sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.api import TransferError
from kvtransfer.blocks import block_runs, device_index
from kvtransfer.waits import wait_event

logger = logging.getLogger(__name__)

ROW_WORDS = 64
KERNEL_FROM_RUNS = 8  # a CUDA cache with more runs than this takes the one-kernel path
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_dtype(block_bytes: int) -> torch.dtype:
    """The word type of a layout's checksum: the widest dividing ``block_bytes``."""
    return next(dt for size, dt in _WORDS if block_bytes % size == 0)


def _words(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, words]`` view of a block-major cache (no copy when it is contiguous)."""
    flat = cache.reshape(-1).view(torch.uint8)
    block_bytes = flat.numel() // max(1, cache.shape[0])
    dt = word_dtype(block_bytes)
    if flat.data_ptr() % dt.itemsize:
        flat = flat.clone()  # a view of a misaligned tensor cannot change its element size
    return flat.view(dt).view(cache.shape[0], -1)


def _weights(rows: int, device: torch.device) -> torch.Tensor:
    """``2r + 1`` for each row, made on the current stream each time (a tensor cached on
    one stream could be read on another before its fill ran)."""
    return torch.arange(1, 2 * rows, 2, dtype=torch.int64, device=device)


def _rows(words_per_block: int) -> tuple[int, int]:
    cols = math.gcd(words_per_block, ROW_WORDS)
    return words_per_block // cols, cols


def block_checksums(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """One int64 checksum per block ``ids[i]`` of ``cache``, on the cache's device, queued on
    the current stream (nothing waits for it)."""
    words = _words(cache)
    rows, cols = _rows(words.shape[1])
    runs = block_runs(ids)
    if cache.is_cuda and len(runs) > KERNEL_FROM_RUNS:
        return kernel_checksums(words, ids, rows, cols)
    weights = _weights(rows, words.device)
    out = torch.empty(len(ids), dtype=torch.int64, device=words.device)
    for run in runs:
        part = words[run.start:run.start + run.count].view(run.count, rows, cols)
        row_sums = part.sum(-1, dtype=torch.int64)
        out[run.pos:run.pos + run.count] = (row_sums * weights).sum(-1)
    return out


def reference_checksums(data: bytes | np.ndarray, block_bytes: int) -> np.ndarray:
    """The definition, in numpy, over blocks laid out one after another in ``data``."""
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    size = torch.tensor([], dtype=word_dtype(block_bytes)).element_size()
    kind = {8: "<i8", 4: "<i4", 2: "<i2", 1: "u1"}[size]
    words = raw.view(kind).astype(np.int64).reshape(-1, block_bytes // size)
    rows, cols = _rows(words.shape[1])
    row_sums = words.reshape(len(words), rows, cols).sum(-1, dtype=np.int64)
    weights = np.arange(1, 2 * rows, 2, dtype=np.int64)
    with np.errstate(over="ignore"):
        return (row_sums * weights).sum(-1, dtype=np.int64)


# ------------------------------------------------------------------ one kernel for many runs
_kernel = None


def _checksum_kernel():
    """The Triton kernel, compiled on first use (only GPU caches with scattered blocks)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def row_weighted_sums(words, ids, partial, words_per_block, rows, n_chunks,
                              ROWS: tl.constexpr, COLS: tl.constexpr):
            # program (b, p): rows [p * ROWS, (p + 1) * ROWS) of block ids[b]; writes
            # sum_r (2r + 1) * rowsum_r of them to partial[b, p]
            b = tl.program_id(0)
            p = tl.program_id(1)
            block = tl.load(ids + b).to(tl.int64)
            r = p * ROWS + tl.arange(0, ROWS)
            c = tl.arange(0, COLS)
            mask = r[:, None] < rows
            offs = block * words_per_block + r[:, None] * COLS + c[None, :]
            x = tl.load(words + offs, mask=mask, other=0).to(tl.int64)
            row_sum = tl.sum(x, axis=1)
            weighted = row_sum * (2 * r.to(tl.int64) + 1)
            tl.store(partial + b * n_chunks + p, tl.sum(weighted, axis=0))

        _kernel = row_weighted_sums
    return _kernel


def kernel_checksums(words: torch.Tensor, ids: list[int], rows: int, cols: int,
                     rows_per_program: int = 64) -> torch.Tensor:
    """:func:`block_checksums` in one kernel launch for any number of scattered blocks
    (``words``: a cache's :func:`_words` view; reads only the blocks named)."""
    n_chunks = -(-rows // rows_per_program)
    idx = device_index(ids, words.device)  # no host sync, whatever the stream waits for
    partial = torch.empty(len(ids), n_chunks, dtype=torch.int64, device=words.device)
    _checksum_kernel()[(len(ids), n_chunks)](words, idx, partial, words.shape[1], rows,
                                             n_chunks, ROWS=rows_per_program, COLS=cols)
    return partial.sum(-1)


# ------------------------------------------------------------------ wire and verdict


def encode(sums: np.ndarray) -> bytes:
    """Checksums as they travel: little-endian int64, in transfer order."""
    return np.asarray(sums, dtype="<i8").tobytes()


def decode(data: bytes, count: int) -> np.ndarray:
    if len(data) != 8 * count:
        raise TransferError(f"checksum message of {len(data)} bytes for {count} blocks")
    return np.frombuffer(data, dtype="<i8")


def verify(expected: np.ndarray, got: np.ndarray, dst_ids: list[int]) -> None:
    """TransferError naming the first block whose checksum differs (and how many do)."""
    verify_flags(np.asarray(expected, dtype=np.int64) != np.asarray(got, dtype=np.int64),
                 dst_ids)


def verify_flags(mismatch: np.ndarray, dst_ids: list[int]) -> None:
    """:func:`verify` from per-block mismatch flags (compared on a device)."""
    bad = np.flatnonzero(mismatch)
    if len(bad):
        i = int(bad[0])
        raise TransferError(
            f"checksum mismatch: block {i} of {len(dst_ids)} (destination block {dst_ids[i]}) "
            f"and {len(bad) - 1} more arrived corrupted; the transfer is not used")


def note_fault(transfer_id: str, what: str) -> None:
    """Log that fault injection (``KVTransferOptions.corrupt_every``) damaged a transfer."""
    logger.warning("fault injection: transfer %s: flipped a byte of %s", transfer_id, what)


def corrupt_first_byte(cache: torch.Tensor, block: int, transfer_id: str) -> None:
    """Fault injection: flip the first byte of ``block`` of ``cache`` (a copy on its way, or
    a destination block that the receiver's checksums then reject). On a GPU it is queued on
    the current stream and waited for, so nothing writes there once this returns."""
    view = cache[block].reshape(-1).view(torch.uint8)
    view[0:1].bitwise_xor_(0xFF)
    if cache.is_cuda:
        torch.cuda.current_stream(cache.device).synchronize()
    note_fault(transfer_id, f"block {block} as it landed")


SMALL_ON_LOOP_BYTES = 4 << 20  # CPU checksums of more data than this run in a helper thread


async def host_checksums(cache: torch.Tensor, ids: list[int], stream=None, watch=None,
                         what: str = "the block checksums") -> np.ndarray:
    """:func:`block_checksums` on the host, without blocking the event loop: a CUDA cache's
    are computed on ``stream`` (default: the current one; it must be ordered after the
    writes of those blocks) and copied to pinned memory, awaited like any device work
    (``watch``: a control socket whose peer giving up ends the wait); a CPU cache's run in
    a helper thread when they cover much data."""
    if not cache.is_cuda:
        return await _gathered([_on_cpu(cache, ids)])
    with torch.cuda.device(cache.device), \
            (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        sums = block_checksums(cache, ids)
        host = torch.empty(len(ids), dtype=torch.int64, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    await wait_event(done, watch=watch, what=what)
    return host.numpy()


class SourceSums:
    """A sending side's checksums, part by part, started as each part is handed over (its
    blocks readable by then) so they overlap the data's way out: on a GPU queued on
    ``stream`` and copied to pinned memory, on a CPU computed in a helper thread (torch's
    reductions release the GIL). :meth:`collect` waits once, for all of them."""

    def __init__(self, cache: torch.Tensor, stream=None) -> None:
        self._cache = cache
        self._stream = stream
        self._cpu: list[asyncio.Future | np.ndarray] = []
        self._gpu: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def add(self, ids: list[int]) -> None:
        if not self._cache.is_cuda:
            self._cpu.append(_on_cpu(self._cache, ids))
            return
        with torch.cuda.device(self._cache.device), \
                (torch.cuda.stream(self._stream) if self._stream is not None
                 else contextlib.nullcontext()):
            host = torch.empty(len(ids), dtype=torch.int64, pin_memory=True)
            host.copy_(block_checksums(self._cache, ids), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._gpu.append((host, done))

    async def collect(self, watch=None) -> np.ndarray:
        """Every part's checksums, in transfer order."""
        if self._gpu:  # one stream: the last event completes after every earlier part
            await wait_event(self._gpu[-1][1], watch=watch, what="the block checksums")
            return np.concatenate([host.numpy() for host, _ in self._gpu])
        return await _gathered(self._cpu)


class LandingSums:
    """A CPU receiver's checksums of its destination blocks, computed in a helper thread
    stretch by stretch as the blocks land (in transfer order), so most of them overlap the
    rest of the data's arrival; :meth:`result` adds the last stretch and waits."""

    def __init__(self, cache: torch.Tensor, dst_ids: list[int]) -> None:
        self._cache = cache
        self._ids = dst_ids
        self._block_bytes = cache[0].numel() * cache.element_size()
        self._done = 0  # blocks handed to a computation so far
        self._parts: list[asyncio.Future | np.ndarray] = []

    def landed(self, blocks: int) -> None:
        """The first ``blocks`` destination blocks are in place."""
        if (blocks - self._done) * self._block_bytes >= SMALL_ON_LOOP_BYTES:
            self._parts.append(_on_cpu(self._cache, self._ids[self._done:blocks]))
            self._done = blocks

    async def result(self) -> np.ndarray:
        if self._done < len(self._ids):
            self._parts.append(_on_cpu(self._cache, self._ids[self._done:]))
            self._done = len(self._ids)
        return await _gathered(self._parts)


def _on_cpu(cache: torch.Tensor, ids: list[int]) -> asyncio.Future | np.ndarray:
    """A CPU cache's checksums: at once when they cover little data, else a future of a
    helper thread's."""
    if len(ids) * cache[0].numel() * cache.element_size() < SMALL_ON_LOOP_BYTES:
        return block_checksums(cache, ids).numpy()
    return asyncio.get_running_loop().run_in_executor(
        None, lambda: block_checksums(cache, ids).numpy())


async def _gathered(parts: list[asyncio.Future | np.ndarray]) -> np.ndarray:
    out = [await p if isinstance(p, asyncio.Future) else p for p in parts]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


async def send_checksums(loop: asyncio.AbstractEventLoop, sock, sums: np.ndarray) -> None:
    """Send a transfer's checksums (in transfer order) as a BLOB."""
    await loop.sock_sendall(sock, wire.encode_blob(encode(sums)))


async def check_arrived(loop: asyncio.AbstractEventLoop, conn, cache: torch.Tensor,
                        dst_ids: list[int], stream=None, landing: LandingSums | None = None
                        ) -> None:
    """Read the sender's checksum BLOB and verify the destination blocks against it
    (TransferError naming the first bad block); ``landing``: their checksums, already
    being computed as they landed."""
    expected = decode(await wire.read_blob(loop, conn), len(dst_ids))
    got = await landing.result() if landing is not None else \
        await host_checksums(cache, dst_ids, stream, watch=conn)
    verify(expected, got, dst_ids)
