"""Shared pieces of the kvtransfer conformance suites (test_kvtransfer*.py): the backends
under test, two layouts, caches, and a started receiver/sender pair."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
import uvloop

from kvtransfer import KVLayout, make_receiver, make_sender
from kvtransfer.backends.nixl import nixl_available

ROOT = Path(__file__).resolve().parents[2]
# nixl (NVIDIA NIXL over UCX, on CPU caches here) runs only where nixl-cu13 is installed
BACKENDS = ["fake", "tcp", "shm"] + (["nixl"] if nixl_available() else [])
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
# the shm ring is made small on purpose so that round trips reuse its slots
SENDER_OPTS = {"shm": {"chunk_bytes": 3 * SMALL.block_bytes, "num_slots": 2}}


def run(coro, loop: str = "uvloop"):
    return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)


def cache(layout: KVLayout, num_blocks: int, seed: int | None = None) -> torch.Tensor:
    shape = (num_blocks, *layout.block_shape)
    if seed is None:
        return torch.zeros(shape, dtype=layout.torch_dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(layout.torch_dtype)


async def pair(backend: str, src: torch.Tensor, dst: torch.Tensor, layout: KVLayout = SMALL,
               src_layout: KVLayout | None = None, **sender_opts):
    """A started receiver on ``dst`` and a sender on ``src`` (``sender_opts``: shm only)."""
    rx = make_receiver(backend, dst, layout)
    await rx.start()
    opts = {**SENDER_OPTS.get(backend, {}), **(sender_opts if backend == "shm" else {})}
    tx = make_sender(backend, src, src_layout or layout, **opts)
    return rx, tx
