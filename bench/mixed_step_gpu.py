"""Time of one engine step that mixes decoding sequences with a prefill chunk, on one GPU.

A colocated worker runs such steps whenever a prompt arrives while others decode (its long
prompts in chunks of up to --max-num-batched-tokens), and a decode worker that prefills short
prompts itself (the gateway's --local-prefill-* rule) runs them too. The step is built by
hand: D running sequences at context lengths drawn from --ctx, plus one sequence whose next
P tokens (after a prefix of --prefix tokens) are computed. It is timed three ways in one
process, on dummy:llama-3-8b bf16:

* ``decode``: the D decode rows alone (a CUDA-graph step, as a decode worker runs them);
* ``mixed_one_launch``: eager, every row through one prefill-kernel launch (the engine
  before the split; PDSERVE_SPLIT_MIXED=0);
* ``mixed_split``: eager, decode rows through the decode kernel (TritonAttention.split_mixed);
* ``mixed_graph``: the mixed-step CUDA graph (engine.cuda_graphs), where P fits one;
* ``chunk`` / ``chunk_graph``: the P-token chunk alone, eager / through a mixed graph.

``same_tokens_*``: the share of rows whose greedy token equals the one-launch path's.
Times are host wall times of launch + collect (sampling included), medians of --reps after
two warm-ups.

    python3 -m bench.mixed_step_gpu --set h200-mycommit             (one GPU, ~2 min)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from engine.llm import LLM
from engine.request import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SeqStatus
from pdserve.benchlib import harness
from pdserve.benchlib.workload import parse_range

FIGURES = [
    harness.Figure(f"{d} decode rows + {p}-token chunk, {name}", "ms",
                   ("rows", {"decode_rows": d, "chunk": p}, key), format=".1f")
    for d, p in ((128, 256), (128, 2048))
    for name, key in (("decode rows alone", "decode_ms"), ("one launch (before)",
                                                           "mixed_one_launch_ms"),
                      ("split, eager", "mixed_split_ms"), ("split, graph", "mixed_graph_ms"))]


def build_seq(eng, rid: str, tokens: list[int], computed: int, sp) -> Sequence:
    seq = Sequence(rid, tokens, sp)
    seq.status = SeqStatus.RUNNING
    if not eng.block_manager.allocate_slots(seq, len(tokens)):
        raise SystemExit("KV cache too small for this configuration (raise --kv-gib)")
    seq.num_computed_tokens = computed
    return seq


def timed(runner, out: SchedulerOutput, reps: int) -> list[float]:
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.collect(runner.launch(out))
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.mixed_step_gpu",
                                 description=__doc__.splitlines()[0])
    harness.add_output_args(ap, "mixed_step_gpu")
    ap.add_argument("--decode-rows", default="32,64,128,192",
                    help="comma-separated D: running sequences that decode")
    ap.add_argument("--chunks", default="256,512,2048",
                    help="comma-separated P: tokens of the prefill chunk")
    ap.add_argument("--prefix", type=int, default=0,
                    help="tokens of the chunk's sequence already computed")
    ap.add_argument("--ctx", default="512:4096", help="decode rows' context lengths, lo:hi")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kv-gib", type=float, default=90.0)
    a = ap.parse_args(argv)
    ds = [int(x) for x in a.decode_rows.split(",")]
    ps = [int(x) for x in a.chunks.split(",")]
    lo, hi = parse_range(a.ctx)
    llm = LLM("dummy:llama-3-8b", dtype="bfloat16", device="cuda", max_num_seqs=max(ds) + 1,
              max_num_batched_tokens=max(ps) + max(ds), max_model_len=8192,
              kv_cache_memory_bytes=int(a.kv_gib * 2**30), enable_prefix_caching=False)
    eng = llm.engine
    runner = eng.runner
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    rec = harness.Recorder.start("mixed_step_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    R = rec.doc
    R["device"] = torch.cuda.get_device_name(0)
    R["rows"] = []
    decoders = []
    for i in range(max(ds)):
        n = rng.randint(lo, hi)
        decoders.append(build_seq(eng, f"d{i}", [rng.randrange(3, vocab) for _ in range(n + 1)],
                                  n, sp))
    backend = runner.backend
    graphs = runner.mixed_graphs

    def variant(out, split: bool, graph: bool) -> tuple[float, dict]:
        backend.split_mixed = split
        runner.mixed_graphs = graphs if graph else {}
        try:
            ms = statistics.median(timed(runner, out, a.reps))
            return ms, runner.collect(runner.launch(out))[0]
        finally:
            backend.split_mixed, runner.mixed_graphs = True, graphs

    for p in ps:
        n = a.prefix + p
        chunk = build_seq(eng, f"c{p}", [rng.randrange(3, vocab) for _ in range(n + 1)],
                          a.prefix, sp)
        only = SchedulerOutput([ScheduledSeq(chunk, p)])
        chunk_ms = variant(only, True, False)[0]
        chunk_graph_ms = variant(only, True, True)[0] if p <= max(runner.mixed_tokens,
                                                                   default=0) else None
        for d in ds:
            dec = [ScheduledSeq(s, 1) for s in decoders[:d]]
            half = d // 2  # the chunk's sequence between decode rows, as the scheduler may
            mixed = SchedulerOutput(dec[:half] + [ScheduledSeq(chunk, p)] + dec[half:])
            row = {"decode_rows": d, "chunk": p, "prefix": a.prefix,
                   "ctx_mean": round(statistics.mean(s.num_computed_tokens
                                                     for s in decoders[:d]))}
            row["decode_ms"] = round(statistics.median(
                timed(runner, SchedulerOutput(dec), a.reps)), 3)
            row["chunk_ms"] = round(chunk_ms, 3)
            row["chunk_graph_ms"] = chunk_graph_ms and round(chunk_graph_ms, 3)
            tokens = {}
            for name, split, graph in (("mixed_one_launch_ms", False, False),
                                       ("mixed_split_ms", True, False),
                                       ("mixed_graph_ms", True, True)):
                if graph and runner._mixed_plan(mixed) is None:
                    continue
                ms, tokens[name] = variant(mixed, split, graph)
                row[name] = round(ms, 3)
            # greedy tokens of each path against the one-launch path (bf16: near-ties flip)
            base = tokens["mixed_one_launch_ms"]
            for name, toks in tokens.items():
                if name != "mixed_one_launch_ms":
                    row["same_tokens_" + name[len("mixed_"):-len("_ms")]] = round(
                        sum(toks[k] == v for k, v in base.items()) / len(base), 3)
            row["split_speedup"] = round(row["mixed_one_launch_ms"] / row["mixed_split_ms"], 2)
            if "mixed_graph_ms" in row:
                row["graph_speedup"] = round(row["mixed_split_ms"] / row["mixed_graph_ms"], 2)
            R["rows"].append(row)
            print(row, flush=True)
            rec.save()
        eng.block_manager.free_seq(chunk)
    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
