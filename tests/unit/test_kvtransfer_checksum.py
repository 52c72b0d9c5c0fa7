"""kvtransfer.checksum: the definition (numpy), the torch path and the Triton kernel agree
exactly, and what it must detect it detects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer import KVLayout
from kvtransfer.api import TransferError
from kvtransfer.checksum import (
    _rows,
    _words,
    block_checksums,
    corrupt_first_byte,
    decode,
    encode,
    kernel_checksums,
    reference_checksums,
    verify,
    word_dtype,
)

LAYOUTS = [
    KVLayout(2, 2, 8, 4, "float32"),     # 1 KiB blocks: int64 words, rows of 64
    KVLayout(3, 1, 3, 1, "bfloat16"),    # 36-byte blocks: int32 words, rows of 1
    KVLayout(1, 1, 3, 1, "uint8"),       # 6-byte blocks: int16 words
    KVLayout(1, 1, 1, 1, "uint8"),       # 2-byte blocks
    KVLayout(4, 4, 64, 16, "bfloat16"),  # 64 KiB blocks
]


def _cache(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * layout.block_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(layout.torch_dtype).view(n, *layout.block_shape)


def _bytes_of(cache: torch.Tensor, ids: list[int]) -> bytes:
    return cache[ids].reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.block_bytes}B")
def test_torch_path_and_kernel_match_the_definition(layout):
    cache = _cache(layout, 24, seed=layout.block_bytes)
    ids = [3, 4, 5, 17, 0, 9, 10, 11, 23, 1]
    want = reference_checksums(_bytes_of(cache, ids), layout.block_bytes)
    assert np.array_equal(block_checksums(cache, ids).numpy(), want)
    words = _words(cache)
    rows, cols = _rows(words.shape[1])
    # rows split over programs, the last one masked (the interpreter runs programs one by
    # one: few of them for the large blocks)
    for per_program in (1, 4, 64) if rows <= 16 else (64,):
        got = kernel_checksums(words, ids[:4] if rows > 16 else ids, rows, cols,
                               rows_per_program=per_program)
        want = want[:len(got)]
        assert np.array_equal(got.numpy(), want), per_program


def test_word_type_follows_the_block_size():
    assert [word_dtype(n) for n in (1024, 36, 6, 3)] == \
        [torch.int64, torch.int32, torch.int16, torch.uint8]


def test_every_single_byte_change_and_swapped_blocks_are_detected():
    layout = LAYOUTS[0]
    cache = _cache(layout, 4, seed=1)
    base = block_checksums(cache, [0, 1, 2, 3]).numpy()
    flat = cache.reshape(-1).view(torch.uint8)
    rng = np.random.default_rng(0)
    for pos in list(range(0, layout.block_bytes, 61)) + [layout.block_bytes - 1]:
        block = int(rng.integers(0, 4))
        at = block * layout.block_bytes + pos
        old = int(flat[at])
        flat[at] = old ^ int(rng.integers(1, 256))
        got = block_checksums(cache, [0, 1, 2, 3]).numpy()
        assert (got != base).tolist() == [b == block for b in range(4)], (block, pos)
        flat[at] = old
    swapped = block_checksums(cache, [1, 0, 2, 3]).numpy()
    assert swapped[0] != base[0] and swapped[1] != base[1]
    corrupt_first_byte(cache, 2, "t")
    assert (block_checksums(cache, [0, 1, 2, 3]).numpy() != base).tolist() == \
        [False, False, True, False]


def test_verify_names_the_first_bad_block_and_the_wire_format_round_trips():
    sums = np.array([5, -7, 1 << 62, 0], dtype=np.int64)
    assert np.array_equal(decode(encode(sums), 4), sums)
    with pytest.raises(TransferError, match="checksum message of 24 bytes for 4 blocks"):
        decode(encode(sums[:3]), 4)
    verify(sums, sums.copy(), [10, 11, 12, 13])
    bad = sums.copy()
    bad[[1, 3]] += 1
    with pytest.raises(TransferError, match=r"block 1 of 4 \(destination block 11\) and 1 "
                                            r"more arrived corrupted"):
        verify(sums, bad, [10, 11, 12, 13])
