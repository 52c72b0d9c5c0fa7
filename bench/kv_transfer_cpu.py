"""KV transfer throughput on one CPU host: tcp and shm between two real processes.

The parent process is the sender (prefill side); it starts one receiver process (decode side)
per backend and drives it over stdin/stdout lines: ``expect <tid> <pattern>`` -> ``ready``,
then the parent sends and the child prints the receiver's result as JSON. Throughput is the
payload over the sender's ``send()`` time (connect to ack: the data is in the receiver's
cache), median of ``--runs`` runs after ``--warmup`` runs. Two block patterns: ``contiguous``
(blocks 0..n-1 on both sides), ``scattered`` (random, distinct ids on both sides) and
``runs<k>`` (k runs of consecutive ids at random places on each side). Both
processes run their event loop as the workers do (uvloop where installed).

    python3 -m bench.kv_transfer_cpu --set cpu-mybox
    python3 -m bench.kv_transfer_cpu --tokens 256 --runs 3 --out /tmp/kv.json   (quick)
    python3 -m bench.kv_transfer_cpu --backends tcp --tls ...    (tcp inside mutual TLS)

``--tls``: both sides get a cluster identity (a throw-away CA, a prefill certificate for the
sender, a decode one for the receiver), so the control connection and tcp's data run over
mutual TLS as in a default deployment (kvtransfer/secure.py); shm has no TCP connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from kvtransfer import KVLayout, make_receiver, make_sender
from kvtransfer.registry import options_from_env
from kvtransfer.stream import BlockStream
from pdserve.benchlib import harness
from pdcore.config_tree import environ
from services.grpc_server import run as run_on_service_loop  # uvloop, as the workers

FIGURES = [
    harness.Figure("tcp, contiguous blocks, one send", "GB/s",
                   ("results", "tcp", "contiguous", "median_gbps")),
    harness.Figure("shm, contiguous blocks, one send", "GB/s",
                   ("results", "shm", "contiguous", "median_gbps")),
    harness.Figure("tcp, scattered blocks", "GB/s", ("results", "tcp", "scattered", "median_gbps")),
    harness.Figure("shm, scattered blocks", "GB/s", ("results", "shm", "scattered", "median_gbps")),
]


def parse_args(argv: list[str] | None = None,
               benchmark: str = "kv_transfer_cpu") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python3 -m bench.{benchmark}",
                                description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="tcp,shm")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=30)  # SmolLM2-135M
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--shm-chunk-mb", type=float, default=None, help="shm sender chunk_bytes")
    p.add_argument("--shm-slots", type=int, default=None, help="shm sender num_slots")
    p.add_argument("--patterns", default="contiguous,scattered")
    p.add_argument("--modes", default="send",
                   help="comma list: send (a list of ids: connect..ack), ahead (a BlockStream: "
                        "handshake first, then all blocks; GB/s over the time after the blocks "
                        "were handed over), two_parts (half the blocks, a 20 ms pause standing "
                        "in for the last prefill chunk, then the rest; reports the tail)")
    harness.add_output_args(p, benchmark)
    p.add_argument("--src-device", default="cpu", help="sender cache device (e.g. cuda:0)")
    p.add_argument("--dst-device", default="cpu", help="receiver cache device (e.g. cuda:1)")
    p.add_argument("--tls", action="store_true", help="mutual TLS between the two processes")
    p.add_argument("--tls-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", default="sender", choices=["sender", "receiver"])
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (every thread) or of process ``pid``."""
    if pid is None:
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_tls(shared, directory: str | None, role: str):
    """``shared`` with the identity of ``role`` from ``directory`` (None: unchanged)."""
    if not directory:
        return shared
    import dataclasses
    from services.tls import ClusterTls
    return dataclasses.replace(shared, tls=ClusterTls(
        os.path.join(directory, "ca.crt"), os.path.join(directory, f"{role}.crt"),
        os.path.join(directory, f"{role}.key")))


def layout_of(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, args.dtype)


