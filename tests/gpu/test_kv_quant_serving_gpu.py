"""An FP8 KV cache across a real 1P1D pair on one GPU: prefill and decode workers as two
processes on the same GPU, the KV blocks (codes and scales) moved by cuda_ipc, and the
decode worker's tokens equal to a colocated engine's with the same FP8 KV cache.

Requests go one at a time, so the decode worker steps a batch of one, as the reference
engine does (a different batch could change bf16 rounding and, through the cache's
codes, a near-tie token).

    PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_kv_quant_serving_gpu.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

MODEL = "dummy:smollm2-135m"
PROMPTS = [[10 + (i * 37 + j * 11) % 20000 for j in range(n)] for i, n in
           enumerate([40, 70, 17, 300, 129])]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_1p1d_cuda_ipc_quantized_kv_matches_colocated(kind):
    from engine import LLM, SamplingParams
    from pdserve import client
    from pdserve.cluster import LocalCluster
    from tests.integration.helpers import gen_many, run, wait_all_free
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(MODEL, device="cuda", kv_dtype=kind, kv_cache_memory_bytes=1 << 30,
              max_model_len=1024)
    ref = [llm.generate([p], sp)[0].token_ids for p in PROMPTS]
    del llm
    torch.cuda.empty_cache()
    with LocalCluster(MODEL, prefill=1, decode=1, kv_backend="cuda_ipc",
                      devices={"prefill": ["cuda:0"], "decode": ["cuda:0"]},
                      worker_args=("--kv-dtype", kind, "--max-model-len", "1024")) as c:
        got = []
        for p in PROMPTS:
            req = client.make_request(token_ids=p, max_tokens=16, ignore_eos=True)
            got.append(run(gen_many(c.address, [req]))[0].token_ids)
        stats = run(wait_all_free([w.address for w in c.workers]))
    assert got == ref
    assert all(s.kv_blocks_used == 0 for s in stats)
    assert sum(s.transferred_bytes for s in stats) > 0  # the blocks moved, not re-prefilled
