"""One tensor-parallel group: its process group (gloo on the CPU, NCCL on GPUs) and the
three collectives the model needs, each bounded by a timeout.

Rendezvous never opens a port: ranks meet through a ``FileStore`` in a private directory
(mode 0700, so only this user's processes can join), and gloo's connections bind 127.0.0.1.
The group is a standalone ``ProcessGroup`` object, not torch.distributed's global default,
so one process may hold several engines (tests) and nothing is left behind on close.

Every multi-GPU process runs with NVLink multicast off (``NVLINK_ENV``, set before CUDA or
NCCL initialise; DESIGN.md "Machines": multicast is not used on the lent machines).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1"}


def set_process_env() -> None:
    """Environment every rank process runs with (before CUDA / NCCL start)."""
    from pdcore.config_tree import environ, set_library_environ

    set_library_environ(NVLINK_ENV)
    if "NCCL_SOCKET_IFNAME" not in environ():  # NCCL's bootstrap sockets: loopback only
        set_library_environ({"NCCL_SOCKET_IFNAME": "lo"})


class TPGroup:
    """Rank ``rank`` of ``size``; ``device`` picks gloo (cpu) or NCCL (cuda). Modules hold the
    group from construction; :meth:`connect` (every rank, once all have loaded their
    weights, so nobody's rendezvous waits out a slow load) makes the process group."""

    def __init__(self, store_path: str, rank: int, size: int, device: torch.device,
                 timeout_s: float):
        self.rank, self.size, self.device = rank, size, device
        self.store_path = store_path
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = None
        self._bcast = dist.BroadcastOptions()
        self._bcast.rootRank = 0

    def connect(self) -> None:
        store = dist.FileStore(self.store_path, self.size)
        store.set_timeout(self.timeout)
        rank, size, device = self.rank, self.size, self.device
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(store, rank, size, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank ends with the same bits)."""
        self.pg.allreduce([t]).wait(self.timeout)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dim (rank order)."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([parts], [t]).wait(self.timeout)
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype on all)."""
        self.pg.broadcast([t], self._bcast).wait(self.timeout)
        return t

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a peer already gone: nothing to release
                pass
