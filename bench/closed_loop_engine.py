"""The engine alone under a closed-loop load, against the same requests submitted at once.

``pdserve bench --concurrency C`` keeps C requests in flight: one arrives whenever one ends.
``LLM.generate`` submits every request at once. This bench runs both on one ``LLMEngine`` in
one process, with no gRPC, gateway or client in the way, so the difference between them is
the engine's own (scheduling, chained launches, mixed steps), and the difference between
``closed`` here and a served run is the serving stack's.

Modes (each on a fresh engine, after --warmup requests through it):

* ``offline``: every request added, then ``step()`` until done (LLM.generate);
* ``closed``: C requests in flight; one new request per request that ended, added
  --arrival-delay-ms after the step that ended it (0: before the next step). A served
  request arrives a client and gateway round trip later, while the next steps run: with a
  delay, arrivals land between steps launched ahead, as in serving; --arrival-jitter-ms
  spreads them over several steps.

Per mode: wall time, output tok/s, and the engine's step counters: steps, steps launched
ahead of the one before (``chained``), CUDA-graph steps (decode-only, mixed) and eager steps,
steps that computed prompt tokens, and the host time per step.

    python3 -m bench.closed_loop_engine --model dummy:llama-3-8b --device cuda \\
        --concurrency 512 --set h200-mycommit                            (one GPU, ~2 min)
    python3 -m bench.closed_loop_engine --model dummy:tiny --num-requests 64 \\
        --concurrency 16 --input-len 32 --output-len 32                     (CPU, seconds)
"""
from __future__ import annotations

import argparse
import ast
import random
import sys
import time

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.benchlib import harness
from pdserve.benchlib.workload import parse_range


def figures(modes: list[str]) -> list[harness.Figure]:
    """The headline figures of the modes run (their ratio when both ran)."""
    out = [harness.Figure(f"{mode} output tok/s", "tok/s", ("modes", mode, "output_tok_s"),
                          format=",.0f") for mode in modes]
    if {"offline", "closed"} <= set(modes):
        out.append(harness.Figure("closed vs offline", "x", ("closed_vs_offline",),
                                  format=".3f"))
    return out


COUNTERS = ("steps", "graph_steps", "mixed_graph_steps", "eager_steps")


def counters(eng) -> dict:
    st = eng.stats()
    out = {k: getattr(st, k) for k in COUNTERS}
    out["chained_steps"] = eng.chained_steps
    out["preemptions"] = st.num_preemptions
    return out


