"""kvtransfer between two real processes: a round trip, then the receiver process killed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import uvloop

from kvtransfer import KVLayout, TransferState, make_sender

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(4, 4, 64, 16, "float32")
N = 512  # 64 MiB: more than the socket buffers / shm ring hold

# The child is the decode side. Transfer "rt": check the data, print its checksum.
# Transfer "victim": as soon as the data starts to arrive, stop reading (block the loop) and
# wait to be killed.
_CHILD_RECEIVER = """
import asyncio, sys, time, torch
from kvtransfer import KVLayout, TransferState, make_receiver
backend, n = sys.argv[1], int(sys.argv[2])
layout = KVLayout(4, 4, 64, 16, "float32")

async def main():
    dst = torch.zeros(n + 8, *layout.block_shape)
    rx = make_receiver(backend, dst, layout)
    await rx.start()
    rt = rx.expect("rt", list(range(n + 7, 7, -1)), 30)
    victim = rx.expect("victim", list(range(n)), 60)
    print(rx.endpoint, flush=True)
    res = await rt.wait()
    print(res.state.value, float(dst[8:].double().sum()), flush=True)
    while victim.state is TransferState.PENDING:
        await asyncio.sleep(0.001)
    print("transferring", flush=True)
    time.sleep(60)

asyncio.run(main())
"""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_processes_round_trip_then_receiver_killed(backend):
    async def main():
        src = torch.arange(N * LAYOUT.block_bytes // 4, dtype=torch.float32).remainder_(977)
        src = src.view(N, *LAYOUT.block_shape)
        tx = make_sender(backend, src, LAYOUT)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_RECEIVER, backend, str(N)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        loop = asyncio.get_running_loop()

        async def line() -> str:
            return (await loop.run_in_executor(None, proc.stdout.readline)).strip()

        try:
            endpoint = await asyncio.wait_for(line(), 30)
            res = await tx.send("rt", endpoint, list(range(N)), 30)
            assert res.state is TransferState.DONE, res
            state, checksum = (await line()).split()
            assert state == "done"
            assert float(checksum) == float(src.double().sum())

            task = asyncio.create_task(tx.send("victim", endpoint, list(range(N)), 60))
            assert await asyncio.wait_for(line(), 10) == "transferring"
            proc.kill()
            t0 = time.monotonic()
            res = await asyncio.wait_for(task, 5)
            assert res.state is TransferState.FAILED, res
            assert time.monotonic() - t0 < 2.0
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            await tx.close()

    uvloop.run(main())
