"""StepHandle: one launched engine step, as the model runner returns it.

Its own module so that the model runner and its CUDA-graph part (engine.cuda_graphs) both
import it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.sampler import SampleOutput
from engine.scheduler import SchedulerOutput


@dataclass
class StepHandle:
    """A launched step. Its tokens are known at launch (eager paths, sampling on the host) or
    still on the device (greedy CUDA-graph steps: ``greedy`` is the device argmax, copied to
    the pinned ``host`` buffer; ``event`` completes when that copy has landed; a GPU step
    whose sampler ran: ``sample``, and ``greedy`` its tokens on the device when every row
    sampled, which a step launched after it takes as its input). A chained greedy step
    whose logits are processed (a grammar's mask, penalties) is launched with its sampling
    left for later: ``pending`` holds its logits until ModelRunner.sample_pending."""
    sched: SchedulerOutput
    sampled_ids: list[str]
    rows: list[int] | None = None  # graph paths: the rows of ``greedy`` that sampled (None: all)
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    greedy: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    top_logprobs: list | None = None  # per row: [(token, logprob), ...] or None
    sample: SampleOutput | None = None  # samples still on the device (read by collect)
    chained: bool = False  # launched by launch_next, before the previous step's tokens were read
    pending: torch.Tensor | None = None  # logits not sampled yet (see above)
    # a pending graph step's argmax of the raw logits (a view of the graph's output, valid
    # until its next replay): what a batch masked and nothing else keeps for its free rows
    pending_greedy: torch.Tensor | None = None
