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


def test_healthcheck_speaks_mutual_tls_with_the_services_own_files(tmp_path, monkeypatch):
    """The Kubernetes / compose probes: the worker's port needs a cluster certificate, which
    the probe takes from the service's own PDSERVE_TLS_* variables."""
    from services import tls
    files = tls.write_cluster_files(str(tmp_path / "certs"))
    me = tls.ClusterTls(files.ca_file, files.cert("decode"), files.key("decode"))

    async def go():
        srv = GrpcServer([], host="127.0.0.1", port=0, credentials=me.server_credentials())
        addr = f"127.0.0.1:{await srv.start()}"
        plain = await asyncio.to_thread(main, [addr, "--plaintext"])
        monkeypatch.setenv("PDSERVE_TLS_CA_FILE", files.ca_file)
        monkeypatch.setenv("PDSERVE_TLS_CERT_FILE", files.cert("decode"))
        monkeypatch.setenv("PDSERVE_TLS_KEY_FILE", files.key("decode"))
        with_files = await asyncio.to_thread(main, [addr])
        await srv.stop(0)
        return plain, with_files
    assert asyncio.run(go()) == (1, 0)
