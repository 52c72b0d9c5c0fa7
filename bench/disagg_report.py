"""The comparison and report half of bench/disagg_gpu.py: targets, token agreement between
deployments, the printed summary; and, as a command, the summary of a saved run, several runs
merged into one report, or each deployment's SLO limit over several runs:

    python3 -m bench.disagg_report bench/results/disagg_gpu/SET/FILE.json
    python3 -m bench.disagg_report --merge RUN_1P1D.json RUN_COLOCATED.json --out MERGED.json
    python3 -m bench.disagg_report --limits RUN... [--slo-ttft-ms 1000 --slo-tpot-ms 30] \\
        --out LIMITS.json
"""
from __future__ import annotations

import json
import math
import sys

from pdserve.benchlib import harness
from pdserve.benchlib.metrics import RequestResult, meets_slo

TARGETS = {"ttft_added_pct_max": 5.0, "itl_p99_ratio_min": 3.0, "goodput_ratio_min": 1.3}
# goodput as disaggregation papers define it (DistServe): the highest request rate a
# deployment serves with at least this share of its requests within the SLO
SLO_ATTAINMENT = 0.9

# the headline figures of a run (or merged runs) of both deployments, and of --limits
FIGURES = [
    harness.Figure("4096-token TTFT added by 1P1D", "%",
                   ("comparison", "ttft", "ttft_added_pct"), format="+.2f"),
    harness.Figure("greedy prompts identical, one at a time", "",
                   ("comparison", "exact_sequential", "identical")),
    harness.Figure("highest rate with 90% in the SLO, 1P1D", "req/s",
                   ("comparison", "max_rate_at_slo", "1p1d")),
    harness.Figure("highest rate with 90% in the SLO, colocated", "req/s",
                   ("comparison", "max_rate_at_slo", "colocated")),
]
LIMITS_FIGURES = [
    harness.Figure("SLO limit (90% of requests), 1P1D", "req/s",
                   ("deployments", "1p1d", "rate")),
    harness.Figure("SLO limit (90% of requests), colocated", "req/s",
                   ("deployments", "colocated", "rate")),
    harness.Figure("limit ratio 1P1D / colocated", "", ("ratio", "rate"), format=".2f"),
]


def max_rate_at_slo(mixed: list[dict], attainment: float = SLO_ATTAINMENT) -> float | None:
    """The highest rate of a rising sweep up to which every rate kept ``attainment`` of its
    requests within the SLO (None if even the lowest did not). A grid figure: the true
    limit lies between it and the next rate measured."""
    best = None
    for row in sorted(mixed, key=lambda r: r["rate"]):
        got = row["summary"].get("slo_attainment")
        if got is None or got < attainment:
            break
        best = row["rate"]
    return best


# ------------------------------------------------------------------------------ comparing
def _ratio(num, den):
    if num is None or den is None:
        return None
    if den == 0:
        return None if num == 0 else math.inf
    return round(num / den, 4)


def _first_divergence(x: list[int], y: list[int]) -> int:
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return i
    return min(len(x), len(y)) if len(x) != len(y) else -1


def token_agreement(ta: dict, tb: dict, ids: list[str], detail: bool = False) -> dict:
    """Requests compared (ok in both) and identical; tokens matching before the first
    divergence over all compared tokens."""
    compared = identical = tok_total = tok_prefix = 0
    mismatches = []
    for rid in ids:
        x, y = ta.get(rid), tb.get(rid)
        if x is None or y is None:
            continue
        compared += 1
        d = _first_divergence(x, y)
        tok_total += max(len(x), len(y))
        tok_prefix += max(len(x), len(y)) if d < 0 else d
        if d < 0:
            identical += 1
        elif detail:
            mismatches.append({"id": rid, "first_divergence": d, "a": x[:d + 8], "b": y[:d + 8]})
    out = {"requests_compared": compared, "requests_identical": identical,
           "tokens_compared": tok_total, "tokens_before_divergence": tok_prefix,
           "token_agreement": round(tok_prefix / tok_total, 4) if tok_total else None}
    if detail:
        out["mismatches"] = mismatches
    return out


