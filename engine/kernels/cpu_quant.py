"""CPU matrix-vector products straight from GGUF Q4_1 / Q8_0 blocks (batch-1 decode).

The weights stay packed (about 0.75 byte per weight for Q4_1, 1.125 for Q8_0, instead of 4
in fp32); the C++ kernel in cpu_quant.cpp expands each 32-weight block in registers to the
very same fp32 values that engine/loader/dequant.py produces and accumulates in fp32, so only
the summation order differs from a dense fp32 matmul. Decode is memory-bound, so reading ~5x
fewer bytes is what makes it faster.

Packed layout (row-major; one row = one output feature; K % 32 == 0):

    ("q4_1", qs uint8 [N, K/2], d float32 [N, K/32], m float32 [N, K/32])   w = d * q + m
        qs holds each block's 16 bytes as in the file: low nibbles = weights 0..15 of the
        block, high nibbles = weights 16..31
    ("q8_0", qs int8 [N, K], d float32 [N, K/32])                            w = d * q

The extension is compiled with torch.utils.cpp_extension on first use (g++ and ninja needed;
-O3 -march=native -fopenmp) and cached in torch's extensions directory, under a name that
includes a hash of the source and of this CPU's flags. If it cannot be built, `available()`
is False (logged once) and callers keep the dense fp32 path. The engine setting cpu_packed
(``PDSERVE_CPU_PACKED=off``) keeps the engine off it; on (default) uses it when it builds.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading

from pdcore.config_tree import environ

import torch

logger = logging.getLogger(__name__)

__all__ = ["available", "q4_1_gemv", "q8_0_gemv", "q4_1_gemv_ref", "q8_0_gemv_ref",
           "packed_gemv", "packed_gemv_ref", "pack_q4_1", "pack_q8_0", "dequant_packed",
           "MAX_PACKED_TOKENS"]

MAX_PACKED_TOKENS = 8  # the packed GEMV serves at most this many tokens per call
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_quant.cpp")
_lock = threading.Lock()
_ext = None
_tried = False


def _cpu_tag() -> str:
    """Hash of this CPU's feature flags: a -march=native build must not be reused elsewhere."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _build():
    from torch.utils.cpp_extension import load

    # CXX: torch.utils.cpp_extension's compiler choice (a standard variable, not a setting)
    if shutil.which(environ().get("CXX", "g++")) is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    with open(_SRC, "rb") as f:
        src = f.read()
    name = f"pdserve_cpu_quant_{hashlib.sha1(src).hexdigest()[:8]}_{_cpu_tag()}"
    # build from a copy at a path that depends only on the source's content: ninja rebuilds
    # whenever the source's path changes, so two checkouts of the same code (or a moved
    # one) sharing torch's extension cache would otherwise rebuild it in turn, each start
    cache = os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    os.makedirs(cache, exist_ok=True)
    stable = os.path.join(cache, name + ".cpp")
    if not os.path.exists(stable):
        tmp = f"{stable}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(src)
        os.replace(tmp, stable)
    return load(name=name + "_c", sources=[stable],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def _get():
    global _ext, _tried
    if _tried:
        return _ext
    with _lock:
        if not _tried:
            try:
                import time
                t0 = time.perf_counter()
                _ext = _build()
                logger.info("cpu_quant extension ready in %.1fs (simd=%s)",
                            time.perf_counter() - t0, _ext.simd_enabled())
            except Exception as e:  # noqa: BLE001 - any build failure means: stay dense
                logger.warning("cpu_quant: packed GEMV extension unavailable (%s: %s); "
                               "using dense fp32 weights", type(e).__name__, e)
                _ext = None
            _tried = True
    return _ext


def available() -> bool:
    """True when the extension is built (building it on the first call)."""
    return _get() is not None


# ------------------------------------------------------------------ kernels
def q4_1_gemv(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (Q4_1 weights [N, K])^T -> [M, N] float32."""
    ext = _get()
    if ext is None:
        return q4_1_gemv_ref(x, qs, d, m)
    return ext.q4_1_gemv(x, qs, d, m)


def q8_0_gemv(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (Q8_0 weights [N, K])^T -> [M, N] float32."""
    ext = _get()
    if ext is None:
        return q8_0_gemv_ref(x, qs, d)
    return ext.q8_0_gemv(x, qs, d)


def packed_gemv(x: torch.Tensor, packed: tuple) -> torch.Tensor:
    kind, *t = packed
    return q4_1_gemv(x, *t) if kind == "q4_1" else q8_0_gemv(x, *t)


# ------------------------------------------------------------------ references
def dequant_packed(packed: tuple) -> torch.Tensor:
    """Packed tuple -> dense float32 [N, K], same values and rounding as loader.dequant."""
    kind, qs, d, *rest = packed
    n = qs.shape[0]
    if kind == "q4_1":
        m = rest[0]
        b = qs.reshape(n, -1, 16)
        q = torch.empty(n, b.shape[1], 32, dtype=torch.float32)
        q[..., :16].copy_(b & 0x0F)
        q[..., 16:].copy_(b >> 4)
        return q.mul_(d.unsqueeze(-1)).add_(m.unsqueeze(-1)).reshape(n, -1)
    if kind == "q8_0":
        q = qs.reshape(n, -1, 32).float()
        return q.mul_(d.unsqueeze(-1)).reshape(n, -1)
    raise ValueError(f"unknown packed kind {kind!r}")


def q4_1_gemv_ref(x, qs, d, m):
    return x @ dequant_packed(("q4_1", qs, d, m)).t()


def q8_0_gemv_ref(x, qs, d):
    return x @ dequant_packed(("q8_0", qs, d)).t()


def packed_gemv_ref(x, packed):
    return x @ dequant_packed(packed).t()


# ------------------------------------------------------------------ packing raw GGUF bytes
def pack_q4_1(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple:
    """Raw GGUF bytes of a Q4_1 tensor [N, K] (20-byte blocks: fp16 d, fp16 m, 16 bytes of
    nibbles) -> ("q4_1", qs, d, m)."""
    n, k = int(shape[0]), int(shape[1])
    b = raw.reshape(n, k // 32, 20)
    dm = b[..., :4].contiguous().view(torch.float16).float()  # (n, k/32, 2)
    return ("q4_1", b[..., 4:].contiguous().reshape(n, k // 2), dm[..., 0].contiguous(),
            dm[..., 1].contiguous())


def pack_q8_0(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple:
    """Raw GGUF bytes of a Q8_0 tensor [N, K] (34-byte blocks: fp16 d, 32 x int8) ->
    ("q8_0", qs, d)."""
    n, k = int(shape[0]), int(shape[1])
    b = raw.reshape(n, k // 32, 34)
    d = b[..., :2].contiguous().view(torch.float16).float().reshape(n, k // 32)
    return ("q8_0", b[..., 2:].contiguous().view(torch.int8).reshape(n, k), d.contiguous())
