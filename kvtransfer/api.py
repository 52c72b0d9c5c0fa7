"""The kvtransfer interface: layout, transfer states and results, sender, receiver, backend.

A KV cache is ONE tensor of shape ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` ("block-major"): block ``b`` is one contiguous region of ``block_bytes`` bytes
holding every layer's K and V. kvtransfer moves whole blocks between two such tensors; it
never imports the engine, it only sees the tensor, a :class:`KVLayout` and block ids.

Lifecycle of one transfer (both sides keep the same state machine)::

    decode (receiver)                         prefill (sender)
    handle = rx.expect(tid, dst_ids, t)  -->  (tid and rx.endpoint travel via the control plane)
      PENDING                                 res = await tx.send(tid, endpoint, src_ids, t)
      TRANSFERRING  <-- header + payload --     PENDING -> TRANSFERRING
      DONE          --       ack         -->    DONE
    res = await handle.wait()

A sender may start before its source blocks are computed (a ``BlockStream``): the
handshake then overlaps the forward pass, and each prefill chunk's blocks move while later
chunks compute (nccl: while the chunk itself computes, layer by layer).

Every transfer ends in exactly one of DONE, FAILED, TIMED_OUT, CANCELLED, and always by its
timeout. Leases: the sender reads the source blocks only while ``send()`` runs, so the caller
keeps those blocks allocated (holds a lease) until ``send()`` returns, whatever the result.
The receiver writes the destination blocks only between ``expect()`` and the end of the
transfer; once ``handle.wait()`` has returned (or ``cancel()`` was called) it never touches
them again, so the caller may free them.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
# Packed caches: the tensor's bytes follow a format its dtype alone does not describe (the
# engine's quantized KV cache: per block, layer and K/V, the codes then the float32 scales;
# engine.quant.kv). The layout names the format, so two workers whose formats differ (also
# builds from before this format) refuse each other's blocks instead of misreading them.
PACKED_DTYPES = {"int8/slab": torch.int8, "fp8/slab": torch.float8_e4m3fn}
_DTYPES.update(PACKED_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block; two caches can exchange blocks iff their layouts are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} not one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        numel = 1
        for n in self.block_shape:
            numel *= n
        return numel * self.torch_dtype.itemsize

    @classmethod
    def from_cache(cls, cache: torch.Tensor, block_size: int | None = None,
                   packed: str | None = None) -> KVLayout:
        """Layout of a block-major cache tensor (``block_size`` is checked when given);
        ``packed`` names the format of a packed cache (PACKED_DTYPES) of that dtype."""
        if packed is not None and PACKED_DTYPES.get(packed) != cache.dtype:
            raise ValueError(f"packed format {packed!r} is not one of a {cache.dtype} cache "
                             f"({sorted(k for k, v in PACKED_DTYPES.items() if v == cache.dtype)})")
        if cache.dim() != 6 or cache.shape[2] != 2:
            raise ValueError(
                "KV cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(cache.shape)}"
            )
        _, layers, _, bs, heads, head_dim = cache.shape
        if block_size is not None and bs != block_size:
            raise ValueError(f"cache block_size is {bs}, expected {block_size}")
        return cls(layers, heads, head_dim, bs, packed or dtype_name(cache.dtype))

    def validate(self, cache: torch.Tensor, *, need_contiguous_cpu: bool = False) -> None:
        """Raise ValueError unless ``cache`` is a block-major cache with this layout."""
        actual = KVLayout.from_cache(cache,
                                     packed=self.dtype if self.dtype in PACKED_DTYPES else None)
        if actual != self:
            raise ValueError(f"cache layout {actual} does not match {self}")
        if need_contiguous_cpu and (cache.device.type != "cpu" or not cache.is_contiguous()):
            raise ValueError("this backend needs a contiguous CPU cache tensor")


class TransferError(Exception):
    """A transfer failed for a reason both sides can name (rejection, protocol error)."""


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {TransferState.DONE, TransferState.FAILED, TransferState.TIMED_OUT, TransferState.CANCELLED}
)
_ENDINGS = frozenset({TransferState.FAILED, TransferState.TIMED_OUT, TransferState.CANCELLED})
ALLOWED_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.TRANSFERRING}) | _ENDINGS,
    TransferState.TRANSFERRING: frozenset({TransferState.DONE}) | _ENDINGS,
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.TIMED_OUT: frozenset(),
    TransferState.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transfer was moved along an edge its state machine does not have."""


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    state: TransferState
    num_bytes: int
    seconds: float
    error: str | None = None
    # GPU backends: the data movement alone (device copy / NCCL kernels / NIXL READ), without
    # the control-connection handshake that ``seconds`` includes
    data_seconds: float | None = None
    # streamed sends (a BlockStream): from the last block being handed over to the end, i.e.
    # what the transfer adds after the prompt was computed (``seconds`` then includes the
    # forward pass it overlapped); for a list of ids the same as ``seconds``
    tail_seconds: float | None = None
    # receiver, GPU backends: the pieces contiguous in both caches it moved (one copy, NCCL
    # segment or NIXL descriptor run each; kvtransfer.control.segments): how fragmented the
    # two caches' blocks were; None where the backend does not count them
    pieces: int | None = None

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (1e9 bytes per second)."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ReceiverStats:
    active_transfers: int  # expected and not yet ended (PENDING or TRANSFERRING)
    bytes_received: int  # payload bytes written into the cache, all transfers
    done: int
    failed: int  # FAILED + TIMED_OUT + CANCELLED


