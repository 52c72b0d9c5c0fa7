"""NIXL backend: the decode side READs the blocks straight out of the prefill side's cache.

Built on NVIDIA NIXL (``pip install nixl-cu13``, import name ``nixl_cu13``) with its UCX
backend. Each side creates ONE nixl agent and registers its WHOLE cache tensor once, at
construction (VRAM for a cuda cache, DRAM for a CPU cache); a transfer is then a single READ
request with one descriptor per :func:`~kvtransfer.control.segments` piece (a run of blocks
contiguous in both caches): per-descriptor cost dominates NIXL transfers, so few large
descriptors matter far more than anything else here.

Per transfer, on the control connection of :mod:`kvtransfer.control`::

    sender (prefill)                             receiver (decode)
    HELLO                                    ->  claim the expected transfer
                                             <-  OK
    BLOB offer: agent name + metadata,       ->  load the sender's agent (first time only),
      cache base / device / memory type,         READ one descriptor per segment, poll it
      source block ids                           (a sender that hangs up ends it at once)
    BLOB the blocks' checksums (computed     ->  compare them with the landed blocks' own
      while the receiver READs)
                                             <-  OK (read done and intact: DONE)

The READ is one-sided: the sender's cache is read by the receiver, not by ``send()``, and
the sender's caller may reuse the source blocks once ``send()`` returned. So a send that
fails after its offer went out (timeout, cancel) does not return at once: it tells the
receiver and waits until the receiver answered or hung up
(:func:`~kvtransfer.control.until_receiver_stopped`); a receiver that hears of it stops its
READ before it hangs up. A READ that completes therefore always ran while the sender held
its blocks, and DONE needs no confirmation round trip.

The receiver never writes into its blocks once the transfer ended: the end of a transfer
(cancel, timeout, close) waits for a READ still in flight to stop and releases its handle
before ``handle.wait()`` returns. That wait blocks the event loop for at most what remains of
the READ (milliseconds on NVLink / RDMA), bounded by ``DRAIN_TIMEOUT_S``.

For a cuda cache the READ runs outside torch's stream order: the kernels that wrote the
source blocks must have completed before ``send()`` (they have once the prefill step's
output was read back to the host), and the decode side must not use the destination blocks
before ``handle.wait()`` returned DONE.

The agent metadata (a few hundred bytes) travels with every offer, so a receiver that
restarted, or evicted the sender's agent, needs no extra round trip to learn it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer import checksum, wire
from kvtransfer.api import (
    BackendSpec,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    ListenAddress,
    TransferError,
    check_options,
    option,
)
from kvtransfer.blocks import segments
from kvtransfer.control import await_ack, control_receiver, control_sender, hold_lease
from kvtransfer.lifecycle import ExpectedTransfer, TransferStateMachine
from kvtransfer.stream import BlockStream
from kvtransfer.waits import poll_in_thread

logger = logging.getLogger(__name__)

NIXL_BACKENDS = ["UCX"]
# poll() timeout of the UCX progress thread, which otherwise wakes on UCX events only. nixl's
# python API hard-codes 0, which turns that thread into a busy loop: a whole core per agent,
# and slower transfers on a loaded host.
PROGRESS_THREAD_DELAY_US = 1000
DRAIN_TIMEOUT_S = 1.0  # most the end of a transfer waits (blocking) for a READ in flight
SETTLE_TIMEOUT_S = 2.0  # most a failed transfer waits (not blocking) for its READ to stop
MAX_REMOTE_AGENTS = 64  # sender agents a receiver keeps loaded (idle ones are evicted)
OFFER_VERSION = 1


@dataclass(frozen=True)
class NixlOptions:
    max_descriptor_bytes: int = option(
        0, "receiver: descriptors are cut to at most this many bytes, so UCX can move the "
           "pieces of one large segment concurrently; 0: one descriptor per segment",
        minimum=0)
    verbose_logs: bool = option(False, "keep nixl's INFO logs (it logs every agent creation "
                                       "on stdout); off: its Python logger is kept at WARNING")

    def __post_init__(self) -> None:
        check_options(self)

_OFFER_HEAD = struct.Struct("!I")
_nixl_module = None


def _import_nixl():
    """The ``nixl_cu13`` module, or RuntimeError saying how to install it."""
    global _nixl_module
    if _nixl_module is not None:
        return _nixl_module
    saved = logging.raiseExceptions  # nixl's logging setup turns it off process-wide
    try:
        import nixl_cu13
    except Exception as exc:  # ImportError, or OSError from a shared library it lacks
        raise RuntimeError(
            "the nixl kvtransfer backend needs NVIDIA NIXL: pip install nixl-cu13 "
            f"(import nixl_cu13 failed: {type(exc).__name__}: {exc})") from exc
    finally:
        logging.raiseExceptions = saved
    _nixl_module = nixl_cu13
    return nixl_cu13


def nixl_available() -> bool:
    """Whether ``nixl_cu13`` imports here (the backend can be constructed)."""
    try:
        _import_nixl()
    except RuntimeError:
        return False
    return True


def _new_agent(nixl, name: str):
    """A nixl agent with a UCX backend and a progress thread that sleeps when idle.

    ``nixl_agent`` fills the binding's config itself (``pthrDelay = 0``); the binding's
    constructor is wrapped for this one synchronous call to raise that to
    PROGRESS_THREAD_DELAY_US. Without the expected internals it is left as nixl has it.
    """
    config = nixl.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                    backends=list(NIXL_BACKENDS))
    bindings = getattr(getattr(nixl, "_api", None), "nixlBind", None)
    real = getattr(bindings, "nixlAgent", None)
    if real is None:
        return nixl.nixl_agent(name, config)

    def make(agent_name, cfg):
        if getattr(cfg, "pthrDelay", None) == 0:
            cfg.pthrDelay = PROGRESS_THREAD_DELAY_US
        return real(agent_name, cfg)

    bindings.nixlAgent = make
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bindings.nixlAgent = real


class _Agent:
    """One nixl agent with the whole cache tensor registered once."""

    def __init__(self, role: str, cache: torch.Tensor, verbose_logs: bool = False) -> None:
        nixl = _import_nixl()
        if not verbose_logs:  # nixl logs every agent creation at INFO on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        if not cache.is_contiguous():
            raise ValueError("the nixl backend needs a contiguous cache tensor")
        if cache.device.type == "cuda":
            self.mem = "VRAM"
            self.dev = (cache.device.index if cache.device.index is not None
                        else torch.cuda.current_device())
        elif cache.device.type == "cpu":
            self.mem, self.dev = "DRAM", 0
        else:
            raise ValueError(f"the nixl backend needs a cpu or cuda cache, not {cache.device}")
        self.base = cache.data_ptr()
        self.nbytes = cache.numel() * cache.element_size()
        self.name = f"pdkv-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._reg = None
        try:
            self.agent = _new_agent(nixl, self.name)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own exception types
            raise RuntimeError(f"nixl agent could not start: {type(exc).__name__}: {exc}") from exc
        missing = [b for b in NIXL_BACKENDS if b not in self.agent.backends]
        if missing:
            self.agent = None
            raise RuntimeError(f"nixl backend plugin(s) {missing} not available")
        try:
            self._reg = self.agent.register_memory(
                [(self.base, self.nbytes, self.dev, "")], self.mem)
            self.metadata: bytes = self.agent.get_agent_metadata()
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise RuntimeError(f"nixl could not register the {self.mem} cache "
                               f"({self.nbytes} bytes): {type(exc).__name__}: {exc}") from exc
        logger.debug("nixl agent %s registered %d bytes of %s (device %d)", self.name,
                     self.nbytes, self.mem, self.dev)

    def close(self) -> None:
        """Deregister the cache and drop the agent (its UCX worker and progress thread)."""
        agent, self.agent = self.agent, None
        reg, self._reg = self._reg, None
        if agent is not None and reg is not None:
            try:
                agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                logger.warning("nixl agent %s: deregister failed", self.name, exc_info=True)
        del agent  # the last reference: the agent is destroyed now


class _Offer:
    """What the sender tells the receiver: where its blocks are and how to reach them.

    Wire: ``!I`` header length, a json header, ``n`` source ids as little-endian int64,
    then the agent metadata (``md_len`` bytes).
    """

    def __init__(self, agent: str, metadata: bytes, mem: str, dev: int, base: int,
                 block_bytes: int, num_blocks: int, src_ids: np.ndarray) -> None:
        self.agent, self.metadata = agent, metadata
        self.mem, self.dev, self.base = mem, dev, base
        self.block_bytes, self.num_blocks = block_bytes, num_blocks
        self.src_ids = src_ids

    def encode(self) -> bytes:
        head = json.dumps({
            "v": OFFER_VERSION, "agent": self.agent, "mem": self.mem, "dev": self.dev,
            "base": self.base, "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks, "n": len(self.src_ids),
            "md_len": len(self.metadata),
        }, separators=(",", ":")).encode()
        ids = np.asarray(self.src_ids, dtype="<i8").tobytes()
        return _OFFER_HEAD.pack(len(head)) + head + ids + self.metadata

    @classmethod
    def decode(cls, data: bytes) -> _Offer:
        try:
            (head_len,) = _OFFER_HEAD.unpack_from(data)
            end = _OFFER_HEAD.size + head_len
            head = json.loads(data[_OFFER_HEAD.size:end])
            if head["v"] != OFFER_VERSION:
                raise TransferError(f"nixl offer version {head['v']} not supported")
            n, md_len = int(head["n"]), int(head["md_len"])
            if n < 0 or md_len <= 0 or len(data) != end + 8 * n + md_len:
                raise ValueError(f"offer of {len(data)} bytes, header says n={n} md={md_len}")
            ids = np.frombuffer(data, dtype="<i8", count=n, offset=end)
            offer = cls(str(head["agent"]), data[end + 8 * n:], str(head["mem"]),
                        int(head["dev"]), int(head["base"]), int(head["block_bytes"]),
                        int(head["num_blocks"]), ids)
        except TransferError:
            raise
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise TransferError(f"bad nixl offer: {type(exc).__name__}: {exc}") from exc
        if offer.mem not in ("DRAM", "VRAM") or offer.dev < 0 or offer.base <= 0:
            raise TransferError(f"bad nixl offer: memory {offer.mem} device {offer.dev}")
        if (offer.block_bytes <= 0 or offer.num_blocks <= 0
                or offer.base + offer.num_blocks * offer.block_bytes >= 1 << 64):
            raise TransferError(f"bad nixl offer: {offer.num_blocks} blocks of "
                                f"{offer.block_bytes} bytes at {offer.base:#x}")
        return offer


class _Read:
    """One posted nixl READ. ``abort`` guarantees nixl writes no more into the blocks.

    ``done`` may be polled from a helper thread: a lock keeps its state checks apart from
    the handle's release in ``abort`` (which a transfer's end may run on the loop)."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self._handle = None
        self._finished = False
        self._lock = threading.RLock()
        self.broken = False  # nixl itself failed: the remote agent should be reloaded

    def post(self, local, remote, remote_agent: str) -> None:
        try:
            self._handle = self._agent.initialize_xfer("READ", local, remote, remote_agent)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own exception types
            self.broken = True
            raise TransferError(f"nixl could not create the READ: {type(exc).__name__}: "
                                f"{exc}") from exc
        try:
            state = self._agent.transfer(self._handle)
        except Exception as exc:  # noqa: BLE001
            state, why = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            why = "error status"
        if state == "ERR":
            self.broken = True
            self.abort()
            raise TransferError(f"nixl could not post the READ: {why}")
        self._finished = state == "DONE"

    def _state(self) -> str:
        try:
            return self._agent.check_xfer_state(self._handle)
        except Exception as exc:  # noqa: BLE001
            logger.debug("nixl READ state check failed: %r", exc)
            return "ERR"

    def done(self) -> bool:
        """True once the data is in place; TransferError if the READ failed."""
        with self._lock:
            if self._finished:
                return True
            if self._handle is None:
                raise TransferError("nixl READ aborted")
            state = self._state()
            if state == "ERR":
                self.broken = True
                raise TransferError("nixl READ failed (see the nixl log for the cause)")
            self._finished = state == "DONE"
            return self._finished

    def _in_flight(self) -> bool:
        with self._lock:
            return not self._finished and self._handle is not None and self._state() == "PROC"

    async def settle(self) -> None:
        """Let a READ that is still running end by itself, without blocking the loop."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        delay = 0.0002
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.005)

    def abort(self) -> None:
        """Release the handle; a READ still in flight is first waited for (blocking, at most
        DRAIN_TIMEOUT_S): UCX cannot take back a posted RDMA/IPC read. Idempotent."""
        with self._lock:
            self._abort()

    def _abort(self) -> None:
        if self._handle is None:
            return
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._in_flight():
            if time.monotonic() > deadline:
                self.broken = True
                logger.error("nixl READ still running after %.1fs; cancelling it, its blocks "
                             "may still be written", DRAIN_TIMEOUT_S)
                break
            time.sleep(0.00005)
        handle, self._handle = self._handle, None
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - nixl keeps it and retries when the agent goes
            self.broken = True
            logger.error("nixl could not release a READ handle", exc_info=True)


class _Remote:
    __slots__ = ("refs", "broken")

    def __init__(self) -> None:
        self.refs = 0
        self.broken = False


class NixlPayloadReceiver:
    """Decode side: READs each transfer's blocks from the sender's registered cache."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: NixlOptions) -> None:
        self._cache = cache
        self._layout = layout
        limit = options.max_descriptor_bytes
        self._max_blocks = max(1, limit // layout.block_bytes) if limit > 0 else 0
        self._nixl = _Agent("rx", cache, options.verbose_logs)
        self._remotes: OrderedDict[str, _Remote] = OrderedDict()

    async def start(self) -> None:
        pass

    def close(self) -> None:
        for name in list(self._remotes):
            self._drop_remote(name)
        self._nixl.close()

    async def receive(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      entry: ExpectedTransfer) -> str:
        offer = _Offer.decode(await wire.read_blob(loop, conn))
        bb = self._layout.block_bytes
        if offer.block_bytes != bb:
            raise TransferError(f"nixl offer has {offer.block_bytes}-byte blocks, not {bb}")
        if len(offer.src_ids) != len(entry.dst_block_ids):
            raise TransferError(f"nixl offer has {len(offer.src_ids)} blocks, "
                                f"expected {len(entry.dst_block_ids)}")
        if offer.src_ids.min() < 0 or offer.src_ids.max() >= offer.num_blocks:
            raise TransferError("nixl offer has source block ids out of range")
        local, remote, pieces = self._descriptors(offer, entry.dst_block_ids)
        entry.add_pieces(pieces)
        if self._nixl.agent is None:
            raise TransferError("nixl receiver closed")
        if entry.state.terminal:  # ended meanwhile (its cancel reaches us at the next await)
            raise TransferError(f"transfer {entry.transfer_id} already {entry.state.value}")
        remote_state = self._use_remote(offer)
        read = _Read(self._nixl.agent)
        entry.on_end(read.abort)  # runs when the transfer ends, before handle.wait() returns
        try:
            t_post = time.perf_counter()
            read.post(local, remote, offer.agent)
            try:
                # polled from a helper thread: the loop's timers would round each back-off
                # up to a millisecond, as long as a whole 512 MiB READ over NVLink
                await poll_in_thread(read.done, max_interval_s=0.0001, watch=conn,
                                     what="the nixl READ")
            except TransferError:
                await read.settle()
                raise
            seconds = time.perf_counter() - t_post
            read.abort()  # done: just releases the handle
            await self._verify(loop, conn, entry)
            entry.add_bytes(len(entry.dst_block_ids) * bb)
            return wire.data_seconds_message("read done", seconds)
        finally:
            read.abort()
            remote_state.broken |= read.broken
            self._unuse_remote(offer.agent, remote_state)

    async def _verify(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      entry: ExpectedTransfer) -> None:
        """After the READ: the blocks against the sender's checksums (fault injection first
        damages one, as a READ gone wrong would)."""
        if entry.corrupt:
            checksum.corrupt_first_byte(self._cache, entry.dst_block_ids[0], entry.transfer_id)
        if entry.checksums:
            await checksum.check_arrived(loop, conn, self._cache, entry.dst_block_ids)

    def _descriptors(self, offer: _Offer, dst_ids: list[int]):
        """Local and remote nixl descriptor lists: one ``(address, length, device)`` row per
        piece contiguous in both caches (split at ``max_descriptor_bytes``), and the count of
        those pieces before the split."""
        bb = self._layout.block_bytes
        segs = segments(offer.src_ids.tolist(), dst_ids)
        pieces = np.asarray(split_pieces(segs, self._max_blocks), dtype=np.uint64)
        lengths = pieces[:, 2] * np.uint64(bb)
        local = np.empty((len(pieces), 3), dtype=np.uint64)
        local[:, 0] = np.uint64(self._nixl.base) + pieces[:, 1] * np.uint64(bb)
        local[:, 1] = lengths
        local[:, 2] = self._nixl.dev
        remote = np.empty_like(local)
        remote[:, 0] = np.uint64(offer.base) + pieces[:, 0] * np.uint64(bb)
        remote[:, 1] = lengths
        remote[:, 2] = offer.dev
        agent = self._nixl.agent
        if agent is None:
            raise TransferError("nixl receiver closed")
        try:
            local_descs = agent.get_xfer_descs(local, self._nixl.mem)
            remote_descs = agent.get_xfer_descs(remote, offer.mem)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"nixl descriptor lists: {type(exc).__name__}: {exc}") from exc
        if local_descs is None or remote_descs is None:
            raise TransferError("nixl rejected the descriptor lists")
        return local_descs, remote_descs, len(segs)

    def _use_remote(self, offer: _Offer) -> _Remote:
        """The sender's agent, loaded from its metadata the first time it shows up."""
        state = self._remotes.get(offer.agent)
        if state is None:
            self._evict_idle_remotes()
            try:
                loaded = self._nixl.agent.add_remote_agent(offer.metadata)
            except Exception as exc:  # noqa: BLE001
                raise TransferError(f"nixl could not load agent {offer.agent}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            if isinstance(loaded, bytes):
                loaded = loaded.decode(errors="replace")
            if loaded != offer.agent:
                self._remove_remote_agent(loaded)
                raise TransferError(f"nixl metadata is for agent {loaded}, "
                                    f"offer came from {offer.agent}")
            state = self._remotes[offer.agent] = _Remote()
        self._remotes.move_to_end(offer.agent)
        state.refs += 1
        return state

    def _unuse_remote(self, name: str, state: _Remote) -> None:
        state.refs -= 1
        if state.broken and state.refs == 0 and self._remotes.get(name) is state:
            self._drop_remote(name)  # the next offer from it loads it afresh

    def _evict_idle_remotes(self) -> None:
        while len(self._remotes) >= MAX_REMOTE_AGENTS:
            idle = next((n for n, s in self._remotes.items() if s.refs == 0), None)
            if idle is None:
                return
            self._drop_remote(idle)

    def _drop_remote(self, name: str) -> None:
        self._remotes.pop(name, None)
        self._remove_remote_agent(name)

    def _remove_remote_agent(self, name: str) -> None:
        if self._nixl.agent is None:
            return
        try:
            self._nixl.agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001
            logger.debug("nixl: removing remote agent %s failed", name, exc_info=True)


class NixlPayloadSender:
    """Prefill side: offers its registered blocks; the receiver READs them."""

    eager = True

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: NixlOptions) -> None:
        self._cache = cache
        self._layout = layout
        self._nixl = _Agent("tx", cache, options.verbose_logs)
        # the source blocks' checksums (a GPU cache's, on a stream of their own)
        self._sums_stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None

    def close(self) -> None:
        self._nixl.close()

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                   sm: TransferStateMachine, blocks: BlockStream) -> None:
        # one READ per transfer: the handshake overlapped the prompt's forward pass, the
        # blocks move once all of them are computed
        ids = await blocks.all(watch=sock)
        nixl = self._nixl
        if nixl.agent is None:
            raise TransferError("nixl sender closed")
        offer = _Offer(nixl.name, nixl.metadata, nixl.mem, nixl.dev, nixl.base,
                       self._layout.block_bytes, self._cache.shape[0], np.asarray(ids))
        try:
            await loop.sock_sendall(sock, wire.encode_blob(offer.encode()))
            if sm.checksums:  # computed while the receiver READs
                sums = checksum.SourceSums(self._cache, self._sums_stream)
                sums.add(ids)
                await checksum.send_checksums(loop, sock, await sums.collect(watch=sock))
            done = await await_ack(loop, sock, sm)  # the READ is done and so is the transfer
        except BaseException as exc:  # the receiver may be reading: keep the blocks leased
            await hold_lease(loop, sock, sm, exc)
            raise
        sm.data_seconds = wire.parse_data_seconds(done)


