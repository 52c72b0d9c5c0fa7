"""A quantized KV cache across a real 1P1D pair (tcp): the prefill worker's int8 / fp8
blocks travel with their scales and the decode worker continues token-exact with an engine
using the same KV dtype; a pair whose KV formats differ refuses at the handshake."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from pdserve import client
from pdserve.cluster import LocalCluster
from tests.integration.helpers import gen_many, run, wait_all_free

PROMPTS = [[10 + (i * 37 + j * 11) % 200 for j in range(n)] for i, n in
           enumerate([40, 70, 17, 100])]


def _reqs():
    return [client.make_request(token_ids=p, max_tokens=12, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_1p1d_quantized_kv_matches_colocated(kind):
    ref = LLM("dummy:tiny", kv_dtype=kind).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with LocalCluster("dummy:tiny", prefill=1, decode=1, kv_backend="tcp",
                      worker_args=("--kv-dtype", kind)) as c:
        outs = run(gen_many(c.address, _reqs()))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        stats = run(wait_all_free([w.address for w in c.workers]))
        assert all(s.kv_blocks_used == 0 for s in stats)
        assert sum(s.transferred_bytes for s in stats) > 0


def test_pair_with_different_kv_formats_refuses_the_transfer():
    """int8 prefill, fp8 decode: the prefill worker refuses the transfer at the layout
    check (FAILED_PRECONDITION naming both layouts); the decode worker then prefills the
    request itself, so the tokens are those of its own fp8 engine and no KV moved."""
    ref = LLM("dummy:tiny", kv_dtype="fp8").generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with LocalCluster("dummy:tiny", prefill=1, decode=1, kv_backend="tcp",
                      role_args={"prefill": ("--kv-dtype", "int8"),
                                 "decode": ("--kv-dtype", "fp8")}) as c:
        outs = run(gen_many(c.address, _reqs(), timeout=120))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        stats = run(wait_all_free([w.address for w in c.workers]))
        assert all(s.kv_blocks_used == 0 for s in stats)
        assert sum(s.transferred_bytes for s in stats) == 0


def test_prefill_refusal_names_both_layouts():
    from kvtransfer import KVLayout
    from prefill_worker.call import _layout_text
    assert _layout_text(KVLayout(2, 4, 68, 16, "int8")) == (
        "int8 x 2 layers x 4 heads x 68 per row, blocks of 16")
