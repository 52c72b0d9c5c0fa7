"""How often batch composition changes a seeded sample on a GPU (issue 25, point 3). Not run
by the CPU suite (there the answer is never: fp32 and a generator per request, tested in
tests/unit/test_sampling_controls.py); the lead runs it on the GPU machine:

    python3 -m bench.seeded_batch_gpu --set h200

A seeded row draws its noise from (seed, step, token) alone (engine.kernels.
seeded_exponentials), so what can still change its tokens is its logits: in bf16 the
GEMMs and attention of a step round differently at other batch shapes (other kernels,
split-K, tiles), and a draw that was nearly a tie between two tokens can flip. Once one
token differs, the rest of the sample follows another path.

--requests seeded requests (random prompts, temperature 1, --max-tokens each, EOS
ignored) run (1) one at a time, the reference; (2) all together; (3) together with
--fillers unseeded requests of other lengths interleaved; (4) all together in reverse
order. For each composition against (1): the share of requests whose tokens are identical,
of tokens equal position by position, and the first position that differs. The same for
greedy requests separates what the seed adds from what the logits alone do. Prefix caching
is off, so every run computes every prompt afresh.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("sampled, batch of all: requests identical to batch 1", "%",
                   ("runs", {"mode": "sampled"}, "compositions", {"name": "together"},
                    "identical_pct"), format=".1f"),
    harness.Figure("sampled, with fillers: requests identical to batch 1", "%",
                   ("runs", {"mode": "sampled"}, "compositions", {"name": "with_fillers"},
                    "identical_pct"), format=".1f"),
    harness.Figure("sampled, with fillers: tokens equal to batch 1", "%",
                   ("runs", {"mode": "sampled"}, "compositions", {"name": "with_fillers"},
                    "tokens_equal_pct"), format=".1f"),
    harness.Figure("greedy, with fillers: requests identical to batch 1", "%",
                   ("runs", {"mode": "greedy"}, "compositions", {"name": "with_fillers"},
                    "identical_pct"), format=".1f"),
]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Agreement of ``got`` with ``ref``, request by request."""
    same = sum(a == b for a, b in zip(ref, got))
    equal = total = 0
    firsts = []
    for a, b in zip(ref, got):
        total += len(a)
        equal += sum(x == y for x, y in zip(a, b))
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                               min(len(a), len(b))))
    return {"identical": same, "requests": len(ref),
            "identical_pct": 100.0 * same / max(1, len(ref)),
            "tokens_equal_pct": 100.0 * equal / max(1, total),
            "first_difference": {"median": statistics.median(firsts) if firsts else None,
                                 "min": min(firsts) if firsts else None,
                                 "all": firsts}}


def run_mode(llm, prompts, fillers, a, greedy: bool) -> dict:
    from engine import SamplingParams

    def sp(i: int) -> SamplingParams:
        if greedy:
            return SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                              seed=a.seed + i, ignore_eos=True)

    def tokens(outs) -> list[list[int]]:
        return [list(o.token_ids) for o in outs]

    t0 = time.perf_counter()
    solo = [tokens(llm.generate([p], [sp(i)]))[0] for i, p in enumerate(prompts)]
    t_solo = time.perf_counter() - t0
    together = tokens(llm.generate(prompts, [sp(i) for i in range(len(prompts))]))
    rev = tokens(llm.generate(prompts[::-1], [sp(i) for i in range(len(prompts))][::-1]))[::-1]
    mixed_prompts, mixed_params, where = [], [], []
    rng = random.Random(a.seed + 1)
    k = 0
    for i, p in enumerate(prompts):
        for _ in range(len(fillers) // len(prompts)):
            mixed_prompts.append(fillers[k])
            mixed_params.append(SamplingParams(max_tokens=rng.randint(8, 2 * a.max_tokens),
                                               temperature=rng.choice([0.0, 0.7, 1.0]),
                                               ignore_eos=True))
            k += 1
        where.append(len(mixed_prompts))
        mixed_prompts.append(p)
        mixed_params.append(sp(i))
    mixed_all = tokens(llm.generate(mixed_prompts, mixed_params))
    mixed = [mixed_all[j] for j in where]
    return {"mode": "greedy" if greedy else "sampled", "solo_seconds": t_solo,
            "compositions": [dict(name="together", **compare(solo, together)),
                             dict(name="reversed", **compare(solo, rev)),
                             dict(name="with_fillers", batch=len(mixed_prompts),
                                  **compare(solo, mixed))]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.seeded_batch_gpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=32, help="seeded requests")
    ap.add_argument("--fillers", type=int, default=96, help="unseeded requests beside them")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", default="32:256", help="LO:HI prompt tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1000, help="request i has seed SEED + i")
    harness.add_output_args(ap, "seeded_batch_gpu")
    a = ap.parse_args(argv)
    from engine.llm import LLM

    rec = harness.Recorder.start("seeded_batch_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=a.device.startswith("cuda"))
    llm = LLM(a.model, device=a.device, enable_prefix_caching=False,
              max_num_seqs=max(256, a.requests + a.fillers))
    vocab = llm.engine.model_config.vocab_size
    lo, hi = (int(x) for x in a.prompt_len.split(":"))
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(a.requests)]
    fillers = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(a.fillers)]
    rec["config_resolved"] = {"dtype": llm.engine.config.dtype,
                              "device": llm.engine.config.device}
    rec["runs"] = []
    for greedy in (False, True):
        rec["runs"].append(run_mode(llm, prompts, fillers, a, greedy))
        rec.save()
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
