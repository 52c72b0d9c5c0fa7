"""Llama-family decoder (Llama 2/3, Qwen2 with q/k/v bias, Mistral, SmolLM2).

Plain torch modules. Q/K/V and gate/up projections are fused into one matmul each; weights
arrive under Hugging Face names and are fused in ``load_weights``. Attention is delegated to
an ``AttentionBackend`` so the GPU path can swap in Triton kernels without touching this file.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

_MAX_PACKED_TOKENS = 8  # = engine.kernels.cpu_quant.MAX_PACKED_TOKENS


class QLinear(nn.Linear):
    """nn.Linear that, on CPU, may also hold its weight in GGUF block form (``packed``, see
    engine.kernels.cpu_quant): calls with at most 8 tokens (decode) then run the packed GEMV,
    which reads ~5x fewer bytes than the dense fp32 weight and gives the same weight values.
    Larger calls (prefill) and the GPU keep the dense weight."""
    packed: tuple | None = None

    def forward(self, x):
        p = self.packed
        if p is not None and x.dim() == 2 and x.shape[0] <= _MAX_PACKED_TOKENS:
            from engine.kernels.cpu_quant import packed_gemv
            y = packed_gemv(x, p)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


def _packed_fits(p: tuple | None, out_features: int, in_features: int) -> bool:
    if p is None:
        return False
    k = p[1].shape[1] * (2 if p[0] == "q4_1" else 1)
    return p[1].shape[0] == out_features and k == in_features


class Attention(nn.Module):
    """Q/K/V and output projections around the attention backend; DecoderLayer.forward calls
    the projections itself (they may fuse with the norms around them) and ``attend``."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = QLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = QLinear(self.q_size, cfg.hidden_size, bias=False)

    def attend(self, qkv, positions, rotary: RotaryEmbedding, backend: AttentionBackend,
               kv_cache, meta: AttentionMetadata):
        """Projected qkv [T, q+2kv] -> attention output [T, q_size] (before o_proj)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if rotary.fused and getattr(backend, "fuses_rotary", False) and meta.decode_only:
            # GPU decode: rotary + store_kv in one kernel inside the backend (it pays at
            # decode; on prefill and mixed steps it was slower, so they keep the separate
            # kernels)
            o = backend.forward(self.layer, q, k, v, kv_cache, meta,
                                rope=(positions, rotary.cos_sin_cache))
        else:
            q, k = rotary(positions, q, k)
            o = backend.forward(self.layer, q, k, v, kv_cache, meta)
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    """gate_up and down projections; DecoderLayer.forward runs them around ``act``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = QLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = QLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False  # GPU: silu(gate) * up in one Triton kernel

    def act(self, gate_up):
        if self.fused:
            from engine.kernels.elementwise import silu_and_mul
            return silu_and_mul(gate_up)
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # GPU, one token: {"qkv"|"o"|"gate_up"|"down": gemv config or None}; set by the runner
        self.gemv_plan: dict | None = None

    def forward(self, x, residual, positions, rotary, backend, kv_cache, meta):
        """One decoder layer. On the GPU at one token, each projection the gemv plan names
        runs as the Triton GEMV with its neighbouring row-wise op folded in (rmsnorm /
        add+rmsnorm before qkv and gate_up, silu_and_mul before down); a role mapped to None
        stays on its module. A quantized module may fuse the row-wise op itself
        (QuantLinear.prologue_forward)."""
        plan = self.gemv_plan if self.gemv_plan is not None and x.shape[0] == 1 else {}
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = _norm_linear(self.input_layernorm, attn.qkv_proj, x, residual,
                                     plan.get("qkv"))
        o = attn.attend(qkv, positions, rotary, backend, kv_cache, meta)
        h = _linear(attn.o_proj, o, plan.get("o"))
        gu, residual = _norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, h, residual,
                                    plan.get("gate_up"))
        cfg = plan.get("down")
        if cfg is None:
            fused = getattr(mlp.down_proj, "prologue_forward", None)
            y = fused("silu_mul", gu) if fused is not None and mlp.fused else None
            return (mlp.down_proj(mlp.act(gu)) if y is None else y), residual
        from engine.kernels.matvec import gemv, gemv_weight
        w, wkw = gemv_weight(mlp.down_proj)
        return gemv(gu, w, mlp.down_proj.bias, prologue="silu_mul", **wkw, **cfg), residual


def _linear(linear: nn.Linear, x, cfg):
    if cfg is None:
        return linear(x)
    from engine.kernels.matvec import gemv, gemv_weight
    w, wkw = gemv_weight(linear)
    return gemv(x, w, linear.bias, **wkw, **cfg)


