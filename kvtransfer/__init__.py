"""Moves KV cache blocks from a prefill worker to a decode worker.

Read in this order: :mod:`kvtransfer.api` (the interface: layout, states, sender, receiver,
what a backend declares), :mod:`kvtransfer.lifecycle` (state machine, timeouts, leases: the
part every backend shares), :mod:`kvtransfer.stream` (source blocks handed over while the
prompt computes), :mod:`kvtransfer.registry` (the one list of backends), then the control
wire (:mod:`kvtransfer.wire`, :mod:`kvtransfer.control`, :mod:`kvtransfer.waits`) and one
backend under :mod:`kvtransfer.backends` (tcp is the smallest).
"""

from kvtransfer.api import (
    IllegalTransition,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    ListenAddress,
    ReceiverStats,
    TransferHandle,
    TransferResult,
    TransferState,
)
from kvtransfer.registry import backends, make_receiver, make_sender
from kvtransfer.stream import BlockStream

__all__ = [
    "BlockStream",
    "IllegalTransition",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferOptions",
    "ListenAddress",
    "ReceiverStats",
    "TransferHandle",
    "TransferResult",
    "TransferState",
    "backends",
    "make_receiver",
    "make_sender",
]
