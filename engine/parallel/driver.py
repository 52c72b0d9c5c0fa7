"""Rank 0 of a tensor-parallel engine: starts the other ranks, builds its own shard, and
stands in for the model in the model runner (:class:`TPModel`).

One engine = ``n`` processes: this one (rank 0: scheduler, block manager, sampling, the KV
transfer endpoints) and ``n - 1`` rank processes (engine.parallel.rank) spawned here. Each
process loads only its own slices of the weights. Each step rank 0 sends the step's flat
inputs to every rank through a pipe, then all ranks run the same forward pass, meeting in
the row-parallel all-reduces; for sampling rank 0 broadcasts the hidden rows it samples and
every rank contributes its vocabulary slice of the logits (all-gather).

KV cache: on the CPU one cache holds every KV head, in memory shared by the ranks (a memfd:
not bound by /dev/shm's size, pages backed only once written); each rank reads and writes
the view of its heads (ranks that replicate a head write the same bytes). So rank 0's
``kv_cache`` is the whole model's cache and a KV transfer moves blocks of every head, in the
model's head order, whatever the TP size of either side: gathering the heads from the ranks
and scattering them to the ranks is done by the memory the ranks share. On GPUs each rank
keeps its heads on its own device; KV transfer from such an engine is not built (issue 28).

Failure: a rank that exits (killed, crashed) is seen at once (a pipe write or a collective
fails: gloo reports the reset connection); one that hangs fails the collective after
``tensor_parallel_timeout_s``. Either way the step raises :class:`RankFailure`, the engine
is dead, and :attr:`TensorParallel.failure` says why (a serving worker polls it to end).
"""
from __future__ import annotations

import logging
import mmap
from multiprocessing.connection import Pipe
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.group import NVLINK_ENV, TPGroup, set_process_env
from engine.parallel.plan import ShardPlan, check_shardable

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


def map_shared(fd: int, shape: tuple[int, ...], dtype: torch.dtype):
    """(tensor over the shared memory behind ``fd``, the mapping to keep alive)."""
    n = 1
    for d in shape:
        n *= d
    mm = mmap.mmap(fd, n * dtype.itemsize)
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape), mm


