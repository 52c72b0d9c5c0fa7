"""services.healthcheck (the docker-compose probe) against a real GrpcServer."""
from __future__ import annotations

import asyncio

from services.grpc_server import GATEWAY_SERVICE, GrpcServer
from services.healthcheck import check, main


def test_healthcheck_reports_serving_then_not_serving():
    async def go():
        srv = GrpcServer([GATEWAY_SERVICE], host="127.0.0.1", port=0)
        port = await srv.start()
        addr = f"127.0.0.1:{port}"
        up = await asyncio.to_thread(check, addr)
        rc = await asyncio.to_thread(main, [addr, "--service", GATEWAY_SERVICE])
        await srv.set_serving(False)
        down = await asyncio.to_thread(check, addr)
        rc_down = await asyncio.to_thread(main, [addr])
        await srv.stop(0)
        gone = await asyncio.to_thread(check, addr, "", 0.5)
        return up, rc, down, rc_down, gone
    up, rc, down, rc_down, gone = asyncio.run(go())
    assert (up, rc, down, rc_down) == ("SERVING", 0, "NOT_SERVING", 1)
    assert gone in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
