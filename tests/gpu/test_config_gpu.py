"""Defaults that need no tuning, on the GPU: a bare LLM(model) picks the GPU and bf16, takes
the GPU's scheduler limits, sizes its KV cache from gpu_memory_utilization after a profiling
pass (an explicit size wins), sets max_model_len to the model's maximum capped by the cache,
and sizes its CUDA graphs by cuda_graph_max_len, not by that maximum.

    pytest -q -m gpu tests/gpu/test_config_gpu.py
"""
import gc

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine.llm import LLM  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

GIB = 1 << 30


@pytest.fixture(autouse=True)
def auto_device(monkeypatch):
    monkeypatch.delenv("PDSERVE_DEVICE", raising=False)  # tests/conftest.py pins the CPU
    yield
    gc.collect()
    torch.cuda.empty_cache()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_bare_llm_runs_on_the_gpu_in_bf16_with_the_gpu_limits():
    llm = LLM("dummy:tiny-llama3")  # max_position 16384
    eng = llm.engine
    c = eng.config
    assert c.device.startswith("cuda") and c.dtype == "bfloat16" and c.async_decode is True
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (512, 8192)
    assert eng.runner.backend.name == "triton" and eng.runner.graphs
    # a small model: the cache holds what 512 sequences of the model's maximum use, no more
    assert eng.max_model_len == 16384 == c.scheduler.max_model_len
    assert eng.runner.num_blocks == 512 * 16384 // 16 == c.cache.num_blocks
    # graphs sized by cuda_graph_max_len (8192 tokens), not by the 16384 maximum
    assert eng.runner.graph_width == 8192 // 16
    assert eng.runner.graph_buckets[-1] == 512
    out = llm.generate([[1, 2, 3, 4]] * 3, greedy(8))
    assert [len(o.token_ids) for o in out] == [8, 8, 8]
    # a sequence past the graphs' width is served (eager decode steps)
    long = LLM("dummy:tiny-llama3", cuda_graph_max_len=64, max_num_seqs=4)
    steps0 = long.engine.runner.eager_steps
    got = long.generate([list(range(3, 100))], greedy(4))[0]
    assert len(got.token_ids) == 4 and long.engine.runner.eager_steps - steps0 >= 4


def test_kv_cache_follows_gpu_memory_utilization_and_an_explicit_size_wins():
    free, total = torch.cuda.mem_get_info()
    if free < 0.6 * total:
        pytest.skip("the GPU is shared: this test needs most of it free")
    llm = LLM("dummy:llama-3-8b", gpu_memory_utilization=0.3, enforce_eager=True)
    eng = llm.engine
    weights = 16 * GIB  # 8.0e9 bf16 parameters
    kv = eng.runner.kv_cache_bytes
    assert kv == eng.config.cache.kv_cache_memory_bytes
    # the share less weights, activations (a few GiB at most) and the 2 GiB reserve
    assert 0.3 * total - weights - 8 * GIB < kv < 0.3 * total - weights
    llm.generate([list(range(3, 4000))], greedy(4))
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= 0.3 * total + GIB
    # llama-3-8b declares 131072 positions; the cache holds more than that here
    assert eng.max_model_len == min(131072, eng.runner.num_blocks * 16)
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    fixed = LLM("dummy:llama-3-8b", kv_cache_memory_bytes=GIB, enforce_eager=True).engine
    assert GIB - (2 << 20) < fixed.runner.kv_cache_bytes <= GIB  # 2 MiB blocks
    assert fixed.max_model_len == fixed.runner.num_blocks * 16  # capped by the cache
    with pytest.raises(ValueError, match="context limit"):
        fixed.validate(list(range(3, fixed.max_model_len + 3)), greedy(1))


def test_two_engines_sharing_the_gpu_each_keep_to_their_share():
    free, total = torch.cuda.mem_get_info()
    if free < 0.95 * total:
        pytest.skip("the GPU is shared: this test needs it free")
    a = LLM("dummy:llama-3-8b", gpu_memory_utilization=0.45, enforce_eager=True)
    b = LLM("dummy:llama-3-8b", gpu_memory_utilization=0.45, enforce_eager=True)
    for llm in (a, b):
        assert llm.engine.runner.kv_cache_bytes > 0.45 * total - 16 * GIB - 8 * GIB
    out = [llm.generate([list(range(3, 300))], greedy(4))[0] for llm in (a, b)]
    assert out[0].token_ids == out[1].token_ids  # same seed, same weights
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= 0.9 * total + 2 * GIB  # with both CUDA contexts' slack


def test_an_8192_token_prompt_is_accepted_by_default():
    llm = LLM("dummy:tiny-llama3", max_num_seqs=8)
    out = llm.generate([[1] + [5 + i % 400 for i in range(8191)]], greedy(4))[0]
    assert len(out.token_ids) == 4 and len(out.prompt_token_ids) == 8192
