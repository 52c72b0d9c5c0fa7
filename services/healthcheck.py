"""Probe a service's ``grpc.health.v1.Health``: exit 0 when SERVING, 1 otherwise.

    python -m services.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

Used by docker-compose healthchecks (Kubernetes uses its native gRPC probes instead).
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name of ``service`` at ``address`` (or the gRPC error code name)."""
    with grpc.insecure_channel(address) as ch:
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
    a = p.parse_args(argv)
    status = check(a.address, a.service, a.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
