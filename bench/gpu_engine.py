"""GPU engine benchmark on dummy:llama-3-8b in bf16 (issue 4): (a) batch-1 decode, (b) offline
throughput, (c) TTFT of a long prompt, (d) greedy agreement with transformers, (e) an
8192-token prompt.

    PYTHONPATH=. python3 bench/gpu_engine.py --out bench/results/gpu_engine_h200.json
    PYTHONPATH=. python3 bench/gpu_engine.py --defaults \
        --out bench/results/gpu_engine_defaults_h200.json

``--defaults`` builds the engine as a new user would, ``LLM("dummy:llama-3-8b")`` with no
other argument (device, dtype, KV cache, max_model_len and scheduler limits all "auto"; the
resolved configuration is recorded), and runs sections a, c, e, b (issue 22's done-when:
b >= 13,800 output tok/s, a >= 230 tok/s, c <= 115 ms, e accepted).

Sections run in the order d, a, c, e, b (d first: it needs a second copy of the weights for the
transformers model, freed before the engine is built). Every figure is written to --out with
the exact command line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.llm import LLM  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

MODEL = "dummy:llama-3-8b"


def rand_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    # ids >= 3 keep clear of the byte tokenizer's bos/eos
    return [1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()


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


def section_d(args, results):
    from engine.loader import load_model
    t0 = time.time()
    loaded = load_model(MODEL, dtype=torch.bfloat16, device="cuda", seed=0)
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


def profile_table(fn, reps: int) -> str:
    """Per-kernel CUDA time of fn() (torch profiler), per repetition."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return f"(totals over {reps} repetitions)\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default=None, help="default d,a,c,b (--defaults: a,c,e,b)")
    ap.add_argument("--defaults", action="store_true",
                    help='LLM("dummy:llama-3-8b") with no engine argument (the flags below '
                         'that set engine values are ignored)')
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default 512; with --defaults: only when given (the one engine "
                         "argument, for LLM.generate at a serving run's concurrency)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="launch each decode step before reading the previous one's tokens "
                         "(default: the engine's, on with CUDA graphs)")
    args = ap.parse_args()
    sections = (args.sections or ("a,c,e,b" if args.defaults else "d,a,c,b")).split(",")
    R = {"command": "PYTHONPATH=. python3 " + " ".join(sys.argv), "python": platform.python_version(),
         "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
         "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args)}

    def save():
        with open(args.out, "w") as f:
            json.dump(R, f, indent=1)

    hf = None
    if "d" in sections:
        hf, d_prompts, hf_out = section_d(args, R)
        save()

    t0 = time.time()
    if args.defaults:
        llm = LLM(MODEL, **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))
    else:
        llm = LLM(MODEL, dtype="bfloat16", device="cuda",
                  max_num_seqs=args.max_num_seqs or 512,
                  max_num_batched_tokens=args.max_batched_tokens, max_model_len=4352,
                  kv_cache_memory_bytes=int(args.kv_gib * 2**30), enable_prefix_caching=False,
                  enforce_eager=args.eager, async_decode=args.async_decode)
    eng = llm.engine
    R["engine_build_s"] = round(time.time() - t0, 1)
    from services.config_tree import redacted_flat
    R["resolved_config"] = redacted_flat(eng.config)
    R["graph_width"] = getattr(eng.runner, "graph_width", None)
    free, total = torch.cuda.mem_get_info()
    R["gpu_memory_after_build_gib"] = {"used": round((total - free) / 2**30, 2),
                                       "total": round(total / 2**30, 2)}
    R["graph_buckets"] = getattr(eng.runner, "graph_buckets", None)
    R["num_kv_blocks"] = eng.runner.num_blocks
    R["gemv_tuning"] = getattr(eng.runner, "gemv_tuning", None)
    R["env"] = {k: v for k, v in os.environ.items() if k.startswith("PDSERVE_")}
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa
    print("engine built", R["engine_build_s"], "s", flush=True)
    save()

    if "d" in sections:
        outs = llm.generate(d_prompts, greedy(32))
        eng_out = [o.token_ids for o in outs]
        per = []
        for p, e, h in zip(d_prompts, eng_out, hf_out):
            first = next((i for i, (x, y) in enumerate(zip(e, h)) if x != y), None)
            row = {"prompt_len": len(p), "agree_tokens": sum(x == y for x, y in zip(e, h)),
                   "first_divergence": first, "engine": e, "hf": h}
            if first is not None:
                row.update(margin_at(hf, p, h[:first], e[first], h[first]))
            per.append(row)
        R["d"] = {"prompts": per, "exact_prompts": sum(r["first_divergence"] is None for r in per),
                  "matching_prefix_tokens": sum((r["first_divergence"] if r["first_divergence"]
                                                 is not None else 32) for r in per),
                  "total_tokens": 32 * len(per)}
        print("d:", R["d"]["exact_prompts"], "/ 8 exact;",
              [r["first_divergence"] for r in per], flush=True)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        save()

    if "a" in sections:
        runs = []
        for rep in range(4):
            p = rand_prompt(gen, 128, vocab)
            rid = f"a{rep}"
            t_start = time.perf_counter()
            eng.add_request(rid, p, greedy(128))
            t_first = None
            n = 0
            while eng.has_work:
                for o in eng.step():
                    n += len(o.token_ids)
                    if t_first is None:
                        t_first = time.perf_counter()
            t_end = time.perf_counter()
            runs.append({"ttft_ms": (t_first - t_start) * 1e3, "tokens": n,
                         "decode_tok_s": (n - 1) / (t_end - t_first),
                         "e2e_tok_s": n / (t_end - t_start)})
        R["a"] = {"runs": runs[1:], "warmup": runs[0], "chained_steps": eng.chained_steps,
                  "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs[1:]),
                  "e2e_tok_s_median": statistics.median(r["e2e_tok_s"] for r in runs[1:])}
        print("a:", {k: v for k, v in R["a"].items() if "median" in k}, flush=True)
        # GPU time of one graphed batch-1 decode step alone (no host work)
        r = eng.runner
        if r.graphs:
            g = r.graphs[1][0]
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(50):
                g.replay()
            ev[1].record()
            torch.cuda.synchronize()
            R["a"]["graph_replay_ms_b1"] = ev[0].elapsed_time(ev[1]) / 50
            for b in (64, 256):
                if b in r.graphs:
                    g = r.graphs[b][0]
                    g.replay()
                    ev[0].record()
                    for _ in range(20):
                        g.replay()
                    ev[1].record()
                    torch.cuda.synchronize()
                    R["a"][f"graph_replay_ms_b{b}"] = ev[0].elapsed_time(ev[1]) / 20
            print("graph replay ms:", {k: v for k, v in R["a"].items() if "replay" in k})
            R["a"]["profile_b1"] = profile_table(lambda: [r.graphs[1][0].replay()
                                                          for _ in range(10)], 10)
            print(R["a"]["profile_b1"])
        save()

    if "c" in sections:
        ttfts = []
        for rep in range(5):
            p = rand_prompt(gen, 4096, vocab)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.add_request(f"c{rep}", p, greedy(1))
            t_first = None
            while eng.has_work:
                for o in eng.step():
                    if t_first is None:
                        t_first = time.perf_counter()
            ttfts.append((t_first - t0) * 1e3)
        R["c"] = {"ttft_ms": ttfts[1:], "warmup_ms": ttfts[0],
                  "ttft_ms_median": statistics.median(ttfts[1:])}
        def one_ttft():
            eng.add_request("cprof", rand_prompt(gen, 4096, vocab), greedy(1))
            while eng.has_work:
                eng.step()
        R["c"]["profile_4096"] = profile_table(one_ttft, 1)
        print(R["c"]["profile_4096"])
        print("c:", R["c"], flush=True)
        save()

    if "e" in sections:
        # an 8192-token prompt is accepted and served (max_model_len auto: the model's
        # 131072, capped by the KV cache); its decode steps run eagerly past
        # cuda_graph_max_len
        p = rand_prompt(gen, 8192, vocab)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            out = llm.generate([p], greedy(16))[0]
            R["e"] = {"prompt_tokens": len(p), "accepted": True,
                      "output_tokens": len(out.token_ids), "finish": out.finish_reason.value,
                      "wall_ms": (time.perf_counter() - t0) * 1e3,
                      "max_model_len": eng.max_model_len}
        except ValueError as err:
            R["e"] = {"prompt_tokens": len(p), "accepted": False, "error": str(err),
                      "max_model_len": eng.max_model_len}
        print("e:", R["e"], flush=True)
        save()

    if "b" in sections:
        llm.generate([rand_prompt(gen, 200, vocab) for _ in range(64)], greedy(16))  # warm-up
        prompts = [rand_prompt(gen, 200, vocab) for _ in range(args.num_requests)]
        torch.cuda.synchronize()
        steps0 = eng.steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy(200))
        dt = time.perf_counter() - t0
        ntok = sum(len(o.token_ids) for o in outs)
        R["b"] = {"requests": len(prompts), "output_tokens": ntok, "wall_s": dt,
                  "output_tok_s": ntok / dt, "total_tok_s": (ntok + 200 * len(prompts)) / dt,
                  "steps": eng.steps - steps0}
        print("b:", R["b"], flush=True)
        save()

    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    print(json.dumps({k: R[k] for k in ("a", "b", "c", "e") if k in R}, indent=1))


if __name__ == "__main__":
    main()
