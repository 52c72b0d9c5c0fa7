"""GPTQ rounding (engine/quant/gptq.py): its output is the formats of engine/quant/reference.py
(so every kernel runs it), it equals round-to-nearest when the inputs are uncorrelated, and on
correlated inputs it moves the projection's output less than round-to-nearest does."""
from __future__ import annotations

import pytest
import torch

from engine.quant.gptq import HessianCollector, gptq_quantize
from engine.quant.reference import (dequantize, quant_matmul_ref, quantize_fp8, quantize_int4,
                                    quantize_int8)

RTN = {"int4": quantize_int4, "int8": quantize_int8, "fp8": quantize_fp8}


def _inputs(k: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Correlated activations with a few large channels, like a transformer's (one
    distribution; ``seed`` draws other tokens from it)."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(99)) / k ** 0.5
    mix += torch.eye(k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)) @ mix
    x[:, :4] *= 8.0
    return x


@pytest.mark.parametrize("fmt,k", [("int4", 256), ("int4", 200), ("int8", 192), ("fp8", 192)])
def test_identity_hessian_gives_round_to_nearest(fmt, k):
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(1))
    rtn = RTN[fmt](w)
    got = gptq_quantize(w, torch.eye(k, dtype=torch.float64), fmt)
    assert got.keys() == rtn.keys()
    for key, v in rtn.items():
        if isinstance(v, torch.Tensor):
            assert got[key].dtype == v.dtype and got[key].shape == v.shape, key
    same = (dequantize(got) == dequantize(rtn)).float().mean().item()
    assert same > 0.999, same  # float64 rounding may break an exact .5 tie the other way
    torch.testing.assert_close(got["scale"], rtn["scale"])


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_output_error_on_calibration_inputs_is_lower_than_round_to_nearest(fmt, act_order):
    k, n = 256, 64
    x = _inputs(k, 2048)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    col = HessianCollector()
    col.hook("p", lin)
    for part in x.split(512):  # H accumulates over calls
        lin(part)
    col.remove()
    assert col.tokens["p"] == 2048
    torch.testing.assert_close(col.h["p"], x.double().t() @ x.double())
    qg = gptq_quantize(w, col.h["p"], fmt, act_order=act_order)
    qr = RTN[fmt](w)
    held = _inputs(k, 1024, seed=3)  # held-out inputs of the same distribution
    ref = held @ w.t()
    err_g = (quant_matmul_ref(held, qg) - ref).pow(2).mean().item()
    err_r = (quant_matmul_ref(held, qr) - ref).pow(2).mean().item()
    assert err_g < 0.8 * err_r, (err_g, err_r)


def test_features_never_seen_and_bad_arguments():
    k = 128
    h = torch.eye(k, dtype=torch.float64)
    h[5, 5] = 0.0  # an input feature that was always zero
    q = gptq_quantize(torch.randn(8, k), h, "int8")
    assert (q["q"][:, 5] == 0).all()
    with pytest.raises(ValueError, match="int4, int8 and fp8"):
        gptq_quantize(torch.randn(8, k), h, "nf4")
    with pytest.raises(ValueError, match="input features"):
        gptq_quantize(torch.randn(8, k), torch.eye(64, dtype=torch.float64), "int4")


def _calibrated(tmp_path, plan=None):
    """dummy:tiny calibrated on two windows and saved: (engine's greedy tokens, file)."""
    from engine import LLM, SamplingParams
    from engine.quant.calibrated import gptq_calibrate, save_file
    from engine.quant.plan import QuantPlan
    llm = LLM("dummy:tiny", num_blocks=64, enforce_eager=True)
    windows = [[(7 * i + 3 * j) % 250 + 1 for i in range(64)] for j in range(2)]
    info = gptq_calibrate(llm.engine, windows, plan or QuantPlan.uniform("int4"))
    assert info["tokens"] == 128 and info["method"] == "gptq"
    path = str(tmp_path / "w.safetensors")
    n = save_file(llm.engine.runner.model, path, llm.engine.model_id, info)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return llm.generate([[5, 6, 7, 8], [9, 10]], sp), path, n


def test_calibrated_file_loads_into_the_same_modules_and_tokens(tmp_path):
    from engine import LLM, SamplingParams
    from engine.quant.plan import QuantPlan
    plan = QuantPlan(default="int4", layers={"layers.0.down": "int8", "layers.1.o": "none"})
    want, path, n = _calibrated(tmp_path, plan)
    llm = LLM("dummy:tiny", num_blocks=64, quantized_weights=path)
    layers = len(llm.engine.runner.model.layers)
    assert n == 4 * layers - 1
    summary = llm.engine.runner.quantization
    assert summary["projections"] == {"int4": 4 * layers - 2, "int8": 1, "none": 1}
    assert summary["calibration"]["tokens"] == 128
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate([[5, 6, 7, 8], [9, 10]], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_calibrated_file_is_checked_against_model_and_settings(tmp_path):
    from engine import LLM
    from pdcore.config_tree import ConfigError
    _, path, _ = _calibrated(tmp_path)
    with pytest.raises(ValueError, match="was made for 'dummy:tiny'"):
        LLM("dummy:tiny-qwen2", num_blocks=64, quantized_weights=path)
    with pytest.raises(ConfigError, match="leave quantization none"):
        LLM("dummy:tiny", num_blocks=64, quantized_weights=path, quantization="int8")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="quantized_weights"):
        LLM("dummy:tiny", num_blocks=64, quantized_weights=str(bad))
    with pytest.raises(ValueError, match="quantized_weights"):
        LLM("dummy:tiny", num_blocks=64, quantized_weights=str(tmp_path / "missing"))


def test_quantize_cli_writes_gptq_weights(tmp_path, capsys):
    from engine.quant.calibrated import read_file
    from pdserve.quantize_cli import main
    out = str(tmp_path / "q.safetensors")
    assert main(["--gptq", "int8", "--model", "dummy:tiny", "--windows", "2", "--window", "48",
                 "--out", out]) == 0
    assert "wrote" in capsys.readouterr().out
    header, tensors = read_file(out)
    assert header["model"] == "dummy:tiny" and header["calibration"]["tokens"] == 96
    assert {m["format"] for m in header["projections"].values()} == {"int8"}
    assert all(t.dtype in (torch.int8, torch.float32) for t in tensors.values())
    with pytest.raises(SystemExit):  # one mode at a time
        main(["--gptq", "int4", "--plan", "--out", out])


def test_default_calibration_covers_the_widest_projection():
    """pdserve quantize --gptq without --windows: 32 windows, or enough windows that the
    tokens are 1.25x the widest projection's inputs (Llama-3-8B's down: 14336 inputs ->
    71 windows of 256, 17,960 tokens; fewer tokens than inputs leave H rank-deficient)."""
    from types import SimpleNamespace as NS

    from pdserve.quantize_cli import gptq_windows

    def model(k_down):
        lin = lambda k: torch.nn.Linear(k, 4, bias=False)  # noqa: E731
        layer = NS(self_attn=NS(qkv_proj=lin(64), o_proj=lin(64)),
                   mlp=NS(gate_up_proj=lin(64), down_proj=lin(k_down)))
        return NS(layers=[layer])
    assert gptq_windows(model(1536), 256) == 32  # SmolLM2's widest: the old default
    n = gptq_windows(model(14336), 256)
    assert n * 255 >= 1.25 * 14336 and (n - 1) * 255 < 1.25 * 14336
