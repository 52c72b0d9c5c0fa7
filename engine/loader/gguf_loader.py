"""Load a GGUF file (llama.cpp's format): ModelConfig from its metadata, a byte-level BPE
tokenizer from its vocabulary, and weights dequantized to HF names and layouts.

Metadata and tokenizer paths are torch-free; torch is imported inside `load_gguf_weights`.

llama.cpp's convert script permutes the rows of attn_q / attn_k per head, from HF's
"rotate half" layout (first half of each head's rows = real parts) to interleaved pairs. We undo
it: view rows as (heads, head_dim / 2, 2) and swap the last two axes -> (heads, 2, head_dim / 2).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from engine.config import ModelConfig
from engine.loader.gguf_reader import GGUFFile
from engine.loader.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}

# GGUF tensor-name suffix -> HF name suffix, per layer.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_IGNORED = {"rope_freqs.weight"}

# Pre-tokenizer split patterns for byte-level vocabularies (tokenizer.ggml.pre).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# GPT-2 regex after splitting every digit apart (llama.cpp's "\p{N}" + gpt2 pattern).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
_CONTROL, _USER_DEFINED = 3, 4


def _round7(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06. Keep 7 digits."""
    return float(f"{float(x):.7g}")


def gguf_config(g: GGUFFile) -> ModelConfig:
    arch = g.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{g.path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {sorted(SUPPORTED_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return g.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens else g.tensors["token_embd.weight"].shape[0])
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = (("factor", _round7(key("rope.scaling.factor"))), ("rope_type", "linear"))
    elif scaling_type not in (None, "none"):
        logger.warning("%s: rope scaling %r is not interpreted", g.path, scaling_type)
    if "rope_freqs.weight" in g.tensors:
        logger.warning("%s: rope_freqs (llama3 frequency factors) are ignored", g.path)
    eos = g.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=SUPPORTED_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=_round7(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_round7(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        sliding_window=key("attention.sliding_window"),
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _bytes_to_unicode_alphabet() -> set[str]:
    """The 256 printable characters GPT-2's byte-level BPE spells bytes with."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    extra = [256 + i for i in range(256 - len(keep))]
    return {chr(c) for c in keep + extra}


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers as pt

    if pre in _DIGITS_THEN_GPT2:
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLITS:
        return pt.Sequence([pt.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("unknown tokenizer.ggml.pre %r: using GPT-2's pre-tokenizer", pre)
    return pt.ByteLevel(add_prefix_space=False, use_regex=True)


def gguf_tokenizer(g: GGUFFile) -> Tokenizer:
    """A byte-level BPE `Tokenizer` from tokenizer.ggml.* metadata (model "gpt2" only)."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, processors

    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{g.path}: tokenizer model {model!r} is not supported "
                         "(only byte-level BPE, 'gpt2')")
    tokens: list[str] = g.get("tokenizer.ggml.tokens")
    types: list[int] = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
    pre = g.get("tokenizer.ggml.pre")
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in _SPLITS and _SPLITS[pre] is _LLAMA3_SPLIT)
    tok = Backend(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    alphabet = _bytes_to_unicode_alphabet()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = g.get("tokenizer.ggml.bos_token_id")
    if g.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = g.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(tok, bos_token_id=bos, eos_token_ids=() if eos is None else (eos,),
                     chat_template=g.get("tokenizer.chat_template"))


def hf_name(gguf_name: str) -> str | None:
    """HF weight name for a GGUF tensor name (None: not a weight we load)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    return None


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's per-head row permutation of attn_q / attn_k (weights or biases)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


_PACKERS = {"Q4_1": "pack_q4_1", "Q8_0": "pack_q8_0"}


def load_gguf_weights(g: GGUFFile, config: ModelConfig, dtype, device: str = "cpu",
                      packed: dict | None = None, shard=None) -> dict:
    """All weights, dequantized, under HF names and shapes, in `dtype` on `device`.

    When `packed` is a dict (CPU only), 2-D Q4_1 / Q8_0 tensors are also kept in their block
    form there, under the same HF names (engine.kernels.cpu_quant layouts, rows permuted
    like the dense rows): name -> ("q4_1", qs, d, m) or ("q8_0", qs, d).

    ``shard`` (engine.parallel.ShardPlan): keep a tensor-parallel rank's slices only (each
    tensor is dequantized whole, sliced and freed before the next; no block form kept)."""
    import torch

    from engine.loader.dequant import dequantize
    from engine.loader.gguf_reader import GGML_TYPES

    weights: dict[str, torch.Tensor] = {}
    for name, info in g.tensors.items():
        target = hf_name(name)
        if target is None:
            if name not in _IGNORED:
                logger.warning("%s: skipping unknown tensor %s", g.path, name)
            continue
        raw = torch.frombuffer(bytearray(g.tensor_bytes(name)), dtype=torch.uint8)
        if device != "cpu":
            raw = raw.to(device)
        w = dequantize(raw, info.ggml_type, info.shape)
        pk = None
        kind = GGML_TYPES[info.ggml_type][0]
        if (packed is not None and device == "cpu" and kind in _PACKERS
                and len(info.shape) == 2 and target.endswith(".weight")):
            from engine.kernels import cpu_quant

            pk = getattr(cpu_quant, _PACKERS[kind])(raw, info.shape)
        heads = (config.num_heads if ".q_proj." in target
                 else config.num_kv_heads if ".k_proj." in target else None)
        if heads is not None:
            w = unpermute_rows(w, heads)
            if pk is not None:  # block rows are whole rows: the same row permutation applies
                pk = (pk[0], *(unpermute_rows(t, heads).contiguous() for t in pk[1:]))
        if shard is not None:
            pk = None
            w = shard.take(target, tuple(w.shape), lambda ix, w=w: w if ix is None else w[ix])
        weights[target] = w.to(dtype).contiguous()
        if pk is not None:
            packed[target] = pk
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        if packed is not None:
            packed.pop("lm_head.weight", None)
    return weights


def model_id_for(path: str) -> str:
    return os.path.basename(os.path.normpath(path))
