"""Tensor parallelism on GPUs (NCCL, eager): needs two GPUs (issue 28; not run in issue 27,
which built and proved TP on CPUs with gloo). Run on a 2-GPU machine:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py
"""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [[1] + [(13 * i + 7 * j) % 500 + 3 for j in range(8 + 9 * i)] for i in range(8)]


def _run(tp: int, dtype: str, model: str = "dummy:tiny"):
    with LLM(model, device="cuda:0", dtype=dtype, tensor_parallel_size=tp,
             max_model_len=1024, attention_backend="triton") as llm:
        if tp > 1:
            assert llm.engine.config.enforce_eager  # all-reduce in CUDA graphs: not built
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0,
                                                    ignore_eos=True))
        return [o.token_ids for o in outs]


def test_tp2_fp32_on_two_gpus_equals_tp1():
    a, b = _run(1, "float32"), _run(2, "float32")
    assert sum(x == y for x, y in zip(a, b)) >= 7


@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:tiny-mistral"])
def test_tp2_bf16_on_two_gpus_mostly_equals_tp1(model):
    a, b = _run(1, "bfloat16", model), _run(2, "bfloat16", model)
    same = sum(x == y for r, s in zip(a, b) for x, y in zip(r, s)) / sum(map(len, a))
    assert same >= 0.9, same  # bf16 near-ties may flip under another summation order


def test_rank_processes_run_without_nvlink_multicast():
    from engine.parallel.group import NVLINK_ENV

    with LLM("dummy:tiny", device="cuda:0", dtype="bfloat16", tensor_parallel_size=2) as llm:
        pid = llm.engine.runner.tp.pids[0]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        for k, v in NVLINK_ENV.items():
            assert env[k.encode()] == v.encode()
            assert os.environ[k] == v  # rank 0 (this process) too
