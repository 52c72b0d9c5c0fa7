"""Probe a service's ``grpc.health.v1.Health``: exit 0 when SERVING, 1 otherwise.

    python -m services.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

Used by the docker-compose health checks and the Kubernetes probes (exec: the kubelet's
own gRPC probe cannot present a client certificate). When the service's certificate files
are set (PDSERVE_TLS_CA_FILE, PDSERVE_TLS_CERT_FILE, PDSERVE_TLS_KEY_FILE, as in its own
environment) the probe speaks mutual TLS with them. The gateway's client port is not an
internal hop: probe it with ``--plaintext``, or ``--ca FILE`` when it serves TLS
(client_tls_cert_file; a port that also requires client certificates cannot be probed
this way).
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(address: str, files: tuple[str, str, str] | None,
             server_ca: str = "") -> grpc.Channel:
    if server_ca:
        with open(server_ca, "rb") as f:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
    if not files:
        return grpc.insecure_channel(address)
    from services.tls import CLUSTER_NAME
    ca, cert, key = (open(f, "rb").read() for f in files)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert),
                               options=[("grpc.ssl_target_name_override", CLUSTER_NAME)])


def tls_files() -> tuple[str, str, str] | None:
    """The service's certificate files from its environment (None when unset)."""
    from pdcore.config_tree import environ
    env = environ()
    files = tuple(env.get(f"PDSERVE_TLS_{n}_FILE", "") for n in ("CA", "CERT", "KEY"))
    return files if all(files) else None


def check(address: str, service: str = "", timeout_s: float = 3.0,
          files: tuple[str, str, str] | None = None, server_ca: str = "") -> str:
    """The health status name of ``service`` at ``address`` (or the gRPC error code name);
    ``files``: (CA, certificate, key) for mutual TLS; ``server_ca``: TLS to a port that
    does not ask for a client certificate, verified against that CA."""
    with _channel(address, files, server_ca) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.healthcheck")
    p.add_argument("address", help="HOST:PORT of the service")
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--plaintext", action="store_true",
                   help="no TLS (the gateway's client port without client_tls_cert_file)")
    p.add_argument("--ca", default="", help="TLS verified against this CA, no client "
                   "certificate (the gateway's client port with client_tls_cert_file)")
    a = p.parse_args(argv)
    files = None if a.plaintext or a.ca else tls_files()
    status = check(a.address, a.service, a.timeout, files, a.ca)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
