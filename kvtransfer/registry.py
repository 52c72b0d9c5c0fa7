"""The backend registry: the one list of kvtransfer backends.

``make_sender("tcp", cache, layout)`` / ``make_receiver("shm", cache, layout)``. Each backend
is a module that declares itself in a module-level ``BACKEND`` (a
:class:`~kvtransfer.api.BackendSpec`: name, the devices it serves, whether its receiver
listens on TCP, its sender and receiver factories); adding a backend is one module plus one
line in ``_MODULES``. Modules are imported on first use, so an entry point that never asks
about backends never imports them.
"""

from __future__ import annotations

import importlib

import torch

from kvtransfer.api import BackendSpec, KVLayout, KVReceiver, KVSender, ListenAddress

_MODULES = (
    "kvtransfer.backends.tcp",
    "kvtransfer.backends.shm",
    "kvtransfer.backends.fake",
    "kvtransfer.backends.nccl",
    "kvtransfer.backends.cuda_ipc",
    # NVIDIA NIXL (pip install nixl-cu13, not a project dependency): without it, constructing
    # a nixl sender / receiver raises RuntimeError saying so
    "kvtransfer.backends.nixl",
)
_SPECS: dict[str, BackendSpec] = {}


def _specs() -> dict[str, BackendSpec]:
    if not _SPECS:
        for module in _MODULES:
            spec = importlib.import_module(module).BACKEND
            if spec.name in _SPECS:
                raise RuntimeError(f"kvtransfer backend {spec.name!r} declared twice")
            _SPECS[spec.name] = spec
    return _SPECS


def backends() -> list[str]:
    """Every backend's name, sorted."""
    return sorted(_specs())


def spec(backend: str) -> BackendSpec:
    """The backend's declaration; ValueError naming the known ones for an unknown name."""
    try:
        return _specs()[backend]
    except KeyError:
        raise ValueError(f"unknown kvtransfer backend {backend!r}; have {backends()}") from None


def make_sender(backend: str, cache: torch.Tensor, layout: KVLayout, **opts) -> KVSender:
    """Options: shm ``chunk_bytes`` (8 MiB), ``num_slots`` (4); nccl ``layers_per_message``,
    ``pack_message_bytes``."""
    return spec(backend).sender(cache, layout, **opts)


def make_receiver(backend: str, cache: torch.Tensor, layout: KVLayout, **opts) -> KVReceiver:
    """Options: tcp / nccl / cuda_ipc / nixl ``host``, ``port``, ``advertise_host`` (their
    control listener); cuda_ipc ``copy_lanes`` (streams one transfer's copies are spread
    over); shm ``name``; fake ``stall``.

    Call ``await receiver.start()`` before using ``endpoint`` / ``expect``.
    """
    found = spec(backend)
    where = {k: opts.pop(k) for k in ("host", "port", "advertise_host") if k in opts}
    listen = ListenAddress(**where) if found.listener else None
    if where and not found.listener:
        raise ValueError(f"the {backend} backend listens on no TCP port ({sorted(where)})")
    return found.receiver(cache, layout, listen, **opts)


def device_rules() -> str:
    """Which backends serve which devices, in words (for error messages)."""
    by_devices: dict[tuple[str, ...], list[str]] = {}
    for found in _specs().values():
        by_devices.setdefault(found.devices, []).append(found.name)
    return ", ".join(
        f"{'/'.join(sorted(names))} " + (f"need a {devices[0]} device" if len(devices) == 1
                                         else f"take {' or '.join(devices)}")
        for devices, names in sorted(by_devices.items()))
