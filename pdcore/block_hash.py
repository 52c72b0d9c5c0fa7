"""Chained block hashes: the one definition shared by the engine, the gateway and the Redis index.

Spec (v1)
---------
A prompt's token ids are cut into full blocks of ``block_size`` tokens; a trailing partial block
has no hash. Tokens are serialised as little-endian unsigned 32-bit integers. With ``H`` =
xxh3-128 (digest: 16 bytes, big-endian as ``xxhash`` returns it)::

    root    = H(b"pdserve-block-hash-v1\\0" + seed + b"\\0" + model_id + b"\\0" + str(block_size))
    hash[0] = H(root    + u32le(tokens[0 : bs]))
    hash[i] = H(hash[i-1] + u32le(tokens[i*bs : (i+1)*bs]))

``seed``, ``model_id`` are UTF-8. The seed is fixed by configuration (``CacheConfig.hash_seed``),
never random per process: every process that must agree on hashes uses the same one. A hash
names a prefix, not a block's contents alone, so two equal blocks at different positions (or
after different prefixes) hash differently. Holders of a block confirm a hit by comparing
token ids; the hash alone is only an index.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
import sys

import xxhash

_DOMAIN = b"pdserve-block-hash-v1\0"

BlockHash = bytes  # 16 bytes


def root_hash(seed: str, model_id: str, block_size: int) -> BlockHash:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    material = _DOMAIN + seed.encode() + b"\0" + model_id.encode() + b"\0" + str(block_size).encode()
    return xxhash.xxh3_128_digest(material)


def _u32le(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit here")
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def chain_hash(parent: BlockHash, block_tokens: Sequence[int]) -> BlockHash:
    return xxhash.xxh3_128_digest(parent + _u32le(block_tokens))


class BlockHasher:
    """Hashes full blocks of a token sequence for one (seed, model, block size)."""

    def __init__(self, seed: str, model_id: str, block_size: int):
        self.block_size = block_size
        self.root = root_hash(seed, model_id, block_size)

    def hash_blocks(self, tokens: Sequence[int], start: int = 0,
                    parent: BlockHash | None = None) -> list[BlockHash]:
        """Hashes of full blocks ``start, start+1, ...`` of ``tokens``; ``parent`` is the hash of
        block ``start-1`` (required when ``start > 0``)."""
        if start > 0 and parent is None:
            raise ValueError("parent hash required when start > 0")
        bs = self.block_size
        prev = self.root if start == 0 else parent
        out: list[BlockHash] = []
        for i in range(start, len(tokens) // bs):
            prev = chain_hash(prev, tokens[i * bs:(i + 1) * bs])
            out.append(prev)
        return out


def hash_prompt(tokens: Sequence[int], seed: str, model_id: str, block_size: int) -> list[BlockHash]:
    return BlockHasher(seed, model_id, block_size).hash_blocks(tokens)
