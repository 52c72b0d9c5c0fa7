"""Pre-quantized Hugging Face checkpoints (engine.quant.checkpoint), from fixtures written
here in each published format: compressed-tensors FP8 (float-quantized, channel and tensor
strategies), AWQ GEMM int4 and GPTQ int4 (config.json quantization_config)."""
import copy

import pytest
import torch

from engine.loader import load_model
from tests.reference import save_hf_folder, wordlevel_tokenizer_json

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32


def _pack_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """[R, 8C] values 0..15 -> int32 [R, C], nibble i of column j = value 8j + i."""
    r, c8 = nibbles.shape
    v = nibbles.to(torch.int64).view(r, c8 // 8, 8)
    out = torch.zeros(r, c8 // 8, dtype=torch.int64)
    for i in range(8):
        out |= v[..., i] << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _fp8_tensors(w, strategy):
    if strategy == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / 448.0
    else:
        s = w.abs().amax().reshape(1) / 448.0
    s = s.to(torch.bfloat16).float()  # checkpoints store the scales in bf16
    q = (w / s.reshape(-1, 1) if strategy == "channel" else w / s).to(torch.float8_e4m3fn)
    deq = q.float() * (s.reshape(-1, 1) if strategy == "channel" else s)
    return {"weight": q, "weight_scale": s.to(torch.bfloat16)}, deq


def _int4_codes(n, k, g):
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(1, 16, (k // GROUP, n), generator=g)
    s = (torch.rand(k // GROUP, n, generator=g) * 0.02 + 0.005).half()
    deq = ((q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0))
    return q, z, s, deq.t().contiguous()  # deq: [N, K]


def _awq_tensors(n, k, g):
    q, z, s, deq = _int4_codes(n, k, g)
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8j + order[i]

    def pack(v):  # [R, N] -> int32 [R, N/8] in AWQ's interleaved order
        r = v.shape[0]
        perm = v.view(r, -1, 8)[..., list(order)].reshape(r, -1)
        return _pack_int32(perm)
    return {"qweight": pack(q), "qzeros": pack(z), "scales": s}, deq


def _gptq_tensors(n, k, g):
    q, z, s, deq = _int4_codes(n, k, g)
    qweight = _pack_int32(q.t().contiguous()).t().contiguous()  # [K/8, N] along K
    qzeros = _pack_int32(z - 1)  # stored as z - 1
    return {"qweight": qweight, "qzeros": qzeros, "scales": s,
            "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}, deq


QCONFIGS = {
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                    "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float",
                                              "strategy": "token", "dynamic": True},
                        "targets": ["Linear"]}}, "ignore": ["lm_head"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
             "sym": False},
}
QCONFIGS["fp8-tensor"] = copy.deepcopy(QCONFIGS["fp8-channel"])
QCONFIGS["fp8-tensor"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"


def _write(tmp_path, kind):
    """A dummy:tiny checkpoint in format ``kind`` and the float weights it stands for."""
    base = load_model("dummy:tiny", seed=3)
    g = torch.Generator().manual_seed(7)
    quant, dense = dict(base.weights), dict(base.weights)
    for name in [n for n in base.weights if n.endswith(".weight")
                 and any(f".{p}." in n for p in LINEARS)]:
        w = base.weights[name]
        n, k = w.shape
        if kind.startswith("fp8"):
            t, deq = _fp8_tensors(w, kind.split("-")[1])
        else:
            t, deq = (_awq_tensors if kind == "awq" else _gptq_tensors)(n, k, g)
        del quant[name]
        prefix = name[:-len(".weight")]
        quant.update({f"{prefix}.{key}": v for key, v in t.items()})
        dense[name] = deq
    folder_q, folder_f = tmp_path / "q", tmp_path / "f"
    tok = wordlevel_tokenizer_json()
    save_hf_folder(type(base)(base.config, quant, None, "q"), str(folder_q), tokenizer_json=tok,
                   config_overrides={"quantization_config": QCONFIGS[kind]})
    save_hf_folder(type(base)(base.config, dense, None, "f"), str(folder_f), tokenizer_json=tok)
    return str(folder_q), str(folder_f)


@pytest.mark.parametrize("kind", ["fp8-channel", "fp8-tensor", "awq", "gptq"])
def test_prequantized_checkpoint_loads_its_codes(tmp_path, kind):
    from engine import LLM, SamplingParams
    from engine.quant.linear import QuantLinear
    from engine.quant.reference import dequantize
    q_dir, f_dir = _write(tmp_path, kind)
    llm = LLM(q_dir, num_blocks=64)
    r = llm.engine.runner
    fmt = "fp8" if kind.startswith("fp8") else "int4"
    assert r.quantization["checkpoint"] and r.quantization["projections"] == {
        fmt: 4 * len(r.model.layers)}
    ref = LLM(f_dir, num_blocks=64)
    # the swapped-in weights are exactly the checkpoint's values (q/k/v fused like dense)
    for ours, theirs in ((r.model.layers[0].self_attn.qkv_proj,
                          ref.engine.runner.model.layers[0].self_attn.qkv_proj),
                         (r.model.layers[1].mlp.down_proj,
                          ref.engine.runner.model.layers[1].mlp.down_proj)):
        assert isinstance(ours, QuantLinear) and ours.format == fmt
        torch.testing.assert_close(dequantize(ours.qweight()), theirs.weight, atol=1e-6,
                                   rtol=1e-6)
    ids = [(11 * i) % 500 + 1 for i in range(30)]
    if fmt == "int4":  # weight-only: the same math as the float model with those weights
        torch.testing.assert_close(llm.engine.score(ids), ref.engine.score(ids), atol=1e-4,
                                   rtol=1e-4)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = llm.generate([ids[:5]], sp)[0].token_ids  # decode: weight-only for fp8 too
    assert got == ref.generate([ids[:5]], sp)[0].token_ids
    with pytest.raises(ValueError, match="already quantized"):
        LLM(q_dir, num_blocks=64, quantization="int8")


def test_unsupported_quantization_configs_are_refused():
    from engine.quant.checkpoint import method_of
    assert method_of(None) is None
    with pytest.raises(ValueError, match="only 4-bit"):
        method_of({"quant_method": "gptq", "bits": 8})
    with pytest.raises(ValueError, match="act-order"):
        method_of({"quant_method": "gptq", "bits": 4, "desc_act": True})
    with pytest.raises(ValueError, match="unsupported quantization_config"):
        method_of({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="8-bit float"):
        method_of({"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "int"}}}})
