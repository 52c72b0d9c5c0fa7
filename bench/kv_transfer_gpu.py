"""KV transfer throughput between two GPUs of one host (issue 5): nccl, cuda_ipc, nixl.

The KV of one 4096-token prompt of Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16,
16-token blocks: 256 blocks x 2 MiB = 512 MiB), sent by this process from cuda:0 to a
receiver process on cuda:1, through each backend's real sender / receiver. Same method as
bench/kv_transfer_cpu.py (whose driver this reuses): GB/s = payload / sender ``send()`` time
(control connection, handshake, data, receiver's ack), median of ``--runs``; patterns
``contiguous`` (one run of blocks on both sides), ``scattered`` (random block ids on both
sides: up to 256 separate messages) and ``runs<k>`` (k runs at random places on each side:
``runs8`` is what the engine's allocator hands out in a used-through cache, see
bench/kv_block_runs.py); the receiver checks every landed block's contents.
``first_transfer_s`` is the first transfer to the peer (NCCL: communicator creation).
Modes ``ahead`` / ``two_parts`` send through a BlockStream as the prefill worker does: the
handshake happens first, then all blocks (or half, 20 ms, the rest) are handed over; their
GB/s is over the time after the last hand-over, i.e. what a transfer adds to TTFT.
The ceiling is one contiguous cuda:0 -> cuda:1 copy of the same payload in one process.

    python3 -m bench.kv_transfer_gpu --set h200-mycommit          (2 GPUs, ~2 min)
"""

from __future__ import annotations

import importlib.util
import os
import sys

from bench import kv_transfer_cpu as driver
from pdserve.benchlib import harness

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

GPU_DEFAULTS = ["--backends", "nccl,cuda_ipc,nixl", "--layers", "32", "--kv-heads", "8",
                "--head-dim", "128", "--dtype", "bfloat16", "--src-device", "cuda:0",
                "--dst-device", "cuda:1", "--runs", "10", "--warmup", "2",
                "--modes", "send,ahead,two_parts",
                "--patterns", "contiguous,runs8,runs24,scattered"]


FIGURES = [
    harness.Figure(f"{backend}, {pattern} blocks, data movement", "GB/s",
                   ("results", backend, pattern, "data_median_gbps"))
    for backend in ("nccl", "cuda_ipc", "nixl") for pattern in ("runs8", "scattered")
] + [harness.Figure(f"{backend}, contiguous, one send end to end", "GB/s",
                    ("results", backend, "contiguous", "median_gbps"))
     for backend in ("nccl", "cuda_ipc", "nixl")] + [
    harness.Figure("in-process cuda:0 -> cuda:1 copy (ceiling)", "GB/s", ("copy_ceiling_gbps",))]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = driver.parse_args(GPU_DEFAULTS + argv, benchmark="kv_transfer_gpu")
    if args.role == "sender" and "nixl" in args.backends.split(",") and \
            importlib.util.find_spec("nixl_cu13") is None:
        print("nixl_cu13 not importable: skipping the nixl backend", flush=True)
        args.backends = ",".join(b for b in args.backends.split(",") if b != "nixl")
    driver.log_timelines(args.role)
    driver.run_on_service_loop(driver.main(args, "kv_transfer_gpu", FIGURES, argv=argv))


if __name__ == "__main__":
    main()
