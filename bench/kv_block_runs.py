"""How contiguous are a serving run's KV transfers? (CPU; the real BlockManager.)

A transfer moves a prompt's blocks from the prefill worker's cache to the blocks the decode
worker pre-allocated for it; it costs one copy / message / descriptor per *segment*, a run
contiguous on BOTH sides (``kvtransfer.blocks.segments``). On two H200s, 256 segments of
2 MiB move at 250-295 GB/s and one segment of 512 MiB at 330-385
(bench/results/kv_transfer_gpu_h200*.json). Which of the two a serving run sees depends on
the order in which each worker's ``BlockManager`` hands out free blocks once its cache has
been used through (fresh caches hand out ascending ids and every transfer is one segment).

This bench replays the 1P1D bench's mix (bench/disagg_gpu.py: a quarter 4096-token prompts,
the rest 128-512, 128-256 new tokens, Poisson arrivals) through two real BlockManagers with a
simple clock: the prefill worker computes chunks of up to ``--budget`` tokens at
``--prefill-tok-s``; the decode worker pre-allocates a request's blocks when it arrives (as the
gateway's Pre-allocate call does), takes a block every ``--block-size`` new tokens while it
decodes at ``--tpot-ms`` a token, and frees them when it finishes. Both caches are small
enough to be used through several times. Per transfer it records the segment count; the
summary covers the transfers after ``--settle`` seconds (both caches wrapped by then).

    python3 -m bench.kv_block_runs --set cpu-mycommit
    python3 -m bench.kv_block_runs --no-block-runs --out ...   (strict eviction order)
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys

from engine.block_manager import BlockManager
from engine.request import SamplingParams
from engine.sequence import Sequence
from kvtransfer.blocks import segments
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("pieces per 4096-token transfer (mean)", "",
                   ("summary", "long_prompts", "segments_mean")),
    harness.Figure("blocks per piece, all transfers", "", ("summary", "all", "blocks_per_segment")),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.kv_block_runs",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=26.0, help="requests/s")
    p.add_argument("--duration", type=float, default=120.0, help="s of arrivals")
    p.add_argument("--settle", type=float, default=40.0, help="s before transfers count")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-blocks", type=int, default=20480, help="40 GiB of Llama-3-8B KV")
    p.add_argument("--decode-blocks", type=int, default=40960, help="80 GiB")
    p.add_argument("--prefill-tok-s", type=float, default=37000.0)
    p.add_argument("--budget", type=int, default=2048, help="prefill tokens per step")
    p.add_argument("--tpot-ms", type=float, default=20.0)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    harness.add_output_args(p, "kv_block_runs")
    p.add_argument("--no-block-runs", dest="block_runs", action="store_false",
                   help="strict eviction order (the workers' kv_block_runs off; was "
                        "PDSERVE_KV_BLOCK_RUNS=0 here)")
    return p.parse_args(argv)


def simulate(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    bs = a.block_size
    pbm = BlockManager(a.prefill_blocks, bs, hasher=None, block_runs=a.block_runs)
    dbm = BlockManager(a.decode_blocks, bs, hasher=None, block_runs=a.block_runs)
    sampling = SamplingParams(max_tokens=1)
    events: list[tuple[float, int, str, object]] = []  # (time, tie, kind, payload)
    tie = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, payload))

    t, i = 0.0, 0
    while t < a.duration:
        t += rng.expovariate(a.rate)
        n = a.long_len if rng.random() < a.long_frac else rng.randint(128, 512)
        push(t, "arrive", (i, n, rng.randint(128, 256)))
        i += 1

    waiting: list[tuple[Sequence, Sequence, int]] = []  # (prefill seq, decode seq, out len)
    running: list[tuple[Sequence, Sequence, int]] = []  # prefilling, in FIFO order
    prefill_busy_until = 0.0
    transfers: list[dict] = []
    refused = 0

    def prefill_step(now: float) -> None:
        nonlocal prefill_busy_until
        running.extend(waiting)  # FIFO: chunks go to the oldest prompts first
        waiting.clear()
        budget, done = a.budget, []
        for item in running:
            if not budget:
                break
            seq = item[0]
            left = seq.num_tokens - seq.num_computed_tokens
            take = min(left, budget)
            if not pbm.allocate_slots(seq, take):
                break  # cache full: wait for frees
            seq.num_computed_tokens += take
            budget -= take
            if seq.num_computed_tokens == seq.num_tokens:
                done.append(item)
        used = a.budget - budget
        if not used:
            return
        end = now + used / a.prefill_tok_s
        prefill_busy_until = end
        for item in done:
            running.remove(item)
            push(end, "computed", item)
        push(end, "prefill", None)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            rid, n, out = payload
            ids = [1] * n
            dseq = Sequence(f"d{rid}", ids, sampling)
            dseq.block_table = dbm.allocate_blocks(-(-n // bs)) or []
            if not dseq.block_table:
                refused += 1
                continue
            waiting.append((Sequence(f"p{rid}", ids, sampling), dseq, out))
            if prefill_busy_until <= now:
                prefill_step(now)
        elif kind == "prefill":
            prefill_step(now)
        elif kind == "computed":
            pseq, dseq, out = payload
            segs = segments(pseq.block_table, dseq.block_table)
            transfers.append({"t": now, "blocks": len(pseq.block_table), "segments": len(segs)})
            pbm.free_seq(pseq)  # the KV left (a transfer takes ~2 ms; not modelled)
            if prefill_busy_until <= now:  # a step that found the cache full goes again
                prefill_step(now)
            dseq.num_computed_tokens = dseq.num_tokens
            push(now + a.tpot_ms / 1000, "decode", (dseq, out))
        elif kind == "decode":
            dseq, left = payload
            if left == 0 or not dbm.allocate_slots(dseq, 1):
                dbm.free_seq(dseq)  # finished (or, rarely, out of blocks: dropped)
                continue
            dseq.num_computed_tokens += 1
            dseq.token_ids.append(1)
            push(now + a.tpot_ms / 1000, "decode", (dseq, left - 1))
    return {"transfers": transfers, "refused": refused}


def summarize(transfers: list[dict], settle: float) -> dict:
    late = [x for x in transfers if x["t"] >= settle]
    if not late:
        return {"transfers": 0}
    long = [x for x in late if x["blocks"] >= 256]

    def stats(xs: list[dict]) -> dict:
        segs = [x["segments"] for x in xs]
        blocks = sum(x["blocks"] for x in xs)
        return {"transfers": len(xs), "segments_median": statistics.median(segs),
                "segments_mean": round(statistics.fmean(segs), 2), "segments_max": max(segs),
                "blocks_per_segment": round(blocks / sum(segs), 2),
                "one_segment_share": round(sum(s == 1 for s in segs) / len(segs), 3)}

    return {"all": stats(late), "long_prompts": stats(long) if long else {}}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    rec = harness.Recorder.start("kv_block_runs", a, argv=argv, about=__doc__, figures=FIGURES)
    res = simulate(a)
    rec["refused"] = res["refused"]
    rec["summary"] = summarize(res["transfers"], a.settle)
    print(json.dumps(rec["summary"], indent=2))
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
