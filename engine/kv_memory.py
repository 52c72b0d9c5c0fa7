"""Sizing the KV cache from device memory (GPU workers and ``LLM`` on a GPU).

With neither ``num_blocks`` nor ``kv_cache_memory_bytes`` set, a GPU engine may use
``gpu_memory_utilization`` of its device: after the weights are loaded, the model runner runs
profiling steps on a scratch cache (the largest prompt chunk of one sequence, and a step of
``max_num_seqs`` sequences that all sample, with logprobs). The engine's own use is its
weights (parameters and buffers) plus the peak its profiling steps added to the allocator's
reserved memory (so other engines of the same process do not count), and the KV cache gets
what is left of its share::

    kv = min(utilization * total - used - GPU_RESERVE_BYTES, free - GPU_RESERVE_BYTES)

``free`` is the device's free memory at that moment, so workers started together on one GPU,
each with its own share (``pdserve up --device cuda`` gives a prefill and a decode worker 0.45
each), never take more than the device holds even when one of them exceeds its share.
``GPU_RESERVE_BYTES`` stays out of the cache for what the profile does not see: the CUDA
context, cuBLAS / Triton / NCCL workspaces and the CUDA-graph pool captured after the cache.
The model runner then takes no more blocks than ``max_num_seqs`` sequences of
``max_model_len`` tokens can use (a small model on a large GPU would otherwise get tens of
millions of blocks, each a host-side object in the block manager).
"""
from __future__ import annotations

import logging

import torch

from engine.request import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

GPU_RESERVE_BYTES = 2 << 30


def profile_lengths(max_tokens: int, max_seqs: int, max_len: int) -> list[list[int]]:
    """Sequence lengths of the profiling steps: one sequence with the largest chunk a step
    computes (prompt activations, prefill attention), then the step budget spread over as
    many sequences as may run (logits and sampling of every row)."""
    one = [max(1, min(max_tokens, max_len - 1))]
    n = max(1, min(max_seqs, max_tokens))
    many = [max_tokens // n + (1 if i < max_tokens % n else 0) for i in range(n)]
    return [one, many]


def kv_budget_bytes(total: int, free: int, used: int, utilization: float,
                    reserve: int = GPU_RESERVE_BYTES) -> int:
    """Bytes the KV cache may take (see the module docstring); 0 when nothing is left."""
    share = int(utilization * total) - used - reserve
    return max(0, min(share, free - reserve))


def profile_step(runner, lengths: list[int]) -> None:
    """One eager forward pass and sampling (greedy, with logprobs) over fresh sequences of
    ``lengths`` tokens, on a scratch KV cache that holds just them."""
    bs = runner.block_size
    mc = runner.mc
    blocks = [-(-(n + 1) // bs) for n in lengths]
    scratch = torch.zeros((sum(blocks), mc.num_layers, 2, bs, mc.num_kv_heads,
                           getattr(runner, "kv_row", mc.head_dim)),
                          dtype=runner.kv_dtype, device=runner.device)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, ignore_eos=True)
    items, first = [], 0
    for i, (n, nb) in enumerate(zip(lengths, blocks)):
        seq = Sequence(f"profile-{i}", [(i + j) % mc.vocab_size for j in range(n)], sp)
        seq.block_table = list(range(first, first + nb))
        first += nb
        items.append(ScheduledSeq(seq, n))
    had, previous = hasattr(runner, "kv_cache"), getattr(runner, "kv_cache", None)
    steps = runner.eager_steps
    runner.kv_cache = scratch
    try:
        runner.collect(runner.launch(SchedulerOutput(items)))
    finally:
        if had:
            runner.kv_cache = previous
        else:
            del runner.kv_cache
        runner.eager_steps = steps  # profiling runs are not the engine's steps


def gpu_kv_cache_bytes(runner, max_tokens: int, max_seqs: int, max_len: int,
                       utilization: float) -> int:
    """Profile ``runner`` (weights loaded, no KV cache yet) and return the KV budget."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    for lengths in profile_lengths(max_tokens, max_seqs, max_len):
        profile_step(runner, lengths)
    torch.cuda.synchronize(dev)
    activations = max(0, torch.cuda.max_memory_reserved(dev) - base)
    model = runner.model
    weights = sum(t.numel() * t.element_size()
                  for t in (*model.parameters(), *model.buffers()) if t.device == dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    budget = kv_budget_bytes(total, free, weights + activations, utilization)
    logger.info("KV cache budget %.2f GiB: %.0f%% of %.1f GiB less weights %.2f GiB, "
                "profiled activations %.2f GiB and %.1f GiB for context and graphs "
                "(%.1f GiB free)", budget / 2**30, 100 * utilization, total / 2**30,
                weights / 2**30, activations / 2**30, GPU_RESERVE_BYTES / 2**30, free / 2**30)
    return budget
