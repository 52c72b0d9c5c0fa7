"""Peak resident memory per tensor-parallel rank while loading (CPU, gloo), TP=1 vs TP=N.

Each configuration runs in a fresh process (``--child``) that builds an ``LLMEngine`` with a
small KV cache and reports, per rank, its anonymous resident memory (RssAnon, sampled every
5 ms) before loading (the interpreter, torch, the engine's modules) and its peak while
loading; the figure is their difference over the weight bytes of the whole model. (Peak RSS
is recorded too, but it counts the file pages a safetensors mmap faults in: a column slice
touches every page of its tensor, and those pages are page cache the kernel can drop.)
Two sources:

- ``hf``: a Hugging Face folder written once to a temporary directory (a modest Llama-shaped
  model, random weights): a rank reads only its slices of each tensor (safetensors slices);
- ``dummy``: ``dummy:<name>``: a rank draws each tensor whole (its values must not depend on
  the TP size), keeps its slice and frees the rest before the next tensor, so its peak is
  its shards plus the largest single tensor.

    python3 -m bench.tp_memory_cpu --tp 2 --set cpu-2core
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("dummy, TP=1: peak load memory / whole-model weights", "",
                   ("summary", "dummy", "tp1_fraction")),
    harness.Figure("dummy, TP=N: peak load memory of the busiest rank / whole-model weights",
                   "", ("summary", "dummy", "max_rank_fraction")),
    harness.Figure("dummy, TP=N: busiest rank / TP=1", "", ("summary", "dummy",
                                                           "max_rank_over_tp1")),
    harness.Figure("safetensors, TP=1: peak load memory / whole-model weights", "",
                   ("summary", "hf", "tp1_fraction")),
    harness.Figure("safetensors, TP=N: busiest rank / whole-model weights", "",
                   ("summary", "hf", "max_rank_fraction")),
    harness.Figure("safetensors, TP=N: busiest rank / TP=1", "", ("summary", "hf",
                                                                 "max_rank_over_tp1")),
]

# the HF folder has dummy:llama-160m's shapes (JackFram/llama-160m: 162M parameters, 650 MB
# in fp32; its largest tensors, the embedding and lm_head, are 1/6.6 of it each)
HF_MODEL = "llama-160m"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.tp_memory_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="ranks of the parallel run")
    p.add_argument("--dummy", default="dummy:llama-160m", help="the dummy model measured")
    p.add_argument("--child", nargs=2, metavar=("SPEC", "TP"), help=argparse.SUPPRESS)
    harness.add_output_args(p, "tp_memory_cpu")
    return p.parse_args(argv)


def child(spec: str, tp: int) -> dict:
    """In a fresh process: load ``spec`` on ``tp`` ranks; memory per rank."""
    from engine.engine import LLMEngine
    from engine.llm import build_engine_config
    from engine.parallel.rank import AnonPeak, peak_rss_bytes

    before = AnonPeak()
    before._take()
    with AnonPeak() as anon:
        eng = LLMEngine(build_engine_config(spec, device="cpu", dtype="float32", num_blocks=16,
                                            tensor_parallel_size=tp, cpu_packed=False))
    params = eng.runner.model.parameters()
    ranks = [{"rank": 0, "anon_before": before.peak, "anon_peak": anon.peak,
              "peak_rss": peak_rss_bytes(),
              "weights_bytes": sum(p.numel() * p.element_size() for p in params)}]
    if eng.runner.tp is not None:
        ranks += [{"rank": r, **m} for r, m in enumerate(eng.runner.tp.rank_memory, start=1)]
    eng.close()
    return {"ranks": ranks}


def _run_child(spec: str, tp: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.tp_memory_cpu", "--child", spec, str(tp)],
                         capture_output=True, text=True, check=True, cwd=harness.REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_hf(folder: str) -> None:
    from safetensors.torch import save_file

    from engine.loader import load_tokenizer
    from engine.loader.dummy import dummy_config, random_weights

    c = dummy_config(HF_MODEL)
    cfg = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": c.max_position,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(load_tokenizer("smollm2-135m").backend.to_str())
    import torch
    weights = random_weights(c, torch.float32)
    save_file(weights, os.path.join(folder, "model.safetensors"))


def _summary(runs: dict, whole: int) -> dict:
    def grown(r):  # anonymous memory the load added (file pages of a mmap not counted)
        return r["anon_peak"] - r["anon_before"]

    one = grown(runs["1"]["ranks"][0])
    par = [grown(r) for r in runs["n"]["ranks"]]
    return {"weights_bytes": whole, "tp1_load_bytes": one, "tp1_fraction": one / whole,
            "rank_load_bytes": par, "rank_fractions": [x / whole for x in par],
            "max_rank_fraction": max(par) / whole, "max_rank_over_tp1": max(par) / one}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return 0
    rec = harness.Recorder.start("tp_memory_cpu", a, argv=argv, about=__doc__, figures=FIGURES)
    from engine.loader import load_config
    from engine.loader.dummy import weight_shapes

    def nbytes(config) -> int:
        total = 0
        for shape in weight_shapes(config).values():
            n = 4
            for d in shape:
                n *= d
            total += n
        return total

    rec["summary"], rec["runs"] = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        _write_hf(tmp)
        for name, spec in (("dummy", a.dummy), ("hf", tmp)):
            runs = {"1": _run_child(spec, 1), "n": _run_child(spec, a.tp)}
            rec["runs"][name] = runs
            rec["summary"][name] = _summary(runs, nbytes(load_config(spec)))
            rec.save()
            print(name, json.dumps(rec["summary"][name]), flush=True)
    print(rec.save())
    return 0


if __name__ == "__main__":
    sys.exit(main())
