"""engine.loader: GGUF reading and dequantization, config parsing, HF folders, dummy models."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import dequantize as np_dequantize, quantize as np_quantize

from engine.config import ModelConfig
from engine.loader import LoadedModel, load_config, load_model, load_tokenizer, smollm2_gguf_path
from engine.loader.dequant import dequantize
from engine.loader.dummy import DUMMY_CONFIGS, weight_shapes
from engine.loader.gguf_reader import GGUFFile
from engine.loader.hf_loader import hf_config_from_dict
from tests.reference import greedy_reference, hf_model_from_loaded, save_hf_folder

SMOLLM2_CONFIG = ModelConfig(
    arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


# ---------------------------------------------------------------- dequantization

def _ours(raw: np.ndarray, qtype: Q, shape) -> torch.Tensor:
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    return dequantize(data, int(qtype), tuple(shape)).float()


def test_dequant_smollm2_tensors_match_gguf_package():
    with GGUFFile(smollm2_gguf_path()) as g:
        names = ["token_embd.weight", "output_norm.weight"] + \
            [n for n in g.tensors if n.startswith(("blk.0.", "blk.29."))]
        seen = set()
        for name in names:
            info = g.tensors[name]
            raw = np.frombuffer(g.tensor_bytes(name), dtype=np.uint8).copy()
            ref = np_dequantize(raw.reshape(info.shape[0] if len(info.shape) > 1 else 1, -1),
                                info.ggml_type).reshape(info.shape)
            ours = _ours(raw, Q(info.ggml_type), info.shape)
            assert torch.equal(ours, torch.from_numpy(ref.astype(np.float32))), name
            seen.add(info.type_name)
    assert seen == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("qtype,tol", [(Q.F16, 1e-3), (Q.BF16, 8e-3), (Q.Q8_0, 0.03),
                                       (Q.Q4_0, 0.4), (Q.Q4_1, 0.3)])
def test_dequant_round_trip(qtype, tol):
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    packed = np_quantize(x, qtype)
    ref = np_dequantize(packed, qtype)
    ours = _ours(packed, qtype, x.shape)
    assert torch.equal(ours, torch.from_numpy(ref.astype(np.float32)))
    assert float(np.abs(ours.numpy() - x).max()) < tol


def test_dequant_q6_k_matches_gguf_package():
    # gguf cannot quantize Q6_K: use random blocks with a sane float16 scale.
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(12, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full(12, 0.01, dtype=np.float16).view(np.uint8).reshape(12, 2)
    ref = np_dequantize(blocks.reshape(3, 4 * 210), Q.Q6_K)
    ours = _ours(blocks, Q.Q6_K, (3, 1024))
    assert torch.equal(ours, torch.from_numpy(ref.astype(np.float32)))


# ---------------------------------------------------------------- GGUF files

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to q/k rows (written from its definition)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, loaded: LoadedModel, qtypes: dict[str, Q]):
    c = loaded.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + \
        [chr(c) for c in range(ord("!"), ord("!") + c.vocab_size - 3)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (c.vocab_size - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for hf, t in loaded.weights.items():
        if hf.startswith("model.layers."):
            _, _, i, rest = hf.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{parts[mod]}.{kind}"
        else:
            name = names[hf]
        x = t.float().numpy()
        if "q_proj" in hf:
            x = _llama_cpp_permute(x, c.num_heads)
        elif "k_proj" in hf:
            x = _llama_cpp_permute(x, c.num_kv_heads)
        qtype = qtypes.get(name.rsplit(".", 2)[-2], Q.F32) if x.ndim == 2 else Q.F32
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(x))
        else:
            w.add_tensor(name, np_quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_round_trip_unpermutes_q_and_k(tmp_path):
    src = load_model("dummy:tiny", seed=3)
    path = tmp_path / "tiny-test.gguf"
    _write_gguf(path, src, {})
    loaded = load_model(str(path))
    assert loaded.model_id == "tiny-test.gguf"
    assert loaded.config == src.config
    assert set(loaded.weights) == set(src.weights)
    for name, t in src.weights.items():
        assert torch.equal(loaded.weights[name], t), name
    assert loaded.tokenizer.encode("!\"#") == [1, 3, 4, 5]  # add_bos_token is true here


def test_gguf_file_quantized_types(tmp_path):
    src = load_model("dummy:tiny", seed=4)
    path = tmp_path / "q.gguf"
    _write_gguf(path, src, {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1,
                            "ffn_up": Q.F16, "ffn_gate": Q.BF16, "attn_output": Q.Q8_0})
    loaded = load_model(str(path), dtype=torch.bfloat16)
    q = loaded.weights["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16 and q.shape == (64, 64)
    for name, tol in [("self_attn.q_proj", 0.15), ("self_attn.k_proj", 0.01),
                      ("self_attn.v_proj", 0.1), ("mlp.up_proj", 0.01), ("mlp.gate_proj", 0.01)]:
        full = f"model.layers.0.{name}.weight"
        err = (loaded.weights[full].float() - src.weights[full]).abs().max().item()
        assert err < tol, (name, err)


def test_smollm2_config_and_weights(smollm2):
    assert load_config("smollm2-135m") == SMOLLM2_CONFIG
    assert smollm2.config == SMOLLM2_CONFIG
    assert smollm2.model_id == "smollm2-135m"
    assert set(smollm2.weights) == set(weight_shapes(SMOLLM2_CONFIG))
    for name, shape in weight_shapes(SMOLLM2_CONFIG).items():
        assert tuple(smollm2.weights[name].shape) == shape, name
        assert smollm2.weights[name].dtype == torch.float32


def test_smollm2_greedy_answer_through_reference(smollm2):
    """Wrong q/k un-permutation garbles every answer; this one is exact."""
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))
    out = greedy_reference(hf_model_from_loaded(smollm2), ids, 8)
    assert tok.decode(out) == "The capital of France is Paris."


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_conversion(smollm2):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = hf_model_from_loaded(smollm2)
    parsed = load_gguf_checkpoint(smollm2_gguf_path(), return_tensors=True, model_to_load=ours)
    theirs = parsed["tensors"]
    assert set(theirs) == set(smollm2.weights)
    for name, t in smollm2.weights.items():
        assert torch.equal(torch.as_tensor(theirs[name]).float(), t), name
    cfg = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    cfg.pop("model_type", None)
    ref = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    ref.load_state_dict({k: torch.as_tensor(v).float() for k, v in theirs.items()},
                        strict=False)
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the")])
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    print(f"max |logits diff| vs transformers' GGUF conversion: {diff:.3g}")
    assert diff < 1e-3


# ---------------------------------------------------------------- HF folders

def test_hf_config_parsing_old_and_new_rope_keys():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
                bos_token_id=128000, eos_token_id=[128001, 128008, 128009])
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = hf_config_from_dict({**base, "rope_theta": 500000.0, "rope_scaling": scaling},
                              {"eos_token_id": [128001, 128009, 7]})
    new = hf_config_from_dict({**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}},
                              {"eos_token_id": [128001, 128009, 7]})
    assert old == new == dataclasses.replace(DUMMY_CONFIGS["llama-3-8b"], bos_token_id=128000,
                                             eos_token_ids=(128001, 128008, 128009, 7))
    qwen = hf_config_from_dict(dict(architectures=["Qwen2ForCausalLM"], vocab_size=10,
                                    hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, sliding_window=4096,
                                    use_sliding_window=False, eos_token_id=3))
    assert (qwen.arch, qwen.attention_bias, qwen.sliding_window, qwen.num_kv_heads,
            qwen.head_dim, qwen.eos_token_ids) == ("qwen2", True, None, 2, 4, (3,))
    with pytest.raises(ValueError, match="unsupported model"):
        hf_config_from_dict(dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


@pytest.mark.parametrize("spec,shards", [("dummy:tiny", 1), ("dummy:tiny-qwen2", 2),
                                         ("dummy:tiny-mistral", 1), ("dummy:tiny-llama3", 3)])
def test_hf_folder_round_trip(tmp_path, smollm2, spec, shards):
    src = load_model(spec, seed=7)
    folder = tmp_path / "my-model"
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    save_hf_folder(src, str(folder), tokenizer_json=smollm2.tokenizer.backend.to_str(),
                   tokenizer_config={"chat_template": template, "eos_token": "<|im_end|>",
                                     "bos_token": {"content": "<|im_start|>"}}, shards=shards)
    loaded = load_model(str(folder), dtype=torch.float16)
    assert loaded.model_id == "my-model"
    assert loaded.config == src.config
    assert set(loaded.weights) == set(src.weights)
    if src.config.attention_bias:
        assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    for name, t in src.weights.items():
        assert loaded.weights[name].dtype == torch.float16
        assert torch.equal(loaded.weights[name], t.half()), name
    tok = load_tokenizer(str(folder))
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"
    assert tok.encode("Hello world") == [19556, 905]


def test_hf_folder_tied_checkpoint_with_lm_head_and_generation_config(tmp_path, smollm2):
    src = load_model("dummy:tiny-qwen2")
    with_head = LoadedModel(src.config, {**src.weights,
                                         "lm_head.weight": src.weights["model.embed_tokens.weight"].clone()},
                            None, "x")
    save_hf_folder(with_head, str(tmp_path), tokenizer_json=smollm2.tokenizer.backend.to_str())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = load_model(str(tmp_path))
    assert "lm_head.weight" not in loaded.weights
    assert loaded.config.eos_token_ids == (2, 5)
    assert loaded.tokenizer.eos_token_ids == (2, 5)
    assert not loaded.tokenizer.has_chat_template


# ---------------------------------------------------------------- dummy models and specs

@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_dummy_configs_are_valid(name):
    config = load_config(f"dummy:{name}")
    assert config is DUMMY_CONFIGS[name]
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_dummy_weights_deterministic_and_shaped():
    a = load_model("dummy:tiny-qwen2", dtype=torch.bfloat16, seed=1)
    b = load_model("dummy:tiny-qwen2", dtype=torch.bfloat16, seed=1)
    c = load_model("dummy:tiny-qwen2", dtype=torch.bfloat16, seed=2)
    assert a.model_id == "dummy:tiny-qwen2"
    assert {k: tuple(v.shape) for k, v in a.weights.items()} == weight_shapes(a.config)
    assert all(v.dtype == torch.bfloat16 for v in a.weights.values())
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not torch.equal(a.weights["model.layers.0.mlp.up_proj.weight"],
                           c.weights["model.layers.0.mlp.up_proj.weight"])
    assert "lm_head.weight" not in a.weights  # tied
    assert "model.layers.0.self_attn.q_proj.bias" in a.weights


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-mistral", "tiny-llama3"])
def test_dummy_greedy_decoding_is_varied(name):
    loaded = load_model(f"dummy:{name}")
    model = hf_model_from_loaded(loaded)
    out = greedy_reference(model, loaded.tokenizer.encode("Hello there"), 16)
    assert len(set(out)) >= 6, out


def test_unknown_specs_are_readable_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model spec 'no-such-model'"):
        load_config("no-such-model")
    with pytest.raises(ValueError, match="unknown dummy model 'nope'.*dummy:tiny"):
        load_model("dummy:nope")
    with pytest.raises(ValueError, match="has no config.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_config(str(bad))