class TensorParallel:
    """Rank 0's handle on the group: processes, pipes, the shared KV cache."""

    def __init__(self, config: EngineConfig):
        """``config``: resolved (device and dtype known). Starts ranks 1..n-1 at once, so
        they load their shards while this process loads its own."""
        set_process_env()
        self.config = config
        self.size = n = config.tensor_parallel_size
        if config.device_kind == "cpu" and not config.num_threads:
            # N processes share the cores: torch's default (all of them each) oversubscribes
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        self.dir = tempfile.mkdtemp(prefix="pdserve-tp-")  # 0700: only this user joins
        store = os.path.join(self.dir, "store")
        self.conns, self.procs = [], []
        try:
            for r in range(1, n):
                conn, proc = _start_rank()
                self.conns.append(conn)
                self.procs.append(proc)
                conn.send(("init", r, n, store, config))
        except BaseException:
            _shutdown(self.conns, self.procs, self.dir)
            raise
        # ranks 1..n-1 once loaded: {"peak_rss", "anon_before", "anon_peak"} in bytes
        self.rank_memory: list[dict] = []
        self.group = TPGroup(store, 0, n, torch.device(config.device),
                             config.tensor_parallel_timeout_s)
        self._failure: str | None = None
        self._mapping = None
        self._finalizer = weakref.finalize(self, _shutdown, self.conns, self.procs, self.dir)
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", n - 1, self.pids)

    def plan(self, mc: ModelConfig) -> ShardPlan:
        check_shardable(mc, self.size)
        return ShardPlan(mc, 0, self.size)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # --------------------------------------------------------------- start-up
    def build(self, mc: ModelConfig, weights: dict, device: torch.device,
              dtype: torch.dtype) -> "TPModel":
        """Rank 0's shard, once every rank has loaded its own; then the group connects."""
        from engine.parallel.shard import build_shard

        plan = self.rank_plan = self.plan(mc)
        model = build_shard(mc, plan, self.group, weights, device, dtype)
        for r, conn in enumerate(self.conns, start=1):
            msg = self._recv(r, conn)
            if msg[0] != "loaded":
                raise RankFailure(f"tensor-parallel {msg[1]}")
            self.rank_memory.append(msg[1])
        self.send(("connect",))
        self.group.connect()
        logger.info("tensor parallel: %d ranks connected (rank pids %s)", self.size, self.pids)
        return TPModel(self, model, plan)

    def _recv(self, r: int, conn):
        """A rank's answer, waiting while it lives (a load may take long: no timeout)."""
        while not conn.poll(0.2):
            p = self.procs[r - 1]
            if p.poll() is not None:
                raise RankFailure(f"tensor-parallel rank {r} (pid {p.pid}) exited with code "
                                  f"{p.returncode} while loading")
        try:
            return conn.recv()
        except EOFError:
            raise RankFailure(f"tensor-parallel rank {r} closed its pipe") from None

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """Allocate the KV cache (every head) and give the ranks their part (see module)."""
        self.send(("cache", tuple(shape), str(dtype).removeprefix("torch.")))
        if device.type == "cuda":  # this rank's heads only
            return torch.zeros((*shape[:4], self.rank_plan.num_kv_heads, shape[5]), dtype=dtype,
                               device=device)
        from multiprocessing.reduction import send_handle

        n = dtype.itemsize
        for d in shape:
            n *= d
        fd = os.memfd_create("pdserve-kv-cache")
        try:
            os.ftruncate(fd, n)
            cache, self._mapping = map_shared(fd, tuple(shape), dtype)
            for conn, p in zip(self.conns, self.procs):
                send_handle(conn, fd, p.pid)
        finally:
            os.close(fd)
        return cache

    def cache_fraction(self, device: torch.device) -> float:
        """The part of a whole-model KV block that rank 0 stores: all of it on the CPU (one
        shared cache), its heads' share on a GPU (each rank its own)."""
        if device.type != "cuda":
            return 1.0
        return self.rank_plan.num_kv_heads / self.rank_plan.config.num_kv_heads

    # ----------------------------------------------------------------- steps
    def send(self, msg) -> None:
        self.check()
        for r, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except (OSError, EOFError) as e:
                raise self._failed(f"tensor-parallel rank {r}: {e!r}") from e

    def check(self) -> None:
        """Raise RankFailure if the group is broken (a rank exited, or a step failed)."""
        if self._failure is None:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    self._failure = (f"tensor-parallel rank {r} (pid {p.pid}) exited with "
                                     f"code {p.returncode}")
                    break
        if self._failure is not None:
            raise RankFailure(self._failure)

    @property
    def failure(self) -> str | None:
        """Why the group is broken, or None while every rank lives."""
        try:
            self.check()
        except RankFailure as e:
            return str(e)
        return None

    def _failed(self, why: str) -> RankFailure:
        """A collective or pipe failed: name the rank that died if one did (its exit is
        reaped within a second), else the error itself."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        if self._failure is None:
            try:
                self.check()
            except RankFailure:
                pass
        if self._failure is None:
            self._failure = why
        return RankFailure(self._failure)

    def close(self) -> None:
        self.group.close()
        self._finalizer()


def _start_rank():
    """A rank process (``python -m engine.parallel.rank FD``): a fresh interpreter, so the
    caller's main module is never re-imported (multiprocessing's spawn would run a script
    without a ``__main__`` guard again), talking over one end of a socket pair."""
    mine, theirs = Pipe(duplex=True)  # a Unix socket pair (file descriptors pass over it)
    from pdcore.config_tree import child_environ, environ

    # the folder holding the engine package (engine/parallel/driver.py -> three levels up)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(x for x in (root, environ().get("PYTHONPATH")) if x)
    env = child_environ({**NVLINK_ENV, "PYTHONPATH": path})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.rank",
                                 str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env,
                                stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    return mine, proc


def _shutdown(conns, procs, path) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except Exception:  # noqa: BLE001 - that rank is gone already
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(2.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(path, ignore_errors=True)


class TPModel:
    """What the model runner calls instead of the model: each call tells the other ranks
    to do the same, then runs rank 0's shard."""

    def __init__(self, tp: TensorParallel, model: torch.nn.Module, plan: ShardPlan):
        self.tp, self.model, self.plan = tp, model, plan
        self.config = model.config

    def __call__(self, ids, positions, kv_cache, meta, backend, after_layer=None):
        from engine.parallel.shard import head_view, pack_step

        self.tp.send(("forward", pack_step(ids, positions, meta)))
        try:
            return self.model(ids, positions, head_view(kv_cache, self.plan), meta, backend,
                              after_layer)
        except RuntimeError as e:
            raise self.tp._failed(f"tensor-parallel forward failed: {e}") from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from engine.parallel.shard import local_logits

        hidden = hidden.contiguous()
        self.tp.send(("logits", tuple(hidden.shape)))
        try:
            self.tp.group.broadcast(hidden)
            return local_logits(self.model, hidden, self.tp.group, self.config.vocab_size)
        except RuntimeError as e:
            raise self.tp._failed(f"tensor-parallel logits failed: {e}") from e

    def enable_fused_ops(self, on: bool = True) -> None:
        self.model.enable_fused_ops(on)

    def eval(self):
        return self

    def parameters(self):
        return self.model.parameters()

    def buffers(self):
        return self.model.buffers()
