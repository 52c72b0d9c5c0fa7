"""What each default costs in gpu_engine's section b, and where a GPU engine's reserved memory
goes (an investigation driver; its outputs are raw JSON, not harness headers).

    python3 -m bench.defaults_ablation_gpu b '{"enable_prefix_caching": false}'
        LLM("dummy:llama-3-8b", **kw) then section b (1000 x (200 + 200)); '{}' = defaults
    python3 -m bench.defaults_ablation_gpu mem
        gpu_memory_utilization 0.3, eager: reserved memory after the build and after a
        4000-token prompt, and the largest allocations of that prompt with their frames
"""
import json, sys, time, os
import torch
from engine import LLM
from bench.gpu_engine import section_b
mode = sys.argv[1]
out = {"mode": mode}
if mode == "mem":
    GIB = 2**30
    llm = LLM("dummy:llama-3-8b", gpu_memory_utilization=0.3, enforce_eager=True)
    eng = llm.engine
    free, total = torch.cuda.mem_get_info()
    out["after_build_reserved"] = torch.cuda.memory_reserved() / GIB
    out["kv_bytes"] = eng.runner.kv_cache_bytes / GIB
    out["share"] = 0.3 * total / GIB
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    from engine import SamplingParams
    llm.generate([list(range(3, 4000))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    out["after_gen_reserved"] = torch.cuda.memory_reserved() / GIB
    out["peak_alloc_during_gen"] = torch.cuda.max_memory_allocated() / GIB
    snap = torch.cuda.memory._snapshot()
    allocs = []
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc" and ev["size"] > 64 * 2**20:
            fr = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in ev.get("frames", [])
                  if "/engine/" in f["filename"] or "/bench/" in f["filename"]][:6]
            allocs.append((ev["size"] / GIB, fr))
    allocs.sort(key=lambda a: -a[0])
    out["big_allocs"] = allocs[:25]
else:
    kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    llm = LLM("dummy:llama-3-8b", **kw)
    out["kw"] = kw
    out["max_model_len"] = llm.engine.max_model_len
    out["graph_width"] = getattr(llm.engine.runner, "graph_width", None)
    gen = torch.Generator().manual_seed(0)
    out["b"] = section_b(llm, gen, llm.engine.model_config.vocab_size, 1000, "cuda")
print("RESULT", json.dumps(out), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_{mode}_{len(sys.argv)}_{int(time.time())}.json"), "w") as f:
    json.dump(out, f)
