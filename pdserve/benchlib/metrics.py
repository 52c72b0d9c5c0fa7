"""Per-request records and the figures of one run.

Definitions (all times in seconds inside, milliseconds in the report):

- TTFT: send -> first streamed message.
- TPOT (per request): ``(latency - ttft) / (completion_tokens - 1)``; requests with fewer than
  two tokens have none. Percentiles are over requests.
- ITL: the gaps between consecutive streamed messages, pooled over all requests (a message
  may carry more than one token; the gap is still one gap).
- E2E latency: send -> end of stream.
- The measurement window runs from the first measured request's send to the last measured
  request's end; throughputs divide by it. Goodput counts successful requests with
  ``ttft <= slo_ttft`` and ``tpot <= slo_tpot`` (an SLO left unset always passes; a request
  without a TPOT passes the TPOT SLO).
- Prefix-cache hit rate: sum of ``usage.cached_tokens`` / sum of ``usage.prompt_tokens``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
import math

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    id: str
    start_s: float  # send time, relative to the run's start
    ok: bool = False
    code: str = "OK"  # gRPC status code name, or CLIENT_<ExceptionType>
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # message arrivals, from send
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist_ms(xs: list[float]) -> dict:
    """mean and p50/p90/p99 of seconds, reported in milliseconds."""
    if not xs:
        return {"n": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    d = {"n": len(xs), "mean": round(1000 * sum(xs) / len(xs), 3)}
    for q in PERCENTILES:
        d[f"p{q}"] = round(1000 * percentile(xs, q), 3)
    return d


def meets_slo(r: RequestResult, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_s is not None and r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def summarize(results: list[RequestResult], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    errors = Counter(r.code for r in results if not r.ok)
    first_error: dict[str, str] = {}  # per code, the first request's message: what to fix
    for r in results:
        if not r.ok and r.code not in first_error:
            first_error[r.code] = r.error
    if results:
        t0 = min(r.start_s for r in results)
        t1 = max(r.end_s for r in results)
        window = max(t1 - t0, 1e-9)
    else:
        window = 0.0
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in results)
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)

    def rate(x):
        return round(x / window, 4) if window else 0.0

    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors_by_code": dict(sorted(errors.items())),
        "first_error_by_code": dict(sorted(first_error.items())),
        "duration_s": round(window, 4),
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(out_tokens),
        "goodput": rate(good),
        "num_good": good,
        "slo": {"ttft_ms": None if slo_ttft_s is None else slo_ttft_s * 1000,
                "tpot_ms": None if slo_tpot_s is None else slo_tpot_s * 1000},
        "prompt_tokens": prompt_tokens,
        "completion_tokens": out_tokens,
        "cached_tokens": cached,
        "prefix_cache_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else None,
        "ttft_ms": dist_ms([r.ttft_s for r in ok]),
        "tpot_ms": dist_ms([t for t in (r.tpot_s for r in ok) if t is not None]),
        "itl_ms": dist_ms([g for r in ok for g in r.itls()]),
        "e2e_ms": dist_ms([r.latency_s for r in ok]),
    }


# The figures --compare puts side by side: (label, path in the summary, higher is better)
COMPARE_KEYS = [
    ("request throughput (req/s)", ("request_throughput",), True),
    ("output throughput (tok/s)", ("output_token_throughput",), True),
    ("goodput (req/s)", ("goodput",), True),
    ("prefix cache hit rate", ("prefix_cache_hit_rate",), True),
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), False),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), False),
    ("TPOT p50 (ms)", ("tpot_ms", "p50"), False),
    ("TPOT p99 (ms)", ("tpot_ms", "p99"), False),
    ("ITL p50 (ms)", ("itl_ms", "p50"), False),
    ("ITL p99 (ms)", ("itl_ms", "p99"), False),
    ("E2E p50 (ms)", ("e2e_ms", "p50"), False),
    ("E2E p99 (ms)", ("e2e_ms", "p99"), False),
    ("errors", ("num_errors",), False),
]


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def compare(a: dict, b: dict) -> list[dict]:
    """Rows of (metric, a, b, b/a) for two summaries."""
    rows = []
    for label, path, higher in COMPARE_KEYS:
        va, vb = _get(a, path), _get(b, path)
        ratio = round(vb / va, 4) if va and vb is not None else None
        rows.append({"metric": label, "a": va, "b": vb, "b_over_a": ratio,
                     "higher_is_better": higher})
    return rows
