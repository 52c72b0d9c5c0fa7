"""bench.gpu_engine on one card with the fp8 paths of 2026-12-06 switched off ("before") or
as they are ("after"), so both sides run on the same warm GPU:

    python3 -m bench.fp8_ab_gpu before --defaults --quantization fp8 --sections a,c,b --out A.json
    python3 -m bench.fp8_ab_gpu after  --defaults --quantization fp8 --sections a,c,b --out B.json

"before" takes away: the FP8 tensor-core GEMV (no f8mma configs for the tuner; fp8 calls of
2..8 rows back on the a8 GEMV, one program row per token), the prologues fused into the
activation quantization of fp8 prefills (QuantLinear.prologue_forward), and the unrolled
passes over x of the one-token GEMV (matvec.gemv unroll=False).
"""
import functools
import sys


def switch_off() -> None:
    """Put the fp8 paths back as they were before 2026-12-06 (module docstring)."""
    import engine.kernels.gemv_tune as GT
    import engine.kernels.matvec as MV
    import engine.quant.kernels as QK
    from engine.quant.linear import QuantLinear
    GT.F8_CONFIGS = []
    QuantLinear.prologue_forward = lambda self, *a, **k: None
    MV.gemv = functools.partial(MV.gemv, unroll=False)
    orig = QK.quant_linear

    def quant_linear(x, qw, bias=None):
        if qw["format"] == "fp8" and x.shape[0] <= QK.GEMV_MAX_ROWS:
            return MV.gemv(x.contiguous(), qw["q"], bias, **QK.gemv_keywords(qw))
        return orig(x, qw, bias)
    QK.quant_linear = quant_linear


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("before", "after"):
        sys.exit("usage: python3 -m bench.fp8_ab_gpu before|after [bench.gpu_engine arguments]")
    if argv[0] == "before":
        switch_off()
    import bench.gpu_engine as G
    return G.main(argv[1:])


if __name__ == "__main__":
    main()
