"""A tensor-parallel rank other than 0: a process that holds one shard and runs each step
rank 0 hands it. It keeps no scheduler and no block manager; rank 0 (the engine) sends each
step's flat inputs through a pipe, and the ranks meet only in the model's collectives.

Messages (rank 0 -> rank, in order):
    ("connect",)                 join the process group (after every rank has loaded)
    ("cache", shape, dtype)      the KV cache: CPU, the memfd of rank 0's shared cache
                                 follows (every head; this rank uses its heads' view);
                                 GPU: allocate this rank's heads on its own device
    ("forward", step)            run the forward pass (engine.parallel.shard.pack_step)
    ("logits", shape)            take the hidden rows rank 0 broadcasts; gather the logits
    ("stop",)                    exit
The first message, ("init", rank, size, store path, config), comes before all of these.
A rank answers ("loaded", its memory figures while loading: bytes) or ("error", text) after loading. It exits on any
error, on EOF (rank 0 gone) and on "stop"; a collective whose peer died fails at once
(gloo: connection reset) and one whose peer hangs fails after the group's timeout.
"""
from __future__ import annotations

import logging
import os
import resource

logger = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: not the file pages a
    safetensors mmap faults in, which the kernel can drop), sampled every ``period_s``
    while the ``with`` block runs (Linux; 0 elsewhere)."""

    def __init__(self, period_s: float = 0.005):
        self.period_s, self.peak = period_s, 0

    def __enter__(self) -> "AnonPeak":
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _take(self) -> None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
        except OSError:
            pass

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()


def rss_bytes() -> int:
    """Resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: cpu, or the GPU ``rank`` places after rank 0's."""
    if not device.startswith("cuda"):
        return "cpu"
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def main(argv: list[str]) -> None:
    """``python -m engine.parallel.rank FD``: FD is this rank's end of rank 0's socket pair;
    the first message is ("init", rank, size, store path, resolved EngineConfig)."""
    from multiprocessing.connection import Connection

    from engine.parallel.group import set_process_env

    set_process_env()
    conn = Connection(int(argv[0]))
    code = 0
    try:
        _, rank, size, store_path, config = conn.recv()
    except EOFError:
        os._exit(1)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    try:
        _serve(rank, size, store_path, config, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # rank 0 ended (its worker stopped, even while this rank was loading): nothing to
        # report to, and no traceback to print
        logger.warning("rank 0 is gone: exiting")
        code = 1
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process ends
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", f"rank {rank}: {e!r}"[:500]))
        except Exception:  # noqa: BLE001 - rank 0 gone
            pass
        code = 1
    os._exit(code)  # no atexit / finaliser may block on a dead group


def _serve(rank: int, size: int, store_path: str, config, conn) -> None:
    import torch

    from engine.loader import load_model
    from engine.model_runner import DTYPES, make_attention_backend
    from engine.parallel.group import TPGroup
    from engine.parallel.plan import ShardPlan
    from engine.parallel.shard import build_shard, head_view, local_logits, unpack_step

    device = torch.device(rank_device(config.device, rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // size))
    dtype = DTYPES[config.dtype]
    before = AnonPeak()
    before._take()  # the interpreter, torch and the engine's modules
    with AnonPeak() as anon:
        loaded = load_model(config.model, dtype=dtype, device=str(device), seed=config.seed,
                            keep_packed=False, shard=lambda c: ShardPlan(c, rank, size))
        mc = loaded.config
        plan = ShardPlan(mc, rank, size)
        group = TPGroup(store_path, rank, size, device, config.tensor_parallel_timeout_s)
        model = build_shard(mc, plan, group, loaded.weights, device, dtype)
        loaded.weights = None
    backend = make_attention_backend(config, mc)
    if device.type == "cuda" and backend.name == "triton":
        model.enable_fused_ops(True)
    conn.send(("loaded", {"peak_rss": peak_rss_bytes(), "anon_before": before.peak,
                          "anon_peak": anon.peak}))
    kv = None
    keep = None  # the shared mapping behind ``kv`` (alive while this loop runs)
    with torch.inference_mode():
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "forward":
                ids, pos, meta = unpack_step(msg[1], device)
                cache = kv if kv is not None else _scratch(meta, mc, plan, config, dtype, device)
                model(ids, pos, head_view(cache, plan), meta, backend)
            elif kind == "logits":
                hidden = torch.empty(msg[1], dtype=dtype, device=device)
                group.broadcast(hidden)
                local_logits(model, hidden, group, mc.vocab_size)
            elif kind == "cache":
                kv, keep = _attach_cache(conn, msg[1], DTYPES[msg[2]], device, plan)
            elif kind == "connect":
                group.connect()
            elif kind == "stop":
                group.close()
                return
            else:
                raise ValueError(f"unknown message {kind!r}")


def _scratch(meta, mc, plan, config, dtype, device):
    """A throwaway cache for a step before the real one exists: rank 0's GPU memory
    profile (engine.kv_memory) runs a step on a scratch cache of its own."""
    import torch

    from engine.model_runner import DTYPES

    bs = config.cache.block_size
    n = int(meta.slot_mapping.max().item()) // bs + 1
    kv_dtype = DTYPES[config.cache.kv_dtype] if config.cache.kv_dtype else dtype
    return torch.zeros((n, mc.num_layers, 2, bs, plan.num_kv_heads, mc.head_dim),
                       dtype=kv_dtype, device=device)


def _attach_cache(conn, shape, dtype, device, plan):
    import torch

    if device.type == "cuda":
        local = (*shape[:4], plan.num_kv_heads, shape[5])
        return torch.zeros(local, dtype=dtype, device=device), None
    from multiprocessing.reduction import recv_handle

    from engine.parallel.driver import map_shared
    fd = recv_handle(conn)
    try:
        return map_shared(fd, shape, dtype)
    finally:
        os.close(fd)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
