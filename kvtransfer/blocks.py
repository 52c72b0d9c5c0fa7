"""Block-id runs and raw byte views over a block-major KV cache.

Consecutive block ids are one contiguous region of the cache, so a transfer is cut into
"runs" (``first_block, count``) and each run moves as one copy / one socket write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    pos: int  # index of the run's first block within the transfer's block list
    start: int  # first block id in the cache
    count: int


def block_runs(ids: list[int]) -> list[Run]:
    """``[4, 5, 6, 9, 2, 3]`` -> runs (0, 4, 3), (3, 9, 1), (4, 2, 2)."""
    runs: list[Run] = []
    pos = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append(Run(pos, ids[pos], i - pos))
            pos = i
    return runs


def split_runs(runs: list[Run], max_blocks: int) -> list[Run]:
    """Cut runs so none is longer than ``max_blocks`` (bounds one write or one copy)."""
    out: list[Run] = []
    for run in runs:
        for off in range(0, run.count, max_blocks):
            out.append(Run(run.pos + off, run.start + off, min(max_blocks, run.count - off)))
    return out


def byte_view(cache: torch.Tensor) -> memoryview:
    """A writable, flat ``memoryview`` of the cache's bytes (no copy). CPU, contiguous."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        raise ValueError("byte views need a contiguous CPU tensor")
    return memoryview(cache.reshape(-1).view(torch.uint8).numpy())


def _rows(t: torch.Tensor):
    """``[n, block_bytes]`` uint8 numpy view of a contiguous CPU tensor, else None."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


def _copy_runs(dst: torch.Tensor, dst_ids: list[int] | None, src: torch.Tensor,
               src_ids: list[int] | None) -> None:
    """Copy block runs. On CPU through numpy (a plain single-threaded memcpy per run): torch's
    intra-op thread pool makes many ~1 MB copies far slower on a loaded 2-core host."""
    ids = dst_ids if dst_ids is not None else src_ids
    d, s = _rows(dst), _rows(src)
    for run in block_runs(ids):
        a, b = (run.start, run.pos) if dst_ids is not None else (run.pos, run.start)
        if d is not None and s is not None:
            d[a:a + run.count] = s[b:b + run.count]
        else:
            dst[a:a + run.count].copy_(src[b:b + run.count])


def gather(cache: torch.Tensor, ids: list[int], out: torch.Tensor) -> None:
    """``out[i] = cache[ids[i]]``, one copy per run of consecutive ids."""
    _copy_runs(out, None, cache, ids)


def scatter(cache: torch.Tensor, ids: list[int], src: torch.Tensor) -> None:
    """``cache[ids[i]] = src[i]``, one copy per run of consecutive ids."""
    _copy_runs(cache, ids, src, None)
