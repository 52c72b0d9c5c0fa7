"""pdserve.cluster.orphan_guard: a LocalCluster's children end with the process that started
them, even when it is SIGKILLed (a killed test run or bench driver leaves nothing behind)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.cluster import REPO

PARENT = """
import subprocess, sys, time
from pdserve.cluster import orphan_guard
child = subprocess.Popen([*orphan_guard(), "sleep", "60"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_end_when_their_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the guard has exec'd sleep
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep"):
                    break
            time.sleep(0.05)
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
