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


def segments(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Cut a transfer into ``(src_start, dst_start, count)`` pieces that are contiguous on BOTH
    sides (block-major caches: one piece is one region of ``count`` blocks in each cache).

    ``segments([4, 5, 6, 9], [0, 1, 7, 8])`` -> ``[(4, 0, 2), (6, 7, 1), (9, 8, 1)]``.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
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


def layer_groups(num_layers: int, per_group: int) -> list[tuple[int, int]]:
    """``[(0, 4), (4, 8), ...]``: layers cut into groups of ``per_group`` (the last may be
    shorter), the unit a layer-by-layer sender moves as one message."""
    if per_group <= 0:
        raise ValueError(f"layers per group must be positive, got {per_group}")
    return [(lo, min(lo + per_group, num_layers)) for lo in range(0, num_layers, per_group)]


def check_layer_groups(groups, num_layers: int) -> list[tuple[int, int]]:
    """Validate a peer's layer groups: ``[lo, hi)`` pairs covering ``0..num_layers`` in
    order, each layer once (ValueError otherwise)."""
    out, expect = [], 0
    for group in groups:
        lo, hi = (int(x) for x in group)
        if lo != expect or hi <= lo or hi > num_layers:
            raise ValueError(f"layer groups {list(groups)[:8]} do not cover 0..{num_layers}")
        out.append((lo, hi))
        expect = hi
    if expect != num_layers:
        raise ValueError(f"layer groups {list(groups)[:8]} do not cover 0..{num_layers}")
    return out


def _by_layer(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, num_layers, per_layer]`` view of a block-major cache (no copy), in the
    widest integer type that divides a layer of a block: torch's index kernels move one
    element per thread, so 8-byte elements move bf16 KV in a quarter of the steps."""
    return _widest(cache).view(cache.shape[0], cache.shape[1], -1)


def _widest(cache: torch.Tensor) -> torch.Tensor:
    """A block-major cache's bytes, flat, as int64 / int32 / int16 / uint8: the widest type
    whose size divides one layer of one block and the cache's address."""
    flat = cache.reshape(-1).view(torch.uint8)
    unit = flat.numel() // max(1, cache.shape[0] * cache.shape[1])
    for dt in (torch.int64, torch.int32, torch.int16):
        if unit % dt.itemsize == 0 and flat.data_ptr() % dt.itemsize == 0:
            return flat.view(dt)
    return flat


def device_index(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``, copied on the CURRENT stream without the
    host waiting: a plain ``torch.tensor(ids, device=...)`` synchronizes that stream, and
    on a transfer stream whose earlier messages wait for a prefill's forward pass that
    would block the worker's event loop for as long (pinned host memory makes the copy
    asynchronous; torch keeps the pinned block until the copy has run)."""
    host = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_layers(cache: torch.Tensor, idx: torch.Tensor, lo: int, hi: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Layers ``[lo, hi)`` of blocks ``idx`` (an index tensor on the cache's device) as one
    contiguous tensor ``[len(idx), hi - lo, per_layer]``: one gather kernel, so a layer
    group of scattered blocks travels as one message. Its elements are of
    :func:`_by_layer`'s integer type (the bytes are the cache's). ``out``: a contiguous
    buffer with room for it (its first bytes are used), else a new tensor."""
    src = _by_layer(cache)[:, lo:hi]
    if out is None:
        return src.index_select(0, idx)
    view = staging_view(_as(out, src.dtype), len(idx), hi - lo, src.shape[-1])
    torch.index_select(src, 0, idx, out=view)
    return view


def _as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous buffer's bytes, flat, as ``dtype``."""
    return buf.reshape(-1).view(torch.uint8).view(dtype)


def staging_view(buf: torch.Tensor, num_blocks: int, num_layers: int,
                 per_layer: int) -> torch.Tensor:
    """The first ``num_blocks * num_layers * per_layer`` elements of a flat buffer as
    ``[num_blocks, num_layers, per_layer]`` (ValueError when it is too small)."""
    n = num_blocks * num_layers * per_layer
    if buf.numel() < n:
        raise ValueError(f"staging buffer of {buf.numel()} elements, {n} needed")
    return buf.reshape(-1)[:n].view(num_blocks, num_layers, per_layer)


def pack_groups(num_layers: int, part_bytes: int, message_bytes: int) -> list[tuple[int, int]]:
    """Layer groups for moving a part of ``part_bytes`` (all layers) in messages of about
    ``message_bytes``: whole layers per message, at least one, at most all of them."""
    per_layer = max(1, part_bytes // num_layers)
    return layer_groups(num_layers, max(1, min(num_layers, message_bytes // per_layer)))


def scatter_layers(cache: torch.Tensor, idx: torch.Tensor, lo: int, hi: int,
                   src: torch.Tensor) -> None:
    """Inverse of :func:`gather_layers`: write ``src`` (a contiguous tensor holding those
    layers' bytes, of any dtype) into layers ``[lo, hi)`` of blocks ``idx`` (one kernel)."""
    dst = _by_layer(cache)[:, lo:hi]
    dst.index_copy_(0, idx, _as(src, dst.dtype).view(len(idx), hi - lo, -1))