def run_mode(eng, mode: str, prompts: list[list[int]], sp: list[SamplingParams],
             concurrency: int, prefix: str, delay_s: float = 0.0,
             jitter_s: float = 0.0) -> dict:
    before = counters(eng)
    pending = list(enumerate(prompts))
    pending.reverse()
    in_flight = 0
    due: list[float] = []  # when each replacement request arrives (closed mode)
    jitter = random.Random(1)
    out_tokens = 0
    prompt_steps = 0
    step_s: list[float] = []

    def add() -> None:
        nonlocal in_flight
        i, ids = pending.pop()
        eng.add_request(f"{prefix}-{i}", ids, sp[i])
        in_flight += 1

    t0 = time.perf_counter()
    while pending and (mode == "offline" or in_flight < concurrency):
        add()
    while eng.has_work or due:
        while due and due[0] <= time.perf_counter():
            due.pop(0)
            add()
        if not eng.has_work:
            time.sleep(max(0.0, due[0] - time.perf_counter()))
            continue
        s0 = time.perf_counter()
        outs = eng.step()
        step_s.append(time.perf_counter() - s0)
        last = eng.last_schedule
        if last is not None and any(item.num_new_tokens > 1 for item in last.scheduled):
            prompt_steps += 1
        for o in outs:
            out_tokens += len(o.token_ids)
            if o.finished:
                in_flight -= 1
                if mode == "closed" and len(due) < len(pending):
                    due.append(time.perf_counter() + delay_s + jitter.uniform(0, jitter_s))
                    due.sort()
        if not delay_s and not jitter_s:
            while due:
                due.pop()
                add()
    wall = time.perf_counter() - t0
    after = counters(eng)
    step_s.sort()
    row = {k: after[k] - before[k] for k in after}
    row.update(arrival_delay_ms=round(delay_s * 1e3, 3) if mode == "closed" else None,
               arrival_jitter_ms=round(jitter_s * 1e3, 3) if mode == "closed" else None,
               wall_s=round(wall, 3), output_tokens=out_tokens,
               output_tok_s=round(out_tokens / wall, 1), prompt_steps=prompt_steps,
               step_ms_p50=round(1e3 * step_s[len(step_s) // 2], 3) if step_s else None,
               step_ms_mean=round(1e3 * sum(step_s) / len(step_s), 3) if step_s else None)
    return row


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.closed_loop_engine",
                                 description=__doc__.splitlines()[0])
    harness.add_output_args(ap, "closed_loop_engine")
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=512,
                    help="requests in flight in closed mode; also max_num_seqs of both modes")
    ap.add_argument("--input-len", default="200", help="prompt tokens, N or LO:HI")
    ap.add_argument("--output-len", default="200",
                    help="output tokens, N or LO:HI (a range spreads the ends, and so the "
                         "arrivals of closed mode, over steps)")
    ap.add_argument("--warmup", type=int, default=64, help="requests run before each mode")
    ap.add_argument("--modes", default="offline,closed")
    ap.add_argument("--arrival-delay-ms", type=float, default=0.0,
                    help="closed mode: a replacement request arrives this long after the step "
                         "that ended its predecessor")
    ap.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                    help="closed mode: plus a uniform random delay up to this long (spreads "
                         "arrivals over steps, as a served run's clients do)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for both modes (repeatable), e.g. async_decode=false")
    a = ap.parse_args(argv)
    kw = {}
    for item in a.engine_arg:
        k, _, v = item.partition("=")
        kw[k] = {"true": True, "false": False}.get(v.lower(), v)
        if isinstance(kw[k], str):
            try:
                kw[k] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                pass
    rec = harness.Recorder.start("closed_loop_engine", a, argv=argv, about=__doc__,
                                 figures=figures(a.modes.split(",")))
    R = rec.doc
    R["modes"] = {}
    rng = random.Random(0)
    in_lo, in_hi = parse_range(a.input_len)
    out_lo, out_hi = parse_range(a.output_len)
    for mode in a.modes.split(","):
        llm = LLM(a.model, device=a.device, max_num_seqs=a.concurrency, **kw)
        eng = llm.engine
        vocab = eng.model_config.vocab_size

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(3, vocab) for _ in range(rng.randint(in_lo, in_hi))]
                    for _ in range(n)]

        def params(n: int) -> list[SamplingParams]:
            return [SamplingParams(max_tokens=rng.randint(out_lo, out_hi), temperature=0,
                                   ignore_eos=True) for _ in range(n)]

        rng.seed(0)  # every mode runs the same requests
        run_mode(eng, "offline", prompts(a.warmup), params(a.warmup), a.concurrency,
                 f"w{mode}")
        R["modes"][mode] = row = run_mode(eng, mode, prompts(a.num_requests),
                                          params(a.num_requests),
                                          a.concurrency, mode, a.arrival_delay_ms / 1e3,
                                          a.arrival_jitter_ms / 1e3)
        row["engine"] = {"max_num_seqs": eng.config.scheduler.max_num_seqs,
                         "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
                         "device": str(eng.runner.device)}
        print(mode, row, flush=True)
        rec.save()
        llm.close()
        del llm, eng
    if "offline" in R["modes"] and "closed" in R["modes"]:
        R["closed_vs_offline"] = round(R["modes"]["closed"]["output_tok_s"]
                                       / R["modes"]["offline"]["output_tok_s"], 3)
    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
