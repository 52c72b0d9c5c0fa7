"""engine.kernels.cpu_quant: GEMV straight from GGUF Q4_1 / Q8_0 blocks (CPU, C++ extension).

The kernel must expand blocks to exactly the values engine.loader.dequant produces (so the
dense fp32 weights and the packed ones describe the same model) and agree with the torch
reference (dequantize, then matmul) up to fp32 summation order.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as np_quantize

from engine.kernels import cpu_quant
from engine.loader import load_model, smollm2_gguf_path
from engine.loader.dequant import dequantize
from engine.loader.gguf_loader import unpermute_rows
from engine.loader.gguf_reader import GGUFFile

needs_ext = pytest.mark.skipif(not cpu_quant.available(),
                               reason="cpu_quant extension could not be built")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _random_raw(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """GGUF bytes of a random [n, k] tensor quantized by the gguf package (real block layout)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = np_quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())


PACK = {Q.Q4_1: cpu_quant.pack_q4_1, Q.Q8_0: cpu_quant.pack_q8_0}


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_pack_matches_loader_dequant(qtype):
    raw = _random_raw(qtype, 37, 96, seed=1)
    packed = PACK[qtype](raw, (37, 96))
    assert torch.equal(cpu_quant.dequant_packed(packed), dequantize(raw, int(qtype), (37, 96)))


@needs_ext
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 13, 64), (2, 7, 96), (3, 61, 576),
                                   (4, 100, 160), (5, 33, 1536), (7, 9, 288), (8, 257, 576)])
def test_kernel_matches_reference_random_blocks(qtype, m, n, k):
    raw = _random_raw(qtype, n, k, seed=n * 1000 + k)
    packed = PACK[qtype](raw, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = cpu_quant.packed_gemv(x, packed)
    ref = x @ dequantize(raw, int(qtype), (n, k)).t()
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert _rel(out, ref) < 2e-6
    assert _rel(out, cpu_quant.packed_gemv_ref(x, packed)) < 2e-6


@needs_ext
def test_kernel_random_bytes_and_noncontiguous_x():
    """Arbitrary bytes (every nibble / int8 value, extreme scales) and a strided x."""
    g = torch.Generator().manual_seed(0)
    n, k = 45, 320
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    d = torch.randn(n, k // 32, generator=g).half().float()
    m = torch.randn(n, k // 32, generator=g).half().float()
    x = torch.randn(k, 6, generator=g).t()  # [6, k], not contiguous
    assert _rel(cpu_quant.q4_1_gemv(x, qs, d, m), cpu_quant.q4_1_gemv_ref(x, qs, d, m)) < 2e-6
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    assert _rel(cpu_quant.q8_0_gemv(x, q8, d), cpu_quant.q8_0_gemv_ref(x, q8, d)) < 2e-6


@needs_ext
def test_kernel_rejects_bad_shapes():
    x = torch.randn(1, 48)
    with pytest.raises(RuntimeError):
        cpu_quant.q8_0_gemv(x, torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1))


@needs_ext
def test_kernel_on_real_smollm2_tensors():
    names = {"blk.0.attn_q.weight": 9, "blk.3.ffn_down.weight": None,
             "blk.7.ffn_gate.weight": None, "token_embd.weight": None}
    g = torch.Generator().manual_seed(3)
    with GGUFFile(smollm2_gguf_path()) as f:
        for name, heads in names.items():
            info = f.tensors[name]
            kind = {int(Q.Q4_1): "q4_1", int(Q.Q8_0): "q8_0"}[info.ggml_type]
            raw = torch.frombuffer(bytearray(f.tensor_bytes(name)), dtype=torch.uint8)
            packed = PACK[Q.Q4_1 if kind == "q4_1" else Q.Q8_0](raw, info.shape)
            dense = dequantize(raw, info.ggml_type, info.shape)
            if heads:
                dense = unpermute_rows(dense, heads)
                packed = (kind, *(unpermute_rows(t, heads).contiguous() for t in packed[1:]))
            assert torch.equal(cpu_quant.dequant_packed(packed), dense), name
            for m in (1, 3, 8):
                x = torch.randn(m, dense.shape[1], generator=g)
                assert _rel(cpu_quant.packed_gemv(x, packed), x @ dense.t()) < 2e-6, (name, m)


def test_loader_keeps_packed_blocks_equal_to_dense():
    loaded = load_model("smollm2-135m", keep_packed=True)
    assert loaded.packed is not None
    kinds = {name: p[0] for name, p in loaded.packed.items()}
    assert kinds["model.embed_tokens.weight"] == "q8_0"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert "lm_head.weight" not in loaded.packed  # tied
    assert len(loaded.packed) == 1 + 30 * 7
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.5.self_attn.k_proj.weight", "model.layers.29.mlp.up_proj.weight"]:
        assert torch.equal(cpu_quant.dequant_packed(loaded.packed[name]), loaded.weights[name])
    assert load_model("smollm2-135m", keep_packed=False).packed is None


@needs_ext
def test_model_packed_path_matches_dense():
    """Fused qkv / gate_up packed rows and the tied lm_head: decode-sized calls through the
    packed GEMV agree with the dense weights."""
    from engine.models.llama import LlamaForCausalLM

    loaded = load_model("smollm2-135m", keep_packed=True)
    model = LlamaForCausalLM(loaded.config)
    model.load_weights(loaded.weights)
    assert model.load_packed(loaded.packed) == 30 * 4 + 1
    layer = model.layers[4]
    g = torch.Generator().manual_seed(5)
    for lin in [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj]:
        assert torch.equal(cpu_quant.dequant_packed(lin.packed), lin.weight)
        x = torch.randn(3, lin.in_features, generator=g)
        assert _rel(lin(x), x @ lin.weight.t()) < 2e-6
    h = torch.randn(2, 576, generator=g)
    assert _rel(model.compute_logits(h), h @ model.embed_tokens.weight.t()) < 2e-6
    model.load_packed(None)
    assert model.lm_packed is None and layer.mlp.down_proj.packed is None


def test_setting_off_disables(monkeypatch):
    """cpu_packed off (PDSERVE_CPU_PACKED=off, or the keyword): no packed blocks are kept and
    no projection reads them."""
    from engine import LLM
    assert load_model("smollm2-135m", keep_packed=False).packed is None
    monkeypatch.setenv("PDSERVE_CPU_PACKED", "off")
    llm = LLM("smollm2-135m", num_blocks=8)
    assert llm.engine.config.kernels.cpu_packed is False
    assert llm.engine.runner.packed_projections == 0
