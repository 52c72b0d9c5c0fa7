"""Shared by the GPU kvtransfer suites: layouts, caches, receiver/sender pairs and a sender
child process."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

from kvtransfer import KVLayout, make_receiver, make_sender  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["nccl", "cuda_ipc"] + (["nixl"] if importlib.util.find_spec("nixl_cu13") else [])
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
SRC, DST = "cuda:0", "cuda:1"


def run(coro):
    return asyncio.run(coro)


def cache(n: int, device: str, seed: int | None = None, layout: KVLayout = LAYOUT):
    shape = (n, *layout.block_shape)
    if seed is None:
        return torch.zeros(shape, dtype=layout.torch_dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(layout.torch_dtype)


async def pair(backend, src, dst, src_layout=LAYOUT):
    rx = make_receiver(backend, dst, LAYOUT)
    await rx.start()
    return rx, make_sender(backend, src, src_layout)


_CHILD = r"""
import asyncio, os, sys, time, torch
from kvtransfer import KVLayout, make_receiver, make_sender
backend, mode = sys.argv[1], sys.argv[2]
layout = KVLayout(4, 2, 64, 16, "bfloat16")
n = 64
if mode == "send":  # argv: endpoint, hang (1: freeze before queueing the data)
    endpoint, hang = sys.argv[3], sys.argv[4] == "1"
    src = (torch.arange(n, device="cuda:0") % 200).to(torch.bfloat16)
    src = src.view(n, 1, 1, 1, 1, 1).expand(n, *layout.block_shape).contiguous()
    tx = make_sender(backend, src, layout)
    if hang:
        import kvtransfer.backends.nccl as nc
        def frozen(self, *a, **k):
            print("FROZEN", flush=True)
            time.sleep(3600)
        nc.Comm.post = frozen
    res = asyncio.run(tx.send(sys.argv[5], endpoint, list(range(n)), 60))
    print("RESULT", res.state.value, res.error, flush=True)
"""


def _spawn(*args):
    return subprocess.Popen([sys.executable, "-c", _CHILD, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