def compare(doc: dict, mixed_tokens: dict) -> dict | None:
    """1P1D against colocated (and colocated against its rerun, when run); ``mixed_tokens``:
    (deployment, rate index) -> the mixed workload's token ids by request id."""
    deps = doc["deployments"]
    p, c = deps.get("1p1d"), deps.get("colocated")
    if not c:
        return None
    p = p or {}
    out: dict = {"a": "1p1d", "b": "colocated", "targets": TARGETS}
    if "ttft" in p and "ttft" in c:
        pm, cm = p["ttft"]["ttft_ms"]["p50"], c["ttft"]["ttft_ms"]["p50"]
        added = round(100 * (pm / cm - 1), 2) if pm and cm else None
        out["ttft"] = {"prompt_len": p["ttft"]["prompt_len"], "1p1d_p50_ms": pm,
                       "colocated_p50_ms": cm, "1p1d_p90_ms": p["ttft"]["ttft_ms"]["p90"],
                       "colocated_p90_ms": c["ttft"]["ttft_ms"]["p90"],
                       "ttft_added_ms": round(pm - cm, 2) if pm and cm else None,
                       "ttft_added_pct": added,
                       "pass": added is not None and added <= TARGETS["ttft_added_pct_max"]}
    if "exact" in p and "exact" in c:
        ids = list(p["exact"]["tokens"])
        ag = token_agreement(p["exact"]["tokens"], c["exact"]["tokens"], ids, detail=True)
        ag["total"] = len(ids)
        ag["identical"] = ag["requests_identical"]
        ag["all_identical"] = ag["identical"] == len(ids)
        ag["prompt_lens"] = p["exact"]["prompt_lens"]
        out["exact_sequential"] = ag
    rows, under_load = [], []
    for k, (rp, rc) in enumerate(zip(p.get("mixed", []), c.get("mixed", []))):
        sp, sc = rp["summary"], rc["summary"]
        itl_ratio = _ratio(sc["itl_ms"]["p99"], sp["itl_ms"]["p99"])
        gp_ratio = _ratio(sp["goodput"], sc["goodput"])
        rows.append({
            "rate": rp["rate"],
            "itl_p99_ms": {"1p1d": sp["itl_ms"]["p99"], "colocated": sc["itl_ms"]["p99"]},
            "itl_p50_ms": {"1p1d": sp["itl_ms"]["p50"], "colocated": sc["itl_ms"]["p50"]},
            "ttft_p99_ms": {"1p1d": sp["ttft_ms"]["p99"], "colocated": sc["ttft_ms"]["p99"]},
            "tpot_p50_ms": {"1p1d": sp["tpot_ms"]["p50"], "colocated": sc["tpot_ms"]["p50"]},
            "goodput": {"1p1d": sp["goodput"], "colocated": sc["goodput"]},
            "slo_attainment": {"1p1d": sp["slo_attainment"], "colocated": sc["slo_attainment"]},
            "itl_p99_ratio": itl_ratio,
            "itl_pass": itl_ratio is not None and itl_ratio >= TARGETS["itl_p99_ratio_min"],
            "goodput_ratio": gp_ratio,
            "goodput_pass": gp_ratio is not None and gp_ratio >= TARGETS["goodput_ratio_min"]})
        tp, tc = mixed_tokens.get(("1p1d", k)), mixed_tokens.get(("colocated", k))
        if tp is not None and tc is not None:
            ag = token_agreement(tp, tc, list(tp))
            ag["rate"] = rp["rate"]
            under_load.append(ag)
    out["mixed"] = rows
    if rows:
        rp, rc = max_rate_at_slo(p.get("mixed", [])), max_rate_at_slo(c.get("mixed", []))
        ratio = _ratio(rp, rc)
        out["max_rate_at_slo"] = {
            "attainment": SLO_ATTAINMENT, "1p1d": rp, "colocated": rc, "ratio": ratio,
            "rates": sorted(r["rate"] for r in rows),
            "pass": ratio is not None and ratio >= TARGETS["goodput_ratio_min"]}
    if under_load:
        tot = {k: sum(x[k] for x in under_load) for k in
               ("requests_compared", "requests_identical", "tokens_compared",
                "tokens_before_divergence")}
        tot["token_agreement"] = round(tot["tokens_before_divergence"] / tot["tokens_compared"],
                                       4) if tot["tokens_compared"] else None
        out["agreement_under_load"] = {"per_rate": under_load, "total": tot}
    rerun = []  # control: colocated against a second run of itself
    for k in range(len(c.get("mixed", []))):
        ta, tb = mixed_tokens.get(("colocated", k)), mixed_tokens.get(("colocated_rerun", k))
        if ta is not None and tb is not None:
            ag = token_agreement(ta, tb, list(ta))
            ag["rate"] = c["mixed"][k]["rate"]
            rerun.append(ag)
    if rerun:
        out["agreement_under_load_colocated_vs_rerun"] = rerun
    out["pass"] = {
        "ttft_added": out.get("ttft", {}).get("pass"),
        "exact_sequential": out.get("exact_sequential", {}).get("all_identical"),
        "itl_p99_3x_at_rates": [r["rate"] for r in rows if r["itl_pass"]],
        "goodput_1.3x_at_rates": [r["rate"] for r in rows if r["goodput_pass"]],
        "max_rate_at_slo_1.3x": out.get("max_rate_at_slo", {}).get("pass"),
    }
    return out


