"""Weight quantization (engine.quant): formats, the CPU reference path, plans, the swap."""
import json

import pytest
import torch

from engine.quant import reference as ref
from engine.quant.linear import QuantLinear
from engine.quant.plan import QuantPlan, plan_for


def _w(n=48, k=200, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16), ("int4", 0.5 / 15)])
def test_round_trip_error_within_the_format_step(fmt, bound):
    w = _w()
    qw = ref.QUANTIZERS[fmt](w)
    d = ref.dequantize(qw)
    assert d.shape == w.shape
    if fmt == "int4":  # half a step of each group's (max - min) / 15
        kp = -(-w.shape[1] // 128) * 128
        g = torch.nn.functional.pad(w, (0, kp - w.shape[1]))
        err = (d - w).abs()
        step = qw["scale"].repeat_interleave(128, dim=1)[:, :w.shape[1]]
        assert (err <= step / 2 + 1e-6).all()
        assert g.shape[1] == 256 and qw["q"].shape == (48, 128) and qw["scale"].shape == (48, 2)
    elif fmt == "int8":
        assert ((d - w).abs() <= qw["scale"][:, None] / 2 + 1e-7).all()
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormals
        big = w.abs() > qw["scale"][:, None] * 2 ** -6
        assert ((d - w).abs()[big] <= w.abs()[big] * bound + 1e-7).all()


def test_int4_packing_low_nibble_is_the_even_feature():
    w = torch.tensor([[0.0, 15.0, 3.0, 4.0] + [0.0] * 124])
    qw = ref.quantize_int4(w)
    assert qw["zero"].tolist() == [[0.0]] and qw["scale"].tolist() == [[1.0]]
    assert qw["q"][0, :2].tolist() == [0xF0, 0x43]
    assert torch.equal(ref.dequantize(qw), w)


def test_int4_partial_last_group_ignores_the_padding():
    w = torch.full((2, 130), 5.0)
    w[:, 128:] = torch.tensor([7.0, 9.0])
    qw = ref.quantize_int4(w)
    assert qw["zero"][:, 1].tolist() == [7.0, 7.0]  # the pad's zeros did not widen the range
    assert torch.allclose(ref.dequantize(qw), w)


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("rows", [1, 8, 9, 33])
def test_quant_linear_cpu_matches_the_reference_matmul(fmt, rows):
    lin = torch.nn.Linear(200, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_w())
        lin.bias.copy_(torch.arange(48.0))
    q = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1))
    y = q(x)
    want = ref.quant_matmul_ref(x, q.qweight(), lin.bias)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)
    dense = lin(x)
    rel = ((y - dense).norm() / dense.norm()).item()
    assert rel < {"int8": 0.01, "fp8": 0.06, "int4": 0.12}[fmt]
    if fmt == "fp8" and rows > ref.GEMV_MAX_ROWS:  # W8A8: activations went through fp8
        assert not torch.allclose(y, x @ ref.dequantize(q.qweight()).t() + lin.bias, atol=1e-5)


def test_plan_file_round_trip_and_validation(tmp_path):
    p = tmp_path / "p.json"
    QuantPlan(default="int4", layers={"layers.1.down": "int8", "layers.0.qkv": "none"},
              model="m").save(str(p))
    plan = QuantPlan.load(str(p))
    assert plan.format_of("layers.1.down") == "int8" and plan.format_of("layers.1.o") == "int4"
    assert plan_for("none", str(p)) == plan and plan_for("int4", str(p)) == plan
    with pytest.raises(ValueError, match="disagrees"):
        plan_for("int8", str(p))
    assert plan_for("none", None) is None
    with pytest.raises(ValueError, match="not a projection name"):
        QuantPlan(default="int4", layers={"layers.x.down": "int8"})
    with pytest.raises(ValueError, match="format 'nf4'"):
        QuantPlan(default="nf4")
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a pdserve-quant-plan/1 file"):
        QuantPlan.load(str(p))
    with pytest.raises(ValueError, match="has 2 layers"):
        QuantPlan(default="int8", layers={"layers.5.o": "int4"}).check_model(2)


