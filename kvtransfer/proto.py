"""KVLayout <-> its proto message (common.proto KVLayout): the one translation, used by both
worker roles when they agree on a layout."""
from __future__ import annotations

from kvtransfer.base import KVLayout
from protos.pdserve.v1 import common_pb2


def layout_from_proto(pb: common_pb2.KVLayout) -> KVLayout:
    """Raises ValueError for a layout that is not valid."""
    return KVLayout(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, pb.dtype)


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, block_size=layout.block_size,
                               dtype=layout.dtype)
