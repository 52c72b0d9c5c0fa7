"""PNG plots of benchmark runs (matplotlib, headless Agg backend).

``runs`` is a list of ``(label, x, summary, results)``: a line label (deployment, and rate when
several), the offered load (req/s or concurrency), the run's summary and its request records.
"""
from __future__ import annotations


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, xs_s: list[float], label: str) -> None:
    if not xs_s:
        return
    xs = sorted(1000 * x for x in xs_s)
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=label)


def latency_cdfs(runs, path: str, title: str = "") -> str:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("TTFT", lambda rs: [r.ttft_s for r in rs if r.ok]),
              ("TPOT", lambda rs: [r.tpot_s for r in rs if r.tpot_s is not None]),
              ("inter-token latency", lambda rs: [g for r in rs if r.ok for g in r.itls()]),
              ("end-to-end latency", lambda rs: [r.latency_s for r in rs if r.ok])]
    for ax, (name, pick) in zip(axes.flat, panels):
        for label, _x, _summary, results in runs:
            _cdf(ax, pick(results), label)
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("gaps" if "inter" in name else "requests"))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_load(series: dict, path: str, xlabel: str, title: str = "") -> str:
    """``series``: deployment label -> list of (x, summary), one per run."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, pts in series.items():
        pts = sorted(pts, key=lambda p: p[0])
        xs = [p[0] for p in pts]
        a1.plot(xs, [p[1]["output_token_throughput"] for p in pts], "o-", label=label)
        a2.plot(xs, [p[1]["request_throughput"] for p in pts], "o-", label=f"{label} throughput")
        a2.plot(xs, [p[1]["goodput"] for p in pts], "s--", label=f"{label} goodput")
    a1.set_title("output tokens/s")
    a2.set_title("requests/s: throughput and goodput (SLO)")
    for ax in (a1, a2):
        ax.set_xlabel(xlabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput against load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
