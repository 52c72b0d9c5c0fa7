"""The backend registry: the one list of kvtransfer backends.

``make_sender("tcp", cache, layout)`` / ``make_receiver("shm", cache, layout)``. Each backend
is a module that declares itself in a module-level ``BACKEND`` (a
:class:`~kvtransfer.api.BackendSpec`: name, the devices it serves, whether its receiver
listens on TCP, its options dataclass, its sender and receiver factories); adding a backend
is one module plus one line in ``_MODULES``. Modules are imported on first use, so an entry
point that never asks about backends never imports them.

Options are frozen dataclasses that only validate: :class:`~kvtransfer.api.KVTransferOptions`
for what every backend honours, one per backend in its module (``TcpOptions``,
``NcclOptions``, ...). Nothing in kvtransfer reads the environment; :func:`options_from_env`
maps the documented ``PDSERVE_*`` variables onto them for the entry points that honour them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

import torch

from kvtransfer.api import (
    BackendSpec,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    ListenAddress,
)

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


def make_sender(backend: str, cache: torch.Tensor, layout: KVLayout, options=None, *,
                shared: KVTransferOptions | None = None, **fields) -> KVSender:
    """The backend's sender over ``cache``. ``options``: the backend's options dataclass
    (default: its defaults; see its module, or :func:`options_from_env`); ``fields``
    override single fields of it (``make_sender("shm", c, l, chunk_bytes=1 << 20)``);
    ``shared``: the options every backend honours."""
    found = spec(backend)
    return found.sender(cache, layout, _options(found, options, fields),
                        shared or KVTransferOptions())


def make_receiver(backend: str, cache: torch.Tensor, layout: KVLayout, options=None, *,
                  shared: KVTransferOptions | None = None, listen: ListenAddress | None = None,
                  **fields) -> KVReceiver:
    """The backend's receiver into ``cache`` (``options``, ``fields``, ``shared``: as for
    :func:`make_sender`). ``listen``: where a TCP-listening backend listens (default:
    127.0.0.1, any free port); refused for the others.

    Call ``await receiver.start()`` before using ``endpoint`` / ``expect``.
    """
    found = spec(backend)
    if listen is not None and not found.listener:
        raise ValueError(f"the {backend} backend listens on no TCP port")
    return found.receiver(cache, layout, _options(found, options, fields),
                          shared or KVTransferOptions(), listen)


def _options(found: BackendSpec, options, fields: dict):
    if options is None:
        options = found.options()
    elif not isinstance(options, found.options):
        raise TypeError(f"the {found.name} backend takes {found.options.__name__}, "
                        f"got {type(options).__name__}")
    if not fields:
        return options
    known = {f.name for f in dataclasses.fields(found.options)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"the {found.name} backend has no option {', '.join(unknown)}; "
                         f"it has {', '.join(sorted(known))}")
    return dataclasses.replace(options, **fields)


# The environment variables that set kvtransfer options until the service configuration
# does: variable -> (backend, or None for KVTransferOptions; field). Read by options_from_env
# only: nothing in kvtransfer reads the environment itself.
ENV_OPTIONS: dict[str, tuple[str | None, str]] = {
    "PDSERVE_KV_TIMELINE": (None, "timeline"),
    "PDSERVE_KV_CHECKSUMS": (None, "checksums"),
    "PDSERVE_KV_CORRUPT_EVERY": (None, "corrupt_every"),  # fault injection (chaos runs)
    "PDSERVE_NCCL_LAYERS_PER_MESSAGE": ("nccl", "layers_per_message"),
    "PDSERVE_NCCL_PACK_MESSAGE_BYTES": ("nccl", "pack_message_bytes"),
    "PDSERVE_NCCL_LIB": ("nccl", "library"),
    "PDSERVE_CUDA_IPC_LANES": ("cuda_ipc", "copy_lanes"),
    "PDSERVE_BATCH_COPY": ("cuda_ipc", "batch_copy"),
    "PDSERVE_DRIVER_COPY": ("cuda_ipc", "driver_copy"),
    "PDSERVE_KERNEL_COPY_BELOW_BYTES": ("cuda_ipc", "kernel_copy_below_bytes"),
    "PDSERVE_NIXL_MAX_DESCRIPTOR_BYTES": ("nixl", "max_descriptor_bytes"),
    "NIXL_LOG_LEVEL": ("nixl", "verbose_logs"),  # nixl's own variable: set -> keep its logs
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def options_from_env(env: Mapping[str, str]) -> tuple[KVTransferOptions, dict[str, object]]:
    """The options the environment ``env`` sets (os.environ at a worker's start): the shared
    :class:`KVTransferOptions` and every backend's options by name, defaults where a
    variable is unset or empty. The one place kvtransfer options are read from the
    environment (:data:`ENV_OPTIONS` lists the variables); ValueError naming the variable
    for a value that is not of the field's type or out of its range. Booleans take
    1/0/true/false/yes/no/on/off; NIXL_LOG_LEVEL (nixl's own variable) turns on nixl's
    verbose logs whatever its value."""
    values: dict[str | None, dict[str, object]] = {}
    for var, (backend, name) in ENV_OPTIONS.items():
        raw = env.get(var, "")
        if not raw:
            continue
        cls = KVTransferOptions if backend is None else spec(backend).options
        default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
        values.setdefault(backend, {})[name] = _parse(var, raw, default)
    try:
        shared = KVTransferOptions(**values.get(None, {}))
        per_backend = {name: found.options(**values.get(name, {}))
                       for name, found in _specs().items()}
    except ValueError as exc:
        set_vars = [v for v in ENV_OPTIONS if env.get(v)]
        raise ValueError(f"kvtransfer options from the environment ({', '.join(set_vars)}): "
                         f"{exc}") from None
    return shared, per_backend


def _parse(var: str, raw: str, default: object) -> object:
    if var == "NIXL_LOG_LEVEL":
        return True
    if isinstance(default, bool):
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{var}={raw!r}: expected one of {'/'.join(_TRUE + _FALSE)}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r}: not an integer") from None
    return raw


def device_rules() -> str:
    """Which backends serve which devices, in words (for error messages)."""
    by_devices: dict[tuple[str, ...], list[str]] = {}
    for found in _specs().values():
        by_devices.setdefault(found.devices, []).append(found.name)
    return ", ".join(
        f"{'/'.join(sorted(names))} " + (f"need a {devices[0]} device" if len(devices) == 1
                                         else f"take {' or '.join(devices)}")
        for devices, names in sorted(by_devices.items()))