# ------------------------------------------------------------------------------ report
def settings(a) -> dict:
    return {k: getattr(a, k) for k in (
        "model", "dtype", "kv_backend", "colocated_kv_backend", "devices", "quick", "seed",
        "vocab_size", "prompt_len", "rate_list", "duration", "num_requests", "long_frac",
        "short_len", "output_len", "ttft_repeats", "ttft_max_tokens", "exact_prompts",
        "exact_max_tokens", "warmup_rounds", "warmup_size", "timeout", "startup_timeout",
        "slo_ttft_ms", "slo_tpot_ms", "deps", "gemv", "worker_env", "time_budget",
        "gateway_args", "decode_worker_args")}


def _f(v, spec=".3g"):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def print_summary(doc: dict) -> None:
    cmp_ = doc.get("comparison")
    print("\n== disagg_gpu summary", flush=True)
    for name, dep in doc["deployments"].items():
        t = dep.get("ttft", {}).get("ttft_ms", {})
        print(f"   {name:10s} startup {dep.get('startup_s')} s; TTFT({doc['settings']['prompt_len']})"
              f" p50 {_f(t.get('p50'))} ms p90 {_f(t.get('p90'))} ms")
    if not cmp_:
        return
    if "ttft" in cmp_:
        t = cmp_["ttft"]
        print(f"   TTFT added by disaggregation: {_f(t['ttft_added_pct'])}% "
              f"({_f(t['ttft_added_ms'])} ms; target <= 5%): {'PASS' if t['pass'] else 'FAIL'}")
    if "exact_sequential" in cmp_:
        e = cmp_["exact_sequential"]
        print(f"   token-exact, one at a time: {e['identical']}/{e['total']} identical "
              f"({'PASS' if e['all_identical'] else 'FAIL'}); token agreement "
              f"{_f(e['token_agreement'], '.4f')}")
    if "agreement_under_load" in cmp_:
        g = cmp_["agreement_under_load"]["total"]
        print(f"   agreement under load: {g['requests_identical']}/{g['requests_compared']} "
              f"requests identical, token agreement {_f(g['token_agreement'], '.4f')}")
    print(f"   {'rate':>6s} {'ITL p99 1P1D':>13s} {'coloc':>8s} {'ratio':>6s}   "
          f"{'goodput 1P1D':>12s} {'coloc':>7s} {'ratio':>6s}   {'TTFT p99 1P1D':>13s} "
          f"{'coloc':>8s}")
    for r in cmp_.get("mixed", []):
        print(f"   {r['rate']:6g} {_f(r['itl_p99_ms']['1p1d'], '.1f'):>13s} "
              f"{_f(r['itl_p99_ms']['colocated'], '.1f'):>8s} {_f(r['itl_p99_ratio'], '.2f'):>5s}"
              f"{'*' if r['itl_pass'] else ' '}   {_f(r['goodput']['1p1d'], '.3g'):>12s} "
              f"{_f(r['goodput']['colocated'], '.3g'):>7s} {_f(r['goodput_ratio'], '.2f'):>5s}"
              f"{'*' if r['goodput_pass'] else ' '}   {_f(r['ttft_p99_ms']['1p1d'], '.0f'):>13s} "
              f"{_f(r['ttft_p99_ms']['colocated'], '.0f'):>8s}")
    print("   (* = target met: ITL p99 ratio >= 3, goodput ratio >= 1.3; ITL/TTFT in ms, "
          "goodput in req/s)", flush=True)
    m = cmp_.get("max_rate_at_slo")
    if m:
        print(f"   highest rate with >= {m['attainment']:.0%} of requests within the SLO: "
              f"1P1D {_f(m['1p1d'])}, colocated {_f(m['colocated'])} req/s, ratio "
              f"{_f(m['ratio'], '.2f')} (target >= 1.3): {'PASS' if m['pass'] else 'FAIL'}",
              flush=True)




