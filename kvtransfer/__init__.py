"""Moves KV cache blocks from a prefill worker to a decode worker (see kvtransfer.base)."""

from kvtransfer.base import (
    IllegalTransition,
    KVLayout,
    KVReceiver,
    KVSender,
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
    "ReceiverStats",
    "TransferHandle",
    "TransferResult",
    "TransferState",
    "backends",
    "make_receiver",
    "make_sender",
]
