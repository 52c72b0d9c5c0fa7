"""``pdserve quantize``: a mixed-precision plan (``--plan``), calibrated weights (``--gptq``)
or static KV cache scales (``--kv-scales``).

    pdserve quantize --plan --out plan.json [--model smollm2-135m] [--low int4 --high int8]
        [--budget 0.15] [--windows 2 --window 128] [--corpus FILE]
    pdserve quantize --gptq int4|int8|fp8 --out w.safetensors [--from-plan plan.json]
        [--windows 32 --window 256] [--device cuda]
    pdserve quantize --kv-scales --out kv.safetensors [--windows 8 --window 256]

Both run on the corpus's tune part (pdserve eval reports on the held-out part), on the float
engine's device (``--device``, else the engine setting: PDSERVE_DEVICE, ``--base
device=...``, or auto: cuda when a GPU is visible); GPTQ's Hessians and rounding run there
too. The engine scores one window at a time, so its KV cache is sized for one (on a GPU the
memory is left to the Hessians). The engine loads a plan with ``--quantization-plan
plan.json``, calibrated weights with ``--quantized-weights w.safetensors``
(engine/quant/calibrated.py) and KV scales with ``--kv-dtype fp8 --kv-scales kv.safetensors``
(engine/quant/kv_scales.py: the largest |K| and |V| of each layer and KV head over the
windows).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from pdserve.argtypes import Parser, integer, number, output_file
    p = Parser(prog="pdserve quantize", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true",
                      help="run the sensitivity sweep and write a plan file")
    mode.add_argument("--gptq", choices=("int4", "int8", "fp8"), default=None,
                      help="calibrate GPTQ weights of this format and write them")
    mode.add_argument("--kv-scales", action="store_true",
                      help="calibrate static KV cache scales (per layer and KV head) and "
                           "write them")
    p.add_argument("--out", required=True, type=output_file,
                   help="the plan (--plan), weights (--gptq) or scales (--kv-scales) file")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--base", default="", help="engine settings k=v,... of the float model")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (over --base) [the engine setting, auto]")
    p.add_argument("--low", default="int4", choices=("int4", "int8", "fp8"))
    p.add_argument("--high", default="int8", choices=("int8", "fp8", "none"))
    p.add_argument("--budget", type=number(0.0), default=0.15,
                   help="extra weight bytes allowed over the all-low model (0.15: 15%%)")
    p.add_argument("--from-plan", default=None,
                   help="--gptq: each projection's format from this plan file")
    p.add_argument("--corpus", default=None)
    p.add_argument("--corpus-sha256", default=None)
    p.add_argument("--window", type=integer(2), default=None,
                   help="tokens per window [--plan 128, --gptq and --kv-scales 256]")
    p.add_argument("--windows", type=integer(1), default=None,
                   help="windows of the tune part [--plan 2; --gptq 32, or enough for "
                        "1.25x the widest projection's inputs in tokens; --kv-scales 8]")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.plan and a.from_plan:
        p.error("--from-plan goes with --gptq (a plan sweep writes a plan)")
    a.window = a.window or (128 if a.plan else 256)
    llm, corpus, windows = _setup(p, a)
    if a.plan:
        return _plan(llm, corpus, windows, a)
    if a.kv_scales:
        return _kv_scales(llm, corpus, windows, a)
    return _gptq(p, llm, corpus, windows, a)


def _setup(p, a):
    from engine.evaluation.corpus import load_corpus
    from engine.evaluation.run import pick_windows
    from engine.llm import LLM
    from pdserve.eval_cli import engine_config_of, parse_pairs
    try:
        pairs = parse_pairs(a.base)
        if (pairs.get("quantization", "none") != "none" or "quantization_plan" in pairs
                or "quantized_weights" in pairs):
            raise ValueError("quantize starts from the unquantized model")
        if pairs.get("kv_dtype") in ("int8", "fp8"):
            raise ValueError("quantize starts from a float KV cache")
        pairs["enforce_eager"] = "true"  # projections are swapped after loading
        pairs["cpu_packed"] = "false"  # every projection runs its module
        if a.device:
            pairs["device"] = a.device
        # one window scored at a time: a KV cache for one (not 90% of a GPU)
        pairs.setdefault("max_num_seqs", "1")
        pairs.setdefault("max_model_len", str(a.window))
        cfg = engine_config_of(a.model, pairs)
        corpus = load_corpus(a.corpus, a.corpus_sha256)
        llm = LLM.from_config(cfg)  # e.g. device cuda without a GPU: one error line
    except ValueError as e:
        p.error(str(e))
    ids = llm.tokenizer.encode(corpus.part("tune"))
    if a.windows is None:
        a.windows = (gptq_windows(llm.engine.runner.model, a.window) if a.gptq
                     else 8 if a.kv_scales else 2)
    try:
        windows = [w[:-1] for w in pick_windows(ids, a.window, a.windows)]
    except ValueError as e:
        p.error(str(e))
    return llm, corpus, windows


def gptq_windows(model, window: int) -> int:
    """GPTQ's default calibration: 32 windows, or enough that the tokens are 1.25x the
    widest projection's inputs. With fewer tokens than inputs a projection's Hessian is
    rank-deficient and its rounding fits the calibration tokens at the expense of others
    (on the H200, Llama-3-8B's down projection, 14336 inputs against 8192 tokens, rounded
    worse than round-to-nearest on held-out inputs: bench/results/gptq_gpu/h200)."""
    from engine.quant import projections
    widest = max(getattr(parent, attr).in_features for _, parent, attr in projections(model))
    return max(32, -(-widest * 5 // (4 * (window - 1))))


def _plan(llm, corpus, windows, a) -> int:
    from engine.quant.sweep import sweep
    plan = sweep(llm.engine, windows, a.low, a.high, a.budget,
                 progress=lambda line: print(line, flush=True))
    plan.meta.update(corpus=corpus.describe(), window=a.window, windows=a.windows)
    plan.save(a.out)
    m = plan.meta
    print(f"wrote {a.out}: {len(plan.layers)} of {len(m['sensitivity_kl'])} projections in "
          f"{a.high}, the rest {a.low}; weights {m['bytes_plan'] / 2**20:.1f} MiB against "
          f"{m['bytes_all_low'] / 2**20:.1f} MiB all-{a.low}")
    return 0


def _gptq(p, llm, corpus, windows, a) -> int:
    from engine.quant.calibrated import gptq_calibrate, save_file
    from engine.quant.plan import QuantPlan
    try:
        plan = QuantPlan.load(a.from_plan) if a.from_plan else QuantPlan.uniform(a.gptq)
        if a.from_plan and plan.default != a.gptq:
            raise ValueError(f"--gptq {a.gptq} but the plan's default is {plan.default}")
        info = gptq_calibrate(llm.engine, windows, plan)
    except ValueError as e:
        p.error(str(e))
    info.update(corpus=corpus.describe(), window=a.window, plan=a.from_plan)
    n = save_file(llm.engine.runner.model, a.out, llm.engine.model_id, info)
    print(f"wrote {a.out}: {n} projections {info['projections']}, weights "
          f"{info['weight_bytes'] / 2**20:.1f} MiB; calibrated on {info['tokens']} tokens in "
          f"{info['calibration_s']:.0f}s, quantized in {info['quantize_s']:.0f}s")
    return 0


def _kv_scales(llm, corpus, windows, a) -> int:
    import time
    from engine.quant.kv_scales import RangeRecorder, write_file
    eng = llm.engine
    runner = eng.runner
    rec = RangeRecorder(runner.backend, eng.model_config.num_layers,
                        eng.model_config.num_kv_heads)
    runner.backend = rec
    t0 = time.perf_counter()
    try:
        for w in windows:
            eng.score(w)
    finally:
        runner.backend = rec.inner
    info = {"corpus": corpus.describe(), "window": a.window, "windows": len(windows),
            "tokens": sum(len(w) for w in windows), "calibration_s": time.perf_counter() - t0}
    write_file(a.out, rec.ranges, eng.model_id, info)
    r = rec.ranges
    print(f"wrote {a.out}: K and V scales of {r.shape[0]} layers x {r.shape[2]} KV heads from "
          f"{info['tokens']} tokens in {info['calibration_s']:.0f}s (max |K| "
          f"{float(r[:, 0].min()):.3g}-{float(r[:, 0].max()):.3g}, max |V| "
          f"{float(r[:, 1].min()):.3g}-{float(r[:, 1].max()):.3g})")
    return 0