# ------------------------------------------------------------------------------ merging
# settings that must agree for two runs' deployments to be compared (the workload)
_WORKLOAD_KEYS = ("model", "dtype", "devices", "seed", "vocab_size", "prompt_len", "rate_list",
                  "duration", "num_requests", "long_frac", "short_len", "output_len",
                  "ttft_repeats", "exact_prompts", "exact_max_tokens", "slo_ttft_ms",
                  "slo_tpot_ms", "gemv")


def merge(paths: list[str]) -> dict:
    """One report from runs that each measured some deployments (``--deployments 1p1d`` in
    one, ``colocated`` in another) on the same workload; later files win. Agreement under
    load is not available (the mixed workload's token ids are compared in memory only)."""
    docs = [json.load(open(p)) for p in paths]
    base = {k: docs[0]["settings"].get(k) for k in _WORKLOAD_KEYS}
    for p, d in zip(paths[1:], docs[1:]):
        other = {k: d["settings"].get(k) for k in _WORKLOAD_KEYS}
        diff = {k: (base[k], other[k]) for k in _WORKLOAD_KEYS if base[k] != other[k]}
        if diff:
            raise SystemExit(f"{p}: a different workload than {paths[0]}: {diff}")
    out = dict(docs[-1])
    out["deployments"] = {}
    for d in docs:
        out["deployments"].update(d["deployments"])
    out["merged_from"] = [{"path": p, "command": d.get("command"),
                           "kv_backend": d["settings"].get("kv_backend"),
                           "deployments": list(d["deployments"]), "started": d.get("started")}
                          for p, d in zip(paths, docs)]
    out["comparison"] = compare(out, {})
    return out


