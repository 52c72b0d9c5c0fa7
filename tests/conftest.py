"""Shared fixtures: a private redis-server per test, free ports.

``redis_proc`` starts ``redis-server`` on a free port (never 6379) with ``--save ""
--appendonly no`` and yields a :class:`RedisProcess` (the same class ``pdserve up`` uses);
tests may ``kill()`` it (SIGKILL, like a crash) and ``start()`` it again on the same port (it
comes back empty). ``redis_server`` is the same process's URL (``redis://127.0.0.1:PORT/0``);
ask for both to kill/restart it.
"""
from __future__ import annotations

import os

import pytest
import torch

# Triton decides at decoration time whether to interpret: set it before anything imports
# engine.kernels. On a GPU machine the kernels compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The default suite runs on the CPU on any machine: device "auto" would pick a GPU where one
# is visible (in process and in the workers the tests start). GPU tests name their device,
# and those of device "auto" remove this variable.
os.environ.setdefault("PDSERVE_DEVICE", "cpu")

from pdserve.cluster import RedisProcess, free_port, wait_port  # noqa: F401 - re-exported


@pytest.fixture
def redis_proc():
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_proc: RedisProcess) -> str:
    return redis_proc.url


# ------------------------------------------------------------------ CI's time budget
def pytest_addoption(parser):
    parser.addoption(
        "--start-by", type=float, default=0.0, metavar="UNIX_TIME",
        help="start no test after this Unix time: later ones are skipped, with the reason "
             "(.ci/run gives the slow suite what is left of CI's 90 minutes; each test "
             "runs at most the configured pytest timeout after it starts)")


def pytest_runtest_setup(item):
    import time

    start_by = item.config.getoption("--start-by")
    if start_by and time.time() > start_by:
        pytest.skip("not started: CI's time budget is spent (.ci/run --start-by)")