def test_engine_quantized_at_load_and_generates():
    from engine import LLM, SamplingParams
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = LLM("dummy:tiny", num_blocks=32)
    want = base.generate([[5, 6, 7, 8]], sp)[0].token_ids
    bytes0 = base.engine.runner.quantization
    assert bytes0 is None
    llm = LLM("dummy:tiny", num_blocks=32, quantization="int8")
    r = llm.engine.runner
    n = len(r.model.layers) * 4
    assert r.quantization["projections"] == {"int8": n}
    assert all(isinstance(getattr(m, a), QuantLinear) for layer in r.model.layers
               for m, a in ((layer.self_attn, "qkv_proj"), (layer.mlp, "down_proj")))
    from engine.quant import model_weight_bytes
    assert r.quantization["weight_bytes"] == model_weight_bytes(r.model) < \
        model_weight_bytes(base.engine.runner.model)
    got = llm.generate([[5, 6, 7, 8]], sp)[0].token_ids
    assert len(got) == 6 and got[:2] == want[:2]  # random weights: int8 keeps the first tokens
    with pytest.raises(ValueError, match="plan"):
        LLM("dummy:tiny", num_blocks=32, quantization_plan="/nonexistent/plan.json")


def test_sensitivity_sweep_writes_a_plan_within_the_budget(tmp_path):
    from engine import LLM
    from engine.quant import model_weight_bytes
    from engine.quant.sweep import select_plan, sweep
    llm = LLM("dummy:tiny", num_blocks=64, enforce_eager=True)
    windows = [[(5 * i + j) % 250 + 1 for i in range(24)] for j in range(2)]
    before = [llm.engine.score(w) for w in windows]
    none = sweep(llm.engine, windows, low="int4", high="int8", budget=0.0)
    n = len(llm.engine.runner.model.layers) * 4
    kl, rows = none.meta["sensitivity_kl"], none.meta["rows"]
    assert len(kl) == n and all(v > 0 for v in kl.values())
    # no budget: only upgrades that cost nothing (dummy:tiny's 64-wide inputs pad int4's
    # group of 128: its int4 can be larger than int8)
    assert set(none.layers) == {r["name"] for r in rows if r["extra_bytes"] <= 0}
    # half of what upgrading everything costs: the most KL per byte go first
    low = none.meta["bytes_all_low"]
    half = sum(max(0, r["extra_bytes"]) for r in rows) / 2 / low
    plan = select_plan(rows, low, "int4", "int8", half)
    paid = [r for r in rows if r["extra_bytes"] > 0]
    best = max(paid, key=lambda r: r["kl"] / r["extra_bytes"])
    assert best["name"] in plan.layers and len(plan.layers) < n
    assert plan.default == "int4" and 0 < len(plan.layers) < n
    assert plan.meta["bytes_plan"] <= (1 + half) * low
    # the model is restored after each measurement
    assert all(torch.equal(a, llm.engine.score(w)) for a, w in zip(before, windows))
    # the plan loads, and the engine's bytes are what the sweep predicted
    path = tmp_path / "plan.json"
    plan.save(str(path))
    q = LLM("dummy:tiny", num_blocks=64, quantization_plan=str(path)).engine.runner
    assert model_weight_bytes(q.model) == plan.meta["bytes_plan"]
    assert q.quantization["projections"] == {"int4": n - len(plan.layers),
                                             "int8": len(plan.layers)}


def test_quantization_with_tensor_parallelism_is_refused():
    from engine.config import CacheConfig, EngineConfig
    from pdcore.settings import SettingError
    for kw in ({"quantization": "int8"}, {"quantization_plan": "p.json"},
               {"cache": CacheConfig(kv_dtype="int8")}):
        with pytest.raises(SettingError, match="tensor_parallel_size > 1"):
            EngineConfig(tensor_parallel_size=2, **kw)
    EngineConfig(tensor_parallel_size=2, cache=CacheConfig(kv_dtype="bfloat16"))