# ------------------------------------------------------------------------------ SLO limits
def rescore(row: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> tuple[int, int]:
    """(requests within another SLO, requests) of one rate of a run, from its per-request
    records (bench/disagg_gpu.py's REQUEST_FIELDS), by the rule of
    ``pdserve.benchlib.metrics.meets_slo``."""
    if "requests" not in row:
        raise ValueError(f"rate {row.get('rate')}: no per-request records to re-score")
    f = {k: i for i, k in enumerate(row["request_fields"])}
    good = 0
    for r in row["requests"]:
        ok = r[f["code"]] == "OK"
        rr = RequestResult(id=str(r[f["id"]]), start_s=r[f["start_s"]], ok=ok, code=r[f["code"]],
                           ttft_s=(r[f["ttft_ms"]] or 0.0) / 1000, latency_s=r[f["e2e_ms"]] / 1000,
                           completion_tokens=r[f["completion_tokens"]])
        good += meets_slo(rr, None if slo_ttft_ms is None else slo_ttft_ms / 1000,
                          None if slo_tpot_ms is None else slo_tpot_ms / 1000)
    return good, len(row["requests"])


def limits(docs: list[dict], attainment: float = SLO_ATTAINMENT,
           slo: tuple[float | None, float | None] | None = None) -> dict:
    """Each deployment's SLO limit from every rate it ran in ``docs`` (several runs, any rate
    lists, repeated rates with other samples), two ways:

    * ``rate``: the highest rate up to which every rate kept ``attainment`` of its requests
      within the SLO, the samples of a rate pooled (DistServe's goodput, on the grid);
    * ``prompt_tokens_per_s``: the highest offered prompt token rate that kept ``attainment``
      below the lowest that did not. It does not depend on how many long prompts a
      sample happened to draw.

    and the ratios of 1P1D's to colocated's when both ran. ``slo``: (TTFT ms, TPOT ms) to
    re-score every request against instead of the runs' own SLO (:func:`rescore`)."""
    rows: dict[str, list[dict]] = {}
    for d in docs:
        for name, dep in d["deployments"].items():
            for row in dep.get("mixed", []):
                s = row["summary"]
                good, sent = s["num_good"], s["num_requests"]
                if slo is not None:
                    good, sent = rescore(row, *slo)
                got = round(good / sent, 4) if sent and s.get("slo_attainment") is not None \
                    else None
                if got is None:
                    continue
                rows.setdefault(name, []).append({
                    "rate": row["rate"], "slo_attainment": got, "ok": got >= attainment,
                    "good": good, "sent": sent,
                    "offered_prompt_tokens_per_s": s.get("offered_prompt_tokens_per_s")})
    out: dict = {"attainment": attainment, "deployments": {}}
    if slo is not None:
        out["slo"] = {"ttft_ms": slo[0], "tpot_ms": slo[1]}
    for name, rs in rows.items():
        rs.sort(key=lambda r: (r["rate"], r["offered_prompt_tokens_per_s"] or 0))
        pooled: dict[float, list[int]] = {}
        for r in rs:
            acc = pooled.setdefault(r["rate"], [0, 0])
            acc[0] += r["good"]
            acc[1] += r["sent"]
        rate = max_rate_at_slo([{"rate": r, "summary": {"slo_attainment": g / n if n else None}}
                                for r, (g, n) in pooled.items()], attainment)
        toks = [r for r in rs if r["offered_prompt_tokens_per_s"] is not None]
        tok_fail = min((r["offered_prompt_tokens_per_s"] for r in toks if not r["ok"]),
                       default=math.inf)
        tok = max((r["offered_prompt_tokens_per_s"] for r in toks
                   if r["ok"] and r["offered_prompt_tokens_per_s"] < tok_fail), default=None)
        out["deployments"][name] = {
            "rate": rate, "prompt_tokens_per_s": tok, "samples": rs,
            "pooled_attainment": {r: round(g / n, 4) for r, (g, n) in sorted(pooled.items()) if n}}
    dp, dc = out["deployments"].get("1p1d"), out["deployments"].get("colocated")
    if dp and dc:
        out["ratio"] = {k: _ratio(dp[k], dc[k]) for k in ("rate", "prompt_tokens_per_s")}
    return out


def main(argv=None) -> None:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python3 -m bench.disagg_report",
                                description="Print, merge or find the SLO limits of "
                                            "bench/disagg_gpu.py reports")
    p.add_argument("reports", nargs="+")
    p.add_argument("--merge", action="store_true",
                   help="combine the deployments of several runs of the same workload")
    p.add_argument("--limits", action="store_true",
                   help="each deployment's SLO limit over every rate of the given runs")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="with --limits: re-score every request against this TTFT SLO (and "
                        "--slo-tpot-ms) instead of the runs' own")
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    prog = "python3 -m bench.disagg_report"
    if a.limits:
        slo = None
        if a.slo_ttft_ms is not None or a.slo_tpot_ms is not None:
            slo = (a.slo_ttft_ms, a.slo_tpot_ms)
        doc = harness.header("disagg_gpu", vars(a), argv=argv, prog=prog,
                             about="SLO limits over saved bench/disagg_gpu.py runs",
                             figures=LIMITS_FIGURES)
        doc.update(limits([json.load(open(r)) for r in a.reports], slo=slo))
        doc["inputs"] = a.reports
        for name, dep in doc["deployments"].items():
            print(f"{name:10s} limit {dep['rate']} req/s, {dep['prompt_tokens_per_s']} prompt "
                  f"tok/s; samples: " + ", ".join(
                      f"{r['rate']:g}:{r['slo_attainment']:.1%}"
                      f"({r['offered_prompt_tokens_per_s']})" for r in dep["samples"]))
        print("1P1D / colocated:", doc.get("ratio"))
    elif a.merge:
        doc = merge(a.reports)
        doc.update(harness.header("disagg_gpu", vars(a), argv=argv, prog=prog,
                                  about="bench/disagg_gpu.py runs merged", figures=FIGURES))
        print_summary(doc)
    else:
        doc = json.load(open(a.reports[0]))
        print_summary(doc)
    if a.out:
        harness.write_json(a.out, doc)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
