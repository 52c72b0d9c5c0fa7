"""Static KV cache scales (engine.quant.kv_scales): read from a Hugging Face checkpoint written
here in the published layout (compressed-tensors ``kv_cache_scheme``, ``self_attn.k_scale``
/ ``v_scale`` per layer or per KV head; the older ``k_proj.output_scale`` names), or
calibrated by ``pdserve quantize --kv-scales``; what the cache then holds; every refusal."""
import copy
import json
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.quant.kv import CODE_DTYPES, INV_QMAX, dequantize, slabs
from engine.quant.kv_scales import FORMAT, file_ranges
from pdcore.config_tree import ConfigError
from tests.reference import save_hf_folder, wordlevel_tokenizer_json

SCHEME = {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
          "symmetric": True}
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def tiny():
    return load_model("dummy:tiny")


def _folder(tmp_path, loaded, scales: dict, scheme=SCHEME, name="ckpt"):
    """dummy:tiny as an HF folder with float weights plus ``scales`` (name -> tensor)."""
    lm = copy.copy(loaded)
    lm.weights = {**loaded.weights, **scales}
    path = str(tmp_path / name)
    qcfg = {"quant_method": "compressed-tensors", "format": "dense"}
    if scheme is not None:
        qcfg["kv_cache_scheme"] = scheme
    save_hf_folder(lm, path, tokenizer_json=wordlevel_tokenizer_json(cfg_vocab(loaded)),
                   config_overrides={"quantization_config": qcfg})
    return path


def cfg_vocab(loaded) -> int:
    return loaded.config.vocab_size


def _ckpt_scales(cfg, per_head_layers=(0,), old_names_layers=(), value=0.002):
    """Layer 0 per KV head, the rest one value per layer (e4m3 grid: x = code * s; ranges
    s * 448 of 0.9-3.6, below the largest |K| of dummy:tiny: saturation is exercised)."""
    out = {}
    for layer in range(cfg.num_layers):
        for i, kv in enumerate("kv"):
            n = cfg.num_kv_heads if layer in per_head_layers else 1
            s = torch.linspace(value, 2 * value, n) * (1 + i)
            name = (f"model.layers.{layer}.self_attn.{kv}_proj.output_scale"
                    if layer in old_names_layers else f"model.layers.{layer}.self_attn.{kv}_scale")
            out[name] = s
    return out


