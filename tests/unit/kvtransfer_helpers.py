"""Shared pieces of the kvtransfer conformance suites (test_kvtransfer*.py): the backends
under test, two layouts, caches, and a started receiver/sender pair."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
import socket

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


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def memfd_mappings() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "pdkv" in line]


class StalledPeer:
    """An endpoint that accepts a connection but never answers (for sender timeouts)."""

    def __init__(self, backend: str, dst: torch.Tensor) -> None:
        self.backend, self.dst = backend, dst
        self.sock: socket.socket | None = None
        self.rx = None

    async def __aenter__(self) -> str:
        if self.backend == "fake":
            self.rx = make_receiver("fake", self.dst, SMALL, stall=True)
            await self.rx.start()
            self.rx.expect("stalled", [0], 30)
            return self.rx.endpoint
        # tcp and the control-connection backends (nixl) listen on TCP, shm on a unix socket
        family = socket.AF_UNIX if self.backend == "shm" else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        name = f"pdkv-test-stall-{os.getpid()}"
        self.sock.bind("\0" + name if self.backend == "shm" else ("127.0.0.1", 0))
        self.sock.listen(8)  # never accepted: the kernel completes the connect, nobody reads
        if self.backend == "shm":
            return f"shm://{name}"
        return f"{self.backend}://127.0.0.1:{self.sock.getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        if self.rx is not None:
            await self.rx.close()
        if self.sock is not None:
            self.sock.close()
