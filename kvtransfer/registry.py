"""Backend registry: ``make_sender("tcp", cache, layout)`` / ``make_receiver("shm", ...)``.

Backends are imported lazily, so a GPU-only backend never costs the CPU path an import.
"""

from __future__ import annotations

import importlib

import torch

from kvtransfer.base import KVLayout, KVReceiver, KVSender

# backend -> (module, sender class, receiver class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "tcp": ("kvtransfer.tcp", "TcpSender", "TcpReceiver"),
    "shm": ("kvtransfer.shm", "ShmSender", "ShmReceiver"),
    "fake": ("kvtransfer.fake", "FakeSender", "FakeReceiver"),
    "nccl": ("kvtransfer.nccl", "NcclSender", "NcclReceiver"),
    "cuda_ipc": ("kvtransfer.cuda_ipc", "CudaIpcSender", "CudaIpcReceiver"),
    # NVIDIA NIXL (pip install nixl-cu13, not a project dependency): without it,
    # constructing a nixl sender / receiver raises RuntimeError saying so
    "nixl": ("kvtransfer.nixl", "NixlSender", "NixlReceiver"),
}


def backends() -> list[str]:
    return sorted(_BACKENDS)


def _load(backend: str, index: int) -> type:
    try:
        entry = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown kvtransfer backend {backend!r}; have {backends()}") from None
    return getattr(importlib.import_module(entry[0]), entry[index])


def make_sender(backend: str, cache: torch.Tensor, layout: KVLayout, **opts) -> KVSender:
    """Options: shm ``chunk_bytes`` (8 MiB), ``num_slots`` (4); nixl none (the cache,
    CPU or cuda, is registered with a NIXL agent once, here)."""
    return _load(backend, 1)(cache, layout, **opts)


def make_receiver(backend: str, cache: torch.Tensor, layout: KVLayout, **opts) -> KVReceiver:
    """Options: tcp / nccl / cuda_ipc / nixl ``host``, ``port``, ``advertise_host`` (their
    control listener); cuda_ipc ``copy_lanes`` (streams one transfer's copies are spread
    over); shm ``name``; fake ``stall``.

    Call ``await receiver.start()`` before using ``endpoint`` / ``expect``.
    """
    return _load(backend, 2)(cache, layout, **opts)
