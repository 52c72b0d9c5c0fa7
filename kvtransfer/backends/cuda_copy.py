"""Device-to-device copies of block runs: copy engines, or one kernel for many short runs.

A scattered transfer is one copy per run of blocks contiguous on both sides (up to one per
2 MiB block for Llama-3-8B). Each copy costs twice, whatever its size:

* Host: ``Tensor.copy_`` goes through Python, the dispatcher and the runtime;
  ``cuMemcpyDtoDAsync`` through ctypes (:func:`copy_runs`) is several times cheaper.
* Copy engine: a fixed cost per copy, whatever queued it, so many short copies run well
  below the rate of one contiguous copy, and more streams do not recover it.

Two ways around the per-copy cost: ONE ``cuMemcpyBatchAsync`` call for all runs (CUDA
12.8+ drivers; :func:`batch_copy_runs`), or ONE Triton kernel on the receiving GPU that
reads the peer's memory (:func:`kernel_copy_runs`; it takes SMs from the decode worker's own
kernels). :func:`copy_blocks` takes the batched copy engines where the driver has them, else
the kernel for short runs. bench/kv_copy_gpu.py measures all of them; the current figures
are in docs/performance.md.

Addresses are unified (UVA): a source mapped from another process (CUDA IPC) or living on
another GPU of this process is copied peer to peer by the driver. Where the driver library
cannot be loaded (no GPU build of the driver, tests on CPU), :func:`copy_runs` falls back to
``Tensor.copy_``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import numpy as np
import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_memcpy = None  # cuMemcpyDtoDAsync_v2, once loaded; False: unavailable


def _driver_memcpy():
    global _memcpy
    if _memcpy is None:
        with _lock:
            if _memcpy is None:
                try:
                    fn = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
                    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                   ctypes.c_void_p]
                    fn.restype = ctypes.c_int
                    _memcpy = fn
                except (OSError, AttributeError) as exc:
                    logger.info("CUDA driver copies unavailable (%s): using Tensor.copy_", exc)
                    _memcpy = False
    return _memcpy


KERNEL_BELOW_RUN_BYTES = 8 << 20  # copy_blocks: the kernel when runs average less
KERNEL_PROGRAMS = 32  # CTAs of the copy kernel: enough loads in flight to fill NVLink


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
                stream: torch.cuda.Stream, kernel_below: int = KERNEL_BELOW_RUN_BYTES,
                batch: bool = True, driver: bool = True) -> str:
    """Queue the copies of ``runs`` (see :func:`copy_runs`) the fastest way. Several runs go
    to the copy engines in ONE batched call where the driver has one
    (:func:`batch_copy_runs`; ``batch=False`` turns it off). Without it, runs averaging
    under ``kernel_below`` bytes (0: never) take one kernel launch when ``src`` is mapped
    into ``dst``'s device (a CUDA IPC mapping; another GPU's tensor of this process may not
    be addressable by kernels), else one copy-engine call per run (``driver``: see
    :func:`copy_runs`). Returns which ("batch", "kernel", "copy_engine")."""
    if len(runs) > 1 and batch and batch_copy_runs(dst, src, runs, stream):
        return "batch"
    bb = dst.stride(0)
    blocks = sum(n for _, _, n in runs)
    if (kernel_below > 0 and runs and blocks * bb < kernel_below * len(runs)
            and dst.is_cuda and src.device == dst.device and _tile_bytes(bb, src, dst)):
        kernel_copy_runs(dst, src, runs, stream)
        return "kernel"
    copy_runs(dst, src, runs, stream, driver)
    return "copy_engine"


def _tile_bytes(bb: int, *tensors: torch.Tensor, most: int = 32768, least: int = 1024) -> int:
    """The largest power-of-two tile (``least``..``most`` bytes) that divides a block, 0 if
    none does or a tensor is not 16-byte aligned."""
    if any(t.data_ptr() % 16 for t in tensors):
        return 0
    tile = most
    while tile >= least:
        if bb % tile == 0:
            return tile
        tile //= 2
    return 0


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
              stream: torch.cuda.Stream, driver: bool = True) -> None:
    """Queue ``dst[d:d+n] = src[s:s+n]`` for each ``(s, d, n)`` of ``runs`` on ``stream``
    (``dst`` / ``src``: contiguous ``[num_blocks, block_bytes]`` uint8 views of two caches,
    ``dst`` on the stream's device). Asynchronous, like ``copy_(non_blocking=True)``; the
    caller keeps both tensors alive until the stream passed the copies. One
    ``cuMemcpyDtoDAsync`` call per run where the driver library loads (``driver=False``:
    ``Tensor.copy_`` instead)."""
    fn = driver and _driver_memcpy()
    if not (fn and dst.is_cuda and src.is_cuda):
        _torch_copy(dst, src, runs, stream)
        return
    bb = dst.stride(0)
    if src.stride(0) != bb:
        raise ValueError(f"block sizes differ: {src.stride(0)} vs {bb} bytes")
    d0, s0, handle = dst.data_ptr(), src.data_ptr(), stream.cuda_stream
    with torch.cuda.device(dst.device):  # the stream's context is this thread's current one
        for i, (s, d, n) in enumerate(runs):
            rc = fn(d0 + d * bb, s0 + s * bb, n * bb, handle)
            if rc != 0:  # e.g. no current context on this thread yet: torch's copies work
                _warn_once(rc)
                _torch_copy(dst, src, runs[i:], stream)
                return


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA 12.8+)
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1
_batch = None  # (function, takes failIdx) once looked up; False: unavailable


def _driver_batch():
    """``cuMemcpyBatchAsync``: CUDA 13 drivers export the 8-argument form as ``_v2``; 12.8-12.9
    ones the 9-argument form (with ``failIdx``) under the plain name."""
    global _batch
    if _batch is None:
        with _lock:
            if _batch is None:
                _batch = False
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError:
                    return _batch
                for name, fail_idx in (("cuMemcpyBatchAsync_v2", False),
                                       ("cuMemcpyBatchAsync", True)):
                    fn = getattr(lib, name, None)
                    if fn is not None:
                        fn.restype = ctypes.c_int
                        _batch = (fn, fail_idx)
                        break
    return _batch


def batch_copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
                    stream: torch.cuda.Stream) -> bool:
    """Like :func:`copy_runs`, with ONE ``cuMemcpyBatchAsync`` call for all runs (the driver
    may spread them over its copy engines). False when the driver has no batch call or
    refused it (nothing was queued then)."""
    found = _driver_batch()
    if not (found and runs and dst.is_cuda and src.is_cuda):
        return False
    fn, fail_idx = found
    n = len(runs)
    # the three address arrays through numpy: built element by element (a torch call per
    # data_ptr(), ctypes arrays from Python ints) they cost several times the host time
    r = np.array(runs, dtype=np.uint64).reshape(n, 3) * np.uint64(dst.stride(0))
    srcs = np.ascontiguousarray(r[:, 0] + np.uint64(src.data_ptr()))
    dsts = np.ascontiguousarray(r[:, 1] + np.uint64(dst.data_ptr()))
    sizes = np.ascontiguousarray(r[:, 2])
    attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, 1, src.device.index, 1,
                              dst.device.index, 0)
    idx = (ctypes.c_size_t * 1)(0)
    args = [ctypes.c_void_p(dsts.ctypes.data), ctypes.c_void_p(srcs.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data), ctypes.c_size_t(n), ctypes.byref(attrs), idx,
            ctypes.c_size_t(1)]
    if fail_idx:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    args.append(ctypes.c_void_p(stream.cuda_stream))
    with torch.cuda.device(dst.device):
        rc = fn(*args)
    if rc != 0 and not _batch_refused:
        _batch_refused.append(rc)  # said once: the caller falls back to the other copies
        logger.warning("cuMemcpyBatchAsync returned CUDA error %d: copying otherwise", rc)
    return rc == 0


_batch_refused: list[int] = []


_warned = False


def _warn_once(rc: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("cuMemcpyDtoDAsync returned CUDA error %d: copying with Tensor.copy_",
                       rc)


def _torch_copy(dst, src, runs, stream) -> None:
    with torch.cuda.stream(stream) if dst.is_cuda else contextlib.nullcontext():
        for s, d, n in runs:
            dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


# ------------------------------------------------------------------ SM copies (one launch)
_kernel = None


def _gather_kernel():
    """The Triton kernel, compiled on first use (kvtransfer needs no Triton otherwise)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather_blocks(src, dst, pairs, n_tiles, BLOCK_ELEMS: tl.constexpr,
                          TILE: tl.constexpr):
            # src / dst: caches as int64 elements; pairs: [n, 2] (src block, dst block).
            # Each program walks tiles pid, pid + nprog, ...: a few programs per SM keep
            # enough loads in flight to fill the link.
            tiles_per_block: tl.constexpr = BLOCK_ELEMS // TILE
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            offs = tl.arange(0, TILE)
            for t in range(pid, n_tiles, nprog):
                b = t // tiles_per_block
                c = t % tiles_per_block
                s = tl.load(pairs + 2 * b).to(tl.int64)
                d = tl.load(pairs + 2 * b + 1).to(tl.int64)
                x = tl.load(src + s * BLOCK_ELEMS + c * TILE + offs)
                tl.store(dst + d * BLOCK_ELEMS + c * TILE + offs, x)

        _kernel = gather_blocks
    return _kernel


def kernel_copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
                     stream: torch.cuda.Stream | None, programs: int = KERNEL_PROGRAMS,
                     tile_bytes: int | None = None, num_warps: int = 8,
                     device: torch.device | None = None) -> None:
    """Like :func:`copy_runs`, in ONE kernel launch on ``dst``'s GPU that reads ``src``
    directly (a CUDA IPC mapping, or a peer GPU's memory once peer access is enabled):
    no per-run cost, but ``programs`` CTAs take SMs while it runs. ``tile_bytes`` (default:
    the largest power of two up to 32 KiB dividing a block) must divide a block.
    ``device``: the GPU the kernel runs on (default ``dst``'s; ``src``'s pushes the data
    into a peer, which then must be addressable from there); ``stream`` must be on it."""
    bb = dst.stride(0)
    tile_bytes = tile_bytes or _tile_bytes(bb, src, dst)
    if src.stride(0) != bb or not tile_bytes or bb % tile_bytes or tile_bytes % 8:
        raise ValueError(f"blocks of {bb} B cannot be cut into {tile_bytes} B tiles")
    pairs = [(s + k, d + k) for s, d, n in runs for k in range(n)]
    if not pairs:
        return
    n_tiles = len(pairs) * (bb // tile_bytes)
    grid = (max(1, min(programs, n_tiles)),)
    device = device or dst.device
    ctx = torch.cuda.stream(stream) if stream is not None and device.type == "cuda" \
        else contextlib.nullcontext()
    with ctx:  # the ids travel on the copy's stream: ordered before the kernel reads them
        idx = torch.tensor(pairs, dtype=torch.int32).to(device, non_blocking=True)
        _gather_kernel()[grid](src.view(torch.int64), dst.view(torch.int64), idx, n_tiles,
                               BLOCK_ELEMS=bb // 8, TILE=tile_bytes // 8, num_warps=num_warps)


def enable_peer_access(device: int, peer: int) -> None:
    """Let ``device``'s context address ``peer``'s memory from kernels (copies need no
    such thing; a CUDA IPC mapping comes with it). For tests and benchmarks in one process."""
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), peer) != 0:
        raise RuntimeError(f"no primary context on GPU {peer}")
    with torch.cuda.device(device):
        torch.cuda.current_stream().synchronize()  # the device's context current here
        rc = lib.cuCtxEnablePeerAccess(ctx, 0)
    if rc not in (0, 704):  # 704: already enabled
        raise RuntimeError(f"cuCtxEnablePeerAccess failed with CUDA error {rc}")
