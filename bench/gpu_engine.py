"""GPU engine benchmark on dummy:llama-3-8b in bf16: (a) batch-1 decode, (b) offline
throughput, (c) TTFT of a long prompt, (d) greedy agreement with transformers, (e) an
8192-token prompt.

    python3 -m bench.gpu_engine --set h200-mycommit                 (one H200, ~3 min)
    python3 -m bench.gpu_engine --sections a --max-num-seqs 8 --out ...   (section a alone)
    python3 -m bench.gpu_engine --device cpu --model dummy:tiny --dtype float32 \\
        --sections a,c,b --num-requests 4 --long-prompt 1024 --kv-gib 0.5 \\
        --out /tmp/engine.json                                       (CPU smoke run, ~1 min)

``--defaults`` builds the engine as a new user would, ``LLM("dummy:llama-3-8b")`` with no
other argument (device, dtype, KV cache, max_model_len and scheduler limits all "auto"; the
resolved configuration is recorded), and runs sections a, c, e, b.

Sections run in the order d, a, c, e, b (d first: it needs a second copy of the weights for the
transformers model, freed before the engine is built); ``--sections`` picks some of them.

(a) four requests of a 128-token prompt and 128 new tokens, one at a time (the first is a
    warm-up): decode tok/s after the first token; on the GPU also the replay time of the
    batch-1 (and 64 / 256) decode CUDA graph alone and its kernel profile.
(b) ``--num-requests`` prompts of 200 random tokens, 200 new tokens each, all queued at
    once (after a warm-up of 64): output tok/s.
(c) TTFT of a 4096-token prompt (``--long-prompt``), five one at a time (the first is a warm-up), and a kernel
    profile of one more.
(d) eight prompts (8-256 tokens), 32 greedy tokens by the engine and by transformers with
    the same weights (sdpa attention, bf16): where they first differ, and transformers' own
    logit gap between the two candidate tokens there.

Random weights (``dummy:``), greedy, EOS ignored, prefix caching off. The JSON is rewritten
after every section.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.benchlib import harness

SECTIONS = ("d", "a", "c", "e", "b")
FIGURES = [
    harness.Figure("(a) batch-1 decode", "tok/s", ("a", "decode_tok_s_median"), format=".1f"),
    harness.Figure("(a) batch-1 decode graph replay", "ms", ("a", "graph_replay_ms_b1"),
                   format=".3f"),
    harness.Figure("(b) 1000 x (200 in + 200 out)", "out tok/s", ("b", "output_tok_s"),
                   format=".0f"),
    harness.Figure("(c) TTFT of a 4096-token prompt", "ms", ("c", "ttft_ms_median"),
                   format=".1f"),
    harness.Figure("(d) prompts identical to transformers (of 8)", "", ("d", "exact_prompts")),
    harness.Figure("(d) tokens before the first divergence (of 256)", "",
                   ("d", "matching_prefix_tokens")),
]


def rand_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    # ids >= 3 keep clear of the byte tokenizer's bos/eos
    return [1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_bf16_cuda(loaded):
    """transformers model on the GPU in bf16 holding `loaded`'s exact weights."""
    from transformers import AutoModelForCausalLM
    from tests.reference import hf_config_from_model_config
    cfg = hf_config_from_model_config(loaded.config)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    res = model.load_state_dict(dict(loaded.weights), strict=False, assign=True)
    if res.unexpected_keys or res.missing_keys:
        raise ValueError(f"weights mismatch: {res}")
    return model.to("cuda").eval()


def section_d_reference(args, results):
    """transformers' greedy tokens for section d's prompts (before the engine exists)."""
    from engine.loader import load_model
    t0 = time.time()
    loaded = load_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    vocab = loaded.config.vocab_size
    model = hf_bf16_cuda(loaded)
    del loaded
    gen = torch.Generator().manual_seed(1234)
    prompts = [rand_prompt(gen, n, vocab) for n in (8, 16, 33, 64, 100, 128, 200, 256)]
    hf_out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            o = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                               attention_mask=torch.ones_like(ids), pad_token_id=0)
            hf_out.append(o[0, len(p):].tolist())
    results["d_hf_s"] = round(time.time() - t0, 1)
    return model, prompts, hf_out


def margin_at(model, prompt, prefix, a, b):
    """transformers' logit gap between tokens a and b after prompt + prefix (bf16 model)."""
    with torch.no_grad():
        ids = torch.tensor([prompt + prefix], device="cuda")
        logits = model(ids).logits[0, -1].float()
    top2 = torch.topk(logits, 2)
    return {"hf_logit_engine_tok": float(logits[a]), "hf_logit_hf_tok": float(logits[b]),
            "hf_top2_gap": float(top2.values[0] - top2.values[1])}