def _norm_linear(norm: RMSNorm, linear: nn.Linear, x, residual, cfg):
    """(linear(rmsnorm(x [+ residual])), new residual), fused into one GEMV when cfg is set
    (or by the module's own prologue_forward, where it has one for this call)."""
    if cfg is None:
        fused = getattr(linear, "prologue_forward", None)
        out = fused("rmsnorm", x, residual, norm) if fused is not None and norm.fused else None
        if out is not None:
            return out[0], (x if residual is None else out[1])
        if residual is None:
            residual, h = x, norm(x)
        else:
            h, residual = norm(x, residual)
        return linear(h), residual
    from engine.kernels.matvec import gemv, gemv_weight
    w, wkw = gemv_weight(linear)
    if residual is None:
        return gemv(x, w, linear.bias, prologue="rmsnorm", norm_weight=norm.weight,
                    eps=norm.eps, **wkw, **cfg)
    return gemv(x, w, linear.bias, prologue="add_rmsnorm", residual=residual,
                norm_weight=norm.weight, eps=norm.eps, **wkw, **cfg)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                                      cfg.rope_scaling_dict)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_packed: tuple | None = None  # CPU: packed lm_head (or tied embedding) weight
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """``after_layer(i)`` is called once layer ``i``'s work (its KV-cache write included)
        has been queued: the runner records an event there for layer-by-layer KV sending."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary, backend, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        x, _ = self.norm(x, residual)
        return x

    def enable_fused_ops(self, on: bool = True) -> None:
        """GPU only: route RMSNorm, rotary and SiLU-and-mul through the Triton kernels in
        engine.kernels (fp32 math inside each kernel; the default torch path is unchanged)."""
        for m in self.modules():
            if hasattr(m, "fused"):
                m.fused = on
        self.rotary.fused = on

    def set_gemv_plan(self, plan: dict | None) -> None:
        """GPU only: route one-token projections through engine.kernels.matvec.gemv per ``plan``
        (see DecoderLayer.forward); None restores the default path."""
        for layer in self.layers:
            layer.gemv_plan = plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if (self.lm_packed is not None and hidden.dim() == 2
                and hidden.shape[0] <= _MAX_PACKED_TOKENS):
            from engine.kernels.cpu_quant import packed_gemv
            return packed_gemv(hidden, self.lm_packed)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w)

    @torch.no_grad()
    def load_packed(self, packed: dict[str, tuple] | None) -> int:
        """CPU: attach GGUF block-form weights (HF names, engine.kernels.cpu_quant layouts) to
        the projections and lm_head; q/k/v and gate/up rows are concatenated like the dense
        weights. A projection whose parts are missing or of mixed kinds stays dense. None
        detaches everything. Returns the number of projections (incl. lm_head) now packed."""
        packed = packed or {}

        def cat(names: list[str]) -> tuple | None:
            parts = [packed.get(n) for n in names]
            if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
                return None
            if len(parts) == 1:
                return parts[0]
            return (parts[0][0], *(torch.cat([p[i] for p in parts]).contiguous()
                                   for i in range(1, len(parts[0]))))

        count = 0

        def attach(lin: QLinear, p: tuple | None) -> None:
            nonlocal count
            ok = _packed_fits(p, lin.out_features, lin.in_features)
            lin.packed = p if ok else None
            count += ok

        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attach(layer.self_attn.qkv_proj, cat([a + "q_proj.weight", a + "k_proj.weight",
                                                  a + "v_proj.weight"]))
            attach(layer.self_attn.o_proj, packed.get(a + "o_proj.weight"))
            attach(layer.mlp.gate_up_proj, cat([m + "gate_proj.weight", m + "up_proj.weight"]))
            attach(layer.mlp.down_proj, packed.get(m + "down_proj.weight"))
        head = packed.get("model.embed_tokens.weight" if self.lm_head is None
                          else "lm_head.weight")
        cfg = self.config
        self.lm_packed = head if _packed_fits(head, cfg.vocab_size, cfg.hidden_size) else None
        count += self.lm_packed is not None
        return count

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be set."""
        cfg = self.config
        params = dict(self.named_parameters())
        done: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: expected shape {tuple(p.shape)}, got {tuple(tensor.shape)}")
            p.copy_(tensor)
            done.add(name)

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing {name}")
            return weights[name]

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", get(src + "post_attention_layernorm.weight"))
            a = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight", torch.cat(
                [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]))
            if cfg.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat(
                    [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]))
            put(dst + "self_attn.o_proj.weight", get(a + "o_proj.weight"))
            m = src + "mlp."
            put(dst + "mlp.gate_up_proj.weight", torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
            put(dst + "mlp.down_proj.weight", get(m + "down_proj.weight"))
        missing = set(params) - done
        if missing:
            raise ValueError(f"parameters not loaded: {sorted(missing)[:5]}")
