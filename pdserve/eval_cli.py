"""``pdserve eval``: compare engine configurations' output quality against a baseline.

    pdserve eval --candidate int8=quantization=int8 --candidate fp8kv=kv_dtype=fp8
    pdserve eval --base attention_backend=torch --candidate enable_prefix_caching=false
    pdserve eval --corpus my.txt --model /path/to/hf-folder --candidate quantization=int4

A configuration is a comma-separated list of engine settings by their flat names
(docs/configuration.md), applied over the defaults and the PDSERVE_* environment;
``NAME=k=v,...`` names a candidate. Prints a table; ``--out`` / ``--set`` write the JSON
(bench/results/eval/<set>/eval.json, with the harness header).
"""
from __future__ import annotations

import logging
import sys

BENCHMARK = "eval"


def parse_pairs(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` -> {k: v}; names checked against the engine's settings."""
    from engine.config import EngineConfig
    from pdcore.config_tree import aliases, nearest
    known = aliases(EngineConfig)
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"expected setting=value, got {item!r}")
        if key not in known:
            raise ValueError(f"unknown engine setting {key!r}" + nearest(key, known))
        out[key] = value.strip()
    return out


def engine_config_of(model: str, pairs: dict[str, str], env=None):
    """The engine settings: defaults < PDSERVE_* (``env``, default the process's) < --model
    < ``pairs``."""
    from engine.config import EngineConfig
    from pdcore.config_tree import PREFIX, build, environ
    env = dict(environ() if env is None else env)
    env[PREFIX + "MODEL"] = model
    env.update({PREFIX + k.upper(): v for k, v in pairs.items()})
    return build(EngineConfig, roots={"engine": EngineConfig}, env=env, sections=("engine",),
                 strict=False)[0]


def _candidate(text: str) -> tuple[str, dict[str, str]]:
    head, sep, rest = text.partition("=")
    if sep and "=" in rest and "," not in head:  # NAME=k=v,...
        name, pairs = head.strip(), parse_pairs(rest)
        if not name:
            raise ValueError(f"--candidate {text!r}: the name before the first '=' is empty")
    else:
        name, pairs = text.strip(), parse_pairs(text)
    if not pairs:  # the baseline again, under no name: nothing to compare
        raise ValueError(f"--candidate {text!r} sets nothing: give k=v,... (or NAME=k=v,...)")
    return name, pairs


def _args(argv):
    from pdserve.argtypes import Parser, integer
    from pdserve.benchlib import harness
    p = Parser(prog="pdserve eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--base", default="", help="the baseline's settings (k=v,...) [defaults]")
    p.add_argument("--candidate", action="append", default=[], required=True,
                   help="[NAME=]k=v,... (repeat for several; the baseline runs once)")
    p.add_argument("--corpus", default=None, help="a UTF-8 text file [stdlib docstrings]")
    p.add_argument("--corpus-sha256", default=None, help="refuse any other corpus text")
    p.add_argument("--part", default="heldout", choices=("heldout", "tune", "all"))
    p.add_argument("--window", type=integer(2), default=256)
    p.add_argument("--windows", type=integer(1), default=8)
    p.add_argument("--continuations", type=integer(0), default=8)
    p.add_argument("--prompt-tokens", type=integer(1), default=64)
    p.add_argument("--new-tokens", type=integer(1), default=32)
    harness.add_output_args(p, BENCHMARK)
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    from engine.evaluation.corpus import load_corpus
    from engine.evaluation.run import EvalSettings, evaluate, table
    from pdserve.benchlib import harness
    argv = list(sys.argv[1:] if argv is None else argv)
    p, a = _args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        settings = EvalSettings(window=a.window, windows=a.windows,
                                continuations=a.continuations, prompt_tokens=a.prompt_tokens,
                                new_tokens=a.new_tokens, part=a.part)
        base = engine_config_of(a.model, parse_pairs(a.base))
        cands = {}
        for text in a.candidate:
            name, pairs = _candidate(text)
            if name in cands:
                raise ValueError(f"candidate {name!r} given twice")
            cands[name] = engine_config_of(a.model, pairs)
        corpus = load_corpus(a.corpus, a.corpus_sha256)
    except ValueError as e:
        p.error(str(e))
    rec = harness.Recorder.start(BENCHMARK, a, argv=argv, prog="pdserve eval",
                                 about=__doc__, figures=_figures(cands))
    try:
        doc = evaluate(base, cands, corpus, settings)
    except ValueError as e:
        print(f"pdserve eval: error: {e}", file=sys.stderr)
        return 2
    rec.doc.update(doc)
    print(table(doc))
    if a.out or a.result_set:
        print(f"wrote {rec.save()}")
    return 0


def _figures(cands) -> list:
    from pdserve.benchlib import harness
    out = []
    for name in cands:
        out += [harness.Figure(f"{name}: top-1 agreement", "", ("candidates", name,
                                                                "top1_agreement"), format=".4f"),
                harness.Figure(f"{name}: KL mean", "nats", ("candidates", name, "kl_mean"),
                               format=".5f")]
    return out