def section_d(llm, hf, prompts, hf_out) -> dict:
    outs = llm.generate(prompts, greedy(32))
    per = []
    for p, e, h in zip(prompts, [o.token_ids for o in outs], hf_out):
        first = next((i for i, (x, y) in enumerate(zip(e, h)) if x != y), None)
        row = {"prompt_len": len(p), "agree_tokens": sum(x == y for x, y in zip(e, h)),
               "first_divergence": first, "engine": e, "hf": h}
        if first is not None:
            row.update(margin_at(hf, p, h[:first], e[first], h[first]))
        per.append(row)
    return {"prompts": per, "exact_prompts": sum(r["first_divergence"] is None for r in per),
            "matching_prefix_tokens": sum((r["first_divergence"] if r["first_divergence"]
                                           is not None else 32) for r in per),
            "total_tokens": 32 * len(per)}


def profile_table(fn, reps: int) -> str:
    """Per-kernel CUDA time of fn() (torch profiler), per repetition."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return f"(totals over {reps} repetitions)\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)


def graph_replay_ms(graph, reps: int, warm: int) -> float:
    """GPU time of one replay of a captured decode graph (no host work)."""
    for _ in range(warm):
        graph.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


def section_a(eng, gen, vocab) -> dict:
    runs = []
    for rep in range(4):
        p = rand_prompt(gen, 128, vocab)
        t_start = time.perf_counter()
        eng.add_request(f"a{rep}", p, greedy(128))
        t_first, n = None, 0
        while eng.has_work:
            for o in eng.step():
                n += len(o.token_ids)
                if t_first is None:
                    t_first = time.perf_counter()
        t_end = time.perf_counter()
        runs.append({"ttft_ms": (t_first - t_start) * 1e3, "tokens": n,
                     "decode_tok_s": (n - 1) / (t_end - t_first),
                     "e2e_tok_s": n / (t_end - t_start)})
    out = {"runs": runs[1:], "warmup": runs[0], "chained_steps": eng.chained_steps,
           "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs[1:]),
           "e2e_tok_s_median": statistics.median(r["e2e_tok_s"] for r in runs[1:])}
    print("a:", {k: v for k, v in out.items() if "median" in k}, flush=True)
    r = eng.runner
    if r.graphs:
        out["graph_replay_ms_b1"] = graph_replay_ms(r.graphs[1][0], 50, 3)
        for b in (64, 256):
            if b in r.graphs:
                out[f"graph_replay_ms_b{b}"] = graph_replay_ms(r.graphs[b][0], 20, 1)
        print("graph replay ms:", {k: v for k, v in out.items() if "replay" in k})
        out["profile_b1"] = profile_table(lambda: [r.graphs[1][0].replay()
                                                   for _ in range(10)], 10)
        print(out["profile_b1"])
    return out


def section_c(eng, gen, vocab, device: str, plen: int) -> dict:
    ttfts = []
    for rep in range(5):
        p = rand_prompt(gen, plen, vocab)
        sync(device)
        t0 = time.perf_counter()
        eng.add_request(f"c{rep}", p, greedy(1))
        t_first = None
        while eng.has_work:
            for _ in eng.step():
                if t_first is None:
                    t_first = time.perf_counter()
        ttfts.append((t_first - t0) * 1e3)
    out = {"ttft_ms": ttfts[1:], "warmup_ms": ttfts[0],
           "ttft_ms_median": statistics.median(ttfts[1:])}

    def one_ttft():
        eng.add_request("cprof", rand_prompt(gen, plen, vocab), greedy(1))
        while eng.has_work:
            eng.step()
    if device.startswith("cuda"):
        out["profile_4096"] = profile_table(one_ttft, 1)
        print(out["profile_4096"])
    print("c:", {k: v for k, v in out.items() if k != "profile_4096"}, flush=True)
    return out


def section_b(llm, gen, vocab, num_requests: int, device: str) -> dict:
    eng = llm.engine
    llm.generate([rand_prompt(gen, 200, vocab) for _ in range(64)], greedy(16))  # warm-up
    prompts = [rand_prompt(gen, 200, vocab) for _ in range(num_requests)]
    sync(device)
    steps0 = eng.steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(200))
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    out = {"requests": len(prompts), "output_tokens": ntok, "wall_s": dt,
           "output_tok_s": ntok / dt, "total_tok_s": (ntok + 200 * len(prompts)) / dt,
           "steps": eng.steps - steps0}
    print("b:", out, flush=True)
    return out


def section_e(llm, gen, vocab) -> dict:
    """An 8192-token prompt is accepted and served (max_model_len auto: the model's own,
    capped by the KV cache); its decode steps run eagerly past cuda_graph_max_len."""
    eng = llm.engine
    p = rand_prompt(gen, 8192, vocab)
    t0 = time.perf_counter()
    try:
        out = llm.generate([p], greedy(16))[0]
        res = {"prompt_tokens": len(p), "accepted": True, "output_tokens": len(out.token_ids),
               "finish": out.finish_reason.value, "wall_ms": (time.perf_counter() - t0) * 1e3,
               "max_model_len": eng.max_model_len}
    except ValueError as err:
        res = {"prompt_tokens": len(p), "accepted": False, "error": str(err),
               "max_model_len": eng.max_model_len}
    print("e:", res, flush=True)
    return res


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.gpu_engine",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=None,
                    help="any of d,a,c,e,b (run in that order; default d,a,c,b, with "
                         "--defaults a,c,e,b)")
    ap.add_argument("--defaults", action="store_true",
                    help='LLM(MODEL) with no engine argument (the flags below that set engine '
                         'values are ignored, but --max-num-seqs when given)')
    ap.add_argument("--num-requests", type=int, default=1000, help="section b's requests")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default 512; with --defaults: only when given (the one engine "
                         "argument, for LLM.generate at a serving run's concurrency)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--long-prompt", type=int, default=4096, help="section c's prompt tokens")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="launch each decode step before reading the previous one's tokens "
                         "(default: the engine's, on with CUDA graphs)")
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8", "int8", "int4"),
                    help="weights quantized at load (engine.quant); kept with --defaults")
    ap.add_argument("--quantization-plan", default=None, help="a mixed-precision plan file")
    ap.add_argument("--kv-dtype", default=None,
                    help="KV cache dtype (int8 / fp8: engine.quant.kv); kept "
                         "with --defaults")
    ap.add_argument("--attention-backend", default=None, choices=("auto", "torch", "triton"),
                    help="the engine's attention_backend (default: its own, auto); kept with "
                         "--defaults")
    harness.add_output_args(ap, "gpu_engine")
    args = ap.parse_args(argv)
    sections = args.sections or ("a,c,e,b" if args.defaults else "d,a,c,b")
    args.section_list = [s for s in sections.split(",") if s]
    if set(args.section_list) - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(set(args.section_list) - set(SECTIONS))}")
    if "d" in args.section_list and not args.device.startswith("cuda"):
        ap.error("section d compares against transformers on the GPU: leave it out on the CPU")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    figures = [f for f in FIGURES if f.path[0] in args.section_list]  # the sections that run
    rec = harness.Recorder.start("gpu_engine", args, argv=argv, about=__doc__, figures=figures)
    rec["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    hf = None
    if "d" in args.section_list:
        hf, d_prompts, hf_out = section_d_reference(args, rec.doc)
        rec.save()

    t0 = time.time()
    quant = {"quantization": args.quantization,
             **({"quantization_plan": args.quantization_plan} if args.quantization_plan else {}),
             **({"kv_dtype": args.kv_dtype} if args.kv_dtype else {}),
             **({"attention_backend": args.attention_backend}
                if args.attention_backend else {})}
    if args.defaults:
        llm = LLM(args.model, **quant, **({"max_num_seqs": args.max_num_seqs}
                                          if args.max_num_seqs else {}))
    else:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, **quant,
                  max_num_seqs=args.max_num_seqs or 512,
                  max_num_batched_tokens=args.max_batched_tokens,
                  max_model_len=args.long_prompt + 256,
                  kv_cache_memory_bytes=int(args.kv_gib * 2**30), enable_prefix_caching=False,
                  enforce_eager=args.eager, async_decode=args.async_decode)
    eng = llm.engine
    from pdcore.config_tree import redacted_flat
    rec["resolved_config"] = redacted_flat(eng.config)
    rec["graph_width"] = getattr(eng.runner, "graph_width", None)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        rec["gpu_memory_after_build_gib"] = {"used": round((total - free) / 2**30, 2),
                                             "total": round(total / 2**30, 2)}
    rec["engine_build_s"] = round(time.time() - t0, 1)
    rec["graph_buckets"] = getattr(eng.runner, "graph_buckets", None)
    rec["num_kv_blocks"] = eng.runner.num_blocks
    rec["gemv_tuning"] = getattr(eng.runner, "gemv_tuning", None)
    rec["quantization"] = getattr(eng.runner, "quantization", None)
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    print("engine built", rec["engine_build_s"], "s", flush=True)
    rec.save()

    if "d" in args.section_list:
        rec["d"] = section_d(llm, hf, d_prompts, hf_out)
        print("d:", rec["d"]["exact_prompts"], "/ 8 exact;",
              [r["first_divergence"] for r in rec["d"]["prompts"]], flush=True)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        rec.save()
    if "a" in args.section_list:
        rec["a"] = section_a(eng, gen, vocab)
        rec.save()
    if "c" in args.section_list:
        rec["c"] = section_c(eng, gen, vocab, args.device, args.long_prompt)
        rec.save()
    if "e" in args.section_list:
        rec["e"] = section_e(llm, gen, vocab)
        rec.save()
    if "b" in args.section_list:
        rec["b"] = section_b(llm, gen, vocab, args.num_requests, args.device)
        rec.save()
    rec["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
