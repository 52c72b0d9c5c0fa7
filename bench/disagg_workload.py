"""The prompts of bench/disagg_gpu.py (and bench/ttft_gpu.py): token-id items for the TTFT,
exactness, warm-up and mixed-workload phases, seeded from ``--seed`` so every deployment gets
the same items. ``a`` is disagg_gpu's resolved argument namespace."""
from __future__ import annotations

import math
import random

from pdserve.benchlib import workload
from pdserve.benchlib.workload import Item


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft_items(a) -> list[Item]:
    rng = random.Random(a.seed * 1000 + 2)
    return [Item(f"ttft{i}", a.ttft_max_tokens, token_ids=random_ids(rng, a.prompt_len,
                                                                      a.vocab_size),
                 prompt_units=a.prompt_len) for i in range(a.ttft_repeats)]


def exact_lengths(a) -> list[int]:
    """Mixed lengths, the longest first: the full long prompt, fractions of it, short ones."""
    p = a.prompt_len
    cands = [p, 3 * p // 4 + 5, p // 2, p // 4 + 3, p // 8, 100, 33, 7, 2 * p // 3, 3 * p // 8]
    out = []
    for n in cands:
        if n >= 1 and n not in out:
            out.append(n)
    return (out * (a.exact_prompts // len(out) + 1))[:a.exact_prompts]


def exact_items(a) -> list[Item]:
    rng = random.Random(a.seed * 1000 + 3)
    return [Item(f"exact{i}", a.exact_max_tokens, token_ids=random_ids(rng, n, a.vocab_size),
                 prompt_units=n) for i, n in enumerate(exact_lengths(a))]


def mix_items(a, n: int, seed: int, tag: str) -> list[Item]:
    spec = workload.WorkloadSpec(kind="longmix", num_requests=n, seed=seed, fmt="tokens",
                                 vocab_size=a.vocab_size, input_len=a.short,
                                 output_len=a.out_range, long_frac=a.long_frac,
                                 long_len=a.prompt_len)
    return [Item(**{**it.__dict__, "id": f"{tag}.{it.id}"}) for it in workload.generate(spec)]


def rate_seed(a, rate: float, stream: int) -> int:
    """The seed of one random stream (100: the prompts, 200: the arrival times) at ``rate``:
    a function of the rate's value, not of its place in ``--rates``, so a rate label carries
    the same sample in every run and every deployment (until session 7 it was the place, and
    the same label meant different loads in runs with other rate lists)."""
    return (a.seed * 1000 + stream) * 1_000_003 + int(round(rate * 1000))


def rate_items(a, k: int, rate: float) -> list[Item]:
    """The mixed workload of the k-th rate: new prompts at every rate (no prefix hits across
    rates; a rate listed twice gets the same prompts), the same items for every deployment."""
    n = a.num_requests or int(math.ceil(rate * a.duration * 1.5)) + 10
    return mix_items(a, n, seed=rate_seed(a, rate, 100), tag=f"rate{k}")


def warmup_items(a, rnd: int) -> list[Item]:
    items = mix_items(a, a.warmup_size, seed=a.seed * 1000 + 10 + rnd, tag=f"warm{rnd}")
    rng = random.Random(a.seed * 1000 + 20 + rnd)
    for i, it in enumerate(items):  # half long, so every worker sees chunked long prompts
        if i % 2 == 0:
            it.token_ids = random_ids(rng, a.prompt_len, a.vocab_size)
            it.prompt_units = a.prompt_len
        it.max_tokens = min(it.max_tokens, 16)
    return items
