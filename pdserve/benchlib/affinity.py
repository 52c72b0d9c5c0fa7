"""Keep a benchmark's client off the server's CPUs (Linux affinity), so that on a small
machine what a client costs is not taken from the server it measures."""
from __future__ import annotations

import os


def pin_processes(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes onto ``cpus`` (threads started later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:  # a thread that just ended
                pass


def split_cluster(cluster) -> dict | None:
    """A LocalCluster's processes (gateway, workers, redis-server) onto every CPU but the
    last, this process (the client) onto the last; None (nothing pinned) with one CPU.
    Returns the split, for the results."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    servers = [cluster.gateway.proc.pid] + [w.proc.pid for w in cluster.workers]
    if cluster.redis is not None and cluster.redis.proc is not None:
        servers.append(cluster.redis.proc.pid)
    pin_processes(servers, set(cpus[:-1]))
    pin_processes([os.getpid()], {cpus[-1]})
    return {"server": cpus[:-1], "client": cpus[-1:]}