def split_pieces(pieces: list[tuple[int, int, int]],
                 max_blocks: int) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` pieces cut to at most ``max_blocks`` blocks each (0: as they are).

    ``split_pieces([(0, 8, 5)], 2)`` -> ``[(0, 8, 2), (2, 10, 2), (4, 12, 1)]``.
    """
    if max_blocks <= 0:
        return list(pieces)
    out = []
    for s, d, n in pieces:
        for k in range(0, n, max_blocks):
            out.append((s + k, d + k, min(max_blocks, n - k)))
    return out


def make_sender(cache: torch.Tensor, layout: KVLayout, options: NixlOptions,
                shared: KVTransferOptions) -> KVSender:
    layout.validate(cache)
    return control_sender(cache, layout, "nixl", wire.KIND_NIXL,
                          NixlPayloadSender(cache, layout, options), shared)


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: NixlOptions,
                  shared: KVTransferOptions, listen: ListenAddress | None) -> KVReceiver:
    layout.validate(cache)
    return control_receiver(cache, layout, "nixl", wire.KIND_NIXL,
                            NixlPayloadReceiver(cache, layout, options), shared, listen)


BACKEND = BackendSpec(name="nixl", devices=("cpu", "cuda"), listener=True,
                      options=NixlOptions, sender=make_sender, receiver=make_receiver,
                      available=nixl_available)
