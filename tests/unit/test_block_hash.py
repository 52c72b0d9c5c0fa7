"""Fixed vectors for the block-hash spec (pdcore/block_hash.py): any change to the spec
silently breaks routing across processes of different versions, so it must show up here."""
import xxhash

from pdcore.block_hash import BlockHasher, chain_hash, hash_prompt, root_hash


def test_fixed_vectors():
    assert root_hash("pdserve-v1", "smollm2-135m", 16).hex() == "4bae91fa5b960671a03fa5252d0ff3b8"
    hashes = hash_prompt(list(range(40)), "pdserve-v1", "smollm2-135m", 16)
    assert [h.hex() for h in hashes] == ["9bc9304e4afef71a0d736c5a948955a5",
                                         "f3e6927c27a8f9680286401c3183f91f"]
    assert hash_prompt([1, 2, 3, 4], "s", "m", 2)[1].hex() == "5ebfb33d7e2515b6c1a302872edf58b1"


def test_spec_written_out():
    root = xxhash.xxh3_128_digest(b"pdserve-block-hash-v1\0s\0m\x002")
    h0 = xxhash.xxh3_128_digest(root + (1).to_bytes(4, "little") + (2).to_bytes(4, "little"))
    assert hash_prompt([1, 2, 3], "s", "m", 2) == [h0]


def test_chained_and_partial_blocks():
    h = BlockHasher("s", "m", 4)
    toks = list(range(10))
    full = h.hash_blocks(toks)
    assert len(full) == 2  # trailing partial block has no hash
    assert h.hash_blocks(toks, start=1, parent=full[0]) == full[1:]
    assert chain_hash(full[0], toks[4:8]) == full[1]
    # same block content after a different prefix hashes differently
    other = h.hash_blocks([99] + toks[1:])
    assert other[1] != full[1]


def test_seed_model_and_block_size_are_folded_in():
    toks = list(range(16))
    base = hash_prompt(toks, "s", "m", 16)
    assert hash_prompt(toks, "s2", "m", 16) != base
    assert hash_prompt(toks, "s", "m2", 16) != base
    assert hash_prompt(toks + toks, "s", "m", 32)[0] != hash_prompt(toks + toks, "s", "m", 16)[1]