class TransferHandle(abc.ABC):
    """What ``KVReceiver.expect`` returns: one expected transfer on the decode side."""

    transfer_id: str

    @property
    @abc.abstractmethod
    def state(self) -> TransferState: ...

    @abc.abstractmethod
    async def wait(self) -> TransferResult:
        """The final result; returns no later than the transfer's timeout."""

    @abc.abstractmethod
    def assign(self, dst_block_ids: list[int]) -> None:
        """The destination block ids of a transfer expected by count (ValueError if they do
        not match it, or the transfer already has its ids)."""


class KVReceiver(abc.ABC):
    """Decode side: writes incoming blocks into its cache."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind/listen; ``endpoint`` is valid afterwards."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Opaque address a sender connects to, e.g. ``tcp://127.0.0.1:5555``."""

    @abc.abstractmethod
    def expect(self, transfer_id: str, dst_block_ids: list[int] | int,
               timeout_s: float) -> TransferHandle:
        """Register a transfer before the sender sends; must be called in the event loop.

        ``dst_block_ids``: the blocks to write, or their number, the ids following through
        ``handle.assign`` (a sender may connect before that; nothing is written until then,
        and the transfer's timeout still runs)."""

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> bool:
        """End the transfer as CANCELLED (no more writes to its blocks); False if not active."""

    @abc.abstractmethod
    def stats(self) -> ReceiverStats: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Cancel active transfers and release sockets / shared memory."""


class KVSender(abc.ABC):
    """Prefill side: reads blocks from its cache and ships them to a receiver."""

    @abc.abstractmethod
    async def send(
        self, transfer_id: str, endpoint: str, src_block_ids, timeout_s: float,
        accepted: asyncio.Event | None = None,
    ) -> TransferResult:
        """Send the blocks; DONE only once the receiver acked having them.

        ``accepted`` is set once the receiver accepted the transfer: from then on the
        receiver hears of its end however it ends (its waiter gets the result), so a caller
        may tell the decode side to rely on the receiver before ``send()`` returns.

        ``src_block_ids``: a list of ids, or a :class:`kvtransfer.stream.BlockStream` that
        hands them over while the prompt still computes (the handshake and the parts already
        computed overlap the rest of the forward pass).

        Never raises on network problems (returns FAILED / TIMED_OUT; CANCELLED after
        ``cancel``); raises ValueError for invalid arguments. The cache is read only while
        this coroutine runs: keep the source blocks leased until it returns.
        """

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> bool:
        """Make a running ``send`` return CANCELLED; False if no such send is running."""

    @abc.abstractmethod
    async def close(self) -> None: ...


def option(default: Any, help: str, *, minimum: int | None = None,
           maximum: int | None = None) -> Any:
    """A field of an options dataclass: its default, a help line and, for numbers, a range
    (checked by :func:`check_options`)."""
    return field(default=default, metadata={"help": help, "min": minimum, "max": maximum})


def check_options(options: Any) -> None:
    """Validate an options dataclass (call from its ``__post_init__``): each field holds a
    value of its default's type (an int is no bool) within its declared range; ValueError
    naming the field otherwise."""
    for f in fields(options):
        if f.metadata.get("object"):
            continue
        value = getattr(options, f.name)
        kind = type(f.default)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)) or \
                kind is not int and not isinstance(value, kind):
            raise ValueError(f"{type(options).__name__}.{f.name} must be of type "
                             f"{kind.__name__}, got {value!r}")
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if low is not None and value < low or high is not None and value > high:
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise ValueError(f"{type(options).__name__}.{f.name} must be {bounds}, "
                             f"got {value!r}")


@dataclass(frozen=True)
class KVTransferOptions:
    """Options every backend honours (each backend's own are in its module)."""

    timeline: bool = option(False, "log, when each transfer ends, the time of each phase its "
                                   "backend marked (ms since it began, per side): where a "
                                   "transfer's time goes")
    checksums: bool = option(True, "send a checksum of every block with the data and verify "
                                   "it on arrival (a mismatch fails the transfer); both "
                                   "sides must agree")
    corrupt_every: int = option(
        0, "fault injection, for tests and the chaos kit: flip one byte of the data of every "
           "N-th transfer on its way (0: never). The side that moves the data does it: the "
           "sender for tcp, shm, fake and nccl, the receiver for cuda_ipc and nixl (they "
           "read the sender's memory); the receiver's checksums then fail the transfer",
        minimum=0)
    # the worker's cluster identity (kvtransfer.secure.KVTls): control connections (and the
    # tcp backend's data) run over mutual TLS; None: plaintext. Set by the worker, not by
    # an environment variable.
    tls: Any = field(default=None, compare=False, repr=False, metadata={
        "object": True, "help": "the worker's cluster identity: mutual TLS on control "
                                "connections (set by the worker; None: plaintext)"})

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class ListenAddress:
    """Where a receiver of a TCP-listening backend (``BackendSpec.listener``) listens, and
    the host it tells senders to dial (never a wildcard bind address)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # default: ``host``
    advertise_port: int = 0  # default: the bound port (a proxy's port, say)

    def __post_init__(self) -> None:
        for name in ("port", "advertise_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend module declares about itself (its module-level ``BACKEND``); the
    registry lists the modules, everything else about a backend is read from here.

    ``sender(cache, layout, options, shared)`` / ``receiver(cache, layout, options, shared,
    listen)`` build its sender and receiver: ``options`` is an instance of ``options`` (the
    backend's frozen options dataclass), ``shared`` a :class:`KVTransferOptions`, ``listen``
    a :class:`ListenAddress` for ``listener`` backends, else None. ``available()`` says
    whether it can be built here at all (nixl: the package imports).
    """

    name: str
    devices: tuple[str, ...]  # cache device types it moves blocks of: "cpu", "cuda"
    listener: bool  # its receiver listens on a TCP port (host / port / advertise host)
    options: type  # its options dataclass (all fields with defaults)
    sender: Callable[..., KVSender]
    receiver: Callable[..., KVReceiver]
    available: Callable[[], bool] = lambda: True

    def serves(self, device: str) -> bool:
        """Whether a cache on ``device`` (``"cpu"``, ``"cuda:1"``, ...) can be moved."""
        return device.split(":", 1)[0] in self.devices
