"""GPTQ on the GPU (engine/quant/gptq.py, calibrated.py): the Hessian (float32 there) and the
rounding on the device give the CPU's codes but for a few rounding ties, and beat
round-to-nearest as on the CPU; ``pdserve quantize --gptq`` on a GPU engine keeps everything
there and writes a file that loads into the same tokens. Full sizes: bench/gptq_gpu.py.

    PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_gptq_gpu.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.quant.gptq import HessianCollector, gptq_quantize  # noqa: E402
from engine.quant.reference import QUANTIZERS, quant_matmul_ref, unpack_int4  # noqa: E402


def _inputs(k: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """tests/unit/test_gptq.py's correlated activations."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(99)) / k ** 0.5
    mix += torch.eye(k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)) @ mix
    x[:, :4] *= 8.0
    return x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    col = HessianCollector()
    mod = torch.nn.Identity()
    col.hook("p", mod)
    for part in x.split(512):
        mod(part)
    return col.h["p"]


def _codes(qw: dict) -> torch.Tensor:
    if qw["format"] == "int4":
        return unpack_int4(qw["q"])[:, :qw["k"]]
    return qw["q"].view(torch.uint8)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_gpu_rounding_agrees_with_the_cpu_and_beats_round_to_nearest(fmt, act_order):
    k, n = 256, 64
    x = _inputs(k, 2048)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    h_gpu = _hessian(x.cuda())
    assert h_gpu.dtype == torch.float32 and h_gpu.is_cuda
    h_cpu = _hessian(x)
    assert ((h_gpu.double().cpu() - h_cpu).abs().max() / h_cpu.abs().max()).item() < 1e-5
    cpu = gptq_quantize(w, h_cpu, fmt, act_order=act_order)
    gpu = gptq_quantize(w.cuda(), h_gpu, fmt, act_order=act_order)
    assert all(v.is_cuda for v in gpu.values() if isinstance(v, torch.Tensor))
    for key, v in cpu.items():
        if isinstance(v, torch.Tensor):
            assert gpu[key].dtype == v.dtype and gpu[key].shape == v.shape, key
    # float32 H and other reduction orders flip a few near-ties (and a flip moves the rest of
    # its row a little); without act-order a group's range comes from updated weights, so
    # its scale may differ in the last bits
    same = (_codes(gpu).cpu() == _codes(cpu)).float().mean().item()
    assert same > 0.98, same
    sg, sc = gpu["scale"].cpu(), cpu["scale"]
    if act_order or fmt != "int4":  # ranges from the original weights: the same up to the
        # last bit (the GPU's amax / reciprocal rounding, H200 2026-12-03)
        torch.testing.assert_close(sg, sc, rtol=1e-6, atol=0)
    else:
        assert ((sg - sc).abs() <= 1e-3 * sc.abs()).float().mean().item() > 0.95
    held = _inputs(k, 1024, seed=3)
    ref = held @ w.t()
    err_g = (quant_matmul_ref(held.cuda(), gpu).cpu() - ref).pow(2).mean().item()
    err_r = (quant_matmul_ref(held, QUANTIZERS[fmt](w)) - ref).pow(2).mean().item()
    assert err_g < 0.8 * err_r, (err_g, err_r)


def test_calibration_on_a_gpu_engine_stays_there_and_loads(tmp_path):
    """SmolLM2-135M's shapes (random weights): 120 projections rounded on the GPU."""
    from engine import LLM, SamplingParams
    from engine.quant.calibrated import gptq_calibrate, save_file
    from engine.quant.linear import QuantLinear
    from engine.quant.plan import QuantPlan
    kw = dict(device="cuda", num_blocks=64, enforce_eager=True)
    llm = LLM("dummy:smollm2-135m", **kw)
    windows = [[(7 * i + 3 * j) % 250 + 1 for i in range(64)] for j in range(2)]
    assert llm.engine.runner.device.type == "cuda"
    info = gptq_calibrate(llm.engine, windows, QuantPlan.uniform("int4"))
    assert info["tokens"] == 128
    mods = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.q.is_cuda for m in mods)
    path = str(tmp_path / "w.safetensors")
    save_file(llm.engine.runner.model, path, llm.engine.model_id, info)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10]], sp)]
    del llm
    torch.cuda.empty_cache()
    loaded = LLM("dummy:smollm2-135m", quantized_weights=path, **kw)
    got = loaded.generate([[5, 6, 7, 8], [9, 10]], sp)
    assert [o.token_ids for o in got] == want
