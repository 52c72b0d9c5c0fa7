"""How to move a 4096-token prompt's KV blocks from one GPU to another of the same host,
when its blocks are scattered: copy engines (one cuMemcpyDtoDAsync per run of blocks; ONE
cuMemcpyBatchAsync call for all runs, CUDA 12.8+, what cuda_ipc does now) against one
Triton kernel on the receiving GPU reading the peer's memory
(kvtransfer.backends.cuda_copy.kernel_copy_runs, "pull") with various numbers of programs
(CTAs), the same kernel on the SENDING GPU writing into the peer ("push"), and both engines
at once (``split_kNN``: NN% of the blocks by the pulling kernel, the rest by batched copy
engine copies on a second stream).

In one process: src cache on cuda:0, dst cache on cuda:1 (peer access enabled, as a CUDA IPC
mapping is), 256 blocks x 2 MiB (Llama-3-8B, 16-token blocks). GB/s = payload / GPU time
between events around the copies on the receiving GPU's stream, median of --reps.

    python3 -m bench.kv_copy_gpu --set h200-mycommit                (2 GPUs, ~1 min)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from kvtransfer.backends.cuda_copy import (batch_copy_runs, copy_runs, enable_peer_access,
                                           kernel_copy_runs)
from kvtransfer.blocks import segments
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure(f"{pattern}, {method}", "GB/s", ("results", pattern, method, "median_gbps"))
    for pattern, method in (("scattered", "copy_engine"), ("scattered", "copy_engine_batch"),
                            ("scattered", "kernel_p32_t32k"), ("contiguous", "copy_engine"))]


def cut_runs(runs: list[tuple[int, int, int]],
             first: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """``runs`` cut after their first ``first`` blocks (a run is split where the cut falls).

    ``cut_runs([(0, 10, 4), (8, 20, 2)], 3)`` -> ``([(0, 10, 3)], [(3, 13, 1), (8, 20, 2)])``.
    """
    head: list[tuple[int, int, int]] = []
    tail: list[tuple[int, int, int]] = []
    left = max(0, first)
    for s, d, n in runs:
        take = min(n, left)
        if take:
            head.append((s, d, take))
        if n > take:
            tail.append((s + take, d + take, n - take))
        left -= take
    return head, tail


def split_copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
                    stream: torch.cuda.Stream, side: torch.cuda.Stream,
                    kernel_share: float) -> None:
    """Queue ``runs`` on two engines at once: the first ``kernel_share`` of the blocks by the
    copy kernel on ``stream``, the rest by the copy engines (one batched call where the
    driver has it) on ``side``, which ``stream`` then waits for. Each engine alone is
    limited below the link's rate (the kernel by its reads in flight, the copy engines by
    a per-copy cost), so together they move more."""
    total = sum(n for _, _, n in runs)
    head, tail = cut_runs(runs, round(total * kernel_share))
    with torch.cuda.device(dst.device):
        start = torch.cuda.Event()
        start.record(stream)
        if tail:
            side.wait_event(start)
            if not batch_copy_runs(dst, src, tail, side):
                copy_runs(dst, src, tail, side)
        if head:
            kernel_copy_runs(dst, src, head, stream)
        if tail:
            joined = torch.cuda.Event()
            joined.record(side)
            stream.wait_event(joined)


def _push(dst, src, runs, stream, push_stream, programs) -> None:
    """The copy kernel launched on the SOURCE GPU, writing into the peer; the receiving
    stream waits for it (so the events on ``stream`` time it)."""
    with torch.cuda.device("cuda:1"):
        start = torch.cuda.Event()
        start.record(stream)
    with torch.cuda.device("cuda:0"):
        push_stream.wait_event(start)
        kernel_copy_runs(dst, src, runs, push_stream, programs=programs, tile_bytes=32768,
                         device=src.device)
        done = torch.cuda.Event()
        done.record(push_stream)
    stream.wait_event(done)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python3 -m bench.kv_copy_gpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=2 << 20)
    p.add_argument("--cache-blocks", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--programs", default="16,32,66,132,264,528")
    p.add_argument("--tiles", default="32768,65536")
    p.add_argument("--push-programs", default="32,132,264")
    p.add_argument("--kernel-shares", default="0.25,0.4,0.5,0.6")
    harness.add_output_args(p, "kv_copy_gpu")
    a = p.parse_args(argv)
    rec = harness.Recorder.start("kv_copy_gpu", a, argv=argv, about=__doc__, figures=FIGURES)
    src = torch.randint(0, 255, (a.cache_blocks, a.block_bytes), dtype=torch.uint8,
                        device="cuda:0")
    dst = torch.zeros((a.cache_blocks, a.block_bytes), dtype=torch.uint8, device="cuda:1")
    enable_peer_access(1, 0)  # as a CUDA IPC mapping is
    enable_peer_access(0, 1)  # the push kernel runs on cuda:0 and writes cuda:1
    torch.cuda.synchronize("cuda:0")
    rng = random.Random(0)
    patterns = {
        "contiguous": (list(range(a.blocks)), list(range(a.blocks))),
        "scattered": (rng.sample(range(a.cache_blocks), a.blocks),
                      rng.sample(range(a.cache_blocks), a.blocks)),
    }
    stream = torch.cuda.Stream("cuda:1")
    payload = a.blocks * a.block_bytes
    methods = {"copy_engine": lambda runs: copy_runs(dst, src, runs, stream)}
    side = torch.cuda.Stream("cuda:1")
    def batch(runs):
        if not batch_copy_runs(dst, src, runs, stream):
            raise RuntimeError("cuMemcpyBatchAsync unavailable or refused")
    methods["copy_engine_batch"] = batch
    for share in (float(x) for x in a.kernel_shares.split(",") if x):
        methods[f"split_k{round(share * 100)}"] = (
            lambda runs, share=share: split_copy_runs(dst, src, runs, stream, side, share))
    push_stream = torch.cuda.Stream("cuda:0")
    for prog in (int(x) for x in a.push_programs.split(",") if x):
        methods[f"push_p{prog}_t32k"] = (
            lambda runs, prog=prog: _push(dst, src, runs, stream, push_stream, prog))
    for tile in (int(t) for t in a.tiles.split(",")):
        for prog in (int(x) for x in a.programs.split(",")):
            methods[f"kernel_p{prog}_t{tile // 1024}k"] = (
                lambda runs, prog=prog, tile=tile: kernel_copy_runs(
                    dst, src, runs, stream, programs=prog, tile_bytes=tile))
    results: dict = {}
    for pname, (s_ids, d_ids) in patterns.items():
        runs = segments(s_ids, d_ids)
        want = src[s_ids].to("cuda:1")
        for mname, fn in methods.items():
            try:
                fn(runs)
            except RuntimeError as exc:
                print(f"{pname:10s} {mname:22s} skipped: {exc}", flush=True)
                continue
            dst.zero_()
            torch.cuda.synchronize("cuda:1")
            times, host = [], []
            for rep in range(a.reps + 2):
                with torch.cuda.device("cuda:1"):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    e0.record(stream)
                    t0 = time.perf_counter()
                    fn(runs)
                    host.append(time.perf_counter() - t0)
                    e1.record(stream)
                e1.synchronize()
                if rep >= 2:
                    times.append(e0.elapsed_time(e1) / 1000)
            ok = torch.equal(dst[d_ids], want)
            gbps = payload / statistics.median(times) / 1e9
            results.setdefault(pname, {})[mname] = {
                "median_gbps": round(gbps, 1), "max_gbps": round(payload / min(times) / 1e9, 1),
                "host_ms_median": round(statistics.median(host[2:]) * 1e3, 3),
                "runs": len(runs), "data_verified": ok}
            print(f"{pname:10s} {mname:22s} {gbps:7.1f} GB/s  host "
                  f"{statistics.median(host[2:]) * 1e3:6.3f} ms  runs {len(runs)}  ok={ok}",
                  flush=True)
    rec["payload_bytes"] = payload
    rec["devices"] = [torch.cuda.get_device_name(i) for i in (0, 1)]
    rec["results"] = results
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