def block_ids(pattern: str, n: int, num_blocks: int, seed: int) -> list[int]:
    """``contiguous``: blocks 0..n-1; ``scattered``: n random distinct ids; ``runs<k>``: k
    runs of consecutive ids (lengths within 1 of each other), each at a random place (what a
    used-through cache hands out: bench/kv_block_runs.py, ~8 runs for a 4096-token prompt)."""
    if pattern == "contiguous":
        return list(range(n))
    rng = random.Random(seed)
    if pattern.startswith("runs"):
        k = int(pattern[4:])
        lengths = [n // k + (1 if i < n % k else 0) for i in range(k)]
        slots = num_blocks // (n // k + 1)  # places that fit the longest run
        if not 1 <= k <= n or slots < k:
            raise ValueError(f"{pattern}: cannot place {k} runs of {n} blocks in {num_blocks}")
        ids: list[int] = []
        for length, slot in zip(lengths, rng.sample(range(slots), k)):
            start = slot * (n // k + 1)
            ids.extend(range(start, start + length))
        return ids
    return rng.sample(range(num_blocks), n)


async def receiver_main(args: argparse.Namespace) -> None:
    layout = layout_of(args)
    n = -(-args.tokens // args.block_size)
    cache = torch.zeros(2 * n, *layout.block_shape, dtype=layout.torch_dtype,
                        device=args.dst_device)
    shared, opts = options_from_env(environ())  # PDSERVE_* sweeps (bench/gpu_suite.sh)
    shared = with_tls(shared, args.tls_dir, "decode")
    rx = make_receiver(args.backend, cache, layout, opts[args.backend], shared=shared)
    await rx.start()
    print(rx.endpoint, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        _, tid, pattern, seed = line.split()
        handle = rx.expect(tid, block_ids(pattern, n, 2 * n, int(seed) + 1), timeout_s=60)
        print("ready", flush=True)
        res = await handle.wait()
        # every source block b holds the value b % 200: check what landed where
        dst_ids = block_ids(pattern, n, 2 * n, int(seed) + 1)
        want = torch.tensor(block_ids(pattern, n, 2 * n, int(seed)), device=cache.device) % 200
        got = cache[dst_ids].reshape(len(dst_ids), -1)
        ok = bool((got == want[:, None].to(got.dtype)).all()) if res.ok else False
        cache[dst_ids] = 0
        print(json.dumps({"state": res.state.value, "num_bytes": res.num_bytes,
                          "error": res.error, "verified": ok}), flush=True)
    await rx.close()


async def bench_backend(args: argparse.Namespace, backend: str) -> dict:
    layout = layout_of(args)
    n = -(-args.tokens // args.block_size)
    src = (torch.arange(2 * n, device=args.src_device) % 200).to(layout.torch_dtype)
    src = src.view(-1, *([1] * len(layout.block_shape))).expand(
        2 * n, *layout.block_shape).contiguous()
    opts = {}
    if backend == "shm" and args.shm_chunk_mb:
        opts["chunk_bytes"] = int(args.shm_chunk_mb * 2**20)
    if backend == "shm" and args.shm_slots:
        opts["num_slots"] = args.shm_slots
    shared, env_opts = options_from_env(environ())  # PDSERVE_* sweeps (bench/gpu_suite.sh)
    tls_dir = None
    if args.tls:
        import tempfile
        from services.tls import write_cluster_files
        tls_dir = write_cluster_files(tempfile.mkdtemp(prefix="kvbench-tls-")).directory
    shared = with_tls(shared, tls_dir, "prefill")
    tx = make_sender(backend, src, layout, env_opts[backend], shared=shared, **opts)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_transfer_cpu", "--role", "receiver",
         *(["--tls-dir", tls_dir] if tls_dir else []),
         "--backend", backend, "--tokens", str(args.tokens), "--layers", str(args.layers), "--kv-heads",
         str(args.kv_heads), "--head-dim", str(args.head_dim), "--block-size",
         str(args.block_size), "--dtype", args.dtype, "--dst-device", args.dst_device],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=harness.REPO)
    loop = asyncio.get_running_loop()

    async def readline() -> str:
        return (await loop.run_in_executor(None, child.stdout.readline)).strip()

    out: dict = {}
    try:
        endpoint = await readline()
        for pattern in args.patterns.split(","):
            for mode in args.modes.split(","):
                key = pattern if mode == "send" else f"{pattern}/{mode}"
                out[key] = await _bench_mode(args, backend, tx, endpoint, child, readline,
                                             pattern, mode, n, out)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        await tx.close()
    return out


async def _bench_mode(args, backend, tx, endpoint, child, readline, pattern: str, mode: str,
                      n: int, out: dict) -> dict:
    """Runs of one pattern in one mode; GB/s over the sender's send() time (send) or over
    the time after the last block was handed to the stream (ahead, two_parts)."""
    gbps, data_gbps, tails_ms = [], [], []
    verified = True
    cpu = [0.0, 0.0]  # CPU seconds of the sender and the receiver process during the sends
    for i in range(args.warmup + args.runs):
        tid = f"{backend}-{pattern}-{mode}-{i}"
        child.stdin.write(f"expect {tid} {pattern} {i}\n")
        child.stdin.flush()
        assert await readline() == "ready"
        ids = block_ids(pattern, n, 2 * n, i)
        if mode == "send":
            before = (cpu_seconds(), cpu_seconds(child.pid))
            res = await tx.send(tid, endpoint, ids, 60)
            if i >= args.warmup:
                cpu[0] += cpu_seconds() - before[0]
                cpu[1] += cpu_seconds(child.pid) - before[1]
        else:
            stream = BlockStream(len(ids))
            task = asyncio.create_task(tx.send(tid, endpoint, stream, 60))
            compute = _Compute(args.src_device)  # stands in for the prompt's forward pass
            if mode == "two_parts":
                await compute.run(0.025)
                stream.extend(ids[:len(ids) // 2], compute.event())  # moves during the rest
                await compute.run(0.025, sync=True)  # the last chunk, then the first token
                stream.extend(ids[len(ids) // 2:])
            else:
                await compute.run(0.05, sync=True)  # meanwhile: the handshake
                stream.extend(ids)
            res = await task
        remote = json.loads(await readline())
        if not res.ok or remote["state"] != "done":
            raise RuntimeError(f"{tid}: sender {res}, receiver {remote}")
        verified = verified and remote["verified"]
        if i == 0:  # the first transfer to a peer also sets up the pair (communicator)
            out.setdefault("first_transfer_s", round(res.seconds, 4))
        if i >= args.warmup:
            seconds = res.seconds if mode == "send" else res.tail_seconds
            gbps.append(res.num_bytes / seconds / 1e9)
            tails_ms.append(seconds * 1000)
            if res.data_seconds and mode != "two_parts":
                data_gbps.append(res.num_bytes / res.data_seconds / 1e9)
    r = {"median_gbps": round(statistics.median(gbps), 3), "data_verified": verified,
         **({"cpu_s_per_gb": {"sender": round(cpu[0] / (args.runs * n * layout_of(args)
                                                          .block_bytes / 1e9), 3),
                              "receiver": round(cpu[1] / (args.runs * n * layout_of(args)
                                                          .block_bytes / 1e9), 3)}}
            if mode == "send" else {}),
         "min_gbps": round(min(gbps), 3), "max_gbps": round(max(gbps), 3),
         "runs_gbps": [round(g, 3) for g in gbps],
         "median_ms": round(statistics.median(tails_ms), 3)}
    if data_gbps:  # the data movement alone (device copy / NCCL / NIXL READ)
        r["data_median_gbps"] = round(statistics.median(data_gbps), 3)
        r["data_runs_gbps"] = [round(g, 3) for g in data_gbps]
    data = f"; data movement alone {r['data_median_gbps']:.1f} GB/s" if data_gbps else ""
    print(f"{backend:4s} {pattern:10s} {mode:9s} median {r['median_gbps']:.2f} GB/s "
          f"= {r['median_ms']:.2f} ms (min {min(gbps):.2f}, max {max(gbps):.2f}, "
          f"{len(gbps)} runs){data}", flush=True)
    return r


class _Compute:
    """The prefill's forward pass during a streamed send: on a GPU, matmuls on the sender's
    device (the GPU is busy and clocked up as on a prefill worker, and a part's event
    completes only when they are done); on the CPU, a pause."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            self.device = device

    async def run(self, seconds: float, sync: bool = False) -> None:
        """``seconds`` of GPU work (in a thread, as the engine's), then, unless ``sync``,
        a few more matmuls left queued: a part's event then completes a few ms later."""
        if not self.cuda:
            await asyncio.sleep(seconds)
            return
        await asyncio.to_thread(self._busy, seconds)
        if not sync:
            with torch.cuda.device(self.device):
                for _ in range(4):
                    self.a @ self.a

    def _busy(self, seconds: float) -> None:
        with torch.cuda.device(self.device):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                self.a @ self.a
                torch.cuda.current_stream().synchronize()

    def event(self):
        if not self.cuda:
            return None
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record()
            return event


def memcpy_gbps(nbytes: int, runs: int) -> float:
    """One-process, one-thread copy of the same payload: the same-host ceiling to compare to."""
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def device_copy_gbps(nbytes: int, src: str, dst: str, runs: int) -> float:
    """One contiguous device-to-device copy of the payload (the link's ceiling for us)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times = []
    for _ in range(runs + 2):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:]) / 1e9


async def main(args: argparse.Namespace, benchmark: str = "kv_transfer_cpu",
               figures: list[harness.Figure] = FIGURES, argv: list[str] | None = None) -> dict:
    layout = layout_of(args)
    n = -(-args.tokens // args.block_size)
    payload = n * layout.block_bytes
    print(f"KV of {args.tokens} tokens: {n} blocks x {layout.block_bytes} B = "
          f"{payload / 2**20:.1f} MiB", flush=True)
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "result_set", "role",
                                                           "backend", "tls_dir")}
    backends = args.backends.split(",")
    patterns = args.patterns.split(",")
    figures = [f for f in figures if len(f.path) < 3 or f.path[0] != "results"
               or (f.path[1] in backends and f.path[2] in patterns)]  # what this run measures
    if args.tls:
        figures = [harness.Figure(f"{f.name}, inside mutual TLS", f.unit, f.path, f.pattern,
                                  f.format) for f in figures]
    head = harness.header(benchmark, cfg, argv=argv, about=__doc__, figures=figures)
    results = {}
    for b in args.backends.split(","):
        try:
            results[b] = await bench_backend(args, b)
        except Exception as exc:  # noqa: BLE001 - report the others, say why this one failed
            print(f"{b}: FAILED: {exc!r}", flush=True)
            results[b] = {"error": repr(exc)}
    if args.src_device.startswith("cuda"):
        copy = device_copy_gbps(payload, args.src_device, args.dst_device, args.runs)
        print(f"in-process {args.src_device} -> {args.dst_device} copy of the same payload: "
              f"{copy:.2f} GB/s")
    else:
        copy = memcpy_gbps(payload, args.runs)
        print(f"in-process single-thread memcpy of the same payload: {copy:.2f} GB/s")
    report = {
        **head,
        "layout": layout.__dict__, "tokens": args.tokens, "num_blocks": n,
        "payload_bytes": payload, "runs": args.runs, "warmup": args.warmup,
        "cpu_definition": ("mode send: cpu_s_per_gb = CPU seconds (user + system, all "
                           "threads) the sender / receiver process used during the measured "
                           "sends, per GB moved: what a transfer costs whatever the machine's "
                           "load"),
        "gbps_definition": ("mode send: payload bytes / sender send() seconds (connect..ack); "
                            "modes ahead / two_parts (keys '<pattern>/<mode>'): payload / the "
                            "seconds from handing the last blocks to the sender's BlockStream "
                            "(handshake already done) to the ack; 1e9 B/s"),
        "data_gbps_definition": ("GPU backends: payload / the data movement alone (nccl: "
                                 "CUDA events around the sender's NCCL group; cuda_ipc: "
                                 "events around the receiver's copies; nixl: READ post to "
                                 "completion on the receiver), without the handshake"),
        "results": results, "copy_ceiling_gbps": round(copy, 3),
        "copy_ceiling_definition": ("one contiguous torch copy src_device -> dst_device"
                                    if args.src_device.startswith("cuda") else
                                    "single-thread numpy memcpy in one process"),
        "devices": {"src": args.src_device, "dst": args.dst_device,
                    "names": [torch.cuda.get_device_name(i)
                              for i in range(torch.cuda.device_count())]},
        "torch_threads": torch.get_num_threads(),
        "event_loop": type(asyncio.get_running_loop()).__module__,
    }
    path = harness.write_json(harness.output_path(args, benchmark), report)
    print(f"wrote {path}")
    return report


def log_timelines(role: str) -> None:
    """With PDSERVE_KV_TIMELINE=1, print each transfer's phases (kvtransfer logs them)."""
    if environ().get("PDSERVE_KV_TIMELINE", "") not in ("", "0"):
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"[{role}] %(message)s")


def cli(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    log_timelines(ns.role)
    run_on_service_loop(receiver_main(ns) if ns.role == "receiver" else main(ns, argv=argv))


if __name__ == "__main__":
    cli()
