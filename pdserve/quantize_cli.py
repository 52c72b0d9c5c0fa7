"""``pdserve quantize --plan``: measure each projection's sensitivity and write a plan.

    pdserve quantize --plan --out plan.json [--model smollm2-135m] [--low int4 --high int8]
        [--budget 0.15] [--windows 2 --window 128] [--corpus FILE]

Runs on the corpus's tune part (pdserve eval reports on the held-out part); the engine
loads the result with ``--quantization-plan plan.json`` (PDSERVE_QUANTIZATION_PLAN, ...).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from pdserve.argtypes import Parser, integer, number
    p = Parser(prog="pdserve quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", required=True,
                   help="run the sensitivity sweep and write a plan file")
    p.add_argument("--out", required=True, help="the plan file to write")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--base", default="", help="engine settings k=v,... of the float model")
    p.add_argument("--low", default="int4", choices=("int4", "int8", "fp8"))
    p.add_argument("--high", default="int8", choices=("int8", "fp8", "none"))
    p.add_argument("--budget", type=number(0.0), default=0.15,
                   help="extra weight bytes allowed over the all-low model (0.15: 15%%)")
    p.add_argument("--corpus", default=None)
    p.add_argument("--corpus-sha256", default=None)
    p.add_argument("--window", type=integer(2), default=128)
    p.add_argument("--windows", type=integer(1), default=2)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from engine.evaluation.corpus import load_corpus
    from engine.evaluation.run import pick_windows
    from engine.llm import LLM
    from engine.quant.sweep import sweep
    from pdserve.eval_cli import engine_config_of, parse_pairs
    try:
        pairs = parse_pairs(a.base)
        if pairs.get("quantization", "none") != "none" or "quantization_plan" in pairs:
            raise ValueError("the sweep starts from the unquantized model")
        pairs["enforce_eager"] = "true"  # projections are swapped between scoring passes
        cfg = engine_config_of(a.model, pairs)
        corpus = load_corpus(a.corpus, a.corpus_sha256)
    except ValueError as e:
        p.error(str(e))
    llm = LLM.from_config(cfg)
    ids = llm.tokenizer.encode(corpus.part("tune"))
    try:
        windows = [w[:-1] for w in pick_windows(ids, a.window, a.windows)]
    except ValueError as e:
        p.error(str(e))
    plan = sweep(llm.engine, windows, a.low, a.high, a.budget,
                 progress=lambda line: print(line, flush=True))
    plan.meta.update(corpus=corpus.describe(), window=a.window, windows=a.windows)
    plan.save(a.out)
    m = plan.meta
    print(f"wrote {a.out}: {len(plan.layers)} of {len(m['sensitivity_kl'])} projections in "
          f"{a.high}, the rest {a.low}; weights {m['bytes_plan'] / 2**20:.1f} MiB against "
          f"{m['bytes_all_low'] / 2**20:.1f} MiB all-{a.low}")
    return 0
