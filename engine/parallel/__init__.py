"""Tensor parallelism (issue 27): one engine over ``n`` processes of one host.

    plan.py     which slice of each weight a rank holds (no torch)
    layers.py   the module swap: column / row / vocabulary-parallel modules
    group.py    the process group (gloo / NCCL), loopback rendezvous, timeouts
    shard.py    building a rank's shard; the step message rank 0 sends each rank
    driver.py   rank 0: starts the ranks, stands in for the model in the runner
    rank.py     ranks 1..n-1: the loop that runs each step rank 0 sends
"""
from engine.parallel.driver import RankFailure, TensorParallel
from engine.parallel.plan import ShardPlan, check_shardable

__all__ = ["RankFailure", "ShardPlan", "TensorParallel", "check_shardable"]
