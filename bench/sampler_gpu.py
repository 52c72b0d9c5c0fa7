"""Sampling controls on one GPU: their cost per decode step, and how often the batch changes
a seeded sample in bf16.

1. ``sampler``: the sampler alone on [B, V] bf16 logits (dummy:llama-3-8b's V = 128256) at
   B = 1 and 64, per control set (plain argmax; temperature + top_p; presence / frequency /
   repetition penalties over a --ctx-token context; 300 logit_bias entries; min_p;
   top_logprobs=20; all of them), device time by CUDA events (median of --reps), and whether
   it ran free of host synchronisation (torch.cuda.set_sync_debug_mode("error")).
2. ``step``: a whole decode step (launch + collect, host wall time) of B running sequences
   at --ctx tokens, every row plain (the greedy CUDA graph) against every row with the
   controls (the graph's logits, then the sampler) and half and half; ``overhead_pct`` is
   the added share of the plain step.
3. ``batch_effect``: --seeded requests (temperature 1, each its own seed) generated alone,
   then all together among as many unseeded ones; the share whose tokens differ, and the
   first position where they do. On the CPU (fp32) the same check is exact
   (tests/unit/test_sampling_controls.py); in bf16 a different batch shape can change a
   matmul's rounding and so flip a near-tie.

    PYTHONPATH=. python3 -m bench.sampler_gpu --out $OUT/sampler_gpu.json     (~3 min)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from engine.layers.sampler import Sampler, SamplingBatch
from engine.llm import LLM
from engine.request import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SeqStatus
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure(f"sampler, all controls, batch {b}", "ms",
                   ("sampler", {"batch": b, "controls": "all"}, "ms"), format=".3f")
    for b in (1, 64)] + [
    harness.Figure(f"decode step overhead, all controls, batch {b}", "%",
                   ("step", {"batch": b}, "overhead_pct"), format=".1f")
    for b in (1, 64)] + [
    harness.Figure("seeded samples changed by the batch (bf16)", "",
                   ("batch_effect", "changed_share"), format=".3f")]

CONTROLS = {
    "plain": {},
    "temperature_top_p": dict(temperature=0.8, top_p=0.9),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "logit_bias": dict(logit_bias={t: 1.0 for t in range(1000, 1300)}),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "top_logprobs": dict(logprobs=True, top_logprobs=20),
    "all": dict(temperature=0.8, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                frequency_penalty=0.5, repetition_penalty=1.2, logprobs=True, top_logprobs=20,
                logit_bias={t: 1.0 for t in range(1000, 1300)}, min_tokens=4),
}


def _seqs(batch: int, ctx: int, vocab: int, sp: SamplingParams, rng) -> list[Sequence]:
    out = []
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(ctx // 2)]
        s = Sequence(f"s{i}", prompt, sp,
                     output_token_ids=[rng.randrange(3, vocab) for _ in range(ctx // 2)])
        out.append(s)
    return out


def _timed_sample(sampler, logits, batch, cuda: bool):
    """(device ms, host launch ms, ran without a host sync) of one sampler call."""
    if not cuda:
        t0 = time.perf_counter()
        sampler(logits, batch).to_host()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms, True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    sync_free = True
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, batch)
    except RuntimeError:
        sync_free = False
        torch.cuda.set_sync_debug_mode(0)
        out = sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    end.record()
    host = (time.perf_counter() - t0) * 1e3
    out.start_copy()
    out.to_host()
    return start.elapsed_time(end), host, sync_free


def sampler_rows(vocab: int, ctx: int, reps: int, device: str = "cuda") -> list[dict]:
    rng = random.Random(0)
    cuda = device.startswith("cuda")
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    rows = []
    for b in (1, 64):
        dtype = torch.bfloat16 if cuda else torch.float32  # the CPU engine runs fp32
        logits = torch.randn(b, vocab, device=device, dtype=dtype) * 4
        for name, kw in CONTROLS.items():
            sp = SamplingParams(max_tokens=1 << 20, **({"temperature": 0} | kw))
            seqs = _seqs(b, ctx, vocab, sp, rng)
            gens = [torch.Generator(device=device).manual_seed(i) if sp.temperature else None
                    for i in range(b)]
            times = []
            for i in range(reps + 3):
                batch = SamplingBatch.from_seqs(seqs, gens, (2,))  # host work: timed below
                t0 = time.perf_counter()
                SamplingBatch.from_seqs(seqs, gens, (2,))
                build = (time.perf_counter() - t0) * 1e3
                times.append((*_timed_sample(sampler, logits, batch, cuda), build))
            times = times[3:]
            row = {"batch": b, "controls": name, "ctx": ctx,
                   "ms": round(statistics.median(t[0] for t in times), 4),
                   "host_launch_ms": round(statistics.median(t[1] for t in times), 4),
                   "host_batch_build_ms": round(statistics.median(t[3] for t in times), 4),
                   "sync_free": all(t[2] for t in times)}
            rows.append(row)
            print(row, flush=True)
    return rows


def _running(eng, rid: str, tokens: list[int], sp) -> Sequence:
    seq = Sequence(rid, tokens, sp)
    seq.status = SeqStatus.RUNNING
    if not eng.block_manager.allocate_slots(seq, len(tokens) + 1):
        raise SystemExit("KV cache too small (raise --kv-gib)")
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def _step_ms(runner, out: SchedulerOutput, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.collect(runner.launch(out))
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_rows(llm, ctx: int, reps: int) -> list[dict]:
    eng, rng = llm.engine, random.Random(1)
    vocab = eng.model_config.vocab_size
    plain = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=1 << 20, ignore_eos=True, **CONTROLS["all"])
    rows = []
    for b in (1, 64):
        toks = [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(b)]
        seqs = {name: [_running(eng, f"{name}{i}", t, sp) for i, t in enumerate(toks)]
                for name, sp in (("p", plain), ("c", full))}
        for s in seqs["c"]:  # the penalties' output tokens: half the context
            s.num_prompt_tokens = ctx // 2
        mixed = seqs["p"][:b // 2] + seqs["c"][b // 2:]
        row = {"batch": b, "ctx": ctx}
        for name, group in (("plain_ms", seqs["p"]), ("controls_ms", seqs["c"]),
                            ("half_ms", mixed)):
            row[name] = round(_step_ms(eng.runner, SchedulerOutput(
                [ScheduledSeq(s, 1) for s in group]), reps), 3)
        row["overhead_pct"] = round(100 * (row["controls_ms"] / row["plain_ms"] - 1), 2)
        row["half_overhead_pct"] = round(100 * (row["half_ms"] / row["plain_ms"] - 1), 2)
        rows.append(row)
        print(row, flush=True)
        for group in seqs.values():
            for s in group:
                eng.runner.drop_request(s.request_id)
                eng.block_manager.free_seq(s)
    return rows


def batch_effect(llm, seeded: int, tokens: int) -> dict:
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 200))]
               for _ in range(2 * seeded)]
    sps = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=100 + i, ignore_eos=True)
           for i in range(seeded)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, sps)]
    others = [SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)] * seeded
    together = llm.generate(prompts, sps + others)[:seeded]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y.token_ids)) if a != b), None)
              for x, y in zip(alone, together)]
    changed = [f for f in firsts if f is not None]
    return {"seeded": seeded, "tokens": tokens, "changed": len(changed),
            "changed_share": round(len(changed) / seeded, 4),
            "first_divergence": sorted(changed),
            "tokens_compared": seeded * tokens}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.sampler_gpu",
                                 description=__doc__.splitlines()[0])
    harness.add_output_args(ap, "sampler_gpu")
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens per row")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seeded", type=int, default=32, help="seeded requests (part 3)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (part 3)")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("sampler_gpu", a, argv=argv, about=__doc__, figures=FIGURES)
    R = rec.doc
    R["device"] = torch.cuda.get_device_name(0)
    llm = LLM("dummy:llama-3-8b", dtype="bfloat16", device="cuda", max_num_seqs=128,
              max_model_len=4096, kv_cache_memory_bytes=int(a.kv_gib * 2**30),
              enable_prefix_caching=False)
    R["sampler"] = sampler_rows(llm.engine.model_config.vocab_size, a.ctx, a.reps)
    rec.save()
    R["step"] = step_rows(llm, a.ctx, a.reps)
    rec.save()
    R["batch_effect"] = batch_effect(llm, a.seeded, a.tokens)
    print(R["batch_effect"], flush=True)
    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
