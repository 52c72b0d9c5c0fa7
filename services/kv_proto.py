"""KV transfer types <-> their protos: one translation, used by both worker roles.

The prefill worker reads the decode worker's layout from a Prefill request, the decode worker
writes its own into one; keeping the translation here (not in either worker package) keeps the
worker packages from importing each other. Imports kvtransfer (torch), so only the workers do.
"""
from __future__ import annotations

from kvtransfer import KVLayout
from protos.pdserve.v1 import common_pb2


def layout_from_proto(pb: common_pb2.KVLayout) -> KVLayout:
    """ValueError for a layout that is not one (non-positive sizes, unknown dtype)."""
    return KVLayout(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, pb.dtype)


def layout_to_proto(layout: KVLayout, tensor_parallel_size: int = 1,
                    kv_heads: tuple[int, int] | None = None) -> common_pb2.KVLayout:
    """``kv_heads``: the model's KV heads ``[start, end)`` the blocks carry (default: all)."""
    start, end = kv_heads or (0, layout.num_kv_heads)
    return common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, block_size=layout.block_size,
                               dtype=layout.dtype, tensor_parallel_size=tensor_parallel_size,
                               kv_head_start=start, kv_head_end=end)


def heads_from_proto(pb: common_pb2.KVLayout) -> tuple[int, int, int]:
    """(tensor_parallel_size, first KV head, end KV head) of a layout, defaults filled in."""
    return (pb.tensor_parallel_size or 1, pb.kv_head_start, pb.kv_head_end or pb.num_kv_heads)