def _layer0_kv(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V of PROMPT as the cache holds them (dequantized), [T, heads, D]."""
    r = llm.engine.runner
    bs = r.block_size
    out = []
    for which in (0, 1):
        if r.kv_cache.dtype in CODE_DTYPES.values():
            codes, scales = slabs(r.kv_cache, 0, which)
            x = dequantize(codes, scales.transpose(1, 2), r.kv_cache.dtype, torch.float32)
        else:
            x = r.kv_cache[:, 0, which].float()
        out.append(x.reshape(-1, *x.shape[2:]))  # blocks 0.. hold the first prompt in order
    n = len(PROMPT)
    assert r.num_blocks * bs >= n
    return out[0][:n], out[1][:n]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_checkpoint_scales_are_what_the_cache_stores(tmp_path, tiny, kind):
    cfg = tiny.config
    ck = _ckpt_scales(cfg, per_head_layers=(0,), old_names_layers=(1,))
    path = _folder(tmp_path, tiny, ck)
    p = SamplingParams(max_tokens=1, temperature=0)
    ref = LLM(path, enable_prefix_caching=False)
    ref.generate([PROMPT], p)
    llm = LLM(path, kv_dtype=kind, kv_scales="checkpoint", enable_prefix_caching=False)
    llm.generate([PROMPT], p)
    static = llm.engine.runner.kv_static_scales
    code = CODE_DTYPES[kind]
    for layer in range(cfg.num_layers):
        for which, kv in enumerate("kv"):
            name = next(n for n in ck if n.startswith(f"model.layers.{layer}.")
                        and f".{kv}_" in n)
            want = (ck[name].expand(cfg.num_kv_heads) * 448.0) * INV_QMAX[code]
            torch.testing.assert_close(static[layer, which], want, rtol=1e-6, atol=0)
            _, scales = slabs(llm.engine.runner.kv_cache, layer, which)
            used = scales.transpose(1, 2).reshape(-1, cfg.num_kv_heads)[:len(PROMPT)]
            assert torch.equal(used, static[layer, which].expand_as(used))
    # layer 0's K/V depend only on the prompt: the stored values are the float engine's,
    # rounded to the static grid and saturated at its largest code
    qmax = 448.0 if kind == "fp8" else 127.0
    for which, (got, want) in enumerate(zip(_layer0_kv(llm), _layer0_kv(ref))):
        s = static[0, which][None, :, None]
        clipped = want.clamp(-qmax * s, qmax * s)
        err = (got - clipped).abs()
        bound = s / 2 + 1e-6 if kind == "int8" else clipped.abs() / 16 + s
        assert bool((err <= bound).all()), float((err - bound).max())
        assert (want.abs() > qmax * s).any() or which == 1  # K saturates at these scales


def test_int_grid_checkpoint_and_engine_grids(tmp_path, tiny):
    """A kv_cache_scheme of type int puts the checkpoint's scales on the int8 grid (qmax
    127); an fp8 cache then takes the same range on its own grid."""
    cfg = tiny.config
    ck = _ckpt_scales(cfg, per_head_layers=())
    path = _folder(tmp_path, tiny, ck, scheme={**SCHEME, "type": "int", "strategy": "tensor"})
    llm = LLM(path, kv_dtype="fp8", kv_scales="checkpoint")
    want = ck["model.layers.1.self_attn.v_scale"] * 127.0 * INV_QMAX[torch.float8_e4m3fn]
    torch.testing.assert_close(llm.engine.runner.kv_static_scales[1, 1],
                               want.expand(cfg.num_kv_heads), rtol=1e-6, atol=0)


def test_refusals(tmp_path, tiny):
    cfg = tiny.config
    with pytest.raises(ConfigError, match="kv_dtype int8 or fp8"):
        LLM("dummy:tiny", kv_scales="checkpoint")
    with pytest.raises(ValueError, match="not a Hugging Face folder"):
        LLM("dummy:tiny", kv_dtype="fp8", kv_scales="checkpoint")
    with pytest.raises(ValueError, match="stores no KV cache scales"):
        LLM(_folder(tmp_path, tiny, {}, name="none"), kv_dtype="fp8", kv_scales="checkpoint")
    bad_shape = _ckpt_scales(cfg)
    bad_shape["model.layers.1.self_attn.k_scale"] = torch.ones(cfg.num_kv_heads + 1)
    with pytest.raises(ValueError, match=r"expected 1 \(per layer\)"):
        LLM(_folder(tmp_path, tiny, bad_shape, name="shape"), kv_dtype="fp8",
            kv_scales="checkpoint")
    missing = _ckpt_scales(cfg)
    del missing["model.layers.1.self_attn.v_scale"]
    with pytest.raises(ValueError, match="no KV cache scale for 1 of 4"):
        LLM(_folder(tmp_path, tiny, missing, name="missing"), kv_dtype="int8",
            kv_scales="checkpoint")
    negative = _ckpt_scales(cfg)
    negative["model.layers.0.self_attn.k_scale"] = -negative["model.layers.0.self_attn.k_scale"]
    with pytest.raises(ValueError, match="positive finite"):
        LLM(_folder(tmp_path, tiny, negative, name="neg"), kv_dtype="fp8",
            kv_scales="checkpoint")
    dyn = _folder(tmp_path, tiny, _ckpt_scales(cfg), scheme={**SCHEME, "dynamic": True},
                  name="dyn")
    with pytest.raises(ValueError, match="dynamic"):
        LLM(dyn, kv_dtype="fp8", kv_scales="checkpoint")
    with pytest.raises(ValueError, match="no such file"):
        LLM("dummy:tiny", kv_dtype="fp8", kv_scales=str(tmp_path / "absent.safetensors"))
    notst = tmp_path / "junk.safetensors"
    notst.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        LLM("dummy:tiny", kv_dtype="fp8", kv_scales=str(notst))


def test_checkpoint_with_kv_scales_and_float_weights_loads_as_float(tmp_path, tiny):
    """compressed-tensors with only a kv_cache_scheme is not a pre-quantized checkpoint:
    its weights load as they are, and a float cache ignores the scales."""
    path = _folder(tmp_path, tiny, _ckpt_scales(tiny.config))
    p = SamplingParams(max_tokens=8, temperature=0)
    a = LLM(path).generate([PROMPT], p)[0].token_ids
    b = LLM("dummy:tiny").generate([PROMPT], p)[0].token_ids
    assert a == b


def test_quantize_cli_calibrates_the_largest_k_and_v(tmp_path):
    """`pdserve quantize --kv-scales` on one window: the file's ranges are the largest |K| and
    |V| per layer and head the float engine stored for that window; the engine loads the
    file (model id checked) and stores those scales."""
    from pdserve.quantize_cli import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. " + "words and more words " * 40
                                  for i in range(12)))
    out = tmp_path / "kv.safetensors"
    rc = main(["--kv-scales", "--model", "dummy:tiny", "--out", str(out), "--corpus",
               str(corpus), "--windows", "1", "--window", "48"])
    assert rc == 0
    from safetensors import safe_open
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and meta["model"] == "dummy:tiny"
    assert json.loads(meta["calibration"])["tokens"] == 48
    tiny_cfg = load_model("dummy:tiny").config
    ranges = file_ranges(str(out), tiny_cfg, "dummy:tiny")
    # the same window through a fresh float engine: its cache holds that window alone
    from engine.evaluation.corpus import load_corpus
    from engine.evaluation.run import pick_windows
    from pdserve.eval_cli import engine_config_of
    ref = LLM.from_config(engine_config_of("dummy:tiny", {"enforce_eager": "true",
                                                          "cpu_packed": "false",
                                                          "max_num_seqs": "1",
                                                          "max_model_len": "48"}))
    ids = ref.tokenizer.encode(load_corpus(str(corpus), None).part("tune"))
    window = pick_windows(ids, 48, 1)[0][:-1]
    ref.engine.score(window)
    cache = ref.engine.runner.kv_cache.float()  # zeros outside the window's slots
    want = cache.abs().amax(dim=(0, 3, 5))  # [layers, 2, heads]
    torch.testing.assert_close(ranges, want, rtol=1e-6, atol=1e-7)
    llm = LLM("dummy:tiny", kv_dtype="int8", kv_scales=str(out))
    torch.testing.assert_close(llm.engine.runner.kv_static_scales,
                               ranges * INV_QMAX[torch.int8], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="calibrated on 'dummy:tiny'"):
        LLM("dummy:tiny-llama3", kv_dtype="int8", kv_scales=str(out))
    assert os.path.getsize(out) < 4096
